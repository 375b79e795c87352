"""Model-free replay of a request trace through SGLang 0.5.20's real ``MambaRadixCache`` (``--engine sglang``),
or through one of our backends (``HybridPrefixCache`` over the same pools, as SGLang's factory builds it).

What is real: ``sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache`` (match, split, insert, lock, LRU
and eviction), its pools built on device ``cpu`` (``HybridReqToTokenPool`` with its ``MambaPool`` and
``MambaSlotAllocator``, ``TokenToKVPoolAllocator``), the request object (``schedule_batch.Req`` with its
``ReqKvInfo``), and the scheduler's own cache calls, in the order the scheduler makes them for one request:

1. ``Req.init_next_round_input(tree_cache)``: ``match_prefix`` with ``cow_mamba=True`` and the scheduler's key
   limit of ``input_len - 1``, bracketed by ``mamba_allocator.alloc_group_begin(1)`` / ``alloc_group_end()``
   as ``Scheduler._get_new_batch_prefill`` does; then ``inc_lock_ref(req.last_node)`` and
   ``set_extend_range(prefix_len, input_len)`` as ``PrefillAdder.add_one_req`` does.
2. ``alloc_req_slots`` (mem_cache/allocation.py): evicts states until ``MAMBA_STATE_PER_REQ_PREFIX_CACHE`` (3)
   slots per admitted request are free, then takes a request row and a state slot unless the match already
   gave the request one; ``alloc_token_slots`` takes the KV for the uncached input, evicting the shortfall
   through the cache (``evict_from_tree_cache``); the row of ``req_to_token`` is written as
   ``write_cache_indices`` would.
3. After prefill the first reply token is appended; unless the request is finished (a reply of at most one
   token) ``maybe_cache_unfinished_req`` inserts the input with a copy of the state (no-buffer strategy).
4. Decode: the KV for reply tokens ``0 .. n-2`` (the last token's KV is never computed) is taken with
   ``alloc_token_slots``. The scheduler takes it one token per step; with one request in flight the tree does
   not change between steps, so one allocation evicts the same LRU leaves as ``n - 1`` single-token ones.
5. ``release_kv_cache`` (mem_cache/common.py): ``cache_finished_req(kv_len_to_handle=input_len + n - 1)``
   inserts input + reply[:-1] and donates the request's state slot, then the row is freed.

The hit of a request is ``len(req.prefix_indices)`` after step 1: the KV the request reuses, which ends at
the deepest matched node that still holds a state. ``token_hit_rate`` = sum of hits / sum of input tokens,
``request_hit_rate`` = share of requests with a hit. States evicted = states the tree admitted (inserts that
did not find the state already there) minus the states it still holds at the end. Requests run one at a time
in ``ts`` order (a session's turns are in order in any valid trace), so ``ts`` only orders them. A turn's
reply is taken from the trace, so turn ``k+1``'s input extends turn ``k``'s input and reply when the trace
was built that way.

What stands in: the model. No forward runs: the deferred copy-on-write of a matched state
(``req.kv.mamba_cow_src_index``) is never executed, and the state tensors are tiny (one Mamba2 layer with
every dimension 1), because only slot counts matter. The KV allocator has no KV buffer behind it.

Memory model (SGLang 0.5.20, static pools, no speculative decoding, no pipeline parallelism):
``cache_bytes`` plays the part of ``rest_memory``, the device memory left for the KV cache and the states
after the weights (``KVCacheConfigurator._profile_available_bytes``). ``_handle_max_mamba_cache``
(mem_cache/kv_cache_configurator.py) gives the states ``ratio / (1 + ratio)`` of it, with ``ratio`` =
``--mamba-full-memory-ratio`` (its resolution fallback is 0.9, arg_groups/fields/schedule.py), in GiB::

    mamba_budget_bytes   = cache_bytes * ratio / (1 + ratio)
    max_mamba_cache_size = int((mamba_budget_bytes - state_bytes) // state_bytes)   # minus the pool's padding slot
    kv_budget_bytes      = int(cache_bytes - (max_mamba_cache_size + 1) * state_bytes)
    max_total_num_tokens = kv_budget_bytes // kv_bytes_per_token // page_size * page_size  # DefaultPoolConfigurator

``state_bytes`` is ``mamba_cache_per_req`` (conv + SSM state of every Mamba layer, e.g. 24 x 1,099,264 bytes
for the paper's 7B) and ``kv_bytes_per_token`` the KV of one token over the attention layers (4 x 2 x 4096 x 2
= 65,536 bytes for the same model). ``resolve_max_num_reqs`` caps the running requests at
``max_mamba_cache_size // 3`` (``MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO``) and refuses to start when that is
0; the scheduler limits a request to ``max_req_len = min(context_len, max_total_num_tokens) - 1`` tokens and its
input to ``max_req_len - 5`` (``tp_worker.get_worker_info``, ``validate_input_length``) and clips the reply to
fit. The replay sets the context length to the longest turn, so the budget must hold every turn whole:
a budget that would refuse or clip a turn is rejected with an error naming the turn.

The no-buffer strategy is the one whose upstream ``MambaRadixCache`` path needs no model: with overlap
scheduling on, 0.5.20 resolves ``--mamba-radix-cache-strategy auto`` to ``extra_buffer`` for architectures that
support it, and its default tree cache for hybrid SSM models is ``UnifiedRadixCache``, not ``MambaRadixCache``.

Verified against sglang 0.5.20 only; other versions are refused because this drives engine internals.
Run ``python -m hybrid_prefix_cache.bench.engines.sglang_replay --help`` in ``.venvs/sglang``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import typing
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_prefix_cache.bench.engines import parse_budgets
from hybrid_prefix_cache.bench.traces import Request
from hybrid_prefix_cache.cost_model import ModelSpec

if TYPE_CHECKING:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

SUPPORTED_SGLANG_VERSION = "0.5.20"
GIB = 1 << 30
UPSTREAM = "upstream-mamba"  # the --backends name of SGLang's own MambaRadixCache
# FLA's chunk size, the value 0.5.20 uses when the model config has no mamba_chunk_size
# (arg_groups/overrides.py mamba_cache_chunk_size); only the branching point of a match depends on it.
DEFAULT_MAMBA_CHUNK_SIZE = 64
# Validation headroom between the longest request and its longest input (tp_worker.get_worker_info).
MAX_REQ_INPUT_HEADROOM = 5


TraceRequest = Request


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """The static pool geometry SGLang 0.5.20 derives from a byte budget (see the module docstring)."""

    cache_bytes: int
    kv_bytes_per_token: int
    state_bytes: int
    mamba_full_memory_ratio: float
    page_size: int
    max_mamba_cache_size: int
    max_total_num_tokens: int
    state_pool_bytes: int
    kv_pool_bytes: int
    max_running_requests: int


def pool_sizes(
    cache_bytes: int,
    kv_bytes_per_token: int,
    state_bytes: int,
    *,
    mamba_full_memory_ratio: float,
    page_size: int = 1,
    context_len: int,
    state_slots_per_running_request: int = 3,
) -> PoolSizes:
    """Splits ``cache_bytes`` between state slots and KV tokens as SGLang 0.5.20 does (static pools).

    ``state_slots_per_running_request`` is ``MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO`` (3 for the radix
    cache without the extra buffer); ``context_len`` only enters the estimate of the running-request cap.
    Raises ValueError when the budget cannot run a single request, as the server refuses to start then.
    """
    for name, value in (
        ("cache_bytes", cache_bytes),
        ("kv_bytes_per_token", kv_bytes_per_token),
        ("state_bytes", state_bytes),
        ("page_size", page_size),
        ("context_len", context_len),
        ("state_slots_per_running_request", state_slots_per_running_request),
    ):
        if type(value) is not int or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not (isinstance(mamba_full_memory_ratio, int | float) and math.isfinite(mamba_full_memory_ratio)):
        raise ValueError(f"mamba_full_memory_ratio must be a finite number, got {mamba_full_memory_ratio!r}")
    if mamba_full_memory_ratio <= 0:
        raise ValueError(f"mamba_full_memory_ratio must be positive, got {mamba_full_memory_ratio!r}")

    # Same float steps as _handle_max_mamba_cache, which works in GiB.
    rest_gib = cache_bytes / GIB
    mamba_budget_bytes = rest_gib * mamba_full_memory_ratio / (1 + mamba_full_memory_ratio) * GIB
    max_mamba_cache_size = int((mamba_budget_bytes - state_bytes) // state_bytes)
    if max_mamba_cache_size <= 0:
        raise ValueError(
            f"{cache_bytes} bytes leave {int(mamba_budget_bytes)} bytes for states at "
            f"--mamba-full-memory-ratio {mamba_full_memory_ratio}: not one {state_bytes}-byte state slot "
            "(SGLang refuses to start: 'Not enough GPU memory for hybrid state cache')"
        )
    state_pool_bytes = (max_mamba_cache_size + 1) * state_bytes
    kv_pool_bytes = max(int((rest_gib - state_pool_bytes / GIB) * GIB), 0)
    max_total_num_tokens = kv_pool_bytes // kv_bytes_per_token // page_size * page_size
    if max_total_num_tokens <= 1:
        raise ValueError(
            f"{cache_bytes} bytes leave {kv_pool_bytes} bytes of KV after {max_mamba_cache_size} state slots: "
            f"{max_total_num_tokens} tokens of {kv_bytes_per_token} bytes (SGLang refuses to start)"
        )

    # resolve_max_num_reqs, without --max-running-requests.
    estimated = max(min(int(max_total_num_tokens / context_len * 512), 4096), 2048)
    max_running_requests = min(
        estimated, max_total_num_tokens // 2, max_mamba_cache_size // state_slots_per_running_request
    )
    if max_running_requests <= 0:
        raise ValueError(
            f"{max_mamba_cache_size} state slots cannot serve one request: SGLang needs "
            f"{state_slots_per_running_request} per running request (it refuses to start: "
            "'state cache is too small to serve any requests')"
        )
    return PoolSizes(
        cache_bytes=cache_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        state_bytes=state_bytes,
        mamba_full_memory_ratio=float(mamba_full_memory_ratio),
        page_size=page_size,
        max_mamba_cache_size=max_mamba_cache_size,
        max_total_num_tokens=max_total_num_tokens,
        state_pool_bytes=state_pool_bytes,
        kv_pool_bytes=kv_pool_bytes,
        max_running_requests=max_running_requests,
    )


def check_sglang_version() -> str:
    """Returns the installed sglang version; raises RuntimeError unless it is the one this replay drives."""
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise RuntimeError("sglang is not installed: run this in .venvs/sglang (scripts/setup_env.sh sglang)") from None
    if version != SUPPORTED_SGLANG_VERSION:
        raise RuntimeError(
            f"sglang {version} is installed; this replay drives sglang {SUPPORTED_SGLANG_VERSION} internals "
            "(MambaRadixCache was removed in 0.5.21)"
        )
    return version


def upstream_mamba_full_memory_ratio() -> float:
    """The ``--mamba-full-memory-ratio`` SGLang resolves to when the flag and the model leave it unset."""
    from sglang.srt.arg_groups.fields.schedule import Schedule

    annotation = typing.get_type_hints(Schedule, include_extras=True)["mamba_full_memory_ratio"]
    return float(annotation.__metadata__[0].fallback)


def upstream_state_slots_per_running_request() -> int:
    from sglang.srt.mem_cache.kv_cache_configurator import MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO

    return MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO


@dataclass(slots=True)
class ReplayCache:
    """The real cache and pools of one replay: upstream's ``MambaRadixCache`` (counting the states it admits)
    or our ``HybridPrefixCache``."""

    tree: Any
    req_to_token_pool: HybridReqToTokenPool
    kv_allocator: TokenToKVPoolAllocator
    sizes: PoolSizes

    def check_idle(self, when: str) -> None:
        """The scheduler's idle-time pool invariants (scheduler_components/invariant_checker.py): every KV
        token and state slot is free or held by the tree, none is locked, every request row is free."""
        tree = self.tree
        kv = (self.kv_allocator.available_size(), tree.full_evictable_size(), tree.full_protected_size())
        states = (
            self.req_to_token_pool.mamba_allocator.available_size(),
            tree.mamba_evictable_size(),
            tree.mamba_protected_size(),
        )
        problems = []
        if sum(kv) != self.sizes.max_total_num_tokens or kv[2]:
            problems.append(f"KV (available, evictable, protected) = {kv} of {self.sizes.max_total_num_tokens}")
        if sum(states) != self.sizes.max_mamba_cache_size or states[2]:
            problems.append(f"states (available, evictable, protected) = {states} of {self.sizes.max_mamba_cache_size}")
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            problems.append(
                f"request rows free {self.req_to_token_pool.available_size()} of {self.req_to_token_pool.size}"
            )
        if problems:
            raise RuntimeError(f"pool accounting broken {when}: " + "; ".join(problems))

    def release_everything(self) -> tuple[int, int]:
        """Evicts the whole tree (no request may be in flight) and resets it; returns the KV tokens and state
        slots that did not come back to their allocators (a leak when non-zero)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.check_idle("before releasing the tree")
        tree = self.tree
        tree.evict(EvictParams(num_tokens=tree.full_evictable_size(), mamba_num=tree.mamba_evictable_size()))
        cached_tokens, cached_states = tree.total_size()
        if cached_tokens or cached_states:
            raise RuntimeError(
                f"evicting everything left {cached_tokens} KV tokens and {cached_states} states in the tree"
            )
        tree.reset()
        missing_tokens = self.sizes.max_total_num_tokens - self.kv_allocator.available_size()
        missing_states = self.sizes.max_mamba_cache_size - self.req_to_token_pool.mamba_allocator.available_size()
        return missing_tokens, missing_states


