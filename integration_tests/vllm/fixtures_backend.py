"""Helpers and fixtures for the hybrid-prefix-cache backend tests against vLLM (``test_backend_*.py``)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybrid_prefix_cache.bench.runner import engine_model_config
from hybrid_prefix_cache.bench.traces import Request

# paper-7b as vLLM instantiates it (the Nemotron-H form the benchmark's --engine vllm uses): 24 Mamba2 + 4
# attention layers (7 KV-cache groups on vLLM).
PAPER_7B_HF_CONFIG: dict[str, Any] = json.loads(Path(engine_model_config("paper-7b")).read_text(encoding="utf-8"))
GIB = 1 << 30
MIB = 1 << 20
# The tiny model's vocabulary is 1024 ids, the first few special.
TINY_TOKEN_RANGE = (8, 1000)
ENGINE_CACHE_BYTES = 64 * MIB
ENGINE_MAX_MODEL_LEN = 4096


def random_tokens(rng: random.Random, count: int, token_range: tuple[int, int] = TINY_TOKEN_RANGE) -> tuple[int, ...]:
    return tuple(rng.randrange(*token_range) for _ in range(count))


def multi_turn_trace(
    seed: int,
    sessions: int,
    turns: int,
    *,
    system_tokens: int = 700,
    reply_tokens: tuple[int, int] = (100, 400),
    token_range: tuple[int, int] = TINY_TOKEN_RANGE,
) -> list[Request]:
    """Sessions sharing a system prompt; turn k's input is turn k-1's input + reply + a new message."""
    rng = random.Random(seed)
    system = random_tokens(rng, system_tokens, token_range)
    requests = []
    for session in range(sessions):
        history = system + random_tokens(rng, rng.randint(50, 300), token_range)
        for turn in range(turns):
            reply = random_tokens(rng, rng.randint(*reply_tokens), token_range)
            requests.append(Request(f"s{session}", turn, float(session + 10 * turn), history, reply))
            history = history + reply + random_tokens(rng, rng.randint(20, 200), token_range)
    return sorted(requests, key=lambda request: request.ts)


def hits(result: dict[str, Any]) -> dict[tuple[str, int], int]:
    return {(entry["session_id"], entry["turn_id"]): entry["cached_tokens"] for entry in result["per_request"]}


def pool_problems(pool: Any) -> list[str]:
    """Every way ``pool`` (a HybridBlockPool) disagrees with vLLM's own state of its blocks; empty when sound.

    Checked: the free queue holds exactly the blocks with ref_cnt 0 (null block aside), unhashed ones before
    hashed ones; the index has a key for exactly the hashed blocks, marks exactly the free ones free, and offers
    as candidates only free cached blocks.
    """
    problems = []
    queue = pool.free_block_queue
    queued = list(queue.iter_blocks_after(None))
    if len(queued) != queue.num_free_blocks:
        problems.append(f"queue links {len(queued)} blocks but counts {queue.num_free_blocks}")
    queued_ids = {block.block_id for block in queued}
    seen_hashed = False
    for block in queued:
        if block.block_hash is not None:
            seen_hashed = True
        elif seen_hashed and block.block_id not in pool._reuse_watchers:
            problems.append(f"free unhashed block {block.block_id} behind a hashed one")
            break
    index = pool.index
    for block in pool.blocks[1:]:
        free = block.ref_cnt == 0
        if free != (block.block_id in queued_ids):
            problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt} but queued={not free}")
        if index is None:
            continue
        if index.is_cached(block.block_id) != (block.block_hash is not None):
            problems.append(f"block {block.block_id}: hashed={block.block_hash is not None} but index disagrees")
        if block.block_hash is not None and index.is_free(block.block_id) != free:
            problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt} but index free={not free}")
        candidate = index.candidate_of(block.block_id)
        if candidate is not None and (not free or block.block_hash is None):
            problems.append(f"block {block.block_id}: candidate {candidate} while in use or uncached")
    return problems


def read_hf_config(model: Path) -> dict[str, Any]:
    return json.loads((model / "config.json").read_text(encoding="utf-8"))


def start_engine(model: Path, **overrides: Any) -> Any:
    """An in-process-or-not vLLM ``LLM`` for the tiny model, greedy-friendly and small."""
    from vllm import LLM

    arguments: dict[str, Any] = {
        "model": str(model),
        "enable_prefix_caching": True,
        "max_model_len": ENGINE_MAX_MODEL_LEN,
        "kv_cache_memory_bytes": ENGINE_CACHE_BYTES,
        "max_num_batched_tokens": 2048,
        "enforce_eager": True,
        "seed": 0,
    }
    arguments.update(overrides)
    return LLM(**arguments)


def stop_engine(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def in_process_scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def greedy_turn(llm: Any, prompt: list[int], max_tokens: int, logprobs: int | None = 20) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return output


def conversation(llm: Any, seed: int, turns: int, reply_tokens: int) -> Iterator[tuple[list[int], Any]]:
    """A multi-turn conversation whose every turn extends the previous prompt with its reply and a new
    message; yields each turn's prompt and output."""
    rng = random.Random(seed)
    prompt = list(random_tokens(rng, 700))
    for _ in range(turns):
        output = greedy_turn(llm, prompt, reply_tokens)
        yield prompt, output
        prompt = prompt + list(output.outputs[0].token_ids) + list(random_tokens(rng, 60))


