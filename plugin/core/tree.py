"""The engine-free radix tree for hybrid models.

Each node holds the KV slots of its edge (one per token) and at most one recurrent-state slot: the state after the
node's last token. A node without a state is a *tombstone*: its KV serves the paths through it, but no request can
resume from it, because a recurrent state cannot be rolled back.

Invariants (all checked by :meth:`HybridRadixTree.check_invariants`):

- every non-root edge is a non-empty whole number of pages, and siblings differ in their first page;
- ``len(node.kv) == len(node.key)`` and ``node.end == parent.end + len(node.key)``;
- ``full_lock >= state_lock >= 0`` on every node; a parent's full lock is at least the sum of its children's,
  since a full lock counts the locked paths through the node; a state lock needs a state;
- a tombstone leaf exists only while it is full-locked; the moment it is unlocked it is removed;
- the full LRU list holds exactly the unlocked non-root nodes, every node after all of its descendants, so
  its head is always an unlocked leaf (an unlocked node's children are all unlocked and older);
- the state LRU list holds exactly the nodes with a state and no state lock;
- both lists are ordered by their nodes' timestamps (``last_access``, ``state_access``): releasing a lock counts
  as a use, for the order and the timestamp alike;
- the evictable/protected token and state counters equal the sums they stand for.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hybrid_prefix_cache.core.allocator import SlotAllocator
from hybrid_prefix_cache.core.linked_list import Link, LinkedList
from hybrid_prefix_cache.core.stats import CacheStats

_COMPARE_CHUNK = 64


class TreeError(RuntimeError):
    """An operation that would break the tree's invariants (a caller bug), reported before anything changed."""


class Node:
    """A tree node; see the module docstring for what its fields mean together."""

    __slots__ = (
        "children",
        "end",
        "full_link",
        "full_lock",
        "key",
        "kv",
        "last_access",
        "namespace",
        "node_id",
        "parent",
        "policy_data",
        "state",
        "state_access",
        "state_link",
        "state_lock",
    )

    def __init__(self, key: array, kv: Any, parent: Node | None, end: int, namespace: Hashable, node_id: int):
        self.key = key
        self.kv = kv
        self.state: Any = None
        self.parent = parent
        self.children: dict[Hashable, Node] = {}
        self.end = end
        self.namespace = namespace
        self.node_id = node_id
        self.full_lock = 0
        self.state_lock = 0
        self.last_access = 0
        self.state_access = 0
        self.full_link = Link(self)
        self.state_link = Link(self)
        self.policy_data: Any = None

    @property
    def start(self) -> int:
        return self.end - len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_tombstone(self) -> bool:
        return self.state is None

    def __repr__(self) -> str:
        state = "-" if self.state is None else repr(self.state)
        return f"Node#{self.node_id}[{self.start}:{self.end}] state={state} locks={self.full_lock}/{self.state_lock}"


@dataclass(slots=True)
class MatchResult:
    """The longest cached prefix of a key.

    ``kv`` lists the KV segments of the reusable prefix (the caller concatenates them); ``reusable_len`` is the
    length up to ``state_node``, the deepest matched node with a state (the root when there is none);
    ``matched_len`` is the full KV match, ending at ``last_node``; ``branching_seqlen`` is ``matched_len``
    floored to the state chunk size when that lies beyond ``reusable_len`` (None otherwise): the length at which
    the request should capture its state so the next request that diverges there can resume.
    """

    kv: list
    reusable_len: int
    state_node: Node
    matched_len: int
    last_node: Node
    branching_seqlen: int | None


@dataclass(slots=True)
class InsertResult:
    """``prefix_len`` tokens of the key were already cached: the caller frees its own KV for them.

    ``state_existed`` means the node already had a state. ``state_taken`` says whether the tree took the state
    the caller passed; when it did not (a state existed, or the key was shorter than a page) the caller still
    owns it. ``inserted_len`` is the page-aligned length the tree now covers. ``lock`` is set when the insert
    was asked to lock its node.
    """

    prefix_len: int
    state_existed: bool
    state_taken: bool
    node: Node
    inserted_len: int
    lock: PathLock | None


