"""Which conv inputs and which SSM states an extend (prefill) batch must save into its track slots.

These mirror SGLang 0.5.20's ``_init_track_conv_indices`` and ``_init_track_ssm_indices`` (methods of
``MambaAttnBackendBase`` in ``layers/attention/hybrid_linear_attn_backend.py``) as free functions over tensors, so
they can be called without a backend object; their results feed :func:`track_conv_states_extend` and
:func:`track_ssm_states_extend`. The arithmetic is over a handful of integers per request, so it stays in PyTorch.

Terms: request ``i`` extends ``extend_seq_lens[i]`` new tokens after ``extend_prefix_lens[i]`` cached ones and
wants its state saved at ``mamba_track_seqlens[i]``; the saved length is floored to the chunk size ("aligned").
The conv state at a position is the ``conv_state_len`` inputs before it. The SSM state at an aligned position is
either the final recurrent state (when the whole tracked span is chunk-aligned) or an intermediate chunk state
``h`` the chunked scan produced.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch


class TrackSsmIndices(NamedTuple):
    """Indices for the SSM track copy, in the order SGLang 0.5.20's ``_init_track_ssm_indices`` returns them."""

    track_chunk_idx: torch.Tensor
    """[batch] int32: chunk index of the tracked state for unaligned tracked requests, -1 elsewhere."""
    track_ssm_h_src: torch.Tensor
    """Rows of ``h`` (chunk states) to copy, for tracked requests whose tracked span is not chunk-aligned."""
    track_ssm_h_dst: torch.Tensor
    """Track slots receiving those chunk states."""
    track_ssm_h_batch_src: torch.Tensor
    """Batch rows of those requests."""
    track_ssm_final_src: torch.Tensor
    """Working slots whose final state is copied, for tracked requests with a chunk-aligned span."""
    track_ssm_final_dst: torch.Tensor
    """Track slots receiving those final states."""
    track_ssm_seq_idx: torch.Tensor | None
    """Mamba2 only: batch rows whose tracked position is off the global chunk grid (state must be recomputed)."""
    track_ssm_end_locs: torch.Tensor | None
    """Mamba2 only: flattened token positions of those tracked states."""
    track_ssm_recompute_dst: torch.Tensor | None
    """Mamba2 only: track slots receiving the recomputed states."""


