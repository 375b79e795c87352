"""Our admission policies inside vLLM's ``MambaManager`` (mode ``align``): which recurrent states get cached.

vLLM hashes a Mamba block at most once, in ``cache_blocks``, in the step where the block becomes full; its
``reachable_block_mask`` keeps, under the default retention (0), only the prompt's replay boundary and the
shared-prefix junction. :class:`AdmissionMambaManager` steers that decision:

- ``all`` (``mamba-radix``): dense retention: every block-aligned state the request computes (prefill chunk
  ends, every boundary crossed while decoding), hence also the last one before the final token.
- ``periodic:N``: vLLM's retention interval N.
- ``marconi``: the boundary just computed is added to the reachable boundaries whenever it lies past the prompt's
  replay boundary, so the state after the last decoded block boundary is cached; each such checkpoint of a
  request supersedes the request's previous one (its replay-boundary state or an earlier decode boundary),
  which is un-cached at once, so a request leaves one own checkpoint: the state after its last decoded token,
  block-aligned (Marconi's "last decoded token"). Junction states (branch points) are kept, except where the
  junction lies in an earlier request's reply or in a block produced by the same session: that request
  continues the conversation, and its own final state will supersede the junction's.

Each request's kept states are remembered with their Marconi parent (the deepest state each extends: the hit,
or the last state the request kept). When the request leaves the scheduler, the manager of the first Mamba
group hands them, with the request's block keys, to a FLOP-aware
:class:`~hybrid_prefix_cache.adapters.vllm.pool.HybridBlockPool` (node efficiencies, the alpha tuner's window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock, resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from hybrid_prefix_cache.adapters.vllm.pool import HybridBlockPool
from hybrid_prefix_cache.adapters.vllm.settings import BackendSettings


@dataclass(slots=True)
class _Chain:
    """What one request has cached so far in this manager's group."""

    request: Any
    parent_end: int
    junction_end: int = 0
    checkpoint: tuple[KVCacheBlock, bytes, int] | None = None
    states: list[tuple[int, int]] = field(default_factory=list)


class AdmissionMambaManager(MambaManager):
    """``MambaManager`` running one of our admission policies; see the module docstring."""

    def __init__(self, *args: Any, settings: BackendSettings, reports_requests: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.mamba_cache_mode != "align":
            raise ValueError(
                f"hybrid-prefix-cache {settings.name}: vLLM runs Mamba prefix caching in mode "
                f"{self.mamba_cache_mode!r}; the backends need mode 'align' (prefix caching on)"
            )
        if settings.admission == "periodic" and settings.period % self.scheduler_block_size:
            raise ValueError(
                f"hybrid-prefix-cache {settings.name}: periodic:{settings.period} must be a multiple of vLLM's "
                f"scheduler block size {self.scheduler_block_size}"
            )
        self.settings = settings
        self.reports_requests = reports_requests
        self._chains: dict[str, _Chain] = {}

    def _retention(self) -> int | None:
        if self.settings.admission == "all":
            return None
        if self.settings.admission == "periodic":
            return self.settings.period
        return 0

    def _aligned(self, tokens: int) -> int:
        alignment = self.cache_hit_alignment_tokens
        return tokens // alignment * alignment if tokens > 0 else 0

    def cache_blocks(
        self,
        request: Any,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None:
        request_id = request.request_id
        chain = self._chains.get(request_id)
        if chain is None:
            # At the first call the request's blocks are exactly its cache hit.
            hit_end = self.num_cached_block.get(request_id, 0) * self.block_size
            chain = self._chains[request_id] = _Chain(request, hit_end)
            if self.settings.admission == "marconi":
                self._filter_junction(request, chain)
        boundaries = list(replay_boundaries)
        if self.settings.admission == "marconi" and num_tokens > self._aligned(request.num_prompt_tokens - 1):
            boundaries.append(num_tokens)
        before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens, retention_interval=self._retention(), replay_boundaries=boundaries)
        after = self.num_cached_block.get(request_id, 0)
        blocks = self.req_to_blocks[request_id]
        for position in range(before, min(after, len(blocks))):
            block = blocks[position]
            if not block.is_null and block.block_hash is not None:
                self._admitted(chain, position, block)

    def _filter_junction(self, request: Any, chain: _Chain) -> None:
        junction = self._aligned(request.shared_prefix_boundary)
        if not junction or not isinstance(self.block_pool, HybridBlockPool):
            return
        hashes = resolve_block_hashes(request.block_hashes, self.block_pool.hash_block_size, self.block_size)
        position = junction // self.block_size - 1
        session_id = getattr(request, "session_id", None)
        if 0 <= position < len(hashes) and self.block_pool.continues_a_reply(hashes[position], session_id):
            # The scheduler reads it to end a prefill chunk there and the mask to keep the state: neither pays.
            request.shared_prefix_boundary = 0
            return
        chain.junction_end = junction

    def _admitted(self, chain: _Chain, position: int, block: KVCacheBlock) -> None:
        end = (position + 1) * self.block_size
        if self.settings.admission != "marconi" or end == chain.junction_end:
            chain.states.append((position, chain.parent_end))
            chain.parent_end = end
            return
        previous = chain.checkpoint
        if previous is not None:
            previous_block, previous_key, previous_position = previous
            if previous_block.block_hash == previous_key:
                self.block_pool._maybe_evict_cached_block(previous_block)
            chain.states = [state for state in chain.states if state[0] != previous_position]
        assert block.block_hash is not None
        chain.checkpoint = (block, block.block_hash, position)
        chain.states.append((position, chain.parent_end))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        chain = self._chains.pop(request_id, None)
        pool = self.block_pool
        scored = isinstance(pool, HybridBlockPool) and pool.index is not None
        if chain is not None and self.reports_requests and scored:
            request = chain.request
            hashes = resolve_block_hashes(request.block_hashes, pool.hash_block_size, self.block_size)
            count = min(len(hashes), request.num_computed_tokens // self.block_size)
            pool.finish_request(
                [hashes[position] for position in range(count)],
                chain.states,
                max(0, request.num_prompt_tokens - 1) // self.block_size,
                finished=request.is_finished(),
            )
        return super().pop_blocks_for_free(request_id)
