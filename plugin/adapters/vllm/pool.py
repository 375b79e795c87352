"""vLLM's ``BlockPool`` with the bookkeeping our backends need: who produced each cached FA block, and an
optional FLOP-aware eviction order over the free cached blocks.

vLLM evicts cached content in exactly one place, ``BlockPool.get_new_blocks``, in the order of its free queue
(unhashed blocks at the front, hashed ones appended at release: LRU). :class:`HybridBlockPool` keeps the queue
as the set of free blocks (its count drives vLLM's admission control) and, when FLOP-aware eviction is on,
chooses the victims itself: unhashed free blocks first as vLLM does, then the pick of
:class:`~hybrid_prefix_cache.adapters.vllm.block_index.BlockCacheIndex`, which the overrides below keep in step
with every key added or removed and every block released or reused. Alpha follows an
:class:`~hybrid_prefix_cache.policies.tuning.AlphaTuner` whose ``evaluate`` replays the last window of finished
requests through a :class:`~hybrid_prefix_cache.adapters.vllm.block_index.ShadowCache` of the same size; it
stays 0 (LRU) unless a value beat LRU on that window.

A block that loses its key while free (our admission un-caches superseded states; KV connectors evict) is moved
to the front of the queue, where vLLM puts every free unhashed block.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

from hybrid_prefix_cache.adapters.vllm.block_index import (
    BlockCacheIndex,
    BlockCosts,
    RequestRecord,
    shadow_hits,
)
from hybrid_prefix_cache.policies.tuning import AlphaTuner

# A child of vLLM's logger: vLLM configures handlers for "vllm" only, so a logger of our own would drop INFO.
logger = logging.getLogger(f"vllm.{__name__}")

_NEVER = 1 << 62


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """The KV-cache groups sharing the pool, by kind, and their common block size in tokens."""

    fa_groups: tuple[int, ...]
    state_groups: tuple[int, ...]
    block_size: int


class HybridBlockPool(BlockPool):
    """Constructed like ``BlockPool``; behaves exactly like it until :meth:`configure` is called."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout: PoolLayout | None = None
        self.index: BlockCacheIndex | None = None
        self.tuner: AlphaTuner[RequestRecord] | None = None
        # How each overwritten cached block was classed: dead (no hit can use it), scored, lru (no candidate).
        self.evictions: Counter[str] = Counter()
        self.tune_every = 0
        self._evicted_at_last_tune = 0
        # Producer of each cached FA block: did it hold decoded tokens, and the producing request's session.
        self._holds_output = bytearray(self.num_gpu_blocks)
        self._producer_session: list[str | None] = [None] * self.num_gpu_blocks

    def configure(
        self, layout: PoolLayout, costs: BlockCosts | None, *, tune_window: int = 500, tune_every: int = 500
    ) -> None:
        """Start tracking ``layout``; with ``costs``, evict by FLOP-aware utility with a tuned alpha."""
        self.layout = layout
        if costs is None:
            return
        self.index = BlockCacheIndex(self.num_gpu_blocks, layout.fa_groups, layout.state_groups, costs)
        # The pool decides when to re-tune (see finish_request), so the tuner's own period never fires.
        self.tuner = AlphaTuner(self._shadow_hits, window=tune_window, retune_every=_NEVER)
        self.tuner.bind(self.index)
        self.tune_every = tune_every

    # ------------------------------------------------------------------ what our admission asks

    def continues_a_reply(self, block_hash: BlockHash, session_id: str | None) -> bool:
        """Whether the cached FA block with ``block_hash`` holds decoded tokens of an earlier request, or was
        produced by the session ``session_id``: a request reaching it continues that conversation."""
        if self.layout is None:
            return False
        for group in self.layout.fa_groups:
            block = self.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, group))
            if block is None:
                continue
            if self._holds_output[block.block_id]:
                return True
            producer = self._producer_session[block.block_id]
            if session_id is not None and producer == session_id:
                return True
        return False

    def finish_request(
        self, keys: Sequence[BlockHash], states: Sequence[tuple[int, int]], max_hit_blocks: int, finished: bool
    ) -> None:
        """A request left the scheduler: ``keys`` of its full blocks, ``states`` it left cached as ``(block
        index, parent state end in tokens)``. Its Marconi nodes get their efficiency and their parent states
        (which they may subsume); a finished request (not a preempted one) joins the alpha tuner's window
        (which may re-tune)."""
        if self.index is None or self.layout is None:
            return
        self.index.assign_states(keys, states)
        if not finished or self.tuner is None:
            return
        self.tuner.observe(RequestRecord(tuple(keys), max_hit_blocks, tuple(states)))
        if self.tuner.requests_seen % self.tune_every:
            return
        # Without evictions since the last re-tune alpha has had no effect, and the shadow (which holds no more
        # than the pool) would evict little or nothing: its replays (seconds on a 500-request window) are skipped.
        evicted = sum(self.evictions.values())
        if evicted == self._evicted_at_last_tune:
            return
        self._evicted_at_last_tune = evicted
        before = self.tuner.alpha
        after = self.tuner.retune().alpha
        if after != before:
            logger.info("hybrid-prefix-cache: FLOP-aware eviction alpha %s -> %s", before, after)

    def _shadow_hits(self, alpha: float, window: Sequence[RequestRecord]) -> float:
        assert self.index is not None and self.layout is not None
        return float(
            shadow_hits(
                window,
                num_blocks=self.num_gpu_blocks - 1,
                block_size=self.layout.block_size,
                fa_groups=self.layout.fa_groups,
                state_groups=self.layout.state_groups,
                costs=self.index.costs,
                alpha=alpha,
            )
        )

    # ------------------------------------------------------------------ keys

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        super().cache_full_blocks(
            request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask
        )
        if self.layout is None or kv_cache_group_id not in self.layout.fa_groups:
            return
        session_id = getattr(request, "session_id", None)
        for position in range(num_cached_blocks, num_full_blocks):
            block = blocks[position]
            if block.is_null or block.block_hash is None:
                continue
            end = (position + 1) * block_size
            self._holds_output[block.block_id] = end > request.num_prompt_tokens
            self._producer_session[block.block_id] = session_id
            if self.index is not None and position > 0 and not blocks[position - 1].is_null:
                self.index.link_parent(block.block_id, blocks[position - 1].block_id)

    def _insert_block_hash(
        self, block_hash_with_group_id: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        had_key = block.block_hash is not None
        super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)
        if self.index is not None and not had_key and block.block_hash is not None:
            self.index.admit(block.block_id, get_block_hash(block.block_hash), get_group_id(block.block_hash))

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        had_key = block.block_hash is not None
        removed = super()._remove_cached_block_hashes(block)
        if had_key:
            self._holds_output[block.block_id] = 0
            self._producer_session[block.block_id] = None
            if self.index is not None:
                self.index.drop(block.block_id)
            if block.ref_cnt == 0 and not block.is_null and block.prev_free_block is not None:
                # A free block without a key is reused before any cached one, as vLLM orders its queue.
                self.free_block_queue.remove(block)
                self.free_block_queue.prepend_n([block])
        return removed

    def reset_prefix_cache(self) -> bool:
        reset = super().reset_prefix_cache()
        if reset:
            self._holds_output = bytearray(self.num_gpu_blocks)
            self._producer_session = [None] * self.num_gpu_blocks
            if self.index is not None:
                self.index.reset()
        return reset

    # ------------------------------------------------------------------ free / in use

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        if self.index is not None:
            for block in blocks:
                if block.ref_cnt == 0 and not block.is_null:
                    self.index.acquire(block.block_id)
        super().touch(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        if self.index is None:
            super().free_blocks(ordered_blocks)
            return
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        self._release(blocks)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        if self.index is None:
            super().unpin_blocks(blocks, on_reuse)
            return
        blocks = list(blocks)
        super().unpin_blocks(blocks, on_reuse)
        self._release(blocks)

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        assert self.index is not None
        # In the order given: vLLM passes the block to evict first (a request's tail) first.
        for block in blocks:
            if block.pool not in (None, self) or block.ref_cnt != 0 or block.is_null:
                continue
            if block.block_hash is not None:
                self.index.release(block.block_id)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if self.index is None or not self.enable_caching:
            return super().get_new_blocks(num_blocks)
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        chosen = [self._next_victim() for _ in range(num_blocks)]
        if self._reuse_watchers:
            self._notify_reuse(chosen)
        for block in chosen:
            self._maybe_evict_cached_block(block)
            if block.ref_cnt != 0:
                raise RuntimeError(f"hybrid-prefix-cache: block {block.block_id} was free with ref_cnt {block.ref_cnt}")
            block.ref_cnt = 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(block)
        return chosen

    def _next_victim(self) -> KVCacheBlock:
        assert self.index is not None
        queue = self.free_block_queue
        front = queue.fake_free_list_head.next_free_block
        victim = None
        if front is None or front is queue.fake_free_list_tail or front.block_hash is not None:
            victim = self.index.pick_victim()
        if victim is None:
            # An unhashed block, or no candidate (only in-use chains' interior blocks are free and cached):
            # vLLM's own order decides.
            block = queue.popleft()
            if block.block_hash is not None:
                self.evictions["lru"] += 1
        else:
            block = self.blocks[victim]
            self.evictions[self.index.candidate_of(victim) or "lru"] += 1
            queue.remove(block)
        if self.index.is_free(block.block_id):
            self.index.acquire(block.block_id)
        return block
