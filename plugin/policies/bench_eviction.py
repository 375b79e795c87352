"""Micro-benchmark: what one eviction costs at 1e3, 1e4 and 1e5 candidates, for LRU, the bucketed FLOP-aware
policy and Marconi's own method (rescoring every candidate on every eviction).

    python -m hybrid_prefix_cache.policies.bench_eviction [--sizes 1000 10000 100000] [--buckets 64]

The tree holds groups of ``GROUP`` leaves under a shared prefix that keeps a state (a branch point), so a tree
with n candidate leaves has n / GROUP more nodes. Prefix and leaf lengths are random, which spreads the leaves
over many efficiency buckets. Each figure is the mean wall time of one call, in microseconds: ``insert`` and
``match`` show what observing the tree costs the policy (a match's share of the next pick included), the three
``evict_*`` columns one eviction of one victim, the tree's own work included.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Callable, Iterator

from hybrid_prefix_cache.core import HybridRadixTree, LRUEviction, Node
from hybrid_prefix_cache.cost_model import BUNDLED_MODELS, ModelSpec, load_model_spec
from hybrid_prefix_cache.policies.eviction import DEFAULT_BUCKETS, FlopAwareEviction

GROUP = 8
DEFAULT_SIZES = (1_000, 10_000, 100_000)


class _DiscardingAllocator:
    """The tree's slot allocator for a benchmark that never reuses slots."""

    def free_kv(self, kv: object) -> None:
        return None

    def free_state(self, state: object) -> None:
        return None


