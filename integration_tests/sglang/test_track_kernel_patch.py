"""patches/sglang_track_kernels.py against the real SGLang 0.5.20: upstream's call sites run our kernels.

Upstream's own methods (``MambaAttnBackendBase._track_mamba_state_decode`` and the call shape of
``Mamba2AttnBackend.forward``) are driven on a real ``MambaPool`` before and after ``apply()``; the pools must end
up byte-identical and our kernel must have been launched. The extend helpers are compared with upstream's
``_init_track_conv_indices``/``_init_track_ssm_indices``/``_track_mamba_state_extend`` on the same inputs.

Run: ``TRITON_INTERPRET=1 .venvs/sglang/bin/python -m pytest integration_tests/sglang/test_track_kernel_patch.py``
(the module sets TRITON_INTERPRET=1 itself when it is unset, before any Triton kernel is defined).
"""

from __future__ import annotations

import os

# Triton picks the interpreter when a kernel is decorated, i.e. when its module is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import sglang.kernels.ops.mamba.mamba_state_scatter_triton as upstream_kernels
import sglang.srt.layers.attention.hybrid_linear_attn_backend as backend_module
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache.memory_pool import MambaPool

from hybrid_prefix_cache import kernels
from hybrid_prefix_cache.kernels import track_state
from hybrid_prefix_cache.patches import sglang_track_kernels as patch

_RUNNABLE = torch.cuda.is_available() or (
    track_state.KERNELS_INTERPRETED
    and type(upstream_kernels.track_mamba_state_if_needed_kernel).__name__ == "InterpretedFunction"
)
pytestmark = pytest.mark.skipif(
    not _RUNNABLE,
    reason="Triton kernels were defined before TRITON_INTERPRET=1 was set and there is no GPU; run this module "
    "with TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() and not track_state.KERNELS_INTERPRETED else "cpu"
MAMBA_LAYER_IDS = [0, 2, 3, 5]
FUNCTION_NAMES = ("track_mamba_states_if_needed", "track_mamba_states_all_layers")


@pytest.fixture
def unpatched() -> Iterator[None]:
    """Start from upstream's functions and put them back afterwards (other tests in the session expect them)."""
    patch.revert()
    yield
    patch.revert()


def real_pool(conv_dtype: torch.dtype, ssm_dtype: torch.dtype, seed: int) -> MambaPool:
    """SGLang's own MambaPool (Mamba2-style shapes, 4 layers, 9 slots) filled with random bytes."""
    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=64, n_groups=2, num_heads=4, head_dim=16, state_size=8, conv_kernel=4
    )
    params = Mamba2CacheParams(
        shape=shape, layers=MAMBA_LAYER_IDS, dtype=Mamba2StateDType(conv=conv_dtype, temporal=ssm_dtype)
    )
    pool = MambaPool(size=8, spec_state_size=8, cache_params=params, mamba_layer_ids=MAMBA_LAYER_IDS, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for tensor in [*pool.mamba_cache.conv, pool.mamba_cache.temporal]:
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    return pool


def pool_bytes(pool: MambaPool) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in [*pool.mamba_cache.conv, pool.mamba_cache.temporal]]


def backend_for(pool: MambaPool, track_indices: torch.Tensor, check_freed_slots: bool) -> object:
    """A MambaAttnBackendBase with only the attributes its decode tracking reads (no model runner needed)."""
    backend = object.__new__(backend_module.MambaAttnBackendBase)
    backend.req_to_token_pool = SimpleNamespace(
        mamba_pool=pool, mamba_map={layer: i for i, layer in enumerate(MAMBA_LAYER_IDS)}
    )
    backend.forward_metadata = SimpleNamespace(mamba_track_indices=track_indices)
    backend.enable_unified_memory = check_freed_slots
    return backend


def decode_step(pool: MambaPool, all_layers: bool, check_freed_slots: bool) -> None:
    """One decode step's tracking through upstream's ``_track_mamba_state_decode``, layer by layer."""
    cache = torch.tensor([0, 1, 2, -1 if check_freed_slots else 3], dtype=torch.int32, device=DEVICE)
    mask = torch.tensor([True, False, True, True], device=DEVICE)
    track = torch.tensor([4, 5, 6, 7], dtype=torch.int64, device=DEVICE)
    backend = backend_for(pool, track, check_freed_slots)
    batch = SimpleNamespace(mamba_track_mask=mask, batch_size=4)
    for index, layer_id in enumerate(MAMBA_LAYER_IDS):
        layer = pool.mamba_cache.at_layer_idx(index)
        backend._track_mamba_state_decode(batch, layer.conv[0], layer.temporal, cache, layer_id if all_layers else None)


