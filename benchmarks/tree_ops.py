"""Core micro-benchmark: per-operation cost of match, insert and evict at 1e3, 1e4 and 1e5 cached nodes.

Run: .venvs/core/bin/python benchmarks/tree_ops.py [--sizes 1000,10000,100000] [--ops 2000]

The tree is filled with N leaves under a shared 3-level prefix fan-out (keys of 64 tokens, each node holding
its own state), then each operation is timed over ``--ops`` calls on that tree; evictions refill what they free
so the tree stays at N nodes.
"""

from __future__ import annotations

import argparse
import random
import time

from hybrid_prefix_cache.core import HybridRadixTree


class Pools:
    def free_kv(self, kv) -> None:
        pass

    def free_state(self, state) -> None:
        pass


def build_tree(num_leaves: int, rng: random.Random) -> tuple[HybridRadixTree, list[tuple[int, ...]]]:
    tree = HybridRadixTree(Pools())
    keys = []
    for i in range(num_leaves):
        key = (i % 7, i % 61, i % 997, *(rng.randrange(50_000) for _ in range(61)))
        keys.append(key)
        tree.insert(key, range(len(key)), state=i)
    return tree, keys


def time_ops(tree: HybridRadixTree, keys: list, rng: random.Random, ops: int) -> dict[str, float]:
    probes = [rng.choice(keys) for _ in range(ops)]
    start = time.perf_counter()
    for key in probes:
        tree.match(key, record=False)
    match_us = (time.perf_counter() - start) / ops * 1e6
    fresh = [(*key[:3], *(rng.randrange(50_000, 90_000) for _ in range(61))) for key in probes]
    start = time.perf_counter()
    for i, key in enumerate(fresh):
        tree.insert(key, range(len(key)), state=-i - 1)
    insert_us = (time.perf_counter() - start) / ops * 1e6
    start = time.perf_counter()
    for _ in range(ops):
        tree.evict_tokens(1)
    evict_us = (time.perf_counter() - start) / ops * 1e6
    start = time.perf_counter()
    for _ in range(ops):
        tree.evict_states(1)
    evict_state_us = (time.perf_counter() - start) / ops * 1e6
    return {"match": match_us, "insert": insert_us, "evict_tokens": evict_us, "evict_states": evict_state_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--ops", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"{'cached nodes':>13}{'match us':>11}{'insert us':>11}{'evict tok us':>14}{'evict state us':>16}")
    for size in (int(s) for s in args.sizes.split(",")):
        tree, keys = build_tree(size, rng)
        nodes = tree.num_nodes
        result = time_ops(tree, keys, rng, args.ops)
        print(f"{nodes:>13,}{result['match']:>11.1f}{result['insert']:>11.1f}{result['evict_tokens']:>14.1f}"
              f"{result['evict_states']:>16.1f}")


if __name__ == "__main__":
    main()
