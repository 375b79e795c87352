"""Triton kernels that move recurrent-state rows between slots of SGLang's Mamba/GDN state pool.

Layouts follow SGLang's ``MambaPool.State``: ``conv`` is a list of [layers, slots, *conv_row] tensors and
``temporal`` (the SSM state) is [layers, slots, heads, head_v_dim, head_k_dim]; slot ``size`` is the padding slot.
Any strides are accepted (SGLang's page-major "envelope" layout gives huge layer/slot strides; tests use sliced
and permuted views); row dimensions that are laid out contiguously are merged so the common case is a flat copy.

Work split: one program copies one ``row_block_bytes`` block of one state row, for one (layer, request) pair.
The grid is (row blocks of every state tensor, requests, layers), so a batch of one request still yields
thousands of programs. SGLang 0.5.20's kernels run one program per (layer, request) that walks the whole row;
``docs/kernels.md`` has the occupancy arithmetic.

Every copy moves raw bits (integer views of the same width), so copies are bit-exact for all values including
NaN payloads. Where a call site converts dtypes (chunk states ``h`` into the SSM pool, ``mixed_qkv`` into the conv
pool) the kernels convert between float32, bfloat16 and float16 with explicit round-to-nearest-even bit
arithmetic: the Triton interpreter truncates float32 to bfloat16 and flushes bfloat16 subnormals, and the
explicit form gives PyTorch's results for every non-NaN value on both the interpreter and the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybrid_prefix_cache.kernels.plans import (
    ConvWindowPlan,
    RowCopyPlan,
    plan_conv_extend,
    plan_decode_tracking,
    plan_slot_copy,
    plan_ssm_extend,
)
from hybrid_prefix_cache.kernels.validation import FLOAT_KINDS, RAW_BITS_DTYPES, SlotIndices, row_numel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

TRITON_AVAILABLE = triton is not None

ROW_BLOCK_BYTES = 16384
"""Bytes of a state row one program copies: 32 float32 (64 bfloat16) elements per thread at 4 warps.

