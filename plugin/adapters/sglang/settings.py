"""Policy settings of a hybrid-prefix-cache backend inside SGLang, from server flags or one JSON object.

The launcher parses them (``--prefix-cache-config JSON`` and the individual ``--prefix-cache-*`` flags, which win
over the same key in the JSON) and stores :meth:`PrefixCacheSettings.to_dict` on the ``ServerArgs`` record under
:data:`SERVER_ARGS_ATTRIBUTE`; the record is pickled into the scheduler process, where the cache factory reads it
back with :meth:`PrefixCacheSettings.from_mapping`. This module imports no engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from hybrid_prefix_cache.bench.sim import SimSettings

# An underscore name that is not a ServerArgs field: SGLang lets it be set on the record before resolution, and
# the record's pickling keeps it (sglang/srt/server_args.py, ServerArgs.__setattr__ and __reduce__).
SERVER_ARGS_ATTRIBUTE = "_hybrid_prefix_cache"

# The simulator's tuning defaults, so that a backend tunes alike in the engine and in the benchmark.
_SIM_DEFAULTS = SimSettings()


def _positive_int(key: str, value: object, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"prefix-cache setting {key!r} must be an integer {bound}, got {value!r}")
    return value


def _alpha(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"prefix-cache setting {key!r} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class PrefixCacheSettings:
    """What a backend's policies need beyond its name.

    - ``state_chunk_size``: the granularity of branch points (the sequence length at which a request captures
      the state where the next request can diverge). None takes SGLang's checkpoint grid,
      ``lcm(mamba cache chunk size, page size)``; a value must be a multiple of that grid, because SGLang can
      only capture states on it.
    - ``alpha``: the FLOP-aware eviction's weight of FLOP efficiency against recency before any tuning
      (0 is LRU).
    - ``alpha_grid``: the values the online tuner tries (0, plain LRU, is always tried and wins ties).
    - ``tuning_window``: requests over which the tuner compares its shadow caches (one per alpha, fed every
      finished request); 0 turns tuning off (``alpha`` stays).
    - ``retune_every``: requests between two tunings.
    - ``relative_margin``: a tuned alpha replaces 0 only when its shadow's hits beat alpha 0's by this fraction.
    """

    state_chunk_size: int | None = None
    alpha: float = 0.0
    alpha_grid: tuple[float, ...] = _SIM_DEFAULTS.alpha_grid
    tuning_window: int = _SIM_DEFAULTS.tune_window
    retune_every: int = _SIM_DEFAULTS.tune_every
    relative_margin: float = _SIM_DEFAULTS.tune_relative_margin

    def __post_init__(self) -> None:
        if self.state_chunk_size is not None:
            _positive_int("state_chunk_size", self.state_chunk_size)
        _alpha("alpha", self.alpha)
        if isinstance(self.alpha_grid, str | bytes) or not hasattr(self.alpha_grid, "__iter__"):
            raise ValueError(f"prefix-cache setting 'alpha_grid' must be a list of numbers, got {self.alpha_grid!r}")
        grid = tuple(_alpha("alpha_grid", value) for value in self.alpha_grid)
        if not grid:
            raise ValueError("prefix-cache setting 'alpha_grid' must hold at least one number")
        object.__setattr__(self, "alpha_grid", grid)
        _positive_int("tuning_window", self.tuning_window, allow_zero=True)
        _positive_int("retune_every", self.retune_every)
        _alpha("relative_margin", self.relative_margin)

    @property
    def tunes(self) -> bool:
        return self.tuning_window > 0

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(field.name for field in fields(cls))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None) -> PrefixCacheSettings:
        """Settings from a mapping whose keys are field names; an unknown key is an error naming the known ones."""
        if mapping is None:
            return cls()
        if not isinstance(mapping, Mapping):
            raise ValueError(f"prefix-cache settings must be a JSON object, got {type(mapping).__name__}")
        unknown = sorted(set(mapping) - set(cls.keys()))
        if unknown:
            raise ValueError(
                f"unknown prefix-cache setting(s) {', '.join(map(repr, unknown))}; known: {', '.join(cls.keys())}"
            )
        return cls(**dict(mapping))

    @classmethod
    def from_json(cls, text: str) -> PrefixCacheSettings:
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--prefix-cache-config is not valid JSON: {error}") from None
        return cls.from_mapping(mapping)

    def with_overrides(self, overrides: Mapping[str, Any]) -> PrefixCacheSettings:
        """A copy with the given keys replaced (keys whose value is None are ignored)."""
        merged = self.to_dict()
        merged.update({key: value for key, value in overrides.items() if value is not None})
        return type(self).from_mapping(merged)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (the form carried on the ServerArgs record)."""
        out = asdict(self)
        out["alpha_grid"] = list(self.alpha_grid)
        return out


def parse_alpha_grid(text: str) -> tuple[float, ...]:
    """``"0,0.5,2"`` -> ``(0.0, 0.5, 2.0)``; ValueError naming the bad item otherwise."""
    values = []
    for item in text.split(","):
        try:
            values.append(float(item))
        except ValueError:
            raise ValueError(f"alpha grid items must be numbers, got {item.strip()!r} in {text!r}") from None
    return PrefixCacheSettings(alpha_grid=tuple(values)).alpha_grid
