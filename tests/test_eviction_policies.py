"""FLOP-aware eviction and alpha tuning: hand-computed utilities, candidate rules, LRU equivalence at alpha 0,
the bucketing's error bound, invariants and slot accounting under random lifecycles, and the tuner's guard."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_harness import SlotPools, tree_held_slots

from hybrid_prefix_cache.bench.traces import Request
from hybrid_prefix_cache.core import HybridRadixTree, LRUEviction, Node
from hybrid_prefix_cache.cost_model import load_model_spec
from hybrid_prefix_cache.policies import AlphaTuner, FlopAwareEviction


@dataclass(frozen=True)
class ToySpec:
    """Round numbers that make utilities computable by hand: 1000 FLOPs per token plus a quadratic term."""

    kv_bytes_per_token: int = 10
    state_bytes: int = 100

    def segment_flops(self, start: int, end: int) -> float:
        return 1000.0 * (end - start) + (end * end - start * start)


def make_tree(alpha: float = 0.0, **options) -> tuple[HybridRadixTree, SlotPools, FlopAwareEviction]:
    pools = SlotPools(kv_size=10_000, state_size=200)
    policy = FlopAwareEviction(options.pop("spec", ToySpec()), alpha, **options)
    return HybridRadixTree(pools, eviction=policy, state_chunk_size=0), pools, policy


def cache(tree: HybridRadixTree, pools: SlotPools, key, with_state: bool = True):
    """Insert ``key`` as a finished request would: fresh KV for the new part, a fresh state."""
    match = tree.match(key, record=False)
    kv = [slot for segment in tree.path_kv(match.last_node) for slot in segment] if match.matched_len else []
    kv += pools.alloc_kv(len(key) - len(kv))
    state = pools.alloc_state() if with_state else None
    result = tree.insert(key, kv, state)
    pools.free_kv(kv[match.matched_len : result.prefix_len])
    if state is not None and not result.state_taken:
        pools.free_state(state)
    return result


def node_of(tree: HybridRadixTree, key) -> Node:
    """The node ending exactly at ``key``, found without a match (a match would touch it)."""
    node, position = tree.root, 0
    while position < len(key):
        node = node.children[tree._child_key(node, tuple(key), position, None)]
        assert tuple(node.key) == tuple(key[position : position + len(node.key)]), f"no node ends at {key}"
        position += len(node.key)
    return node


def utilities_by_key(policy: FlopAwareEviction, kind: str) -> dict[tuple, float]:
    return {tuple(node.key): utility for node, utility in policy.utilities(kind)}


# ---------------------------------------------------------------------------------------------- hand-built trees

OLD_EXPENSIVE = tuple(range(100, 108))  # 8 tokens: (8000 + 64) FLOPs / (80 + 100) bytes = 44.8 per byte
MIDDLE = tuple(range(200, 204))  # 4 tokens: (4000 + 16) / (40 + 100) = 28.6857...
RECENT_CHEAP = (1, 2)  # 2 tokens: (2000 + 4) / (20 + 100) = 16.7


def test_efficiency_is_flops_saved_relative_to_the_parent_per_byte_held():
    tree, pools, policy = make_tree()
    cache(tree, pools, OLD_EXPENSIVE)
    cache(tree, pools, (*OLD_EXPENSIVE, 9, 9, 9))
    parent, child = node_of(tree, OLD_EXPENSIVE), node_of(tree, (*OLD_EXPENSIVE, 9, 9, 9))
    assert policy.efficiency_of(parent) == pytest.approx(8064 / 180)
    # The child saves tokens [8, 11): 3 * 1000 + (121 - 64) FLOPs, for 3 tokens of KV and a state.
    assert policy.efficiency_of(child) == pytest.approx(3057 / 130)
    tree.match((*OLD_EXPENSIVE[:4], 7), record=False)  # splits the parent: [0, 4) becomes a tombstone
    upper = node_of(tree, OLD_EXPENSIVE[:4])
    assert upper.state is None and policy.efficiency_of(upper) == pytest.approx(4016 / 40)
    assert policy.efficiency_of(node_of(tree, OLD_EXPENSIVE)) == pytest.approx((4000 + 64 - 16) / 140)
    policy.check_invariants()


def test_alpha_flips_the_order_of_a_recent_cheap_leaf_and_an_old_expensive_one():
    tree, pools, policy = make_tree()
    cache(tree, pools, OLD_EXPENSIVE)
    cache(tree, pools, RECENT_CHEAP)
    # recency: old 0, recent 1; efficiency: cheap 0, expensive 1.
    for kind in ("leaf", "state", "victim"):
        assert utilities_by_key(policy, kind) == {OLD_EXPENSIVE: 0.0, RECENT_CHEAP: 1.0}
    picks = ("pick_leaf", "pick_state", "pick_victim")
    assert {tuple(getattr(policy, pick)().key) for pick in picks} == {OLD_EXPENSIVE}
    policy.alpha = 1.0  # 0 + 1 = 1 + 0: a tie goes to the older one
    assert utilities_by_key(policy, "leaf") == {OLD_EXPENSIVE: 1.0, RECENT_CHEAP: 1.0}
    assert tuple(policy.pick_leaf().key) == OLD_EXPENSIVE
    policy.alpha = 2.0  # old: 0 + 2 * 1 = 2, recent: 1 + 2 * 0 = 1
    assert utilities_by_key(policy, "leaf") == {OLD_EXPENSIVE: 2.0, RECENT_CHEAP: 1.0}
    assert {tuple(getattr(policy, pick)().key) for pick in picks} == {RECENT_CHEAP}
    assert tree.evict_tokens(1).tokens == 2
    assert tree.match(RECENT_CHEAP, record=False).matched_len == 0
    assert tree.match(OLD_EXPENSIVE, record=False).reusable_len == 8
    tree.check_invariants()
    policy.check_invariants()


def test_min_max_normalisation_can_evict_the_middle_candidate():
    tree, pools, policy = make_tree(alpha=1.0)
    for key in (OLD_EXPENSIVE, MIDDLE, RECENT_CHEAP):
        cache(tree, pools, key)
    # Ticks: the three leaves were touched at 2, 5 and 8, so recency normalises to 0, 0.5 and 1.
    # Efficiency normalises over [16.7, 44.8]: the middle leaf sits at (4016/140 - 16.7) / 28.1 = 0.426538.
    expected = {OLD_EXPENSIVE: 0.0 + 1.0, MIDDLE: 0.5 + 0.426538, RECENT_CHEAP: 1.0 + 0.0}
    got = utilities_by_key(policy, "leaf")
    assert got.keys() == expected.keys()
    for key, utility in expected.items():
        assert got[key] == pytest.approx(utility, abs=1e-6)
    assert tree.evict_tokens(1).tokens == 4
    assert tree.match(MIDDLE, record=False).matched_len == 0
    # Two candidates left: old (0, 1) and recent (1, 0) tie at 1; the older goes.
    assert tree.evict_tokens(1).tokens == 8
    policy.check_invariants()


def test_state_candidates_have_at_most_one_child_and_fall_back_to_branch_points():
    tree, pools, policy = make_tree(alpha=1e-12)  # alpha 0 would be LRU itself
    branch = (1, 2, 3, 4)
    cache(tree, pools, branch)  # the oldest state
    cache(tree, pools, (*branch, 5, 6))
    cache(tree, pools, (*branch, 7, 8))
    tree.match((*branch, 5, 6))
    tree.match((*branch, 7, 8))  # the branch point's state is now the oldest
    branch_node = node_of(tree, branch)
    assert len(branch_node.children) == 2 and branch_node.state is not None
    lru = LRUEviction()
    lru.attach(tree)
    assert lru.pick_state() is branch_node  # upstream takes the branch point's state, the oldest
    assert tuple(policy.pick_state().key) == (5, 6)  # Marconi keeps a state that serves two paths
    assert set(utilities_by_key(policy, "state")) == {(5, 6), (7, 8)}
    leaf_locks = [tree.lock(node_of(tree, (*branch, tail, tail + 1))) for tail in (5, 7)]
    assert policy.pick_state() is branch_node  # nothing else is evictable: fall back, never stall
    assert policy.pick_victim() is branch_node
    assert policy.pick_leaf() is None
    result = tree.evict_states(1)
    assert (result.states, result.tokens) == (1, 0) and branch_node.state is None
    assert policy.pick_state() is None and policy.pick_victim() is None
    for lock in leaf_locks:
        tree.unlock(lock)
    tree.check_invariants()
    policy.check_invariants()


def test_single_child_node_drops_its_state_and_its_kv_serves_the_child():
    tree, pools, policy = make_tree()
    cache(tree, pools, (1, 2, 3, 4))
    cache(tree, pools, (1, 2, 3, 4, 5, 6))
    inner = node_of(tree, (1, 2, 3, 4))
    tree.match((1, 2, 3, 4, 5, 6), record=False)  # the leaf's state is newer than the inner one's
    assert policy.pick_state() is inner
    assert policy.pick_victim() is inner  # inner's state_access is older than the leaf's last_access
    result = tree.evict_memory(1, kv_bytes_per_token=10, state_bytes=100)
    assert (result.states, result.tokens) == (1, 0)
    assert inner.state is None and inner.parent is tree.root
    assert tree.match((1, 2, 3, 4, 5, 6), record=False).reusable_len == 6
    policy.check_invariants()


@pytest.mark.parametrize("alpha", [1e-12, 1.0, 50.0])
def test_a_subsumed_state_goes_before_any_older_candidate_when_alpha_is_positive(alpha):
    tree, pools, policy = make_tree(alpha=alpha)
    cache(tree, pools, (9, 9))  # another session, older than everything below
    cache(tree, pools, (1, 2, 3))  # turn 1 of a conversation
    cache(tree, pools, (1, 2, 3, 4, 5))  # turn 2 extends it: turn 1's state is subsumed
    turn_one = node_of(tree, (1, 2, 3))
    lru = LRUEviction()
    lru.attach(tree)
    assert tuple(lru.pick_victim().key) == (9, 9)
    assert policy.pick_state() is turn_one and policy.pick_victim() is turn_one
    assert [node for node, _ in policy.utilities("subsumed")] == [turn_one]
    result = tree.evict_memory(1, kv_bytes_per_token=10, state_bytes=100)
    assert (result.states, result.tokens) == (1, 0)
    assert tree.match((1, 2, 3, 4, 5, 6), record=False).reusable_len == 5  # the next turn still hits in full
    assert policy.utilities("subsumed") == []
    assert policy.pick_victim() is not None and policy.pick_victim().state is not None
    policy.check_invariants()


def test_a_state_touched_by_a_match_counts_as_recent():
    # The tree stamps state_access after notifying the path; the policy must still see the new stamp.
    tree, pools, policy = make_tree()
    cache(tree, pools, (1, 2, 3))
    cache(tree, pools, (1, 2, 3, 4, 5))
    cache(tree, pools, (9, 9))
    inner = node_of(tree, (1, 2, 3))
    assert policy.pick_state() is inner
    tree.match((1, 2, 3, 7))  # resumes from the inner state
    assert tuple(policy.pick_state().key) == (4, 5)
    policy.check_invariants()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="buckets"):
        FlopAwareEviction(ToySpec(), buckets=0)
    with pytest.raises(ValueError, match="max_context"):
        FlopAwareEviction(ToySpec(), max_context=0)
    policy = FlopAwareEviction(ToySpec())
    for alpha in (-1.0, math.nan, math.inf, "2", True):
        with pytest.raises(ValueError, match="alpha"):
            policy.alpha = alpha
    with pytest.raises(ValueError, match="candidate kind"):
        policy.utilities("leaves")
    with pytest.raises(AssertionError, match="not attached"):
        policy.check_invariants()
    HybridRadixTree(SlotPools(kv_size=1, state_size=1), eviction=policy)
    with pytest.raises(ValueError, match="another tree"):
        HybridRadixTree(SlotPools(kv_size=1, state_size=1), eviction=policy)


def test_buckets_are_log_spaced_between_the_spec_bounds():
    policy = FlopAwareEviction(ToySpec(), buckets=10, max_context=1001)
    low = 1001 / 110  # one token at position 0 with a state
    high = (1000 + 1001**2 - 1000**2) / 10  # one stateless token at position 1000
    assert policy.lowest_bucketed_efficiency == pytest.approx(low)
    assert policy.bucket_ratio == pytest.approx((high / low) ** 0.1)
    assert policy.bucket_of(low / 2) == 0 and policy.bucket_of(low * 1.0001) == 0
    assert policy.bucket_of(low * policy.bucket_ratio * 1.0001) == 1
    assert policy.bucket_of(high * 0.9999) == 9 and policy.bucket_of(high * 100) == 9
    single = FlopAwareEviction(ToySpec(), buckets=1)
    assert single.bucket_of(low) == single.bucket_of(high) == 0


def test_real_model_spec_is_accepted():
    spec = load_model_spec("paper-7b")
    tree, pools, policy = make_tree(alpha=1.0, spec=spec)
    cache(tree, pools, tuple(range(64)))
    cache(tree, pools, tuple(range(1000, 1008)))
    leaf = node_of(tree, tuple(range(64)))
    held = 64 * spec.kv_bytes_per_token + spec.state_bytes
    assert policy.efficiency_of(leaf) == pytest.approx(spec.segment_flops(0, 64) / held)
    assert policy.pick_leaf() is not None
    policy.check_invariants()


# ---------------------------------------------------------------------------------------------- random trees

# Few short segments, so that keys share prefixes, branch mid-edge and repeat; long operation lists, so that
# trees grow branch points with states before evictions shrink them.
SEGMENTS = [tuple(range(base, base + length)) for base, length in ((0, 6), (100, 5), (200, 3), (300, 2))]
keys = st.lists(st.integers(0, len(SEGMENTS) - 1), min_size=1, max_size=4).map(
    lambda picks: tuple(token for i in picks for token in SEGMENTS[i])
)
OPERATIONS = ("cache",) * 4 + ("match",) * 2 + ("reinsert", "evict_tokens", "evict_states", "evict_memory")
operations = st.lists(st.tuples(st.sampled_from(OPERATIONS), keys, st.integers(1, 12)), min_size=20, max_size=80)


def apply(tree: HybridRadixTree, pools: SlotPools, operation: str, key: tuple, amount: int) -> None:
    if operation == "cache":
        cache(tree, pools, key)
    elif operation == "match":
        tree.match(key)
    elif operation == "reinsert":  # the key again with a new state: the node's KV is touched, not its state
        match = tree.match(key, record=False)
        if match.matched_len == len(key) and match.last_node.state is not None:
            kv = [slot for segment in tree.path_kv(match.last_node) for slot in segment]
            state = pools.alloc_state()
            assert not tree.insert(key, kv, state).state_taken
            pools.free_state(state)
    elif operation == "evict_tokens":
        tree.evict_tokens(amount)
    elif operation == "evict_states":
        tree.evict_states(max(1, amount // 4))
    else:
        tree.evict_memory(amount * 10, kv_bytes_per_token=10, state_bytes=100)


def subsumed_states(tree: HybridRadixTree) -> list[tuple[Node, int]]:
    """(node, state_access) of every unlocked state on a node with exactly one child."""
    found = []
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.state is not None and not node.state_lock and len(node.children) == 1:
            found.append((node, node.state_access))
    return found


def brute_force_candidates(tree: HybridRadixTree, kind: str) -> list[tuple[Node, int]]:
    """(node, recency) of every candidate of ``kind``, from the definitions in the module docstring (without
    the subsumed-first rule of alpha > 0, which :func:`check_picks_against_brute_force` applies)."""
    nodes = []
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        nodes.append(node)
    free_states = [node for node in nodes if node.state is not None and not node.state_lock]
    unlocked_leaves = [node for node in free_states if not node.full_lock and not node.children]
    narrow = [node for node in free_states if len(node.children) <= 1]
    branch_points = [node for node in free_states if len(node.children) > 1]
    if kind == "leaf":
        return [(node, node.last_access) for node in unlocked_leaves]
    if kind == "state":
        return [(node, node.state_access) for node in narrow or branch_points]
    leaf_ids = {node.node_id for node in unlocked_leaves}
    victims = [(node, min(node.last_access, node.state_access)) for node in unlocked_leaves] + [
        (node, node.state_access) for node in narrow if node.node_id not in leaf_ids
    ]
    return victims or [(node, node.state_access) for node in branch_points]


def exact_utilities(policy: FlopAwareEviction, candidates: list[tuple[Node, int]]) -> dict[int, float]:
    recencies = [recency for _, recency in candidates]
    efficiencies = [policy.efficiency_of(node) for node, _ in candidates]
    recency_span, least = max(recencies) - min(recencies), min(efficiencies)
    efficiency_span = max(efficiencies) - least
    return {
        node.node_id: ((recency - min(recencies)) / recency_span if recency_span else 0.0)
        + (policy.alpha * (efficiency - least) / efficiency_span if efficiency_span else 0.0)
        for (node, recency), efficiency in zip(candidates, efficiencies, strict=True)
    }


PICKS = {"leaf": "pick_leaf", "state": "pick_state", "victim": "pick_victim"}


def chosen_recency(node: Node, kind: str) -> int:
    if kind == "leaf":
        return node.last_access
    if kind == "victim" and not node.children and not node.full_lock:
        return min(node.last_access, node.state_access)
    return node.state_access


def check_picks_against_brute_force(tree: HybridRadixTree, policy: FlopAwareEviction) -> None:
    lru = LRUEviction()
    lru.attach(tree)  # reads the tree's own LRU lists; needs no notifications
    for kind, pick in PICKS.items():
        candidates = brute_force_candidates(tree, kind)
        chosen = getattr(policy, pick)()
        if policy.alpha == 0:
            assert chosen is getattr(lru, pick)(), f"{kind}: alpha 0 is not exactly LRU"
            continue
        if not candidates:
            assert chosen is None, f"{kind}: picked {chosen!r} without candidates"
            continue
        subsumed = subsumed_states(tree) if kind != "leaf" else []
        if subsumed:
            assert chosen in [node for node, _ in subsumed], f"{kind}: a subsumed state must go first"
            assert chosen.state_access == min(recency for _, recency in subsumed), f"{kind}: not the oldest"
            continue
        utilities = exact_utilities(policy, candidates)
        assert chosen.node_id in utilities, f"{kind}: picked {chosen!r}, not a candidate"
        # The head of a bucket is at most one bucket's width less efficient than the bucket's best member.
        efficiencies = [policy.efficiency_of(node) for node, _ in candidates]
        span = max(efficiencies) - min(efficiencies)
        slack = policy.alpha * (policy.bucket_ratio - 1) * max(efficiencies) / span if span else 0.0
        assert utilities[chosen.node_id] <= min(utilities.values()) + slack + 1e-9, f"{kind}: utility too high"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_alpha_zero_is_exactly_lru_and_a_tiny_alpha_is_lru_over_marconi_candidates(steps):
    """alpha 0 (the guard's fallback) is LRUEviction itself; a tiny alpha takes subsumed states first, then
    orders Marconi's candidates by recency."""
    tree, pools, policy = make_tree()
    tiny_tree, tiny_pools, tiny = make_tree(alpha=1e-12)
    lru = LRUEviction()
    lru.attach(tree)
    for operation, key, amount in steps:
        apply(tree, pools, operation, key, amount)
        apply(tiny_tree, tiny_pools, operation, key, amount)
        for kind, pick in PICKS.items():
            assert getattr(policy, pick)() is getattr(lru, pick)(), kind
        check_picks_against_brute_force(tiny_tree, tiny)
        for kind, pick in PICKS.items():
            candidates = (kind != "leaf" and subsumed_states(tiny_tree)) or brute_force_candidates(tiny_tree, kind)
            if candidates:
                chosen = getattr(tiny, pick)()
                assert chosen in [node for node, _ in candidates], f"{kind}: {chosen!r} is not a candidate"
                assert chosen_recency(chosen, kind) == min(recency for _, recency in candidates), kind


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations, st.sampled_from([0.5, 1.0, 4.0, 50.0]), st.sampled_from([1, 4, 64, 1_000_000]))
def test_picks_are_within_one_bucket_of_the_exact_marconi_utility(steps, alpha, buckets):
    tree, pools, policy = make_tree(alpha=alpha, buckets=buckets)
    for operation, key, amount in steps:
        apply(tree, pools, operation, key, amount)
        check_picks_against_brute_force(tree, policy)
    policy.check_invariants()


