"""Online tuning of the FLOP-aware eviction's alpha, guarded so that it never picks a value that lost to LRU.

Marconi tunes alpha once, by replaying a window of past requests over a grid; a value tuned once can lose to
plain LRU by a wide margin when the workload drifts. :class:`AlphaTuner` keeps a sliding window of the latest
requests and re-tunes every ``retune_every`` requests: the caller's ``evaluate(alpha, window)`` returns the
token hits a cache with that alpha had on the window (the simulator keeps one persistent shadow cache per
alpha). alpha 0 is plain LRU and the baseline: a tuned alpha replaces it only when its hits strictly exceed
alpha 0's on the same window by more than ``margin`` plus ``relative_margin`` times alpha 0's hits; ties go
to 0, and among tuned values with equal hits the smallest wins. Until the window holds ``min_window``
requests (by default a full window) the choice stays 0: on fewer requests the shadows' differences are mostly
noise (on the bundled default trace, 124 requests, a re-tune after 100 took alpha 1 and lost 0.2 points).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

# 0.05: the subsumed-first rule of FlopAwareEviction with almost no weight on efficiency (docs/policies.md).
DEFAULT_ALPHA_GRID: tuple[float, ...] = (0.0, 0.05, 0.25, 0.5, 1.0)

RequestT = TypeVar("RequestT")


class _HasAlpha(Protocol):
    alpha: float


@dataclass(frozen=True, slots=True)
class TuningRecord:
    """One re-tune: after ``request_index`` observed requests, ``alpha`` was chosen from ``hits``
    (alpha -> token hits on the window of ``window_size`` requests)."""

    request_index: int
    alpha: float
    hits: dict[float, float]
    window_size: int


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"AlphaTuner: {name} must be a positive integer, got {value!r}")
    return value


class AlphaTuner(Generic[RequestT]):
    """Chooses alpha from ``grid`` (0 is always evaluated, as the baseline) every ``retune_every`` requests,
    on the latest ``window`` requests, once at least ``min_window`` of them have arrived. Policies passed to
    :meth:`bind` follow every choice."""

    def __init__(
        self,
        evaluate: Callable[[float, Sequence[RequestT]], float],
        *,
        grid: Sequence[float] = DEFAULT_ALPHA_GRID,
        window: int = 500,
        retune_every: int = 500,
        margin: float = 0.0,
        relative_margin: float = 0.0,
        min_window: int | None = None,
    ) -> None:
        if not callable(evaluate):
            raise TypeError(f"AlphaTuner: evaluate must be callable, got {evaluate!r}")
        values = list(grid)
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"AlphaTuner: grid values must be finite numbers >= 0, got {value!r}")
        for name, value in (("margin", margin), ("relative_margin", relative_margin)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"AlphaTuner: {name} must be a finite number >= 0, got {value!r}")
        self.evaluate = evaluate
        self.grid: tuple[float, ...] = tuple(sorted({0.0, *(float(value) for value in values)}))
        self.window = _positive_int("window", window)
        self.retune_every = _positive_int("retune_every", retune_every)
        self.min_window = self.window if min_window is None else _positive_int("min_window", min_window)
        if self.min_window > self.window:
            raise ValueError(f"AlphaTuner: min_window ({self.min_window}) exceeds window ({self.window})")
        self.margin = float(margin)
        self.relative_margin = float(relative_margin)
        self.history: list[TuningRecord] = []
        self.requests_seen = 0
        self._recent: deque[RequestT] = deque(maxlen=self.window)
        self._alpha = 0.0
        self._bound: list[_HasAlpha] = []

    @property
    def alpha(self) -> float:
        """The current choice (0 until a re-tune finds a value that beats LRU)."""
        return self._alpha

    def bind(self, policy: _HasAlpha) -> None:
        """Set ``policy.alpha`` now and after every re-tune (a live :class:`FlopAwareEviction` accepts it)."""
        policy.alpha = self._alpha
        self._bound.append(policy)

    def observe(self, request: RequestT) -> float:
        """Add ``request`` to the window; re-tune when ``retune_every`` requests have arrived since the last
        one. Returns the alpha in force after the request."""
        self._recent.append(request)
        self.requests_seen += 1
        if self.requests_seen % self.retune_every == 0:
            self.retune()
        return self._alpha

    def retune(self) -> TuningRecord:
        """Evaluate every grid value on the current window and apply the guarded choice."""
        window = tuple(self._recent)
        hits: dict[float, float] = {}
        for alpha in self.grid:
            result = self.evaluate(alpha, window)
            if isinstance(result, bool) or not isinstance(result, int | float) or not math.isfinite(result):
                raise ValueError(f"AlphaTuner: evaluate({alpha}, window) returned {result!r}, not a finite number")
            hits[alpha] = float(result)
        best = max(self.grid, key=lambda alpha: (hits[alpha], -alpha))
        beats_lru = hits[best] > hits[0.0] * (1.0 + self.relative_margin) + self.margin
        chosen = best if beats_lru and len(window) >= self.min_window else 0.0
        self._alpha = chosen
        for policy in self._bound:
            policy.alpha = chosen
        record = TuningRecord(self.requests_seen, chosen, hits, len(window))
        self.history.append(record)
        return record
