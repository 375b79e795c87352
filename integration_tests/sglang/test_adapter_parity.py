"""Parity of ``mamba-radix`` with SGLang 0.5.20's own ``MambaRadixCache``, on the same operation streams.

Each stream is served twice, in lockstep, by two :class:`CacheDriver` instances with identical pools: one with our
cache (backend ``mamba-radix``), one with upstream's. Every admission must return the same hit length; every step
must succeed or fail alike; both must end with the same cached sizes, valid trees and no leaks.

Where the two differ (also in docs/sglang.md, "Parity with MambaRadixCache"):

1. Split refresh (an upstream quirk). When a match or an insert splits an edge, upstream moves the lower half to the
   most-recent end of its LRU list, although the request that split it uses only the upper half; ours leaves it
   where it was. Under memory pressure upstream then evicts something else first
   (:func:`test_upstream_refreshes_the_unused_half_of_a_split`). The sequential streams below are compared with
   :class:`UpstreamWithoutSplitRefresh` (upstream with only that step undone) and are identical; with plain
   upstream they are identical until a split-refreshed node changes an eviction.
2. Recency under concurrency (a definition). Upstream ranks an entry by its last match or insert; ours by its last
   use, and an entry is in use while a running request holds its lock, so releasing a lock makes the entry recent.
   With one request at a time both agree; with overlapping requests and evictions they can pick different victims
   (:func:`test_recency_is_last_use_not_last_match`). Without eviction, concurrent streams hit identically.
3. Upstream's defect: a locked tombstone that loses its last child stays as an unlocked tombstone leaf once
   released, and a later full eviction fails an assertion (test_adapter_defect.py). Ours removes it on release.
4. ``mamba_branching_seqlen``: upstream returns the chunk-aligned match length even when it is not beyond the
   reusable prefix; ours returns None then. SGLang only tracks a branch point beyond the prefix, so nothing the
   engine does changes (hit lengths and cached states agree).
"""

from __future__ import annotations

import random
from contextlib import ExitStack

import pytest
from fixtures_sglang import (
    CacheDriver,
    PoolSetup,
    conversation_turns,
    make_ours,
    make_upstream,
    sglang_config,
    tree_states,
)

MODES = [
    pytest.param(1, False, id="no_buffer"),
    pytest.param(1, True, id="extra_buffer"),
    pytest.param(2, True, id="extra_buffer-page2"),
]


@pytest.fixture
def config():
    with ExitStack() as stack:
        yield lambda **kwargs: stack.enter_context(sglang_config(**kwargs))


def make_upstream_without_split_refresh(params):
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

    class UpstreamWithoutSplitRefresh(MambaRadixCache):
        """Upstream's cache with one step undone: after ``_split_node`` the lower half goes back to the place it
        had in the full LRU list (with the new upper half just before it, on the recent side), instead of the
        most-recent end. Only for splits during a match: an insert refreshes the node before splitting it, which
        the streams here never hit (a request's own match already split its edges)."""

        def _split_node(self, key, child, split_len):
            lru = self.full_lru_list
            more_recent = child.prev
            upper = super()._split_node(key, child, split_len)
            lru._remove_node(child)
            lru._remove_node(upper)
            lru._add_node_after(more_recent, upper)
            lru._add_node_after(upper, child)
            return upper

    return UpstreamWithoutSplitRefresh(params)


