"""Which free cached block vLLM should overwrite next under Marconi's FLOP-aware eviction; engine-free.

vLLM keeps every cached block of a hybrid model in one pool: full-attention (FA) blocks, one per FA group and
``block_size`` tokens, and recurrent-state blocks, one per Mamba group for the state after a block boundary.
A hit of ``n`` blocks needs the FA blocks of all ``n`` boundaries in every FA group and the state at boundary
``n`` in every Mamba group; vLLM finds blocks by key (a hash of the whole prefix), so when two requests
computed the same block, either copy serves.

:class:`BlockCacheIndex` tracks the free cached blocks and picks the one of lowest Marconi utility
``recency + alpha * efficiency``, both min-max normalised over the free cached blocks (the FLOP-aware policy's
candidate set, :class:`~hybrid_prefix_cache.policies.eviction.FlopAwareEviction`):

- Recency is a release counter, so with ``alpha == 0`` the order is exactly vLLM's LRU (vLLM releases a finished
  request's blocks tail first, and a hit takes blocks out of the free set until they are released again). The
  alpha tuner's guard relies on this: alpha 0 is the LRU baseline.
- Efficiency is Marconi's, per node of its tree: a node is a cached state plus the FA blocks since its parent
  state (the state the request resumed from, or the last one it kept), and all its blocks carry the prefill
  FLOPs from the parent to the state per byte the node holds (:meth:`BlockCosts.node_efficiency`).
- A block no hit can use (*dead*) has efficiency 0: a redundant copy of a key that another block of its group
  holds; an FA block that no cached FA block continues and that has no complete state at its boundary; a
  state block whose boundary lacks a block of some Mamba or FA group. FA blocks covered by no state score 0.

Subsumed states go first, as in the tree policy. A state is *subsumed* when its boundary has exactly one
cached FA continuation (it is not a branch point) and one of its child nodes (a node whose parent state it is)
has a complete state with its FA blocks at that boundary: a request that continues along the path, such as the
next turn of the conversation, resumes from the child's state, so dropping the parent's loses nothing for it.
For ``alpha > 0`` :meth:`BlockCacheIndex.pick_victim` takes the oldest free subsumed state block before scoring
anything (every state block of the boundary is subsumed, so the whole state goes together); without this a
multi-turn session keeps one state per past turn. The node's FA blocks stay where they are: the child's hit
needs them. ``alpha == 0`` ignores the rule, so it stays vLLM's LRU. The child's completeness is read at its
boundary only (O(G) per change): a missing FA block between the two states makes the child unreachable while
the parent still counts as subsumed (rare: the FA blocks between them form one node with one efficiency, and
vLLM releases a chain tail first, so a chain loses its end first).

Eviction is per block, as vLLM frees memory, rather than Marconi's per node, and node efficiencies are fixed
when the request that cached the node finishes (Marconi recomputes a child's when its parent's state is
evicted). Each operation costs O(G) for G KV-cache groups plus O(log n) heap work; a pick
O(buckets + log n); :meth:`BlockCacheIndex.assign_node` O(G) per boundary of the node.

:class:`ShadowCache` replays :class:`RequestRecord` windows through a fresh index for
:class:`~hybrid_prefix_cache.policies.tuning.AlphaTuner` (see its docstring for what it models).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybrid_prefix_cache.policies.eviction import DEFAULT_BUCKETS, CandidateSet, FlopAwareEviction

FA = "fa"
STATE = "state"
DEAD = "dead"
SCORED = "scored"
SUBSUMED = "subsumed"


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

    def node_efficiency(self, parent_end: int, end: int) -> float:
        """FLOPs from the parent state to ``end`` per byte of the node: its state and the FA blocks since."""
        parent_end = min(max(parent_end, 0), end)
        held = self.state_bytes + (end - parent_end) * self.num_fa_groups * self.block_bytes // self.block_size
        return self.model.segment_flops(parent_end, end) / max(held, 1)


class _Slot:
    """Side-table entry of one block id (vLLM's ``KVCacheBlock`` has ``__slots__``: no room for ours)."""

    __slots__ = ("candidate", "efficiency", "free", "group", "key", "kind", "member", "recency", "subsumed_member")

    def __init__(self) -> None:
        self.kind: str | None = None
        self.group = -1
        self.key: Hashable = None
        self.free = False
        self.recency = 0
        self.efficiency = 0.0
        self.candidate: str | None = None
        self.member = None
        self.subsumed_member = None


class _Position:
    """The cached blocks of one boundary, by group (several blocks of a group are identical copies)."""

    __slots__ = ("complete", "efficiency", "fa", "states")

    def __init__(self) -> None:
        self.fa: dict[int, list[int]] = {}
        self.states: dict[int, list[int]] = {}
        self.efficiency = 0.0
        # Every state group and every FA group has a block here: a hit can end at this boundary.
        self.complete = False


class BlockCacheIndex:
    """Free cached blocks ordered for eviction; see the module docstring.

    Block ids are ``0 .. num_blocks - 1``; ``fa_groups`` and ``state_groups`` are the KV-cache group ids of
    each kind. The engine reports every change: :meth:`admit` (a block got its prefix-cache key),
    :meth:`link_parent` (an FA block continues another), :meth:`assign_node` / :meth:`assign_states` (a
    finished request's states, the FA boundaries since their parents and the parents' boundaries),
    :meth:`drop` (a block lost its key), :meth:`release` (its reference count reached 0) and :meth:`acquire`
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
        # Only its buckets and alpha validation are used: the candidate set lives here.
        self._policy = FlopAwareEviction(costs, alpha=alpha, buckets=buckets)
        self._slots = [_Slot() for _ in range(num_blocks)]
        self._ticks = itertools.count(1)
        self._reset_keys()

    def _reset_keys(self) -> None:
        self._positions: dict[Hashable, _Position] = {}
        # The chain is a property of the keys (a key hashes its parent's), so it is kept per key: a key's
        # parent while the key is cached, and the child keys that have an FA block cached.
        self._parent_of: dict[Hashable, Hashable] = {}
        self._children: dict[Hashable, set[Hashable]] = {}
        # Marconi's tree between states, per state boundary: the parent state's boundary of the node ending
        # there, and per parent its child nodes' boundaries and how many of them are complete. Kept while the
        # child boundary is cached, so a parent that is cached again finds its children.
        self._node_parent: dict[Hashable, Hashable] = {}
        self._node_children: dict[Hashable, set[Hashable]] = {}
        self._complete_children: dict[Hashable, int] = {}
        self._candidates = CandidateSet()
        # The free subsumed state blocks (also in ``_candidates``, which alone orders alpha == 0).
        self._subsumed = CandidateSet()

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

    def admit(self, block_id: int, key: Hashable, group: int) -> None:
        """Block ``block_id`` of KV-cache group ``group`` now caches the boundary ``key``."""
        slot = self._slots[block_id]
        if slot.kind is not None:
            self.drop(block_id)
        if group in self.state_groups:
            kind = STATE
        elif group in self.fa_groups:
            kind = FA
        else:
            raise ValueError(f"BlockCacheIndex: group {group} is neither an FA nor a state group")
        position = self._positions.get(key)
        if position is None:
            position = self._positions[key] = _Position()
        slot.kind, slot.group, slot.key, slot.efficiency = kind, group, key, position.efficiency
        had_fa = bool(position.fa)
        (position.states if kind == STATE else position.fa).setdefault(group, []).append(block_id)
        if kind == FA and not had_fa:
            self._fa_appeared(key)
        self._refresh(key)
        self._update_complete(key, position)

    def link_parent(self, block_id: int, parent_id: int) -> None:
        """FA block ``block_id`` continues FA block ``parent_id`` (the previous block of the same chain)."""
        slot, parent = self._slots[block_id], self._slots[parent_id]
        if slot.kind != FA or parent.kind != FA or slot.key in self._parent_of:
            return
        self._parent_of[slot.key] = parent.key
        self._fa_appeared(slot.key)

    def assign_node(self, keys: Sequence[Hashable], efficiency: float, parent_key: Hashable = None) -> None:
        """The boundaries ``keys`` (those of the FA blocks since the parent state, ending with the state's) form
        one node of Marconi's tree with this ``efficiency``; their cached blocks take it. ``parent_key`` is the
        parent state's boundary (None: the node starts at the root)."""
        if keys and parent_key is not None:
            self._link_node(keys[-1], parent_key)
        for key in keys:
            position = self._positions.get(key)
            if position is None or position.efficiency == efficiency:
                continue
            position.efficiency = efficiency
            for blocks in (*position.fa.values(), *position.states.values()):
                for block_id in blocks:
                    self._slots[block_id].efficiency = efficiency
            self._refresh(key)

    def assign_states(self, keys: Sequence[Hashable], states: Sequence[tuple[int, int]]) -> None:
        """A request whose full blocks have the boundaries ``keys`` left the states ``(block index, parent state
        end in tokens)``: each becomes a node (:meth:`assign_node`) with Marconi's efficiency."""
        block_size = self.costs.block_size
        for position, parent_end in states:
            if position >= len(keys):
                continue
            efficiency = self.costs.node_efficiency(parent_end, (position + 1) * block_size)
            parent_blocks = parent_end // block_size
            parent_key = keys[parent_blocks - 1] if 0 < parent_blocks <= position else None
            self.assign_node(node_keys(keys, position, parent_end, block_size), efficiency, parent_key)

    def drop(self, block_id: int) -> None:
        """Block ``block_id`` lost its key (evicted, overwritten, or un-cached by the admission policy)."""
        slot = self._slots[block_id]
        if slot.kind is None:
            return
        self._unplace(block_id)
        key, kind = slot.key, slot.kind
        position = self._positions[key]
        by_group = position.states if kind == STATE else position.fa
        by_group[slot.group].remove(block_id)
        if not by_group[slot.group]:
            del by_group[slot.group]
        slot.kind, slot.key, slot.group, slot.efficiency = None, None, -1, 0.0
        if kind == FA and not position.fa:
            parent_key = self._parent_of.get(key)
            siblings = self._children.get(parent_key) if parent_key is not None else None
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[parent_key]
                self._refresh(parent_key)
        self._update_complete(key, position)
        if not position.fa and not position.states:
            del self._positions[key]
            self._parent_of.pop(key, None)
            self._unlink_node(key)
        else:
            self._refresh(key)

    def release(self, block_id: int) -> None:
        """Block ``block_id``'s reference count reached 0: it is free, most recently used."""
        slot = self._slots[block_id]
        slot.free = True
        slot.recency = next(self._ticks)
        self._refresh_copies(block_id)

    def acquire(self, block_id: int) -> None:
        """Free block ``block_id`` is in use again (hit, or handed out for new content)."""
        slot = self._slots[block_id]
        slot.free = False
        self._unplace(block_id)
        self._refresh_copies(block_id)

    def reset(self) -> None:
        """Every key is gone (vLLM's ``reset_prefix_cache``); free/in-use status is kept."""
        for slot in self._slots:
            slot.kind, slot.key, slot.group, slot.efficiency = None, None, -1, 0.0
            slot.candidate, slot.member, slot.subsumed_member = None, None, None
        self._reset_keys()

    # ------------------------------------------------------------------ picks and inspection

    def pick_victim(self) -> int | None:
        """The free cached block to overwrite next, or None when no free block is cached."""
        if self.alpha and self._subsumed.size:
            return self._subsumed.pick(0.0)
        return self._candidates.pick(self.alpha)

    def is_cached(self, block_id: int) -> bool:
        return self._slots[block_id].kind is not None

    def is_free(self, block_id: int) -> bool:
        return self._slots[block_id].free

    def candidate_of(self, block_id: int) -> str | None:
        """``subsumed``, ``dead``, ``scored`` or None (in use or not cached)."""
        return self._slots[block_id].candidate

    def efficiency_of(self, block_id: int) -> float:
        return self._slots[block_id].efficiency

    def num_candidates(self) -> int:
        return self._candidates.size

    def num_subsumed(self) -> int:
        return self._subsumed.size

    def check_invariants(self) -> None:
        """Recompute the node relations' counts and every block's class from scratch and compare; O(n), for
        tests."""
        for key, position in self._positions.items():
            complete = self._is_complete(position)
            assert position.complete == complete, f"{key!r}: complete flag {position.complete}, expected {complete}"
        for key, parent_key in self._node_parent.items():
            assert key in self._positions, f"{key!r}: node parent kept after its blocks are gone"
            assert key in self._node_children.get(parent_key, ()), f"{key!r}: missing from its parent's children"
        assert set(self._complete_children) == set(self._node_children), "child counts and child sets disagree"
        for parent_key, children in self._node_children.items():
            assert all(self._node_parent.get(child) == parent_key for child in children), f"{parent_key!r}: stale child"
            complete = sum(self._positions[child].complete for child in children)
            held = self._complete_children[parent_key]
            assert held == complete, f"{parent_key!r}: {held} complete children counted, {complete} found"
        subsumed = 0
        for block_id, slot in enumerate(self._slots):
            wanted = self._wanted(block_id)
            assert slot.candidate == wanted, f"block {block_id}: class {slot.candidate}, expected {wanted}"
            assert (slot.member is not None) == (wanted is not None), f"block {block_id}: candidate membership"
            assert (slot.subsumed_member is not None) == (wanted == SUBSUMED), f"block {block_id}: subsumed membership"
            subsumed += wanted == SUBSUMED
        assert self._subsumed.size == subsumed, f"{self._subsumed.size} subsumed members, {subsumed} expected"

    # ------------------------------------------------------------------ classification

    def _fa_appeared(self, key: Hashable) -> None:
        parent_key = self._parent_of.get(key)
        position = self._positions.get(key)
        if parent_key is None or position is None or not position.fa:
            return
        children = self._children.setdefault(parent_key, set())
        if key not in children:
            children.add(key)
            self._refresh(parent_key)

    def _is_complete(self, position: _Position) -> bool:
        return len(position.states) == len(self.state_groups) and len(position.fa) == len(self.fa_groups)

    def _update_complete(self, key: Hashable, position: _Position) -> None:
        complete = self._is_complete(position)
        if complete != position.complete:
            position.complete = complete
            parent_key = self._node_parent.get(key)
            if parent_key is not None:
                self._count_complete_child(parent_key, 1 if complete else -1)

    def _count_complete_child(self, parent_key: Hashable, delta: int) -> None:
        before = self._complete_children.get(parent_key, 0)
        self._complete_children[parent_key] = before + delta
        if (before > 0) != (before + delta > 0):
            self._refresh(parent_key)

    def _link_node(self, key: Hashable, parent_key: Hashable) -> None:
        """The node whose state is at ``key`` has its parent state at ``parent_key``."""
        position = self._positions.get(key)
        if position is None or key == parent_key or self._node_parent.get(key) == parent_key:
            return
        self._unlink_node(key)
        self._node_parent[key] = parent_key
        self._node_children.setdefault(parent_key, set()).add(key)
        self._complete_children.setdefault(parent_key, 0)
        if position.complete:
            self._count_complete_child(parent_key, 1)

    def _unlink_node(self, key: Hashable) -> None:
        parent_key = self._node_parent.pop(key, None)
        if parent_key is None:
            return
        position = self._positions.get(key)
        if position is not None and position.complete:
            self._count_complete_child(parent_key, -1)
        siblings = self._node_children[parent_key]
        siblings.discard(key)
        if not siblings:
            del self._node_children[parent_key]
            del self._complete_children[parent_key]

    def _subsumed_at(self, key: Hashable) -> bool:
        """Whether the state at ``key`` lies on one path only and a child node there has a complete state."""
        continuations = self._children.get(key)
        return self._complete_children.get(key, 0) > 0 and continuations is not None and len(continuations) == 1

    def _refresh(self, key: Hashable) -> None:
        position = self._positions.get(key)
        if position is None:
            return
        for blocks in (*position.fa.values(), *position.states.values()):
            for block_id in blocks:
                self._classify(block_id)

    def _refresh_copies(self, block_id: int) -> None:
        """A block's free/in-use change reclassifies it and the other copies of its group (the kept one moves)."""
        slot = self._slots[block_id]
        if slot.kind is None:
            return
        position = self._positions[slot.key]
        for copy in (position.states if slot.kind == STATE else position.fa)[slot.group]:
            self._classify(copy)

    def _kept_copy(self, copies: list[int]) -> int:
        for block_id in copies:
            if not self._slots[block_id].free:
                return block_id
        return copies[0]

    def _wanted(self, block_id: int) -> str | None:
        slot = self._slots[block_id]
        if not slot.free or slot.kind is None:
            return None
        position = self._positions[slot.key]
        if slot.kind == STATE and self._subsumed_at(slot.key):
            return SUBSUMED
        copies = (position.states if slot.kind == STATE else position.fa)[slot.group]
        if len(copies) > 1 and self._kept_copy(copies) != block_id:
            return DEAD
        state_complete = len(position.states) == len(self.state_groups)
        if slot.kind == FA:
            return SCORED if self._children.get(slot.key) or state_complete else DEAD
        return SCORED if state_complete and len(position.fa) == len(self.fa_groups) else DEAD

    def _classify(self, block_id: int) -> None:
        wanted = self._wanted(block_id)
        slot = self._slots[block_id]
        if wanted is None:
            self._unplace(block_id)
            return
        # A block no hit can use saves nothing, nor does a subsumed state while its child is cached.
        efficiency = slot.efficiency if wanted == SCORED else 0.0
        bucket = self._policy.bucket_of(efficiency)
        slot.member = self._candidates.place(slot.member, True, block_id, slot.recency, efficiency, bucket)
        slot.subsumed_member = self._subsumed.place(
            slot.subsumed_member, wanted == SUBSUMED, block_id, slot.recency, 0.0, 0
        )
        slot.candidate = wanted

    def _unplace(self, block_id: int) -> None:
        slot = self._slots[block_id]
        if slot.candidate is not None:
            self._candidates.place(slot.member, False, block_id, 0, 0.0, 0)
            self._subsumed.place(slot.subsumed_member, False, block_id, 0, 0.0, 0)
        slot.candidate, slot.member, slot.subsumed_member = None, None, None


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


def node_keys(keys: Sequence[Hashable], position: int, parent_end: int, block_size: int) -> Sequence[Hashable]:
    """The boundaries of the node whose state is at block ``position`` and whose parent state ends at
    ``parent_end`` tokens: the FA blocks after the parent up to and including the state's boundary."""
    return keys[parent_end // block_size : position + 1]


class ShadowCache:
    """A model of vLLM's hybrid prefix cache over abstract blocks, evicting through a :class:`BlockCacheIndex`.

    It replays recorded requests one at a time from an empty cache of ``num_blocks`` blocks: a lookup hits the
    longest run of FA blocks (every FA group) capped at ``max_hit_blocks``, cut back to the deepest complete
    state in it, as vLLM's hybrid coordinator does; the request then holds its hit, caches its other FA blocks
    and its recorded states, allocating (and evicting) as needed, and releases them as vLLM does: states first
    (vLLM frees a state block once decoding moved past it), then the FA blocks tail first. The recorded states
    become nodes whose parents are the states the engine resumed from, as in the pool, so with ``alpha > 0`` the
    shadow drops subsumed states first too, and the tuner weighs that rule with the alpha. It does not model
    requests running concurrently (they only hold blocks longer), the running state a request computes in (one
    block per Mamba group) or states it cached and dropped before finishing.
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
        fa_held: list[int] = []
        state_held: list[int] = []
        for position in range(hit):
            for group in fa_groups:
                fa_held.append(self._take(self._by_key[(keys[position], group)]))
        if hit:
            for group in state_groups:
                state_held.append(self._take(self._by_key[(keys[hit - 1], group)]))
        previous = {group: fa_held[(hit - 1) * len(fa_groups) + n] if hit else -1 for n, group in enumerate(fa_groups)}
        cached_blocks = hit
        for position in range(hit, len(keys)):
            for group in fa_groups:
                block_id = self._cache(keys[position], group, fa_held)
                if block_id is None:
                    break
                if previous[group] >= 0:
                    self.index.link_parent(block_id, previous[group])
                previous[group] = block_id
            else:
                cached_blocks = position + 1
                continue
            break
        for position, _ in record.states:
            if hit <= position < cached_blocks:
                for group in state_groups:
                    if self._cache(keys[position], group, state_held) is None:
                        break
        self.index.assign_states(keys, record.states)
        for block_id in (*state_held, *reversed(fa_held)):
            self.index.release(block_id)
        return hit * self.block_size

    def _take(self, block_id: int) -> int:
        self.index.acquire(block_id)
        return block_id

    def _cache(self, key: Hashable, group: int, held: list[int]) -> int | None:
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
        self.index.admit(block_id, key, group)
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
