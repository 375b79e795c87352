"""Our backends inside vLLM's real Scheduler / KVCacheManager, driven by the model-free replay (no weights):
admission, eviction bookkeeping, the alpha tuner, leaks, selection and errors."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures_backend import (
    GIB,
    MIB,
    PAPER_7B_HF_CONFIG,
    hits,
    multi_turn_trace,
    pool_problems,
    random_tokens,
    read_hf_config,
)

from hybrid_prefix_cache.adapters.vllm import install
from hybrid_prefix_cache.adapters.vllm.engine import SCHEDULER_ATTRIBUTE
from hybrid_prefix_cache.adapters.vllm.managers import AdmissionMambaManager
from hybrid_prefix_cache.adapters.vllm.pool import HybridBlockPool
from hybrid_prefix_cache.bench.engines.vllm_backend_replay import replay_with_backend
from hybrid_prefix_cache.bench.engines.vllm_replay import EngineOptions, replay
from hybrid_prefix_cache.bench.traces import Request

OPTIONS = EngineOptions(max_num_batched_tokens=2048)
FP16_STATES = EngineOptions(mamba_ssm_cache_dtype="float16")


@pytest.fixture(scope="module")
def tiny_hf_config(tiny_qwen3_next: Path) -> dict[str, Any]:
    return read_hf_config(tiny_qwen3_next)


@pytest.fixture(autouse=True)
def no_process_default() -> Iterator[None]:
    install(None)
    yield
    install(None)


def run(trace: list[Request], config: dict[str, Any], cache_bytes: int, backend: str | None, **kwargs: Any) -> Any:
    schedulers: list[Any] = []
    result = replay_with_backend(
        trace, config, cache_bytes, backend, options=kwargs.pop("options", OPTIONS), on_scheduler=schedulers.append
    )
    return result, schedulers[0]


def follow_up_pair(seed: int, prompt_tokens: int, reply_tokens: int) -> list[Request]:
    rng = random.Random(seed)
    prompt = random_tokens(rng, prompt_tokens)
    reply = random_tokens(rng, reply_tokens)
    return [
        Request("s", 0, 0.0, prompt, reply),
        Request("s", 1, 1.0, prompt + reply + random_tokens(rng, 60), (1,)),
    ]


def test_marconi_reuses_the_reply_where_vllm_stops_at_the_prompt(tiny_hf_config: dict[str, Any]) -> None:
    trace = follow_up_pair(seed=1, prompt_tokens=700, reply_tokens=300)
    default, _ = run(trace, tiny_hf_config, 256 * MIB, None)
    marconi, scheduler = run(trace, tiny_hf_config, 256 * MIB, "marconi")
    block = marconi["block_size"]
    prompt, reply = len(trace[0].input_tokens), len(trace[0].output_tokens)
    assert getattr(scheduler, SCHEDULER_ATTRIBUTE) == "marconi"
    assert hits(default)[("s", 1)] == (prompt - 1) // block * block
    # The state after the last decoded token, floored to the block (the final sampled token is never computed).
    assert hits(marconi)[("s", 1)] == (prompt + reply - 1) // block * block > hits(default)[("s", 1)]


def test_marconi_keeps_one_checkpoint_per_request_and_cross_session_junctions(tiny_hf_config: dict[str, Any]) -> None:
    trace = multi_turn_trace(seed=3, sessions=3, turns=3)
    result, scheduler = run(trace, tiny_hf_config, 256 * MIB, "marconi")
    pool = scheduler.kv_cache_manager.block_pool
    block = result["block_size"]
    state_groups = pool.layout.state_groups
    cached_states = {
        block_.block_hash[:-4]
        for block_ in pool.blocks[1:]
        if block_.block_hash is not None and int.from_bytes(block_.block_hash[-4:], "big") == state_groups[0]
    }
    # One final checkpoint per request, plus the system prompt's branch point found by the second session.
    assert len(cached_states) == len(trace) + 1
    by_key = hits(result)
    system_junction = 700 // block * block
    assert by_key[("s2", 0)] == system_junction > 0
    assert all(by_key[(f"s{s}", turn)] > system_junction for s in range(3) for turn in (1, 2))


def test_mamba_radix_caches_every_decode_boundary(tiny_hf_config: dict[str, Any]) -> None:
    trace = follow_up_pair(seed=2, prompt_tokens=600, reply_tokens=700)
    result, scheduler = run(trace, tiny_hf_config, 256 * MIB, "mamba-radix")
    pool = scheduler.kv_cache_manager.block_pool
    assert type(pool).__name__ == "BlockPool"
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    state_group = next(group for group, manager in enumerate(managers) if isinstance(manager, AdmissionMambaManager))
    block = result["block_size"]
    ends = sorted(
        block_.block_hash_num_tokens
        for block_ in pool.blocks[1:]
        if block_.block_hash is not None and int.from_bytes(block_.block_hash[-4:], "big") == state_group
    )
    total = 600 + 700 - 1
    # Every block boundary the decode crossed after the prompt's last chunk, and the prompt's own boundary.
    assert ends[-1] == total // block * block
    assert set(range(600 // block * block + block, total // block * block + 1, block)) <= set(ends)
    assert hits(result)[("s", 1)] == total // block * block


def test_no_backend_builds_vllms_own_classes(tiny_hf_config: dict[str, Any]) -> None:
    trace = follow_up_pair(seed=4, prompt_tokens=500, reply_tokens=50)
    result, scheduler = run(trace, tiny_hf_config, 64 * MIB, None)
    assert getattr(scheduler, SCHEDULER_ATTRIBUTE) is None
    assert type(scheduler.kv_cache_manager.block_pool).__name__ == "BlockPool"
    assert not any(
        isinstance(manager, AdmissionMambaManager)
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers
    )
    assert result["free_blocks_final"] == result["free_blocks_initial"]


@pytest.mark.parametrize("backend", ["marconi", "marconi/lru", "all/flop-aware"])
def test_under_pressure_the_pool_stays_consistent_and_leaks_nothing(
    tiny_hf_config: dict[str, Any], backend: str
) -> None:
    trace = multi_turn_trace(seed=5, sessions=4, turns=4)
    checked: list[list[str]] = []

    def check_every_step(scheduler: Any) -> None:
        original = scheduler.update_from_output

        def update(*args: Any, **kwargs: Any) -> Any:
            outputs = original(*args, **kwargs)
            checked.append(pool_problems(scheduler.kv_cache_manager.block_pool))
            return outputs

        scheduler.update_from_output = update

    result = replay_with_backend(
        trace, tiny_hf_config, 8 * MIB, backend, options=OPTIONS, on_scheduler=check_every_step
    )
    assert result["backend"] == backend
    assert sum(result.get("evicted_blocks_by_reason", {}).values()) > 0 or backend == "marconi/lru"
    assert checked and not [problems for problems in checked if problems][:1]
    assert result["free_blocks_final"] == result["free_blocks_initial"]


def test_marconi_at_alpha_zero_evicts_exactly_like_lru(tiny_hf_config: dict[str, Any]) -> None:
    trace = multi_turn_trace(seed=6, sessions=5, turns=4)
    lru, _ = run(trace, tiny_hf_config, 8 * MIB, "marconi/lru")
    flop, scheduler = run(trace, tiny_hf_config, 8 * MIB, "marconi")
    assert scheduler.kv_cache_manager.block_pool.tuner.alpha == 0.0
    assert sum(flop["evicted_blocks_by_reason"].values()) > 0
    assert hits(flop) == hits(lru)


def test_earlier_turns_states_are_subsumed_and_go_first_once_alpha_is_positive(
    tiny_hf_config: dict[str, Any],
) -> None:
    _, scheduler = run(multi_turn_trace(seed=12, sessions=1, turns=3), tiny_hf_config, 256 * MIB, "marconi")
    index = scheduler.kv_cache_manager.block_pool.index
    index.check_invariants()
    # Turns 2 and 3 resumed from the previous turn's final state: turns 1 and 2 left subsumed states.
    assert index.num_subsumed() == 2 * len(index.state_groups)

    def force_alpha(scheduler: Any) -> None:
        scheduler.kv_cache_manager.block_pool.index.alpha = 1.0

    options = EngineOptions(max_num_batched_tokens=2048, additional_config={"prefix_cache_tune_every": 10**6})
    trace = multi_turn_trace(seed=6, sessions=5, turns=4)
    schedulers: list[Any] = []
    result = replay_with_backend(
        trace, tiny_hf_config, 8 * MIB, "marconi", options=options,
        on_scheduler=lambda scheduler: (force_alpha(scheduler), schedulers.append(scheduler)),
    )
    pool = schedulers[0].kv_cache_manager.block_pool
    assert pool.index.alpha == 1.0
    assert result["evicted_blocks_by_reason"].get("subsumed", 0) > 0
    pool.index.check_invariants()
    assert not pool_problems(pool)
    assert result["free_blocks_final"] == result["free_blocks_initial"]


def test_the_tuner_replays_windows_and_never_picks_a_loser(tiny_hf_config: dict[str, Any]) -> None:
    trace = multi_turn_trace(seed=7, sessions=6, turns=4)
    options = EngineOptions(
        max_num_batched_tokens=2048,
        additional_config={"prefix_cache_tune_window": 16, "prefix_cache_tune_every": 8},
    )
    result, scheduler = run(trace, tiny_hf_config, 8 * MIB, "marconi", options=options)
    pool = scheduler.kv_cache_manager.block_pool
    tuner = pool.tuner
    assert (tuner.window, pool.tune_every) == (16, 8)
    assert 0 < len(result["retunes"]) <= len(trace) // 8
    for retune in result["retunes"]:
        shadow_hits = retune["shadow_hits"]
        assert set(shadow_hits) == set(tuner.grid)
        assert any(value > 0 for value in shadow_hits.values())
        chosen = retune["alpha"]
        assert chosen == 0.0 or shadow_hits[chosen] > shadow_hits[0.0]


def test_install_makes_the_plain_replay_run_a_backend(tiny_hf_config: dict[str, Any]) -> None:
    trace = follow_up_pair(seed=8, prompt_tokens=700, reply_tokens=300)
    baseline = replay(trace, tiny_hf_config, 256 * MIB, options=OPTIONS)
    install("marconi")
    with_marconi = replay(trace, tiny_hf_config, 256 * MIB, options=OPTIONS)
    install(None)
    assert hits(with_marconi)[("s", 1)] > hits(baseline)[("s", 1)]
    assert hits(replay(trace, tiny_hf_config, 256 * MIB, options=OPTIONS)) == hits(baseline)


def test_additional_config_none_overrides_the_environment(
    tiny_hf_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = follow_up_pair(seed=9, prompt_tokens=700, reply_tokens=300)
    monkeypatch.setenv("HYBRID_PREFIX_CACHE_BACKEND", "marconi")
    from_env = replay(trace, tiny_hf_config, 256 * MIB, options=OPTIONS)
    forced_off = replay(
        trace, tiny_hf_config, 256 * MIB,
        options=EngineOptions(max_num_batched_tokens=2048, additional_config={"prefix_cache_backend": "none"}),
    )
    assert hits(from_env)[("s", 1)] > hits(forced_off)[("s", 1)]


def test_unknown_backend_fails_with_the_choices(tiny_hf_config: dict[str, Any]) -> None:
    trace = follow_up_pair(seed=10, prompt_tokens=300, reply_tokens=10)
    options = EngineOptions(additional_config={"prefix_cache_backend": "marconni"})
    with pytest.raises(ValueError, match=r"'marconni'.*choose from mamba-radix, marconi"):
        replay(trace, tiny_hf_config, 64 * MIB, options=options)
    with pytest.raises(ValueError, match="marconni"):
        install("marconni")


def test_paper_7b_geometry_runs_marconi_with_six_state_groups() -> None:
    trace = multi_turn_trace(seed=11, sessions=3, turns=3, token_range=(0, 100_000))
    result, scheduler = run(trace, PAPER_7B_HF_CONFIG, GIB, "marconi", options=FP16_STATES)
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, HybridBlockPool)
    assert (len(pool.layout.fa_groups), len(pool.layout.state_groups)) == (1, 6)
    assert result["blocks_per_state"] == 6
    assert not pool_problems(pool)
    assert result["free_blocks_final"] == result["free_blocks_initial"]