Blocks are sized in bytes, not elements, so every program moves the same amount whatever the dtype; it also
gives each dtype its own block shape, which keeps Triton from sharing one register layout between a 2-byte and a
4-byte tensor (that sharing forced a shared-memory layout conversion in the compiled kernel)."""

MAX_ROW_DIMS = 4
"""Row dimensions a state tensor may keep after contiguous dimensions are merged."""

RAW_KIND = -1
"""Kind code for "copy the bits unchanged" (source and destination share a dtype)."""


class TritonUnavailableError(RuntimeError):
    """The Triton entry points were called but Triton is not installed."""


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise TritonUnavailableError(
            "triton is not installed, so the Triton state-tracking kernels are unavailable; install triton "
            "(pip install 'hybrid-prefix-cache[kernels]') or use hybrid_prefix_cache.kernels.reference"
        )


def _is_interpreted(kernel: object) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def _require_launchable(device: torch.device, kernel: object) -> None:
    if device.type != "cuda" and not _is_interpreted(kernel):
        raise ValueError(
            f"the state tensors are on {device}; the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set "
            "before hybrid_prefix_cache.kernels is imported to run them on the CPU"
        )


if TRITON_AVAILABLE:

    @triton.jit
    def _row_offsets(elements, SIZES: tl.constexpr, strides):
        """Memory offsets of flat row elements for a row of shape SIZES (innermost last) and ``strides``."""
        if len(SIZES) == 1:
            offsets = elements.to(tl.int64) * strides[0]
        else:
            offsets = tl.zeros_like(elements).to(tl.int64)
            rest = elements
            for d in tl.static_range(len(SIZES) - 1, -1, -1):
                offsets += (rest % SIZES[d]).to(tl.int64) * strides[d]
                rest = rest // SIZES[d]
        return offsets

    @triton.jit
    def _convert_bits(bits, SRC_KIND: tl.constexpr, DST_KIND: tl.constexpr):
        """Raw bits of one float kind to raw bits of another (0 float32, 1 bfloat16, 2 float16), or unchanged."""
        if SRC_KIND == DST_KIND:
            out = bits
        else:
            if SRC_KIND == 0:
                f32 = bits.to(tl.uint32, bitcast=True)
            elif SRC_KIND == 1:
                f32 = bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
            else:
                f32 = bits.to(tl.float16, bitcast=True).to(tl.float32).to(tl.uint32, bitcast=True)
            if DST_KIND == 0:
                out = f32.to(tl.int32, bitcast=True)
            elif DST_KIND == 1:
                is_nan = (f32 & 0x7FFFFFFF) > 0x7F800000
                rounded = (f32 + 0x7FFF + ((f32 >> 16) & 1)) >> 16
                out = tl.where(is_nan, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)
            else:
                out = f32.to(tl.float32, bitcast=True).to(tl.float16).to(tl.int16, bitcast=True)
        return out

    @triton.jit
    def _copy_slot_rows_kernel(
        src_ptrs,
        dst_ptrs,
        src_layer_strides,
        src_slot_strides,
        dst_layer_strides,
        dst_slot_strides,
        src_row_strides,
        dst_row_strides,
        src_slot_ptr,
        src_slot_step,
        dst_slot_ptr,
        dst_slot_step,
        mask_ptr,
        mask_step,
        num_src_slots,
        num_dst_slots,
        ROW_SIZES: tl.constexpr,
        ROW_NUMELS: tl.constexpr,
        FIRST_BLOCKS: tl.constexpr,
        SRC_KINDS: tl.constexpr,
        DST_KINDS: tl.constexpr,
        HAS_MASK: tl.constexpr,
        SKIP_SELF_COPIES: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        """Grid (row blocks of all tensors, pairs, layers): copy one block of one row of one state tensor."""
        block = tl.program_id(0)
        pair = tl.program_id(1)
        layer = tl.program_id(2).to(tl.int64)
        src_slot = tl.load(src_slot_ptr + pair * src_slot_step).to(tl.int64)
        dst_slot = tl.load(dst_slot_ptr + pair * dst_slot_step).to(tl.int64)
        # Out-of-range slots (freed slots are -1) are skipped rather than faulting; the host checks reject them
        # unless the caller opted out of index checks.
        skip = (src_slot < 0) | (src_slot >= num_src_slots) | (dst_slot < 0) | (dst_slot >= num_dst_slots)
        if HAS_MASK:
            skip = skip | (tl.load(mask_ptr + pair * mask_step) == 0)
        if SKIP_SELF_COPIES:
            skip = skip | (src_slot == dst_slot)
        if skip:
            return
        for c in tl.static_range(len(ROW_SIZES)):
            if (block >= FIRST_BLOCKS[c]) & (block < FIRST_BLOCKS[c + 1]):
                elements = (block - FIRST_BLOCKS[c]) * BLOCKS[c] + tl.arange(0, BLOCKS[c])
                keep = elements < ROW_NUMELS[c]
                src_row = src_ptrs[c] + layer * src_layer_strides[c] + src_slot * src_slot_strides[c]
                dst_row = dst_ptrs[c] + layer * dst_layer_strides[c] + dst_slot * dst_slot_strides[c]
                bits = tl.load(src_row + _row_offsets(elements, ROW_SIZES[c], src_row_strides[c]), mask=keep)
                tl.store(
                    dst_row + _row_offsets(elements, ROW_SIZES[c], dst_row_strides[c]),
                    _convert_bits(bits, SRC_KINDS[c], DST_KINDS[c]),
                    mask=keep,
                )

    @triton.jit
    def _gather_conv_windows_kernel(
        tokens_ptr,
        conv_ptr,
        positions_ptr,
        positions_row_step,
        positions_col_step,
        dst_slot_ptr,
        dst_slot_step,
        tokens_dim_stride,
        tokens_token_stride,
        conv_slot_stride,
        conv_dim_stride,
        conv_width_stride,
        num_tokens,
        num_slots,
        DIM: tl.constexpr,
        WIDTH: tl.constexpr,
        SRC_KIND: tl.constexpr,
        DST_KIND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Grid (row blocks, tracked requests): conv[dst, d, w] = tokens[d, positions[request, w]]."""
        block = tl.program_id(0)
        request = tl.program_id(1)
        dst_slot = tl.load(dst_slot_ptr + request * dst_slot_step).to(tl.int64)
        if (dst_slot < 0) | (dst_slot >= num_slots):
            return
        elements = block * BLOCK + tl.arange(0, BLOCK)
        keep = elements < DIM * WIDTH
        dim = elements // WIDTH
        column = elements % WIDTH
        position = tl.load(
            positions_ptr + request * positions_row_step + column * positions_col_step, mask=keep, other=0
        ).to(tl.int64)
        keep = keep & (position >= 0) & (position < num_tokens)
        bits = tl.load(tokens_ptr + dim.to(tl.int64) * tokens_dim_stride + position * tokens_token_stride, mask=keep)
        tl.store(
            conv_ptr
            + dst_slot * conv_slot_stride
            + dim.to(tl.int64) * conv_dim_stride
            + column.to(tl.int64) * conv_width_stride,
            _convert_bits(bits, SRC_KIND, DST_KIND),
            mask=keep,
        )