def count_our_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    launches = [0]
    real = track_state.row_copy_launch

    def counted(*args: object, **kwargs: object) -> object:
        launches[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(track_state, "row_copy_launch", counted)
    return launches


def test_apply_rebinds_upstream_names_idempotently(unpatched: None) -> None:
    originals = {name: getattr(upstream_kernels, name) for name in FUNCTION_NAMES}
    assert all(getattr(backend_module, name) is originals[name] for name in FUNCTION_NAMES)
    patch.apply()
    first = {name: getattr(backend_module, name) for name in FUNCTION_NAMES}
    for name in FUNCTION_NAMES:
        assert first[name] is not originals[name]
        assert first[name].__module__ == patch.__name__
        assert getattr(upstream_kernels, name) is first[name]
    patch.apply()
    assert all(getattr(backend_module, name) is first[name] for name in FUNCTION_NAMES)
    assert patch.upstream_functions() == originals
    patch.apply(check_indices=True)
    for name in FUNCTION_NAMES:
        current = getattr(backend_module, name)
        assert current is not first[name] and current is not originals[name]
        assert getattr(upstream_kernels, name) is current
    patch.revert()
    assert all(getattr(backend_module, name) is originals[name] for name in FUNCTION_NAMES)
    assert all(getattr(upstream_kernels, name) is originals[name] for name in FUNCTION_NAMES)


@pytest.mark.parametrize("all_layers", [True, False], ids=["all-layers", "per-layer"])
@pytest.mark.parametrize("check_freed_slots", [False, True])
@pytest.mark.parametrize(
    ("conv_dtype", "ssm_dtype"), [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)]
)
def test_decode_call_site_runs_ours_and_leaves_upstreams_pool(
    unpatched: None,
    monkeypatch: pytest.MonkeyPatch,
    all_layers: bool,
    check_freed_slots: bool,
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
) -> None:
    upstream_pool = real_pool(conv_dtype, ssm_dtype, seed=1)
    our_pool = real_pool(conv_dtype, ssm_dtype, seed=1)
    before = pool_bytes(upstream_pool)
    decode_step(upstream_pool, all_layers, check_freed_slots)
    assert any(not torch.equal(a, b) for a, b in zip(before, pool_bytes(upstream_pool), strict=True))

    patch.apply()
    launches = count_our_launches(monkeypatch)
    decode_step(our_pool, all_layers, check_freed_slots)
    assert launches[0] == (1 if all_layers else len(MAMBA_LAYER_IDS))
    for ours, theirs in zip(pool_bytes(our_pool), pool_bytes(upstream_pool), strict=True):
        assert torch.equal(ours, theirs)


