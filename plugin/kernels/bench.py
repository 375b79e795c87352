"""GPU benchmark of the state-tracking kernels: ``python -m hybrid_prefix_cache.kernels.bench``.

Measures achieved memory bandwidth (bytes read + written per second) of our kernels against SGLang's
(``sglang.kernels.ops.mamba.mamba_state_scatter_triton``, when sglang is importable) for batch sizes 1..256 on
the real state shapes of Qwen3-Next-80B-A3B and Nemotron-H-8B:

- ``decode-all-layers``: decode tracking of every layer in one launch (SGLang: ``track_mamba_states_all_layers``);
- ``decode-per-layer``: one launch per layer, as SGLang's Mamba2 backend calls ``track_mamba_states_if_needed``;
- ``slot-copy``: copy-on-write/fork copies across all layers (SGLang's ``MambaPool.copy_from`` indexing path).

Times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``), the way SGLang runs decode, so Python launch
overhead is excluded. Without a CUDA GPU it prints one line and exits with status 0. It is not run in CI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybrid_prefix_cache.kernels.track_state import (
    ROW_BLOCK_BYTES,
    TRITON_AVAILABLE,
    copy_state_slots,
    track_mamba_states_if_needed,
    track_states_decode,
)


@dataclass(frozen=True)
class StateShapes:
    """Per-layer recurrent state of one request, at tensor-parallel size 1, as SGLang 0.5.20 allocates it."""

    name: str
    layers: int
    conv_row: tuple[int, int]
    ssm_row: tuple[int, int, int]
    source: str

    def sharded(self, tp: int) -> StateShapes:
        """Shapes on one of ``tp`` tensor-parallel ranks (SGLang shards the conv dim and the SSM heads)."""
        if tp < 1 or self.conv_row[0] % tp or self.ssm_row[0] % tp:
            raise SystemExit(f"{self.name}: tensor-parallel size {tp} does not divide conv dim and SSM heads")
        if tp == 1:
            return self
        conv = (self.conv_row[0] // tp, self.conv_row[1])
        ssm = (self.ssm_row[0] // tp, self.ssm_row[1], self.ssm_row[2])
        return StateShapes(f"{self.name} (tp={tp})", self.layers, conv, ssm, self.source)

    def row_bytes(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        conv = self.conv_row[0] * self.conv_row[1] * conv_dtype.itemsize
        ssm = self.ssm_row[0] * self.ssm_row[1] * self.ssm_row[2] * ssm_dtype.itemsize
        return conv + ssm


MODELS = {
    # 48 layers, every 4th full attention -> 36 GatedDeltaNet layers. conv dim = 2 x 16 key heads x 128 + 32 value
    # heads x 128 = 8192, window = conv kernel 4 - 1; SSM state = 32 value heads x 128 (v) x 128 (k).
    "qwen3-next-80b-a3b": StateShapes(
        "qwen3-next-80b-a3b",
        36,
        (8192, 3),
        (32, 128, 128),
        "Qwen3-Next-80B-A3B (transformers 5.12.1 Qwen3NextConfig defaults): 48 layers, full_attention_interval 4, "
        "linear_num_key_heads 16, linear_num_value_heads 32, key/value head dim 128, conv kernel 4",
    ),
    # hybrid_override_pattern has 24 'M' (Mamba2) layers of 52. conv dim = 128 heads x 64 + 2 x 8 groups x 128 =
    # 10240; SSM state = 128 heads x 64 (head dim) x 128 (state size).
    "nemotron-h-8b": StateShapes(
        "nemotron-h-8b",
        24,
        (10240, 3),
        (128, 64, 128),
        "Nemotron-H-8B config (SGLang 0.5.20 NemotronHConfig defaults): 24 of 52 layers Mamba2, mamba_num_heads "
        "128, mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv kernel 4",
    ),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Timing:
    microseconds: float
    bytes_moved: int

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.microseconds * 1e-6) / 1e9


def _load_upstream() -> tuple[Callable[..., None] | None, Callable[..., None] | None, str]:
    try:
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (
            track_mamba_states_all_layers,
        )
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (
            track_mamba_states_if_needed as upstream_per_layer,
        )
    except Exception as error:
        return None, None, f"sglang's kernels are not importable ({type(error).__name__}: {error})"
    from importlib import metadata

    return track_mamba_states_all_layers, upstream_per_layer, f"sglang {metadata.version('sglang')}"


def _time(fn: Callable[[], None], bytes_moved: int, rep_ms: int) -> Timing:
    from triton.testing import do_bench_cudagraph

    return Timing(float(do_bench_cudagraph(fn, rep=rep_ms)) * 1e3, bytes_moved)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def _fill(tensors: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, device=t.device))


Upstream = tuple[Callable[..., None] | None, Callable[..., None] | None]


def _operations(
    model: StateShapes,
    batch: int,
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
    row_block_bytes: int,
    upstream: Upstream,
    device: str,
) -> tuple[list[tuple[str, Callable[[], None], Callable[[], None] | None]], list[torch.Tensor], list[torch.Tensor]]:
    """(label, ours, reference) per operation, plus our pool and the reference's identical copy of it."""
    upstream_all, upstream_per_layer = upstream
    slots = 2 * batch + 1
    conv = torch.empty((model.layers, slots, *model.conv_row), dtype=conv_dtype, device=device)
    ssm = torch.empty((model.layers, slots, *model.ssm_row), dtype=ssm_dtype, device=device)
    _fill([conv, ssm], seed=batch)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    # Working slots 0..batch-1 are tracked into slots batch..2*batch-1, every request masked in.
    cache = torch.arange(batch, device=device, dtype=torch.int32)
    track = torch.arange(batch, 2 * batch, device=device, dtype=torch.int64)
    mask = torch.ones(batch, dtype=torch.bool, device=device)

    def ours_all() -> None:
        track_states_decode(conv, ssm, cache, mask, track, check_indices=False, row_block_bytes=row_block_bytes)

    def ours_per_layer() -> None:
        for layer in range(model.layers):
            track_mamba_states_if_needed(conv[layer], ssm[layer], cache, mask, track, batch, check_indices=False)

    def ours_copy() -> None:
        copy_state_slots(conv, ssm, cache, track, check_indices=False, row_block_bytes=row_block_bytes)

    def torch_copy() -> None:
        conv_ref[:, track] = conv_ref[:, cache.long()]
        ssm_ref[:, track] = ssm_ref[:, cache.long()]

    up_all = up_per_layer = None
    if upstream_all is not None and upstream_per_layer is not None:

        def up_all() -> None:
            upstream_all(conv_ref, ssm_ref, cache, mask, track, batch)

        def up_per_layer() -> None:
            for layer in range(model.layers):
                upstream_per_layer(conv_ref[layer], ssm_ref[layer], cache, mask, track, batch)

    operations = [
        ("decode-all-layers", ours_all, up_all),
        ("decode-per-layer", ours_per_layer, up_per_layer),
        ("slot-copy (vs torch indexing)", ours_copy, torch_copy),
    ]
    return operations, [conv, ssm], [conv_ref, ssm_ref]


