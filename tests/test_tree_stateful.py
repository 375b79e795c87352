"""Random request lifecycles against the slot-level reference model, with invariants and leak checks each step.

CI runs ``MAX_EXAMPLES x STEPS`` >= 10,000 steps; set HPC_STATEFUL_EXAMPLES to run more.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tree_harness import PoolExhausted, ReferenceModel, Request, SlotPools, flatten, tree_held_slots

from hybrid_prefix_cache.core import HybridRadixTree

MAX_EXAMPLES = int(os.environ.get("HPC_STATEFUL_EXAMPLES", "400"))
STEPS = 50

# Keys are built from a few shared segments so that requests overlap, diverge mid-edge and repeat.
SEGMENTS = [tuple(range(base, base + length)) for base, length in ((0, 6), (100, 5), (200, 3), (300, 8), (400, 2))]
key_strategy = st.lists(st.sampled_from(range(len(SEGMENTS))), min_size=1, max_size=4).map(
    lambda picks: tuple(token for i in picks for token in SEGMENTS[i])
)


class TreeLifecycle(RuleBasedStateMachine):
    steps_taken = 0

    @initialize(page_size=st.sampled_from([1, 2, 4]), chunk=st.sampled_from([0, 4, 8]))
    def setup(self, page_size: int, chunk: int) -> None:
        self.pools = SlotPools(kv_size=120, state_size=10)
        self.reference = ReferenceModel(self.pools, page_size)
        self.tree = HybridRadixTree(self.pools, page_size=page_size, state_chunk_size=chunk)
        self.requests: list[Request] = []
        self.pools.on_free_kv.append(self._never_free_locked_kv)
        self.pools.on_free_state.append(self._never_free_locked_state)

    def _never_free_locked_kv(self, slots: list[int]) -> None:
        for request in self.requests:
            assert not set(slots) & set(request.tree_kv), "tree freed KV on a locked path"

    def _never_free_locked_state(self, slot: int) -> None:
        for request in self.requests:
            node = request.lock.state_node
            assert node is None or node.state != slot, "tree freed a state that a request locked"

    def _alloc(self, kv_count: int) -> tuple[list[int], int]:
        if len(self.pools.free_kv_slots) < kv_count:
            self.tree.evict_tokens(kv_count - len(self.pools.free_kv_slots))
        if not self.pools.free_state_slots:
            self.tree.evict_states(1)
        if not self.pools.free_state_slots:
            raise PoolExhausted
        return self.pools.alloc_kv(kv_count), self.pools.alloc_state()

    @rule(key=key_strategy, namespace=st.sampled_from([None, None, "lora-1"]))
    def start_request(self, key: tuple, namespace) -> None:
        expected = self.reference.expected_match(namespace, key)
        result = self.tree.match(key, namespace)
        tree_kv = flatten(result.kv)
        assert (result.reusable_len, result.matched_len, tree_kv) == expected
        if result.branching_seqlen is not None:
            assert result.reusable_len < result.branching_seqlen <= result.matched_len
            assert result.branching_seqlen % self.tree.state_chunk_size == 0
        lock = self.tree.lock(result.state_node)
        try:
            own_kv, own_state = self._alloc(len(key) - result.reusable_len)
        except PoolExhausted:
            self.tree.unlock(lock)
            return
        self.requests.append(Request(namespace, key, result.reusable_len, lock, tree_kv, own_kv, own_state))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), keep_locked=st.booleans())
    def finish_request(self, data, keep_locked: bool) -> None:
        """cache_finished_req (keep_locked=False) or cache_unfinished_req (True: the lock moves to the new node)."""
        request = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        kv = request.tree_kv + request.own_kv
        result = self.tree.insert(request.key, kv, request.own_state, request.namespace, lock=keep_locked)
        assert result.prefix_len >= request.reusable_len
        taken = set(kv[result.prefix_len : result.inserted_len])
        self.reference.record_insert(
            request.namespace, request.key, kv, result.prefix_len, result.inserted_len,
            request.own_state if result.state_taken else None,
        )
        if not keep_locked and result.node.parent is None:
            self.reference._forget_kv(sorted(taken))
        self.pools.free_kv([slot for slot in request.own_kv if slot not in taken])
        if request.own_state is not None and not result.state_taken:
            self.pools.free_state(request.own_state)
        self.tree.unlock(request.lock)
        if keep_locked:
            node = result.node
            tree_kv = flatten(self.tree.path_kv(node)) if node is not self.tree.root else []
            state_node = result.lock.state_node
            self.requests.append(Request(request.namespace, request.key[: node.end], node.end if state_node else 0,
                                         result.lock, tree_kv, [], None))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_request(self, data) -> None:
        request = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.pools.free_kv(request.own_kv)
        if request.own_state is not None:
            self.pools.free_state(request.own_state)
        self.tree.unlock(request.lock)

    @rule(tokens=st.integers(1, 40))
    def evict_tokens(self, tokens: int) -> None:
        before = self.tree.evictable_tokens
        result = self.tree.evict_tokens(tokens)
        assert result.tokens >= min(tokens, before) or self.tree.evictable_tokens == 0

    @rule(states=st.integers(1, 4))
    def evict_states(self, states: int) -> None:
        before = self.tree.evictable_states
        result = self.tree.evict_states(states)
        assert result.states == min(states, before)

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self) -> None:
        self.tree.reset()
        assert len(self.pools.free_kv_slots) == self.pools.kv_size
        assert len(self.pools.free_state_slots) == self.pools.state_size
        assert not self.reference.kv_at and not self.reference.state_at

    @invariant()
    def tree_is_valid(self) -> None:
        TreeLifecycle.steps_taken += 1
        self.tree.check_invariants()

    @invariant()
    def no_slot_is_lost(self) -> None:
        tree_kv, tree_states = tree_held_slots(self.tree)
        assert (tree_kv, tree_states) == self.reference.tree_slots()
        request_kv = [slot for r in self.requests for slot in r.own_kv]
        request_states = [r.own_state for r in self.requests if r.own_state is not None]
        kv_parts = [self.pools.free_kv_slots, tree_kv, set(request_kv)]
        assert sum(map(len, kv_parts)) == self.pools.kv_size == len(set().union(*kv_parts))
        state_parts = [self.pools.free_state_slots, tree_states, set(request_states)]
        assert sum(map(len, state_parts)) == self.pools.state_size == len(set().union(*state_parts))

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        while self.requests:
            request = self.requests.pop()
            self.pools.free_kv(request.own_kv)
            if request.own_state is not None:
                self.pools.free_state(request.own_state)
            self.tree.unlock(request.lock)
        self.tree.check_invariants()
        self.tree.reset()
        assert len(self.pools.free_kv_slots) == self.pools.kv_size, "KV slots leaked"
        assert len(self.pools.free_state_slots) == self.pools.state_size, "state slots leaked"


def test_tree_lifecycle_runs_enough_steps() -> None:
    """Runs the machine and proves it took at least 10,000 steps (when run with the default example count)."""
    TreeLifecycle.steps_taken = 0
    run_state_machine_as_test(
        TreeLifecycle,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    if MAX_EXAMPLES >= 400:
        assert TreeLifecycle.steps_taken >= 10_000, f"only {TreeLifecycle.steps_taken} steps ran"
