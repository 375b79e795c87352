"""Hit and eviction statistics of one cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class CacheStats:
    """Counters updated by recorded matches and by evictions.

    - request hit rate: recorded matches that reused at least one token / recorded matches;
    - token reuse rate: reused tokens / requested tokens;
    - state hit rate: of the recorded matches whose KV matched at least one page, the fraction that also found
      a state to resume from (the rest matched KV the model cannot use);
    - flops_saved: the caller's cost model applied to each reused prefix length.
    """

    requests: int = 0
    hit_requests: int = 0
    requested_tokens: int = 0
    reused_tokens: int = 0
    kv_matched_requests: int = 0
    state_hits: int = 0
    tokens_evicted: int = 0
    states_evicted: int = 0
    flops_saved: float = 0.0

    def record_match(
        self, requested: int, reused: int, kv_matched: int, flops_saved: Callable[[int], float] | None
    ) -> None:
        self.requests += 1
        self.requested_tokens += requested
        self.reused_tokens += reused
        if reused > 0:
            self.hit_requests += 1
            self.state_hits += 1
            if flops_saved is not None:
                self.flops_saved += flops_saved(reused)
        if kv_matched > 0:
            self.kv_matched_requests += 1

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0

    @property
    def token_reuse_rate(self) -> float:
        return self.reused_tokens / self.requested_tokens if self.requested_tokens else 0.0

    @property
    def state_hit_rate(self) -> float:
        return self.state_hits / self.kv_matched_requests if self.kv_matched_requests else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = asdict(self)
        out["request_hit_rate"] = self.request_hit_rate
        out["token_reuse_rate"] = self.token_reuse_rate
        out["state_hit_rate"] = self.state_hit_rate
        return out
