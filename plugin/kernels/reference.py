"""Plain PyTorch references for every Triton kernel in :mod:`hybrid_prefix_cache.kernels.track_state`.

Each reference takes the same arguments, runs the same input checks (:mod:`.plans`) and must leave the same
bytes in the pools as its kernel; the tests hold them to that bit for bit. They work on any device and without
Triton, and use tensor indexing the way SGLang's own fallbacks do (``pool[:, dst] = pool[:, src]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_prefix_cache.kernels.plans import (
    ConvWindowPlan,
    RowCopyPlan,
    plan_conv_extend,
    plan_decode_tracking,
    plan_slot_copy,
    plan_ssm_extend,
)
from hybrid_prefix_cache.kernels.validation import SlotIndices


def run_row_copy_plan(plan: RowCopyPlan) -> None:
    """Execute a :class:`RowCopyPlan` with tensor indexing."""
    if plan.is_empty:
        return
    n = plan.num_pairs
    src = plan.src_slots[:n].long()
    dst = plan.dst_slots[:n].long()
    selected = (src >= 0) & (src < plan.num_src_slots) & (dst >= 0) & (dst < plan.num_dst_slots)
    if plan.mask is not None:
        selected &= plan.mask[:n] != 0
    if plan.same_pool:
        selected &= src != dst
    src, dst = src[selected], dst[selected]
    for (_, source), (_, target) in zip(plan.src, plan.dst, strict=True):
        if target.numel():
            target[:, dst] = source[:, src].to(target.dtype)


def run_conv_window_plan(plan: ConvWindowPlan) -> None:
    """Execute a :class:`ConvWindowPlan` the way the GDN backend does: gather, transpose, index-assign."""
    num_tokens = plan.tokens.shape[1]
    if plan.is_empty or num_tokens == 0:
        return
    dst = plan.dst_slots.long()
    rows = (dst >= 0) & (dst < plan.conv_states.shape[0])
    positions = plan.token_index.long()[rows]
    dst = dst[rows]
    windows = plan.tokens[:, positions.clamp(0, num_tokens - 1)].transpose(0, 1)
    # Positions outside the token range (possible only with check_indices=False) leave the state untouched,
    # as the kernel's guard does.
    in_range = ((positions >= 0) & (positions < num_tokens)).unsqueeze(1)
    plan.conv_states[dst] = torch.where(in_range, windows.to(plan.conv_states.dtype), plan.conv_states[dst])


def track_states_decode_reference(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    ssm_states: torch.Tensor,
    cache_indices: SlotIndices,
    track_mask: torch.Tensor,
    track_indices: SlotIndices,
    batch_size: int | None = None,
    *,
    skip_negative_slots: bool = False,
    check_indices: bool = True,
) -> None:
    """Reference for :func:`~hybrid_prefix_cache.kernels.track_state.track_states_decode`."""
    run_row_copy_plan(
        plan_decode_tracking(
            conv_states,
            ssm_states,
            cache_indices,
            track_mask,
            track_indices,
            batch_size,
            skip_negative_slots=skip_negative_slots,
            check_indices=check_indices,
        )
    )


def copy_state_slots_reference(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    temporal_states: torch.Tensor | None,
    src_indices: SlotIndices,
    dst_indices: SlotIndices,
    *,
    dst_conv_states: torch.Tensor | Sequence[torch.Tensor] | None = None,
    dst_temporal_states: torch.Tensor | None = None,
    check_indices: bool = True,
) -> None:
    """Reference for :func:`~hybrid_prefix_cache.kernels.track_state.copy_state_slots`."""
    run_row_copy_plan(
        plan_slot_copy(
            conv_states,
            temporal_states,
            src_indices,
            dst_indices,
            dst_conv_states=dst_conv_states,
            dst_temporal_states=dst_temporal_states,
            check_indices=check_indices,
        )
    )


def track_ssm_states_extend_reference(
    h: torch.Tensor | None,
    ssm_states: torch.Tensor,
    track_ssm_h_src: SlotIndices,
    track_ssm_h_dst: SlotIndices,
    track_ssm_final_src: SlotIndices,
    track_ssm_final_dst: SlotIndices,
    *,
    check_indices: bool = True,
) -> None:
    """Reference for :func:`~hybrid_prefix_cache.kernels.track_state.track_ssm_states_extend`."""
    for plan in plan_ssm_extend(
        h,
        ssm_states,
        track_ssm_h_src,
        track_ssm_h_dst,
        track_ssm_final_src,
        track_ssm_final_dst,
        check_indices=check_indices,
    ):
        run_row_copy_plan(plan)


def track_conv_states_extend_reference(
    mixed_qkv: torch.Tensor,
    conv_states: torch.Tensor,
    track_conv_indices: torch.Tensor,
    conv_states_mask_indices: SlotIndices,
    *,
    check_indices: bool = True,
) -> None:
    """Reference for :func:`~hybrid_prefix_cache.kernels.track_state.track_conv_states_extend`."""
    run_conv_window_plan(
        plan_conv_extend(
            mixed_qkv, conv_states, track_conv_indices, conv_states_mask_indices, check_indices=check_indices
        )
    )
