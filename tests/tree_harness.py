"""Slot pools and a slot-level reference model used by the tree tests.

The reference model knows, for every KV slot the tree holds, which (namespace, prefix) it stands for, and for
every state slot which prefix it ends. It learns about evictions only through the allocator interface, so a
match that disagrees with it, or a slot that is neither free, cached nor held by a request, is a tree bug.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from hybrid_prefix_cache.core import HybridRadixTree, PathLock


class PoolExhausted(Exception):
    pass


@dataclass
class SlotPools:
    """Free lists for KV and state slots; implements the tree's SlotAllocator."""

    kv_size: int
    state_size: int
    free_kv_slots: set[int] = field(default_factory=set)
    free_state_slots: set[int] = field(default_factory=set)
    on_free_kv: list = field(default_factory=list)
    on_free_state: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_kv_slots = set(range(self.kv_size))
        self.free_state_slots = set(range(1000, 1000 + self.state_size))

    def alloc_kv(self, count: int) -> list[int]:
        if count > len(self.free_kv_slots):
            raise PoolExhausted
        return [self.free_kv_slots.pop() for _ in range(count)]

    def alloc_state(self) -> int:
        if not self.free_state_slots:
            raise PoolExhausted
        return self.free_state_slots.pop()

    def free_kv(self, kv) -> None:
        kv = list(kv)
        assert not self.free_kv_slots.intersection(kv), f"double free of KV slots {kv}"
        self.free_kv_slots.update(kv)
        for callback in self.on_free_kv:
            callback(kv)

    def free_state(self, state) -> None:
        assert state not in self.free_state_slots, f"double free of state slot {state}"
        self.free_state_slots.add(state)
        for callback in self.on_free_state:
            callback(state)


class ReferenceModel:
    """What the tree should hold, slot by slot, in plain dictionaries."""

    def __init__(self, pools: SlotPools, page_size: int) -> None:
        self.page_size = page_size
        self.kv_at: dict[tuple[Hashable, tuple, int], int] = {}
        self.prefix_of_kv: dict[int, tuple[Hashable, tuple, int]] = {}
        self.state_at: dict[tuple[Hashable, tuple], int] = {}
        self.prefix_of_state: dict[int, tuple[Hashable, tuple]] = {}
        pools.on_free_kv.append(self._forget_kv)
        pools.on_free_state.append(self._forget_state)

    def _forget_kv(self, slots: list[int]) -> None:
        for slot in slots:
            if slot in self.prefix_of_kv:
                del self.kv_at[self.prefix_of_kv.pop(slot)]

    def _forget_state(self, slot: int) -> None:
        if slot in self.prefix_of_state:
            del self.state_at[self.prefix_of_state.pop(slot)]

    def _kv_entry(self, namespace: Hashable, key: tuple, position: int) -> tuple:
        """A KV slot stands for one position of one whole page of one prefix."""
        page_end = (position // self.page_size + 1) * self.page_size
        return namespace, key[:page_end], position

    def record_insert(self, namespace: Hashable, key: tuple, kv: list[int], taken_from: int, upto: int,
                      state: int | None) -> None:
        for i in range(taken_from, upto):
            entry = self._kv_entry(namespace, key, i)
            assert entry not in self.kv_at, f"tree took KV for an already cached position {i}"
            self.kv_at[entry] = kv[i]
            self.prefix_of_kv[kv[i]] = entry
        if state is not None:
            prefix = (namespace, key[:upto])
            self.state_at[prefix] = state
            self.prefix_of_state[state] = prefix

    def expected_match(self, namespace: Hashable, key: tuple) -> tuple[int, int, list[int]]:
        """(reusable_len, matched_len, reusable KV slots) for ``key``."""
        aligned = len(key) - len(key) % self.page_size
        matched = 0
        while matched < aligned and all(
            self._kv_entry(namespace, key, i) in self.kv_at for i in range(matched, matched + self.page_size)
        ):
            matched += self.page_size
        reusable = 0
        for length in range(matched, 0, -self.page_size):
            if (namespace, key[:length]) in self.state_at:
                reusable = length
                break
        slots = [self.kv_at[self._kv_entry(namespace, key, i)] for i in range(reusable)]
        return reusable, matched, slots

    def tree_slots(self) -> tuple[set[int], set[int]]:
        return set(self.prefix_of_kv), set(self.prefix_of_state)


@dataclass
class Request:
    """An in-flight request: the path it locked and the slots it owns itself."""

    namespace: Hashable
    key: tuple
    reusable_len: int
    lock: PathLock
    tree_kv: list[int]
    own_kv: list[int]
    own_state: int | None


def flatten(segments: list) -> list[int]:
    return [slot for segment in segments for slot in segment]


def tree_held_slots(tree: HybridRadixTree) -> tuple[set[int], set[int]]:
    kv: set[int] = set()
    states: set[int] = set()
    for node in tree._iter_nodes():
        kv.update(node.kv)
        if node.state is not None:
            states.add(node.state)
    return kv, states
