"""Compile the Triton kernels for NVIDIA GPUs without a GPU: ``python -m hybrid_prefix_cache.kernels.compile_check``.

The Triton interpreter accepts programs the GPU compiler rejects (and the reverse), so this compiles every kernel
variant the package launches (state dtypes, casts, row layouts, masks) through Triton's full pipeline down to a
cubin with the ``ptxas`` bundled in the triton wheel. It also reports whether the copies compiled to 16-byte
vector loads and stores and whether any shared memory is used (a plain copy needs none). It runs nothing on a
GPU. It needs ``TRITON_INTERPRET`` unset, because interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass

import torch

from hybrid_prefix_cache.kernels.plans import plan_conv_extend, plan_decode_tracking, plan_slot_copy, plan_ssm_extend
from hybrid_prefix_cache.kernels.track_state import (
    TRITON_AVAILABLE,
    KernelLaunch,
    conv_window_launch,
    row_copy_launch,
)


@dataclass(frozen=True)
class CompileReport:
    variant: str
    arch: int
    vector_loads: int
    vector_stores: int
    shared_bytes: int


def _pool(layers: int, slots: int, row: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((layers, slots, *row), dtype=dtype)


def _variants() -> list[tuple[str, KernelLaunch | None]]:
    """Representative launches, labelled; pools have few layers and slots but the real row shapes."""
    slots = torch.tensor([0, 1])
    targets = torch.tensor([2, 3])
    mask = torch.tensor([True, True])
    qwen_conv, qwen_ssm = (8192, 3), (32, 128, 128)
    variants: list[tuple[str, KernelLaunch | None]] = []

    conv, ssm = _pool(2, 5, qwen_conv, torch.bfloat16), _pool(2, 5, qwen_ssm, torch.float32)
    plan = plan_decode_tracking([conv], ssm, slots, mask, targets, None, skip_negative_slots=True, check_indices=True)
    variants.append(("decode tracking, Qwen3-Next rows (bf16 conv, fp32 ssm)", row_copy_launch(plan)))

    conv_a = _pool(2, 5, (6144, 3), torch.float16)
    conv_b = _pool(2, 5, (3, 2048), torch.float16).transpose(2, 3)
    ssm = _pool(5, 2, (16, 64, 128), torch.bfloat16).transpose(0, 1)
    plan = plan_decode_tracking(
        [conv_a, conv_b], ssm, slots, mask, targets, None, skip_negative_slots=False, check_indices=True
    )
    variants.append(("decode tracking, two conv tensors, transposed rows and slots", row_copy_launch(plan)))

    conv, ssm = _pool(2, 5, (10240, 3), torch.bfloat16), _pool(2, 5, (128, 64, 128), torch.float16)
    plan = plan_slot_copy(
        [conv], ssm, slots, slots, dst_conv_states=[conv.clone()], dst_temporal_states=ssm.clone(), check_indices=True
    )
    variants.append(("slot copy into another pool (bf16 conv, fp16 ssm)", row_copy_launch(plan)))

    for h_dtype, ssm_dtype in [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.bfloat16),
        (torch.bfloat16, torch.float16),
        (torch.float32, torch.float16),
        (torch.float16, torch.float32),
    ]:
        h = torch.zeros((1, 4, *qwen_ssm), dtype=h_dtype)
        ssm = torch.zeros((5, *qwen_ssm), dtype=ssm_dtype)
        from_h, _ = plan_ssm_extend(h, ssm, slots, targets, [], [], check_indices=True)
        variants.append((f"extend ssm gather, h {h_dtype} -> ssm {ssm_dtype}", row_copy_launch(from_h)))

    for token_dtype in (torch.bfloat16, torch.float32):
        tokens = torch.zeros((40, 8192), dtype=token_dtype).t()
        conv = torch.zeros((5, 8192, 3), dtype=torch.bfloat16)
        positions = torch.tensor([[1, 2, 3], [10, 11, 12]])
        plan = plan_conv_extend(tokens, conv, positions, targets, check_indices=True)
        variants.append((f"extend conv window gather, {token_dtype} -> bf16", conv_window_launch(plan)))
    return variants


def compile_launch(launch: KernelLaunch, arch: int) -> object:
    """Compile ``launch``'s kernel specialisation for ``sm_<arch>`` and return Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.constants)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, dict(launch.constants), bound_args, specialization, options
    )
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def check(archs: list[int]) -> list[CompileReport]:
    """Compile every variant for every arch; raises Triton's compilation error on failure."""
    reports = []
    for label, launch in _variants():
        if launch is None:
            raise RuntimeError(f"{label}: the plan produced no launch")
        for arch in archs:
            compiled = compile_launch(launch, arch)
            ptx = compiled.asm["ptx"]
            reports.append(
                CompileReport(
                    variant=label,
                    arch=arch,
                    vector_loads=len(re.findall(r"ld\.global[^\n]*\.v4", ptx)),
                    vector_stores=len(re.findall(r"st\.global[^\n]*\.v4", ptx)),
                    shared_bytes=int(compiled.metadata.shared),
                )
            )
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (default 80 90)")
    args = parser.parse_args(argv)
    if not TRITON_AVAILABLE:
        print("triton is not installed; nothing to compile")
        return 1
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set; unset it to compile the kernels for a GPU")
        return 1
    print(f"compiling the state-tracking kernels for sm_{', sm_'.join(map(str, args.arch))} (no GPU needed)")
    for report in check(args.arch):
        print(
            f"ok  sm_{report.arch}  {report.variant}: {report.vector_loads} v4 loads, "
            f"{report.vector_stores} v4 stores, {report.shared_bytes} B shared memory"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
