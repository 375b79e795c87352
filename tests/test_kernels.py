"""State-tracking kernels: every Triton kernel equals its PyTorch reference bit for bit; references equal loops.

Triton kernels run on the CPU through the Triton interpreter: this module sets TRITON_INTERPRET=1 before anything
imports triton, so ``pytest tests`` works as is. Pools are filled with random bit patterns (NaNs with payloads,
infinities, subnormals), so comparing raw bits checks that the copies are exact.
"""

from __future__ import annotations

import os

# Must precede the first import of triton: the interpreter is chosen when a kernel is decorated.
os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_prefix_cache import kernels
from hybrid_prefix_cache.kernels import reference, track_state
from hybrid_prefix_cache.kernels.track_indices import (
    init_track_conv_indices,
    init_track_ssm_indices,
    mamba_track_aligned_lens,
)

REPO = Path(__file__).resolve().parents[1]
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_INTERPRETED = track_state.KERNELS_INTERPRETED
_CUDA = torch.cuda.is_available()
if not track_state.TRITON_AVAILABLE:
    _SKIP_REASON = "triton is not installed; the Triton kernels cannot run (references are still tested)"
elif not (_INTERPRETED or _CUDA):
    _SKIP_REASON = (
        "hybrid_prefix_cache.kernels was imported before TRITON_INTERPRET=1 was set and there is no GPU; "
        "run this module on its own or with TRITON_INTERPRET=1"
    )
else:
    _SKIP_REASON = ""
requires_triton = pytest.mark.skipif(bool(_SKIP_REASON), reason=_SKIP_REASON or "unused")
DEVICE = torch.device("cuda" if track_state.TRITON_AVAILABLE and not _INTERPRETED and _CUDA else "cpu")
# The interpreter converts float32 to float16 with numpy, which warns when a value overflows to inf (as intended).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
# Derandomized: the same examples every run, so a failure reproduces; the counts keep the module near a minute.
KERNEL_CASES = settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------- helpers


