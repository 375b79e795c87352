"""The engine-free eviction index behind ``marconi`` in vLLM (adapters/vllm/block_index.py)."""

from __future__ import annotations

import random

import pytest

from hybrid_prefix_cache.adapters.vllm.block_index import (
    DEAD,
    SCORED,
    SUBSUMED,
    BlockCacheIndex,
    BlockCosts,
    RequestRecord,
    ShadowCache,
    shadow_hits,
)

FA_GROUP, STATE_GROUPS = 0, (1, 2)
BLOCK = 16


class QuadraticModel:
    """Attention-like cost: a segment's FLOPs grow with its end position."""

    def segment_flops(self, start: int, end: int) -> float:
        return float(end * end - start * start)


def costs() -> BlockCosts:
    return BlockCosts(QuadraticModel(), BLOCK, 100, 1, len(STATE_GROUPS))


def new_index(num_blocks: int = 64, alpha: float = 0.0) -> BlockCacheIndex:
    return BlockCacheIndex(num_blocks, (FA_GROUP,), STATE_GROUPS, costs(), alpha=alpha)


def cache_chain(index: BlockCacheIndex, first_block: int, keys: list[str], state_at: int | None) -> dict[str, int]:
    """Admit FA blocks for ``keys`` (ids from ``first_block``) and a complete state at ``keys[state_at]``."""
    ids = {}
    previous = None
    for offset, key in enumerate(keys):
        block_id = first_block + offset
        index.admit(block_id, key, FA_GROUP)
        if previous is not None:
            index.link_parent(block_id, previous)
        previous = ids[key] = block_id
    if state_at is not None:
        for offset, group in enumerate(STATE_GROUPS):
            block_id = first_block + len(keys) + offset
            index.admit(block_id, keys[state_at], group)
            ids[f"state{group}"] = block_id
    return ids


def release_all(index: BlockCacheIndex, block_ids: list[int]) -> None:
    for block_id in block_ids:
        index.release(block_id)


def drain(index: BlockCacheIndex) -> list[int]:
    """Evict until nothing is left, as the pool does: take the pick, then drop its key."""
    order = []
    while (victim := index.pick_victim()) is not None:
        index.acquire(victim)
        index.drop(victim)
        order.append(victim)
    return order


def test_alpha_zero_evicts_in_release_order() -> None:
    index = new_index()
    ids = cache_chain(index, 1, ["a", "b", "c"], state_at=2)
    order = [ids["state1"], ids["c"], ids["state2"], ids["b"], ids["a"]]
    release_all(index, order)
    assert all(index.candidate_of(block_id) == SCORED for block_id in ids.values())
    assert drain(index) == order


def test_blocks_without_a_state_go_first_once_alpha_weighs_flops() -> None:
    index = new_index()
    dead = cache_chain(index, 1, ["a", "b", "c"], state_at=None)
    live = cache_chain(index, 10, ["x"], state_at=0)
    index.assign_node(["x"], costs().node_efficiency(0, BLOCK))
    release_all(index, [*live.values(), dead["a"], dead["b"], dead["c"]])
    assert index.candidate_of(dead["c"]) == DEAD
    assert index.candidate_of(dead["b"]) == SCORED
    assert index.pick_victim() == live["x"]
    # Blocks covered by no state (the whole dead chain) save nothing: they go before the older live node.
    index.alpha = 4.0
    assert index.pick_victim() == dead["a"]
    index.acquire(dead["c"])
    index.drop(dead["c"])
    assert index.candidate_of(dead["b"]) == DEAD


def test_incomplete_state_and_its_fa_leaf_are_dead() -> None:
    index = new_index()
    ids = cache_chain(index, 1, ["a", "b"], state_at=1)
    release_all(index, [ids["a"], ids["b"], ids["state1"], ids["state2"]])
    index.acquire(ids["state1"])
    index.drop(ids["state1"])
    assert index.candidate_of(ids["state2"]) == DEAD
    assert index.candidate_of(ids["b"]) == DEAD
    assert index.candidate_of(ids["a"]) == SCORED


def test_a_redundant_copy_is_dead_and_the_in_use_copy_is_kept() -> None:
    index = new_index()
    index.admit(1, "a", FA_GROUP)
    index.admit(2, "a", FA_GROUP)
    for offset, group in enumerate(STATE_GROUPS):
        index.admit(3 + offset, "a", group)
    index.release(1)
    assert index.candidate_of(1) == DEAD
    index.release(2)
    assert {index.candidate_of(1), index.candidate_of(2)} == {DEAD, SCORED}
    index.acquire(2)
    assert index.candidate_of(1) == DEAD


