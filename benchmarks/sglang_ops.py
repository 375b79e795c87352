"""Cost of the prefix-cache operations inside SGLang 0.5.20: ours (``mamba-radix``) against upstream's MambaRadixCache.

Run in .venvs/sglang:  .venvs/sglang/bin/python benchmarks/sglang_ops.py [--trace default] [--cache-gb 2] [--repeat 3]

Both caches serve the same stream of scheduler calls, built from a multi-turn trace one request at a time with
SGLang's own code (``hybrid_prefix_cache.bench.engines.sglang_replay.run_request``: the admission match with
copy-on-write, the lock, the slot and KV allocations that evict through the cache, the insert after prefill, the
decode allocations, the insert at finish). Each cache has its own real pools of the same size (paper-7b sizes by
default, no-buffer strategy, page size 1). Requests alternate which cache goes first, in one process, so both see
the same machine conditions.

Measured: the CPU time of the calling thread (``time.thread_time``, so that other processes on a busy machine do
not count; torch runs on one thread here) spent inside the cache's methods the scheduler calls (``match_prefix``,
``inc_lock_ref``, ``dec_lock_ref``, ``cache_unfinished_req``, ``cache_finished_req``, ``evict``,
``evict_for_alloc``; a call made by another of them is counted once, in the outer one), over ``--rounds`` rounds
with fresh caches; the figure is the median of the rounds' ratios. Not measured: the pools, the request objects,
the driver. The per-request hits of both caches are compared: when they agree the two served the identical
operation stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybrid_prefix_cache.bench.engines.sglang_replay import (
    GIB,
    ReplayCache,
    build_upstream_cache,
    check_sglang_version,
    pool_sizes,
    run_request,
    sglang_runtime_context,
    upstream_mamba_full_memory_ratio,
)
from hybrid_prefix_cache.bench.traces import Request, load_trace

TIMED_METHODS = (
    "match_prefix",
    "inc_lock_ref",
    "dec_lock_ref",
    "cache_unfinished_req",
    "cache_finished_req",
    "evict",
    "evict_for_alloc",
)
POOL_METHODS = (
    "alloc", "free", "free_segment", "write", "copy_from", "free_mamba_cache", "donate_mamba_ping_pong_slot",
)
PAPER_7B_KV_BYTES_PER_TOKEN = 4 * 2 * 4096 * 2
PAPER_7B_STATE_BYTES = 24 * 1_099_264


class MethodTimer:
    """Wraps a cache instance's scheduler-facing methods and adds up the time spent in the outermost calls.

    With :meth:`attach_pools`, it also adds up, separately, the part of that time spent in SGLang's pools and
    allocators (state copies, slot and KV frees and allocations, row writes): work that any cache must have done
    for the same decisions.
    """

    def __init__(self, cache: Any) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.pool_seconds = 0.0
        self._depth = 0
        self._pool_depth = 0
        for name in TIMED_METHODS:
            setattr(cache, name, self._timed(name, getattr(cache, name)))

    def attach_pools(self, *pools: Any) -> None:
        for pool in pools:
            for name in POOL_METHODS:
                method = getattr(pool, name, None)
                if method is not None:
                    setattr(pool, name, self._pool_timed(method))

    def _pool_timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._depth or self._pool_depth:
                return method(*args, **kwargs)
            self._pool_depth += 1
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.pool_seconds += time.thread_time() - started
                self._pool_depth -= 1

        return timed

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - started
                self.calls[name] += 1
                self._depth -= 1

        return timed

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def build_caches(sizes: Any, context_len: int) -> dict[str, ReplayCache]:
    """Upstream's cache and ours, each over its own freshly built pools of the same geometry."""
    from hybrid_prefix_cache.adapters.sglang.cache import HybridPrefixCache
    from hybrid_prefix_cache.registry import resolve_backend

    upstream = build_upstream_cache(sizes, context_len)
    pools = build_upstream_cache(sizes, context_len)
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    ours = HybridPrefixCache(
        CacheInitParams(disable=False, req_to_token_pool=pools.req_to_token_pool,
                        token_to_kv_pool_allocator=pools.kv_allocator, page_size=sizes.page_size),
        backend=resolve_backend("mamba-radix"),
    )
    return {
        "upstream": upstream,
        "ours": ReplayCache(tree=ours, req_to_token_pool=pools.req_to_token_pool, kv_allocator=pools.kv_allocator,
                              sizes=sizes),
    }