def test_one_bucket_is_lru_and_fine_buckets_are_exact_marconi():
    rng = random.Random(7)
    for buckets in (1, 1_000_000):
        tree, pools, policy = make_tree(alpha=3.0, buckets=buckets)
        agree = 0
        for _ in range(300):
            cache(tree, pools, tuple(rng.randrange(50) for _ in range(rng.randrange(1, 12))))
            candidates = brute_force_candidates(tree, "leaf")
            utilities = exact_utilities(policy, candidates)
            chosen = policy.pick_leaf()
            if buckets == 1:
                assert chosen is min(candidates, key=lambda item: item[1])[0]
            else:
                agree += utilities[chosen.node_id] == min(utilities.values())
            if tree.num_nodes > 20:
                tree.evict_tokens(5)
        if buckets > 1:
            assert agree == 300


# ------------------------------------------------------------------------------ lifecycles with locks and slots


class Lifecycle:
    """Requests that match, lock, allocate, insert and unlock, with evictions through the policy in between."""

    def __init__(self, alpha: float) -> None:
        self.pools = SlotPools(kv_size=150, state_size=12)
        self.policy = FlopAwareEviction(ToySpec(), alpha, buckets=8)
        self.tree = HybridRadixTree(self.pools, eviction=self.policy, state_chunk_size=0)
        self.running: list[tuple[tuple, object, list[int], list[int], int]] = []

    def start(self, key: tuple) -> None:
        match = self.tree.match(key)
        lock = self.tree.lock(match.state_node)
        need = len(key) - match.reusable_len
        if len(self.pools.free_kv_slots) < need:
            self.tree.evict_tokens(need - len(self.pools.free_kv_slots))
        if not self.pools.free_state_slots:
            self.tree.evict_states(1)
        if len(self.pools.free_kv_slots) < need or not self.pools.free_state_slots:
            self.tree.unlock(lock)
            return
        tree_kv = [slot for segment in match.kv for slot in segment]
        self.running.append((key, lock, tree_kv, self.pools.alloc_kv(need), self.pools.alloc_state()))

    def finish(self, index: int) -> None:
        key, lock, tree_kv, own_kv, state = self.running.pop(index % len(self.running))
        kv = tree_kv + own_kv
        result = self.tree.insert(key, kv, state)
        self.pools.free_kv(kv[len(tree_kv) : result.prefix_len])
        if not result.state_taken:
            self.pools.free_state(state)
        self.tree.unlock(lock)

    def check_slots(self) -> None:
        tree_kv, tree_states = tree_held_slots(self.tree)
        owned_kv = [slot for *_, own_kv, _ in self.running for slot in own_kv]
        owned_states = [state for *_, state in self.running]
        all_kv = [*tree_kv, *owned_kv, *self.pools.free_kv_slots]
        all_states = [*tree_states, *owned_states, *self.pools.free_state_slots]
        assert len(all_kv) == len(set(all_kv)) == self.pools.kv_size, "KV slots leaked or double-held"
        assert len(all_states) == len(set(all_states)) == self.pools.state_size, "state slots leaked or double-held"