def _tallying_tree_class() -> type:
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

    class TallyingMambaRadixCache(MambaRadixCache):
        """Upstream's cache, unchanged, counting the inserts that admit a new state (a new leaf or a revived
        tombstone: ``InsertResult.mamba_exist`` is False)."""

        def reset(self) -> None:
            super().reset()
            self.states_admitted = 0

        def insert(self, params):
            result = super().insert(params)
            self.states_admitted += not result.mamba_exist
            return result

    return TallyingMambaRadixCache


def build_upstream_cache(sizes: PoolSizes, max_context_len: int) -> ReplayCache:
    """Builds upstream's pools (device cpu, one request row, one-element states) and a MambaRadixCache.
    A published SGLang runtime context must be installed (see :func:`sglang_runtime_context`)."""
    params = _build_pools(sizes, max_context_len)
    return ReplayCache(tree=_tallying_tree_class()(params), req_to_token_pool=params.req_to_token_pool,
                       kv_allocator=params.token_to_kv_pool_allocator, sizes=sizes)


def build_backend_cache(sizes: PoolSizes, max_context_len: int, backend_name: str, spec: ModelSpec) -> ReplayCache:
    """Our backend over fresh pools of the same geometry, with the policies SGLang's factory would give it
    (``adapters.sglang.factory``: FLOP-aware eviction and its tuner from ``spec``, default settings)."""
    from hybrid_prefix_cache.adapters.sglang.cache import HybridPrefixCache
    from hybrid_prefix_cache.adapters.sglang.settings import PrefixCacheSettings
    from hybrid_prefix_cache.core import LRUEviction
    from hybrid_prefix_cache.registry import resolve_backend

    backend = resolve_backend(backend_name)
    settings = PrefixCacheSettings()
    eviction = LRUEviction() if backend.eviction == "lru" else backend.make_eviction(spec, settings.alpha)
    params = _build_pools(sizes, max_context_len)
    tree = HybridPrefixCache(params, backend=backend, eviction=eviction, settings=settings, model_spec=spec)
    return ReplayCache(tree=tree, req_to_token_pool=params.req_to_token_pool,
                       kv_allocator=params.token_to_kv_pool_allocator, sizes=sizes)


