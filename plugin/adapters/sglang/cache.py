"""``HybridPrefixCache``: SGLang 0.5.20's ``BasePrefixCache`` over the engine-free :class:`HybridRadixTree`.

The tree holds, per node, a slice of KV slot indices (an int64 tensor into the token allocator) and at most one
state slot (an int64 tensor of shape ``[1]`` into ``HybridReqToTokenPool.mamba_pool``). SGLang keeps the tree's
nodes as ``req.last_node`` handles; a node is always the deepest matched node that has a state (or the root), as
in upstream's ``MambaRadixCache``.

Which states are cached is the backend's admission policy; which are dropped first, its eviction policy:

- prefill (``cache_unfinished_req``, after a chunk and after the last chunk): the state SGLang has at hand is
  the one it tracked into the ping-pong buffer (extra-buffer strategy: at ``req.kv.mamba_last_track_seqlen``,
  the end of the extend floored to the checkpoint grid, or the branch point when it falls inside the extend) or
  the request's live state at the end of the fill (no-buffer strategy). It is inserted only when the admission
  policy's ``prefill_captures`` lists its length; otherwise the request keeps its KV privately and nothing is
  inserted.
- finish (``cache_finished_req``): when the policy keeps final states, the state after the last token SGLang
  computed (no buffer: the request's own slot, donated; extra buffer: the last tracked state, since the live
  slot may still be advanced by an overlapped forward) is inserted with the KV up to it.

The branch point the match returns (``mamba_branching_seqlen``) makes SGLang's extra-buffer tracking capture the
state there, which is how Marconi's speculative insertion reaches the engine.

Locks: ``inc_lock_ref`` returns a receipt (``IncLockRefResult.node_id`` is a receipt number, not a node id);
``dec_lock_ref(node, receipt)`` releases exactly that lock; without a receipt it releases the newest lock on the
node. The cache releases a request's lock itself (finish, and after inserting a prefill state) with
``req.lock_receipt``.
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

from hybrid_prefix_cache.core import EvictionPolicy, HybridRadixTree, Node, PathLock, TreeError
from hybrid_prefix_cache.cost_model import ModelSpec
from hybrid_prefix_cache.policies.admission import AdmissionPolicy
from hybrid_prefix_cache.registry import Backend

from .settings import PrefixCacheSettings
from .tuning import ShadowAlphaTuning

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)

class SglangPools:
    """The tree's :class:`~hybrid_prefix_cache.core.SlotAllocator` over SGLang's token allocator and state slots.

    Inside ``with pools:`` frees are collected and handed back in one call per pool when the outermost block
    ends: an eviction that drops many nodes concatenates the allocators' free lists once instead of once per node.
    Only whole-page segments may be collected (a concatenation must stay page-grouped), which tree edges are.
    """

    def __init__(self, kv_allocator: Any, state_allocator: Any) -> None:
        self.kv_allocator = kv_allocator
        self.state_allocator = state_allocator
        self._depth = 0
        self._kv: list[torch.Tensor] = []
        self._states: list[torch.Tensor] = []

    def free_kv(self, kv: torch.Tensor) -> None:
        if self._depth:
            self._kv.append(kv)
        elif len(kv):
            # Tree edges are whole pages, so a segment is page-aligned wherever it sits in the sequence.
            self.kv_allocator.free_segment(kv, start_pos=0)

    def free_state(self, state: torch.Tensor) -> None:
        if self._depth:
            self._states.append(state)
        else:
            self.state_allocator.free(state)

    def __enter__(self) -> SglangPools:
        self._depth += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        kv, states = self._kv, self._states
        self._kv, self._states = [], []
        if kv:
            self.free_kv(kv[0] if len(kv) == 1 else torch.cat(kv))
        if states:
            self.state_allocator.free(states[0] if len(states) == 1 else torch.cat(states))


def _namespace(extra_key: Any, cache_salt: Any) -> Any:
    """Requests with another LoRA / extra key or cache salt never share nodes (as upstream's child keys)."""
    if extra_key is None and cache_salt is None:
        return None
    return (extra_key, cache_salt)


class HybridPrefixCache(BasePrefixCache):
    """A hybrid-model prefix cache for SGLang 0.5.20; see the module docstring.

    ``backend`` names the admission and eviction policies; ``eviction`` is the policy object built for it
    (LRU when None); ``state_chunk_size`` the branch-point granularity (None: SGLang's checkpoint grid, which
    needs SGLang's published configuration).
    """

    def __init__(
        self,
        params: CacheInitParams,
        *,
        backend: Backend,
        admission: AdmissionPolicy | None = None,
        eviction: EvictionPolicy | None = None,
        settings: PrefixCacheSettings | None = None,
        model_spec: ModelSpec | None = None,
        state_chunk_size: int | None = None,
    ) -> None:
        self._check_supported(params)
        self.req_to_token_pool: HybridReqToTokenPool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.disable = False
        self.enable_mamba_extra_buffer = params.enable_mamba_extra_buffer
        self.backend = backend
        self.settings = settings or PrefixCacheSettings()
        self.admission = admission or backend.make_admission()
        self.device = self.token_to_kv_pool_allocator.device
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.checkpoint_grid = self._checkpoint_grid()
        chunk = self.settings.state_chunk_size if state_chunk_size is None else state_chunk_size
        if chunk is None:
            chunk = self.checkpoint_grid
        elif chunk % self.checkpoint_grid:
            raise ValueError(
                f"state_chunk_size {chunk} is not a multiple of SGLang's mamba checkpoint grid "
                f"{self.checkpoint_grid} (lcm of the mamba cache chunk size and the page size {self.page_size}): "
                "SGLang can only capture states on that grid"
            )
        self.pools = SglangPools(self.token_to_kv_pool_allocator, self.req_to_token_pool.mamba_allocator)
        self.tree = HybridRadixTree(
            self.pools,
            page_size=self.page_size,
            state_chunk_size=chunk,
            eviction=eviction,
            flops_saved=model_spec.flops_saved if model_spec is not None else None,
        )
        self.tuning: ShadowAlphaTuning | None = None
        if eviction is not None and hasattr(eviction, "alpha") and model_spec is not None and self.settings.tunes:
            self.tuning = ShadowAlphaTuning(
                eviction,
                backend=backend,
                admission=self.admission,
                spec=model_spec,
                settings=self.settings,
                kv_capacity=self.token_to_kv_pool_allocator.size,
                state_capacity=self.req_to_token_pool.mamba_allocator.size,
                page_size=self.page_size,
                state_chunk_size=chunk,
            )
        self._receipts = itertools.count(1)
        self._locks: dict[int, PathLock] = {}
        self._node_receipts: dict[Node, list[int]] = {}
        if params.enable_metrics:
            self.init_metrics_collector()
        if params.enable_kv_cache_events:
            logger.warning("hybrid-prefix-cache %s publishes no KV cache events; --kv-events-config is ignored",
                           backend.name)

    # ------------------------------------------------------------------ construction checks

    @staticmethod
    def _check_supported(params: CacheInitParams) -> None:
        pool = params.req_to_token_pool
        allocator = params.token_to_kv_pool_allocator
        if params.disable:
            raise ValueError("HybridPrefixCache was built with the radix cache disabled; use SGLang's ChunkCache")
        if not isinstance(pool, HybridReqToTokenPool):
            raise ValueError(f"HybridPrefixCache needs a HybridReqToTokenPool (a hybrid SSM model), got "
                             f"{type(pool).__name__}")
        if type(allocator) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
            raise ValueError(
                f"HybridPrefixCache supports SGLang's TokenToKVPoolAllocator and PagedTokenToKVPoolAllocator, got "
                f"{type(allocator).__name__} (unified or SWA memory pools are not supported)"
            )
        if params.is_eagle:
            raise ValueError("HybridPrefixCache does not support speculative decoding (EAGLE bigram keys)")
        if getattr(pool, "mamba_ckpt_pool", None) is not None:
            raise ValueError("HybridPrefixCache does not support --enable-int8-mamba-checkpoint")
        mamba_pool = pool.mamba_pool
        if (getattr(mamba_pool, "replayssm_write_pos", None) is not None
                or getattr(mamba_pool, "replayssm_spec_write_pos", None) is not None):
            raise ValueError("HybridPrefixCache does not support the linear ReplaySSM state layout")
        if params.page_size > 1 and not params.enable_mamba_extra_buffer:
            raise ValueError(
                f"page size {params.page_size} needs the extra-buffer strategy (--mamba-radix-cache-strategy "
                "extra_buffer): without it the state is only known at the exact end of a sequence, which a "
                "page-aligned tree cannot name"
            )

    def _checkpoint_grid(self) -> int:
        from sglang.srt.runtime_context import mamba_checkpoint_grid

        return mamba_checkpoint_grid(self.page_size)

    # ------------------------------------------------------------------ capabilities

    def supports_mamba(self) -> bool:
        return True

    @property
    def root_node(self) -> Node:
        return self.tree.root

    # ------------------------------------------------------------------ match

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if key.is_bigram:
            raise ValueError("HybridPrefixCache does not support bigram (EAGLE) keys")
        if len(key) == 0:
            root = self.tree.root
            return MatchResult(device_indices=self._empty, last_device_node=root, last_host_node=root,
                               best_match_node=root)
        # Only the admission match (the one that copies the state) counts in the hit statistics; the scheduler's
        # look-ahead matches for cache-aware ordering do not.
        req = params.req
        # RadixKey holds an array('q'), the tree's key type: it is matched without a copy.
        found = self.tree.match(key.raw_token_ids(), _namespace(key.extra_key, key.cache_salt),
                                record=params.cow_mamba)
        state_node = found.state_node
        if params.cow_mamba and state_node.state is not None:
            self._stage_copy_on_write(req, state_node)
        device_indices = torch.cat(found.kv) if found.kv else self._empty
        return MatchResult(
            device_indices=device_indices,
            last_device_node=state_node,
            last_host_node=state_node,
            best_match_node=state_node,
            mamba_branching_seqlen=found.branching_seqlen,
        )

    def _stage_copy_on_write(self, req: Req, state_node: Node) -> None:
        """SGLang 0.5.20's deferred copy-on-write: give the request a state slot of its own and name the cached
        state to copy into it; the copy runs on the forward stream (``ScheduleBatch._collect_deferred_mamba_cow``)."""
        if req is None:
            raise ValueError("match_prefix with cow_mamba=True needs the request (MatchPrefixParams.req)")
        if not req.kv.holds_mamba:
            slot = self.req_to_token_pool.mamba_allocator.alloc(1)
            if slot is None:
                # The state to copy must survive the eviction that makes room for its copy.
                temporary = self.tree.lock(state_node)
                try:
                    self.evict(EvictParams(mamba_num=1))
                finally:
                    self.tree.unlock(temporary)
                slot = self.req_to_token_pool.mamba_allocator.alloc(1)
                if slot is None:
                    raise RuntimeError(
                        "no state slot for a cache hit's copy: every state is locked by running requests; "
                        "raise --max-mamba-cache-size or lower --max-running-requests"
                    )
            req.kv.mamba_pool_idx = slot[0]
        req.kv.mamba_cow_src_index = state_node.state
        req.kv.mamba_needs_clear = False

    # ------------------------------------------------------------------ insert paths

    @staticmethod
    def _tokens(req: Req, length: int) -> array:
        """``(req.origin_input_ids + req.output_ids)[:length]`` as the tree's key. SGLang 0.5.20 keeps both as
        ``array('q')``, the tree's key type, so this is at most one slice and one concatenation (memory copies,
        no per-token conversion); the tree neither keeps nor changes the array it is given."""
        origin = req.origin_input_ids
        if length == len(origin):
            return origin
        if length < len(origin):
            return origin[:length]
        return origin + req.output_ids[: length - len(origin)]

    def _request_row(self, req: Req, length: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :length]

    def _prefill_state_admitted(self, req: Req, state_len: int, fill_len: int) -> bool:
        """Whether the admission policy caches the prefill state SGLang holds at ``state_len``."""
        protected = req.kv.cache_protected_len
        if state_len <= protected:
            return False
        if self.enable_mamba_extra_buffer:
            # SGLang floors the tracked end of an extend to its grid relative to the extend's start; that point,
            # not the fill length, is the "end of input" a policy can ask for.
            start = req.extend_range.start
            capture_end = max(state_len, start + (fill_len - start) // self.checkpoint_grid * self.checkpoint_grid)
        else:
            capture_end = fill_len
        captures = self.admission.prefill_captures(capture_end, protected, req.mamba_branching_seqlen, 1)
        return state_len in captures

    def cache_unfinished_req(self, req: Req, chunked: bool = False, **kwargs: Any) -> None:
        """After a prefill chunk or a whole prefill: insert the prefill state when the policy admits it."""
        fill_len = req.extend_range.end
        state_len = req.kv.mamba_last_track_seqlen if self.enable_mamba_extra_buffer else fill_len
        if state_len is None or not self._prefill_state_admitted(req, state_len, fill_len):
            # The request keeps its KV; the next chunk continues from all of it.
            req.prefix_indices = self._request_row(req, fill_len).to(dtype=torch.int64, copy=True)
            return
        if state_len % self.page_size:
            raise AssertionError(f"tracked state length {state_len} is not page-aligned (page {self.page_size})")

        pool = self.req_to_token_pool
        if self.enable_mamba_extra_buffer:
            state = pool.donate_mamba_ping_pong_slot(req, self._alloc_state_slot())
        else:
            state = self._alloc_state_slot()
            pool.mamba_pool.copy_from(pool.translate_mamba_indices(req.kv.mamba_pool_idx.unsqueeze(0)),
                                      pool.translate_mamba_indices(state))

        protected = req.kv.cache_protected_len
        # One int64 copy of the row serves twice: the tree keeps views of [prefix_len, state_len) of it as its
        # nodes' KV, and the request keeps it as its prefix indices (neither side writes into it).
        indices = self._request_row(req, fill_len).to(dtype=torch.int64, copy=True)
        kv = indices[:state_len]
        result = self.tree.insert(self._tokens(req, state_len), kv, state, _namespace(req.extra_key, req.cache_salt),
                                  lock=True)
        if not result.state_taken:
            pool.mamba_allocator.free(state)
        if result.prefix_len > protected:
            # Another request cached [protected, prefix_len) meanwhile: the request switches to the tree's KV
            # there and frees its own copy. Beyond prefix_len the tree took the request's own slots. The tree's
            # path KV equals the request's row before ``protected`` (the request reuses that prefix), so the
            # path followed by the row's tail is the row after the switch.
            path_kv = torch.cat(self.tree.path_kv(result.node))
            pool.write((req.kv.req_pool_idx, slice(protected, result.prefix_len)),
                       path_kv[protected : result.prefix_len])
            self.pools.free_kv(kv[protected : result.prefix_len])
            indices = path_kv if len(path_kv) == fill_len else torch.cat((path_kv, indices[len(path_kv) :]))
        self._release_request_lock(req)
        req.last_node = result.node
        req.lock_receipt = DecLockRefParams(node_id=self._register_lock(result.lock))
        req.prefix_indices = indices
        req.kv.cache_protected_len = result.inserted_len
        req.kv.mamba_last_track_seqlen = None

    def cache_finished_req(self, req: Req, is_insert: bool = True, *, kv_len_to_handle: int, **kwargs: Any) -> None:
        """The request is done (or aborted / retracted with ``is_insert=False``): cache what the policy keeps,
        free the rest of its KV and its state slots, release its lock."""
        pool = self.req_to_token_pool
        protected = req.kv.cache_protected_len
        row = self._request_row(req, kv_len_to_handle)
        keep_track_slot: int | None = None
        donated_live_slot = False
        state_len = self._final_state_len(req, kv_len_to_handle) if is_insert else 0
        # Released first so that the final state, inserted next, ends up more recent than the state the request
        # held: the next turn of a conversation resumes from the final one. Nothing can be evicted in between,
        # and the node the lock held keeps its state (a state-locked node never loses it), so its path stays.
        self._release_request_lock(req)
        with self.pools:
            if state_len > protected:
                if self.enable_mamba_extra_buffer:
                    keep_track_slot = pool.get_mamba_ping_pong_keep_idx(req)
                    state = req.kv.mamba_ping_pong_track_buffer[keep_track_slot].unsqueeze(-1).clone()
                else:
                    state = req.kv.mamba_pool_idx.unsqueeze(-1).clone()
                token_ids = self._tokens(req, state_len)
                kv = (row if state_len == kv_len_to_handle else row[:state_len]).to(dtype=torch.int64, copy=True)
                result = self.tree.insert(token_ids, kv, state, _namespace(req.extra_key, req.cache_salt))
                self._free_duplicates(kv, protected, result.prefix_len)
                owned_from = max(result.inserted_len, protected)
                if result.state_taken:
                    donated_live_slot = not self.enable_mamba_extra_buffer
                else:
                    keep_track_slot = None
            else:
                owned_from = protected
            self._free_kv_range(row, owned_from, kv_len_to_handle)
        if is_insert and self.tuning is not None:
            self.tuning.observe(req.origin_input_ids, req.output_ids)
        if donated_live_slot:
            # The tree owns the request's own slot now; the pool must not free it.
            req.kv.mamba_pool_idx = None
        elif req.kv.holds_mamba:
            pool.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=keep_track_slot)

    def _final_state_len(self, req: Req, kv_len: int) -> int:
        """Length of the state a finished request can leave: 0 when the policy keeps none."""
        if not self.admission.keep_final_state():
            return 0
        if self.enable_mamba_extra_buffer:
            tracked = req.kv.mamba_last_track_seqlen
            return tracked if tracked is not None and tracked <= kv_len else 0
        return kv_len

    def _free_duplicates(self, kv: torch.Tensor, protected: int, prefix_len: int) -> None:
        """The tree already held ``[protected, prefix_len)`` (another request cached it meanwhile): the request's
        own copy of that KV goes back to the allocator."""
        if prefix_len > protected:
            self.pools.free_kv(kv[protected:prefix_len])

    def _free_kv_range(self, row: torch.Tensor, start: int, end: int) -> None:
        if end > start:
            self.token_to_kv_pool_allocator.free_segment(row[start:end].to(torch.int64), start_pos=start)

    def _alloc_state_slot(self) -> torch.Tensor:
        slot = self.req_to_token_pool.mamba_allocator.alloc(1)
        if slot is None:
            self.evict(EvictParams(mamba_num=1))
            slot = self.req_to_token_pool.mamba_allocator.alloc(1)
            if slot is None:
                raise RuntimeError(
                    "no state slot to cache a prefill state: every state is locked by running requests; "
                    "raise --max-mamba-cache-size or lower --max-running-requests"
                )
        return slot

    # ------------------------------------------------------------------ locks

    def _register_lock(self, path_lock: PathLock) -> int:
        """Files the lock and returns its receipt number."""
        receipt = next(self._receipts)
        self._locks[receipt] = path_lock
        receipts = self._node_receipts.get(path_lock.node)
        if receipts is None:
            self._node_receipts[path_lock.node] = [receipt]
        else:
            receipts.append(receipt)
        return receipt

    def inc_lock_ref(self, node: Node) -> IncLockRefResult:
        """Protect the KV of root..node and the node's state; the receipt releases exactly this lock."""
        return IncLockRefResult(node_id=self._register_lock(self.tree.lock(node)))

    def dec_lock_ref(self, node: Node, params: DecLockRefParams | None = None) -> DecLockRefResult:
        self._release_lock(node, params.node_id if params is not None else None)
        return DecLockRefResult()

    def _release_lock(self, node: Node, receipt: int | None) -> None:
        """Release the lock with ``receipt`` on ``node``, or without a receipt the newest lock on it."""
        receipts = self._node_receipts.get(node)
        if receipt is None:
            if not receipts:
                raise TreeError(f"dec_lock_ref: no lock is held on {node!r}")
            receipt = receipts[-1]
        path_lock = self._locks.get(receipt)
        if path_lock is None:
            raise TreeError(f"dec_lock_ref: lock receipt {receipt} is unknown or was already released")
        if path_lock.node is not node:
            raise TreeError(f"dec_lock_ref: lock receipt {receipt} was taken on {path_lock.node!r}, not {node!r}")
        del self._locks[receipt]
        receipts.remove(receipt)
        if not receipts:
            del self._node_receipts[node]
        self.tree.unlock(path_lock)

    def _release_request_lock(self, req: Req) -> None:
        receipt = getattr(req, "lock_receipt", None)
        self._release_lock(req.last_node, receipt.node_id if receipt is not None else None)
        req.lock_receipt = DecLockRefParams()

    @property
    def locks_held(self) -> int:
        return len(self._locks)

    # ------------------------------------------------------------------ eviction

    def evict(self, params: EvictParams) -> EvictResult:
        """Free ``num_tokens`` KV slots (unlocked leaves, LRU or the backend's order) and ``mamba_num`` states."""
        started = time.perf_counter()
        tokens = states = 0
        with self.pools:
            if params.num_tokens > 0:
                freed = self.tree.evict_tokens(params.num_tokens)
                tokens, states = tokens + freed.tokens, states + freed.states
            if params.mamba_num > 0:
                freed = self.tree.evict_states(params.mamba_num)
                tokens, states = tokens + freed.tokens, states + freed.states
        self.update_eviction_metrics(tokens, started)
        return EvictResult(num_tokens_evicted=tokens, mamba_num_evicted=states)

    def evict_for_alloc(self, params: EvictParams) -> EvictResult:
        """The allocation paths' entry: the pools are separate, so each shortfall is evicted on its own."""
        return self.evict(params)

    # ------------------------------------------------------------------ sizes and inspection

    def full_evictable_size(self) -> int:
        return self.tree.evictable_tokens

    def full_protected_size(self) -> int:
        return self.tree.protected_tokens

    def mamba_evictable_size(self) -> int:
        return self.tree.evictable_states

    def mamba_protected_size(self) -> int:
        return self.tree.protected_states

    def evictable_size(self) -> int:
        return self.tree.evictable_tokens

    def protected_size(self) -> int:
        return self.tree.protected_tokens

    def total_size(self) -> tuple[int, int]:
        return self.tree.total_tokens, self.tree.total_states

    def _nodes(self) -> Iterator[Node]:
        stack = list(self.tree.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_values_flatten(self) -> torch.Tensor:
        values: Sequence[torch.Tensor] = [node.kv for node in self._nodes()]
        return torch.cat(values) if values else self._empty

    def all_mamba_values_flatten(self) -> torch.Tensor:
        values = [node.state for node in self._nodes() if node.state is not None]
        return torch.cat(values) if values else self._empty

    def available_and_evictable_str(self) -> str:
        available = self.token_to_kv_pool_allocator.available_size()
        states_available = self.req_to_token_pool.mamba_allocator.available_size()
        return (
            f"Available full tokens: {available + self.tree.evictable_tokens} "
            f"({available=} + evictable={self.tree.evictable_tokens})\n"
            f"Available states: {states_available + self.tree.evictable_states} "
            f"({states_available=} + evictable={self.tree.evictable_states})\n"
        )

    def sanity_check(self) -> None:
        self.tree.check_invariants()
        check_policy = getattr(self.tree.eviction, "check_invariants", None)
        if check_policy is not None:
            check_policy()
        held = sum(len(receipts) for receipts in self._node_receipts.values())
        assert held == len(self._locks), f"{len(self._locks)} locks but {held} receipts filed under nodes"

    def pretty_print(self) -> None:
        print(self.tree.pretty_print())

    def reset(self) -> None:
        """Drop every cached entry (SGLang calls this on an idle server's flush_cache)."""
        if self._locks:
            raise TreeError(f"reset: {len(self._locks)} locks are still held by requests")
        with self.pools:
            self.tree.reset()

    @property
    def stats(self):
        return self.tree.stats
