"""Each tree operation on worked examples (the seeds' match, split and tombstone examples among them)."""

from __future__ import annotations

import pytest
from tree_harness import SlotPools

from hybrid_prefix_cache.core import HybridRadixTree, TreeError


def make_tree(**options) -> tuple[HybridRadixTree, SlotPools]:
    pools = SlotPools(kv_size=10_000, state_size=100)
    return HybridRadixTree(pools, **options), pools


def cache(tree: HybridRadixTree, pools: SlotPools, key, namespace=None, with_state: bool = True):
    """Insert ``key`` as a finished request would: fresh KV for the new part, a fresh state."""
    match = tree.match(key, namespace, record=False)
    kv = [slot for segment in tree.path_kv(match.last_node) for slot in segment] if match.matched_len else []
    kv += pools.alloc_kv(len(key) - len(kv))
    state = pools.alloc_state() if with_state else None
    result = tree.insert(key, kv, state, namespace)
    pools.free_kv(kv[match.matched_len : result.prefix_len])
    if state is not None and not result.state_taken:
        pools.free_state(state)
    return result


def test_match_150_tokens_resumes_at_the_state_and_branches_at_the_chunk_boundary():
    # The Qwen3-Next seed (section 4.2/5.2): a state at 96, KV to 150. The seed prints the aligned length as 96,
    # but floor(150 / 64) * 64 is 128: the request resumes from the state at 96 and tracks its state at 128.
    tree, pools = make_tree(state_chunk_size=64)
    tokens = list(range(1000))
    cache(tree, pools, tokens[:191])
    cache(tree, pools, tokens[:96])
    cache(tree, pools, [*tokens[:150], 7, 7])  # the seed's tree: [0,96) state, [96,150) tombstone, two leaves
    tree.check_invariants()
    assert tree.match(tokens[:150], record=False).last_node.state is None
    result = tree.match(tokens[:150] + [5000] * 41)
    assert (result.reusable_len, result.matched_len, result.branching_seqlen) == (96, 150, 128)
    assert sum(len(segment) for segment in result.kv) == 96


def test_branching_seqlen_is_none_when_the_floor_is_zero_or_not_beyond_the_state():
    tree, pools = make_tree(state_chunk_size=64)
    cache(tree, pools, list(range(100)), with_state=False)
    assert tree.num_nodes == 0, "an unlocked stateless leaf is not kept"
    cache(tree, pools, list(range(120)))
    cache(tree, pools, list(range(70)))
    cache(tree, pools, [*range(100), 7])
    assert tree.match(list(range(100)), record=False).branching_seqlen is None  # floor(100/64)*64=64 < 70
    tree2, pools2 = make_tree(state_chunk_size=64)
    cache(tree2, pools2, list(range(50)))
    assert tree2.match([*list(range(40)), 9], record=False).branching_seqlen is None  # 40 floors to 0
    tree3, _ = make_tree(state_chunk_size=0)
    assert tree3.match([1, 2, 3], record=False).branching_seqlen is None


def test_split_makes_the_upper_part_a_tombstone_and_the_child_keeps_its_state():
    # The MambaRadixCache seed (section 1.8): [1,2,3,4,5] cached, then [1,2,3,6,7] arrives.
    tree, pools = make_tree()
    first = cache(tree, pools, [1, 2, 3, 4, 5])
    state_of_first = first.node.state
    result = tree.match([1, 2, 3, 6, 7])
    assert (result.reusable_len, result.matched_len) == (0, 3)
    upper = result.last_node
    assert tuple(upper.key) == (1, 2, 3) and upper.state is None
    assert first.node.parent is upper and tuple(first.node.key) == (4, 5) and first.node.state == state_of_first
    second = cache(tree, pools, [1, 2, 3, 6, 7])
    assert second.prefix_len == 3 and not second.state_existed
    assert sorted(tuple(child.key) for child in upper.children.values()) == [(4, 5), (6, 7)]
    tree.check_invariants()


def test_insert_reports_the_cached_prefix_and_an_existing_state_and_revives_a_tombstone():
    tree, pools = make_tree()
    cache(tree, pools, [1, 2, 3, 4, 5])
    tree.match([1, 2, 3, 9], record=False)  # splits: [1,2,3] becomes a tombstone
    again = tree.insert([1, 2, 3, 4, 5], pools.alloc_kv(5), pools.alloc_state())
    assert again.prefix_len == 5 and again.state_existed and not again.state_taken
    revive_state = pools.alloc_state()
    revived = tree.insert([1, 2, 3], [0, 0, 0], revive_state)
    assert revived.prefix_len == 3 and not revived.state_existed and revived.state_taken
    assert revived.node.state == revive_state
    assert tree.match([1, 2, 3, 7], record=False).reusable_len == 3


