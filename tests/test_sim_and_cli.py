"""The simulator's memory models and slot accounting, and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_prefix_cache.bench.runner import RECORD_KEYS
from hybrid_prefix_cache.bench.sim import MemoryModel, SimSettings, build_simulator
from hybrid_prefix_cache.bench.traces import load_trace
from hybrid_prefix_cache.cli import main
from hybrid_prefix_cache.cost_model import load_model_spec

SPEC = load_model_spec("paper-7b")
GIB = 1 << 30


def test_vllm_layout_matches_the_block_arithmetic_recorded_on_vllm():
    memory = MemoryModel.vllm(SPEC, 10 * GIB)
    assert memory.page_size == 80  # 16 x ceil(1,099,264 / 262,144)
    block_bytes = 4 * 80 * 16_384  # a group of 4 layers, attention page 80 tokens x 16 KiB
    assert memory.state_bytes == 6 * block_bytes  # one state = one block per state group = 30 MiB
    assert memory.state_bytes == 30 * (1 << 20)
    assert memory.kv_capacity == (10 * GIB // block_bytes) * 80


def test_split_layout_gives_states_ratio_over_one_plus_ratio_of_the_budget():
    memory = MemoryModel.split(SPEC, 10 * GIB, ratio=0.9)
    assert memory.state_capacity == int(10 * GIB * 0.9 / 1.9 // SPEC.state_bytes)
    assert memory.kv_capacity == (10 * GIB - memory.state_capacity * SPEC.state_bytes) // SPEC.kv_bytes_per_token


@pytest.mark.parametrize("backend", ["vllm-align", "upstream-mamba", "mamba-radix", "marconi/lru", "periodic:512/lru"])
@pytest.mark.parametrize("layout", ["split", "unified"])
def test_replay_under_pressure_keeps_the_tree_valid_and_leaks_no_slot(backend, layout):
    requests = load_trace("default")
    simulator = build_simulator(backend, SPEC, int(0.5 * GIB), layout=layout, settings=SimSettings())
    result = simulator.run(requests)
    simulator.tree.check_invariants()
    assert result.requests + result.rejected_requests == len(requests)
    assert simulator.tree.protected_tokens == 0 and simulator.tree.protected_states == 0
    assert simulator.pools.kv_used == simulator.tree.total_tokens
    assert simulator.pools.states_used == simulator.tree.total_states
    assert 0.0 <= result.token_hit_rate <= 1.0
    assert result.input_tokens == result.reused_tokens + result.prefill_tokens_computed


def test_cli_version_backends_and_bad_input(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert "hybrid-prefix-cache 0.1.0" in capsys.readouterr().out
    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mamba-radix") and lines[1].startswith("marconi")
    assert main(["bench", "--backends", "nope", "--no-progress"]) == 2
    assert "unknown prefix-cache backend 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--cache-gb", "0"])


def test_cli_bench_writes_one_record_per_backend_and_size(tmp_path, capsys):
    out = tmp_path / "out.json"
    code = main(["bench", "--cache-gb", "1,2", "--backends", "vllm-align,marconi", "--json", str(out),
                 "--no-progress"])
    assert code == 0
    records = json.loads(out.read_text())
    assert [(r["backend"], r["cache_gb"]) for r in records] == [
        ("vllm-align", 1.0), ("vllm-align", 2.0), ("marconi", 1.0), ("marconi", 2.0)]
    assert all(alpha >= 0 for _, alpha in records[-1]["alpha_history"])
    for record in records:
        assert set(RECORD_KEYS) <= set(record)
    assert "token hit rate (%)" in capsys.readouterr().out


@pytest.mark.parametrize("layout", [None, "split", "unified"])
def test_baselines_keep_their_engines_memory_and_ours_follow_layout(tmp_path, layout):
    out = tmp_path / "out.json"
    args = ["bench", "--cache-gb", "1", "--backends", "vllm-align,upstream-mamba,marconi/lru", "--json", str(out),
            "--no-progress"]
    code = main(args + (["--layout", layout] if layout else []))
    assert code == 0
    layouts = {record["backend"]: record["memory_layout"] for record in json.loads(out.read_text())}
    assert layouts == {"vllm-align": "vllm", "upstream-mamba": "split", "marconi/lru": layout or "vllm"}


def test_engine_vllm_runs_vllms_cache_as_vllm_align_beside_our_backends(tmp_path, monkeypatch):
    """The runner's side of --engine vllm: the command it builds and how the replay's runs become records (the
    replay itself runs in integration_tests/vllm)."""
    from hybrid_prefix_cache.bench import runner

    commands = []

    def fake_replay(command, check):
        commands.append(command)
        out = command[command.index("--json") + 1]
        lines = Path(command[command.index("--trace-jsonl") + 1]).read_text(encoding="utf-8").splitlines()
        trace = [json.loads(line) for line in lines if line.strip()]
        runs = [{"backend": name, "cache_bytes": 1 << 30, "token_hit_rate": hit, "request_hit_rate": hit,
                 "prompt_tokens": sum(len(row["input_tokens"]) for row in trace), "cached_tokens": 10,
                 "per_request": [{"session_id": row["session_id"], "turn_id": row["turn_id"],
                                  "cached_tokens": 10 if index == 0 else 0} for index, row in enumerate(trace)]}
                for name, hit in (("vllm", 0.25), ("marconi", 0.5))]
        with open(out, "w", encoding="utf-8") as handle:
            json.dump({"runs": runs}, handle)

    monkeypatch.setenv("HPC_VLLM_PYTHON", "python-of-the-vllm-env")
    monkeypatch.setattr(runner.subprocess, "run", fake_replay)
    report = runner.run_bench(runner.BenchOptions(engine="vllm", backends=["vllm-align", "marconi"], cache_gb=[1.0],
                                                  progress=False))
    command = commands[0]
    assert command[:3] == ["python-of-the-vllm-env", "-m", "hybrid_prefix_cache.bench.engines.vllm_backend_replay"]
    assert command[command.index("--backends") + 1] == "vllm,marconi"
    assert [(r["backend"], r["token_hit_rate"]) for r in report.records] == [("vllm-align", 0.25), ("marconi", 0.5)]
    assert all(r["prefill_tokens_computed"] == r["engine_run"]["prompt_tokens"] - 10 for r in report.records)
    with pytest.raises(ValueError, match="upstream-mamba"):
        runner.run_bench(runner.BenchOptions(engine="vllm", backends=["upstream-mamba"], progress=False))
