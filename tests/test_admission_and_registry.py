"""Admission rules, backend names, and the admission rules observed end to end in the simulator."""

from __future__ import annotations

import pytest

from hybrid_prefix_cache.bench.sim import CacheSimulator, MemoryModel, SimSettings
from hybrid_prefix_cache.bench.traces import Request
from hybrid_prefix_cache.cost_model import load_model_spec
from hybrid_prefix_cache.policies.admission import AdmitAll, MarconiAdmission, PeriodicAdmission, make_admission
from hybrid_prefix_cache.registry import list_backends, resolve_backend

SPEC = load_model_spec("paper-7b")


def test_all_captures_the_branch_point_and_the_chunk_floored_end_of_input():
    assert AdmitAll().prefill_captures(300, 0, 128, 64) == [128, 256]
    assert AdmitAll().prefill_captures(300, 256, 128, 64) == []
    assert AdmitAll().keep_final_state()


def test_marconi_captures_only_the_branch_point():
    assert MarconiAdmission().prefill_captures(300, 0, 128, 64) == [128]
    assert MarconiAdmission().prefill_captures(300, 0, None, 64) == []
    assert MarconiAdmission().keep_final_state()


def test_periodic_captures_every_period_beyond_the_reused_prefix():
    assert PeriodicAdmission(100).prefill_captures(350, 120, None, 64) == [200, 300]
    with pytest.raises(ValueError, match="period >= 1"):
        PeriodicAdmission(0)


def test_admission_names_parse_and_bad_ones_are_named():
    assert make_admission("periodic:256").period == 256
    with pytest.raises(ValueError, match="periodic:N"):
        make_admission("periodic:x")
    with pytest.raises(ValueError, match="unknown admission policy 'fifo'"):
        make_admission("fifo")


def test_registry_lists_mamba_radix_first_and_resolves_pairs():
    names = [backend.name for backend in list_backends()]
    assert names[:2] == ["mamba-radix", "marconi"]
    assert (resolve_backend("marconi").admission, resolve_backend("marconi").eviction) == ("marconi", "flop-aware")
    pair = resolve_backend("marconi/lru")
    assert (pair.admission, pair.eviction) == ("marconi", "lru")
    with pytest.raises(ValueError, match="choose from mamba-radix, marconi"):
        resolve_backend("radix")
    with pytest.raises(ValueError, match="unknown eviction policy 'lfu'"):
        resolve_backend("all/lfu")


def _simulator(admission) -> CacheSimulator:
    memory = MemoryModel.unified(SPEC, 64 << 30)
    return CacheSimulator(SPEC, memory, admission, settings=SimSettings(chunk=64, max_in_flight=1))


def _req(session: str, turn: int, ts: float, tokens: list[int], output: list[int]) -> Request:
    return Request(session, turn, ts, tuple(tokens), tuple(output))


def test_marconi_caches_a_shared_input_prefix_at_its_branch_point_and_hits_from_the_third_occurrence():
    shared = list(range(1000, 1300))  # 300 tokens: the branch state is captured at 256
    requests = [_req(f"user-{i}", 0, 100.0 * i, [*shared, *range(5000 + 100 * i, 5050 + 100 * i)], [7, 8, 9])
                for i in range(3)]
    simulator = _simulator(MarconiAdmission())
    hits = []
    for request in requests:
        before = simulator.tree.stats.reused_tokens
        simulator.run([request])
        hits.append(simulator.tree.stats.reused_tokens - before)
    assert hits == [0, 0, 256]
    simulator.tree.check_invariants()


def test_the_state_after_the_last_decoded_token_serves_the_next_turn():
    first_input, reply = list(range(500)), list(range(9000, 9040))
    second_input = [*first_input, *reply, *range(20_000, 20_030)]
    simulator = _simulator(MarconiAdmission())
    simulator.run([_req("s", 0, 0.0, first_input, reply)])
    before = simulator.tree.stats.reused_tokens
    simulator.run([_req("s", 1, 50.0, second_input, [1, 2])])
    # input + reply[:-1] was consumed by the model: that is where the state was saved
    assert simulator.tree.stats.reused_tokens - before == len(first_input) + len(reply) - 1


def test_all_keeps_the_end_of_input_state_that_marconi_skips():
    request = _req("s", 0, 0.0, list(range(300)), [1, 2, 3])
    all_sim, marconi_sim = _simulator(AdmitAll()), _simulator(MarconiAdmission())
    all_sim.run([request])
    marconi_sim.run([request])
    assert (all_sim.tree.total_states, marconi_sim.tree.total_states) == (2, 1)


def test_third_party_backends_come_from_the_entry_point_group(monkeypatch):
    from importlib import metadata

    from hybrid_prefix_cache import registry

    class FakeEntryPoint:
        def __init__(self, name, value):
            self.name, self._value = name, value

        def load(self):
            return self._value

    custom = registry.Backend("team-cache", "periodic:128", "lru", "a third-party pairing")
    points = [FakeEntryPoint("team", custom)]
    monkeypatch.setattr(metadata, "entry_points",
                        lambda group: points if group == registry.ENTRY_POINT_GROUP else [])
    assert [b.name for b in list_backends()] == ["mamba-radix", "marconi", "team-cache"]
    assert resolve_backend("team-cache") is custom
    points.append(FakeEntryPoint("broken", object()))
    with pytest.raises(TypeError, match="must load a Backend"):
        list_backends()
