"""The ``--engine sglang`` baseline: a model-free replay through SGLang 0.5.20's real MambaRadixCache."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_prefix_cache.bench.engines import sglang_replay
from hybrid_prefix_cache.bench.engines.sglang_replay import (
    GIB,
    build_upstream_cache,
    pool_sizes,
    replay,
    run_request,
)

PAPER_7B_KV_BYTES_PER_TOKEN = 4 * 2 * 4096 * 2
PAPER_7B_STATE_BYTES = 24 * 1_099_264
# Small sizes keep the pools tiny: a 1 MiB budget at these sizes is ~92 state slots and ~3,000 KV tokens.
SMALL_KV_BYTES_PER_TOKEN = 160
SMALL_STATE_BYTES = 5_000


def _upstream_split(cache_bytes: int, kv_bytes_per_token: int, state_bytes: int) -> tuple[int, int]:
    """(max_mamba_cache_size, max_total_num_tokens) from SGLang's own code: ``_handle_max_mamba_cache`` on a
    configurator holding only what that method reads, then ``DefaultPoolConfigurator.calculate_pool_sizes``."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    configurator = object.__new__(KVCacheConfigurator)
    configurator.mambaish_config = SimpleNamespace(
        mamba2_cache_params=SimpleNamespace(layers=list(range(24)), mamba_cache_per_req=state_bytes)
    )
    configurator.ps = SimpleNamespace(pp_size=1, attn_dp_size=1)
    configurator.spec_algorithm = SpeculativeAlgorithm.NONE
    configurator.hybrid_gdn_config = None
    rest_gib = configurator._handle_max_mamba_cache(cache_bytes / GIB)
    pool_configurator = object.__new__(DefaultPoolConfigurator)
    pool_configurator._cell_size = kv_bytes_per_token
    tokens = pool_configurator.calculate_pool_sizes(int(rest_gib * GIB), 1).max_total_num_tokens
    return get_schedule().max_mamba_cache_size, tokens


@pytest.mark.parametrize("cache_gib", [0.7, 2, 5, 10, 37.3, 80])
def test_memory_split_is_sglangs(sglang_context, cache_gib):
    cache_bytes = int(cache_gib * GIB)
    sizes = pool_sizes(
        cache_bytes,
        PAPER_7B_KV_BYTES_PER_TOKEN,
        PAPER_7B_STATE_BYTES,
        mamba_full_memory_ratio=sglang_replay.upstream_mamba_full_memory_ratio(),
        context_len=32_768,
    )
    assert (sizes.max_mamba_cache_size, sizes.max_total_num_tokens) == _upstream_split(
        cache_bytes, PAPER_7B_KV_BYTES_PER_TOKEN, PAPER_7B_STATE_BYTES
    )
    assert sizes.state_pool_bytes + sizes.kv_pool_bytes <= cache_bytes


def test_default_ratio_is_what_sglang_resolves(sglang_context):
    from sglang.srt.runtime_context import get_schedule

    assert sglang_replay.upstream_mamba_full_memory_ratio() == 0.9
    assert get_schedule().mamba_full_memory_ratio == 0.9
    # 10 GiB at the paper's sizes: states get 0.9 / 1.9 of the budget, 191 slots of 26 MB.
    assert (
        pool_sizes(
            10 * GIB, PAPER_7B_KV_BYTES_PER_TOKEN, PAPER_7B_STATE_BYTES, mamba_full_memory_ratio=0.9, context_len=4096
        ).max_mamba_cache_size
        == 191
    )


def test_budget_without_room_for_one_request_is_refused():
    # 0.9/1.9 of 9 state sizes leaves 3 slots after the padding slot: one running request (3 slots each).
    assert pool_sizes(9 * 1000, 1, 1000, mamba_full_memory_ratio=0.9, context_len=64).max_running_requests == 1
    with pytest.raises(ValueError, match="cannot serve one request"):
        pool_sizes(8 * 1000, 1, 1000, mamba_full_memory_ratio=0.9, context_len=64)
    with pytest.raises(ValueError, match="state slot"):
        pool_sizes(1000, 1, 1000, mamba_full_memory_ratio=0.9, context_len=64)
    with pytest.raises(ValueError, match="kv_bytes_per_token must be a positive integer"):
        pool_sizes(10 * GIB, 0, 1000, mamba_full_memory_ratio=0.9, context_len=64)


