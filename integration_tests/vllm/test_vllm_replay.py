"""The model-free replay through vLLM's real Scheduler/KVCacheManager (bench/engines/vllm_replay.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from hybrid_prefix_cache.bench.engines.vllm_replay import EngineOptions, main, replay
from hybrid_prefix_cache.bench.runner import engine_model_config
from hybrid_prefix_cache.bench.traces import Request

# paper-7b as vLLM instantiates it (the Nemotron-H form the benchmark's --engine vllm uses): 24 Mamba2 + 4
# attention layers (7 KV-cache groups on vLLM).
PAPER_7B_HF_CONFIG: dict[str, Any] = json.loads(Path(engine_model_config("paper-7b")).read_text(encoding="utf-8"))
FP16_STATES = EngineOptions(mamba_ssm_cache_dtype="float16")
GIB = 1 << 30


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100_000) for _ in range(count))


def _multi_turn_trace(seed: int, sessions: int, turns: int) -> list[Request]:
    """Sessions sharing a system prompt; each turn's input is the previous input + reply + a new message."""
    rng = random.Random(seed)
    system_prompt = _tokens(rng, 700)
    requests = []
    for session in range(sessions):
        history = system_prompt + _tokens(rng, rng.randint(50, 300))
        for turn in range(turns):
            reply = _tokens(rng, rng.randint(20, 200))
            requests.append(Request(f"s{session}", turn, float(session + 10 * turn), history, reply))
            history = history + reply + _tokens(rng, rng.randint(20, 200))
    return sorted(requests, key=lambda request: request.ts)


@pytest.fixture(scope="module")
def trace() -> list[Request]:
    return _multi_turn_trace(seed=7, sessions=5, turns=3)


@pytest.fixture(scope="module")
def result(trace: list[Request]) -> dict[str, Any]:
    return replay(trace, PAPER_7B_HF_CONFIG, GIB, options=FP16_STATES)


def test_hit_rates_are_fractions_and_add_up(trace: list[Request], result: dict[str, Any]) -> None:
    assert result["requests"] == len(trace)
    assert 0.0 <= result["token_hit_rate"] <= 1.0
    assert 0.0 <= result["request_hit_rate"] <= 1.0
    assert result["prompt_tokens"] == sum(len(request.input_tokens) for request in trace)
    assert result["computed_prompt_tokens"] == result["prompt_tokens"] - result["cached_tokens"]
    assert result["cached_tokens"] == sum(entry["cached_tokens"] for entry in result["per_request"])
    for entry in result["per_request"]:
        assert 0 <= entry["cached_tokens"] < entry["prompt_tokens"]
        assert entry["cached_tokens"] % result["block_size"] == 0


def test_geometry_comes_from_the_hybrid_config(result: dict[str, Any]) -> None:
    specs = [group["spec"] for group in result["kv_cache_groups"]]
    assert specs.count("FullAttentionSpec") == 1
    assert specs.count("MambaSpec") == result["blocks_per_state"]
    assert sum(group["num_layers"] for group in result["kv_cache_groups"]) == 28
    assert result["mamba_cache_mode"] == "align"
    # conv (3 x (4096 + 2*128)) + SSM (64 x 64 x 128) fp16 values per Mamba layer, 24 layers.
    assert result["state_content_bytes"] == 24 * 2 * (3 * 4352 + 64 * 64 * 128)
    assert result["kv_cache_bytes"] <= GIB
    assert result["bytes_per_block"] * result["num_blocks"] == result["kv_cache_bytes"]


def test_free_blocks_return_to_their_initial_count(result: dict[str, Any]) -> None:
    # Only the null block is never free.
    assert result["free_blocks_initial"] == result["num_blocks"] - 1
    assert result["free_blocks_final"] == result["free_blocks_initial"]


