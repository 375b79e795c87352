"""Checked, normalised descriptions of the state copies; the Triton kernels and the references both execute them.

Every public operation first builds a plan here, so both implementations see the same normalised tensors and
reject bad input with the same ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybrid_prefix_cache.kernels.validation import (
    MAX_GRID_YZ,
    SlotIndices,
    as_tensor_list,
    batch_length,
    check_convertible,
    check_copy_pairs,
    check_pool,
    check_same_rows,
    check_slot_range,
    check_unique_destinations,
    index_vector,
    mask_vector,
    should_check_values,
)


@dataclass(frozen=True)
class RowCopyPlan:
    """Copy row ``src[layer, src_slots[i]]`` to ``dst[layer, dst_slots[i]]`` for every layer and selected i.

    Row i is selected when ``mask[i]`` is set (or there is no mask), both slots are in range, and, within one pool,
    the slots differ (copying a row onto itself changes nothing). Each source tensor pairs with the destination
    tensor at the same position; all are [layers, slots, *row].
    """

    src: tuple[tuple[str, torch.Tensor], ...]
    dst: tuple[tuple[str, torch.Tensor], ...]
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    mask: torch.Tensor | None
    num_pairs: int
    num_layers: int
    num_src_slots: int
    num_dst_slots: int
    same_pool: bool

    @property
    def is_empty(self) -> bool:
        return self.num_pairs == 0 or self.num_layers == 0 or all(t.numel() == 0 for _, t in self.dst)


@dataclass(frozen=True)
class ConvWindowPlan:
    """``conv_states[dst_slots[j], :, w] = tokens[:, token_index[j, w]]`` for every tracked request j.

    ``tokens`` is [dim, num_tokens] (the transposed ``mixed_qkv`` the backend holds), ``conv_states`` is
    [slots, dim, width] for one layer.
    """

    tokens: torch.Tensor
    conv_states: torch.Tensor
    token_index: torch.Tensor
    dst_slots: torch.Tensor

    @property
    def is_empty(self) -> bool:
        return self.dst_slots.numel() == 0 or self.conv_states[0].numel() == 0


def _check_grid(num_pairs: int, num_layers: int) -> None:
    if num_pairs > MAX_GRID_YZ:
        raise ValueError(f"{num_pairs} rows in one call exceeds the kernel limit of {MAX_GRID_YZ}; split the batch")
    if num_layers > MAX_GRID_YZ:
        raise ValueError(f"{num_layers} layers in one call exceeds the kernel limit of {MAX_GRID_YZ}")


def _state_names(conv: list[torch.Tensor], conv_name: str) -> list[str]:
    return [conv_name] if len(conv) == 1 else [f"{conv_name}[{i}]" for i in range(len(conv))]


def _named_pool(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    ssm_states: torch.Tensor | None,
    conv_name: str,
    ssm_name: str,
) -> list[tuple[str, torch.Tensor]]:
    conv = as_tensor_list(conv_states, conv_name)
    named = list(zip(_state_names(conv, conv_name), conv, strict=True))
    if ssm_states is not None:
        if not isinstance(ssm_states, torch.Tensor):
            raise ValueError(f"{ssm_name} must be a torch.Tensor, got {type(ssm_states).__name__}")
        named.append((ssm_name, ssm_states))
    return named


def plan_decode_tracking(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    ssm_states: torch.Tensor,
    cache_indices: SlotIndices,
    track_mask: torch.Tensor,
    track_indices: SlotIndices,
    batch_size: int | None,
    *,
    skip_negative_slots: bool,
    check_indices: bool,
) -> RowCopyPlan:
    """Decode tracking: copy each masked request's working slot to its track slot in every layer."""
    named = _named_pool(conv_states, ssm_states, "conv_states", "ssm_states")
    pool = check_pool(named)
    check_same_rows(named, named, allow_cast=False)
    src = index_vector(cache_indices, "cache_indices", pool.device)
    dst = index_vector(track_indices, "track_indices", pool.device)
    mask = mask_vector(track_mask, "track_mask", pool.device)
    n = batch_length(batch_size, [("cache_indices", src), ("track_mask", mask), ("track_indices", dst)])
    _check_grid(n, pool.num_layers)
    if n and should_check_values(check_indices, pool.device):
        host = torch.stack([src[:n].long(), dst[:n].long(), mask[:n].long()]).cpu()
        active = host[2] != 0
        if skip_negative_slots:
            active &= (host[0] >= 0) & (host[1] >= 0)
        check_copy_pairs(
            host[0],
            host[1],
            active,
            num_src_slots=pool.num_slots,
            num_dst_slots=pool.num_slots,
            same_pool=True,
            src_name="cache_indices",
            dst_name="track_indices",
        )
    return RowCopyPlan(
        src=tuple(named),
        dst=tuple(named),
        src_slots=src,
        dst_slots=dst,
        mask=mask,
        num_pairs=n,
        num_layers=pool.num_layers,
        num_src_slots=pool.num_slots,
        num_dst_slots=pool.num_slots,
        same_pool=True,
    )


