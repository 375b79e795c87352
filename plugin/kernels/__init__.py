"""Triton kernels that save and copy recurrent (Mamba/GatedDeltaNet) states in SGLang's state pool.

Public API (pools are SGLang's ``MambaPool.State`` tensors: conv list + temporal, each [layers, slots, ...]):

- :func:`track_states_decode`: decode tracking, every layer in one launch (working slot -> track slot).
- :func:`copy_state_slots`: slot-to-slot copies across all layers (copy-on-write, fork).
- :func:`track_conv_states_extend`, :func:`track_ssm_states_extend`: extend tracking for one layer, fed by
  :func:`init_track_conv_indices` and :func:`init_track_ssm_indices`.
- :func:`track_mamba_states_if_needed`, :func:`track_mamba_states_all_layers`: drop-ins for SGLang 0.5.20's
  functions of the same names.

Every kernel has a PyTorch reference in :mod:`hybrid_prefix_cache.kernels.reference` (same arguments, same
checks, same bytes). Importing this package works without Triton; the Triton entry points then raise
:class:`TritonUnavailableError`. To run the kernels on a CPU, set ``TRITON_INTERPRET=1`` before importing it.
"""

from hybrid_prefix_cache.kernels import reference
from hybrid_prefix_cache.kernels.track_indices import (
    TrackSsmIndices,
    init_track_conv_indices,
    init_track_ssm_indices,
    mamba_track_aligned_lens,
)
from hybrid_prefix_cache.kernels.track_state import (
    KERNELS_INTERPRETED,
    ROW_BLOCK_BYTES,
    TRITON_AVAILABLE,
    TritonUnavailableError,
    copy_state_slots,
    track_conv_states_extend,
    track_mamba_states_all_layers,
    track_mamba_states_if_needed,
    track_ssm_states_extend,
    track_states_decode,
)

__all__ = [
    "KERNELS_INTERPRETED",
    "ROW_BLOCK_BYTES",
    "TRITON_AVAILABLE",
    "TrackSsmIndices",
    "TritonUnavailableError",
    "copy_state_slots",
    "init_track_conv_indices",
    "init_track_ssm_indices",
    "mamba_track_aligned_lens",
    "reference",
    "track_conv_states_extend",
    "track_mamba_states_all_layers",
    "track_mamba_states_if_needed",
    "track_ssm_states_extend",
    "track_states_decode",
]
