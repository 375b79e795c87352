"""SGLang 0.5.20's real pools and requests, driven the way its scheduler drives a tree cache.

:class:`CacheDriver` runs requests through either cache (ours or upstream's ``MambaRadixCache``) with SGLang's own
code wherever it exists: ``Req.init_next_round_input`` (the match with copy-on-write), ``alloc_req_slots``,
``alloc_token_slots`` / ``alloc_paged_token_slots_extend`` / ``alloc_paged_token_slots_decode`` (which evict
through the cache), ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`` (the extra-buffer tracking
decision), ``maybe_cache_unfinished_req`` and ``release_kv_cache``. What stands in for the model is a state
fingerprint: every forward writes ``(length, crc)`` of the tokens it has consumed into the request's state slot
(and into the ping-pong track slot SGLang chose), and every forward first checks that the slot holds the
fingerprint of the prefix it resumes from. A wrong copy-on-write, a state inserted at the wrong length or a slot
freed while in use therefore fails the next forward, and :func:`check_tree_states` checks every cached state.
"""

from __future__ import annotations

import itertools
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

CHUNK = 4  # mamba cache chunk size: small, so that branch points fall inside short sequences
TRACK_INTERVAL = 8  # --mamba-track-interval


@contextmanager
def sglang_config(*, page_size: int = 1, chunk: int = CHUNK, track_interval: int = TRACK_INTERVAL) -> Iterator[Any]:
    """Publishes a dummy-model SGLang configuration with the given page size, mamba chunk and track interval;
    yields the published ServerArgs."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(
        page_size=page_size, _mamba_cache_chunk_size=max(chunk, page_size), mamba_track_interval=track_interval
    )
    published = override.install()
    try:
        yield published
    finally:
        override.restore()


def fingerprint(tokens: Sequence[int]) -> torch.Tensor:
    """What the stand-in model leaves in a state slot after consuming ``tokens`` (exact in float32)."""
    crc = zlib.crc32(array("q", tokens).tobytes()) & 0xFFFFFF
    return torch.tensor([float(len(tokens)), float(crc)])


@dataclass(frozen=True)
class PoolSetup:
    kv_tokens: int = 512
    states: int = 32
    rows: int = 8
    max_context: int = 512
    page_size: int = 1
    extra_buffer: bool = False
    overlap: bool = True  # two ping-pong track slots per request (one without overlap scheduling)


def build_pools(setup: PoolSetup) -> tuple[Any, Any]:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=1, n_groups=1, num_heads=1, head_dim=1, state_size=2, conv_kernel=2
    )
    params = Mamba2CacheParams(
        shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32)
    )
    pool = HybridReqToTokenPool(
        size=setup.rows,
        mamba_size=setup.states,
        mamba_spec_state_size=setup.rows,
        max_context_len=setup.max_context,
        device="cpu",
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=[0],
        enable_mamba_extra_buffer=setup.extra_buffer,
        enable_overlap_schedule=setup.overlap,
    )
    if setup.page_size == 1:
        allocator = TokenToKVPoolAllocator(setup.kv_tokens, torch.float16, "cpu", None, False)
    else:
        allocator = PagedTokenToKVPoolAllocator(setup.kv_tokens, setup.page_size, torch.float16, "cpu", None, False)
    return pool, allocator


def cache_params(setup: PoolSetup, pool: Any, allocator: Any) -> Any:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return CacheInitParams(
        disable=False,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        page_size=setup.page_size,
        enable_mamba_extra_buffer=setup.extra_buffer,
    )


def make_ours(params: Any, backend: str = "mamba-radix", **settings: Any) -> Any:
    """Our cache for ``backend``; FLOP-aware eviction uses the bundled Qwen3-Next cost model."""
    from hybrid_prefix_cache.adapters.sglang.cache import HybridPrefixCache
    from hybrid_prefix_cache.adapters.sglang.settings import PrefixCacheSettings
    from hybrid_prefix_cache.cost_model import load_model_spec
    from hybrid_prefix_cache.registry import resolve_backend

    chosen = resolve_backend(backend)
    settings_object = PrefixCacheSettings.from_mapping(settings)
    spec = load_model_spec("qwen3-next-80b-a3b") if chosen.eviction == "flop-aware" else None
    eviction = chosen.make_eviction(spec, settings_object.alpha) if spec is not None else None
    return HybridPrefixCache(params, backend=chosen, eviction=eviction, settings=settings_object, model_spec=spec)


def make_upstream(params: Any) -> Any:
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

    return MambaRadixCache(params)


def tree_states(cache: Any) -> list[tuple[tuple[int, ...], int]]:
    """(path tokens, state slot) of every cached state, for ours and for upstream's tree."""
    from hybrid_prefix_cache.adapters.sglang.cache import HybridPrefixCache

    found = []
    if isinstance(cache, HybridPrefixCache):
        stack = [(node, ()) for node in cache.tree.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + tuple(node.key)
            if node.state is not None:
                found.append((path, int(node.state[0])))
            stack.extend((child, path) for child in node.children.values())
    else:
        stack = [(node, ()) for node in cache.root_node.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + tuple(node.key.token_ids)
            if node.mamba_value is not None:
                found.append((path, int(node.mamba_value[0])))
            stack.extend((child, path) for child in node.children.values())
    return found


@dataclass
class CacheDriver:
    """One cache with its own pools, and the scheduler's calls for each request step (see the module docstring).

    ``run`` serves a whole request; ``admit`` / ``prefill`` / ``decode`` / ``finish`` / ``abort`` interleave
    requests as a batch would.
    """

    setup: PoolSetup
    make_cache: Callable[[Any], Any]
    cache: Any = field(init=False)
    hits: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        from sglang.srt.runtime_context import mamba_track_grid

        self.pool, self.allocator = build_pools(self.setup)
        self.cache = self.make_cache(cache_params(self.setup, self.pool, self.allocator))
        self.initial_free = (self.allocator.available_size(), self.pool.mamba_allocator.available_size(),
                             self.pool.available_size())
        self.track_grid = mamba_track_grid(self.setup.page_size)
        self._rids = itertools.count()
        self._outputs: dict[str, list[int]] = {}
        self._chunks: dict[str, int | None] = {}
        self._fill_len: dict[str, int] = {}
        self.in_flight: dict[str, Any] = {}
        self._batch = SimpleNamespace(
            tree_cache=self.cache,
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace(mamba_chunk_size=CHUNK)),
            req_to_token_pool=self.pool,
        )

    # ------------------------------------------------------------------ state slots (the stand-in model)

    def _state(self, slot: Any) -> torch.Tensor:
        return self.pool.mamba_pool.mamba_cache.temporal[0, int(slot), 0, 0, :]

    def _write_state(self, slot: Any, tokens: Sequence[int]) -> None:
        self.pool.mamba_pool.mamba_cache.temporal[0, int(slot), 0, 0, :] = fingerprint(tokens)

    def _expect_state(self, req: Any, length: int, when: str) -> None:
        tokens = self.tokens(req)[:length]
        expected = fingerprint(tokens) if length else torch.zeros(2)
        got = self._state(req.kv.mamba_pool_idx)
        assert torch.equal(got, expected), (
            f"{req.rid} {when}: its state slot holds (len, crc) {got.tolist()}, expected {expected.tolist()}"
        )

    @staticmethod
    def tokens(req: Any) -> list[int]:
        return list(req.origin_input_ids) + list(req.output_ids)

    # ------------------------------------------------------------------ request steps

    def new_request(self, tokens: Sequence[int], outputs: Sequence[int], *, extra_key: str | None = None) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        if not outputs:
            raise ValueError("a request needs at least one output token")
        req = Req(f"r{next(self._rids)}", "", array("q", tokens), SamplingParams(max_new_tokens=len(outputs)))
        req.extra_key = extra_key
        self._outputs[req.rid] = list(outputs)
        return req

    def match(self, req: Any) -> int:
        """The scheduler's admission match (with copy-on-write) inside its slot group; no lock yet."""
        mamba_allocator = self.pool.mamba_allocator
        mamba_allocator.alloc_group_begin(1)
        try:
            req.init_next_round_input(self.cache)
        finally:
            mamba_allocator.alloc_group_end()
        return len(req.prefix_indices)

    def reject(self, req: Any) -> None:
        """The scheduler did not add the matched request: it hands the copy-on-write slot back."""
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = False
        if req.kv.holds_mamba:
            self.pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None

    def admit(self, req: Any, chunk: int | None = None) -> int:
        """Match and lock (``PrefillAdder.add_one_req``); returns the hit."""
        hit = self.match(req)
        req.lock_receipt = self.cache.inc_lock_ref(req.last_node).to_dec_params()
        self._chunks[req.rid] = chunk
        # A retracted request comes back with its outputs so far: they are prefilled too.
        self._fill_len[req.rid] = len(req.origin_input_ids) + len(req.output_ids)
        req.set_extend_range(hit, self._chunk_end(hit, self._fill_len[req.rid], chunk))
        self.in_flight[req.rid] = req
        self.hits.append(hit)
        return hit

    @staticmethod
    def _chunk_end(start: int, input_len: int, chunk: int | None) -> int:
        return input_len if chunk is None else min(input_len, start + chunk)

    def prefill(self, req: Any) -> bool:
        """One extend (a chunk or the rest of the input); True once the whole input is prefilled."""
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

        start, end = req.extend_range.start, req.extend_range.end
        self._allocate_extend(req, start, end)
        self._forward_extend(req, start, end)
        input_len = self._fill_len[req.rid]
        if end < input_len:
            maybe_cache_unfinished_req(req, self.cache, chunked=True)
            self._expect_prefix_is_row(req, end)
            next_start = len(req.prefix_indices)
            req.set_extend_range(next_start, self._chunk_end(next_start, input_len, self._chunks[req.rid]))
            return False
        planned = self._outputs[req.rid]
        req.output_ids.append(planned[len(req.output_ids)])
        if len(req.output_ids) < len(planned):
            maybe_cache_unfinished_req(req, self.cache)
            self._expect_prefix_is_row(req, end)
        return True

    def _expect_prefix_is_row(self, req: Any, fill_len: int) -> None:
        """After ``cache_unfinished_req`` the request's prefix indices are its KV row: the next chunk and the
        decode build on them, and the row is what the forward reads."""
        row = self.pool.req_to_token[req.kv.req_pool_idx, :fill_len].to(torch.int64)
        assert torch.equal(req.prefix_indices, row), (
            f"{req.rid}: prefix indices {req.prefix_indices.tolist()} differ from its KV row {row.tolist()}"
        )

    def _allocate_extend(self, req: Any, start: int, end: int) -> None:
        from sglang.srt.mem_cache.allocation import (
            alloc_paged_token_slots_extend,
            alloc_req_slots,
            alloc_token_slots,
        )

        alloc_req_slots(self.pool, [req], self.cache)
        if self.setup.page_size == 1:
            locations = alloc_token_slots(self.cache, end - start)
        else:
            last = req.prefix_indices[-1:] if start else torch.full((1,), -1, dtype=torch.int64)
            locations = alloc_paged_token_slots_extend(
                self.cache, torch.tensor([start]), torch.tensor([start]), torch.tensor([end]), torch.tensor([end]),
                last.to(torch.int64), end - start,
            )
        row = req.kv.req_pool_idx
        self.pool.write((row, slice(0, start)), req.prefix_indices)
        self.pool.write((row, slice(start, end)), locations)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end

    def _forward_extend(self, req: Any, start: int, end: int) -> None:
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        live = req.kv.mamba_pool_idx
        if req.kv.mamba_cow_src_index is not None:
            self.pool.mamba_pool.copy_from(req.kv.mamba_cow_src_index, live.view(1))
            req.kv.mamba_cow_src_index = None
            req.kv.mamba_needs_clear = False
        elif req.kv.mamba_needs_clear:
            self.pool.mamba_pool.mamba_cache.temporal[:, int(live)] = 0
            req.kv.mamba_needs_clear = False
        self._expect_state(req, start, f"extend from {start}")
        if self.setup.extra_buffer:
            entry = ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend(self._batch, req)
            if entry.track_mask:
                self._write_state(entry.track_index, self.tokens(req)[: req.kv.mamba_last_track_seqlen])
        self._write_state(live, self.tokens(req)[:end])

    def decode(self, req: Any, steps: int | None = None) -> bool:
        """Decode steps (all remaining ones by default); True when every planned output token is out."""
        from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_decode, alloc_token_slots

        planned = self._outputs[req.rid]
        remaining = len(planned) - len(req.output_ids)
        for _ in range(remaining if steps is None else min(steps, remaining)):
            seq_len = len(req.origin_input_ids) + len(req.output_ids)
            position = seq_len - 1
            row = req.kv.req_pool_idx
            if self.setup.page_size == 1:
                location = alloc_token_slots(self.cache, 1)
            else:
                last = self.pool.req_to_token[row, position - 1 : position].to(torch.int64)
                location = alloc_paged_token_slots_decode(
                    self.cache, torch.tensor([seq_len]), torch.tensor([seq_len]), last
                )
            self.pool.write((row, slice(position, seq_len)), location)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = seq_len
            self._expect_state(req, position, f"decode at {position}")
            self._write_state(req.kv.mamba_pool_idx, self.tokens(req)[:seq_len])
            if self.setup.extra_buffer and seq_len % self.track_grid == 0:
                # batch_result_processor._mamba_prefix_cache_update (non-lazy, no speculation)
                track_index = req.kv.mamba_next_track_idx
                self._write_state(req.kv.mamba_ping_pong_track_buffer[track_index], self.tokens(req)[:seq_len])
                req.kv.mamba_last_track_seqlen = seq_len
                req.kv.mamba_last_track_idx = track_index
                req.kv.mamba_next_track_idx = self.pool.get_mamba_ping_pong_other_idx(track_index)
            req.output_ids.append(planned[len(req.output_ids)])
        return len(req.output_ids) == len(planned)

    def finish(self, req: Any) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.cache)
        del self.in_flight[req.rid]

    def abort(self, req: Any) -> None:
        """Abort of an admitted request: nothing of it is cached."""
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.cache, is_insert=False)
        del self.in_flight[req.rid]

    def drop_after_failed_allocation(self, req: Any) -> None:
        """SGLang's scheduler stops when an allocation the admission budget promised fails; the tests release
        such a request by hand (its lock, state slot and row) to check what the cache left."""
        self.cache.dec_lock_ref(req.last_node, req.lock_receipt)
        self.pool.free_mamba_cache(req)
        self.pool.free(req)
        del self.in_flight[req.rid]

    def retract(self, req: Any) -> None:
        """Retraction (``schedule_batch.release_req``): released like an abort, then re-queued with its outputs."""
        self.abort(req)
        req.reset_for_retract()

    def run(self, tokens: Sequence[int], outputs: Sequence[int], *, chunk: int | None = None,
            extra_key: str | None = None) -> int:
        """A whole request: admission, every prefill chunk, every decode step, finish. Returns the hit."""
        req = self.new_request(tokens, outputs, extra_key=extra_key)
        hit = self.admit(req, chunk)
        while not self.prefill(req):
            pass
        self.decode(req)
        self.finish(req)
        return hit

    # ------------------------------------------------------------------ checks

    def check_idle(self) -> None:
        """No request in flight: every KV slot and state slot is free or cached, nothing is locked."""
        cache = self.cache
        kv = (self.allocator.available_size(), cache.full_evictable_size(), cache.full_protected_size())
        states = (self.pool.mamba_allocator.available_size(), cache.mamba_evictable_size(),
                  cache.mamba_protected_size())
        assert not self.in_flight, f"requests still in flight: {sorted(self.in_flight)}"
        assert sum(kv) == self.initial_free[0] and kv[2] == 0, f"KV (free, evictable, protected) {kv}"
        assert sum(states) == self.initial_free[1] and states[2] == 0, f"states (free, evictable, protected) {states}"
        assert self.pool.available_size() == self.initial_free[2], "request rows leaked"

    def check_tree_states(self) -> None:
        """Every cached state slot holds the fingerprint of exactly the tokens on its path."""
        for path, slot in tree_states(self.cache):
            got = self._state(slot)
            assert torch.equal(got, fingerprint(path)), (
                f"state slot {slot} cached at length {len(path)} holds (len, crc) {got.tolist()}"
            )

    def drain(self) -> None:
        """Evict everything; every KV and state slot must be back in its allocator."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.check_idle()
        self.check_tree_states()
        cache = self.cache
        cache.evict(EvictParams(num_tokens=cache.full_evictable_size(), mamba_num=cache.mamba_evictable_size()))
        assert cache.total_size() == (0, 0), f"evicting everything left {cache.total_size()} (tokens, states)"
        assert self.allocator.available_size() == self.initial_free[0], "KV slots leaked"
        assert self.pool.mamba_allocator.available_size() == self.initial_free[1], "state slots leaked"


def conversation_turns(rng: Any, turns: int, *, prefix: Sequence[int] = (), new: tuple[int, int] = (3, 20),
                       reply: tuple[int, int] = (1, 12), vocab: int = 1000) -> list[tuple[list[int], list[int]]]:
    """(input, output) of each turn of one session: turn k+1's input is turn k's input + output + a message."""
    history = list(prefix)
    session = []
    for _ in range(turns):
        prompt = history + [rng.randrange(1, vocab) for _ in range(rng.randint(*new))]
        output = [rng.randrange(1, vocab) for _ in range(rng.randint(*reply))]
        session.append((prompt, output))
        history = prompt + output
    return session


class HfConfigStandIn:
    """What the cache factory reads from ``ModelConfig.hf_config``: ``to_dict()`` (a bundled model's config)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config

    def to_dict(self) -> dict[str, Any]:
        return dict(self._config)


def bundled_hf_config(name: str = "qwen3-next-80b-a3b") -> dict[str, Any]:
    import json
    from importlib import resources

    return json.loads((resources.files("hybrid_prefix_cache") / "models" / f"{name}.json").read_text())


def tree_cache_context(setup: PoolSetup, server_args: Any, *, hybrid_ssm: bool = True,
                       hf_config: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """A ``TreeCacheBuildContext`` as ``kv_cache_builder`` builds it, over real pools (hybrid or plain)."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    if hybrid_ssm:
        pool, allocator = build_pools(setup)
    else:
        pool = ReqToTokenPool(size=setup.rows, max_context_len=setup.max_context, device="cpu",
                              enable_memory_saver=False)
        allocator = TokenToKVPoolAllocator(setup.kv_tokens, torch.float16, "cpu", None, False)
    fields = {
        "server_args": server_args,
        "params": cache_params(setup, pool, allocator),
        "is_hybrid_swa": False,
        "is_hybrid_ssm": hybrid_ssm,
        "enable_hierarchical_cache": False,
        "disable_radix_cache": False,
        "effective_chunked_prefill_size": 8192,
        "tp_worker": None,
        "model_config": SimpleNamespace(model_path="stand-in",
                                        hf_config=HfConfigStandIn(hf_config or bundled_hf_config())),
        "tp_size": 1,
        "tp_rank": 0,
        "tp_group": None,
    }
    fields.update(overrides)
    return TreeCacheBuildContext(**fields)


def build_in_scheduler_process(records: list[Any], results: Any) -> None:
    """Target of a spawned process: what ``run_scheduler_process`` does before the scheduler builds its tree
    cache (``load_plugins()``, ``publish(server_args, role="scheduler")``), then SGLang's ``create_tree_cache``
    for each parsed ServerArgs record. Reports what was built on ``results``."""
    import traceback

    try:
        from sglang.srt.mem_cache.registry import create_tree_cache, registered_radix_cache_backends
        from sglang.srt.plugins import load_plugins
        from sglang.srt.runtime_context import get_server_args, publish

        registered_before = registered_radix_cache_backends()
        load_plugins()
        report = {"registered_before": registered_before, "registered": registered_radix_cache_backends(),
                  "caches": []}
        for server_args in records:
            publish(server_args, role="scheduler")
            cache = create_tree_cache(tree_cache_context(PoolSetup(), get_server_args()))
            report["caches"].append({
                "class": type(cache).__name__,
                "backend": getattr(getattr(cache, "backend", None), "name", None),
                "eviction": type(cache.tree.eviction).__name__ if hasattr(cache, "tree") else None,
                "settings": cache.settings.to_dict() if hasattr(cache, "settings") else None,
            })
        results.put(report)
    except BaseException:
        results.put({"error": traceback.format_exc()})
