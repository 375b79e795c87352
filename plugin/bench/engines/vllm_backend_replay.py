"""Model-free replay of a trace through vLLM's real scheduler with a hybrid-prefix-cache backend.

It runs :mod:`hybrid_prefix_cache.bench.engines.vllm_replay` (same engine configuration, KV-cache sizing,
scheduler and stand-in runner: see that module for what is real and what stands in) after
:func:`hybrid_prefix_cache.adapters.vllm.install` has made ``backend`` the backend of the scheduler it builds;
``backend = None`` (``vllm`` on the command line) is vLLM's own prefix cache. Besides the hit rates it reports
what the backend did: the alpha the FLOP-aware eviction ended with, every re-tune of the guarded tuner (hits of
each alpha on the shadow replay of its window) and how each overwritten cached block was chosen.

Run ``python -m hybrid_prefix_cache.bench.engines.vllm_backend_replay --help`` in ``.venvs/vllm``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybrid_prefix_cache.bench.engines import parse_budgets, vllm_replay
from hybrid_prefix_cache.bench.engines.vllm_replay import GIB, EngineOptions, TraceRequest

VLLM_DEFAULT = "vllm"


def _backend_report(scheduler: Any) -> dict[str, Any]:
    from hybrid_prefix_cache.adapters.vllm.engine import SCHEDULER_ATTRIBUTE
    from hybrid_prefix_cache.adapters.vllm.pool import HybridBlockPool

    report: dict[str, Any] = {"backend": getattr(scheduler, SCHEDULER_ATTRIBUTE, None) or VLLM_DEFAULT}
    pool = scheduler.kv_cache_manager.block_pool
    if isinstance(pool, HybridBlockPool):
        report["evicted_blocks_by_reason"] = dict(pool.evictions)
        if pool.tuner is not None:
            report["alpha"] = pool.tuner.alpha
            report["retunes"] = [
                {"after_requests": record.request_index, "alpha": record.alpha, "shadow_hits": record.hits}
                for record in pool.tuner.history
            ]
    return report


def replay_with_backend(
    requests: Sequence[TraceRequest],
    hf_config: dict[str, Any],
    cache_bytes: int,
    backend: str | None,
    *,
    max_concurrency: int = 1,
    options: EngineOptions | None = None,
    on_scheduler: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` like :func:`vllm_replay.replay`, with ``backend`` (None: vLLM's own cache).

    ``on_scheduler`` receives vLLM's scheduler once it is built, before the replay (to inspect it later)."""
    from hybrid_prefix_cache.adapters.vllm import install

    vllm_replay._check_inputs(requests, hf_config, cache_bytes, max_concurrency)
    vllm = vllm_replay._import_vllm()
    options = options or EngineOptions()
    install(backend)
    try:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="hpc-vllm-backend-replay-") as model_dir:
            (Path(model_dir) / "config.json").write_text(json.dumps(hf_config), encoding="utf-8")
            max_model_len = vllm_replay._max_model_len(requests)
            vllm_config = vllm_replay._engine_config(Path(model_dir), max_model_len, cache_bytes, options)
            specs = vllm_replay._kv_cache_specs(vllm_config)
        setup = vllm_replay._kv_cache_setup(vllm_config, specs, cache_bytes)
        scheduler = vllm_replay._build_scheduler(vllm_config, setup)
    finally:
        install(None)
    if on_scheduler is not None:
        on_scheduler(scheduler)
    pool = scheduler.kv_cache_manager.block_pool
    free_blocks_initial = pool.get_num_free_blocks()
    setup_s = time.perf_counter() - started
    tally = vllm_replay._drive(
        scheduler, setup.hash_block_size, vllm_config.cache_config.prefix_caching_hash_algo, requests, max_concurrency
    )
    geometry = vllm_replay._geometry(setup)
    return {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        **_backend_report(scheduler),
        "cache_bytes": cache_bytes,
        "block_size": geometry["block_size"],
        "num_blocks": geometry["num_blocks"],
        "blocks_per_state": geometry["blocks_per_state"],
        "requests": len(tally.per_request),
        "prompt_tokens": tally.prompt_tokens,
        "cached_tokens": tally.cached_tokens,
        "token_hit_rate": tally.cached_tokens / tally.prompt_tokens,
        "request_hit_rate": tally.requests_with_hit / len(tally.per_request),
        "preemptions": tally.preemptions,
        "free_blocks_initial": free_blocks_initial,
        "free_blocks_final": pool.get_num_free_blocks(),
        "setup_s": round(setup_s, 3),
        "replay_s": round(time.perf_counter() - started - setup_s, 3),
        "per_request": tally.per_request,
    }


