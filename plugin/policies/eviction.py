"""FLOP-aware eviction (Marconi, arXiv 2411.19379) at O(B + log n) per pick instead of Marconi's O(n).

A candidate's utility is ``recency + alpha * flop_efficiency``, both min-max normalised over the current
candidates; the lowest utility is evicted. ``flop_efficiency`` is the prefill FLOPs the node saves relative to
its parent (``spec.segment_flops(node.start, node.end)``) per byte it holds (its KV, plus its state if it has
one). ``alpha == 0`` is plain LRU, exactly :class:`LRUEviction` (which it delegates to): the fallback the
tuner's guard keeps unless a tuned alpha measurably wins.

Candidates and their recency (the tree's logical clock ticks):

- ``pick_leaf``: unlocked leaves, by ``last_access``. Each holds a state: the tree drops an unlocked leaf
  without one at once.
- ``pick_state``: nodes with an unlocked state and at most one child (Marconi: dropping the state of a node with
  one child lets the child absorb its KV, while a branch point's state serves several paths), by
  ``state_access``. When there is none, any node with an unlocked state, so that state eviction never stalls.
- ``pick_victim``: both at once, for one budget shared by KV and states. An unlocked leaf is freed whole and is
  as recent as the older of its ``last_access`` and ``state_access`` (the LRU baseline reaches such a leaf
  through either of its two lists); any other candidate only loses its state and is as recent as its
  ``state_access``. Falls back to branch-point states like ``pick_state``.

Subsumed states go first. The state of a node with exactly one child is subsumed by the states below it: a
request that continues along the path (the next turn of a conversation extends the previous one) resumes from
a deeper state, so the shallower one serves only a request that leaves the path between the two, or a fallback
once the deeper ones are gone. It saves no FLOPs while they are cached, so for ``alpha > 0`` ``pick_state`` and
``pick_victim`` drop the oldest subsumed state before scoring anything else (otherwise a multi-turn session
keeps one state per past turn: on the ShareGPT trace at 10 GB in vLLM's memory layout, two thirds of the cached
states). ``alpha == 0`` keeps LRU's order exactly, so the tuner's guard still compares against plain LRU.

Each candidate set files its members into ``B`` log-spaced efficiency buckets, each a heap ordered by recency.
Within a bucket efficiencies are nearly equal, so its oldest member is (up to the bucket's width) its lowest
utility, and a pick only scores the heads of the non-empty buckets. The oldest candidate is the oldest head; the
newest candidate and the least and most efficient ones come from three more heaps. All heaps delete lazily (an
entry is live while its stamp is its member's current one) and are rebuilt when stale entries outnumber live
ones. ``docs/policies.md`` derives the error bound of the bucketing and the costs.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator
from typing import Protocol

from hybrid_prefix_cache.core.tree import HybridRadixTree, LRUEviction, Node

DEFAULT_BUCKETS = 128
DEFAULT_MAX_CONTEXT = 1 << 20

# A heap is rebuilt from its live entries once it holds more than twice as many entries as live members plus
# this slack; the slack keeps small heaps from being rebuilt after every few updates.
_COMPACTION_SLACK = 32

CANDIDATE_KINDS = ("leaf", "state", "victim", "subsumed")


class CostSpec(Protocol):
    """What the policy needs from a model; :class:`hybrid_prefix_cache.cost_model.ModelSpec` provides it."""

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def state_bytes(self) -> int: ...

    def segment_flops(self, start: int, end: int) -> float: ...


class _Member:
    """One node's membership in one candidate set, under its current recency and efficiency stamps."""

    __slots__ = ("bucket", "efficiency", "efficiency_stamp", "node", "recency", "stamp")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.recency = 0
        self.bucket = 0
        self.stamp = -1
        self.efficiency = 0.0
        self.efficiency_stamp = -1


