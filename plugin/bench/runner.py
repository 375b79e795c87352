"""Runs the A/B benchmark: every (backend, cache size) pair over one trace, and reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_prefix_cache.bench.sim import BASELINES, SimResult, SimSettings, build_simulator, trace_order_ttfts
from hybrid_prefix_cache.bench.traces import Request, export_trace, load_trace
from hybrid_prefix_cache.cost_model import ModelSpec, load_model_spec

GB = 1 << 30
RECORD_KEYS = ("backend", "cache_gb", "token_hit_rate", "state_hit_rate", "flops_saved", "prefill_tokens_computed",
               "ttft_p50_ms", "ttft_p95_ms")


@dataclass(frozen=True)
class BenchOptions:
    trace: str = "default"
    model: str = "paper-7b"
    cache_gb: list[float] = field(default_factory=lambda: [1.0, 2.0, 5.0])
    backends: list[str] = field(default_factory=lambda: ["mamba-radix", "marconi"])
    engine: str = "sim"
    layout: str = "vllm"
    seed: int = 0
    overlap: bool = False
    vllm_block_align: int = 16
    max_in_flight: int | None = None
    progress: bool = True


@dataclass
class BenchReport:
    options: BenchOptions
    spec: ModelSpec
    requests: list[Request]
    records: list[dict]

    def table(self) -> str:
        sizes = sorted({r["cache_gb"] for r in self.records})
        backends = list(dict.fromkeys(r["backend"] for r in self.records))
        by_key = {(r["backend"], r["cache_gb"]): r for r in self.records}
        head = f"token hit rate (%), trace={self.options.trace}, model={self.spec.name}, engine={self.options.engine}"
        if self.options.engine == "sim":
            head += f", our backends in {self.options.layout!r} memory"
        lines = [head, f"{'backend':<16}" + "".join(f"{f'{gb:g} GB':>10}" for gb in sizes)]
        for backend in backends:
            cells = []
            for gb in sizes:
                record = by_key.get((backend, gb))
                cells.append(f"{100 * record['token_hit_rate']:>10.1f}" if record else f"{'-':>10}")
            lines.append(f"{backend:<16}" + "".join(cells))
        lines.append("")
        lines.append(f"{'backend':<16}{'GB':>6}{'state hit':>11}{'TTFT p50':>11}{'TTFT p95':>11}{'prefill tok':>13}"
                     f"{'too large':>11}")
        for record in self.records:
            lines.append(
                f"{record['backend']:<16}{record['cache_gb']:>6g}{_percent(record['state_hit_rate']):>11}"
                f"{record['ttft_p50_ms']:>9.0f}ms{record['ttft_p95_ms']:>9.0f}ms{record['prefill_tokens_computed']:>13,}"
                f"{record.get('rejected_requests', 0):>11,}"
            )
        lines.append("too large: requests that could not fit in the cache even after evicting everything (misses)")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4.5))
        for backend in dict.fromkeys(r["backend"] for r in self.records):
            points = sorted((r["cache_gb"], 100 * r["token_hit_rate"]) for r in self.records if r["backend"] == backend)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=backend)
        axis.set_xlabel("cache size (GB)")
        axis.set_ylabel("token hit rate (%)")
        axis.set_title(f"{self.options.trace} trace, {self.spec.name}, engine={self.options.engine}")
        axis.grid(alpha=0.3)
        axis.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)


def _sim_records(options: BenchOptions, spec: ModelSpec, requests: list[Request]) -> list[dict]:
    settings = SimSettings(overlap=options.overlap, max_in_flight=options.max_in_flight)
    bar = _progress(len(requests) * len(options.backends) * len(options.cache_gb), options.progress)
    records = []
    try:
        for backend in options.backends:
            for gb in options.cache_gb:
                if bar is not None:
                    bar.set_description(f"{backend} @ {gb:g} GB")
                simulator = build_simulator(backend, spec, int(gb * GB), layout=options.layout, settings=settings,
                                            vllm_block_align=options.vllm_block_align)
                result = simulator.run(requests, progress=bar.update if bar is not None else None)
                records.append({
                    "backend": backend,
                    "cache_gb": gb,
                    "memory_layout": simulator.memory.layout,
                    "token_hit_rate": result.token_hit_rate,
                    "state_hit_rate": result.state_hit_rate,
                    "flops_saved": result.flops_saved,
                    "prefill_tokens_computed": result.prefill_tokens_computed,
                    "ttft_p50_ms": result.ttft_percentile_ms(0.50),
                    "ttft_p95_ms": result.ttft_percentile_ms(0.95),
                    "request_hit_rate": result.request_hit_rate,
                    "rejected_requests": result.rejected_requests,
                    "alpha_history": [[record.request_index, record.alpha] for record in result.alpha_history],
                })
    finally:
        if bar is not None:
            bar.close()
    return records


def engine_python(engine: str) -> str:
    """The interpreter of the engine's environment: $HPC_<ENGINE>_PYTHON or .venvs/<engine> of this checkout."""
    configured = os.environ.get(f"HPC_{engine.upper()}_PYTHON")
    if configured:
        return configured
    candidate = Path(__file__).resolve().parents[2] / ".venvs" / engine / "bin" / "python"
    if not candidate.exists():
        raise FileNotFoundError(
            f"--engine {engine} needs the {engine} environment: run scripts/setup_env.sh {engine} in the "
            f"hybrid-prefix-cache checkout, or set HPC_{engine.upper()}_PYTHON to its python"
        )
    return str(candidate)