def test_state_eviction_tombstones_inner_nodes_and_deletes_free_leaves():
    tree, pools = make_tree()
    cache(tree, pools, [1, 2, 3])
    cache(tree, pools, [1, 2, 3, 4, 5])
    cache(tree, pools, [1, 2, 3, 6, 7])
    inner = tree.match([1, 2, 3], record=False).state_node
    tree.match([1, 2, 3, 4, 5], record=False)
    tree.match([1, 2, 3, 6, 7], record=False)
    result = tree.evict_states(1)  # LRU state: [1,2,3], touched before the two leaves
    assert (result.states, result.tokens) == (1, 0)
    assert inner.state is None and inner.parent is tree.root and len(inner.children) == 2
    result = tree.evict_states(1)  # leaf [4,5]: deleted with its KV
    assert (result.states, result.tokens) == (1, 2)
    assert len(inner.children) == 1
    result = tree.evict_states(1)  # last leaf goes, and the tombstone left as a leaf goes with it
    assert (result.states, result.tokens) == (1, 5)
    assert tree.num_nodes == 0 and tree.total_tokens == 0
    tree.check_invariants()


def test_full_eviction_takes_least_recent_unlocked_leaves_first():
    tree, pools = make_tree()
    cache(tree, pools, [1, 2])
    cache(tree, pools, [3, 4])
    cache(tree, pools, [5, 6])
    tree.match([1, 2], record=False)
    lock = tree.lock(tree.match([3, 4], record=False).state_node)
    assert tree.evict_tokens(1).tokens == 2  # [5,6] is least recent
    assert tree.match([5, 6], record=False).matched_len == 0
    assert tree.evict_tokens(10).tokens == 2  # [1,2]; [3,4] is locked
    assert tree.protected_tokens == 2 and tree.evictable_tokens == 0
    tree.unlock(lock)
    assert tree.evict_tokens(10).tokens == 2
    tree.check_invariants()


def test_locks_protect_state_and_path_and_counters_follow():
    tree, pools = make_tree()
    cache(tree, pools, [1, 2, 3, 4])
    cache(tree, pools, [1, 2, 3, 4, 5, 6])
    node = tree.match([1, 2, 3, 4], record=False).state_node
    lock = tree.lock(node)
    assert (node.full_lock, node.state_lock) == (1, 1)
    assert (tree.protected_tokens, tree.evictable_tokens, tree.protected_states, tree.evictable_states) == (4, 2, 1, 1)
    assert tree.evict_states(5).states == 1  # only the leaf's state is evictable
    assert node.state is not None
    tree.unlock(lock)
    with pytest.raises(TreeError, match="already released"):
        tree.unlock(lock)
    tree.check_invariants()


def test_locked_tombstone_that_loses_its_last_child_is_removed_on_unlock_and_all_can_be_evicted():
    # The upstream defect (ENGINE_NOTES): a tombstone locked while its last child is evicted must not survive
    # as an unlocked tombstone leaf, and a later full eviction must work.
    tree, pools = make_tree()
    cache(tree, pools, [1, 2, 3, 4, 5])
    match = tree.match([1, 2, 3, 9, 9], record=False)
    tombstone = match.last_node
    assert tombstone.state is None
    lock = tree.lock(tombstone)
    assert tree.evict_tokens(100).tokens == 2  # the child [4,5] goes, the locked tombstone stays
    assert tombstone.is_leaf and tombstone.parent is tree.root
    tree.check_invariants()
    tree.unlock(lock)
    assert tombstone.parent is None and tree.num_nodes == 0
    tree.check_invariants()
    assert tree.evict_tokens(100).tokens == 0
    assert len(pools.free_kv_slots) == pools.kv_size and len(pools.free_state_slots) == pools.state_size


def test_namespaces_never_share_nodes():
    tree, pools = make_tree()
    cache(tree, pools, [1, 2, 3], namespace="lora-a")
    assert tree.match([1, 2, 3], namespace="lora-b", record=False).matched_len == 0
    assert tree.match([1, 2, 3], record=False).matched_len == 0
    assert tree.match([1, 2, 3], namespace="lora-a", record=False).reusable_len == 3
    cache(tree, pools, [1, 2, 3], namespace="lora-b")
    assert tree.num_nodes == 2
    tree.check_invariants()