def replay(requests: Sequence[Request], cache_bytes: int, repeat: int) -> dict[str, Any]:
    check_sglang_version()
    stream = [request for _ in range(repeat) for request in sorted(requests, key=lambda r: r.ts)]
    context_len = max(len(r.input_tokens) + len(r.output_tokens) for r in stream) + 8
    sizes = pool_sizes(cache_bytes, PAPER_7B_KV_BYTES_PER_TOKEN, PAPER_7B_STATE_BYTES,
                       mamba_full_memory_ratio=upstream_mamba_full_memory_ratio(), context_len=context_len)
    with sglang_runtime_context():
        caches = build_caches(sizes, context_len)
        timers = {name: MethodTimer(cache.tree) for name, cache in caches.items()}
        for name, cache in caches.items():
            pool = cache.req_to_token_pool
            timers[name].attach_pools(pool, pool.mamba_pool, pool.mamba_allocator, cache.kv_allocator)
        hits: dict[str, list[int]] = {name: [] for name in caches}
        order = list(caches)
        for index, request in enumerate(stream):
            for name in order if index % 2 == 0 else reversed(order):
                hits[name].append(run_request(caches[name], request, rid=f"{name}-{index}"))
        for cache in caches.values():
            cache.check_idle("at the end of the replay")
        evictions = {name: cache.tree.full_evictable_size() for name, cache in caches.items()}
    return {"sizes": sizes, "requests": len(stream), "timers": timers, "hits": hits, "resident_tokens": evictions}


def _add(totals: dict[str, dict[str, float]], pool_totals: dict[str, float], timers: dict[str, MethodTimer]) -> None:
    for name, timer in timers.items():
        for method, seconds in timer.seconds.items():
            totals[name][method] += seconds
        pool_totals[name] += timer.pool_seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="default", help="a trace name or JSONL file (bench.traces.load_trace)")
    parser.add_argument("--cache-gb", type=float, default=2.0, help="GiB for KV + states (paper-7b sizes)")
    parser.add_argument("--repeat", type=int, default=3, help="serve the trace this many times in a row per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each with fresh caches")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.rounds < 1 or args.cache_gb <= 0:
        parser.error("--repeat and --rounds must be >= 1 and --cache-gb > 0")
    torch.set_num_threads(1)

    requests = load_trace(args.trace)
    totals: dict[str, dict[str, float]] = {"upstream": defaultdict(float), "ours": defaultdict(float)}
    pool_totals: dict[str, float] = {"upstream": 0.0, "ours": 0.0}
    ratios = []
    for _ in range(args.rounds):
        result = replay(requests, int(args.cache_gb * GIB), args.repeat)
        timers, hits = result["timers"], result["hits"]
        _add(totals, pool_totals, timers)
        ratios.append(timers["upstream"].total / timers["ours"].total)
    sizes, count = result["sizes"], result["requests"] * args.rounds
    print(f"trace {args.trace} x{args.repeat}, {args.rounds} rounds: {count} requests; pools: "
          f"{sizes.max_total_num_tokens} KV tokens, {sizes.max_mamba_cache_size} state slots")
    print(f"{'method':<22}{'upstream us/req':>17}{'ours us/req':>13}{'ratio':>8}")
    for name in TIMED_METHODS:
        up, ours = totals["upstream"][name], totals["ours"][name]
        if up or ours:
            print(f"{name:<22}{up / count * 1e6:>17.1f}{ours / count * 1e6:>13.1f}"
                  f"{(up / ours if ours else float('inf')):>8.2f}")
    per_request = {name: sum(total.values()) / count * 1e6 for name, total in totals.items()}
    pools = {name: seconds / count * 1e6 for name, seconds in pool_totals.items()}
    print(f"per request: upstream {per_request['upstream']:.0f} us, ours {per_request['ours']:.0f} us; of which in "
          f"SGLang's pools and allocators: upstream {pools['upstream']:.0f} us, ours {pools['ours']:.0f} us")
    logic = {name: per_request[name] - pools[name] for name in per_request}
    print(f"cache logic alone (the rest): upstream {logic['upstream']:.0f} us, ours {logic['ours']:.0f} us, "
          f"ratio {logic['upstream'] / logic['ours']:.2f}x")
    same = hits["upstream"] == hits["ours"]
    print(f"token hits per round: upstream {sum(hits['upstream'])}, ours {sum(hits['ours'])} "
          f"({'identical per request' if same else 'per-request hits differ'})")
    print(f"cost ratio upstream / ours: median {statistics.median(ratios):.2f}x over {args.rounds} rounds "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