def plan_slot_copy(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    temporal_states: torch.Tensor | None,
    src_indices: SlotIndices,
    dst_indices: SlotIndices,
    *,
    dst_conv_states: torch.Tensor | Sequence[torch.Tensor] | None,
    dst_temporal_states: torch.Tensor | None,
    check_indices: bool,
) -> RowCopyPlan:
    """Pool copy (copy-on-write, fork): slot ``src_indices[i]`` to ``dst_indices[i]`` in every layer."""
    src_named = _named_pool(conv_states, temporal_states, "conv_states", "temporal_states")
    src_pool = check_pool(src_named)
    separate = dst_conv_states is not None or dst_temporal_states is not None
    if separate:
        if dst_conv_states is None or (dst_temporal_states is None) != (temporal_states is None):
            raise ValueError(
                "give dst_conv_states, and dst_temporal_states exactly when temporal_states is given, to copy "
                "into another pool"
            )
        dst_named = _named_pool(dst_conv_states, dst_temporal_states, "dst_conv_states", "dst_temporal_states")
        dst_pool = check_pool(dst_named)
        if dst_pool.device != src_pool.device:
            raise ValueError(f"destination pool is on {dst_pool.device} but source pool is on {src_pool.device}")
        if dst_pool.num_layers != src_pool.num_layers:
            raise ValueError(
                f"destination pool has {dst_pool.num_layers} layers but source pool has {src_pool.num_layers}"
            )
        same_pool = all(s.data_ptr() == d.data_ptr() for (_, s), (_, d) in zip(src_named, dst_named, strict=False))
    else:
        dst_named, dst_pool, same_pool = src_named, src_pool, True
    check_same_rows(src_named, dst_named, allow_cast=False)
    src = index_vector(src_indices, "src_indices", src_pool.device)
    dst = index_vector(dst_indices, "dst_indices", src_pool.device)
    n = batch_length(None, [("src_indices", src), ("dst_indices", dst)])
    _check_grid(n, src_pool.num_layers)
    if n and should_check_values(check_indices, src_pool.device):
        host = torch.stack([src.long(), dst.long()]).cpu()
        check_copy_pairs(
            host[0],
            host[1],
            torch.ones(n, dtype=torch.bool),
            num_src_slots=src_pool.num_slots,
            num_dst_slots=dst_pool.num_slots,
            same_pool=same_pool,
            src_name="src_indices",
            dst_name="dst_indices",
        )
    return RowCopyPlan(
        src=tuple(src_named),
        dst=tuple(dst_named),
        src_slots=src,
        dst_slots=dst,
        mask=None,
        num_pairs=n,
        num_layers=src_pool.num_layers,
        num_src_slots=src_pool.num_slots,
        num_dst_slots=dst_pool.num_slots,
        same_pool=same_pool,
    )


def plan_ssm_extend(
    h: torch.Tensor | None,
    ssm_states: torch.Tensor,
    track_ssm_h_src: SlotIndices,
    track_ssm_h_dst: SlotIndices,
    track_ssm_final_src: SlotIndices,
    track_ssm_final_dst: SlotIndices,
    *,
    check_indices: bool,
) -> tuple[RowCopyPlan, RowCopyPlan]:
    """Extend SSM tracking for one layer: chunk states ``h`` rows and aligned final states into track slots.

    Returns the two copies in upstream's order (``h`` first, then final states within ``ssm_states``), which the
    callers run one after the other.
    """
    if not isinstance(ssm_states, torch.Tensor) or ssm_states.dim() < 1:
        raise ValueError("ssm_states must be a [slots, ...] tensor")
    device = ssm_states.device
    h_src = index_vector(track_ssm_h_src, "track_ssm_h_src", device)
    h_dst = index_vector(track_ssm_h_dst, "track_ssm_h_dst", device)
    final_src = index_vector(track_ssm_final_src, "track_ssm_final_src", device)
    final_dst = index_vector(track_ssm_final_dst, "track_ssm_final_dst", device)
    num_h = batch_length(None, [("track_ssm_h_src", h_src), ("track_ssm_h_dst", h_dst)])
    num_final = batch_length(None, [("track_ssm_final_src", final_src), ("track_ssm_final_dst", final_dst)])
    _check_grid(max(num_h, num_final), 1)
    pool = ssm_states.unsqueeze(0)
    if h is None:
        if num_h:
            raise ValueError(f"h is None but track_ssm_h_src selects {num_h} chunk states")
        chunks = pool[:, :0]
    else:
        if not isinstance(h, torch.Tensor):
            raise ValueError(f"h must be a torch.Tensor or None, got {type(h).__name__}")
        if h.dim() == ssm_states.dim() + 1 and h.shape[0] == 1:
            h = h.squeeze(0)
        if h.device != device:
            raise ValueError(f"h is on {h.device} but ssm_states is on {device}")
        chunks = h.unsqueeze(0)
    h_named = [("h", chunks)]
    ssm_named = [("ssm_states", pool)]
    if chunks.shape[2:] != pool.shape[2:]:
        raise ValueError(
            f"h holds chunk states of shape {tuple(chunks.shape[2:])} but ssm_states rows are "
            f"{tuple(pool.shape[2:])} (h is [num_chunks, ...] or [1, num_chunks, ...])"
        )
    check_same_rows(h_named, ssm_named, allow_cast=True)
    num_chunks, num_slots = chunks.shape[1], pool.shape[1]
    if should_check_values(check_indices, device) and (num_h or num_final):
        host_h = torch.stack([h_src.long(), h_dst.long()]).cpu()
        host_final = torch.stack([final_src.long(), final_dst.long()]).cpu()
        h_rows = torch.arange(num_h)
        final_rows = torch.arange(num_final)
        check_slot_range(host_h[0], h_rows, num_chunks, "track_ssm_h_src", "chunk states in h")
        check_slot_range(host_h[1], h_rows, num_slots, "track_ssm_h_dst")
        check_copy_pairs(
            host_final[0],
            host_final[1],
            torch.ones(num_final, dtype=torch.bool),
            num_src_slots=num_slots,
            num_dst_slots=num_slots,
            same_pool=True,
            src_name="track_ssm_final_src",
            dst_name="track_ssm_final_dst",
        )
        check_unique_destinations(
            torch.cat([host_h[1], host_final[1]]),
            torch.cat([h_rows, final_rows]),
            "track_ssm_h_dst + track_ssm_final_dst",
        )
    from_h = RowCopyPlan(
        src=tuple(h_named),
        dst=tuple(ssm_named),
        src_slots=h_src,
        dst_slots=h_dst,
        mask=None,
        num_pairs=num_h,
        num_layers=1,
        num_src_slots=num_chunks,
        num_dst_slots=num_slots,
        same_pool=False,
    )
    from_final = RowCopyPlan(
        src=tuple(ssm_named),
        dst=tuple(ssm_named),
        src_slots=final_src,
        dst_slots=final_dst,
        mask=None,
        num_pairs=num_final,
        num_layers=1,
        num_src_slots=num_slots,
        num_dst_slots=num_slots,
        same_pool=True,
    )
    return from_h, from_final