@dataclass(slots=True)
class PathLock:
    """A full lock on the path root..node and, when ``state_node`` is set, a state lock on that node."""

    node: Node
    state_node: Node | None
    released: bool = False


@dataclass(slots=True)
class EvictResult:
    tokens: int = 0
    states: int = 0


class EvictionPolicy(Protocol):
    """Chooses victims. The tree keeps the LRU lists; a policy that keeps its own order observes nodes."""

    observes_nodes: bool

    def attach(self, tree: HybridRadixTree) -> None: ...

    def node_changed(self, node: Node) -> None:
        """The node's lock, children, state, size or recency changed."""

    def node_removed(self, node: Node) -> None: ...

    def pick_leaf(self) -> Node | None:
        """An unlocked leaf to delete, or None if there is none."""

    def pick_state(self) -> Node | None:
        """A node with a state and no state lock whose state to drop, or None."""

    def pick_victim(self) -> Node | None:
        """For one memory budget shared by KV and states: an unlocked leaf (freed whole) or a node whose
        state alone is dropped (any node with an unlocked state that is not an unlocked leaf), or None."""


class LRUEviction:
    """Upstream's order: the head of the full LRU list (always an unlocked leaf) and of the state LRU list."""

    observes_nodes = False

    def attach(self, tree: HybridRadixTree) -> None:
        self._tree = tree

    def node_changed(self, node: Node) -> None:
        return None

    def node_removed(self, node: Node) -> None:
        return None

    def pick_leaf(self) -> Node | None:
        return self._tree.full_lru.head()

    def pick_state(self) -> Node | None:
        return self._tree.state_lru.head()

    def pick_victim(self) -> Node | None:
        leaf = self._tree.full_lru.head()
        stateful = self._tree.state_lru.head()
        if leaf is None or (stateful is not None and stateful.state_access < leaf.last_access):
            return stateful
        return leaf


