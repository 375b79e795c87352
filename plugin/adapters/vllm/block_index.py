"""Which free cached block vLLM should overwrite next under Marconi's FLOP-aware eviction; engine-free.

vLLM keeps every cached block of a hybrid model in one pool: full-attention (FA) blocks, one per FA group and
``block_size`` tokens, and recurrent-state blocks, one per Mamba group for the state after a block boundary.
A hit of ``n`` blocks needs the FA blocks of all ``n`` boundaries in every FA group and the state at boundary
``n`` in every Mamba group. :class:`BlockCacheIndex` tracks the free cached blocks with that structure and
picks victims the way Marconi evicts nodes of its radix tree:

1. Dead blocks first, oldest first: an FA block that no cached FA block continues (a leaf) and that has no
   complete state at its boundary, or a state block that cannot serve a hit (another Mamba group lost its
   block at that boundary, or an FA group has no block there). Nothing can hit them.
2. Then states, by Marconi's utility ``recency + alpha * efficiency`` (min-max normalised; lowest first), using
   the FLOP-aware policy's candidate sets (:class:`~hybrid_prefix_cache.policies.eviction.FlopAwareEviction`).
   A state is a node of Marconi's tree: its efficiency is the prefill FLOPs from its parent state to its
   boundary per byte the node holds (its state blocks plus the FA blocks since the parent). States whose
   boundary FA block has at most one cached child come first (Marconi's candidates: dropping the state of a
   node with one child lets the child absorb its KV); branch-point states only when no other state is free.
3. An FA leaf with a complete state at its boundary is never picked: its state goes first, which turns the
   leaf dead, so a leaf node loses its state and then its KV, tail first, up to the next state or branch point.
   FA blocks that cached FA blocks continue are never picked: a missing FA block would orphan every deeper one.

``alpha == 0`` orders the states by release time alone, which is vLLM's LRU order (vLLM releases a finished
request's blocks tail first, and a hit removes blocks from the free set until they are released again).

Recency is a release counter. Each operation costs O(G + log n) for G KV-cache groups, a pick O(buckets + log n).

:class:`ShadowCache` replays :class:`RequestRecord` windows through a fresh index for
:class:`~hybrid_prefix_cache.policies.tuning.AlphaTuner` (see its docstring for what it models).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybrid_prefix_cache.policies.eviction import DEFAULT_BUCKETS, FlopAwareEviction, _CandidateSet

FA = "fa"
STATE = "state"


class CostModel(Protocol):
    """FLOPs a cached segment saves (``hybrid_prefix_cache.cost_model.ModelSpec`` provides it)."""

    def segment_flops(self, start: int, end: int) -> float: ...


@dataclass(frozen=True, slots=True)
class BlockCosts:
    """Bytes of vLLM's blocks, for a FLOPs-per-byte efficiency in vLLM's units.

    ``block_bytes`` is what one block id costs (every group's pages overlay one allocation); a cached state
    takes one block per Mamba group, ``block_size`` cached tokens one block per FA group.
    """

    model: CostModel
    block_size: int
    block_bytes: int
    num_fa_groups: int
    num_state_groups: int

    def __post_init__(self) -> None:
        for name in ("block_size", "block_bytes", "num_state_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockCosts.{name} must be a positive integer, got {value!r}")
        if isinstance(self.num_fa_groups, bool) or not isinstance(self.num_fa_groups, int) or self.num_fa_groups < 0:
            raise ValueError(f"BlockCosts.num_fa_groups must be a non-negative integer, got {self.num_fa_groups!r}")

    # The two properties and segment_flops make this a CostSpec for FlopAwareEviction's buckets.
    @property
    def kv_bytes_per_token(self) -> int:
        return max(1, self.num_fa_groups * self.block_bytes // self.block_size)

    @property
    def state_bytes(self) -> int:
        return self.num_state_groups * self.block_bytes

    def segment_flops(self, start: int, end: int) -> float:
        return self.model.segment_flops(start, end)

    def state_efficiency(self, parent_end: int, end: int) -> float:
        """FLOPs saved from the parent state to ``end`` per byte of the node (state + FA blocks since parent)."""
        parent_end = min(parent_end, end)
        held = self.state_bytes + (end - parent_end) * self.num_fa_groups * self.block_bytes // self.block_size
        return self.model.segment_flops(parent_end, end) / max(held, 1)


class _Slot:
    """Side-table entry of one block id (vLLM's ``KVCacheBlock`` has ``__slots__``: no room for ours)."""

    __slots__ = (
        "candidate",
        "children",
        "efficiency",
        "end",
        "free",
        "generation",
        "group",
        "key",
        "kind",
        "member",
        "parent",
        "parent_generation",
        "recency",
    )

    def __init__(self) -> None:
        self.kind: str | None = None
        self.group = -1
        self.key: Hashable = None
        self.end = 0
        self.parent = -1
        self.parent_generation = -1
        self.children = 0
        self.free = False
        self.recency = 0
        self.efficiency = 0.0
        self.candidate: str | None = None
        self.member = None
        self.generation = 0


class _Position:
    """The cached blocks of one boundary, by group."""

    __slots__ = ("fa", "states")

    def __init__(self) -> None:
        self.fa: dict[int, list[int]] = {}
        self.states: dict[int, list[int]] = {}


DEAD, NARROW, BRANCH = "dead", "narrow", "branch"


class BlockCacheIndex:
    """Free cached blocks ordered for eviction; see the module docstring.

    Block ids are ``0 .. num_blocks - 1``; ``fa_groups`` and ``state_groups`` are the KV-cache group ids of
    each kind. The engine reports every change: :meth:`admit` (a block got its prefix-cache key),
    :meth:`link_parent` (an FA block continues another), :meth:`set_parent_end` (a state's parent state),
    :meth:`drop` (a block lost its key), :meth:`release` (reference count reached 0) and :meth:`acquire`
    (a free block was hit or handed out).
    """

    def __init__(
        self,
        num_blocks: int,
        fa_groups: Sequence[int],
        state_groups: Sequence[int],
        costs: BlockCosts,
        *,
        alpha: float = 0.0,
        buckets: int = DEFAULT_BUCKETS,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"BlockCacheIndex: num_blocks must be a positive integer, got {num_blocks!r}")
        if not state_groups:
            raise ValueError("BlockCacheIndex: a hybrid model needs at least one state (Mamba) group")
        if set(fa_groups) & set(state_groups):
            raise ValueError(f"BlockCacheIndex: groups {sorted(set(fa_groups) & set(state_groups))} are both kinds")
        self.fa_groups = tuple(fa_groups)
        self.state_groups = tuple(state_groups)
        self.costs = costs
        # Only its buckets and alpha validation are used: the candidate sets live here.
        self._policy = FlopAwareEviction(costs, alpha=alpha, buckets=buckets)
        self._slots = [_Slot() for _ in range(num_blocks)]
        self._positions: dict[Hashable, _Position] = {}
        self._ticks = itertools.count(1)
        self._reset_candidates()

    def _reset_candidates(self) -> None:
        self._dead: dict[int, None] = {}
        self._narrow = _CandidateSet()
        self._branch = _CandidateSet()

    @property
    def alpha(self) -> float:
        return self._policy.alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._policy.alpha = value

    @property
    def num_blocks(self) -> int:
        return len(self._slots)

    # ------------------------------------------------------------------ engine events

    def admit(self, block_id: int, key: Hashable, group: int, end: int) -> None:
        """Block ``block_id`` of KV-cache group ``group`` now caches the boundary ``key`` (``end`` tokens)."""
        slot = self._slots[block_id]
        if slot.kind is not None:
            self.drop(block_id)
        if group in self.state_groups:
            kind = STATE
        elif group in self.fa_groups:
            kind = FA
        else:
            raise ValueError(f"BlockCacheIndex: group {group} is neither an FA nor a state group")
        slot.kind, slot.group, slot.key, slot.end = kind, group, key, end
        slot.parent, slot.parent_generation, slot.children = -1, -1, 0
        if kind == STATE:
            slot.efficiency = self.costs.state_efficiency(0, end)
        position = self._positions.get(key)
        if position is None:
            position = self._positions[key] = _Position()
        (position.states if kind == STATE else position.fa).setdefault(group, []).append(block_id)
        self._refresh_position(key)

    def link_parent(self, block_id: int, parent_id: int) -> None:
        """FA block ``block_id`` continues FA block ``parent_id`` (the previous block of the same chain)."""
        slot, parent = self._slots[block_id], self._slots[parent_id]
        if slot.kind != FA or parent.kind != FA or slot.parent >= 0:
            return
        slot.parent, slot.parent_generation = parent_id, parent.generation
        parent.children += 1
        self._refresh_position(parent.key)

    def set_parent_end(self, block_id: int, parent_end: int) -> None:
        """State block ``block_id``'s node starts after the state at ``parent_end`` tokens."""
        slot = self._slots[block_id]
        if slot.kind != STATE:
            return
        slot.efficiency = self.costs.state_efficiency(parent_end, slot.end)
        self._classify(block_id)

    def drop(self, block_id: int) -> None:
        """Block ``block_id`` lost its key (evicted, overwritten, or un-cached by the admission policy)."""
        slot = self._slots[block_id]
        if slot.kind is None:
            return
        self._unplace(block_id)
        key = slot.key
        position = self._positions[key]
        group_blocks = (position.states if slot.kind == STATE else position.fa)[slot.group]
        group_blocks.remove(block_id)
        if not group_blocks:
            del (position.states if slot.kind == STATE else position.fa)[slot.group]
        if not position.fa and not position.states:
            del self._positions[key]
        parent_key = None
        if slot.parent >= 0:
            parent = self._slots[slot.parent]
            if parent.generation == slot.parent_generation and parent.kind == FA:
                parent.children -= 1
                parent_key = parent.key
        slot.kind, slot.key, slot.group, slot.parent, slot.children = None, None, -1, -1, 0
        slot.generation += 1
        if key in self._positions:
            self._refresh_position(key)
        if parent_key is not None:
            self._refresh_position(parent_key)

    def release(self, block_id: int) -> None:
        """Block ``block_id``'s reference count reached 0: it is free, most recently used."""
        slot = self._slots[block_id]
        slot.free = True
        slot.recency = next(self._ticks)
        self._classify(block_id)

    def acquire(self, block_id: int) -> None:
        """Free block ``block_id`` is in use again (hit, or handed out for new content)."""
        slot = self._slots[block_id]
        slot.free = False
        self._unplace(block_id)

    def reset(self) -> None:
        """Every key is gone (vLLM's ``reset_prefix_cache``); free/in-use status is kept."""
        for slot in self._slots:
            slot.kind, slot.key, slot.group, slot.parent, slot.children = None, None, -1, -1, 0
            slot.candidate, slot.member = None, None
            slot.generation += 1
        self._positions.clear()
        self._reset_candidates()

    # ------------------------------------------------------------------ picks

    def pick_victim(self) -> int | None:
        """The free cached block to overwrite next, or None when no free block is a candidate."""
        if self._dead:
            return next(iter(self._dead))
        node = self._narrow.pick(self.alpha)
        if node is None:
            node = self._branch.pick(self.alpha)
        return node

    def is_cached(self, block_id: int) -> bool:
        return self._slots[block_id].kind is not None

    def is_free(self, block_id: int) -> bool:
        return self._slots[block_id].free

    def candidate_of(self, block_id: int) -> str | None:
        """``dead``, ``narrow``, ``branch`` or None (not evictable now), for tests and reports."""
        return self._slots[block_id].candidate

    def state_efficiency(self, block_id: int) -> float:
        return self._slots[block_id].efficiency

    def num_candidates(self) -> int:
        return len(self._dead) + self._narrow.size + self._branch.size

    # ------------------------------------------------------------------ classification

    def _state_complete(self, position: _Position) -> bool:
        return len(position.states) == len(self.state_groups)

    def _fa_complete(self, position: _Position) -> bool:
        return len(position.fa) == len(self.fa_groups)

    def _refresh_position(self, key: Hashable) -> None:
        position = self._positions.get(key)
        if position is None:
            return
        for blocks in (*position.fa.values(), *position.states.values()):
            for block_id in blocks:
                self._classify(block_id)

    def _wanted(self, block_id: int) -> str | None:
        slot = self._slots[block_id]
        if not slot.free or slot.kind is None:
            return None
        position = self._positions[slot.key]
        if slot.kind == FA:
            if slot.children > 0 or self._state_complete(position):
                return None
            return DEAD
        if not self._state_complete(position) or not self._fa_complete(position):
            return DEAD
        children = max((self._slots[fa].children for blocks in position.fa.values() for fa in blocks), default=0)
        return NARROW if children <= 1 else BRANCH

    def _classify(self, block_id: int) -> None:
        wanted = self._wanted(block_id)
        slot = self._slots[block_id]
        if wanted != slot.candidate:
            self._unplace(block_id)
        if wanted is None:
            return
        if wanted == DEAD:
            self._dead[block_id] = None
        else:
            candidates = self._narrow if wanted == NARROW else self._branch
            bucket = self._policy.bucket_of(slot.efficiency)
            slot.member = candidates.place(slot.member, True, block_id, slot.recency, slot.efficiency, bucket)
        slot.candidate = wanted

    def _unplace(self, block_id: int) -> None:
        slot = self._slots[block_id]
        if slot.candidate == DEAD:
            del self._dead[block_id]
        elif slot.candidate is not None:
            candidates = self._narrow if slot.candidate == NARROW else self._branch
            candidates.place(slot.member, False, block_id, 0, 0.0, 0)
        slot.candidate, slot.member = None, None


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one finished request did to the cache, for shadow replays.

    ``keys`` are the prefix-cache keys of its full blocks in order (boundary ``i`` covers ``(i + 1) *
    block_size`` tokens), ``max_hit_blocks`` how many of them a lookup may reuse (vLLM recomputes the last
    prompt token), ``states`` the ``(block index, parent state end in tokens)`` of the states it left cached.
    """

    keys: tuple[Hashable, ...]
    max_hit_blocks: int
    states: tuple[tuple[int, int], ...]


class ShadowCache:
    """A model of vLLM's hybrid prefix cache over abstract blocks, evicting through a :class:`BlockCacheIndex`.

    It replays recorded requests one at a time from an empty cache of ``num_blocks`` blocks: a lookup hits the
    longest run of FA blocks (every FA group) capped at ``max_hit_blocks``, cut back to the deepest complete
    state in it, as vLLM's hybrid coordinator does; the request then holds its hit, caches its other FA blocks
    and its recorded states, allocating (and evicting) as needed, and releases everything tail first. It does
    not model requests running concurrently (they only hold blocks longer), the running state a request
    computes in (one block per Mamba group) or states it cached and dropped before finishing.
    """

    def __init__(self, index: BlockCacheIndex, block_size: int) -> None:
        self.index = index
        self.block_size = block_size
        self._unused = list(range(index.num_blocks - 1, -1, -1))
        self._by_key: dict[tuple[Hashable, int], int] = {}
        self._owner: dict[int, tuple[Hashable, int]] = {}

    def serve(self, record: RequestRecord) -> int:
        """Replay ``record``; returns the tokens its lookup hit."""
        keys = record.keys
        fa_groups, state_groups = self.index.fa_groups, self.index.state_groups
        reach = 0
        limit = min(len(keys), record.max_hit_blocks)
        while reach < limit and all((keys[reach], group) in self._by_key for group in fa_groups):
            reach += 1
        hit = 0
        for blocks in range(reach, 0, -1):
            if all((keys[blocks - 1], group) in self._by_key for group in state_groups):
                hit = blocks
                break
        held: list[int] = []
        for position in range(hit):
            for group in fa_groups:
                held.append(self._take(self._by_key[(keys[position], group)]))
        if hit:
            for group in state_groups:
                held.append(self._take(self._by_key[(keys[hit - 1], group)]))
        previous = {group: (held[(hit - 1) * len(fa_groups) + n] if hit else -1) for n, group in enumerate(fa_groups)}
        complete = True
        for position in range(hit, len(keys)):
            for group in fa_groups:
                block_id = self._cache(keys[position], group, (position + 1) * self.block_size, held)
                if block_id is None:
                    complete = False
                    break
                if previous[group] >= 0:
                    self.index.link_parent(block_id, previous[group])
                previous[group] = block_id
            if not complete:
                break
        for position, parent_end in record.states:
            if not complete or position < hit or position >= len(keys):
                continue
            for group in state_groups:
                block_id = self._cache(keys[position], group, (position + 1) * self.block_size, held)
                if block_id is None:
                    break
                self.index.set_parent_end(block_id, parent_end)
        for block_id in reversed(held):
            self.index.release(block_id)
        return hit * self.block_size

    def _take(self, block_id: int) -> int:
        self.index.acquire(block_id)
        return block_id

    def _cache(self, key: Hashable, group: int, end: int, held: list[int]) -> int | None:
        existing = self._by_key.get((key, group))
        if existing is not None:
            # Requests replay one at a time, so a block in use is already this request's.
            if self.index.is_free(existing):
                self.index.acquire(existing)
                held.append(existing)
            return existing
        block_id = self._allocate()
        if block_id is None:
            return None
        self._by_key[(key, group)] = block_id
        self._owner[block_id] = (key, group)
        self.index.admit(block_id, key, group, end)
        held.append(block_id)
        return block_id

    def _allocate(self) -> int | None:
        if self._unused:
            return self._unused.pop()
        victim = self.index.pick_victim()
        if victim is None:
            return None
        self.index.acquire(victim)
        self.index.drop(victim)
        del self._by_key[self._owner.pop(victim)]
        return victim


def shadow_hits(
    records: Sequence[RequestRecord],
    *,
    num_blocks: int,
    block_size: int,
    fa_groups: Sequence[int],
    state_groups: Sequence[int],
    costs: BlockCosts,
    alpha: float,
) -> int:
    """Tokens hit when ``records`` are replayed through an empty :class:`ShadowCache` evicting with ``alpha``."""
    index = BlockCacheIndex(num_blocks, fa_groups, state_groups, costs, alpha=alpha)
    shadow = ShadowCache(index, block_size)
    return sum(shadow.serve(record) for record in records)
