"""Input checks shared by the Triton kernels and their PyTorch references.

Both implementations run exactly the same checks, so a bad call fails the same way whichever one is used.
Shape, dtype, length and device checks only read tensor metadata and always run. Checks of index *values*
(slot ranges, duplicate destinations, a slot both read and written) need the indices on the host: they run when
``check_indices`` is true and the current CUDA stream is not capturing a graph (a device-to-host copy is illegal
there); the kernels then skip any row whose slots are out of range instead of touching memory they do not own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SlotIndices = torch.Tensor | Sequence[int]

FLOAT_KINDS: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Float dtypes the kernels convert between; the codes are the ``*_KIND`` constants the kernels branch on."""

RAW_BITS_DTYPES: dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtype of the same width as an element: the kernels move raw bits, so copies are bit-exact for any
value, NaN payloads included."""

MAX_GRID_YZ = 65535
"""CUDA's limit on the second and third grid dimensions (pairs and layers in these kernels)."""


def as_tensor_list(value: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    """A pool given as one tensor or as SGLang's list of conv tensors, as a list."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return list(value)
    raise ValueError(f"{name} must be a tensor or a non-empty list of tensors, got {type(value).__name__}")


@dataclass(frozen=True)
class PoolLayout:
    """What a set of state tensors shares: each tensor is [layers, slots, *row]."""

    num_layers: int
    num_slots: int
    device: torch.device


def check_pool(named: Sequence[tuple[str, torch.Tensor]]) -> PoolLayout:
    """Check that state tensors share a device, a layer count and a slot count."""
    if not named:
        raise ValueError("no state tensors given")
    first_name, first = named[0]
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() < 2:
            raise ValueError(f"{name} must be [layers, slots, ...], got shape {tuple(tensor.shape)}")
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}")
        if tensor.shape[0] != first.shape[0]:
            raise ValueError(
                f"{name} has {tensor.shape[0]} layers but {first_name} has {first.shape[0]} (shapes "
                f"{tuple(tensor.shape)} and {tuple(first.shape)})"
            )
        if tensor.shape[1] != first.shape[1]:
            raise ValueError(
                f"{name} has {tensor.shape[1]} slots but {first_name} has {first.shape[1]} (shapes "
                f"{tuple(tensor.shape)} and {tuple(first.shape)})"
            )
    return PoolLayout(first.shape[0], first.shape[1], first.device)


def check_same_rows(
    src: Sequence[tuple[str, torch.Tensor]], dst: Sequence[tuple[str, torch.Tensor]], *, allow_cast: bool
) -> None:
    """Check that each source tensor can be copied row by row into its destination tensor."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source state tensors but {len(dst)} destination state tensors")
    for (src_name, s), (dst_name, d) in zip(src, dst, strict=True):
        if s.shape[2:] != d.shape[2:]:
            raise ValueError(
                f"row shape of {src_name} {tuple(s.shape[2:])} differs from {dst_name} {tuple(d.shape[2:])}"
            )
        check_convertible(src_name, s.dtype, dst_name, d.dtype, allow_cast=allow_cast)


def check_convertible(
    src_name: str, src_dtype: torch.dtype, dst_name: str, dst_dtype: torch.dtype, *, allow_cast: bool
) -> None:
    """Check that values of ``src_dtype`` can be stored into ``dst_dtype`` by the kernels."""
    if src_dtype == dst_dtype:
        if src_dtype.itemsize not in RAW_BITS_DTYPES:
            raise ValueError(f"{src_name} has unsupported dtype {src_dtype}")
        return
    if not allow_cast:
        raise ValueError(f"dtype mismatch: {src_name} is {src_dtype} but {dst_name} is {dst_dtype}")
    for name, dtype in ((src_name, src_dtype), (dst_name, dst_dtype)):
        if dtype not in FLOAT_KINDS:
            raise ValueError(
                f"cannot convert {src_name} ({src_dtype}) to {dst_name} ({dst_dtype}): {name} must be one of "
                f"{', '.join(str(k) for k in FLOAT_KINDS)} when the dtypes differ"
            )