# The engine's own default cache in each engine replay, under the name of the simulator baseline that models
# it; our backends keep their names. The vLLM replay calls vLLM's own cache "vllm".
ENGINE_DEFAULT_BACKEND = {"sglang": "upstream-mamba", "vllm": "vllm-align"}
_VLLM_REPLAY_DEFAULT = "vllm"


def _engine_command(options: BenchOptions, spec: ModelSpec, trace_path: str, out_path: str) -> list[str]:
    python = engine_python(options.engine)
    sizes = ",".join(f"{gb:g}" for gb in options.cache_gb)
    common = ["--trace-jsonl", trace_path, "--cache-gb", sizes, "--json", out_path, "--per-request"]
    if options.engine == "sglang":
        return [python, "-m", "hybrid_prefix_cache.bench.engines.sglang_replay", *common,
                "--kv-bytes-per-token", str(spec.kv_bytes_per_token), "--state-bytes", str(spec.state_bytes),
                "--page-size", "1", "--backends", ",".join(options.backends), "--model", options.model]
    backends = [_VLLM_REPLAY_DEFAULT if name == ENGINE_DEFAULT_BACKEND["vllm"] else name for name in options.backends]
    config = engine_model_config(options.model)
    return [python, "-m", "hybrid_prefix_cache.bench.engines.vllm_backend_replay", *common, "--model-config", config,
            "--mamba-ssm-cache-dtype", "float16", "--backends", ",".join(backends)]


def engine_model_config(model: str) -> str:
    """A config.json the engine can instantiate: the bundled engine form of a bundled model, or the given path."""
    bundled = Path(__file__).resolve().parents[1] / "models" / "engine" / f"{model}.json"
    if bundled.exists():
        return str(bundled)
    if Path(model).exists():
        return model
    raise ValueError(f"--engine vllm needs a config.json vLLM can instantiate; {model!r} has no bundled engine form "
                     f"(bundled: paper-7b); pass a config.json path")


def _engine_records(options: BenchOptions, spec: ModelSpec, requests: list[Request]) -> list[dict]:
    """Runs the engine's real cache code model-free in its environment, one process for all sizes and backends:
    the engine's own default (under its baseline's name) and our backends plugged in."""
    default = ENGINE_DEFAULT_BACKEND[options.engine]
    other_baselines = [name for name in options.backends if name in BASELINES and name != default]
    if other_baselines:
        raise ValueError(f"--engine {options.engine} runs its own cache as {default} and our backends; "
                         f"not available there: {', '.join(other_baselines)} (a baseline of the other engine)")
    by_turn = {(r.session_id, r.turn_id): r for r in requests}
    settings = SimSettings()
    with tempfile.TemporaryDirectory(prefix="hpc-bench-") as workdir:
        trace_path = os.path.join(workdir, "trace.jsonl")
        out_path = os.path.join(workdir, "out.json")
        export_trace(requests, trace_path)
        subprocess.run(_engine_command(options, spec, trace_path, out_path), check=True)
        with open(out_path, encoding="utf-8") as handle:
            runs = json.load(handle)["runs"]
    records = []
    for run in runs:
        hits = [(by_turn[(row["session_id"], row["turn_id"])],
                 row.get("hit_tokens", row.get("cached_tokens"))) for row in run["per_request"]]
        ttfts = trace_order_ttfts(hits, spec, settings)
        result = SimResult(requests=len(hits), input_tokens=run["prompt_tokens"], reused_tokens=run["cached_tokens"],
                           prefill_tokens_computed=run["prompt_tokens"] - run["cached_tokens"], ttft_s=ttfts,
                           flops_saved=sum(spec.flops_saved(hit) for _, hit in hits))
        backend = run.get("backend") or default
        records.append({
            "backend": default if backend in (_VLLM_REPLAY_DEFAULT, default) else backend,
            "cache_gb": run["cache_bytes"] / GB,
            "token_hit_rate": run["token_hit_rate"],
            "state_hit_rate": None,
            "flops_saved": result.flops_saved,
            "prefill_tokens_computed": result.prefill_tokens_computed,
            "ttft_p50_ms": result.ttft_percentile_ms(0.50),
            "ttft_p95_ms": result.ttft_percentile_ms(0.95),
            "request_hit_rate": run["request_hit_rate"],
            "engine_run": {key: value for key, value in run.items() if key != "per_request"},
        })
    return records


def run_bench(options: BenchOptions) -> BenchReport:
    from hybrid_prefix_cache.registry import resolve_backend

    for name in options.backends:
        if name not in BASELINES:
            resolve_backend(name)
    spec = load_model_spec(options.model)
    requests = load_trace(options.trace, seed=options.seed) if options.trace in ("sharegpt", "agentic",
                                                                                  "shared-prompt") \
        else load_trace(options.trace)
    if options.engine == "sim":
        records = _sim_records(options, spec, requests)
    else:
        records = _engine_records(options, spec, requests)
    return BenchReport(options, spec, requests, records)
