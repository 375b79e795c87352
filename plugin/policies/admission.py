"""Admission policies: which recurrent states a request leaves in the cache.

A state can only be captured while the request computes it, so the policy answers two questions for the engine
adapter: at which sequence lengths to capture the state during prefill, and whether to keep the state after
the last decoded token. Capture lengths are always beyond the reused prefix and at most the input length.

- ``all`` (upstream): the state at the branch point, the state at the end of the input (floored to the state
  chunk size, as the engine tracks it) and the final state.
- ``marconi``: the state at the branch point found by the speculative insertion (the match itself: the match
  splits the edge where the input leaves the cached tree) and the final state; nothing else. A prefix that only
  ever appears as input is cached from its second occurrence, which creates the branch, and hits from its third.
- ``periodic:N``: every multiple of N inside the prefill, and the final state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class AdmissionPolicy(Protocol):
    name: str
    caches_kv_without_state: bool

    def prefill_captures(self, input_len: int, reused_len: int, branching_seqlen: int | None, chunk: int) -> list[int]:
        """Sorted lengths in (reused_len, input_len] whose state the prefill should capture and cache."""

    def keep_final_state(self) -> bool:
        """Whether the state after the last decoded token is cached when the request finishes."""


def _window(lengths: list[int], reused_len: int, input_len: int) -> list[int]:
    return sorted({length for length in lengths if reused_len < length <= input_len})


@dataclass(frozen=True, slots=True)
class AdmitAll:
    """Upstream's admission: branch point, end of input (chunk-floored), final state."""

    name: str = "all"
    caches_kv_without_state: bool = False

    def prefill_captures(self, input_len: int, reused_len: int, branching_seqlen: int | None, chunk: int) -> list[int]:
        end = input_len // chunk * chunk if chunk else input_len
        return _window([end, branching_seqlen or 0], reused_len, input_len)

    def keep_final_state(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class MarconiAdmission:
    """Only branch points and the state after the last decoded token."""

    name: str = "marconi"
    caches_kv_without_state: bool = False

    def prefill_captures(self, input_len: int, reused_len: int, branching_seqlen: int | None, chunk: int) -> list[int]:
        return _window([branching_seqlen or 0], reused_len, input_len)

    def keep_final_state(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class PeriodicAdmission:
    """Every ``period`` tokens during prefill, plus the final state."""

    period: int
    name: str = "periodic"
    caches_kv_without_state: bool = False

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"periodic admission needs a period >= 1, got {self.period}")

    def prefill_captures(self, input_len: int, reused_len: int, branching_seqlen: int | None, chunk: int) -> list[int]:
        first = (reused_len // self.period + 1) * self.period
        return list(range(first, input_len + 1, self.period))

    def keep_final_state(self) -> bool:
        return True


ADMISSION_NAMES = ("all", "marconi", "periodic:N")


def make_admission(name: str) -> AdmissionPolicy:
    """``all``, ``marconi`` or ``periodic:N`` (N tokens between captured states)."""
    if name == "all":
        return AdmitAll()
    if name == "marconi":
        return MarconiAdmission()
    if name.startswith("periodic"):
        _, _, period = name.partition(":")
        if not period.isdigit():
            raise ValueError(f"admission {name!r}: write periodic:N with N a positive number of tokens")
        return PeriodicAdmission(int(period))
    raise ValueError(f"unknown admission policy {name!r}; choose from {', '.join(ADMISSION_NAMES)}")