def random_bits(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern equally likely: NaNs with payloads, infinities, subnormals, -0."""
    raw = RAW[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(raw)
    return torch.randint(info.min, info.max, tuple(shape), generator=gen, dtype=raw).view(dtype).to(DEVICE)


def random_non_nan(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns with NaNs replaced by finite values (NaN encodings differ between PyTorch paths)."""
    values = random_bits(shape, dtype, gen)
    return torch.where(torch.isnan(values), torch.full_like(values, 1.5), values)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(RAW[t.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert torch.equal(bits(actual), bits(expected)), (
        f"{what}: bits differ at {(bits(actual) != bits(expected)).nonzero()[:5].tolist()}"
    )


LAYOUTS = ("contiguous", "strided_slots", "slot_major", "transposed_rows")


def make_pool(
    layout: str, layers: int, slots: int, row: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """A [layers, slots, *row] pool laid out as SGLang does (contiguous) or as strided views of other storage."""
    if layout == "contiguous":
        return random_bits((layers, slots, *row), dtype, gen)
    if layout == "strided_slots":
        return random_bits((layers, 2 * slots + 1, *row), dtype, gen)[:, 1::2]
    if layout == "slot_major":
        # SGLang's page-major "envelope" layout: all layers of one slot are adjacent.
        return random_bits((slots, layers, *row), dtype, gen).transpose(0, 1)
    if layout == "transposed_rows":
        return random_bits((layers, slots, *reversed(row)), dtype, gen).permute(0, 1, *range(len(row) + 1, 1, -1))
    raise AssertionError(layout)


def envelope_pool(
    layers: int, slots: int, conv_row: tuple[int, ...], ssm_row: tuple[int, ...], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv (bf16) and SSM (fp32) views into one byte buffer with one entry per slot, like SGLang's envelope."""
    conv_bytes = layers * 2 * int(torch.tensor(conv_row).prod())
    conv_bytes += -conv_bytes % 4
    ssm_bytes = layers * 4 * int(torch.tensor(ssm_row).prod())
    raw = bits(random_bits((slots, conv_bytes + ssm_bytes), torch.uint8, gen))
    conv_elems = layers * int(torch.tensor(conv_row).prod())
    conv = raw[:, :conv_bytes].view(torch.bfloat16)[:, :conv_elems].view(slots, layers, *conv_row).transpose(0, 1)
    ssm = raw[:, conv_bytes:].view(torch.float32).view(slots, layers, *ssm_row).transpose(0, 1)
    return conv, ssm


def clone_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies with the same strides, so the reference sees the same layout."""
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t) for t in tensors]


def slot_pairs(draw: st.DrawFn, batch: int, slots: int) -> tuple[list[int], list[int]]:
    """Distinct destinations, none read by another pair (what the kernels require); some self-copies."""
    perm = draw(st.permutations(range(slots)))
    src = list(perm[:batch])
    dst = list(perm[batch : 2 * batch])
    for i in range(batch):
        if draw(st.integers(0, 7)) == 0:
            dst[i] = src[i]
    return src, dst


# ----------------------------------------------------------------------------------- decode tracking (Triton)


@st.composite
def decode_cases(draw: st.DrawFn) -> dict:
    layers = draw(st.integers(1, 3))
    batch = draw(st.integers(0, 4))
    slots = draw(st.integers(max(2 * batch, 1), 2 * batch + 3))
    conv_rows = draw(st.lists(st.tuples(st.integers(1, 24), st.integers(1, 4)), min_size=1, max_size=2))
    ssm_row = draw(st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 6)))
    src, dst = slot_pairs(draw, batch, slots)
    mask = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    skip_negative = draw(st.booleans())
    for i in range(batch):
        if not mask[i]:
            # Masked-off rows may hold anything, even slots that do not exist.
            src[i] = draw(st.integers(-5, slots + 5))
            dst[i] = draw(st.integers(-5, slots + 5))
        elif skip_negative and draw(st.integers(0, 4)) == 0:
            src[i] = -1
    padding = draw(st.integers(0, 2))
    return {
        "layers": layers,
        "slots": slots,
        "conv_rows": conv_rows,
        "ssm_row": ssm_row,
        "conv_dtypes": [draw(st.sampled_from(FLOATS)) for _ in conv_rows],
        "ssm_dtype": draw(st.sampled_from(FLOATS)),
        "layout": draw(st.sampled_from(LAYOUTS)),
        "src": src + [0] * padding,
        "dst": dst + [0] * padding,
        "mask": mask + [True] * padding,
        "batch_size": batch if padding else draw(st.sampled_from([None, batch])),
        "skip_negative": skip_negative,
        "row_block_bytes": draw(st.sampled_from([64, 128, 16384])),
        "seed": draw(st.integers(0, 2**31)),
    }


@requires_triton
@KERNEL_CASES
@given(decode_cases())
def test_decode_tracking_matches_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    conv = [
        make_pool(case["layout"], case["layers"], case["slots"], row, dtype, gen)
        for row, dtype in zip(case["conv_rows"], case["conv_dtypes"], strict=True)
    ]
    ssm = make_pool(case["layout"], case["layers"], case["slots"], case["ssm_row"], case["ssm_dtype"], gen)
    expected = clone_all([*conv, ssm])
    args = (
        torch.tensor(case["src"], device=DEVICE, dtype=torch.long),
        torch.tensor(case["mask"], device=DEVICE, dtype=torch.bool),
        torch.tensor(case["dst"], device=DEVICE, dtype=torch.int32),
        case["batch_size"],
    )
    kernels.track_states_decode(
        conv, ssm, *args, skip_negative_slots=case["skip_negative"], row_block_bytes=case["row_block_bytes"]
    )
    reference.track_states_decode_reference(
        expected[:-1], expected[-1], *args, skip_negative_slots=case["skip_negative"]
    )
    for i, (actual, want) in enumerate(zip([*conv, ssm], expected, strict=True)):
        assert_same_bits(actual, want, f"state tensor {i}")


@requires_triton
def test_decode_tracking_on_an_envelope_buffer() -> None:
    gen = torch.Generator().manual_seed(7)
    conv, ssm = envelope_pool(2, 6, (48, 3), (4, 8, 8), gen)
    expected = clone_all([conv, ssm])
    src, mask, dst = torch.tensor([0, 1, 2]), torch.tensor([True, False, True]), torch.tensor([3, 4, 5])
    kernels.track_states_decode([conv], ssm, src, mask, dst, row_block_bytes=512)
    reference.track_states_decode_reference([expected[0]], expected[1], src, mask, dst)
    assert_same_bits(conv, expected[0], "conv")
    assert_same_bits(ssm, expected[1], "ssm")
    assert torch.equal(bits(ssm[:, 3]), bits(ssm[:, 0])) and not torch.equal(bits(ssm[:, 4]), bits(ssm[:, 1]))


def _signature_pool(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [random_bits((3, 9, 10, 3), torch.bfloat16, gen), random_bits((3, 9, 2, 4, 4), torch.float32, gen)]


@requires_triton
@pytest.mark.parametrize("padded", [False, True])
def test_upstream_signatures_match_reference_and_each_other(padded: bool) -> None:
    """SGLang's argument order, a batch_size shorter than the (padded) vectors, freed (-1) slots skipped."""
    cache = torch.tensor([0, 1, -1, 2] + ([-1, -1] if padded else []), dtype=torch.int32)
    mask = torch.tensor([True, True, True, False] + ([True, True] if padded else []))
    track = torch.tensor([5, 6, 7, 8] + ([0, 0] if padded else []), dtype=torch.int64)
    all_layers, expected, per_layer = _signature_pool(3), _signature_pool(3), _signature_pool(3)
    kernels.track_mamba_states_all_layers(*all_layers, cache, mask, track, 4, check_freed_slots=True)
    reference.track_states_decode_reference(*expected, cache, mask, track, 4, skip_negative_slots=True)
    for layer in range(3):
        kernels.track_mamba_states_if_needed(per_layer[0][layer], per_layer[1][layer], cache, mask, track, 4, True)
    for ours, loop, want in zip(all_layers, per_layer, expected, strict=True):
        assert_same_bits(ours, want)
        assert_same_bits(loop, want)


# ------------------------------------------------------------------------------------- slot copies (Triton)


@st.composite
def copy_cases(draw: st.DrawFn) -> dict:
    layers = draw(st.integers(1, 3))
    batch = draw(st.integers(0, 3))
    slots = draw(st.integers(max(2 * batch, 1), 2 * batch + 2))
    separate = draw(st.booleans())
    src, dst = slot_pairs(draw, batch, slots)
    if separate:
        dst = list(draw(st.permutations(range(slots)))[:batch])
    return {
        "layers": layers,
        "slots": slots,
        "conv_rows": draw(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 4)), min_size=1, max_size=3)),
        "ssm_row": draw(st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5)))),
        "dtype": draw(st.sampled_from(FLOATS)),
        "layout": draw(st.sampled_from(LAYOUTS)),
        "dst_layout": draw(st.sampled_from(LAYOUTS)),
        "src": src,
        "dst": dst,
        "separate": separate,
        "row_block_bytes": draw(st.sampled_from([64, 16384])),
        "seed": draw(st.integers(0, 2**31)),
    }