class HybridRadixTree:
    """A radix tree whose nodes hold per-token KV slots and at most one recurrent-state slot each.

    ``page_size`` tokens form the unit of matching and storing; ``state_chunk_size`` aligns the branching
    seqlen (0 disables it). Namespaces (LoRA id, cache salt) never share nodes.

    ``keep_stateless_leaves`` keeps KV that no state makes reusable until eviction takes it, instead of
    removing a tombstone leaf at once; it exists to model engines that cache such KV (vLLM's attention blocks).
    """

    def __init__(
        self,
        allocator: SlotAllocator,
        *,
        page_size: int = 1,
        state_chunk_size: int = 64,
        eviction: EvictionPolicy | None = None,
        flops_saved: Callable[[int], float] | None = None,
        keep_stateless_leaves: bool = False,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if state_chunk_size < 0:
            raise ValueError(f"state_chunk_size must be >= 0, got {state_chunk_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.state_chunk_size = state_chunk_size
        self.flops_saved = flops_saved
        self.keep_stateless_leaves = keep_stateless_leaves
        self.eviction: EvictionPolicy = eviction or LRUEviction()
        self.stats = CacheStats()
        self._init_structure()

    def _init_structure(self) -> None:
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.full_lru = LinkedList()
        self.state_lru = LinkedList()
        self.root = Node(array("q"), (), None, 0, None, 0)
        self.root.full_lock = 1
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.evictable_states = 0
        self.protected_states = 0
        self.num_nodes = 0
        self.eviction.attach(self)

    # ------------------------------------------------------------------ match and insert

    def match(self, key: Sequence[int], namespace: Hashable = None, *, record: bool = True) -> MatchResult:
        """Find the longest cached prefix of ``key``, splitting a partially matched edge.

        Refreshes the full LRU along the matched path and the state LRU of the node whose state is returned.
        ``record=False`` keeps the statistics untouched (re-matches, speculative lookups).
        """
        key = self._aligned(key)
        root, page_size = self.root, self.page_size
        node, segments, pos, end = root, [], 0, len(key)
        state_node, reusable_len, reusable_segments = root, 0, 0
        while pos < end:
            # _child_key inlined: this is the walk's hottest step.
            first = key[pos] if page_size == 1 else tuple(key[pos : pos + page_size])
            child = node.children.get(first if node is not root else (namespace, first))
            if child is None:
                break
            common = self._common_len(child.key, key, pos)
            partial = common < len(child.key)
            if partial:
                child = self._split(child, common)
            node = child
            segments.append(child.kv)
            pos += common
            if child.state is not None:
                state_node, reusable_len, reusable_segments = child, pos, len(segments)
            if partial:
                break
        self._touch_path(node)
        if state_node is not root:
            self._touch_state(state_node)
        branching = None
        if self.state_chunk_size and pos > reusable_len:
            aligned = pos // self.state_chunk_size * self.state_chunk_size
            branching = aligned if aligned > reusable_len else None
        if record:
            self.stats.record_match(end, reusable_len, pos, self.flops_saved)
        return MatchResult(segments[:reusable_segments], reusable_len, state_node, pos, node, branching)

    def insert(
        self,
        key: Sequence[int],
        kv: Sequence,
        state: Any = None,
        namespace: Hashable = None,
        *,
        lock: bool = False,
    ) -> InsertResult:
        """Cache ``key`` with its KV slots and, optionally, the state after its last token.

        Only whole pages are stored; the caller keeps the KV of a trailing partial page. The tree takes
        ownership of ``kv[prefix_len:inserted_len]`` and, unless ``state_existed``, of ``state``. An exact match
        on a tombstone revives it with ``state``. With ``lock=True`` the node is locked before anything can
        evict it; without a lock, a new stateless leaf is not kept (its KV goes back to the allocator).
        """
        key = self._aligned(key)
        end = len(key)
        if len(kv) < end:
            raise ValueError(f"insert: {len(kv)} KV slots for a key of {end} tokens")
        root, page_size = self.root, self.page_size
        node, pos = root, 0
        while pos < end:
            # _child_key inlined: this is the walk's hottest step.
            first = key[pos] if page_size == 1 else tuple(key[pos : pos + page_size])
            child = node.children.get(first if node is not root else (namespace, first))
            if child is None:
                break
            common = self._common_len(child.key, key, pos)
            if common < len(child.key):
                child = self._split(child, common)
            node = child
            pos += common
        prefix_len = pos
        if pos < end:
            node = self._add_leaf(node, key[pos:], kv[pos:end], namespace)
        state_existed = node.state is not None
        state_taken = state is not None and not state_existed and node is not root
        if state_taken:
            self._set_state(node, state)
        self._touch_path(node)
        if state_taken:
            self._touch_state(node)
        if lock:
            path_lock = self.lock(node)
        else:
            path_lock = None
            self._remove_if_dead_tombstone(node)
        return InsertResult(prefix_len, state_existed, state_taken, node, end, path_lock)

    # ------------------------------------------------------------------ locks

    def lock(self, node: Node, *, lock_state: bool = True) -> PathLock:
        """Protect the KV of root..node and, if it has one and ``lock_state``, the node's state."""
        if node.parent is None and node is not self.root:
            raise TreeError(f"lock: {node!r} is no longer in the tree")
        root, lru, protected = self.root, self.full_lru, 0
        walker = node
        while walker is not root:
            if not walker.full_lock:
                lru.remove(walker.full_link)
                protected += len(walker.key)
            walker.full_lock += 1
            walker = walker.parent
        self.evictable_tokens -= protected
        self.protected_tokens += protected
        state_node = None
        if lock_state and node.state is not None:
            if node.state_lock == 0:
                self.state_lru.remove(node.state_link)
                self.evictable_states -= 1
                self.protected_states += 1
            node.state_lock += 1
            state_node = node
        if self.eviction.observes_nodes:
            self._notify_path(node)
        return PathLock(node, state_node)

    def unlock(self, path_lock: PathLock) -> None:
        """Release a lock; nodes it leaves unlocked become evictable, a dead tombstone leaf goes at once."""
        if path_lock.released:
            raise TreeError(f"unlock: lock on {path_lock.node!r} was already released")
        path_lock.released = True
        node = path_lock.node
        if path_lock.state_node is not None:
            state_node = path_lock.state_node
            state_node.state_lock -= 1
            if state_node.state_lock == 0:
                self.protected_states -= 1
                self.evictable_states += 1
                self.state_lru.push_tail(state_node.state_link)
                state_node.state_access = next(self._clock)
        now = next(self._clock)
        root, lru, released = self.root, self.full_lru, 0
        walker = node
        while walker is not root:
            walker.full_lock -= 1
            if not walker.full_lock:
                lru.push_tail(walker.full_link)
                released += len(walker.key)
                walker.last_access = now
            walker = walker.parent
        self.evictable_tokens += released
        self.protected_tokens -= released
        if self.eviction.observes_nodes:
            self._notify_path(node)
        self._remove_if_dead_tombstone(node)

    # ------------------------------------------------------------------ eviction

    def evict_tokens(self, num_tokens: int) -> EvictResult:
        """Delete unlocked leaves (their KV and states) until ``num_tokens`` KV slots are freed or none is left."""
        result = EvictResult()
        while result.tokens < num_tokens:
            victim = self.eviction.pick_leaf()
            if victim is None:
                break
            if victim.full_lock or victim.children:
                raise TreeError(f"eviction policy picked {victim!r}, which is locked or not a leaf")
            self._delete_leaf(victim, result)
        return result

    def evict_states(self, num_states: int) -> EvictResult:
        """Drop ``num_states`` unlocked states: an inner or locked node becomes a tombstone, a free leaf goes."""
        result = EvictResult()
        while result.states < num_states:
            victim = self.eviction.pick_state()
            if victim is None:
                break
            if victim.state is None or victim.state_lock:
                raise TreeError(f"eviction policy picked {victim!r}, which has no evictable state")
            if victim.children or victim.full_lock:
                self._drop_state(victim, result)
                self._remove_if_dead_tombstone(victim, result)
            else:
                self._delete_leaf(victim, result)
        return result

    def evict_memory(self, num_bytes: int, kv_bytes_per_token: int, state_bytes: int) -> EvictResult:
        """Free at least ``num_bytes`` of one budget shared by KV and states, or as much as can be freed.

        The policy's victim is deleted whole when it is an unlocked leaf; otherwise only its state is dropped.
        """
        result = EvictResult()
        while result.tokens * kv_bytes_per_token + result.states * state_bytes < num_bytes:
            victim = self.eviction.pick_victim()
            if victim is None:
                break
            if victim.full_lock == 0 and not victim.children:
                self._delete_leaf(victim, result)
            elif victim.state is not None and victim.state_lock == 0:
                self._drop_state(victim, result)
                self._remove_if_dead_tombstone(victim, result)
            else:
                raise TreeError(f"eviction policy picked {victim!r}, which holds nothing it may free")
        return result

    def reset(self) -> None:
        """Free every slot the tree holds. All locks must have been released."""
        if self.protected_tokens or self.protected_states:
            raise TreeError("reset: some paths are still locked; release every request's lock first")
        for node in list(self._iter_nodes()):
            if node.state is not None:
                self.allocator.free_state(node.state)
            self.allocator.free_kv(node.kv)
            node.parent = None
        self._init_structure()

    # ------------------------------------------------------------------ sizes

    @property
    def total_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens

    @property
    def total_states(self) -> int:
        return self.evictable_states + self.protected_states

    # ------------------------------------------------------------------ internals: structure

    def _aligned(self, key: Sequence[int]) -> array:
        """The key as whole pages of int64 token ids; an ``array('q')`` from the caller is used without a copy."""
        if not (isinstance(key, array) and key.typecode == "q"):
            key = array("q", key)
        extra = len(key) % self.page_size
        return key[: len(key) - extra] if extra else key

    def _child_key(self, parent: Node, key: array, pos: int, namespace: Hashable) -> Hashable:
        page = key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])
        return (namespace, page) if parent is self.root else page

    def _common_len(self, edge: array, key: array, pos: int) -> int:
        limit = min(len(edge), len(key) - pos)
        if (edge if limit == len(edge) else edge[:limit]) == key[pos : pos + limit]:
            # Edges and aligned keys are whole pages, so a full match needs no flooring.
            return limit
        start = 0
        while edge[start : start + _COMPARE_CHUNK] == key[pos + start : pos + start + _COMPARE_CHUNK]:
            start += _COMPARE_CHUNK
        common = start
        while edge[common] == key[pos + common]:
            common += 1
        return common - common % self.page_size

    def _new_node(self, key: array, kv: Any, parent: Node, end: int, namespace: Hashable) -> Node:
        self.num_nodes += 1
        return Node(key, kv, parent, end, namespace, next(self._ids))

    def _add_leaf(self, parent: Node, key: array, kv: Any, namespace: Hashable) -> Node:
        leaf = self._new_node(key, kv, parent, parent.end + len(key), namespace)
        parent.children[self._child_key(parent, key, 0, namespace)] = leaf
        self.evictable_tokens += len(key)
        self.full_lru.push_tail(leaf.full_link)
        return leaf

    def _split(self, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` tokens; the new upper node is a tombstone that inherits the locks."""
        parent = child.parent
        upper = self._new_node(child.key[:at], child.kv[:at], parent, child.start + at, child.namespace)
        upper.full_lock = child.full_lock
        upper.last_access = child.last_access
        parent.children[self._child_key(parent, child.key, 0, child.namespace)] = upper
        child.key = child.key[at:]
        child.kv = child.kv[at:]
        child.parent = upper
        upper.children[self._child_key(upper, child.key, 0, child.namespace)] = child
        if child.full_link.linked:
            self.full_lru.insert_after(child.full_link, upper.full_link)
        if self.eviction.observes_nodes:
            self.eviction.node_changed(child)
            self.eviction.node_changed(upper)
        return upper

    def _set_state(self, node: Node, state: Any) -> None:
        node.state = state
        self.evictable_states += 1
        self.state_lru.push_tail(node.state_link)

    def _drop_state(self, node: Node, result: EvictResult) -> None:
        self.allocator.free_state(node.state)
        node.state = None
        self.state_lru.remove(node.state_link)
        self.evictable_states -= 1
        result.states += 1
        self.stats.states_evicted += 1
        if self.eviction.observes_nodes:
            self.eviction.node_changed(node)

    def _delete_leaf(self, leaf: Node, result: EvictResult) -> None:
        """Free a leaf's KV and state, then remove the tombstones this leaves as unlocked leaves above it."""
        self._remove_if_dead_tombstone(self._unlink_leaf(leaf, result), result)

    def _unlink_leaf(self, leaf: Node, result: EvictResult) -> Node:
        """Free a leaf's KV and state and detach it; returns its former parent."""
        if leaf.state is not None:
            self._drop_state(leaf, result)
        self.allocator.free_kv(leaf.kv)
        result.tokens += len(leaf.key)
        self.stats.tokens_evicted += len(leaf.key)
        self.evictable_tokens -= len(leaf.key)
        self.full_lru.remove(leaf.full_link)
        parent = leaf.parent
        del parent.children[self._child_key(parent, leaf.key, 0, leaf.namespace)]
        leaf.parent = None
        self.num_nodes -= 1
        if self.eviction.observes_nodes:
            self.eviction.node_removed(leaf)
            self.eviction.node_changed(parent)
        return parent

    def _remove_if_dead_tombstone(self, node: Node, result: EvictResult | None = None) -> None:
        """Delete ``node`` and then its ancestors while each is an unlocked stateless leaf."""
        if self.keep_stateless_leaves:
            return
        root = self.root
        while node is not root and not node.children and node.state is None and not node.full_lock:
            if result is None:
                result = EvictResult()
            node = self._unlink_leaf(node, result)

    # ------------------------------------------------------------------ internals: LRU and counters

    def _touch_path(self, node: Node) -> None:
        now = next(self._clock)
        root, move_to_tail = self.root, self.full_lru.move_to_tail
        observes = self.eviction.observes_nodes
        while node is not root:
            node.last_access = now
            if not node.full_lock:
                move_to_tail(node.full_link)
            if observes:
                self.eviction.node_changed(node)
            node = node.parent

    def _touch_state(self, node: Node) -> None:
        node.state_access = next(self._clock)
        if node.state_link.linked:
            self.state_lru.move_to_tail(node.state_link)
        if self.eviction.observes_nodes:
            self.eviction.node_changed(node)

    def _notify_path(self, node: Node) -> None:
        while node is not self.root:
            self.eviction.node_changed(node)
            node = node.parent

    # ------------------------------------------------------------------ inspection

    def _iter_nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_kv(self, node: Node) -> list:
        """KV segments of root..node, in order."""
        segments = []
        while node is not self.root:
            segments.append(node.kv)
            node = node.parent
        segments.reverse()
        return segments

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (see the module docstring)."""
        counts = {"evictable_tokens": 0, "protected_tokens": 0, "evictable_states": 0, "protected_states": 0}
        unlocked: set[int] = set()
        stateful_unlocked: set[int] = set()
        nodes = 0
        for node in self._iter_nodes():
            nodes += 1
            parent = node.parent
            assert parent is not None, f"{node!r} has no parent"
            assert node.key and len(node.key) % self.page_size == 0, f"{node!r}: edge not whole pages"
            assert len(node.kv) == len(node.key), f"{node!r}: {len(node.kv)} KV slots for {len(node.key)} tokens"
            assert node.end == parent.end + len(node.key), f"{node!r}: end does not follow its parent"
            assert parent.children.get(self._child_key(parent, node.key, 0, node.namespace)) is node, (
                f"{node!r} is not filed under its first page in its parent"
            )
            assert node.full_lock >= node.state_lock >= 0, f"{node!r}: locks out of order"
            assert node.state_lock == 0 or node.state is not None, f"{node!r}: state lock without a state"
            assert sum(c.full_lock for c in node.children.values()) <= node.full_lock, (
                f"{node!r}: children hold more path locks than the node"
            )
            assert self.keep_stateless_leaves or not (node.is_leaf and node.state is None and node.full_lock == 0), (
                f"{node!r}: unlocked tombstone leaf"
            )
            if parent is not self.root:
                assert node.namespace == parent.namespace, f"{node!r}: namespace differs from its parent's"
            side = "protected" if node.full_lock else "evictable"
            counts[f"{side}_tokens"] += len(node.key)
            assert node.full_link.linked == (node.full_lock == 0), f"{node!r}: full LRU membership wrong"
            if node.full_lock == 0:
                unlocked.add(node.node_id)
            if node.state is not None:
                counts["protected_states" if node.state_lock else "evictable_states"] += 1
                if node.state_lock == 0:
                    stateful_unlocked.add(node.node_id)
            assert node.state_link.linked == (node.state is not None and node.state_lock == 0), (
                f"{node!r}: state LRU membership wrong"
            )
        assert nodes == self.num_nodes, f"node count {self.num_nodes} but {nodes} nodes in the tree"
        for name, value in counts.items():
            assert getattr(self, name) == value, f"{name} is {getattr(self, name)}, recount gives {value}"
        listed = [n.node_id for n in self.full_lru]
        assert len(listed) == len(self.full_lru) and set(listed) == unlocked, "full LRU holds the wrong nodes"
        position = {node_id: i for i, node_id in enumerate(listed)}
        for node in self.full_lru:
            if node.parent is not self.root and node.parent.full_lock == 0:
                assert position[node.parent.node_id] > position[node.node_id], (
                    f"{node!r} is listed after its parent in the full LRU"
                )
        listed_states = {n.node_id for n in self.state_lru}
        assert len(self.state_lru) == len(listed_states) == len(stateful_unlocked), "state LRU size is wrong"
        assert listed_states == stateful_unlocked, "state LRU holds the wrong nodes"

    def pretty_print(self, *, max_tokens: int = 8) -> str:
        """A readable outline: one line per node with its token span, state and locks."""
        lines = [
            f"HybridRadixTree: {self.num_nodes} nodes, tokens {self.evictable_tokens} evictable / "
            f"{self.protected_tokens} protected, states {self.evictable_states} evictable / "
            f"{self.protected_states} protected"
        ]

        def visit(node: Node, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.key):
                shown = ", ".join(map(str, child.key[:max_tokens]))
                more = f", ... (+{len(child.key) - max_tokens})" if len(child.key) > max_tokens else ""
                state = "tombstone" if child.state is None else f"state={child.state!r}"
                namespace = f" ns={child.namespace!r}" if node is self.root and child.namespace is not None else ""
                lines.append(
                    f"{'  ' * depth}[{child.start}:{child.end}] ({shown}{more}) {state} "
                    f"lock={child.full_lock}/{child.state_lock}{namespace}"
                )
                visit(child, depth + 1)

        visit(self.root, 1)
        return "\n".join(lines)