def _build_pools(sizes: PoolSizes, max_context_len: int) -> Any:
    """SGLang's pools for one replay, as the ``CacheInitParams`` a tree cache is built from."""
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    if sizes.page_size != 1:
        raise ValueError(
            f"page size {sizes.page_size}: SGLang 0.5.20's MambaRadixCache without the extra buffer "
            "requires page size 1"
        )
    state_shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=1, n_groups=1, num_heads=1, head_dim=1, state_size=1, conv_kernel=2
    )
    cache_params = Mamba2CacheParams(
        shape=state_shape, layers=[0], dtype=Mamba2StateDType(conv=torch.float16, temporal=torch.float16)
    )
    req_to_token_pool = HybridReqToTokenPool(
        size=1,
        mamba_size=sizes.max_mamba_cache_size,
        mamba_spec_state_size=1,
        max_context_len=max_context_len,
        device="cpu",
        enable_memory_saver=False,
        cache_params=cache_params,
        mamba_layer_ids=[0],
        enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False,
    )
    kv_allocator = TokenToKVPoolAllocator(
        sizes.max_total_num_tokens, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False
    )
    return CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=kv_allocator,
        page_size=sizes.page_size,
    )


@contextmanager
def sglang_runtime_context(*, page_size: int = 1, mamba_chunk_size: int = DEFAULT_MAMBA_CHUNK_SIZE) -> Iterator[None]:
    """Publishes a dummy-model SGLang configuration inside the ``with`` block (what SGLang's own tests use:
    ``RuntimeContext.override_server_args``), seeding the mamba cache chunk size a model config would give,
    and restores the previous configuration on exit."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(page_size=page_size, _mamba_cache_chunk_size=mamba_chunk_size)
    override.install()
    try:
        yield
    finally:
        override.restore()


@dataclass(slots=True)
class _Tally:
    input_tokens: int = 0
    hit_tokens: int = 0
    requests_with_hit: int = 0
    cache_op_seconds: float = 0.0


def _check_inputs(requests: Sequence[TraceRequest], kv_bytes_per_token: int, state_bytes: int, cache_bytes: int):
    if not requests:
        raise ValueError("the trace has no requests")
    for name, value in (
        ("kv_bytes_per_token", kv_bytes_per_token),
        ("state_bytes", state_bytes),
        ("cache_bytes", cache_bytes),
    ):
        if type(value) is not int or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for request in requests:
        if len(request.input_tokens) == 0:
            raise ValueError(f"request {request.session_id}/{request.turn_id} has no input tokens")


def _check_turn_fits(request: TraceRequest, max_total_num_tokens: int, context_len: int) -> None:
    """Refuses a turn the 0.5.20 scheduler would reject or cut (scheduler.py: validate_input_length and the
    max_new_tokens clip), so every replayed turn is the trace's turn."""
    input_len, output_len = len(request.input_tokens), len(request.output_tokens)
    max_req_len = min(context_len - 1, max_total_num_tokens - 1)
    max_req_input_len = max_req_len - MAX_REQ_INPUT_HEADROOM
    max_new_tokens = min(max_req_len - input_len - 1, max_total_num_tokens - input_len - 1 - 1)
    if input_len >= max_req_input_len or output_len > max_new_tokens:
        raise ValueError(
            f"turn {request.session_id}/{request.turn_id} ({input_len} input + {output_len} output tokens) does "
            f"not fit a {max_total_num_tokens}-token KV pool: SGLang would reject or truncate it; use a larger "
            "budget"
        )