LIFECYCLE_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "start", "finish", "finish", "match", "evict", "alpha"]),
        keys,
        st.integers(0, 30),
    ),
    min_size=20,
    max_size=80,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LIFECYCLE_STEPS, st.sampled_from([0.0, 2.0]))
def test_random_lifecycles_keep_tree_and_policy_invariants_and_leak_no_slots(steps, alpha):
    life = Lifecycle(alpha)
    tree, policy = life.tree, life.policy
    for operation, key, amount in steps:
        if operation == "start":
            life.start(key)
        elif operation == "finish" and life.running:
            life.finish(amount)
        elif operation == "match":
            tree.match(key)
        elif operation == "evict":
            kind = amount % 3
            if kind == 0:
                tree.evict_tokens(amount)
            elif kind == 1:
                tree.evict_states(1 + amount // 10)
            else:
                tree.evict_memory(amount * 20, kv_bytes_per_token=10, state_bytes=100)
        elif operation == "alpha":
            policy.alpha = amount / 3
        tree.check_invariants()
        policy.check_invariants()
        check_picks_against_brute_force(tree, policy)
        life.check_slots()
    while life.running:
        life.finish(0)
    tree.evict_tokens(10**9)
    assert tree.num_nodes == 0 and policy.pick_leaf() is None and policy.pick_state() is None
    assert len(life.pools.free_kv_slots) == life.pools.kv_size
    assert len(life.pools.free_state_slots) == life.pools.state_size
    tree.reset()
    policy.check_invariants()


def test_reset_forgets_every_candidate():
    tree, pools, policy = make_tree()
    cache(tree, pools, (1, 2, 3))
    tree.reset()
    assert policy.pick_leaf() is None and policy.pick_state() is None and policy.pick_victim() is None
    cache(tree, pools, (4, 5))
    assert tuple(policy.pick_leaf().key) == (4, 5)
    policy.check_invariants()


def test_stale_heap_entries_are_compacted():
    tree, pools, policy = make_tree(alpha=1.0)
    keys_cached = [tuple(range(base, base + 3)) for base in range(0, 30, 3)]
    for key in keys_cached:
        cache(tree, pools, key)
    for round_ in range(5000):
        tree.match(keys_cached[round_ % len(keys_cached)])
        if round_ % 97 == 0:
            assert policy.pick_victim() is not None  # flushes the touched states
    # Each of the 3 sets holds 10 members in at most 10 buckets plus 3 extreme heaps, and every heap stays within
    # 2 x live + 32 entries (+1 for the push that triggers a rebuild); 5,000 touches push over 20,000 entries.
    assert policy.heap_entries() <= 3 * (10 * (2 * 10 + 33) + 3 * (2 * 10 + 33))
    policy.check_invariants()


# ---------------------------------------------------------------------------------------------- the tuner


def scripted(hits_by_alpha: dict[float, float], calls: list | None = None):
    def evaluate(alpha: float, window) -> float:
        if calls is not None:
            calls.append((alpha, tuple(window)))
        return hits_by_alpha[alpha]

    return evaluate


GRID = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)