def plan_conv_extend(
    mixed_qkv: torch.Tensor,
    conv_states: torch.Tensor,
    track_conv_indices: torch.Tensor,
    conv_states_mask_indices: SlotIndices,
    *,
    check_indices: bool,
) -> ConvWindowPlan:
    """Extend conv tracking for one layer: each tracked request's conv window into its track slot."""
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2:
        raise ValueError("mixed_qkv must be a [dim, num_tokens] tensor (the transposed projection)")
    if not isinstance(conv_states, torch.Tensor) or conv_states.dim() != 3:
        raise ValueError("conv_states must be a [slots, dim, width] tensor for one layer")
    device = conv_states.device
    if mixed_qkv.device != device:
        raise ValueError(f"mixed_qkv is on {mixed_qkv.device} but conv_states is on {device}")
    if not isinstance(track_conv_indices, torch.Tensor) or track_conv_indices.dim() != 2:
        raise ValueError("track_conv_indices must be a [num_tracked, width] tensor of token positions")
    if track_conv_indices.dtype == torch.bool or track_conv_indices.dtype.is_floating_point:
        raise ValueError(f"track_conv_indices must hold integer positions, got dtype {track_conv_indices.dtype}")
    if track_conv_indices.device != device:
        raise ValueError(f"track_conv_indices is on {track_conv_indices.device} but conv_states is on {device}")
    dst = index_vector(conv_states_mask_indices, "conv_states_mask_indices", device)
    if dst.shape[0] != track_conv_indices.shape[0]:
        raise ValueError(
            f"mismatched lengths: track_conv_indices has {track_conv_indices.shape[0]} rows but "
            f"conv_states_mask_indices has {dst.shape[0]}"
        )
    dim, width = conv_states.shape[1], conv_states.shape[2]
    if mixed_qkv.shape[0] != dim or track_conv_indices.shape[1] != width:
        raise ValueError(
            f"conv_states rows are [dim={dim}, width={width}] but mixed_qkv has dim {mixed_qkv.shape[0]} and "
            f"track_conv_indices has width {track_conv_indices.shape[1]}"
        )
    check_convertible("mixed_qkv", mixed_qkv.dtype, "conv_states", conv_states.dtype, allow_cast=True)
    _check_grid(dst.shape[0], 1)
    if dst.numel() and should_check_values(check_indices, device):
        host_dst = dst.long().cpu()
        host_tokens = track_conv_indices.long().cpu()
        rows = torch.arange(dst.shape[0])
        check_slot_range(host_dst, rows, conv_states.shape[0], "conv_states_mask_indices")
        check_unique_destinations(host_dst, rows, "conv_states_mask_indices")
        bad = (host_tokens < 0) | (host_tokens >= mixed_qkv.shape[1])
        if bool(bad.any()):
            row, col = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"track_conv_indices out of range: row {row} position {col} is {int(host_tokens[row, col])}, "
                f"but mixed_qkv has {mixed_qkv.shape[1]} tokens"
            )
    return ConvWindowPlan(tokens=mixed_qkv, conv_states=conv_states, token_index=track_conv_indices, dst_slots=dst)