def test_repeated_identical_prompt_hits_up_to_its_last_full_block() -> None:
    prompt = _tokens(random.Random(3), 1000)
    requests = [Request("first", 0, 0.0, prompt, (1, 2, 3)), Request("second", 0, 1.0, prompt, (4, 5))]
    outcome = replay(requests, PAPER_7B_HF_CONFIG, GIB, options=FP16_STATES)
    first, second = outcome["per_request"]
    block = outcome["block_size"]
    assert first["cached_tokens"] == 0
    # The last prompt token is always recomputed, and hits land on block boundaries.
    assert second["cached_tokens"] == (len(prompt) - 1) // block * block > 0
    assert outcome["free_blocks_final"] == outcome["free_blocks_initial"]


def test_next_turn_reuses_the_previous_prompt_but_not_the_reply() -> None:
    rng = random.Random(11)
    first_input = _tokens(rng, 900)
    reply = _tokens(rng, 400)
    second_input = first_input + reply + _tokens(rng, 100)
    requests = [Request("s", 0, 0.0, first_input, reply), Request("s", 1, 1.0, second_input, (9,))]
    outcome = replay(requests, PAPER_7B_HF_CONFIG, GIB, options=FP16_STATES)
    block = outcome["block_size"]
    # vLLM keeps a Mamba state at the prompt's last full block only: the 400 reply tokens, which cover
    # whole blocks, are recomputed by the next turn.
    assert outcome["per_request"][1]["cached_tokens"] == (len(first_input) - 1) // block * block


def test_bounded_concurrency_replays_every_request(trace: list[Request]) -> None:
    outcome = replay(trace, PAPER_7B_HF_CONFIG, GIB, max_concurrency=4, options=FP16_STATES)
    assert outcome["requests"] == len(trace)
    assert 0.0 <= outcome["token_hit_rate"] <= 1.0
    assert outcome["free_blocks_final"] == outcome["free_blocks_initial"]
    by_key = {(entry["session_id"], entry["turn_id"]): entry for entry in outcome["per_request"]}
    assert set(by_key) == {(request.session_id, request.turn_id) for request in trace}


def test_budget_too_small_for_the_longest_turn_is_refused(trace: list[Request]) -> None:
    with pytest.raises(ValueError, match="KV cache"):
        replay(trace, PAPER_7B_HF_CONFIG, 64 << 20, options=FP16_STATES)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (([], PAPER_7B_HF_CONFIG, GIB), "no requests"),
        (([Request("s", 0, 0.0, (1, 2), (3,))], {"model_type": "x"}, GIB), "architectures"),
        (([Request("s", 0, 0.0, (1, 2), (3,))], PAPER_7B_HF_CONFIG, 0), "cache_bytes"),
        (([Request("s", 0, 0.0, (), (3,))], PAPER_7B_HF_CONFIG, GIB), "no input tokens"),
        (([Request("s", 0, 0.0, (1,), ()), Request("s", 0, 1.0, (1,), ())], PAPER_7B_HF_CONFIG, GIB), "twice"),
    ],
)
def test_bad_input_is_named(arguments: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replay(*arguments)


def test_cli_writes_one_run_per_budget(tmp_path: Path, trace: list[Request]) -> None:
    trace_path = tmp_path / "trace.jsonl"
    trace_path.write_text(
        "".join(
            json.dumps(
                {
                    "session_id": r.session_id,
                    "turn_id": r.turn_id,
                    "ts": r.ts,
                    "input_tokens": list(r.input_tokens),
                    "output_tokens": list(r.output_tokens),
                }
            )
            + "\n"
            for r in trace
        ),
        encoding="utf-8",
    )
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(PAPER_7B_HF_CONFIG), encoding="utf-8")
    output = tmp_path / "out.json"
    argv = ["--trace-jsonl", str(trace_path), "--model-config", str(config_path), "--cache-gb", "0.5,1"]
    assert main([*argv, "--mamba-ssm-cache-dtype", "float16", "--json", str(output)]) == 0
    runs = json.loads(output.read_text(encoding="utf-8"))["runs"]
    assert [run["cache_bytes"] for run in runs] == [GIB // 2, GIB]
    assert all("per_request" not in run for run in runs)
    assert runs[0]["num_blocks"] < runs[1]["num_blocks"]
    assert runs[0]["token_hit_rate"] <= runs[1]["token_hit_rate"]
