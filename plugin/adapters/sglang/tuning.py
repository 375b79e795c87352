"""Online alpha tuning for a FLOP-aware backend running inside an engine.

:class:`~hybrid_prefix_cache.policies.tuning.AlphaTuner` needs ``evaluate(alpha, window)``: the token hits a cache
of the engine's size would have had on a window of past requests with that alpha. Here that is a replay of the
window through the trace simulator's cache (the same tree, admission and eviction policy) with the engine's KV
and state capacities. Requests are numbered in finish order and that number is their arrival time, so every
tensor-parallel rank, seeing the same requests, tunes to the same alpha (their trees must stay identical).
This module imports no engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid_prefix_cache.bench.sim import CacheSimulator, MemoryModel, SimSettings
from hybrid_prefix_cache.bench.traces import Request
from hybrid_prefix_cache.cost_model import ModelSpec
from hybrid_prefix_cache.policies.admission import AdmissionPolicy
from hybrid_prefix_cache.policies.tuning import AlphaTuner
from hybrid_prefix_cache.registry import Backend

from .settings import PrefixCacheSettings


class ShadowAlphaTuning:
    """Feeds finished requests to an :class:`AlphaTuner` and applies its choices to ``eviction.alpha``.

    ``eviction.alpha`` starts at ``settings.alpha`` and follows the tuner from its first tuning on (the tuner
    keeps 0, plain LRU, unless another value strictly wins on the window).
    """

    def __init__(
        self,
        eviction: object,
        *,
        backend: Backend,
        admission: AdmissionPolicy,
        spec: ModelSpec,
        settings: PrefixCacheSettings,
        kv_capacity: int,
        state_capacity: int,
        page_size: int,
        state_chunk_size: int,
    ) -> None:
        self.eviction = eviction
        self.backend = backend
        self.admission = admission
        self.spec = spec
        budget = kv_capacity * spec.kv_bytes_per_token + state_capacity * spec.state_bytes
        self.memory = MemoryModel("split", spec.kv_bytes_per_token, spec.state_bytes, kv_capacity, state_capacity,
                                  budget, page_size)
        self.sim_settings = SimSettings(chunk=state_chunk_size)
        self.tuner: AlphaTuner[Request] = AlphaTuner(
            self.shadow_hits, grid=settings.alpha_grid, window=settings.tuning_window,
            retune_every=settings.retune_interval,
        )
        eviction.alpha = settings.alpha
        self._finished = 0

    def observe(self, input_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self._finished += 1
        request = Request(f"request-{self._finished}", 0, float(self._finished), tuple(input_ids), tuple(output_ids))
        tunings = len(self.tuner.history)
        self.tuner.observe(request)
        if len(self.tuner.history) > tunings:
            self.eviction.alpha = self.tuner.alpha

    def shadow_hits(self, alpha: float, window: Sequence[Request]) -> float:
        """Token hits of ``window`` replayed through a fresh simulated cache of the engine's size."""
        shadow = CacheSimulator(self.spec, self.memory, self.admission,
                                lambda value: self.backend.make_eviction(self.spec, value),
                                settings=self.sim_settings, alpha=alpha)
        return float(shadow.run(list(window)).reused_tokens)

    @property
    def history(self) -> list:
        return self.tuner.history
