"""Request lifecycles through HybridPrefixCache with SGLang 0.5.20's real pools, requests and allocation code.

Every scenario ends with :meth:`CacheDriver.drain`: the tree is evicted whole and every KV and state slot must be
back in its allocator (no leaks); the stand-in model checks every state a request resumes from.
"""

from __future__ import annotations

import random
from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch
from fixtures_sglang import (
    CacheDriver,
    PoolSetup,
    build_pools,
    cache_params,
    conversation_turns,
    make_ours,
    sglang_config,
    tree_states,
)


@pytest.fixture
def config():
    """``config(page_size=...)`` publishes an SGLang configuration until the test ends."""
    with ExitStack() as stack:
        yield lambda **kwargs: stack.enter_context(sglang_config(**kwargs))


STRATEGIES = [
    pytest.param(1, False, id="no_buffer"),
    pytest.param(1, True, id="extra_buffer"),
    pytest.param(2, True, id="extra_buffer-page2"),
]


def ours(backend: str = "mamba-radix", **settings):
    return lambda params: make_ours(params, backend, **settings)


def cached_lengths(driver: CacheDriver) -> list[int]:
    return sorted(len(path) for path, _ in tree_states(driver.cache))


PROMPT = list(range(101, 121))  # 20 tokens
REPLY = [7, 8, 9, 10, 11]


@pytest.mark.parametrize(("page_size", "extra_buffer"), STRATEGIES)
@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        # chunk ends at 8 and 16, end of prefill 20, final state after input + reply[:-1] = 24 (tracked at
        # 24 % track interval 8 == 0 in the extra-buffer strategy)
        ("mamba-radix", [8, 16, 20, 24]),
        # Marconi: no branch point on a cold cache, so only the final state
        ("marconi", [24]),
        ("periodic:16/lru", [16, 24]),
    ],
)
def test_chunked_prefill_then_finish_caches_what_the_policy_admits(config, page_size, extra_buffer, backend,
                                                                     expected):
    config(page_size=page_size)
    driver = CacheDriver(PoolSetup(page_size=page_size, extra_buffer=extra_buffer), ours(backend))
    req = driver.new_request(PROMPT, REPLY)
    assert driver.admit(req, chunk=8) == 0
    assert not driver.prefill(req)  # [0, 8)
    assert req.kv.cache_protected_len == (8 if 8 in expected else 0)
    assert len(req.prefix_indices) == 8
    assert not driver.prefill(req)  # [8, 16)
    assert driver.prefill(req)  # [16, 20) and the first reply token
    assert driver.decode(req)
    driver.finish(req)
    assert cached_lengths(driver) == expected
    driver.check_idle()
    driver.drain()


@pytest.mark.parametrize(("page_size", "extra_buffer"), STRATEGIES)
def test_marconi_input_prefix_hits_from_its_third_occurrence(config, page_size, extra_buffer):
    """Each request shares the 20-token prompt and diverges after it. The first caches only its final state (past
    the prompt); the second finds the prompt in the tree without a state there: its match returns the branch point
    (the prompt floored to the chunk, 20), its prefill captures that state and Marconi admits it; the third hits."""
    config(page_size=page_size)
    driver = CacheDriver(PoolSetup(page_size=page_size, extra_buffer=extra_buffer), ours("marconi"))
    hits = []
    for suffix in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        req = driver.new_request(PROMPT + suffix, REPLY)
        hits.append(driver.admit(req))
        branching = req.mamba_branching_seqlen
        while not driver.prefill(req):
            pass
        driver.decode(req)
        driver.finish(req)
        if len(hits) == 2:
            assert branching == 20
    if extra_buffer:
        assert hits == [0, 0, 20]
    else:
        # Without the extra buffer SGLang only has the state at the end of a forward: the branch point is
        # never captured, and only whole-sequence states are cached.
        assert hits == [0, 0, 0]
    driver.check_tree_states()
    driver.drain()


