"""Benchmark tooling: request traces and the A/B replay of prefix-cache backends."""
