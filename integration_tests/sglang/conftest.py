"""Shared fixtures for the tests against the real SGLang 0.5.20 (run them in .venvs/sglang).

Every test module in this folder is skipped, with the reason, when SGLang's prefix-cache modules cannot be
imported (e.g. in .venvs/core): create the environment with ``scripts/setup_env.sh sglang``.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Iterator

import pytest

try:
    for module in ("sglang.srt.mem_cache.mamba_radix_cache", "sglang.srt.managers.schedule_batch"):
        importlib.import_module(module)
    SGLANG_MISSING_REASON = None
except Exception as error:
    SGLANG_MISSING_REASON = (
        f"SGLang is not importable here ({type(error).__name__}: {error}); "
        "run in .venvs/sglang (scripts/setup_env.sh sglang)"
    )


class _SkippedModule(pytest.Module):
    def collect(self):
        pytest.skip(SGLANG_MISSING_REASON)


def pytest_pycollect_makemodule(module_path, parent):
    if SGLANG_MISSING_REASON is not None:
        return _SkippedModule.from_parent(parent, path=module_path)
    return None


@pytest.fixture
def sglang_context() -> Iterator[None]:
    """A published dummy-model SGLang configuration (page size 1, mamba chunk 64) for the test's duration."""
    from hybrid_prefix_cache.bench.engines.sglang_replay import sglang_runtime_context

    with sglang_runtime_context():
        yield


def conversation(
    session_id: str,
    turns: int,
    *,
    seed: int,
    start_ts: float = 0.0,
    prefix: tuple[int, ...] = (),
    new_tokens: tuple[int, int] = (5, 40),
    reply_tokens: tuple[int, int] = (1, 30),
) -> list:
    """A multi-turn session whose turn ``k+1`` input is turn ``k``'s input + reply + a new message; turn 0
    starts with ``prefix`` (a shared system prompt, say). Token ids are drawn from ``seed``."""
    from hybrid_prefix_cache.bench.traces import Request

    rng = random.Random(seed)
    history = list(prefix)
    requests = []
    for turn in range(turns):
        message = [rng.randrange(1, 50_000) for _ in range(rng.randint(*new_tokens))]
        reply = [rng.randrange(1, 50_000) for _ in range(rng.randint(*reply_tokens))]
        prompt = history + message
        requests.append(Request(session_id, turn, start_ts + turn, tuple(prompt), tuple(reply)))
        history = prompt + reply
    return requests


@pytest.fixture
def make_conversation():
    """:func:`conversation`, for tests to build traces."""
    return conversation