@pytest.mark.parametrize(("page_size", "extra_buffer"), STRATEGIES)
def test_hit_copies_the_cached_state_into_a_private_slot(config, page_size, extra_buffer):
    config(page_size=page_size)
    driver = CacheDriver(PoolSetup(page_size=page_size, extra_buffer=extra_buffer), ours())
    driver.run(PROMPT, REPLY)
    follow_up = PROMPT + REPLY[:-1] + [REPLY[-1], 50, 51, 52, 53, 54]
    req = driver.new_request(follow_up, [60, 61])
    hit = driver.admit(req)
    assert hit == 24
    cached = {len(path): slot for path, slot in tree_states(driver.cache)}
    assert int(req.kv.mamba_cow_src_index[0]) == cached[24]
    assert int(req.kv.mamba_pool_idx) not in cached.values()
    assert req.kv.mamba_needs_clear is False
    # The cached state must stay while the request uses it.
    assert driver.cache.mamba_protected_size() == 1
    while not driver.prefill(req):  # the forward checks that the copy holds the state after 24 tokens
        pass
    driver.decode(req)
    driver.finish(req)
    driver.check_tree_states()
    driver.drain()


def _exhaust_state_slots(driver: CacheDriver) -> torch.Tensor:
    allocator = driver.pool.mamba_allocator
    return allocator.alloc(allocator.available_size())


def test_copy_on_write_evicts_another_state_when_the_pool_is_full(config):
    config()
    driver = CacheDriver(PoolSetup(states=12), ours())
    driver.run(PROMPT, REPLY)  # states at 20 and 24
    driver.run([900 + i for i in range(12)], [1, 2])  # an unrelated request: states at 12 and 13
    held = _exhaust_state_slots(driver)  # other running requests hold every free slot
    before = cached_lengths(driver)
    req = driver.new_request([*PROMPT, 77, 78], [1])
    assert driver.admit(req) == 20
    after = cached_lengths(driver)
    assert 20 in after and len(after) == len(before) - 1
    driver.pool.mamba_allocator.free(held)
    while not driver.prefill(req):
        pass
    driver.finish(req)
    driver.drain()


def test_copy_on_write_with_no_evictable_state_fails_clearly_and_keeps_the_hit(config):
    config()
    driver = CacheDriver(PoolSetup(states=8), ours("marconi"))
    driver.run(PROMPT, REPLY)  # Marconi: the final state only
    held = _exhaust_state_slots(driver)
    req = driver.new_request(PROMPT + REPLY[:-1] + [REPLY[-1], 3], [1])
    with pytest.raises(RuntimeError, match="no state slot for a cache hit's copy"):
        driver.match(req)
    # The state the match wanted to copy was protected by the temporary lock.
    assert cached_lengths(driver) == [24]
    assert driver.cache.mamba_protected_size() == 0
    driver.pool.mamba_allocator.free(held)
    driver.drain()


@pytest.mark.parametrize(("page_size", "extra_buffer"), STRATEGIES)
def test_pools_under_pressure_evict_through_the_cache(config, page_size, extra_buffer):
    """Small KV and state pools: SGLang's allocation paths evict through evict_for_alloc; nothing leaks and every
    cached state stays consistent."""
    config(page_size=page_size)
    driver = CacheDriver(PoolSetup(kv_tokens=240, states=16, page_size=page_size, extra_buffer=extra_buffer),
                         ours())
    rng = random.Random(5)
    sessions = [conversation_turns(rng, 4, prefix=list(range(1, 9))) for _ in range(5)]
    for turn in range(4):
        for session in sessions:
            prompt, reply = session[turn]
            driver.run(prompt, reply, chunk=16)
            driver.check_idle()
    stats = driver.cache.stats
    assert stats.tokens_evicted > 0 and stats.states_evicted > 0
    assert stats.reused_tokens > 0
    driver.cache.sanity_check()
    driver.drain()


def test_kv_exhaustion_by_running_requests_fails_clearly_and_keeps_the_cache_valid(config):
    config()
    driver = CacheDriver(PoolSetup(kv_tokens=64), ours())
    driver.run(list(range(700, 720)), [1, 2])  # 21 cached tokens, evictable
    first = driver.new_request(list(range(1, 51)), [1, 2, 3])
    driver.admit(first)
    driver.prefill(first)  # needs 50 of 64 with 43 free: the cached request is evicted to make room
    # What is cached now is the running request's prefill state, locked by it.
    assert driver.cache.total_size() == (50, 1)
    assert driver.cache.full_protected_size() == 50 and driver.cache.mamba_protected_size() == 1
    second = driver.new_request(list(range(200, 230)), [1])
    driver.admit(second)
    with pytest.raises(RuntimeError, match="Out of memory"):
        driver.prefill(second)  # 30 more with 14 free and nothing evictable: SGLang's own OOM error
    driver.cache.sanity_check()
    assert driver.cache.total_size() == (50, 1)
    driver.drop_after_failed_allocation(second)
    driver.decode(first)
    driver.finish(first)
    driver.check_idle()
    driver.drain()