class RescoringEviction:
    """Marconi's eviction as the paper runs it: score every candidate on every pick (O(n) per eviction).

    Same candidates, recency and efficiency as :class:`FlopAwareEviction` without its buckets; it serves as the
    cost baseline here only.
    """

    observes_nodes = False

    def __init__(self, spec: ModelSpec, alpha: float) -> None:
        self._scorer = FlopAwareEviction(spec, alpha)
        self.alpha = alpha

    def attach(self, tree: HybridRadixTree) -> None:
        self._tree = tree

    def node_changed(self, node: Node) -> None:
        return None

    def node_removed(self, node: Node) -> None:
        return None

    def _nodes(self) -> Iterator[Node]:
        stack = list(self._tree.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _lowest_utility(self, candidates: list[tuple[Node, int]]) -> Node | None:
        if not candidates:
            return None
        efficiencies = [self._scorer.efficiency_of(node) for node, _ in candidates]
        oldest = min(recency for _, recency in candidates)
        recency_span = max(recency for _, recency in candidates) - oldest
        least = min(efficiencies)
        efficiency_span = max(efficiencies) - least
        best, best_utility = None, 0.0
        for (node, recency), efficiency in zip(candidates, efficiencies, strict=True):
            utility = (recency - oldest) / recency_span if recency_span else 0.0
            if efficiency_span:
                utility += self.alpha * (efficiency - least) / efficiency_span
            if best is None or utility < best_utility:
                best, best_utility = node, utility
        return best

    def pick_leaf(self) -> Node | None:
        return self._lowest_utility(
            [(node, node.last_access) for node in self._nodes() if not node.full_lock and not node.children]
        )

    def pick_state(self) -> Node | None:
        free = [node for node in self._nodes() if node.state is not None and not node.state_lock]
        narrow = [(node, node.state_access) for node in free if len(node.children) <= 1]
        return self._lowest_utility(narrow or [(node, node.state_access) for node in free])

    def pick_victim(self) -> Node | None:
        candidates = []
        for node in self._nodes():
            if not node.full_lock and not node.children:
                candidates.append((node, min(node.last_access, node.state_access)))
            elif node.state is not None and not node.state_lock and len(node.children) <= 1:
                candidates.append((node, node.state_access))
        return self._lowest_utility(candidates) or self.pick_state()


def _build_keys(num_leaves: int, seed: int) -> list[tuple[tuple[int, ...], list[tuple[int, ...]]]]:
    """Groups of a shared prefix and GROUP leaf keys; token ids are small so that tuples share int objects."""
    rng = random.Random(seed)
    groups = []
    for group in range(max(1, num_leaves // GROUP)):
        prefix = (1000 + group, *([7] * rng.randrange(16, 512)))
        leaves = [(*prefix, 500 + leaf, *([3] * rng.randrange(0, 48))) for leaf in range(GROUP)]
        groups.append((prefix, leaves))
    return groups


def _timed(calls: int, action: Callable[[], object], settle: Callable[[], object] | None = None) -> float:
    """Mean microseconds per call of ``action``; ``settle`` runs once inside the timing, after the calls."""
    gc.collect()
    start = time.process_time()
    for _ in range(calls):
        action()
    if settle is not None:
        settle()
    return (time.process_time() - start) / calls * 1e6


def measure(policy_name: str, spec: ModelSpec, num_leaves: int, evictions: int, alpha: float, buckets: int) -> dict:
    if policy_name == "lru":
        policy = LRUEviction()
    elif policy_name == "flop-aware":
        policy = FlopAwareEviction(spec, alpha, buckets)
    else:
        policy = RescoringEviction(spec, alpha)
    tree = HybridRadixTree(_DiscardingAllocator(), eviction=policy, state_chunk_size=0)
    groups = _build_keys(num_leaves, seed=num_leaves)
    slots = iter(range(1 << 62))
    next_state = 0
    inserts = 0
    start = time.process_time()
    for prefix, leaves in groups:
        for key in (prefix, *leaves):
            first = next(slots)
            tree.insert(key, range(first, first + len(key)), next_state)
            next_state += 1
            inserts += 1
    for pick in (policy.pick_leaf, policy.pick_state, policy.pick_victim):
        pick()  # the first picks settle what the inserts left for them: that work is the inserts'
    insert_us = (time.process_time() - start) / inserts * 1e6
    rng = random.Random(1)
    all_leaves = [leaf for _, leaves in groups for leaf in leaves]
    # FlopAwareEviction re-reads the states a match touched at its next pick: that work is the match's.
    settle = policy.pick_victim if isinstance(policy, FlopAwareEviction) else None
    match_us = _timed(evictions, lambda: tree.match(rng.choice(all_leaves), record=False), settle)
    figures = {"candidates": len(all_leaves), "insert": insert_us, "match": match_us}
    figures["evict_tokens"] = _timed(evictions, lambda: tree.evict_tokens(1))
    figures["evict_states"] = _timed(evictions, lambda: tree.evict_states(1))
    kv_bytes, state_bytes = spec.kv_bytes_per_token, spec.state_bytes
    figures["evict_memory"] = _timed(evictions, lambda: tree.evict_memory(1, kv_bytes, state_bytes))
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="candidate leaves")
    parser.add_argument("--evictions", type=int, default=2000, help="timed calls per operation")
    parser.add_argument("--rescoring-evictions", type=int, default=20, help="timed calls for the O(n) baseline")
    parser.add_argument("--model", default="paper-7b", help=f"one of {', '.join(BUNDLED_MODELS)} or a config path")
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--buckets", type=int, default=DEFAULT_BUCKETS)
    args = parser.parse_args(argv)
    for size in args.sizes:
        if size < GROUP:
            parser.error(f"--sizes: every size must be at least {GROUP}, got {size}")
    spec = load_model_spec(args.model)
    print(f"model {spec.name}, alpha {args.alpha}, {args.buckets} buckets; mean microseconds per call")
    header = ("candidates", "policy", "insert", "match", "evict_tokens", "evict_states", "evict_memory")
    print(f"{header[0]:>10}  {header[1]:<12}" + "".join(f"{name:>14}" for name in header[2:]))
    for size in args.sizes:
        for policy_name in ("lru", "flop-aware", "rescoring"):
            calls = args.rescoring_evictions if policy_name == "rescoring" else args.evictions
            figures = measure(policy_name, spec, size, min(calls, size // 4), args.alpha, args.buckets)
            print(
                f"{figures['candidates']:>10}  {policy_name:<12}"
                + "".join(f"{figures[name]:>14.1f}" for name in header[2:])
            )


if __name__ == "__main__":
    main()
