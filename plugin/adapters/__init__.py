"""Engine adapters: each subpackage binds the engine-free core (tree, policies, cost model) to one engine.

- ``hybrid_prefix_cache.adapters.sglang``: a ``BasePrefixCache`` for SGLang 0.5.20, registered as radix-cache
  backends through SGLang's plugin entry point, with the ``--prefix-cache-backend`` server flag.
- ``hybrid_prefix_cache.adapters.vllm``: the vLLM adapter.

Only the adapters import an engine; importing this package imports none.
"""
