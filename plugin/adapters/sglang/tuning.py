"""Online alpha tuning for a FLOP-aware backend running inside an engine, as the trace simulator tunes.

:class:`~hybrid_prefix_cache.policies.tuning.AlphaTuner` compares alphas on a window of recent requests. Here, as in
:class:`~hybrid_prefix_cache.bench.sim.CacheSimulator`, every grid alpha has a persistent shadow cache: a simulated
cache with the engine's KV and state capacities and the backend's policies, fed every request the engine finishes;
an alpha's score is its shadow's token hits over the window. Requests are numbered in finish order and that number
is their arrival time, so every tensor-parallel rank, seeing the same requests, tunes to the same alpha (their
trees must stay identical). This module imports no engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from hybrid_prefix_cache.bench.sim import CacheSimulator, MemoryModel, SimSettings
from hybrid_prefix_cache.bench.traces import Request
from hybrid_prefix_cache.cost_model import ModelSpec
from hybrid_prefix_cache.policies.admission import AdmissionPolicy
from hybrid_prefix_cache.policies.tuning import AlphaTuner
from hybrid_prefix_cache.registry import Backend

from .settings import PrefixCacheSettings


class ShadowAlphaTuning:
    """Feeds finished requests to the shadow caches and the tuner and applies its choices to ``eviction.alpha``.

    ``eviction.alpha`` starts at ``settings.alpha`` and follows the tuner from its first tuning on (the tuner keeps
    0, plain LRU, unless another value beats it by ``settings.relative_margin``).
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
        budget = kv_capacity * spec.kv_bytes_per_token + state_capacity * spec.state_bytes
        memory = MemoryModel("split", spec.kv_bytes_per_token, spec.state_bytes, kv_capacity, state_capacity,
                             budget, page_size)
        self.tuner: AlphaTuner[Request] = AlphaTuner(
            self._window_hits, grid=settings.alpha_grid, window=settings.tuning_window,
            retune_every=settings.retune_every, relative_margin=settings.relative_margin,
        )
        simulated = SimSettings(chunk=state_chunk_size)
        self.shadows = {
            alpha: CacheSimulator(spec, memory, admission, lambda value: backend.make_eviction(spec, value),
                                  settings=simulated, alpha=alpha)
            for alpha in self.tuner.grid
        }
        self._hits = {alpha: deque(maxlen=settings.tuning_window) for alpha in self.tuner.grid}
        eviction.alpha = settings.alpha
        self._finished = 0

    def observe(self, input_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self._finished += 1
        request = Request(f"request-{self._finished}", 0, float(self._finished), tuple(input_ids), tuple(output_ids))
        for alpha, shadow in self.shadows.items():
            self._hits[alpha].append(shadow.run([request]).reused_tokens)
        tunings = len(self.tuner.history)
        self.tuner.observe(request)
        if len(self.tuner.history) > tunings:
            self.eviction.alpha = self.tuner.alpha

    def _window_hits(self, alpha: float, window: Sequence[Request]) -> float:
        return float(sum(self._hits[alpha]))

    @property
    def history(self) -> list:
        return self.tuner.history
