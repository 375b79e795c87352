"""SGLang's entry point into hybrid-prefix-cache (entry-point group ``sglang.srt.plugins``).

SGLang runs :func:`register` through ``load_plugins()`` in every process that needs it: the launcher (before it
parses arguments) and each scheduler process (first thing in ``run_scheduler_process``, before it builds the
tree cache). Scheduler processes are spawned, so everything here is done by the call, not by importing.

:func:`register` checks the SGLang version, registers the backends as radix-cache backends and registers the
``--prefix-cache-backend`` flag (``hybrid_prefix_cache.patches.sglang_cli_flag``). SGLang's registry needs the
names up front: the built-in backends, every pair of the named admission and eviction policies, and the names
listed in the environment variable :data:`EXTRA_BACKENDS_ENV` are registered. A pair with a parameter
(``periodic:256/lru``) is registered when ``--prefix-cache-backend`` selects it; the name is then added to
that variable, which the spawned scheduler processes inherit. Users who select such a pair with
``--radix-cache-backend`` alone set the variable themselves.

SGLang's plugin loader logs and swallows a plugin's exceptions. On an unsupported SGLang version the names are
therefore still registered, with a factory that raises the version error: a server started with one of them
fails with that message instead of "not registered".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from hybrid_prefix_cache.patches import UnsupportedEngineVersion, require_engine_version
from hybrid_prefix_cache.registry import BUILTIN_BACKENDS, EVICTION_NAMES, resolve_backend

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG_VERSIONS = ("0.5.20",)
EXTRA_BACKENDS_ENV = "HYBRID_PREFIX_CACHE_BACKENDS"
# Admission policies whose names need no parameter; periodic:N pairs are registered on demand.
PAIRED_ADMISSIONS = ("all", "marconi")


def known_backend_names() -> list[str]:
    """Names registered with SGLang at plugin load, in order, without duplicates."""
    names = [backend.name for backend in BUILTIN_BACKENDS]
    names += [f"{admission}/{eviction}" for admission in PAIRED_ADMISSIONS for eviction in EVICTION_NAMES]
    names += [name.strip() for name in os.environ.get(EXTRA_BACKENDS_ENV, "").split(",") if name.strip()]
    return list(dict.fromkeys(names))


def _make_factory(name: str) -> Callable:
    from hybrid_prefix_cache.adapters.sglang.factory import build_tree_cache

    def hybrid_prefix_cache_factory(ctx):
        return build_tree_cache(name, ctx)

    return hybrid_prefix_cache_factory


def _make_refusal(error: UnsupportedEngineVersion) -> Callable:
    def refuse(ctx):
        raise UnsupportedEngineVersion(str(error))

    return refuse


def ensure_registered(name: str) -> None:
    """Register ``name`` (a backend name or pair, validated here) with SGLang unless it already is."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    resolve_backend(name)
    if get_radix_cache_factory(name) is None:
        register_radix_cache_backend(name, _make_factory(name))


def select_backend(name: str) -> None:
    """A command line chose ``name``: register it here and make spawned processes register it too."""
    ensure_registered(name)
    if name not in known_backend_names():
        listed = [item for item in os.environ.get(EXTRA_BACKENDS_ENV, "").split(",") if item]
        os.environ[EXTRA_BACKENDS_ENV] = ",".join([*listed, name])


def _register_refusals(error: UnsupportedEngineVersion) -> None:
    try:
        from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    except ImportError:
        return
    for name in known_backend_names():
        if get_radix_cache_factory(name) is None:
            register_radix_cache_backend(name, _make_refusal(error))


def register() -> None:
    """The ``sglang.srt.plugins`` entry point; see the module docstring."""
    try:
        require_engine_version("sglang", ("sglang",), SUPPORTED_SGLANG_VERSIONS, "SGLang adapter")
    except UnsupportedEngineVersion as error:
        _register_refusals(error)
        raise
    from hybrid_prefix_cache.patches import sglang_cli_flag

    for name in known_backend_names():
        try:
            ensure_registered(name)
        except ValueError as error:
            logger.error("hybrid-prefix-cache: %s lists %r, which is not a backend: %s", EXTRA_BACKENDS_ENV, name,
                         error)
    sglang_cli_flag.apply(select_backend)