# bf16 logits on CPU: recomputing a prefix in other chunks moves a logprob by up to a few thousandths.
NEAR_TIE_NATS = 0.05
LOGPROB_NOISE_NATS = 0.1


def tie_aware_mismatch(reference: Any, candidate: Any) -> str | None:
    """Why ``candidate``'s greedy tokens differ from ``reference``'s (completions with top logprobs),
    or None when they agree.

    The tiny model runs in bf16 (the CPU GatedDeltaNet kernel requires it) with random weights: its two best
    tokens are sometimes within bf16 noise of each other, and a run that resumed from a cached state (other
    chunk boundaries, other rounding) may pick the other one. Agreement therefore means: every token equal, with
    logprobs within ``LOGPROB_NOISE_NATS``, up to the first position where both runs rank the two tokens within
    ``NEAR_TIE_NATS``; nothing after that point is compared. A wrong state changes the distribution by whole
    nats from the first token on.
    """
    ref_tokens, tokens = reference.token_ids, candidate.token_ids
    if len(ref_tokens) != len(tokens):
        return f"{len(tokens)} tokens instead of {len(ref_tokens)}"
    for position, (expected, got) in enumerate(zip(ref_tokens, tokens, strict=True)):
        ref_logprobs, logprobs = reference.logprobs[position], candidate.logprobs[position]
        if expected == got:
            drift = abs(ref_logprobs[expected].logprob - logprobs[got].logprob)
            if drift > LOGPROB_NOISE_NATS:
                return f"token {position}: logprob {logprobs[got].logprob} instead of {ref_logprobs[expected].logprob}"
            continue
        near_tie = (
            got in ref_logprobs
            and expected in logprobs
            and abs(ref_logprobs[got].logprob - ref_logprobs[expected].logprob) <= NEAR_TIE_NATS
            and abs(logprobs[got].logprob - logprobs[expected].logprob) <= NEAR_TIE_NATS
        )
        if near_tie:
            return None
        return f"token {position}: {got} instead of {expected} (reference logprobs {ref_logprobs})"
    return None


def state_blocks_at(pool: Any, end_tokens: int) -> set[int]:
    """Ids of the cached Mamba-state blocks (first state group) for the boundary after ``end_tokens`` tokens."""
    group = pool.layout.state_groups[0]
    return {
        block.block_id
        for block in pool.blocks[1:]
        if block.block_hash is not None
        and block.block_hash_num_tokens == end_tokens
        and int.from_bytes(block.block_hash[-4:], "big") == group
    }


def state_relative_error(llm: Any, block_id: int, reference_block_id: int) -> float:
    """Largest relative L2 difference, over the engine's linear-attention layers, between the recurrent state
    (conv + SSM) stored in two blocks of one in-process engine."""
    import torch

    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    errors = []
    for name, layer in context.items():
        if not name.endswith("linear_attn"):
            continue
        state = torch.cat([tensor[block_id].float().flatten() for tensor in layer.kv_cache])
        reference = torch.cat([tensor[reference_block_id].float().flatten() for tensor in layer.kv_cache])
        errors.append(((state - reference).norm() / reference.norm()).item())
    if not errors:
        raise AssertionError("the engine has no linear-attention layer")
    return max(errors)


def prefill_once(llm: Any, prompt: list[int], salt: str) -> Any:
    """One token for ``prompt`` under a cache salt: no hit, every state computed by prefill."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], params, use_tqdm=False)
    return output