@pytest.mark.parametrize(("page_size", "extra_buffer"), STRATEGIES)
def test_aborted_and_retracted_requests_leave_nothing_behind(config, page_size, extra_buffer):
    config(page_size=page_size)
    driver = CacheDriver(PoolSetup(page_size=page_size, extra_buffer=extra_buffer), ours())
    driver.run(PROMPT, REPLY)
    baseline = cached_lengths(driver)

    mid_prefill = driver.new_request(PROMPT + list(range(300, 330)), [1, 2])
    driver.admit(mid_prefill, chunk=8)
    driver.prefill(mid_prefill)  # a chunk of 8 after the 20-token hit
    driver.abort(mid_prefill)

    mid_decode = driver.new_request(list(range(400, 420)), [1, 2, 3, 4, 5, 6])
    driver.admit(mid_decode)
    driver.prefill(mid_decode)
    driver.decode(mid_decode, steps=2)
    driver.abort(mid_decode)

    not_added = driver.new_request([*PROMPT, 5], [1])
    assert driver.match(not_added) == 20
    driver.reject(not_added)

    retracted = driver.new_request([*PROMPT, 6, 7, 8], [11, 12, 13, 14, 15, 16])
    driver.admit(retracted)
    driver.prefill(retracted)
    driver.decode(retracted, steps=3)
    driver.retract(retracted)
    assert driver.admit(retracted) >= 20  # resumes with its outputs so far as input
    driver.prefill(retracted)
    driver.decode(retracted)
    driver.finish(retracted)

    driver.check_idle()
    driver.check_tree_states()
    assert set(baseline) <= set(cached_lengths(driver))
    driver.drain()


def test_lock_receipts_release_exactly_their_lock(config):
    config()
    driver = CacheDriver(PoolSetup(), ours())
    driver.run(PROMPT, REPLY)
    cache = driver.cache
    node = cache.match_prefix(_match_params([*PROMPT, 1])).last_device_node
    first = cache.inc_lock_ref(node)
    second = cache.inc_lock_ref(node)
    assert first.node_id != second.node_id
    assert cache.mamba_protected_size() == 1 and cache.full_protected_size() == 20
    cache.dec_lock_ref(node, first.to_dec_params())
    with pytest.raises(Exception, match="unknown or was already released"):
        cache.dec_lock_ref(node, first.to_dec_params())
    assert cache.mamba_protected_size() == 1
    with pytest.raises(Exception, match="was taken on"):
        cache.dec_lock_ref(cache.root_node, second.to_dec_params())
    cache.dec_lock_ref(node)  # no receipt: the newest lock on the node
    assert cache.mamba_protected_size() == 0 and cache.full_protected_size() == 0
    with pytest.raises(Exception, match="no lock is held"):
        cache.dec_lock_ref(node)
    cache.sanity_check()
    driver.drain()


def _match_params(tokens, cow=False, req=None):
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return MatchPrefixParams(key=RadixKey(array("q", tokens)), cow_mamba=cow, req=req)


def test_sizes_inspection_and_reset(config, capsys):
    config()
    driver = CacheDriver(PoolSetup(), ours())
    driver.run(PROMPT, REPLY)
    driver.run([500, 501, 502, 503, 504, 505], [1, 2])
    cache = driver.cache
    tokens, states = cache.total_size()
    assert (tokens, states) == (24 + 7, 4)
    assert cache.full_evictable_size() == cache.evictable_size() == tokens
    assert cache.mamba_evictable_size() == states
    assert cache.full_protected_size() == cache.protected_size() == 0
    assert sorted(cache.all_values_flatten().tolist()) == sorted(
        set(range(1, driver.initial_free[0] + 1)) - set(driver.allocator.free_pages.tolist())
    )
    assert len(cache.all_mamba_values_flatten()) == states
    assert "Available full tokens" in cache.available_and_evictable_str()
    cache.pretty_print()
    assert "HybridRadixTree" in capsys.readouterr().out
    cache.sanity_check()
    cache.reset()
    assert cache.total_size() == (0, 0)
    assert driver.allocator.available_size() == driver.initial_free[0]
    assert driver.pool.mamba_allocator.available_size() == driver.initial_free[1]