class CandidateSet:
    """The nodes eligible for one kind of pick, bucketed by efficiency and ordered by recency in each bucket.

    Heap entries are ``(key, stamp)`` pairs; ``_live`` maps the current stamps (a member holds one for its
    recency and one for its efficiency) to their member, so an entry whose stamp is gone is stale. Entries hold
    no object references, which keeps them out of the garbage collector's traversals. Members may be any
    object, not only tree nodes: the vLLM adapter files cached blocks in one.
    """

    __slots__ = (
        "_bucket_sizes",
        "_buckets",
        "_least_efficient",
        "_live",
        "_most_efficient",
        "_newest",
        "_stamps",
        "size",
    )

    def __init__(self) -> None:
        self._stamps = itertools.count()
        self._live: dict[int, _Member] = {}
        self._buckets: dict[int, list[tuple[int, int]]] = {}
        self._bucket_sizes: dict[int, int] = {}
        self._newest: list[tuple[int, int]] = []
        self._least_efficient: list[tuple[float, int]] = []
        self._most_efficient: list[tuple[float, int]] = []
        self.size = 0

    def place(
        self, member: _Member | None, wanted: bool, node: Node, recency: int, efficiency: float, bucket: int
    ) -> _Member | None:
        """Add, re-key or remove ``node`` so that it is a member exactly when ``wanted``; returns its member."""
        if not wanted:
            if member is not None:
                self._remove(member)
            return None
        if member is None:
            member = _Member(node)
            self.size += 1
            self._file(member, recency, bucket)
            self._file_efficiency(member, efficiency)
            return member
        if member.efficiency != efficiency:
            del self._live[member.efficiency_stamp]
            self._file_efficiency(member, efficiency)
        if member.recency != recency or member.bucket != bucket:
            self._unfile(member)
            self._file(member, recency, bucket)
        return member

    def _push(self, heap: list, entry: tuple, live_entries: int) -> None:
        heapq.heappush(heap, entry)
        self._compact_if_stale(heap, live_entries)

    def _compact_if_stale(self, heap: list, live_entries: int) -> None:
        if len(heap) > 2 * live_entries + _COMPACTION_SLACK:
            live = self._live
            heap[:] = [entry for entry in heap if entry[1] in live]
            heapq.heapify(heap)

    def _top(self, heap: list) -> _Member:
        live = self._live
        while heap[0][1] not in live:
            heapq.heappop(heap)
        return live[heap[0][1]]

    def _file(self, member: _Member, recency: int, bucket: int) -> None:
        member.recency = recency
        member.bucket = bucket
        member.stamp = stamp = next(self._stamps)
        self._live[stamp] = member
        heap = self._buckets.get(bucket)
        if heap is None:
            heap = self._buckets[bucket] = []
            self._bucket_sizes[bucket] = 0
        self._bucket_sizes[bucket] += 1
        self._push(heap, (recency, stamp), self._bucket_sizes[bucket])
        self._push(self._newest, (-recency, stamp), self.size)

    def _file_efficiency(self, member: _Member, efficiency: float) -> None:
        member.efficiency = efficiency
        member.efficiency_stamp = stamp = next(self._stamps)
        self._live[stamp] = member
        self._push(self._least_efficient, (efficiency, stamp), self.size)
        self._push(self._most_efficient, (-efficiency, stamp), self.size)

    def _unfile(self, member: _Member) -> None:
        """Retire ``member``'s recency stamp; a bucket left empty is dropped with its stale entries."""
        del self._live[member.stamp]
        bucket = member.bucket
        remaining = self._bucket_sizes[bucket] - 1
        if remaining:
            self._bucket_sizes[bucket] = remaining
            self._compact_if_stale(self._buckets[bucket], remaining)
        else:
            del self._bucket_sizes[bucket]
            del self._buckets[bucket]

    def _remove(self, member: _Member) -> None:
        self._unfile(member)
        del self._live[member.efficiency_stamp]
        self.size -= 1
        for heap in (self._newest, self._least_efficient, self._most_efficient):
            self._compact_if_stale(heap, self.size)

    def _head_entries(self) -> list[tuple[int, int]]:
        """The live entry of the oldest member of every non-empty bucket."""
        live = self._live
        heads = []
        for heap in self._buckets.values():
            while heap[0][1] not in live:
                heapq.heappop(heap)
            heads.append(heap[0])
        return heads

    def pick(self, alpha: float) -> Node | None:
        if not self.size:
            return None
        live = self._live
        heads = self._head_entries()
        oldest_recency, oldest_stamp = min(heads)
        if alpha == 0:
            return live[oldest_stamp].node
        recency_span = self._top(self._newest).recency - oldest_recency
        least_efficiency = self._top(self._least_efficient).efficiency
        efficiency_span = self._top(self._most_efficient).efficiency - least_efficiency
        recency_scale = 1.0 / recency_span if recency_span else 0.0
        efficiency_scale = alpha / efficiency_span if efficiency_span else 0.0
        best_key = None
        for recency, stamp in heads:
            utility = (recency - oldest_recency) * recency_scale
            utility += (live[stamp].efficiency - least_efficiency) * efficiency_scale
            key = (utility, recency, stamp)
            if best_key is None or key < best_key:
                best_key = key
        return live[best_key[2]].node

    def members(self) -> Iterator[_Member]:
        """Every live member, for inspection (O(size))."""
        for stamp, member in self._live.items():
            if member.stamp == stamp:
                yield member

    def heap_entries(self) -> int:
        return (
            sum(len(heap) for heap in self._buckets.values())
            + len(self._newest)
            + len(self._least_efficient)
            + len(self._most_efficient)
        )