def test_pages_are_matched_and_stored_whole():
    tree, pools = make_tree(page_size=4)
    result = cache(tree, pools, list(range(10)))
    assert result.inserted_len == 8 and tuple(result.node.key) == tuple(range(8))
    match = tree.match([0, 1, 2, 3, 4, 5, 99, 7, 8])
    assert (match.matched_len, match.reusable_len) == (4, 0)
    assert tuple(match.last_node.key) == (0, 1, 2, 3)
    assert tree.match(list(range(7)), record=False).matched_len == 4
    tree.check_invariants()


def test_statistics_count_hits_reuse_states_evictions_and_flops():
    pools = SlotPools(kv_size=1000, state_size=10)
    tree = HybridRadixTree(pools, flops_saved=lambda tokens: 10.0 * tokens)
    tree.match([1, 2, 3, 4])  # miss
    cache(tree, pools, [1, 2, 3, 4])
    tree.match([1, 2, 3, 4, 5, 6])  # hit 4 of 6
    cache(tree, pools, [7, 8], with_state=True)
    tree.match([1, 2, 9])  # KV match of 2, no state: not a state hit
    tree.evict_states(1)
    stats = tree.stats
    assert (stats.requests, stats.hit_requests, stats.requested_tokens, stats.reused_tokens) == (3, 1, 13, 4)
    assert stats.request_hit_rate == pytest.approx(1 / 3)
    assert stats.token_reuse_rate == pytest.approx(4 / 13)
    assert stats.state_hit_rate == pytest.approx(1 / 2)
    assert stats.flops_saved == 40.0 and stats.states_evicted == 1


def test_reset_frees_everything_and_refuses_while_locked():
    tree, pools = make_tree()
    cache(tree, pools, [1, 2, 3])
    lock = tree.lock(tree.match([1, 2, 3], record=False).state_node)
    with pytest.raises(TreeError, match="still locked"):
        tree.reset()
    tree.unlock(lock)
    tree.reset()
    assert len(pools.free_kv_slots) == pools.kv_size and len(pools.free_state_slots) == pools.state_size
    assert tree.num_nodes == 0
    tree.check_invariants()


def test_bad_arguments_are_named():
    pools = SlotPools(kv_size=10, state_size=1)
    with pytest.raises(ValueError, match="page_size"):
        HybridRadixTree(pools, page_size=0)
    with pytest.raises(ValueError, match="state_chunk_size"):
        HybridRadixTree(pools, state_chunk_size=-1)
    tree = HybridRadixTree(pools)
    with pytest.raises(ValueError, match="2 KV slots for a key of 3"):
        tree.insert([1, 2, 3], [0, 1])


def test_pretty_print_shows_spans_states_and_locks():
    tree, pools = make_tree()
    cache(tree, pools, [1, 2, 3, 4, 5])
    tree.match([1, 2, 3, 6], record=False)
    text = tree.pretty_print()
    assert "[0:3] (1, 2, 3) tombstone lock=0/0" in text
    assert "[3:5] (4, 5) state=" in text


def test_shared_budget_eviction_frees_the_older_of_leaf_and_state():
    tree, pools = make_tree()
    cache(tree, pools, [1, 2, 3])
    cache(tree, pools, [1, 2, 3, 4, 5])
    cache(tree, pools, [7, 8])
    tree.match([1, 2, 3], record=False)  # the state at [1,2,3] is now newer than leaf [7,8]
    tree.match([1, 2, 3, 4, 5], record=False)
    result = tree.evict_memory(1, kv_bytes_per_token=10, state_bytes=100)
    assert (result.tokens, result.states) == (2, 1)  # leaf [7,8], least recently used
    result = tree.evict_memory(100, kv_bytes_per_token=10, state_bytes=100)
    assert (result.tokens, result.states) == (0, 1)  # the state at [1,2,3]: older than the leaf below it
    assert tree.match([1, 2, 3], record=False).state_node is tree.root
    result = tree.evict_memory(10_000, kv_bytes_per_token=10, state_bytes=100)
    assert tree.num_nodes == 0 and tree.total_states == 0
    tree.check_invariants()


def test_keep_stateless_leaves_retains_kv_until_evicted():
    tree, pools = make_tree(keep_stateless_leaves=True)
    cache(tree, pools, [1, 2, 3, 4], with_state=False)
    assert tree.num_nodes == 1 and tree.total_states == 0
    match = tree.match([1, 2, 3, 4, 5], record=False)
    assert (match.matched_len, match.reusable_len) == (4, 0)
    tree.check_invariants()
    assert tree.evict_tokens(1).tokens == 4 and tree.num_nodes == 0