def test_mamba2_forward_call_shape(unpatched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Mamba2AttnBackend.forward`` passes the trailing ``num_decodes`` rows of mixed prefill+decode batches."""
    pools = [real_pool(torch.bfloat16, torch.float32, seed=2) for _ in range(2)]
    cache = torch.tensor([8, 8, 0, 1, 2], dtype=torch.int32, device=DEVICE)
    mask = torch.tensor([True, True, True, False, True], device=DEVICE)
    track = torch.tensor([3, 3, 4, 5, 6], dtype=torch.int64, device=DEVICE)
    num_decodes = 3

    def forward_tracking(pool: MambaPool) -> None:
        for index in range(len(MAMBA_LAYER_IDS)):
            layer = pool.mamba_cache.at_layer_idx(index)
            backend_module.track_mamba_states_if_needed(
                layer.conv[0],
                layer.temporal,
                cache[-num_decodes:],
                mask[-num_decodes:],
                track[-num_decodes:],
                num_decodes,
                check_freed_slots=False,
            )

    forward_tracking(pools[0])
    patch.apply()
    launches = count_our_launches(monkeypatch)
    forward_tracking(pools[1])
    assert launches[0] == len(MAMBA_LAYER_IDS)
    for ours, theirs in zip(pool_bytes(pools[1]), pool_bytes(pools[0]), strict=True):
        assert torch.equal(ours, theirs)


# ------------------------------------------------------------ extend helpers against upstream's methods


@st.composite
def extend_batches(draw: st.DrawFn) -> dict:
    batch = draw(st.integers(1, 6))
    prefix = draw(st.lists(st.integers(0, 200), min_size=batch, max_size=batch))
    extend = draw(st.lists(st.integers(1, 200), min_size=batch, max_size=batch))
    mask = draw(st.lists(st.booleans(), min_size=batch, max_size=batch).filter(any))
    return {
        "chunk": draw(st.sampled_from([8, 64])),
        "prefix": prefix,
        "extend": extend,
        "track_seqlens": [p + draw(st.integers(1, e)) for p, e in zip(prefix, extend, strict=True)],
        "mask": mask,
        "cache": list(draw(st.permutations(range(2 * batch)))[:batch]),
        "track": [2 * batch + i for i in range(batch)],
    }


def _tensor_or_none_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(extend_batches())
def test_track_index_functions_equal_upstream_methods(case: dict) -> None:
    t = {k: torch.tensor(v) for k, v in case.items() if k != "chunk"}
    t["mask"] = t["mask"].bool()
    chunk = case["chunk"]
    aligned = kernels.mamba_track_aligned_lens(t["track_seqlens"], t["prefix"], chunk)
    starts = torch.tensor([0, *torch.cumsum(t["extend"], 0).tolist()], dtype=torch.int32)
    forward_batch = SimpleNamespace(
        mamba_track_mask=t["mask"],
        mamba_track_indices=t["track"],
        mamba_track_seqlens=t["track_seqlens"],
        extend_prefix_lens=t["prefix"],
        extend_seq_lens=t["extend"],
        mamba_track_aligned_lens=lambda: aligned,
    )
    for backend_class, layout in [
        (backend_module.MambaAttnBackendBase, "per_sequence"),
        (backend_module.Mamba2AttnBackend, "global_grid"),
    ]:
        backend = object.__new__(backend_class)
        backend.device = "cpu"
        backend._mamba_chunk_size = chunk
        backend.conv_states_shape = (9, 32, 3)
        upstream_conv = backend_module.MambaAttnBackendBase._init_track_conv_indices(backend, starts, forward_batch)
        ours_conv = kernels.init_track_conv_indices(starts, aligned, t["mask"], 3)
        assert torch.equal(upstream_conv, ours_conv)
        upstream_ssm = backend_module.MambaAttnBackendBase._init_track_ssm_indices(backend, t["cache"], forward_batch)
        ours_ssm = kernels.init_track_ssm_indices(
            t["cache"], t["mask"], t["track"], t["track_seqlens"], t["prefix"], t["extend"], chunk, h_layout=layout
        )
        assert len(upstream_ssm) == len(ours_ssm)
        for name, theirs, ours in zip(ours_ssm._fields, upstream_ssm, ours_ssm, strict=True):
            assert _tensor_or_none_equal(ours, theirs), name


@pytest.mark.parametrize(("h_dtype", "ssm_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_ssm_extend_equals_upstream_track_mamba_state_extend(h_dtype: torch.dtype, ssm_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    h = torch.randn((1, 6, 4, 16, 8), generator=gen).to(h_dtype)
    upstream_ssm = torch.randn((9, 4, 16, 8), generator=gen).to(ssm_dtype)
    our_ssm = upstream_ssm.clone()
    metadata = SimpleNamespace(
        has_mamba_track_mask=True,
        track_ssm_h_src=torch.tensor([4, 0]),
        track_ssm_h_dst=torch.tensor([5, 6]),
        track_ssm_recompute_dst=None,
        track_ssm_final_src=torch.tensor([1]),
        track_ssm_final_dst=torch.tensor([7]),
    )
    backend = object.__new__(backend_module.MambaAttnBackendBase)
    backend_module.MambaAttnBackendBase._track_mamba_state_extend(backend, None, h, upstream_ssm, metadata)
    kernels.track_ssm_states_extend(
        h,
        our_ssm,
        metadata.track_ssm_h_src,
        metadata.track_ssm_h_dst,
        metadata.track_ssm_final_src,
        metadata.track_ssm_final_dst,
    )
    assert torch.equal(our_ssm.view(torch.uint8), upstream_ssm.view(torch.uint8))