class _NodeData:
    """What the policy keeps in ``node.policy_data``: its memberships and its cached efficiency."""

    __slots__ = (
        "branch_point", "bucket", "efficiency", "leaf", "seen_access", "shape", "state", "subsumed", "victim",
    )

    def __init__(self) -> None:
        self.leaf: _Member | None = None
        self.state: _Member | None = None
        self.victim: _Member | None = None
        self.branch_point: _Member | None = None
        self.subsumed: _Member | None = None
        self.seen_access = -1
        self.shape: tuple[int, int, bool] | None = None
        self.efficiency = 0.0
        self.bucket = 0


class FlopAwareEviction:
    """Marconi's FLOP-aware eviction over the tree's nodes; see the module docstring.

    ``buckets`` log-spaced efficiency buckets span from the efficiency of one token at position 0 with a state
    to that of one stateless token at position ``max_context``; efficiencies outside that range go to the end
    buckets. ``alpha`` may be changed at any time (:class:`~hybrid_prefix_cache.policies.tuning.AlphaTuner`
    does): buckets depend on efficiency only, so only the next pick changes.
    """

    observes_nodes = True

    def __init__(
        self,
        spec: CostSpec,
        alpha: float = 0.0,
        buckets: int = DEFAULT_BUCKETS,
        *,
        max_context: int = DEFAULT_MAX_CONTEXT,
    ) -> None:
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise ValueError(f"FlopAwareEviction: buckets must be a positive integer, got {buckets!r}")
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"FlopAwareEviction: max_context must be a positive integer, got {max_context!r}")
        self.spec = spec
        self.alpha = alpha
        self.num_buckets = buckets
        self._kv_bytes_per_token = spec.kv_bytes_per_token
        self._state_bytes = spec.state_bytes
        if self._kv_bytes_per_token < 0 or self._state_bytes < 0:
            raise ValueError("FlopAwareEviction: the spec's kv_bytes_per_token and state_bytes must be >= 0")
        self.lowest_bucketed_efficiency = spec.segment_flops(0, 1) / max(
            self._kv_bytes_per_token + self._state_bytes, 1
        )
        highest = spec.segment_flops(max_context - 1, max_context) / max(self._kv_bytes_per_token, 1)
        if self.lowest_bucketed_efficiency > 0 and highest > self.lowest_bucketed_efficiency:
            self._buckets_per_log = buckets / math.log(highest / self.lowest_bucketed_efficiency)
        else:
            self._buckets_per_log = 0.0
        self.bucket_ratio = math.exp(1 / self._buckets_per_log) if self._buckets_per_log else math.inf
        self._tree: HybridRadixTree | None = None
        # alpha == 0 is the guard's fallback: it must be LRU exactly, candidate sets included, so it delegates.
        self._lru = LRUEviction()
        self._reset()

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"FlopAwareEviction: alpha must be a finite number >= 0, got {value!r}")
        self._alpha = float(value)

    def _reset(self) -> None:
        self._leaves = CandidateSet()
        self._states = CandidateSet()
        self._victims = CandidateSet()
        self._branch_states = CandidateSet()
        self._subsumed_states = CandidateSet()
        # The tree stamps ``state_access`` after it has notified the touched path (match, insert), so the
        # stateful nodes of every touched path are re-read before the next pick.
        self._state_touch_suspects: set[Node] = set()

    # ------------------------------------------------------------------ EvictionPolicy

    def attach(self, tree: HybridRadixTree) -> None:
        """Start observing ``tree`` (the tree calls this again when it resets: everything is forgotten)."""
        if self._tree is not None and self._tree is not tree:
            raise ValueError("FlopAwareEviction: this policy already serves another tree; give each tree its own")
        self._tree = tree
        self._lru.attach(tree)
        self._reset()

    def node_changed(self, node: Node) -> None:
        if node.parent is None:
            return  # the root, which is never a candidate
        data = node.policy_data
        if data is None:
            data = node.policy_data = _NodeData()
        has_state = node.state is not None
        if node.last_access != data.seen_access:
            data.seen_access = node.last_access
            if has_state:
                self._state_touch_suspects.add(node)
        # An unlocked leaf without a state is about to leave the tree (it drops such leaves at once), so it is
        # never a candidate, which spares re-filing a leaf that is being deleted.
        free_state = has_state and not node.state_lock
        unlocked_leaf = free_state and not node.full_lock and not node.children
        narrow = free_state and len(node.children) <= 1
        if free_state:
            efficiency, bucket = self._efficiency(node, data)
        else:
            efficiency, bucket = 0.0, 0
        data.leaf = self._leaves.place(data.leaf, unlocked_leaf, node, node.last_access, efficiency, bucket)
        data.state = self._states.place(data.state, narrow, node, node.state_access, efficiency, bucket)
        victim_recency = min(node.last_access, node.state_access) if unlocked_leaf else node.state_access
        data.victim = self._victims.place(
            data.victim, unlocked_leaf or narrow, node, victim_recency, efficiency, bucket
        )
        data.branch_point = self._branch_states.place(
            data.branch_point, free_state and not narrow, node, node.state_access, efficiency, bucket
        )
        data.subsumed = self._subsumed_states.place(
            data.subsumed, free_state and len(node.children) == 1, node, node.state_access, efficiency, bucket
        )

    def node_removed(self, node: Node) -> None:
        data = node.policy_data
        if data is None:
            return
        for candidates, member in (
            (self._leaves, data.leaf),
            (self._states, data.state),
            (self._victims, data.victim),
            (self._branch_states, data.branch_point),
            (self._subsumed_states, data.subsumed),
        ):
            candidates.place(member, False, node, 0, 0.0, 0)
        node.policy_data = None
        self._state_touch_suspects.discard(node)

    def pick_leaf(self) -> Node | None:
        if self._alpha == 0:
            return self._lru.pick_leaf()
        self._refresh_state_touches()
        return self._leaves.pick(self._alpha)

    def pick_state(self) -> Node | None:
        if self._alpha == 0:
            return self._lru.pick_state()
        self._refresh_state_touches()
        return (
            self._subsumed_states.pick(0.0)
            or self._states.pick(self._alpha)
            or self._branch_states.pick(self._alpha)
        )

    def pick_victim(self) -> Node | None:
        if self._alpha == 0:
            return self._lru.pick_victim()
        self._refresh_state_touches()
        return (
            self._subsumed_states.pick(0.0)
            or self._victims.pick(self._alpha)
            or self._branch_states.pick(self._alpha)
        )

    # ------------------------------------------------------------------ scoring

    def efficiency_of(self, node: Node) -> float:
        """FLOPs saved relative to the parent per byte held (a node holding nothing counts as one byte)."""
        held = len(node.key) * self._kv_bytes_per_token + (self._state_bytes if node.state is not None else 0)
        return self.spec.segment_flops(node.start, node.end) / max(held, 1)

    def bucket_of(self, efficiency: float) -> int:
        if efficiency <= self.lowest_bucketed_efficiency or not self._buckets_per_log:
            return 0
        bucket = int(math.log(efficiency / self.lowest_bucketed_efficiency) * self._buckets_per_log)
        return min(bucket, self.num_buckets - 1)

    def _efficiency(self, node: Node, data: _NodeData) -> tuple[float, int]:
        shape = (node.end, len(node.key), node.state is not None)
        if shape != data.shape:
            data.shape = shape
            data.efficiency = self.efficiency_of(node)
            data.bucket = self.bucket_of(data.efficiency)
        return data.efficiency, data.bucket

    def _refresh_state_touches(self) -> None:
        if self._state_touch_suspects:
            suspects, self._state_touch_suspects = self._state_touch_suspects, set()
            for node in suspects:
                self.node_changed(node)

    def _candidate_set(self, kind: str) -> CandidateSet:
        self._refresh_state_touches()
        if kind == "leaf":
            return self._leaves
        if kind == "state":
            return self._states if self._states.size else self._branch_states
        if kind == "victim":
            return self._victims if self._victims.size else self._branch_states
        if kind == "subsumed":
            return self._subsumed_states
        raise ValueError(f"candidate kind must be one of {CANDIDATE_KINDS}, got {kind!r}")

    def utilities(self, kind: str) -> list[tuple[Node, float]]:
        """Every current candidate of ``kind`` (one of :data:`CANDIDATE_KINDS`) with its exact Marconi
        utility, lowest first. O(n): for inspection and reports, never called by a pick. With ``alpha > 0``
        the ``state`` and ``victim`` picks take the oldest ``subsumed`` candidate first, when there is one."""
        members = list(self._candidate_set(kind).members())
        if not members:
            return []
        oldest = min(member.recency for member in members)
        recency_span = max(member.recency for member in members) - oldest
        least = min(member.efficiency for member in members)
        efficiency_span = max(member.efficiency for member in members) - least
        scored = []
        for member in members:
            utility = (member.recency - oldest) / recency_span if recency_span else 0.0
            if efficiency_span:
                utility += self._alpha * (member.efficiency - least) / efficiency_span
            scored.append((utility, member.recency, member.stamp, member.node))
        scored.sort(key=lambda item: item[:3])
        return [(node, utility) for utility, _, _, node in scored]

    # ------------------------------------------------------------------ checks

    def heap_entries(self) -> int:
        """Heap entries held over all candidate sets, stale ones included (bounded by compaction)."""
        return sum(
            candidates.heap_entries()
            for candidates in (
                self._leaves, self._states, self._victims, self._branch_states, self._subsumed_states,
            )
        )

    def check_invariants(self) -> None:
        """Raise AssertionError unless every candidate set holds exactly the nodes it should, with their
        current recency and efficiency (O(n); for tests)."""
        if self._tree is None:
            raise AssertionError("FlopAwareEviction is not attached to a tree")
        self._refresh_state_touches()
        expected: dict[str, dict[int, tuple[int, float]]] = {
            "leaf": {}, "state": {}, "victim": {}, "branch": {}, "subsumed": {},
        }
        stack = list(self._tree.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            efficiency = self.efficiency_of(node)
            free_state = node.state is not None and not node.state_lock
            narrow = free_state and len(node.children) <= 1
            if free_state and not node.full_lock and not node.children:
                expected["leaf"][node.node_id] = (node.last_access, efficiency)
                expected["victim"][node.node_id] = (min(node.last_access, node.state_access), efficiency)
            elif narrow:
                expected["victim"][node.node_id] = (node.state_access, efficiency)
            if narrow:
                expected["state"][node.node_id] = (node.state_access, efficiency)
            elif free_state:
                expected["branch"][node.node_id] = (node.state_access, efficiency)
            if free_state and len(node.children) == 1:
                expected["subsumed"][node.node_id] = (node.state_access, efficiency)
        for name, candidates in (
            ("leaf", self._leaves),
            ("state", self._states),
            ("victim", self._victims),
            ("branch", self._branch_states),
            ("subsumed", self._subsumed_states),
        ):
            held = {}
            for member in candidates.members():
                held[member.node.node_id] = (member.recency, member.efficiency)
                assert member.bucket == self.bucket_of(member.efficiency), f"{member.node!r}: wrong bucket"
            assert candidates.size == len(held), f"{name} candidates: size {candidates.size}, {len(held)} live"
            assert set(held) == set(expected[name]), (
                f"{name} candidates: {sorted(held)} held, {sorted(expected[name])} expected"
            )
            for node_id, (recency, efficiency) in expected[name].items():
                got_recency, got_efficiency = held[node_id]
                assert got_recency == recency, f"{name} candidate #{node_id}: recency {got_recency} != {recency}"
                assert math.isclose(got_efficiency, efficiency, rel_tol=1e-12), (
                    f"{name} candidate #{node_id}: efficiency {got_efficiency} != {efficiency}"
                )
