"""Add ``--prefix-cache-backend`` and the ``--prefix-cache-*`` settings flags to SGLang's server command line.

What it patches: ``sglang.srt.server_args.ServerArgs.add_cli_args`` (a staticmethod) and
``ServerArgs.from_cli_args`` (a classmethod), as AROUND hooks registered with SGLang's plugin ``HookRegistry``;
``load_plugins()`` applies them, and every SGLang entry point calls it before parsing arguments
(``launch_server``, ``sglang serve``, ``Engine``).

Versions verified: sglang 0.5.20 (``integration_tests/sglang/test_adapter_flag.py`` parses real command lines and
builds the cache in a spawned scheduler-like process).

Why: ``ServerArgs`` is a msgspec struct whose fields SGLang declares; a plugin cannot add one. The flags are
parsed by argparse and translated: the backend name becomes SGLang's own ``radix_cache_backend`` (so selection,
the "not registered" check and the scheduler's factory lookup stay SGLang's, and ``--radix-cache-backend NAME``
keeps working on its own), and the policy settings ride on the record as the underscore attribute
``_hybrid_prefix_cache``, which SGLang allows before resolution and pickles into the scheduler process.

When removable: when SGLang lets plugins declare server arguments, or when the plugin is configured only through
``--radix-cache-backend`` and the ``HYBRID_PREFIX_CACHE_*`` environment; remove this module, its call in
``hybrid_prefix_cache.adapters.sglang.plugin.register`` and its row in ``docs/patches.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from hybrid_prefix_cache.adapters.sglang.settings import (
    SERVER_ARGS_ATTRIBUTE,
    PrefixCacheSettings,
    parse_alpha_grid,
)
from hybrid_prefix_cache.patches import require_engine_version
from hybrid_prefix_cache.registry import resolve_backend

SUPPORTED_VERSIONS = ("0.5.20",)
ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"

# Flag destination -> settings key; the flags win over the same key in --prefix-cache-config.
SETTING_FLAGS = {
    "prefix_cache_state_chunk_size": "state_chunk_size",
    "prefix_cache_alpha": "alpha",
    "prefix_cache_alpha_grid": "alpha_grid",
    "prefix_cache_tuning_window": "tuning_window",
    "prefix_cache_retune_every": "retune_every",
}

_on_backend_selected: Callable[[str], None] | None = None


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse reports an ArgumentTypeError's message verbatim; a ValueError would become 'invalid value'."""

    def parse_or_report(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse_or_report.__name__ = parse.__name__
    return parse_or_report


def _backend_name(text: str) -> str:
    return resolve_backend(text).name


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def _count(text: str) -> int:
    return _integer(text, 0)


def _positive(text: str) -> int:
    return _integer(text, 1)


def _alpha(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    return PrefixCacheSettings(alpha=value).alpha


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hybrid-prefix-cache")
    group.add_argument(
        "--prefix-cache-backend", type=_argument_type(_backend_name), default=None, metavar="NAME",
        help="hybrid-prefix-cache backend for hybrid SSM models: mamba-radix, marconi, or ADMISSION/EVICTION "
             "(ADMISSION in all, marconi, periodic:N; EVICTION in lru, flop-aware). Sets --radix-cache-backend.",
    )
    group.add_argument(
        "--prefix-cache-config", type=_argument_type(PrefixCacheSettings.from_json), default=None, metavar="JSON",
        help=f"backend settings as one JSON object with keys {', '.join(PrefixCacheSettings.keys())}",
    )
    group.add_argument("--prefix-cache-state-chunk-size", type=_argument_type(_positive), default=None, metavar="N",
                       help="branch-point granularity in tokens (default: SGLang's mamba checkpoint grid)")
    group.add_argument("--prefix-cache-alpha", type=_argument_type(_alpha), default=None, metavar="A",
                       help="FLOP-aware eviction weight before tuning (default 0: LRU)")
    group.add_argument("--prefix-cache-alpha-grid", type=_argument_type(parse_alpha_grid), default=None,
                       metavar="A,B,...", help="alpha values the online tuner tries (0 always included)")
    group.add_argument("--prefix-cache-tuning-window", type=_argument_type(_count), default=None, metavar="N",
                       help="requests per tuning window (default 600); 0 turns tuning off")
    group.add_argument("--prefix-cache-retune-every", type=_argument_type(_positive), default=None, metavar="N",
                       help="requests between tunings (default 100)")


def settings_from_args(args: argparse.Namespace) -> PrefixCacheSettings | None:
    """The settings the command line gave, or None when it gave none."""
    base = getattr(args, "prefix_cache_config", None)
    overrides = {key: getattr(args, dest, None) for dest, key in SETTING_FLAGS.items()}
    if base is None and all(value is None for value in overrides.values()):
        return None
    return (base or PrefixCacheSettings()).with_overrides(overrides)


def _add_cli_args(original: Callable[[argparse.ArgumentParser], None], parser: argparse.ArgumentParser) -> None:
    original(parser)
    add_arguments(parser)


def _from_cli_args(original: Callable[..., Any], cls: type, args: argparse.Namespace) -> Any:
    name = getattr(args, "prefix_cache_backend", None)
    selected = getattr(args, "radix_cache_backend", None)
    if name is not None:
        if selected not in (None, name):
            raise ValueError(f"--prefix-cache-backend {name} conflicts with --radix-cache-backend {selected}; "
                             "give one of them")
        if _on_backend_selected is not None:
            _on_backend_selected(name)
        args.radix_cache_backend = name
    settings = settings_from_args(args)
    if settings is not None and name is None:
        try:
            resolve_backend(selected or "")
        except ValueError:
            raise ValueError(
                "--prefix-cache-config / --prefix-cache-* settings need a hybrid-prefix-cache backend: add "
                "--prefix-cache-backend NAME"
            ) from None
    server_args = original(cls, args)
    if settings is not None:
        setattr(server_args, SERVER_ARGS_ATTRIBUTE, settings.to_dict())
    return server_args


def _hooks_registered(registry: Any, target: str, hook: Callable[..., Any]) -> bool:
    return any(registered is hook for _, registered, _ in registry._hooks.get(target, ()))


def apply(on_backend_selected: Callable[[str], None]) -> None:
    """Register the two AROUND hooks (once per process); ``on_backend_selected(name)`` runs when a command line
    selects a backend, before SGLang builds the record (the adapter registers pair names there)."""
    global _on_backend_selected
    require_engine_version("sglang", ("sglang",), SUPPORTED_VERSIONS, "patch sglang_cli_flag")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _on_backend_selected = on_backend_selected
    for target, hook in ((ADD_CLI_ARGS, _add_cli_args), (FROM_CLI_ARGS, _from_cli_args)):
        if not _hooks_registered(HookRegistry, target, hook):
            HookRegistry.register(target, hook, HookType.AROUND)
