"""Which prefix-cache backend a vLLM engine runs, and with which knobs; no vLLM import.

The name comes from, in order: ``--additional-config '{"prefix_cache_backend": NAME}'`` (also set by this
plugin's ``--prefix-cache-backend NAME`` flag on ``vllm serve``), the process default set by
:func:`hybrid_prefix_cache.adapters.vllm.install`, then the environment variable
``HYBRID_PREFIX_CACHE_BACKEND``. ``"none"`` (or JSON ``null``) in the additional config forces vLLM's own
prefix cache whatever the environment says. No name anywhere: vLLM's own prefix cache, untouched.

A name is any backend of :func:`hybrid_prefix_cache.registry.resolve_backend` whose admission vLLM can run
(``all``: every block-aligned state the request computes; ``marconi``: branch points and the state after the
last decoded token; ``periodic:N``: vLLM's retention interval N) and whose eviction is ``lru`` or
``flop-aware``. Optional knobs in the additional config: ``prefix_cache_tune_window`` and
``prefix_cache_tune_every`` (requests; the alpha tuner's sliding window and re-tune period).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybrid_prefix_cache.registry import resolve_backend

CONFIG_KEY = "prefix_cache_backend"
TUNE_WINDOW_KEY = "prefix_cache_tune_window"
TUNE_EVERY_KEY = "prefix_cache_tune_every"
ENV_VAR = "HYBRID_PREFIX_CACHE_BACKEND"
# Names that explicitly select vLLM's own prefix cache.
VLLM_DEFAULT_NAMES = ("none", "vllm")
ADMISSION_MODES = ("all", "marconi", "periodic")
DEFAULT_TUNE_WINDOW = 500
DEFAULT_TUNE_EVERY = 500

_process_default: str | None = None


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """A resolved backend as the vLLM adapter runs it."""

    name: str
    admission: str
    period: int
    eviction: str
    tune_window: int = DEFAULT_TUNE_WINDOW
    tune_every: int = DEFAULT_TUNE_EVERY

    @property
    def flop_aware(self) -> bool:
        return self.eviction == "flop-aware"

    @property
    def needs_own_pool(self) -> bool:
        """Marconi admission reads who produced a cached block; FLOP-aware eviction orders the free blocks."""
        return self.flop_aware or self.admission == "marconi"


def set_process_default(name: str | None) -> None:
    """The backend of engines whose additional config names none (``install`` sets it); None clears it."""
    global _process_default
    if name is not None:
        settings_for_name(name, source="install()")
    _process_default = name


def process_default() -> str | None:
    return _process_default


def chosen_name(additional_config: Mapping[str, Any] | None) -> tuple[str | None, str]:
    """The backend name in force and where it came from (None: vLLM's own prefix cache)."""
    if additional_config and CONFIG_KEY in additional_config:
        value = additional_config[CONFIG_KEY]
        if value is None:
            return None, f"additional_config[{CONFIG_KEY!r}]"
        if not isinstance(value, str):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a backend name (string), got {value!r}")
        value = value.strip()
        return (None if value.lower() in VLLM_DEFAULT_NAMES else value), f"additional_config[{CONFIG_KEY!r}]"
    if _process_default is not None:
        return _process_default, "install()"
    value = os.environ.get(ENV_VAR, "").strip()
    if value and value.lower() not in VLLM_DEFAULT_NAMES:
        return value, f"${ENV_VAR}"
    return None, "default"


def settings_for_name(name: str, *, source: str, options: Mapping[str, Any] | None = None) -> BackendSettings:
    """Resolve ``name`` into settings, or raise one ValueError naming ``source`` and the choices."""
    try:
        backend = resolve_backend(name)
    except ValueError as error:
        raise ValueError(f"hybrid-prefix-cache: {source} = {name!r}: {error}; or 'none' for vLLM's own cache") from None
    admission, _, period_text = backend.admission.partition(":")
    if admission not in ADMISSION_MODES:
        raise ValueError(
            f"hybrid-prefix-cache: {source} = {name!r}: admission {backend.admission!r} has no vLLM implementation; "
            "vLLM runs all, marconi and periodic:N"
        )
    period = int(period_text) if admission == "periodic" else 0
    if backend.eviction not in ("lru", "flop-aware"):
        raise ValueError(
            f"hybrid-prefix-cache: {source} = {name!r}: eviction {backend.eviction!r} has no vLLM implementation; "
            "vLLM runs lru and flop-aware"
        )
    options = options or {}
    return BackendSettings(
        name=name,
        admission=admission,
        period=period,
        eviction=backend.eviction,
        tune_window=_positive_option(options, TUNE_WINDOW_KEY, DEFAULT_TUNE_WINDOW),
        tune_every=_positive_option(options, TUNE_EVERY_KEY, DEFAULT_TUNE_EVERY),
    )


def settings_for(additional_config: Mapping[str, Any] | None) -> BackendSettings | None:
    """The settings an engine with this additional config runs, None for vLLM's own prefix cache."""
    name, source = chosen_name(additional_config)
    if name is None:
        return None
    return settings_for_name(name, source=source, options=additional_config)


def _positive_option(options: Mapping[str, Any], key: str, default: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"hybrid-prefix-cache: additional_config[{key!r}] must be a positive integer, got {value!r}")
    return value
