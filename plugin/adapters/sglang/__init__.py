"""The SGLang adapter (SGLang 0.5.20).

- :mod:`.plugin`: the ``sglang.srt.plugins`` entry point (``register``): backend registration and the
  ``--prefix-cache-backend`` flag;
- :mod:`.factory`: the radix-cache factory SGLang's ``create_tree_cache`` calls;
- :mod:`.cache`: ``HybridPrefixCache``, the ``BasePrefixCache`` over the engine-free tree;
- :mod:`.settings`: policy settings from flags or JSON; :mod:`.tuning`: online alpha tuning.

Importing this package imports nothing from SGLang; :mod:`.cache` does.
"""