class Lockstep:
    """The same requests, chunking, decode steps and aborts applied to our cache and an upstream one."""

    def __init__(self, setup: PoolSetup, make_reference=make_upstream) -> None:
        self.ours = CacheDriver(setup, make_ours)
        self.upstream = CacheDriver(setup, make_reference)
        self.drivers = (self.ours, self.upstream)
        self.page_size = setup.page_size

    def budget(self) -> int:
        """KV a new request may take: free + evictable minus what the running requests still need (the
        scheduler's admission budget, so that no allocation fails)."""
        free = min(d.allocator.available_size() + d.cache.full_evictable_size() for d in self.drivers)
        reserved = sum(
            len(req.origin_input_ids) + len(self.ours._outputs[req.rid]) - req.kv.kv_allocated_len + self.page_size
            for req in self.ours.in_flight.values()
        )
        return free - reserved

    def admit(self, prompt, reply, chunk):
        pair = [driver.new_request(prompt, reply) for driver in self.drivers]
        hits = [driver.admit(req, chunk) for driver, req in zip(self.drivers, pair, strict=True)]
        assert hits[0] == hits[1], f"hit lengths differ (ours, upstream): {hits} for a {len(prompt)}-token prompt"
        return pair

    def step(self, pair, action, rng_value):
        results = []
        for driver, req in zip(self.drivers, pair, strict=True):
            if action == "prefill":
                results.append(driver.prefill(req))
            elif action == "decode":
                results.append(driver.decode(req, steps=rng_value))
            elif action == "abort":
                results.append(driver.abort(req))
            else:
                results.append(driver.finish(req))
        assert results[0] == results[1], f"{action} differs (ours, upstream): {results}"
        return results[0]

    def finish_checks(self) -> None:
        for driver in self.drivers:
            driver.check_idle()
            driver.check_tree_states()
        assert self.ours.hits == self.upstream.hits
        sizes = (self.ours.cache.total_size(), self.upstream.cache.total_size())
        assert sizes[0] == sizes[1], f"cached (tokens, states) differ (ours, upstream): {sizes}"
        for driver in self.drivers:
            driver.drain()


def serve_stream(lockstep: Lockstep, seed: int, *, concurrency: int, abort_rate: float = 0.03) -> list[int]:
    """Six multi-turn sessions (some sharing a system prompt), a session's turns in order, up to ``concurrency``
    requests in flight, random chunk sizes, decode step counts and aborts."""
    rng = random.Random(seed)
    sessions = [conversation_turns(rng, 5, prefix=list(range(1, 1 + rng.choice([0, 6, 12])))) for _ in range(6)]
    next_turn = [0] * len(sessions)
    flights: list[list] = []  # [session, request pair, next action]
    while True:
        waiting = [s for s in range(len(sessions)) if next_turn[s] < len(sessions[s])
                   and all(flight[0] != s for flight in flights)]
        can_admit = waiting and len(flights) < concurrency
        if not can_admit and not flights:
            break
        if can_admit and (not flights or rng.random() < 0.3):
            session = rng.choice(waiting)
            prompt, reply = sessions[session][next_turn[session]]
            if len(prompt) + len(reply) + 2 * lockstep.page_size > lockstep.budget():
                if not flights:
                    raise AssertionError("a request does not fit the pools on its own; enlarge the test pools")
                continue
            next_turn[session] += 1
            flights.append([session, lockstep.admit(prompt, reply, rng.choice([None, 8, 16])), "prefill"])
            continue
        flight = rng.choice(flights)
        _, pair, action = flight
        # SGLang allocates a request's row in the step that admits it: it can be aborted only after that.
        if action in ("prefill", "decode") and pair[0].kv.holds_kv and rng.random() < abort_rate:
            action = "abort"
        done = lockstep.step(pair, action, rng.randint(1, 4))
        if action == "prefill" and done:
            ours_req = pair[0]
            flight[2] = "decode" if len(ours_req.output_ids) < len(lockstep.ours._outputs[ours_req.rid]) else "finish"
        elif action == "decode" and done:
            flight[2] = "finish"
        elif action in ("finish", "abort"):
            flights.remove(flight)
    return lockstep.ours.hits


@pytest.mark.parametrize(("page_size", "extra_buffer"), MODES)
@pytest.mark.parametrize(("kv_tokens", "states"), [(2000, 64), (300, 20), (200, 14)], ids=["roomy", "tight", "tighter"])
@pytest.mark.parametrize("seed", range(4))
def test_sequential_streams_hit_identically(config, page_size, extra_buffer, kv_tokens, states, seed):
    """One request at a time: identical hits at every admission, with chunked prefill, aborts and (in the tight
    pools) evictions of KV and states; the reference is upstream without its split refresh (difference 1)."""
    config(page_size=page_size)
    lockstep = Lockstep(PoolSetup(kv_tokens=kv_tokens, states=states, page_size=page_size,
                                  extra_buffer=extra_buffer), make_upstream_without_split_refresh)
    hits = serve_stream(lockstep, seed, concurrency=1)
    assert sum(hits) > 0
    if kv_tokens < 2000:
        assert lockstep.ours.cache.stats.tokens_evicted + lockstep.ours.cache.stats.states_evicted > 0
    lockstep.finish_checks()


