"""vLLM general plugin (entry point ``vllm.general_plugins: hybrid_prefix_cache``).

vLLM calls :func:`register` once in every process it starts (API server, engine core, workers) before it
builds an engine. It installs the patches, which stay inert until an engine names a backend (see
:mod:`hybrid_prefix_cache.adapters.vllm.settings`), and checks a backend named in the environment so that a
typo fails at start with the list of choices. On a vLLM release other than 0.32.x/0.33.x it raises
``UnsupportedEngineVersion`` before patching anything, which stops vLLM at load with that one message
(``VLLM_PLUGINS`` can exclude this plugin).
"""

from __future__ import annotations

from hybrid_prefix_cache.adapters.vllm.settings import chosen_name, settings_for_name
from hybrid_prefix_cache.adapters.vllm.version import require_vllm

PLUGIN = "hybrid-prefix-cache vLLM plugin"


def register() -> None:
    """Install every vLLM patch (idempotent)."""
    require_vllm(PLUGIN)
    from hybrid_prefix_cache.patches import (
        vllm_block_pool,
        vllm_engine_args,
        vllm_manager_factory,
        vllm_scheduler_init,
    )

    for patch in (vllm_scheduler_init, vllm_block_pool, vllm_manager_factory, vllm_engine_args):
        patch.apply()
    name, source = chosen_name(None)
    if name is not None:
        settings_for_name(name, source=source)
