"""Route SGLang's decode state-tracking calls to hybrid-prefix-cache's Triton kernels.

What it patches: the functions ``track_mamba_states_if_needed`` and ``track_mamba_states_all_layers`` of
``sglang.kernels.ops.mamba.mamba_state_scatter_triton``, rebound in that module and in every loaded module that
imported them by name (in 0.5.20: ``sglang.srt.layers.attention.hybrid_linear_attn_backend``, whose
``MambaAttnBackendBase._track_mamba_state_decode`` and ``Mamba2AttnBackend.forward`` call them). The replacements
take the same arguments in the same order and leave the same bytes in the pool
(:func:`hybrid_prefix_cache.kernels.track_mamba_states_if_needed` and ``..._all_layers``).

Versions verified: sglang 0.5.20 (the integration test ``integration_tests/sglang/test_track_kernel_patch.py``
runs upstream's call sites before and after :func:`apply` and compares the pools).

Why: upstream launches one program per (layer, request) that walks a whole state row (about 2 MiB per layer for
Qwen3-Next) in 1024-element steps, so a small decode batch occupies only a few dozen of a GPU's streaming
multiprocessors; ours splits every row across programs (see ``docs/kernels.md``). Ours also tracks every conv
tensor of the pool when given SGLang's conv list, and skips out-of-range slots instead of faulting.

Not patched: the extend-time gathers (``_track_mamba_state_extend`` and the conv-window assignment inside the GDN
and Mamba2 ``forward`` methods) and ``MambaPool.copy_from``. They are statements inside methods rather than
functions imported by name; :mod:`hybrid_prefix_cache.kernels` offers equivalents
(``track_ssm_states_extend``, ``track_conv_states_extend``, ``copy_state_slots``) for an adapter to call.

When removable: when SGLang's own tracking kernels split rows across programs (or the plugin stops supporting
SGLang 0.5.20); drop this module and its entry in ``docs/patches.md``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybrid_prefix_cache.patches import require_engine_version

KERNEL_MODULE = "sglang.kernels.ops.mamba.mamba_state_scatter_triton"
CALLER_MODULES = ("sglang.srt.layers.attention.hybrid_linear_attn_backend",)
FUNCTION_NAMES = ("track_mamba_states_if_needed", "track_mamba_states_all_layers")

_originals: dict[str, Callable[..., Any]] = {}
_replacements: dict[str, Callable[..., None]] = {}
_applied_check_indices: list[bool] = []


def _make_replacements(check_indices: bool) -> dict[str, Callable[..., None]]:
    from hybrid_prefix_cache import kernels

    def track_mamba_states_if_needed(
        conv_states: torch.Tensor | Sequence[torch.Tensor],
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        mamba_track_mask: torch.Tensor,
        mamba_track_indices: torch.Tensor,
        batch_size: int,
        check_freed_slots: bool = False,
    ) -> None:
        kernels.track_mamba_states_if_needed(
            conv_states,
            ssm_states,
            cache_indices,
            mamba_track_mask,
            mamba_track_indices,
            batch_size,
            check_freed_slots,
            check_indices=check_indices,
        )

    def track_mamba_states_all_layers(
        conv_states_pool: torch.Tensor | Sequence[torch.Tensor],
        ssm_states_pool: torch.Tensor,
        cache_indices: torch.Tensor,
        mamba_track_mask: torch.Tensor,
        mamba_track_indices: torch.Tensor,
        batch_size: int,
        check_freed_slots: bool = False,
    ) -> None:
        kernels.track_mamba_states_all_layers(
            conv_states_pool,
            ssm_states_pool,
            cache_indices,
            mamba_track_mask,
            mamba_track_indices,
            batch_size,
            check_freed_slots,
            check_indices=check_indices,
        )

    replacements = {
        "track_mamba_states_if_needed": track_mamba_states_if_needed,
        "track_mamba_states_all_layers": track_mamba_states_all_layers,
    }
    for name, function in replacements.items():
        function.__module__ = __name__
        function.__qualname__ = name
        function.__doc__ = (
            f"hybrid-prefix-cache replacement for {KERNEL_MODULE}.{name} (check_indices={check_indices})."
        )
    return replacements


def _modules_holding(function: Callable[..., Any], name: str) -> list[Any]:
    # Read module dicts, not attributes: getattr on lazy modules (e.g. transformers') would import things.
    return [
        module
        for module in list(sys.modules.values())
        if (getattr(module, "__dict__", None) or {}).get(name) is function
    ]


def _rebind(old: Callable[..., Any], new: Callable[..., Any], name: str) -> None:
    for module in _modules_holding(old, name):
        setattr(module, name, new)


def apply(*, check_indices: bool = False) -> None:
    """Rebind upstream's decode tracking functions to ours. Idempotent; calling again may change ``check_indices``.

    ``check_indices=False`` (default) keeps the decode step free of device-to-host syncs, like upstream; rows with
    out-of-range slots are then skipped by the kernel. ``True`` validates indices on every call (debugging).
    """
    require_engine_version("sglang", ("sglang",), ("0.5.20",), "sglang_track_kernels")
    kernel_module = importlib.import_module(KERNEL_MODULE)
    for caller in CALLER_MODULES:
        importlib.import_module(caller)
    if not _originals:
        for name in FUNCTION_NAMES:
            _originals[name] = getattr(kernel_module, name)
    if _applied_check_indices == [check_indices]:
        return
    replacements = _make_replacements(check_indices)
    for name in FUNCTION_NAMES:
        for bound in {_originals[name], _replacements.get(name, _originals[name])}:
            _rebind(bound, replacements[name], name)
    _replacements.update(replacements)
    _applied_check_indices[:] = [check_indices]


def revert() -> None:
    """Put upstream's functions back wherever :func:`apply` rebound them."""
    for name, replacement in list(_replacements.items()):
        _rebind(replacement, _originals[name], name)
        del _replacements[name]
    _applied_check_indices.clear()


def is_applied() -> bool:
    return bool(_replacements)


def upstream_functions() -> dict[str, Callable[..., Any]]:
    """SGLang's original functions as found by the first :func:`apply` (empty before it)."""
    return dict(_originals)