def test_guard_keeps_lru_when_it_wins_or_ties():
    lru_wins = AlphaTuner(scripted({alpha: 100 - alpha for alpha in GRID}), grid=GRID, retune_every=1)
    assert lru_wins.observe("r") == 0.0
    all_tie = AlphaTuner(scripted(dict.fromkeys(GRID, 50)), grid=GRID, retune_every=1)
    assert all_tie.observe("r") == 0.0
    assert all_tie.history[0].hits == dict.fromkeys(GRID, 50.0)


def test_guard_takes_a_tuned_alpha_only_when_it_strictly_beats_lru_by_the_margin():
    hits = {0.0: 100, 0.5: 100, 1.0: 104, 2.0: 106, 4.0: 106, 8.0: 90}
    def tuner(**options):
        return AlphaTuner(scripted(hits), grid=GRID, window=1, retune_every=1, **options)

    assert tuner().observe("r") == 2.0  # best; 4 ties with it, 2 is smaller
    assert tuner(margin=5).observe("r") == 2.0  # 106 > 100 + 5
    assert tuner(margin=6).observe("r") == 0.0  # 106 is not > 106


def test_window_slides_and_retunes_follow_the_cadence():
    calls: list = []
    tuner = AlphaTuner(scripted({0.0: 1, 2.0: 2}, calls), grid=(2.0,), window=3, retune_every=2)
    assert tuner.grid == (0.0, 2.0)  # the LRU baseline is always evaluated
    choices = [tuner.observe(index) for index in range(1, 8)]
    assert choices == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0]  # the first re-tune saw 2 requests: too few
    assert [record.request_index for record in tuner.history] == [2, 4, 6]
    assert [record.window_size for record in tuner.history] == [2, 3, 3]
    assert calls == [
        (0.0, (1, 2)), (2.0, (1, 2)),
        (0.0, (2, 3, 4)), (2.0, (2, 3, 4)),
        (0.0, (4, 5, 6)), (2.0, (4, 5, 6)),
    ]  # fmt: skip