def test_evict_with_token_and_state_targets(config):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    config()
    driver = CacheDriver(PoolSetup(), ours())
    driver.run(PROMPT, REPLY)  # states at 20 (the prefill's) and 24 (the final one)
    driver.run(list(range(600, 610)), [1, 2])  # states at 10 and 11
    cache = driver.cache
    # Recency is the last use. A finishing request releases the state it held (20) before its final state (24),
    # so the final state, the one the conversation's next turn resumes from, is the more recent. The state at 20
    # sits on an inner node: it becomes a tombstone and its KV stays for the path to 24.
    result = cache.evict(EvictParams(mamba_num=1))
    assert (result.mamba_num_evicted, result.num_tokens_evicted) == (1, 0)
    assert cached_lengths(driver) == [10, 11, 24]
    # The least recently used leaf is [20, 24); the tombstone above it goes with it.
    result = cache.evict_for_alloc(EvictParams(num_tokens=1))
    assert (result.num_tokens_evicted, result.mamba_num_evicted) == (24, 1)
    assert cached_lengths(driver) == [10, 11]
    result = cache.evict(EvictParams(num_tokens=5, mamba_num=5))  # more than the tree holds: all of it
    assert (result.num_tokens_evicted, result.mamba_num_evicted) == (11, 2)
    cache.sanity_check()
    driver.drain()


def test_eviction_metrics_reach_sglangs_collector(config):
    pytest.importorskip("prometheus_client", reason="SGLang's metrics collector needs prometheus_client")
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    def with_metrics(params):
        params.enable_metrics = True
        return make_ours(params)

    config()
    driver = CacheDriver(PoolSetup(), with_metrics)
    cache = driver.cache
    assert cache.metrics_collector is not None
    recorded = []
    cache.metrics_collector.increment_eviction_num_tokens = recorded.append
    driver.run(PROMPT, REPLY)
    cache.evict(EvictParams(num_tokens=100))
    assert recorded == [24]
    driver.drain()


def test_flop_aware_eviction_tunes_alpha_online(config):
    config()
    driver = CacheDriver(PoolSetup(kv_tokens=200, states=10),
                         ours("marconi", tuning_window=6, retune_every=6, alpha_grid=[0.5, 4.0]))
    cache = driver.cache
    assert type(cache.tree.eviction).__name__ == "FlopAwareEviction"
    rng = random.Random(3)
    sessions = [conversation_turns(rng, 3, prefix=list(range(1, 13))) for _ in range(4)]
    for turn in range(3):
        for session in sessions:
            driver.run(*session[turn])
    history = cache.tuning.history
    assert len(history) == 2  # 12 requests, a tuning every 6
    assert set(cache.tuning.shadows) == {0.0, 0.5, 4.0}
    assert set(history[-1].hits) == {0.0, 0.5, 4.0}
    assert cache.tree.eviction.alpha == history[-1].alpha
    cache.sanity_check()
    driver.drain()


def test_construction_refuses_what_it_cannot_serve(config):
    config(page_size=2)
    setup = PoolSetup(page_size=2, extra_buffer=True)
    pool, allocator = build_pools(setup)
    with pytest.raises(ValueError, match="needs the extra-buffer strategy"):
        make_ours(cache_params(replace(setup, extra_buffer=False), pool, allocator))
    for field, message in (("disable", "radix cache disabled"), ("is_eagle", "speculative decoding")):
        params = cache_params(setup, pool, allocator)
        setattr(params, field, True)
        with pytest.raises(ValueError, match=message):
            make_ours(params)
    with pytest.raises(ValueError, match="not a multiple of SGLang's mamba checkpoint grid 4"):
        make_ours(cache_params(setup, pool, allocator), state_chunk_size=6)
    cache = make_ours(cache_params(setup, pool, allocator), state_chunk_size=8)
    assert cache.tree.state_chunk_size == 8


def test_coarser_branch_points_from_the_settings(config):
    """state_chunk_size 8 (twice SGLang's grid of 4): the branch point of a 22-token shared prefix is 16, not 20."""
    config()
    driver = CacheDriver(PoolSetup(extra_buffer=True), ours("marconi", state_chunk_size=8))
    shared = list(range(1, 23))
    driver.run([*shared, 90, 91], [1])
    req = driver.new_request([*shared, 92, 93], [1])
    driver.admit(req)
    assert req.mamba_branching_seqlen == 16
    while not driver.prefill(req):
        pass
    driver.finish(req)
    assert 16 in cached_lengths(driver)
    driver.drain()
