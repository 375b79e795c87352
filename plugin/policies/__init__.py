"""Cache policies that plug into :class:`hybrid_prefix_cache.core.HybridRadixTree`.

- :class:`FlopAwareEviction`: Marconi's FLOP-aware eviction (recency + alpha x FLOPs saved per byte), with
  bucketed candidates so that a pick costs O(B + log n) rather than a rescoring of every candidate.
- :class:`AlphaTuner`: re-tunes alpha online over a sliding window of requests, keeping alpha at 0 (plain LRU)
  unless a tuned alpha wins on the same window.

``docs/policies.md`` describes the algorithms and their costs.
"""

from hybrid_prefix_cache.policies.eviction import CostSpec, FlopAwareEviction
from hybrid_prefix_cache.policies.tuning import DEFAULT_ALPHA_GRID, AlphaTuner, TuningRecord

__all__ = ["DEFAULT_ALPHA_GRID", "AlphaTuner", "CostSpec", "FlopAwareEviction", "TuningRecord"]