def bench_model(
    model: StateShapes,
    batch_sizes: list[int],
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
    row_block_bytes: int,
    rep_ms: int,
    budget_bytes: int,
    upstream: Upstream,
    *,
    device: str = "cuda",
    timer: Callable[[Callable[[], None], int, int], Timing] | None = None,
) -> None:
    """Print one line per (batch size, operation); ``device``/``timer`` exist so tests can drive it on a CPU."""
    timer = timer or _time
    row_bytes = model.row_bytes(conv_dtype, ssm_dtype)
    print(
        f"\n{model.name}: {model.layers} state layers, conv {model.conv_row} {conv_dtype}, ssm {model.ssm_row} "
        f"{ssm_dtype}, {row_bytes * model.layers / 2**20:.1f} MiB of state per request\n  ({model.source})"
    )
    for batch in batch_sizes:
        slots = 2 * batch + 1
        pool_bytes = 2 * slots * model.layers * row_bytes
        if pool_bytes > budget_bytes:
            print(f"  bs={batch:4d}: skipped, two pools of {slots} slots need {pool_bytes / 2**30:.1f} GiB")
            continue
        operations, ours_pool, reference_pool = _operations(
            model, batch, conv_dtype, ssm_dtype, row_block_bytes, upstream, device
        )
        moved = 2 * batch * model.layers * row_bytes
        for label, ours, theirs in operations:
            ours()
            if theirs is not None:
                theirs()
                if device == "cuda":
                    torch.cuda.synchronize()
                if not _same(ours_pool, reference_pool):
                    raise SystemExit(f"{model.name} bs={batch} {label}: results differ from the reference; not timing")
            mine = timer(ours, moved, rep_ms)
            line = f"  bs={batch:4d} {label:30s} ours {mine.microseconds:9.1f} us {mine.gbps:7.1f} GB/s"
            if theirs is not None:
                other = timer(theirs, moved, rep_ms)
                line += (
                    f" | reference {other.microseconds:9.1f} us {other.gbps:7.1f} GB/s"
                    f" | speedup {other.microseconds / mine.microseconds:5.2f}x"
                )
            print(line, flush=True)
        del operations, ours_pool, reference_pool
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GPU benchmark of the state-tracking kernels (GB/s, ours vs SGLang)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--conv-dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--ssm-dtype", choices=sorted(DTYPES), default="float32", help="SGLang's default is float32")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: benchmark one rank's shard")
    parser.add_argument("--row-block-bytes", type=int, default=ROW_BLOCK_BYTES)
    parser.add_argument("--rep-ms", type=int, default=100, help="measuring time per point (ms)")
    parser.add_argument(
        "--memory-fraction", type=float, default=0.8, help="largest share of free GPU memory the pools may take"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("state-tracking kernel benchmark: no CUDA GPU found, nothing to measure (it needs a GPU)")
        return 0
    print("benchmark: state-tracking kernels, achieved GB/s (bytes read + written), ours vs SGLang 0.5.20's")
    if not TRITON_AVAILABLE:
        print("triton is not installed: install hybrid-prefix-cache[kernels] to benchmark the kernels")
        return 1
    *upstream, description = _load_upstream()
    if upstream[0] is None:
        print(f"{description}: benchmarking ours alone (install sglang==0.5.20 to compare)")
    else:
        print(f"comparing against {description}")
    free, _ = torch.cuda.mem_get_info()
    print(f"device: {torch.cuda.get_device_name()}, {free / 2**30:.1f} GiB free")
    for name in args.models:
        bench_model(
            MODELS[name].sharded(args.tp),
            args.batch_sizes,
            DTYPES[args.conv_dtype],
            DTYPES[args.ssm_dtype],
            args.row_block_bytes,
            args.rep_ms,
            int(free * args.memory_fraction),
            (upstream[0], upstream[1]),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