Pool = tuple[list[torch.Tensor], torch.Tensor | None]


def clone_pool(pool: Pool) -> Pool:
    conv, ssm = pool
    return clone_all(conv), None if ssm is None else clone_all([ssm])[0]


def assert_same_pool(actual: Pool, expected: Pool) -> None:
    for i, (a, e) in enumerate(zip(actual[0], expected[0], strict=True)):
        assert_same_bits(a, e, f"conv {i}")
    assert (actual[1] is None) == (expected[1] is None)
    if actual[1] is not None:
        assert_same_bits(actual[1], expected[1], "temporal")


@requires_triton
@KERNEL_CASES
@given(copy_cases())
def test_copy_state_slots_matches_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])

    def make(layout: str) -> Pool:
        conv = [make_pool(layout, case["layers"], case["slots"], row, case["dtype"], gen) for row in case["conv_rows"]]
        row = case["ssm_row"]
        return conv, None if row is None else make_pool(layout, case["layers"], case["slots"], row, torch.float32, gen)

    source = make(case["layout"])
    # The other pool has its own layout, so source and destination rows are walked with different strides.
    target = make(case["dst_layout"]) if case["separate"] else None
    expected_source = clone_pool(source)
    expected_target = clone_pool(target) if target is not None else None
    src, dst = torch.tensor(case["src"], dtype=torch.long), case["dst"]

    def into(pool: Pool | None) -> dict:
        return {} if pool is None else {"dst_conv_states": pool[0], "dst_temporal_states": pool[1]}

    kernels.copy_state_slots(*source, src, dst, **into(target), row_block_bytes=case["row_block_bytes"])
    reference.copy_state_slots_reference(*expected_source, src, dst, **into(expected_target))
    assert_same_pool(source, expected_source)
    if target is not None:
        assert_same_pool(target, expected_target)


# --------------------------------------------------------------------------------------- extend (Triton)