def test_hit_rates_and_repeated_session(make_conversation):
    first = make_conversation("a", 4, seed=1)
    repeat = [
        type(request)("b", request.turn_id, 100 + request.ts, request.input_tokens, request.output_tokens)
        for request in first
    ]
    result = replay(first + repeat, SMALL_KV_BYTES_PER_TOKEN, SMALL_STATE_BYTES, 1 << 20)

    assert 0 <= result["token_hit_rate"] <= 1 and 0 <= result["request_hit_rate"] <= 1
    hits = [row["hit_tokens"] for row in result["per_request"]]
    first_hits, repeat_hits = hits[:4], hits[4:]
    # Turn k+1 reuses turn k's input and reply up to the state cache_finished_req left one token before the
    # reply's end (the reply's last token has no KV).
    for turn in range(1, 4):
        assert first_hits[turn] == len(first[turn - 1].input_tokens) + len(first[turn - 1].output_tokens) - 1
    assert first_hits[0] == 0
    # The copy hits wherever the original did: its first prompt cannot reuse the original's state at the end
    # of that same prompt, because the scheduler matches at most input_len - 1 tokens.
    assert repeat_hits == first_hits
    assert result["cached_tokens"] == sum(hits)
    assert result["request_hit_rate"] == pytest.approx(6 / 8)
    assert result["states_evicted"] == 0
    assert result["leaked_kv_tokens"] == 0 and result["leaked_state_slots"] == 0


def test_a_session_resumed_elsewhere_hits_on_its_first_turn(make_conversation):
    original = make_conversation("a", 3, seed=2, reply_tokens=(2, 30))
    resumed = make_conversation("b", 1, seed=3, start_ts=50, prefix=original[1].input_tokens)
    result = replay(original + resumed, SMALL_KV_BYTES_PER_TOKEN, SMALL_STATE_BYTES, 1 << 20)
    # Session b starts with a's turn-1 prompt: the deepest state on it is a's turn-1 prompt itself, which
    # cache_unfinished_req inserted after that prefill (the reply had more than one token).
    assert result["per_request"][-1]["hit_tokens"] == len(original[1].input_tokens)


def test_tight_budget_evicts_states_and_leaks_nothing(make_conversation):
    trace = []
    for session in range(12):
        trace += make_conversation(f"s{session}", 4, seed=10 + session, start_ts=session * 0.5)
    roomy = replay(trace, SMALL_KV_BYTES_PER_TOKEN, SMALL_STATE_BYTES, 1 << 20)
    tight = replay(trace, SMALL_KV_BYTES_PER_TOKEN, SMALL_STATE_BYTES, 40 * SMALL_STATE_BYTES)
    assert roomy["states_evicted"] == 0
    assert tight["max_mamba_cache_size"] < roomy["max_mamba_cache_size"]
    assert tight["states_evicted"] > 0
    assert tight["cached_tokens"] < roomy["cached_tokens"]
    assert tight["leaked_kv_tokens"] == tight["leaked_state_slots"] == 0


def test_pools_are_full_again_after_the_requests_and_a_tree_reset(sglang_context, make_conversation):
    trace = make_conversation("a", 3, seed=4) + make_conversation("b", 3, seed=5, start_ts=0.5)
    trace.sort(key=lambda request: request.ts)
    sizes = pool_sizes(
        30 * SMALL_STATE_BYTES,
        SMALL_KV_BYTES_PER_TOKEN,
        SMALL_STATE_BYTES,
        mamba_full_memory_ratio=0.9,
        context_len=1024,
    )
    cache = build_upstream_cache(sizes, max_context_len=1024)
    allocator, states = cache.kv_allocator, cache.req_to_token_pool.mamba_allocator
    assert (allocator.available_size(), states.available_size()) == (
        sizes.max_total_num_tokens,
        sizes.max_mamba_cache_size,
    )
    for index, request in enumerate(trace):
        run_request(cache, request, rid=str(index))
        cache.check_idle(f"after request {index}")
    assert cache.tree.mamba_evictable_size() > 0 and cache.tree.full_evictable_size() > 0
    assert states.available_size() < sizes.max_mamba_cache_size

    assert cache.release_everything() == (0, 0)
    assert allocator.available_size() == sizes.max_total_num_tokens
    assert states.available_size() == sizes.max_mamba_cache_size
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size
    assert cache.tree.total_size() == (0, 0)


def test_turn_that_does_not_fit_is_refused(make_conversation):
    long_turn = make_conversation("a", 1, seed=6, new_tokens=(400, 400), reply_tokens=(10, 10))
    # ~1,000 tokens of KV: the 400-token prompt fits, so every turn is replayed whole.
    assert replay(long_turn, 100, 5_000, 200_000)["requests"] == 1
    with pytest.raises(ValueError, match="does not fit"):
        replay(long_turn, 1_000, 5_000, 200_000)