def test_hit_takes_blocks_out_and_release_makes_them_newest() -> None:
    index = new_index()
    first = cache_chain(index, 1, ["a"], state_at=0)
    second = cache_chain(index, 10, ["x"], state_at=0)
    release_all(index, list(first.values()) + list(second.values()))
    for block_id in first.values():
        index.acquire(block_id)
    assert index.num_candidates() == len(second)
    release_all(index, list(first.values()))
    assert drain(index)[: len(second)] == list(second.values())


def test_positive_alpha_keeps_the_node_that_saves_more_flops_per_byte() -> None:
    index = new_index(alpha=8.0)
    shallow = cache_chain(index, 1, ["a"], state_at=0)
    deep = cache_chain(index, 10, ["x0", "x1", "x2", "x3"], state_at=3)
    index.assign_node(["a"], costs().node_efficiency(0, BLOCK))
    index.assign_node(["x0", "x1", "x2", "x3"], costs().node_efficiency(0, 4 * BLOCK))
    assert index.efficiency_of(deep["state1"]) > index.efficiency_of(shallow["state1"])
    # The deep chain is released first (older), yet its node saves more per byte and survives alpha = 8.
    release_all(index, list(deep.values()) + list(shallow.values()))
    assert index.pick_victim() in (shallow["a"], shallow["state1"], shallow["state2"])
    index.alpha = 0.0
    assert index.pick_victim() == next(iter(deep.values()))


def two_turns_after_another_session(
    alpha: float,
) -> tuple[BlockCacheIndex, dict[str, int], dict[str, int], dict[str, int]]:
    """An older session ("o"), then a conversation: turn 1 caches ``a b`` and its state at ``b``, turn 2 hits
    it and caches ``c d`` with its state at ``d`` (parent: the state at ``b``). Every block released as vLLM
    does (states, then FA tail first); returns the index and the blocks of the older session, turn 1, turn 2."""
    index = new_index(alpha=alpha)
    older = cache_chain(index, 1, ["o0", "o1"], state_at=1)
    index.assign_states(["o0", "o1"], [(1, 0)])
    release_all(index, [older["state1"], older["state2"], older["o1"], older["o0"]])
    first = cache_chain(index, 10, ["a", "b"], state_at=1)
    index.assign_states(["a", "b"], [(1, 0)])
    release_all(index, [first["state1"], first["state2"], first["b"], first["a"]])
    for block_id in first.values():
        index.acquire(block_id)
    second = cache_chain(index, 20, ["c", "d"], state_at=1)
    index.link_parent(second["c"], first["b"])
    index.assign_states(["a", "b", "c", "d"], [(3, 2 * BLOCK)])
    release_all(
        index,
        [second["state1"], second["state2"], first["state1"], first["state2"], second["d"], second["c"],
         first["b"], first["a"]],
    )
    return index, older, first, second


def test_positive_alpha_drops_the_previous_turns_state_before_an_older_session() -> None:
    index, older, first, _ = two_turns_after_another_session(alpha=1.0)
    turn_one_state = {first["state1"], first["state2"]}
    assert {index.candidate_of(block_id) for block_id in turn_one_state} == {SUBSUMED}
    assert index.num_subsumed() == 2
    order = drain(index)
    # Turn 1's state goes whole and first; its FA blocks stay, turn 2's hit needs them.
    assert set(order[:2]) == turn_one_state
    assert order.index(first["a"]) > order.index(older["o0"])


def test_alpha_zero_ignores_subsumption_and_keeps_lru_order() -> None:
    index, older, first, _ = two_turns_after_another_session(alpha=0.0)
    order = drain(index)
    assert order[:4] == [older["state1"], older["state2"], older["o1"], older["o0"]]
    assert order.index(first["state1"]) > 3


def test_a_branch_point_or_a_lost_child_state_is_not_subsumed() -> None:
    index, _, first, second = two_turns_after_another_session(alpha=1.0)
    fork = cache_chain(index, 30, ["x"], state_at=None)
    index.link_parent(fork["x"], first["b"])
    # Two paths leave the state at b: a request may diverge there.
    assert index.candidate_of(first["state1"]) == SCORED
    index.acquire(fork["x"])
    index.drop(fork["x"])
    assert index.candidate_of(first["state1"]) == SUBSUMED
    assert index.pick_victim() in (first["state1"], first["state2"])
    # Turn 2's state loses a block: turn 1's is the deepest complete state on the path again.
    index.acquire(second["state2"])
    index.drop(second["state2"])
    assert index.num_subsumed() == 0
    assert index.candidate_of(first["state1"]) == SCORED