def _parse_backends(text: str) -> list[str | None]:
    from hybrid_prefix_cache.adapters.vllm.settings import settings_for_name

    backends: list[str | None] = []
    for item in text.split(","):
        name = item.strip()
        if name == VLLM_DEFAULT:
            backends.append(None)
            continue
        try:
            settings_for_name(name, source="--backends")
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        backends.append(name)
    return backends


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybrid_prefix_cache.bench.engines.vllm_backend_replay",
        description="Replay a JSONL trace through vLLM's scheduler with hybrid-prefix-cache backends (no model).",
    )
    parser.add_argument("--trace-jsonl", type=Path, required=True, help="trace (see bench/traces.py)")
    parser.add_argument("--model-config", type=Path, required=True, help="Hugging Face config.json of the model")
    parser.add_argument("--cache-gb", type=parse_budgets, required=True, help="budgets in GiB, e.g. 1,5")
    parser.add_argument(
        "--backends", type=_parse_backends, default=[None, "marconi"],
        help=f"comma-separated backends; '{VLLM_DEFAULT}' is vLLM's own prefix cache (default: vllm,marconi)",
    )
    parser.add_argument("--json", type=Path, help="write all results to this file")
    parser.add_argument("--max-concurrency", type=int, default=1, help="requests in flight (default 1)")
    parser.add_argument("--block-size", type=int, help="vLLM --block-size (default: the platform's)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="prefill chunk budget (default: vLLM's)")
    parser.add_argument("--mamba-ssm-cache-dtype", help="vLLM --mamba-ssm-cache-dtype (default: the model's)")
    parser.add_argument("--additional-config", type=vllm_replay._parse_json_object, help="more --additional-config")
    parser.add_argument("--per-request", action="store_true", help="keep per-request hits in the JSON output")
    args = parser.parse_args(argv)

    from hybrid_prefix_cache.bench.traces import read_jsonl_trace

    requests = read_jsonl_trace(args.trace_jsonl)
    hf_config = vllm_replay._read_hf_config(args.model_config)
    options = EngineOptions(
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        additional_config=args.additional_config,
    )
    runs = []
    print(f"{'cache GiB':>9} {'backend':>14} {'block':>5} {'blocks':>6} {'token hit':>9} {'req hit':>7} "
          f"{'alpha':>5} {'retunes':>7} {'s':>6}")
    for cache_bytes in args.cache_gb:
        for backend in args.backends:
            result = replay_with_backend(
                requests, hf_config, cache_bytes, backend, max_concurrency=args.max_concurrency, options=options
            )
            if not args.per_request:
                del result["per_request"]
            runs.append(result)
            alpha = result.get("alpha")
            print(
                f"{cache_bytes / GIB:9.2f} {result['backend']:>14} {result['block_size']:5d} {result['num_blocks']:6d} "
                f"{result['token_hit_rate']:9.4f} {result['request_hit_rate']:7.3f} "
                f"{'-' if alpha is None else f'{alpha:g}':>5} {len(result.get('retunes', [])):7d} "
                f"{result['setup_s'] + result['replay_s']:6.1f}",
                flush=True,
            )
    if args.json:
        report = {"trace": str(args.trace_jsonl), "model_config": str(args.model_config), "runs": runs}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