@pytest.mark.parametrize(("page_size", "extra_buffer"), MODES)
@pytest.mark.parametrize("seed", range(4))
def test_concurrent_streams_without_eviction_hit_identically(config, page_size, extra_buffer, seed):
    config(page_size=page_size)
    lockstep = Lockstep(PoolSetup(kv_tokens=4000, states=128, page_size=page_size, extra_buffer=extra_buffer))
    hits = serve_stream(lockstep, seed, concurrency=3)
    assert sum(hits) > 0
    assert lockstep.ours.cache.stats.states_evicted == lockstep.ours.cache.stats.tokens_evicted == 0
    lockstep.finish_checks()


def test_upstream_refreshes_the_unused_half_of_a_split(config):
    """Difference 1. A (shared 8-token prefix S + its own tokens) is cached, then the unrelated B. C shares only S
    with A: its match splits A's edge after S. Upstream moves A's own half to the recent end, so evicting one leaf
    drops B; ours drops A, the least recently used. The follow-ups of A and B hit accordingly."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    config()
    shared = list(range(1, 9))
    a_prompt, b_prompt = [*shared, *range(20, 32)], list(range(100, 120))
    outcome = {}
    for name, make in (("ours", make_ours), ("upstream", make_upstream),
                       ("upstream without split refresh", make_upstream_without_split_refresh)):
        driver = CacheDriver(PoolSetup(), make)
        driver.run(a_prompt, [1])
        driver.run(b_prompt, [1])
        c = driver.new_request([*shared, 50, 51, 52], [1])
        assert driver.match(c) == 0  # splits A's edge after the shared prefix
        driver.reject(c)
        driver.cache.evict(EvictParams(num_tokens=1))
        outcome[name] = (driver.run([*a_prompt, 5], [1]), driver.run([*b_prompt, 5], [1]))
        driver.drain()
    assert outcome == {"ours": (0, 20), "upstream": (20, 0), "upstream without split refresh": (0, 20)}


def test_recency_is_last_use_not_last_match(config):
    """Difference 2, in its smallest form. X and Y (12-token prompts) are cached. A is
    admitted on X (X locked), then B is admitted on Y and served completely, then A is served. Upstream ranks X by
    A's match, older than anything B did, and drops X first; ours ranks X by the release of A's lock, after B's,
    and drops Y first. The next requests that diverge right after X and after Y hit accordingly."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    config()
    x_prompt, y_prompt = list(range(1, 13)), list(range(100, 112))
    outcome = {}
    for name, make in (("ours", make_ours), ("upstream", make_upstream)):
        driver = CacheDriver(PoolSetup(), make)
        driver.run(x_prompt, [1])  # caches the state after X
        driver.run(y_prompt, [1])  # caches the state after Y
        a = driver.new_request([*x_prompt, 1, 50, 51], [7, 8, 9])
        b = driver.new_request([*y_prompt, 1, 60, 61], [7])
        assert driver.admit(a) == 12
        assert driver.admit(b) == 12
        driver.prefill(b)
        driver.finish(b)
        driver.prefill(a)
        driver.decode(a)
        driver.finish(a)
        cached = {path for path, _ in tree_states(driver.cache)}
        driver.cache.evict(EvictParams(mamba_num=1))
        dropped = cached - {path for path, _ in tree_states(driver.cache)}
        hits = (driver.run([*x_prompt, 2, 3], [1]), driver.run([*y_prompt, 2, 3], [1]))
        outcome[name] = (dropped, hits)
        driver.drain()
    assert outcome["upstream"] == ({tuple(x_prompt)}, (0, 12))
    assert outcome["ours"] == ({tuple(y_prompt)}, (12, 0))
