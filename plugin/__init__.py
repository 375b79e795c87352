"""Prefix-cache backends for hybrid (attention + recurrent-state) LLMs.

The core (``hybrid_prefix_cache.core``, ``.policies``, ``.cost_model``) imports neither sglang nor vllm;
engine adapters live in ``hybrid_prefix_cache.adapters``.
"""

__version__ = "0.1.0"