def mamba_track_aligned_lens(
    mamba_track_seqlens: torch.Tensor, extend_prefix_lens: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Tokens of each request's extend covered by its tracked state, floored to ``chunk_size``.

    SGLang 0.5.20: ``ForwardBatch.mamba_track_aligned_lens``. Values of untracked rows are meaningless.
    """
    _check_chunk_size(chunk_size)
    return ((mamba_track_seqlens - extend_prefix_lens) // chunk_size) * chunk_size


def init_track_conv_indices(
    query_start_loc: torch.Tensor,
    mamba_track_aligned_lens: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    conv_state_len: int,
) -> torch.Tensor:
    """[num_tracked, conv_state_len] flattened token positions of each tracked request's conv window.

    Request ``i``'s window is the ``conv_state_len`` inputs before ``query_start_loc[i] + aligned_len[i]``,
    clamped into the batch's token range (as upstream does; a span shorter than the window reads clamped
    positions, and such requests are not tracked by the scheduler because their aligned length is 0).
    """
    batch = mamba_track_mask.shape[0]
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc must have batch + 1 = {batch + 1} entries, got shape {tuple(query_start_loc.shape)}"
        )
    if mamba_track_aligned_lens.shape != (batch,):
        raise ValueError(
            f"mamba_track_aligned_lens must have {batch} entries, got shape {tuple(mamba_track_aligned_lens.shape)}"
        )
    if conv_state_len < 1:
        raise ValueError(f"conv_state_len must be >= 1, got {conv_state_len}")
    starts = (query_start_loc[:-1] + mamba_track_aligned_lens - conv_state_len)[mamba_track_mask.bool()]
    positions = starts.unsqueeze(-1) + torch.arange(conv_state_len, device=starts.device, dtype=starts.dtype)
    return positions.clamp(0, query_start_loc[-1] - 1)


def init_track_ssm_indices(
    mamba_cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    mamba_track_seqlens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    chunk_size: int,
    *,
    h_layout: Literal["per_sequence", "global_grid"] = "per_sequence",
) -> TrackSsmIndices:
    """Sources and destinations of the SSM track copy for one extend batch.

    ``h_layout="per_sequence"`` (GatedDeltaNet/KDA): ``h`` holds ``ceil(extend_len / chunk)`` chunk states per
    request, concatenated in batch order. ``"global_grid"`` (Mamba2): ``h`` is one chunk grid over the flattened
    batch, so a tracked position is in ``h`` only when it falls on that grid; the others are returned in the
    ``*_seq_idx``/``*_end_locs``/``*_recompute_dst`` fields for recomputation.
    Computed on the host (a few integers per request) and returned on ``mamba_cache_indices``'s device.
    """
    _check_chunk_size(chunk_size)
    if h_layout not in ("per_sequence", "global_grid"):
        raise ValueError(f"h_layout must be 'per_sequence' or 'global_grid', got {h_layout!r}")
    named = {
        "mamba_cache_indices": mamba_cache_indices,
        "mamba_track_mask": mamba_track_mask,
        "mamba_track_indices": mamba_track_indices,
        "mamba_track_seqlens": mamba_track_seqlens,
        "extend_prefix_lens": extend_prefix_lens,
        "extend_seq_lens": extend_seq_lens,
    }
    lengths = {name: t.shape[0] if t.dim() == 1 else None for name, t in named.items()}
    if len(set(lengths.values())) != 1 or None in lengths.values():
        raise ValueError(
            "all inputs must be 1-D with one entry per request; got "
            + ", ".join(f"{name} {tuple(t.shape)}" for name, t in named.items())
        )
    device = mamba_cache_indices.device
    mask = mamba_track_mask.cpu().bool()
    cache = mamba_cache_indices.cpu()
    dst_masked = mamba_track_indices.cpu()[mask]
    extend_lens = extend_seq_lens.cpu()
    lens_to_track = mamba_track_seqlens.cpu() - extend_prefix_lens.cpu()
    lens_masked = lens_to_track[mask]
    aligned = lens_masked % chunk_size == 0
    final_src = cache[mask][aligned]
    final_dst = dst_masked[aligned]
    unaligned = ~aligned
    tracked_rows = mask.nonzero().flatten()[unaligned]
    h_dst = dst_masked[unaligned]
    seq_idx = end_locs = recompute_dst = None
    if h_layout == "global_grid":
        starts = torch.zeros_like(extend_lens)
        starts[1:] = torch.cumsum(extend_lens[:-1], dim=0)
        positions = starts[tracked_rows] + (lens_masked[unaligned] // chunk_size) * chunk_size
        on_grid = positions % chunk_size == 0
        h_src = positions[on_grid] // chunk_size
        seq_idx = tracked_rows[~on_grid]
        end_locs = positions[~on_grid]
        recompute_dst = h_dst[~on_grid]
        h_dst = h_dst[on_grid]
    else:
        chunks_per_request = (extend_lens - 1) // chunk_size + 1
        first_chunk = torch.zeros_like(chunks_per_request)
        first_chunk[1:] = torch.cumsum(chunks_per_request[:-1], dim=0)
        h_src = first_chunk[mask][unaligned] + lens_masked[unaligned] // chunk_size
    chunk_idx = torch.full((mask.shape[0],), -1, dtype=torch.int32)
    chunk_idx[tracked_rows] = (lens_masked[unaligned] // chunk_size).to(torch.int32)

    def on_device(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return TrackSsmIndices(
        on_device(chunk_idx),
        on_device(h_src),
        on_device(h_dst),
        on_device(tracked_rows),
        on_device(final_src),
        on_device(final_dst),
        on_device(seq_idx),
        on_device(end_locs),
        on_device(recompute_dst),
    )


def _check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