def index_vector(value: SlotIndices, name: str, device: torch.device) -> torch.Tensor:
    """A 1-D integer index tensor on ``device`` (lists of ints are converted)."""
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.int64, device=device)
    if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise ValueError(f"{name} must hold integer slot indices, got dtype {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the state tensors are on {device}")
    return tensor


def mask_vector(value: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """A 1-D mask tensor (bool, or integers where non-zero means set) on ``device``."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex:
        raise ValueError(f"{name} must be bool or integer, got dtype {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the state tensors are on {device}")
    return value


def batch_length(batch_size: int | None, named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Rows to process: ``batch_size`` when given (each vector needs at least that many), else the common length."""
    if batch_size is None:
        lengths = {name: t.shape[0] for name, t in named}
        if len(set(lengths.values())) > 1:
            raise ValueError("mismatched lengths: " + ", ".join(f"{name} has {n}" for name, n in lengths.items()))
        return next(iter(lengths.values()))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"batch_size must be a non-negative int, got {batch_size!r}")
    for name, t in named:
        if t.shape[0] < batch_size:
            raise ValueError(f"{name} has {t.shape[0]} entries but batch_size is {batch_size}")
    return batch_size


def should_check_values(check_indices: bool, device: torch.device) -> bool:
    """Whether index values can be inspected now (never while a CUDA graph is being captured)."""
    if not check_indices:
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _row_list(rows: torch.Tensor) -> str:
    shown = rows[:8].tolist()
    return ", ".join(str(r) for r in shown) + (", ..." if rows.numel() > 8 else "")


def check_slot_range(slots: torch.Tensor, rows: torch.Tensor, limit: int, name: str, what: str = "slots") -> None:
    """Raise if any of ``slots`` (host tensor; ``rows`` are their batch rows) lies outside [0, limit)."""
    bad = (slots < 0) | (slots >= limit)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name} out of range: row {int(rows[first])} has {int(slots[first])}, but there are {limit} "
            f"{what} (valid: 0..{limit - 1}); offending rows: {_row_list(rows[bad])}"
        )


def check_unique_destinations(slots: torch.Tensor, rows: torch.Tensor, name: str) -> None:
    """Raise if a destination slot would be written by two rows (the result would depend on scheduling)."""
    if slots.numel() < 2:
        return
    order = torch.argsort(slots, stable=True)
    ordered = slots[order]
    repeated = (ordered[1:] == ordered[:-1]).nonzero()
    if repeated.numel():
        i = int(repeated[0, 0])
        raise ValueError(
            f"{name} writes slot {int(ordered[i])} twice (rows {int(rows[order[i]])} and "
            f"{int(rows[order[i + 1]])}); destination slots must be distinct"
        )


def check_no_read_after_write(
    src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, src_name: str, dst_name: str
) -> None:
    """Raise if a slot written by one copy is read by another copy in the same launch (a race)."""
    moving = src != dst
    written, read = dst[moving], src[moving]
    clash = torch.isin(written, read)
    if bool(clash.any()):
        first = int(clash.nonzero()[0, 0])
        slot = int(written[first])
        reader = int(rows[moving][int((read == slot).nonzero()[0, 0])])
        raise ValueError(
            f"slot {slot} is written by row {int(rows[moving][first])} ({dst_name}) and read by row {reader} "
            f"({src_name}) in the same call; copies within one pool must not chain"
        )


def check_copy_pairs(
    src: torch.Tensor,
    dst: torch.Tensor,
    active: torch.Tensor,
    *,
    num_src_slots: int,
    num_dst_slots: int,
    same_pool: bool,
    src_name: str,
    dst_name: str,
) -> None:
    """Check active (src, dst) slot pairs on the host: in range, distinct destinations, no chained copies."""
    rows = active.nonzero().flatten()
    src_active, dst_active = src[rows].long(), dst[rows].long()
    check_slot_range(src_active, rows, num_src_slots, src_name)
    check_slot_range(dst_active, rows, num_dst_slots, dst_name)
    check_unique_destinations(dst_active, rows, dst_name)
    if same_pool:
        check_no_read_after_write(src_active, dst_active, rows, src_name, dst_name)


def row_numel(tensor: torch.Tensor) -> int:
    """Elements in one [layer, slot] row of a [layers, slots, *row] tensor."""
    n = 1
    for size in tensor.shape[2:]:
        n *= size
    return n