@st.composite
def ssm_extend_cases(draw: st.DrawFn) -> dict:
    slots = draw(st.integers(2, 8))
    num_chunks = draw(st.integers(0, 5))
    perm = draw(st.permutations(range(slots)))
    num_h = draw(st.integers(0, min(num_chunks, slots // 2)))
    num_final = draw(st.integers(0, (slots - num_h) // 2))
    final_src = list(perm[num_h : num_h + num_final])
    dst = list(perm[:num_h]) + list(perm[num_h + num_final : num_h + 2 * num_final])
    return {
        "slots": slots,
        "num_chunks": num_chunks,
        "row": draw(st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 6))),
        "h_dtype": draw(st.sampled_from(FLOATS)),
        "ssm_dtype": draw(st.sampled_from(FLOATS)),
        "batched_h": draw(st.booleans()),
        "ssm_layout": draw(st.sampled_from(LAYOUTS)),
        "h_src": [draw(st.integers(0, num_chunks - 1)) for _ in range(num_h)],
        "h_dst": dst[:num_h],
        "final_src": final_src,
        "final_dst": dst[num_h:],
        "seed": draw(st.integers(0, 2**31)),
    }


@requires_triton
@KERNEL_CASES
@given(ssm_extend_cases())
def test_ssm_extend_matches_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    make = random_bits if case["h_dtype"] == case["ssm_dtype"] else random_non_nan
    h = make((case["num_chunks"], *case["row"]), case["h_dtype"], gen)
    if case["batched_h"]:
        h = h.unsqueeze(0)
    ssm = make_pool(case["ssm_layout"], 1, case["slots"], case["row"], case["ssm_dtype"], gen)[0]
    expected = clone_all([ssm])[0]
    index = [torch.tensor(case[k], dtype=torch.long) for k in ("h_src", "h_dst", "final_src", "final_dst")]
    kernels.track_ssm_states_extend(h, ssm, *index, row_block_bytes=64)
    reference.track_ssm_states_extend_reference(h, expected, *index)
    assert_same_bits(ssm, expected, "ssm_states")


@requires_triton
@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("dst_dtype", FLOATS)
def test_float_conversions_match_pytorch(src_dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    """Round-to-nearest-even on ties, subnormals, overflow to inf, -0: the kernel's conversion is PyTorch's."""
    gen = torch.Generator().manual_seed(11)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            1.00390625,
            1.01171875,
            1.0 + 2**-8,
            1.0 + 3 * 2**-9,
            65504.0,
            65520.0,
            1e6,
            -3.4e38,
            3.3895e38,
            1e-40,
            -1e-42,
            2**-14,
            2**-24,
            2**-25,
            3 * 2**-26,
            2**-133,
            float("inf"),
            float("-inf"),
        ],
        dtype=torch.float32,
    ).to(src_dtype)
    values = torch.cat([special.to(DEVICE), random_non_nan((4, 250), src_dtype, gen).flatten()])[: 4 * 256]
    h = values[: (values.numel() // 16) * 16].view(-1, 16)
    ssm = torch.zeros((h.shape[0], 16), dtype=dst_dtype, device=DEVICE)
    rows = torch.arange(h.shape[0])
    kernels.track_ssm_states_extend(h, ssm, rows, rows, [], [], row_block_bytes=64)
    assert_same_bits(ssm, h.to(dst_dtype), f"{src_dtype} -> {dst_dtype}")


@st.composite
def conv_extend_cases(draw: st.DrawFn) -> dict:
    batch = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(1, 20), min_size=batch, max_size=batch))
    mask = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    slots = draw(st.integers(batch, batch + 3))
    return {
        "lens": lens,
        "mask": mask,
        "aligned": [draw(st.integers(0, n)) for n in lens],
        "slots": slots,
        "track": list(draw(st.permutations(range(slots)))[:batch]),
        "dim": draw(st.integers(1, 40)),
        "width": draw(st.integers(1, 4)),
        "src_dtype": draw(st.sampled_from(FLOATS)),
        "dst_dtype": draw(st.sampled_from(FLOATS)),
        "token_major": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }


@requires_triton
@KERNEL_CASES
@given(conv_extend_cases())
def test_conv_extend_matches_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    total = sum(case["lens"])
    make = random_bits if case["src_dtype"] == case["dst_dtype"] else random_non_nan
    if case["token_major"]:
        # As the GDN backend holds it: projections are [tokens, dim], transposed to [dim, tokens].
        tokens = make((total, case["dim"]), case["src_dtype"], gen).t()
    else:
        tokens = make((case["dim"], total), case["src_dtype"], gen)
    conv = random_bits((case["slots"], case["dim"], case["width"]), case["dst_dtype"], gen)
    expected = conv.clone()
    starts = torch.tensor([0, *torch.tensor(case["lens"]).cumsum(0).tolist()])
    mask = torch.tensor(case["mask"])
    positions = init_track_conv_indices(starts, torch.tensor(case["aligned"]), mask, case["width"])
    dst = torch.tensor(case["track"])[mask]
    kernels.track_conv_states_extend(tokens, conv, positions, dst, row_block_bytes=64)
    reference.track_conv_states_extend_reference(tokens, expected, positions, dst)
    assert_same_bits(conv, expected, "conv_states")


# ------------------------------------------------------------------------------- edge cases and bad input


@requires_triton
def test_empty_batches_and_self_copies_change_nothing() -> None:
    gen = torch.Generator().manual_seed(5)
    conv = random_bits((2, 4, 6, 3), torch.bfloat16, gen)
    ssm = random_bits((2, 4, 2, 3, 3), torch.float32, gen)
    before = clone_all([conv, ssm])
    empty = torch.tensor([], dtype=torch.long)
    kernels.track_states_decode(conv, ssm, empty, torch.tensor([], dtype=torch.bool), empty)
    kernels.track_states_decode(conv, ssm, torch.tensor([1, 2]), torch.tensor([True, True]), torch.tensor([1, 2]))
    kernels.copy_state_slots([conv], ssm, [], [])
    kernels.copy_state_slots([conv], ssm, [3, 0], [3, 0])
    kernels.track_ssm_states_extend(None, ssm[0], empty, empty, [1], [1])
    tokens = random_bits((6, 10), torch.bfloat16, gen)
    kernels.track_conv_states_extend(tokens, conv[0], torch.zeros((0, 3), dtype=torch.long), empty)
    assert_same_bits(conv, before[0])
    assert_same_bits(ssm, before[1])


def _pool_for_errors() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return random_bits((2, 6, 4, 3), torch.bfloat16, gen), random_bits((2, 6, 2, 2, 2), torch.float32, gen)


def _decode_call(impl: str) -> Callable[..., None]:
    return kernels.track_states_decode if impl == "triton" else reference.track_states_decode_reference


IMPLS = [pytest.param("triton", marks=requires_triton), "reference"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("src", "mask", "dst", "batch_size", "message"),
    [
        ([0, 1], [True], [2, 3], None, "mismatched lengths"),
        ([0, 1], [True, True], [2, 3], 3, "has 2 entries but batch_size is 3"),
        ([0, 6], [True, True], [2, 3], None, "cache_indices out of range: row 1 has 6"),
        ([0, 1], [True, True], [2, -1], None, "track_indices out of range: row 1 has -1"),
        ([0, 1], [True, True], [2, 2], None, "writes slot 2 twice"),
        ([0, 2], [True, True], [2, 3], None, "slot 2 is written by row 0"),
    ],
)
def test_decode_tracking_rejects_bad_indices(impl: str, src, mask, dst, batch_size, message: str) -> None:
    conv, ssm = _pool_for_errors()
    before = clone_all([conv, ssm])
    with pytest.raises(ValueError, match=message):
        _decode_call(impl)(conv, ssm, torch.tensor(src), torch.tensor(mask), torch.tensor(dst), batch_size)
    assert_same_bits(conv, before[0])
    assert_same_bits(ssm, before[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_pools_and_dtypes_are_named(impl: str) -> None:
    conv, ssm = _pool_for_errors()
    call = _decode_call(impl)
    src, mask, dst = torch.tensor([0]), torch.tensor([True]), torch.tensor([1])
    with pytest.raises(ValueError, match="ssm_states has 5 slots but conv_states has 6"):
        call(conv, ssm[:, :5], src, mask, dst)
    with pytest.raises(ValueError, match="conv_states\\[1\\] has 1 layers"):
        call([conv, conv[:1]], ssm, src, mask, dst)
    with pytest.raises(ValueError, match="cache_indices must hold integer slot indices"):
        call(conv, ssm, torch.tensor([0.0]), mask, dst)
    with pytest.raises(ValueError, match="track_indices is on meta"):
        call(conv, ssm, src, mask, torch.tensor([1], device="meta"))
    copy = kernels.copy_state_slots if impl == "triton" else reference.copy_state_slots_reference
    with pytest.raises(
        ValueError, match=r"dtype mismatch: conv_states is torch\.bfloat16 but dst_conv_states is torch\.float16"
    ):
        copy(conv, ssm, [0], [0], dst_conv_states=conv.half(), dst_temporal_states=ssm.clone())
    with pytest.raises(ValueError, match="row shape of temporal_states"):
        copy(conv, ssm, [0], [0], dst_conv_states=conv.clone(), dst_temporal_states=ssm[..., :1].clone())
    with pytest.raises(ValueError, match="dst_indices out of range"):
        copy(conv, ssm, [0], [9])
    ssm_extend = kernels.track_ssm_states_extend if impl == "triton" else reference.track_ssm_states_extend_reference
    with pytest.raises(ValueError, match="track_ssm_h_src out of range: row 0 has 4, but there are 4 chunk states"):
        ssm_extend(ssm[0, :4], ssm[0], [4], [5], [], [])
    with pytest.raises(ValueError, match="cannot convert h"):
        ssm_extend(ssm[0, :4].to(torch.int32), ssm[0], [1], [5], [], [])
    with pytest.raises(ValueError, match="writes slot 5 twice"):
        ssm_extend(ssm[0, :4], ssm[0], [1], [5], [2], [5])
    conv_extend = kernels.track_conv_states_extend if impl == "triton" else reference.track_conv_states_extend_reference
    tokens = torch.zeros((4, 10), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="track_conv_indices out of range: row 0 position 2 is 10"):
        conv_extend(tokens, conv[0], torch.tensor([[8, 9, 10]]), [1])
    with pytest.raises(ValueError, match="mismatched lengths"):
        conv_extend(tokens, conv[0], torch.tensor([[7, 8, 9]]), [1, 2])


@requires_triton
def test_unchecked_out_of_range_rows_are_skipped_not_faulted() -> None:
    conv, ssm = _pool_for_errors()
    expected = clone_all([conv, ssm])
    src, mask, dst = torch.tensor([0, 7, -3]), torch.tensor([True, True, True]), torch.tensor([1, 2, 3])
    kernels.track_states_decode(conv, ssm, src, mask, dst, check_indices=False)
    reference.track_states_decode_reference(expected[0], expected[1], src, mask, dst, check_indices=False)
    assert_same_bits(conv, expected[0])
    assert_same_bits(ssm, expected[1])
    original = _pool_for_errors()
    assert torch.equal(bits(ssm[:, 1]), bits(original[1][:, 0]))
    assert torch.equal(bits(ssm[:, 2:]), bits(original[1][:, 2:]))


def test_triton_entry_points_raise_a_clear_error_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import hybrid_prefix_cache.kernels as k\n"
        "assert not k.TRITON_AVAILABLE\n"
        "pool = torch.zeros(1, 3, 2); k.reference.copy_state_slots_reference(pool, None, [0], [1])\n"
        "try:\n"
        "    k.copy_state_slots(pool, None, [0], [1])\n"
        "except k.TritonUnavailableError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "triton is not installed" in done.stdout


@pytest.mark.skipif(not track_state.TRITON_AVAILABLE, reason="triton is not installed; nothing to compile")
def test_kernels_compile_for_gpus() -> None:
    """The interpreter is more lenient than the compiler: build every variant down to a cubin (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "hybrid_prefix_cache.kernels.compile_check", "--arch", "90"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("ok  sm_90")]
    assert len(lines) == 11, done.stdout
    flat_copies = [line for line in lines if "decode tracking, Qwen3-Next" in line or "slot copy" in line]
    assert all(" 0 B shared memory" in line and " 0 v4 loads" not in line for line in flat_copies), flat_copies


# ------------------------------------------------------------------- references against explicit loops


def test_decode_reference_equals_loops() -> None:
    gen = torch.Generator().manual_seed(21)
    layers, slots = 2, 7
    conv = [
        random_bits((layers, slots, 3, 2), torch.bfloat16, gen),
        random_bits((layers, slots, 5), torch.float16, gen),
    ]
    ssm = random_bits((layers, slots, 2, 2, 3), torch.float32, gen)
    src = [0, 1, 2, -1, 6]
    dst = [3, 4, 2, 5, 1]
    mask = [True, False, True, True, True]
    original = clone_all([*conv, ssm])
    reference.track_states_decode_reference(
        conv, ssm, torch.tensor(src), torch.tensor(mask), torch.tensor(dst), skip_negative_slots=True
    )
    for t, before in zip([*conv, ssm], original, strict=True):
        want = before.clone()
        for i in range(len(src)):
            if mask[i] and src[i] >= 0 and dst[i] >= 0:
                for layer in range(layers):
                    want[layer, dst[i]] = before[layer, src[i]]
        assert_same_bits(t, want)


def test_copy_reference_equals_loops_including_another_pool() -> None:
    gen = torch.Generator().manual_seed(22)
    conv = random_bits((3, 5, 4, 3), torch.bfloat16, gen)
    ssm = random_bits((3, 5, 2, 3), torch.float32, gen)
    other_conv = random_bits((3, 4, 4, 3), torch.bfloat16, gen)
    other_ssm = random_bits((3, 4, 2, 3), torch.float32, gen)
    original = clone_all([conv, ssm, other_conv, other_ssm])
    reference.copy_state_slots_reference(conv, ssm, [4, 0], [1, 3])
    reference.copy_state_slots_reference(
        conv, ssm, [2, 2], [0, 1], dst_conv_states=other_conv, dst_temporal_states=other_ssm
    )
    for t, before, pairs, source in [
        (conv, original[0], [(4, 1), (0, 3)], original[0]),
        (ssm, original[1], [(4, 1), (0, 3)], original[1]),
        (other_conv, original[2], [(2, 0), (2, 1)], conv),
        (other_ssm, original[3], [(2, 0), (2, 1)], ssm),
    ]:
        want = before.clone()
        for s, d in pairs:
            for layer in range(3):
                want[layer, d] = source[layer, s]
        assert_same_bits(t, want)


def test_ssm_extend_reference_equals_loops() -> None:
    gen = torch.Generator().manual_seed(23)
    h = random_non_nan((1, 4, 2, 3), torch.bfloat16, gen)
    ssm = random_bits((6, 2, 3), torch.float32, gen)
    before = ssm.clone()
    reference.track_ssm_states_extend_reference(h, ssm, [3, 0], [4, 5], [1], [2])
    want = before.clone()
    for s, d in [(3, 4), (0, 5)]:
        for i in range(2):
            for j in range(3):
                want[d, i, j] = float(h[0, s, i, j])
    want[2] = before[1]
    assert_same_bits(ssm, want)


def test_conv_extend_reference_equals_loops() -> None:
    gen = torch.Generator().manual_seed(24)
    tokens = random_bits((9, 5), torch.float16, gen).t()
    conv = random_bits((4, 5, 3), torch.float16, gen)
    before = conv.clone()
    positions = torch.tensor([[2, 3, 4], [6, 7, 8]])
    reference.track_conv_states_extend_reference(tokens, conv, positions, [3, 0])
    want = before.clone()
    for j, slot in enumerate([3, 0]):
        for d in range(5):
            for w in range(3):
                want[slot, d, w] = tokens[d, int(positions[j, w])]
    assert_same_bits(conv, want)


# ------------------------------------------------------------------------- track index construction


@st.composite
def extend_batches(draw: st.DrawFn) -> dict:
    batch = draw(st.integers(1, 6))
    chunk = draw(st.sampled_from([4, 8, 64]))
    prefix = draw(st.lists(st.integers(0, 300), min_size=batch, max_size=batch))
    extend = draw(st.lists(st.integers(1, 300), min_size=batch, max_size=batch))
    track = [p + draw(st.integers(0, e)) for p, e in zip(prefix, extend, strict=True)]
    return {
        "chunk": chunk,
        "prefix": prefix,
        "extend": extend,
        "track_seqlens": track,
        "mask": draw(st.lists(st.booleans(), min_size=batch, max_size=batch)),
        "cache": list(draw(st.permutations(range(2 * batch)))[:batch]),
        "track": [2 * batch + i for i in range(batch)],
        "width": draw(st.integers(1, 4)),
    }


@settings(max_examples=300, deadline=None, derandomize=True)
@given(extend_batches())
def test_track_indices_equal_per_request_loops(case: dict) -> None:
    chunk, prefix, extend, seqlens, mask = (case[k] for k in ("chunk", "prefix", "extend", "track_seqlens", "mask"))
    t = {k: torch.tensor(case[k]) for k in ("prefix", "extend", "track_seqlens", "mask", "cache", "track")}
    starts = [sum(extend[:i]) for i in range(len(extend) + 1)]
    aligned = mamba_track_aligned_lens(t["track_seqlens"], t["prefix"], chunk)
    assert aligned.tolist() == [(s - p) // chunk * chunk for s, p in zip(seqlens, prefix, strict=True)]

    conv = init_track_conv_indices(torch.tensor(starts), aligned, t["mask"], case["width"])
    want_conv = [
        [min(max(starts[i] + int(aligned[i]) - case["width"] + w, 0), starts[-1] - 1) for w in range(case["width"])]
        for i in range(len(extend))
        if mask[i]
    ]
    assert conv.tolist() == want_conv

    for layout in ("per_sequence", "global_grid"):
        got = init_track_ssm_indices(
            t["cache"], t["mask"], t["track"], t["track_seqlens"], t["prefix"], t["extend"], chunk, h_layout=layout
        )
        final_src, final_dst, h_src, h_dst, batch_rows, chunk_idx = [], [], [], [], [], [-1] * len(extend)
        recompute = []
        for i in range(len(extend)):
            if not mask[i]:
                continue
            span = seqlens[i] - prefix[i]
            if span % chunk == 0:
                final_src.append(case["cache"][i])
                final_dst.append(case["track"][i])
                continue
            batch_rows.append(i)
            chunk_idx[i] = span // chunk
            if layout == "per_sequence":
                h_src.append(sum((e + chunk - 1) // chunk for e in extend[:i]) + span // chunk)
                h_dst.append(case["track"][i])
            else:
                position = starts[i] + span // chunk * chunk
                if position % chunk == 0:
                    h_src.append(position // chunk)
                    h_dst.append(case["track"][i])
                else:
                    recompute.append((i, position, case["track"][i]))
        assert got.track_ssm_final_src.tolist() == final_src
        assert got.track_ssm_final_dst.tolist() == final_dst
        assert got.track_ssm_h_src.tolist() == h_src
        assert got.track_ssm_h_dst.tolist() == h_dst
        assert got.track_ssm_h_batch_src.tolist() == batch_rows
        assert got.track_chunk_idx.tolist() == chunk_idx
        if layout == "per_sequence":
            assert got.track_ssm_seq_idx is None and got.track_ssm_recompute_dst is None
        else:
            assert (
                list(
                    zip(
                        got.track_ssm_seq_idx.tolist(),
                        got.track_ssm_end_locs.tolist(),
                        got.track_ssm_recompute_dst.tolist(),
                        strict=True,
                    )
                )
                == recompute
            )


def test_track_index_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="query_start_loc must have batch \\+ 1 = 3 entries"):
        init_track_conv_indices(torch.tensor([0, 4]), torch.tensor([0, 0]), torch.tensor([True, True]), 3)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        mamba_track_aligned_lens(torch.tensor([4]), torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="one entry per request"):
        init_track_ssm_indices(*(torch.tensor([0, 1]),) * 5, torch.tensor([3]), 4)


# ------------------------------------------------------------------------------------ benchmark plumbing


@requires_triton
def test_benchmark_checks_results_against_the_reference_before_timing(capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU benchmark's comparison path, on a CPU with a tiny model and a stand-in timer."""
    from hybrid_prefix_cache.kernels import bench

    tiny = bench.StateShapes("tiny", 3, (6, 3), (2, 4, 4), "test shapes")

    def upstream_all(conv, ssm, cache, mask, track, batch_size, check_freed_slots=False) -> None:
        reference.track_states_decode_reference(conv, ssm, cache, mask, track, batch_size)

    def upstream_per_layer(conv, ssm, cache, mask, track, batch_size, check_freed_slots=False) -> None:
        reference.track_states_decode_reference(conv[None], ssm[None], cache, mask, track, batch_size)

    def timer(fn: Callable[[], None], moved: int, rep_ms: int) -> bench.Timing:
        fn()
        return bench.Timing(2.0, moved)

    args = (tiny, [1, 3], torch.bfloat16, torch.float32, 64, 1, 2**30)
    bench.bench_model(*args, (upstream_all, upstream_per_layer), device="cpu", timer=timer)
    lines = [line for line in capsys.readouterr().out.splitlines() if "bs=" in line]
    assert len(lines) == 6 and all("speedup  1.00x" in line for line in lines), lines

    def broken(*call_args: object, **kwargs: object) -> None:
        return None

    with pytest.raises(SystemExit, match="results differ from the reference"):
        bench.bench_model(*args, (broken, broken), device="cpu", timer=timer)
    bench.bench_model(*args[:-1], 1, (None, None), device="cpu", timer=timer)
    assert "skipped, two pools of 3 slots" in capsys.readouterr().out