# What run_request imports, loaded before the replay's clock starts.
_SCHEDULER_MODULES = (
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.mem_cache.allocation",
    "sglang.srt.mem_cache.common",
    "sglang.srt.sampling.sampling_params",
)


def run_request(cache: ReplayCache, request: TraceRequest, rid: str) -> int:
    """Runs one request through the scheduler's cache calls (see the module docstring); returns its hit."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots
    from sglang.srt.mem_cache.common import maybe_cache_unfinished_req, release_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    tree, pool = cache.tree, cache.req_to_token_pool
    input_len, outputs = len(request.input_tokens), request.output_tokens
    req = Req(rid, "", array("q", request.input_tokens), SamplingParams(max_new_tokens=len(outputs)))

    pool.mamba_allocator.alloc_group_begin(1)
    req.init_next_round_input(tree)
    hit = len(req.prefix_indices)
    tree.inc_lock_ref(req.last_node)
    req.set_extend_range(hit, input_len)
    pool.mamba_allocator.alloc_group_end()

    (row,) = alloc_req_slots(pool, [req], tree)
    extend_locations = alloc_token_slots(tree, input_len - hit)
    pool.write((row, slice(0, hit)), req.prefix_indices)
    pool.write((row, slice(hit, input_len)), extend_locations)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = input_len
    # The forward stream would run the deferred state copy / clear here.
    req.kv.mamba_cow_src_index = None
    req.kv.mamba_needs_clear = False

    if outputs:
        req.output_ids.append(outputs[0])
    if len(outputs) > 1:
        maybe_cache_unfinished_req(req, tree)
        decode_len = len(outputs) - 1
        decode_locations = alloc_token_slots(tree, decode_len)
        pool.write((row, slice(input_len, input_len + decode_len)), decode_locations)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = input_len + decode_len
        req.output_ids.extend(outputs[1:])
    release_kv_cache(req, tree)
    return hit


def replay(
    requests: Sequence[TraceRequest],
    kv_bytes_per_token: int,
    state_bytes: int,
    cache_bytes: int,
    *,
    mamba_full_memory_ratio: float | None = None,
    page_size: int = 1,
    mamba_chunk_size: int = DEFAULT_MAMBA_CHUNK_SIZE,
    check_every_request: bool = True,
    backend: str | None = None,
    model_spec: ModelSpec | None = None,
) -> dict[str, Any]:
    """Replays ``requests`` (in ``ts`` order, one at a time) through SGLang 0.5.20's MambaRadixCache with
    ``cache_bytes`` shared by KV tokens of ``kv_bytes_per_token`` and states of ``state_bytes``; with
    ``backend`` (a registered name or ``ADMISSION/EVICTION`` pair, and the ``model_spec`` of its FLOP model)
    through our cache instead, over the same pools.

    ``mamba_full_memory_ratio`` defaults to SGLang's own fallback (0.9). Returns hit rates, the pool
    geometry, state churn and per-request hits; the tree is evicted at the end and every KV token and state
    slot must come back (``leaked_kv_tokens`` / ``leaked_state_slots`` are 0, otherwise RuntimeError).
    ``check_every_request`` also checks the scheduler's idle invariants after each request.
    """
    _check_inputs(requests, kv_bytes_per_token, state_bytes, cache_bytes)
    if backend is not None and model_spec is None:
        raise ValueError(f"backend {backend!r} needs the model_spec of its cost model")
    version = check_sglang_version()
    ratio = upstream_mamba_full_memory_ratio() if mamba_full_memory_ratio is None else mamba_full_memory_ratio
    ordered = sorted(requests, key=lambda request: request.ts)
    # Long enough never to bind: the KV pool alone decides which turns fit (see _check_turn_fits).
    context_len = max(len(r.input_tokens) + len(r.output_tokens) for r in ordered) + MAX_REQ_INPUT_HEADROOM + 2
    sizes = pool_sizes(
        cache_bytes,
        kv_bytes_per_token,
        state_bytes,
        mamba_full_memory_ratio=ratio,
        page_size=page_size,
        context_len=context_len,
        state_slots_per_running_request=upstream_state_slots_per_running_request(),
    )
    for request in ordered:
        _check_turn_fits(request, sizes.max_total_num_tokens, context_len)

    for module in _SCHEDULER_MODULES:
        importlib.import_module(module)
    started = time.perf_counter()
    tally = _Tally()
    per_request: list[dict[str, Any]] = []
    with sglang_runtime_context(page_size=page_size, mamba_chunk_size=mamba_chunk_size):
        if backend is None:
            cache = build_upstream_cache(sizes, context_len)
        else:
            cache = build_backend_cache(sizes, context_len, backend, model_spec)
        for index, request in enumerate(ordered):
            op_started = time.perf_counter()
            try:
                hit = run_request(cache, request, rid=f"{index}:{request.session_id}:{request.turn_id}")
            except Exception as error:
                raise RuntimeError(
                    f"{backend or 'upstream'} cache failed on request {index} ({request.session_id}/{request.turn_id})"
                ) from error
            tally.cache_op_seconds += time.perf_counter() - op_started
            if check_every_request:
                cache.check_idle(f"after request {index} ({request.session_id}/{request.turn_id})")
            input_len = len(request.input_tokens)
            tally.input_tokens += input_len
            tally.hit_tokens += hit
            tally.requests_with_hit += hit > 0
            per_request.append(
                {
                    "session_id": request.session_id,
                    "turn_id": request.turn_id,
                    "input_tokens": input_len,
                    "hit_tokens": hit,
                }
            )
        tree = cache.tree
        states_resident = tree.mamba_evictable_size() + tree.mamba_protected_size()
        kv_tokens_resident = tree.full_evictable_size() + tree.full_protected_size()
        # Upstream counts its admissions; ours counts evictions, and admitted = evicted + still resident.
        states_admitted = tree.states_admitted if backend is None else states_resident + tree.tree.stats.states_evicted
        leaked_tokens, leaked_states = cache.release_everything()
    if leaked_tokens or leaked_states:
        raise RuntimeError(
            f"the replay leaked {leaked_tokens} KV tokens and {leaked_states} state slots after evicting the tree"
        )
    return {
        "engine": "sglang",
        "sglang_version": version,
        "backend": backend or "upstream-mamba",
        "cache_impl": "MambaRadixCache" if backend is None else "HybridPrefixCache",
        "mamba_radix_cache_strategy": "no_buffer",
        **asdict(sizes),
        "context_len": context_len,
        "requests": len(per_request),
        "prompt_tokens": tally.input_tokens,
        "cached_tokens": tally.hit_tokens,
        "computed_prompt_tokens": tally.input_tokens - tally.hit_tokens,
        "token_hit_rate": tally.hit_tokens / tally.input_tokens,
        "request_hit_rate": tally.requests_with_hit / len(per_request),
        "states_admitted": states_admitted,
        "states_evicted": states_admitted - states_resident,
        "states_resident_end": states_resident,
        "kv_tokens_resident_end": kv_tokens_resident,
        "leaked_kv_tokens": leaked_tokens,
        "leaked_state_slots": leaked_states,
        "cache_op_us_per_request": round(tally.cache_op_seconds / len(per_request) * 1e6, 1),
        "replay_s": round(time.perf_counter() - started, 3),
        "per_request": per_request,
    }


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybrid_prefix_cache.bench.engines.sglang_replay",
        description="Replay a JSONL trace through SGLang 0.5.20's real MambaRadixCache and pools, or through "
        "hybrid-prefix-cache backends over the same pools (no model).",
    )
    parser.add_argument("--trace-jsonl", type=Path, required=True, help="trace (see bench/traces.py)")
    parser.add_argument("--kv-bytes-per-token", type=_positive_int, required=True, help="KV bytes of one token")
    parser.add_argument("--state-bytes", type=_positive_int, required=True, help="bytes of one cached state")
    parser.add_argument(
        "--cache-gb", type=parse_budgets, required=True, help="budgets in GiB (2^30 bytes) for KV + states, e.g. 5,10"
    )
    parser.add_argument("--page-size", type=_positive_int, default=1, help="SGLang --page-size (only 1 is supported)")
    parser.add_argument(
        "--mamba-full-memory-ratio", type=_positive_float, help="state share ratio (default: SGLang's, 0.9)"
    )
    parser.add_argument(
        "--mamba-chunk-size", type=_positive_int, default=DEFAULT_MAMBA_CHUNK_SIZE, help="model mamba chunk size"
    )
    parser.add_argument("--backends", default=UPSTREAM,
                        help=f"comma-separated: {UPSTREAM} (SGLang's MambaRadixCache) and/or our backends "
                             f"(default: {UPSTREAM})")
    parser.add_argument("--model", default="paper-7b",
                        help="bundled model name or config.json for the FLOP model of our backends (default paper-7b)")
    parser.add_argument("--json", type=Path, help="write all results to this file")
    parser.add_argument("--per-request", action="store_true", help="keep per-request hits in the JSON output")
    args = parser.parse_args(argv)

    from hybrid_prefix_cache.bench.traces import read_jsonl_trace
    from hybrid_prefix_cache.cost_model import load_model_spec
    from hybrid_prefix_cache.registry import resolve_backend

    try:
        requests = read_jsonl_trace(args.trace_jsonl)
        backends = [name.strip() for name in args.backends.split(",") if name.strip()]
        for name in backends:
            if name != UPSTREAM:
                resolve_backend(name)
        spec = load_model_spec(args.model) if any(name != UPSTREAM for name in backends) else None
    except (OSError, ValueError, KeyError) as error:
        parser.error(str(error))
    runs = []
    header = ("cache GiB", "backend", "states", "KV tokens", "token hit", "req hit", "st evict", "us/req")
    print(f"{header[0]:>9} {header[1]:>16} " + " ".join(f"{name:>9}" for name in header[2:]))
    for cache_bytes in args.cache_gb:
        for name in backends:
            try:
                result = replay(
                    requests,
                    args.kv_bytes_per_token,
                    args.state_bytes,
                    cache_bytes,
                    mamba_full_memory_ratio=args.mamba_full_memory_ratio,
                    page_size=args.page_size,
                    mamba_chunk_size=args.mamba_chunk_size,
                    backend=None if name == UPSTREAM else name,
                    model_spec=spec,
                )
            except ValueError as error:
                print(f"sglang_replay: {cache_bytes / GIB:g} GiB, {name}: {error}", file=sys.stderr)
                return 2
            if not args.per_request:
                del result["per_request"]
            runs.append(result)
            print(
                f"{cache_bytes / GIB:9.2f} {name:>16} {result['max_mamba_cache_size']:9d} "
                f"{result['max_total_num_tokens']:9d} {result['token_hit_rate']:9.4f} "
                f"{result['request_hit_rate']:9.3f} {result['states_evicted']:9d} "
                f"{result['cache_op_us_per_request']:9.0f}"
            )
    if args.json:
        report = {
            "trace": str(args.trace_jsonl),
            "kv_bytes_per_token": args.kv_bytes_per_token,
            "state_bytes": args.state_bytes,
            "runs": runs,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