def test_a_tuned_alpha_waits_for_min_window_requests():
    for min_window, expected in ((None, [0.0, 0.0, 0.0, 2.0]), (2, [0.0, 2.0, 2.0, 2.0]), (1, [2.0] * 4)):
        tuner = AlphaTuner(scripted({0.0: 1, 2.0: 2}), grid=(2.0,), window=4, retune_every=1, min_window=min_window)
        assert [tuner.observe(index) for index in range(4)] == expected, min_window
        assert all(record.hits == {0.0: 1.0, 2.0: 2.0} for record in tuner.history)  # evaluated all the same


def test_tuner_returns_to_lru_when_the_workload_turns():
    phase = {"hits": {0.0: 10, 4.0: 20}}
    tuner = AlphaTuner(lambda alpha, window: phase["hits"][alpha], grid=(4.0,), window=2, retune_every=2)
    policy = FlopAwareEviction(ToySpec(), alpha=3.0)
    tuner.bind(policy)
    assert policy.alpha == 0.0  # binding applies the current choice
    tuner.observe("a")
    tuner.observe("b")
    assert tuner.alpha == policy.alpha == 4.0
    phase["hits"] = {0.0: 20, 4.0: 20}
    tuner.observe("c")
    tuner.observe("d")
    assert tuner.alpha == policy.alpha == 0.0
    assert [(record.alpha, record.hits) for record in tuner.history] == [
        (4.0, {0.0: 10.0, 4.0: 20.0}),
        (0.0, {0.0: 20.0, 4.0: 20.0}),
    ]