KERNELS_INTERPRETED = TRITON_AVAILABLE and _is_interpreted(_copy_slot_rows_kernel)
"""Whether the kernels run through Triton's interpreter (TRITON_INTERPRET=1 was set when this module was imported);
then they take CPU tensors."""


def _raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Same memory, same strides, as integers of the element width."""
    return tensor.view(RAW_BITS_DTYPES[tensor.element_size()])


def _kinds(src: torch.Tensor, dst: torch.Tensor) -> tuple[int, int]:
    if src.dtype == dst.dtype:
        return RAW_KIND, RAW_KIND
    return FLOAT_KINDS[src.dtype], FLOAT_KINDS[dst.dtype]


def _merged_row_dims(
    shape: Sequence[int], src_strides: Sequence[int], dst_strides: Sequence[int], name: str
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Row (sizes, source strides, destination strides) with size-1 dims dropped and mergeable dims merged.

    Two neighbouring dims merge when, in both tensors, the outer stride equals inner stride x inner size: then
    the pair walks memory exactly like one dim, and a contiguous row becomes a single stride-1 dim.
    """
    merged: list[list[int]] = []
    for size, src_stride, dst_stride in zip(shape, src_strides, dst_strides, strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == src_stride * size and merged[-1][2] == dst_stride * size:
            merged[-1] = [merged[-1][0] * size, src_stride, dst_stride]
        else:
            merged.append([size, src_stride, dst_stride])
    if not merged:
        merged = [[1, 1, 1]]
    if len(merged) > MAX_ROW_DIMS:
        raise ValueError(
            f"{name} rows of shape {tuple(shape)} with strides {tuple(src_strides)} -> {tuple(dst_strides)} have "
            f"{len(merged)} non-mergeable dims; at most {MAX_ROW_DIMS} are supported"
        )
    sizes, src_out, dst_out = (tuple(column) for column in zip(*merged, strict=True))
    return sizes, src_out, dst_out


def _block_elements(row_block_bytes: int, *tensors: torch.Tensor) -> int:
    if row_block_bytes < 64 or row_block_bytes & (row_block_bytes - 1):
        raise ValueError(f"row_block_bytes must be a power of two >= 64, got {row_block_bytes}")
    return row_block_bytes // max(t.element_size() for t in tensors)


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch, fully specified: ``kernel[grid](*args, **constants)``."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple[object, ...]
    constants: dict[str, object]
    device: torch.device

    def run(self) -> None:
        _require_launchable(self.device, self.kernel)
        self.kernel[self.grid](*self.args, **self.constants)


def row_copy_launch(plan: RowCopyPlan, row_block_bytes: int = ROW_BLOCK_BYTES) -> KernelLaunch | None:
    """The launch of :func:`_copy_slot_rows_kernel` that executes ``plan`` (None when there is nothing to copy)."""
    _require_triton()
    if plan.is_empty:
        return None
    srcs, dsts = [], []
    src_layer, src_slot, dst_layer, dst_slot = [], [], [], []
    src_rows, dst_rows, sizes, numels, first_blocks = [], [], [], [], [0]
    src_kinds, dst_kinds, blocks = [], [], []
    for (name, src), (_, dst) in zip(plan.src, plan.dst, strict=True):
        if dst.numel() == 0:
            continue
        numel = row_numel(dst)
        block = _block_elements(row_block_bytes, src, dst)
        if numel >= 2**31 - block:
            raise ValueError(f"{name} rows have {numel} elements; rows must stay below 2**31 elements")
        row_sizes, src_row, dst_row = _merged_row_dims(dst.shape[2:], src.stride()[2:], dst.stride()[2:], name)
        src_kind, dst_kind = _kinds(src, dst)
        srcs.append(_raw_bits(src))
        dsts.append(_raw_bits(dst))
        src_layer.append(src.stride(0))
        src_slot.append(src.stride(1))
        dst_layer.append(dst.stride(0))
        dst_slot.append(dst.stride(1))
        src_rows.append(src_row)
        dst_rows.append(dst_row)
        sizes.append(row_sizes)
        numels.append(numel)
        first_blocks.append(first_blocks[-1] + math.ceil(numel / block))
        blocks.append(block)
        src_kinds.append(src_kind)
        dst_kinds.append(dst_kind)
    mask = plan.mask if plan.mask is not None else plan.src_slots
    return KernelLaunch(
        kernel=_copy_slot_rows_kernel,
        grid=(first_blocks[-1], plan.num_pairs, plan.num_layers),
        args=(
            tuple(srcs),
            tuple(dsts),
            tuple(src_layer),
            tuple(src_slot),
            tuple(dst_layer),
            tuple(dst_slot),
            tuple(src_rows),
            tuple(dst_rows),
            plan.src_slots,
            plan.src_slots.stride(0),
            plan.dst_slots,
            plan.dst_slots.stride(0),
            mask,
            mask.stride(0),
            plan.num_src_slots,
            plan.num_dst_slots,
        ),
        constants={
            "ROW_SIZES": tuple(sizes),
            "ROW_NUMELS": tuple(numels),
            "FIRST_BLOCKS": tuple(first_blocks),
            "SRC_KINDS": tuple(src_kinds),
            "DST_KINDS": tuple(dst_kinds),
            "HAS_MASK": plan.mask is not None,
            "SKIP_SELF_COPIES": plan.same_pool,
            "BLOCKS": tuple(blocks),
        },
        device=plan.dst[0][1].device,
    )


def conv_window_launch(plan: ConvWindowPlan, row_block_bytes: int = ROW_BLOCK_BYTES) -> KernelLaunch | None:
    """The launch of :func:`_gather_conv_windows_kernel` that executes ``plan`` (None when there is nothing to do)."""
    _require_triton()
    if plan.is_empty or plan.tokens.shape[1] == 0:
        return None
    tokens, conv, positions, dst = plan.tokens, plan.conv_states, plan.token_index, plan.dst_slots
    dim, width = conv.shape[1], conv.shape[2]
    src_kind, dst_kind = _kinds(tokens, conv)
    block = _block_elements(row_block_bytes, tokens, conv)
    return KernelLaunch(
        kernel=_gather_conv_windows_kernel,
        grid=(math.ceil(dim * width / block), dst.shape[0]),
        args=(
            _raw_bits(tokens),
            _raw_bits(conv),
            positions,
            positions.stride(0),
            positions.stride(1),
            dst,
            dst.stride(0),
            tokens.stride(0),
            tokens.stride(1),
            conv.stride(0),
            conv.stride(1),
            conv.stride(2),
            tokens.shape[1],
            conv.shape[0],
        ),
        constants={"DIM": dim, "WIDTH": width, "SRC_KIND": src_kind, "DST_KIND": dst_kind, "BLOCK": block},
        device=conv.device,
    )


def _run(launch: KernelLaunch | None) -> None:
    if launch is not None:
        launch.run()


def track_states_decode(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    ssm_states: torch.Tensor,
    cache_indices: SlotIndices,
    track_mask: torch.Tensor,
    track_indices: SlotIndices,
    batch_size: int | None = None,
    *,
    skip_negative_slots: bool = False,
    check_indices: bool = True,
    row_block_bytes: int = ROW_BLOCK_BYTES,
) -> None:
    """Decode tracking for all layers in one launch.

    For each request ``i < batch_size`` with ``track_mask[i]`` set, copy slot ``cache_indices[i]`` to slot
    ``track_indices[i]`` in every layer of every conv tensor and of ``ssm_states``. Pools are
    [layers, slots, ...]; ``conv_states`` may be one tensor or SGLang's list. ``batch_size`` defaults to the
    common length of the three vectors. Rows with a negative slot are errors unless ``skip_negative_slots``
    (SGLang's ``check_freed_slots``), in which case they are skipped.
    """
    _require_triton()
    plan = plan_decode_tracking(
        conv_states,
        ssm_states,
        cache_indices,
        track_mask,
        track_indices,
        batch_size,
        skip_negative_slots=skip_negative_slots,
        check_indices=check_indices,
    )
    _run(row_copy_launch(plan, row_block_bytes))


def copy_state_slots(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    temporal_states: torch.Tensor | None,
    src_indices: SlotIndices,
    dst_indices: SlotIndices,
    *,
    dst_conv_states: torch.Tensor | Sequence[torch.Tensor] | None = None,
    dst_temporal_states: torch.Tensor | None = None,
    check_indices: bool = True,
    row_block_bytes: int = ROW_BLOCK_BYTES,
) -> None:
    """Copy whole states slot to slot across all layers in one launch (copy-on-write, fork).

    The state part of SGLang's ``MambaPool.copy_from(src, dst)`` (which also resets ReplaySSM cursors and copies
    registered side states): every conv tensor and ``temporal_states`` get
    ``pool[:, dst_indices[i]] = pool[:, src_indices[i]]``. Give ``dst_conv_states``/``dst_temporal_states`` to
    copy into another pool of the same row shapes and dtypes.
    """
    _require_triton()
    plan = plan_slot_copy(
        conv_states,
        temporal_states,
        src_indices,
        dst_indices,
        dst_conv_states=dst_conv_states,
        dst_temporal_states=dst_temporal_states,
        check_indices=check_indices,
    )
    _run(row_copy_launch(plan, row_block_bytes))


def track_ssm_states_extend(
    h: torch.Tensor | None,
    ssm_states: torch.Tensor,
    track_ssm_h_src: SlotIndices,
    track_ssm_h_dst: SlotIndices,
    track_ssm_final_src: SlotIndices,
    track_ssm_final_dst: SlotIndices,
    *,
    check_indices: bool = True,
    row_block_bytes: int = ROW_BLOCK_BYTES,
) -> None:
    """Extend SSM tracking for one layer, as SGLang's ``_track_mamba_state_extend`` does it.

    ``ssm_states[track_ssm_h_dst] = h[track_ssm_h_src].to(ssm_states.dtype)`` (chunk states at the last chunk
    boundary, for tracked lengths that are not chunk-aligned), then
    ``ssm_states[track_ssm_final_dst] = ssm_states[track_ssm_final_src]`` (final states, for aligned lengths).
    ``h`` is [num_chunks, ...] or [1, num_chunks, ...] and may be None when no chunk state is selected. The index
    tensors are the ones :func:`~hybrid_prefix_cache.kernels.track_indices.init_track_ssm_indices` returns.
    """
    _require_triton()
    for plan in plan_ssm_extend(
        h,
        ssm_states,
        track_ssm_h_src,
        track_ssm_h_dst,
        track_ssm_final_src,
        track_ssm_final_dst,
        check_indices=check_indices,
    ):
        _run(row_copy_launch(plan, row_block_bytes))


def track_conv_states_extend(
    mixed_qkv: torch.Tensor,
    conv_states: torch.Tensor,
    track_conv_indices: torch.Tensor,
    conv_states_mask_indices: SlotIndices,
    *,
    check_indices: bool = True,
    row_block_bytes: int = ROW_BLOCK_BYTES,
) -> None:
    """Extend conv tracking for one layer, as SGLang's GDN and Mamba2 extend paths do it.

    ``conv_states[conv_states_mask_indices] = mixed_qkv[:, track_conv_indices].transpose(0, 1)`` without the
    intermediate gather: ``mixed_qkv`` is [dim, num_tokens] (any strides), ``conv_states`` is [slots, dim, width]
    for one layer, ``track_conv_indices`` is [num_tracked, width] token positions from
    :func:`~hybrid_prefix_cache.kernels.track_indices.init_track_conv_indices`.
    """
    _require_triton()
    plan = plan_conv_extend(
        mixed_qkv, conv_states, track_conv_indices, conv_states_mask_indices, check_indices=check_indices
    )
    _run(conv_window_launch(plan, row_block_bytes))


def track_mamba_states_if_needed(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool = False,
    *,
    check_indices: bool = True,
) -> None:
    """Drop-in for SGLang 0.5.20 ``track_mamba_states_if_needed`` (same arguments, order and effect).

    ``conv_states`` [slots, ...] (or a list of them) and ``ssm_states`` [slots, ...] are one layer's pools.
    """
    conv = [t.unsqueeze(0) for t in _tensor_or_list(conv_states, "conv_states")]
    track_states_decode(
        conv,
        _as_tensor(ssm_states, "ssm_states").unsqueeze(0),
        cache_indices,
        mamba_track_mask,
        mamba_track_indices,
        batch_size,
        skip_negative_slots=check_freed_slots,
        check_indices=check_indices,
    )


def track_mamba_states_all_layers(
    conv_states_pool: torch.Tensor | Sequence[torch.Tensor],
    ssm_states_pool: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool = False,
    *,
    check_indices: bool = True,
) -> None:
    """Drop-in for SGLang 0.5.20 ``track_mamba_states_all_layers`` (same arguments, order and effect).

    ``conv_states_pool`` (or a list of conv pools) and ``ssm_states_pool`` are [layers, slots, ...].
    """
    track_states_decode(
        conv_states_pool,
        ssm_states_pool,
        cache_indices,
        mamba_track_mask,
        mamba_track_indices,
        batch_size,
        skip_negative_slots=check_freed_slots,
        check_indices=check_indices,
    )


def _as_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _tensor_or_list(value: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)) and value:
        return [_as_tensor(t, f"{name}[{i}]") for i, t in enumerate(value)]
    raise ValueError(f"{name} must be a tensor or a non-empty list of tensors, got {type(value).__name__}")