def test_reset_forgets_every_key() -> None:
    index = new_index()
    ids = cache_chain(index, 1, ["a", "b"], state_at=1)
    release_all(index, list(ids.values()))
    index.reset()
    assert index.pick_victim() is None
    assert not any(index.is_cached(block_id) for block_id in ids.values())


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((0, (0,), (1,)), "num_blocks"),
        ((4, (0,), ()), "state"),
        ((4, (0,), (0,)), "both kinds"),
    ],
)
def test_bad_index_arguments_are_named(arguments: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockCacheIndex(*arguments, costs())


def test_block_costs_reject_nonsense_and_count_node_bytes() -> None:
    with pytest.raises(ValueError, match="block_bytes"):
        BlockCosts(QuadraticModel(), BLOCK, 0, 1, 1)
    node = costs()
    # Two state blocks plus one FA block per 16 tokens, 100 bytes each.
    assert node.node_efficiency(0, 32) == pytest.approx(32 * 32 / (2 * 100 + 2 * 100))


def test_shadow_hits_the_previous_turn_and_loses_it_under_pressure() -> None:
    first = RequestRecord(keys=("a", "b", "c"), max_hit_blocks=2, states=((2, 0),))
    follow_up = RequestRecord(keys=("a", "b", "c", "d", "e"), max_hit_blocks=4, states=((4, 3 * BLOCK),))
    unrelated = RequestRecord(keys=("p", "q", "r", "s"), max_hit_blocks=3, states=((3, 0),))
    roomy = ShadowCache(new_index(num_blocks=64), BLOCK)
    assert [roomy.serve(record) for record in (first, follow_up)] == [0, 3 * BLOCK]
    tight = ShadowCache(new_index(num_blocks=7), BLOCK)
    assert [tight.serve(record) for record in (first, unrelated, follow_up)] == [0, 0, 0]


def test_shadow_hits_sum_over_the_window() -> None:
    records = [RequestRecord(keys=("a", "b", "c"), max_hit_blocks=2, states=((1, 0),))] * 3
    total = shadow_hits(
        records, num_blocks=32, block_size=BLOCK, fa_groups=(FA_GROUP,), state_groups=STATE_GROUPS,
        costs=costs(), alpha=0.0,
    )
    assert total == 2 * 2 * BLOCK


def test_shadow_sees_the_gain_of_dropping_subsumed_states() -> None:
    other_session = RequestRecord(keys=("b0", "b1"), max_hit_blocks=1, states=((1, 0),))
    turn_one = RequestRecord(keys=("a0", "a1"), max_hit_blocks=1, states=((1, 0),))
    turn_two = RequestRecord(keys=("a0", "a1", "a2", "a3"), max_hit_blocks=3, states=((3, 2 * BLOCK),))
    newcomer = RequestRecord(keys=("c0", "c1"), max_hit_blocks=1, states=((1, 0),))
    other_session_again = RequestRecord(keys=("b0", "b1", "b2", "b3"), max_hit_blocks=3, states=((3, 2 * BLOCK),))
    window = [other_session, turn_one, turn_two, newcomer, other_session_again]
    # 14 blocks: the newcomer evicts two. LRU takes the other session's state; subsumed-first turn 1's.
    hits = {
        alpha: shadow_hits(
            window, num_blocks=14, block_size=BLOCK, fa_groups=(FA_GROUP,), state_groups=STATE_GROUPS,
            costs=costs(), alpha=alpha,
        )
        for alpha in (0.0, 1.0)
    }
    assert hits == {0.0: 2 * BLOCK, 1.0: 4 * BLOCK}


def conversations(rng: random.Random, sessions: int, requests: int) -> list[RequestRecord]:
    """Interleaved multi-turn sessions as the pool records them (each turn extends the previous one and resumes
    from its state), some forking a session's history into a new branch."""
    histories: dict[int, list[str]] = {}
    records = []
    for request in range(requests):
        session = rng.randrange(sessions)
        history = histories.get(session, [])
        if history and rng.random() < 0.2:
            history = history[: rng.randrange(1, len(history) + 1)]
            session = sessions + request
        keys = history + [f"{session}:{request}:{offset}" for offset in range(rng.randrange(1, 4))]
        records.append(RequestRecord(tuple(keys), len(keys) - 1, ((len(keys) - 1, len(history) * BLOCK),)))
        histories[session] = keys
    return records


@pytest.mark.parametrize("seed", range(4))
def test_subsumption_bookkeeping_matches_a_recount_under_eviction(seed: int) -> None:
    rng = random.Random(seed)
    index = new_index(num_blocks=40, alpha=1.0)
    shadow = ShadowCache(index, BLOCK)
    subsumed_seen = 0
    for record in conversations(rng, sessions=5, requests=120):
        shadow.serve(record)
        index.check_invariants()
        subsumed_seen += index.num_subsumed()
    assert subsumed_seen