def test_tuner_rejects_bad_arguments_and_bad_evaluations():
    evaluate = scripted(dict.fromkeys(GRID, 1))
    with pytest.raises(ValueError, match="grid"):
        AlphaTuner(evaluate, grid=(0.0, -1.0))
    with pytest.raises(ValueError, match="grid"):
        AlphaTuner(evaluate, grid=(math.nan,))
    with pytest.raises(ValueError, match="window"):
        AlphaTuner(evaluate, window=0)
    with pytest.raises(ValueError, match="retune_every"):
        AlphaTuner(evaluate, retune_every=2.5)
    with pytest.raises(ValueError, match="min_window"):
        AlphaTuner(evaluate, min_window=0)
    with pytest.raises(ValueError, match=r"min_window \(6\) exceeds window \(5\)"):
        AlphaTuner(evaluate, window=5, min_window=6)
    with pytest.raises(ValueError, match="margin"):
        AlphaTuner(evaluate, margin=-1)
    with pytest.raises(TypeError, match="callable"):
        AlphaTuner(None)
    with pytest.raises(ValueError, match=r"evaluate\(0.0, window\) returned nan"):
        AlphaTuner(lambda alpha, window: math.nan, window=1, retune_every=1).observe("r")


# ------------------------------------------------------------------- the tuner on a live cache, with shadow replays