def test_bad_arguments_are_named(make_conversation):
    trace = make_conversation("a", 1, seed=7)
    with pytest.raises(ValueError, match="no requests"):
        replay([], 100, 5_000, 1 << 20)
    with pytest.raises(ValueError, match="state_bytes must be a positive integer"):
        replay(trace, 100, -1, 1 << 20)
    with pytest.raises(ValueError, match="page size 2"):
        replay(trace, 100, 5_000, 1 << 20, page_size=2)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sessions=st.lists(
        st.tuples(st.integers(1, 4), st.integers(0, 3), st.floats(0, 5), st.booleans()), min_size=1, max_size=6
    ),
    state_slots=st.integers(6, 40),
    seed=st.integers(0, 1000),
)
def test_random_traces_keep_the_pools_consistent(make_conversation, sessions, state_slots, seed):
    shared_prefix = tuple(range(1, 33))
    trace = []
    for index, (turns, extra_seed, start, shares_prefix) in enumerate(sessions):
        trace += make_conversation(
            f"s{index}",
            turns,
            seed=seed * 7 + extra_seed,
            start_ts=start,
            prefix=shared_prefix if shares_prefix else (),
            reply_tokens=(0, 20),
        )
    # 16 bytes per KV token: the states bind, the KV pool (> 2,000 tokens) holds every turn.
    result = replay(trace, 16, SMALL_STATE_BYTES, state_slots * SMALL_STATE_BYTES * 2)
    assert result["leaked_kv_tokens"] == result["leaked_state_slots"] == 0
    for row in result["per_request"]:
        assert 0 <= row["hit_tokens"] <= row["input_tokens"] - 1
    assert result["states_evicted"] >= 0


def test_command_line_writes_the_report(tmp_path, make_conversation):
    from hybrid_prefix_cache.bench.traces import export_trace

    trace_path = tmp_path / "trace.jsonl"
    export_trace(make_conversation("a", 3, seed=8) + make_conversation("b", 2, seed=9, start_ts=0.2), trace_path)
    out = tmp_path / "out.json"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybrid_prefix_cache.bench.engines.sglang_replay",
            "--trace-jsonl",
            str(trace_path),
            "--kv-bytes-per-token",
            "65536",
            "--state-bytes",
            str(PAPER_7B_STATE_BYTES),
            "--cache-gb",
            "1,2",
            "--page-size",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(out.read_text())
    assert [run["cache_bytes"] for run in report["runs"]] == [GIB, 2 * GIB]
    assert all("per_request" not in run for run in report["runs"])
    assert report["runs"][0]["max_mamba_cache_size"] == 18
    assert all(run["requests"] == 5 for run in report["runs"])


@pytest.mark.parametrize("backend", ["mamba-radix", "marconi/lru", "marconi"])
def test_our_backends_replay_over_the_same_pools_and_leak_nothing(make_conversation, backend):
    from hybrid_prefix_cache.cost_model import load_model_spec

    trace = []
    for session in range(12):
        trace += make_conversation(f"s{session}", 4, seed=10 + session, start_ts=session * 0.5)
    budget = 40 * SMALL_STATE_BYTES
    upstream = replay(trace, SMALL_KV_BYTES_PER_TOKEN, SMALL_STATE_BYTES, budget)
    ours = replay(trace, SMALL_KV_BYTES_PER_TOKEN, SMALL_STATE_BYTES, budget, backend=backend,
                  model_spec=load_model_spec("paper-7b"))
    assert (ours["backend"], ours["cache_impl"]) == (backend, "HybridPrefixCache")
    assert upstream["backend"] == "upstream-mamba"
    assert ours["max_mamba_cache_size"] == upstream["max_mamba_cache_size"]  # the same pools
    assert ours["leaked_kv_tokens"] == ours["leaked_state_slots"] == 0
    assert ours["states_evicted"] > 0
    if backend.startswith("marconi"):
        # Marconi admission keeps the state after the reply, which the next turn extends: more hits than
        # upstream's end-of-input states under the same state pressure.
        assert ours["cached_tokens"] > upstream["cached_tokens"]


def test_a_backend_needs_its_cost_model_and_unknown_names_are_refused(make_conversation, tmp_path):
    trace = make_conversation("a", 2, seed=4)
    with pytest.raises(ValueError, match="model_spec"):
        replay(trace, SMALL_KV_BYTES_PER_TOKEN, SMALL_STATE_BYTES, 1 << 20, backend="marconi")
    from hybrid_prefix_cache.bench.traces import export_trace

    trace_path = tmp_path / "trace.jsonl"
    export_trace(trace, trace_path)
    completed = subprocess.run(
        [sys.executable, "-m", "hybrid_prefix_cache.bench.engines.sglang_replay", "--trace-jsonl", str(trace_path),
         "--kv-bytes-per-token", "65536", "--state-bytes", str(PAPER_7B_STATE_BYTES), "--cache-gb", "1",
         "--backends", "upstream-mamba,nope"],
        capture_output=True, text=True, check=False,
    )
    assert completed.returncode == 2 and "nope" in completed.stderr


def test_bench_engine_sglang_runs_upstream_and_ours(tmp_path, monkeypatch):
    from hybrid_prefix_cache.cli import main

    out = tmp_path / "out.json"
    monkeypatch.setenv("HPC_SGLANG_PYTHON", sys.executable)
    code = main(["bench", "--engine", "sglang", "--backends", "upstream-mamba,marconi", "--cache-gb", "1",
                 "--no-progress", "--json", str(out)])
    assert code == 0
    records = {record["backend"]: record for record in json.loads(out.read_text())}
    assert set(records) == {"upstream-mamba", "marconi"}
    assert records["marconi"]["token_hit_rate"] > records["upstream-mamba"]["token_hit_rate"]