SPEC = ToySpec()
BUDGET_BYTES = 12_000


def replay(policy: FlopAwareEviction, requests, tree: HybridRadixTree | None = None, pools=None) -> int:
    """Serve ``requests`` one at a time in a cache of BUDGET_BYTES; returns the reused input tokens."""
    if tree is None:
        pools = SlotPools(kv_size=100_000, state_size=10_000)
        tree = HybridRadixTree(pools, eviction=policy, state_chunk_size=0)
    hits = 0
    for request in requests:
        hits += tree.match(request.input_tokens).reusable_len
        cache(tree, pools, request.input_tokens + request.output_tokens)
        used = tree.total_tokens * SPEC.kv_bytes_per_token + tree.total_states * SPEC.state_bytes
        if used > BUDGET_BYTES:
            tree.evict_memory(used - BUDGET_BYTES, SPEC.kv_bytes_per_token, SPEC.state_bytes)
    return hits


def synthetic_requests(count: int, seed: int, sessions: int = 4, session_every: int = 6) -> list[Request]:
    """Every ``session_every``-th request continues one of a few long conversations (round robin); the others
    are short one-off prompts. LRU lets the one-offs push the conversations out; FLOP-awareness keeps the
    conversations, whose deep tokens cost more to recompute per byte."""
    rng = random.Random(seed)
    histories = [tuple(rng.randrange(10**6) for _ in range(rng.randrange(100, 160))) for _ in range(sessions)]
    requests = []
    for index in range(count):
        if index % session_every == 0:
            session = index // session_every % sessions
            prompt = histories[session] + tuple(rng.randrange(10**6) for _ in range(10))
            reply = tuple(rng.randrange(10**6) for _ in range(10))
            histories[session] = prompt + reply
            requests.append(Request(f"session-{session}", index, float(index), prompt, reply))
        else:
            prompt = tuple(rng.randrange(10**6) for _ in range(rng.randrange(5, 15)))
            requests.append(Request(f"one-off-{index}", 0, float(index), prompt, (1, 2)))
    return requests


def test_tuner_drives_a_live_policy_and_never_chooses_an_alpha_that_lost_to_lru():
    def evaluate(alpha: float, window) -> float:
        return replay(FlopAwareEviction(SPEC, alpha), window)

    tuner = AlphaTuner(evaluate, grid=(0.5, 2.0, 8.0), window=60, retune_every=30)
    live = FlopAwareEviction(SPEC)
    tuner.bind(live)
    pools = SlotPools(kv_size=100_000, state_size=10_000)
    tree = HybridRadixTree(pools, eviction=live, state_chunk_size=0)
    for request in synthetic_requests(300, seed=3):
        replay(live, [request], tree, pools)
        tuner.observe(request)
        tree.check_invariants()
    live.check_invariants()
    assert len(tuner.history) == 10
    for record in tuner.history:
        assert record.hits[record.alpha] >= record.hits[0.0]
        assert record.alpha == 0.0 or record.hits[record.alpha] > record.hits[0.0]
    assert {record.alpha for record in tuner.history} != {0.0}, "FLOP-awareness should win on this workload"
