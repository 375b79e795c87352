"""Cost model: each FLOP formula against hand arithmetic, bundled configs, config parsing and its errors."""

import dataclasses
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybrid_prefix_cache.cost_model import (
    BUNDLED_MODELS,
    GDN_CHUNK_SIZE,
    ModelSpec,
    load_model_spec,
    model_spec_from_hf_config,
)

# A spec with no layers at all; each test switches on the one component it checks.
EMPTY = ModelSpec(
    name="empty",
    hidden_size=8,
    num_attention_layers=0,
    num_attention_heads=0,
    num_kv_heads=0,
    head_dim=0,
    num_state_layers=0,
    state_layer_kind="mamba2",
    conv_state_shape=(20, 3),
    ssm_state_shape=(4, 4, 2),
    num_mlp_layers=0,
    intermediate_size=0,
    num_moe_layers=0,
    moe_intermediate_size=0,
    num_experts_per_tok=0,
    num_shared_experts=0,
    dtype_bytes=2,
    state_dtype_bytes=2,
)


def with_(**changes: object) -> ModelSpec:
    return dataclasses.replace(EMPTY, **changes)


def test_empty_spec_costs_nothing() -> None:
    assert EMPTY.prefill_flops(1000) == 0.0


def test_attention_reduces_to_marconi_without_gqa() -> None:
    # heads * head_dim == D == 8, kv_heads == heads: Marconi's 8*L*D^2 + 4*L^2*D at L = 10
    # = 8*10*64 + 4*100*8 = 5120 + 3200 = 8320.
    spec = with_(num_attention_layers=1, num_attention_heads=2, num_kv_heads=2, head_dim=4)
    assert spec.prefill_flops(10) == 8320
    three_layers = dataclasses.replace(spec, num_attention_layers=3)
    assert three_layers.prefill_flops(10) == 3 * 8320


def test_attention_with_gqa_and_output_gate() -> None:
    # D = 8, 4 query heads x 4 (q width 16), 1 KV head (kv width 4), L = 10:
    # q 2*10*8*16 = 2560, k+v 2*2*10*8*4 = 1280, o 2*10*16*8 = 2560, scores+values 4*10^2*16 = 6400 -> 12800.
    spec = with_(num_attention_layers=1, num_attention_heads=4, num_kv_heads=1, head_dim=4)
    assert spec.prefill_flops(10) == 12800
    # The output gate doubles the query projection: + 2560.
    assert dataclasses.replace(spec, attention_output_gate=True).prefill_flops(10) == 15360


def test_mlp_ungated_is_marconi_and_gated_has_three_projections() -> None:
    # Ungated with I = 4D = 32: Marconi's 16*L*D^2 = 16*10*64 = 10240 (= 4*L*D*I).
    assert with_(num_mlp_layers=1, intermediate_size=32, mlp_gated=False).prefill_flops(10) == 10240
    # Gated: 6*L*D*I = 6*10*8*32 = 15360; two layers double it.
    assert with_(num_mlp_layers=2, intermediate_size=32).prefill_flops(10) == 2 * 15360


def test_moe_counts_router_active_and_shared_experts() -> None:
    # D = 8, L = 10, 4 experts (router 2*10*8*4 = 640), 2 active gated experts of 16 (2 * 6*10*8*16 = 15360),
    # 1 shared gated expert of 24 (6*10*8*24 = 11520): 27520.
    spec = with_(
        num_moe_layers=1,
        moe_intermediate_size=16,
        num_experts_per_tok=2,
        num_experts=4,
        num_shared_experts=1,
        shared_expert_intermediate_size=24,
    )
    assert spec.prefill_flops(10) == 27520
    # Shared experts default to the routed expert size: 640 + 15360 + 6*10*8*16 (7680) = 23680.
    assert dataclasses.replace(spec, shared_expert_intermediate_size=None).prefill_flops(10) == 23680


def test_mamba2_reduces_to_marconi_at_expand_two() -> None:
    # D = 8, d_inner = 4 heads x 4 = 16 = 2D, N = 2, L = 10: Marconi's 12*L*D^2 + 16*L*D*N + 10*L*D
    # = 12*10*64 + 16*10*8*2 + 10*10*8 = 7680 + 2560 + 800 = 11040.
    spec = with_(num_state_layers=1, conv_state_shape=(20, 3), ssm_state_shape=(4, 4, 2))
    assert spec.prefill_flops(10) == 11040


def test_mamba_inner_size_override_decouples_flops_from_state() -> None:
    # A D-wide state (2 heads x 4 = 8 channels) behind a 2D-wide projection, as in Marconi's model,
    # costs the same as above; without the override the 8-wide inner gives 6*10*8*8 + 8*10*8*2 + 5*10*8 = 5520.
    narrow = with_(num_state_layers=1, conv_state_shape=(20, 3), ssm_state_shape=(2, 4, 2))
    assert narrow.prefill_flops(10) == 5520
    assert dataclasses.replace(narrow, state_inner_size=16).prefill_flops(10) == 11040


def test_mamba1_uses_the_same_formula() -> None:
    spec = with_(num_state_layers=1, state_layer_kind="mamba1", conv_state_shape=(16, 3), ssm_state_shape=(16, 2))
    assert spec.prefill_flops(10) == 11040


def test_gated_delta_net_flops() -> None:
    # D = 8; 1 key head and 2 value heads of dim 4: key width 4, value width 8, conv channels 2*4 + 8 = 16,
    # kernel 4. Per token: projections 2*8*(2*4 + 2*8 + 2*2) = 448 plus out 2*8*8 = 128; conv 2*4*16 = 128;
    # delta rule per value head with C = 64: 6*4*4 + 64*(6*4 + 4*4) + 64^2/3 = 96 + 2560 + 1365.33 -> x2 heads.
    assert GDN_CHUNK_SIZE == 64
    per_token = 448 + 128 + 128 + 2 * (96 + 2560 + 4096 / 3)
    spec = with_(num_state_layers=1, state_layer_kind="gdn", conv_state_shape=(16, 3), ssm_state_shape=(2, 4, 4))
    assert spec.prefill_flops(10) == pytest.approx(10 * per_token, rel=1e-12)
    # vLLM stores the conv state transposed, (kernel - 1, channels): same cost.
    transposed = dataclasses.replace(spec, conv_state_shape=(3, 16))
    assert transposed.prefill_flops(10) == pytest.approx(spec.prefill_flops(10), rel=1e-12)


def test_paper_7b_whole_model_flops_follow_marconi() -> None:
    spec = load_model_spec("paper-7b")
    length, d, n = 1000, 4096, 128
    attention = 8 * length * d**2 + 4 * length**2 * d
    mamba = 12 * length * d**2 + 16 * length * d * n + 10 * length * d
    mlp = 16 * length * d**2
    expected = 4 * attention + 24 * mamba + 28 * mlp
    assert spec.prefill_flops(length) == pytest.approx(expected, rel=1e-12)


def test_paper_7b_memory_matches_engine_figures() -> None:
    spec = load_model_spec("paper-7b")
    # SSM 64*64*128 * 2 = 1,048,576 (Marconi's D*N*2) + conv 8448*3 * 2 = 50,688.
    assert spec.state_bytes_per_layer == 1_099_264
    assert spec.state_bytes == 24 * 1_099_264 == 26_382_336
    # 2 (K and V) * 32 heads * 128 * 2 bytes = 2*D*2 = 16384 per layer, 4 layers.
    assert spec.kv_bytes_per_token == 4 * 16384
    # vLLM aligns its block to the state page: 16 * ceil(1,099,264 / (16 * 16384)) = 80 tokens (ENGINE_NOTES).
    kv_per_layer = spec.kv_bytes_per_token // spec.num_attention_layers
    assert 16 * math.ceil(spec.state_bytes_per_layer / (16 * kv_per_layer)) == 80


def test_state_dtype_applies_to_the_ssm_state_only() -> None:
    spec = dataclasses.replace(load_model_spec("paper-7b"), state_dtype_bytes=4)
    assert spec.state_bytes_per_layer == 50_688 + 2 * 1_048_576


def test_bundled_model_names() -> None:
    assert set(BUNDLED_MODELS) == {"paper-7b", "qwen3-next-80b-a3b", "nemotron-h-8b", "jamba-1.5-mini"}


def test_qwen3_next_parses_to_the_expected_spec() -> None:
    spec = load_model_spec("qwen3-next-80b-a3b")
    assert spec == ModelSpec(
        name="qwen3-next-80b-a3b",
        hidden_size=2048,
        num_attention_layers=12,
        num_attention_heads=16,
        num_kv_heads=2,
        head_dim=256,
        num_state_layers=36,
        state_layer_kind="gdn",
        conv_state_shape=(2 * 16 * 128 + 32 * 128, 3),
        ssm_state_shape=(32, 128, 128),
        num_mlp_layers=0,
        intermediate_size=0,
        num_moe_layers=48,
        moe_intermediate_size=512,
        num_experts_per_tok=10,
        num_shared_experts=1,
        dtype_bytes=2,
        state_dtype_bytes=2,
        num_experts=512,
        shared_expert_intermediate_size=512,
        attention_output_gate=True,
    )
    # conv 8192*3*2 = 49,152 + SSM 32*128*128*2 = 1,048,576; KV 2*2*256*2 = 2048 per token per layer.
    assert spec.state_bytes_per_layer == 1_097_728
    assert spec.kv_bytes_per_token == 12 * 2048
    # vLLM's block for this model: 16 * ceil(1,097,728 / (16 * 2048)) = 544 tokens (ENGINE_NOTES).
    assert 16 * math.ceil(spec.state_bytes_per_layer / (16 * 2048)) == 544


def test_nemotron_h_parses_to_the_expected_spec() -> None:
    assert load_model_spec("nemotron-h-8b") == ModelSpec(
        name="nemotron-h-8b",
        hidden_size=4096,
        num_attention_layers=4,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        num_state_layers=24,
        state_layer_kind="mamba2",
        conv_state_shape=(128 * 64 + 2 * 8 * 128, 3),
        ssm_state_shape=(128, 64, 128),
        num_mlp_layers=24,
        intermediate_size=21504,
        num_moe_layers=0,
        moe_intermediate_size=0,
        num_experts_per_tok=0,
        num_shared_experts=0,
        dtype_bytes=2,
        state_dtype_bytes=2,
        mlp_gated=False,
    )


def test_jamba_parses_to_the_expected_spec() -> None:
    spec = load_model_spec("jamba-1.5-mini")
    assert spec == ModelSpec(
        name="jamba-1.5-mini",
        hidden_size=4096,
        num_attention_layers=4,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        num_state_layers=28,
        state_layer_kind="mamba1",
        conv_state_shape=(8192, 3),
        ssm_state_shape=(8192, 16),
        num_mlp_layers=16,
        intermediate_size=14336,
        num_moe_layers=16,
        moe_intermediate_size=14336,
        num_experts_per_tok=2,
        num_shared_experts=0,
        dtype_bytes=2,
        state_dtype_bytes=2,
        num_experts=16,
    )
    # The Jamba-1.5 paper's 4 GB KV cache at 256K tokens: 4 layers * 2 * 8 * 128 * 2 bytes * 262,144.
    assert spec.kv_bytes_per_token * 262_144 == 4 * 2**30


# Prefill FLOPs per token are about twice the active non-embedding parameters: published active
# parameter counts (with embeddings) are 3.9B, 8.1B, 12B, and about 7B for Marconi's model.
@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("qwen3-next-80b-a3b", 2.8e9, 3.9e9),
        ("nemotron-h-8b", 6.5e9, 8.1e9),
        ("jamba-1.5-mini", 10.5e9, 12e9),
        ("paper-7b", 6e9, 7e9),
    ],
)
def test_bundled_models_have_plausible_costs(name: str, low: float, high: float) -> None:
    spec = load_model_spec(name)
    # prefill_flops(L) = a*L + b*L^2, so prefill_flops(2) - 2*prefill_flops(1) = 2b.
    quadratic = (spec.prefill_flops(2) - 2 * spec.prefill_flops(1)) / 2
    flops_per_token = spec.prefill_flops(1) - quadratic
    assert low < flops_per_token / 2 < high
    assert 5e6 < spec.state_bytes < 1e8
    assert 1e4 < spec.kv_bytes_per_token < 1e5


@given(
    name=st.sampled_from(BUNDLED_MODELS),
    cuts=st.lists(st.integers(min_value=0, max_value=200_000), min_size=3, max_size=3),
)
def test_costs_add_up_along_a_prefix(name: str, cuts: list[int]) -> None:
    spec = load_model_spec(name)
    start, middle, end = sorted(cuts)
    rel = 1e-9
    assert spec.segment_flops(start, middle) + spec.segment_flops(middle, end) == pytest.approx(
        spec.segment_flops(start, end), rel=rel
    )
    assert spec.segment_flops(start, end) == pytest.approx(spec.prefill_flops(end) - spec.prefill_flops(start), rel=rel)
    assert spec.extend_flops(start, end - start) == pytest.approx(spec.segment_flops(start, end), rel=rel)
    assert spec.flops_saved(end) == spec.prefill_flops(end)
    assert spec.segment_flops(start, middle) <= spec.segment_flops(start, end)


def test_extend_after_a_prefix_costs_more_than_from_scratch() -> None:
    # Attention's quadratic term: 100 new tokens after 1000 cached ones attend to the prefix too.
    spec = load_model_spec("paper-7b")
    assert spec.extend_flops(1000, 100) > spec.prefill_flops(100)
    assert spec.extend_flops(0, 100) == spec.prefill_flops(100)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda spec: spec.prefill_flops(-1), "num_tokens"),
        (lambda spec: spec.extend_flops(-1, 5), "prefix_len"),
        (lambda spec: spec.segment_flops(5, 4), "start <= end"),
        (lambda spec: spec.segment_flops(-1, 4), "start <= end"),
    ],
)
def test_negative_or_reversed_token_ranges_are_rejected(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(load_model_spec("paper-7b"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"state_layer_kind": "rwkv"}, "state_layer_kind"),
        ({"ssm_state_shape": (4, 2)}, "ssm_state_shape"),
        ({"conv_state_shape": (20, 0)}, "conv_state_shape"),
        ({"num_mlp_layers": -1}, "num_mlp_layers"),
        ({"num_mlp_layers": 1}, "intermediate_size"),
        ({"num_attention_layers": 1}, "num_attention_heads"),
        ({"num_attention_layers": 1, "num_attention_heads": 3, "num_kv_heads": 2, "head_dim": 4}, "multiple"),
        ({"num_moe_layers": 1, "moe_intermediate_size": 4}, "num_experts_per_tok"),
        ({"num_moe_layers": 1, "moe_intermediate_size": 4, "num_experts_per_tok": 3, "num_experts": 2}, "exceeds"),
        ({"dtype_bytes": 0}, "dtype_bytes"),
        ({"state_inner_size": 0}, "state_inner_size"),
        ({"state_layer_kind": "gdn", "conv_state_shape": (9, 3), "ssm_state_shape": (2, 4, 4)}, "GatedDeltaNet"),
        ({"name": ""}, "name"),
    ],
)
def test_invalid_specs_are_rejected(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        with_(**changes)


def bundled_config(name: str) -> dict:
    from importlib import resources

    return json.loads((resources.files("hybrid_prefix_cache") / "models" / f"{name}.json").read_text())


def test_loading_from_a_config_path_and_directory(tmp_path) -> None:
    config = bundled_config("nemotron-h-8b")
    config["mamba_ssm_cache_dtype"] = "float32"
    model_dir = tmp_path / "My-Nemotron"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    from_dir = load_model_spec(model_dir)
    from_file = load_model_spec(str(model_dir / "config.json"))
    assert from_dir == from_file
    assert from_dir.name == "My-Nemotron"
    # fp32 SSM state, bf16 conv state: 128*64*128*4 + 10240*3*2.
    assert from_dir.state_bytes_per_layer == 4_194_304 + 61_440
    other = tmp_path / "variant.json"
    other.write_text(json.dumps(config))
    assert load_model_spec(other).name == "variant"


def test_head_dim_defaults_to_hidden_over_heads_and_accepts_the_older_key() -> None:
    config = bundled_config("jamba-1.5-mini")
    assert model_spec_from_hf_config(config).head_dim == 4096 // 32
    config["attention_head_dim"] = 64
    assert model_spec_from_hf_config(config).head_dim == 64


def test_qwen3_next_layer_types_and_mlp_only_layers() -> None:
    config = bundled_config("qwen3-next-80b-a3b")
    config.update(
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mlp_only_layers=[0],
        dtype="float32",
    )
    del config["torch_dtype"]
    spec = model_spec_from_hf_config(config, "tiny")
    assert (spec.num_attention_layers, spec.num_state_layers) == (1, 3)
    assert (spec.num_mlp_layers, spec.num_moe_layers, spec.intermediate_size) == (1, 3, 5120)
    assert spec.dtype_bytes == 4


def test_nemotron_moe_layers() -> None:
    config = bundled_config("nemotron-h-8b")
    config.update(
        hybrid_override_pattern="ME*E",
        num_hidden_layers=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=512,
    )
    spec = model_spec_from_hf_config(config)
    assert (spec.num_state_layers, spec.num_moe_layers, spec.num_attention_layers, spec.num_mlp_layers) == (1, 2, 1, 0)
    assert (spec.num_experts, spec.num_shared_experts, spec.shared_expert_intermediate_size) == (8, 1, 512)
    assert not spec.mlp_gated


@pytest.mark.parametrize(
    ("base", "kind", "extra"),
    [
        ("jamba-1.5-mini", "mamba1", {}),
        ("qwen3-next-80b-a3b", "gdn", {"num_moe_layers": 2}),
    ],
)
def test_layer_counts_format_takes_each_state_kind(base: str, kind: str, extra: dict) -> None:
    config = bundled_config(base)
    config.update(
        model_type="hybrid_layer_counts",
        state_layer_kind=kind,
        num_attention_layers=0,
        num_state_layers=3,
        num_mlp_layers=1,
        mlp_gated=True,
        **extra,
    )
    spec = model_spec_from_hf_config(config)
    reference = load_model_spec(base)
    assert spec.state_layer_kind == kind
    assert spec.state_bytes_per_layer == reference.state_bytes_per_layer
    assert spec.num_attention_layers == 0 and spec.kv_bytes_per_token == 0
    assert spec.num_moe_layers == extra.get("num_moe_layers", 0)


def test_unreadable_config_files_are_rejected(tmp_path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_spec(tmp_path)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_model_spec(bad)
    with pytest.raises(ValueError, match="neither a bundled model"):
        load_model_spec("paper-8b")
    with pytest.raises(ValueError, match="neither a bundled model"):
        load_model_spec(tmp_path / "missing")


def _edit(name: str, **changes: object) -> dict:
    config = bundled_config(name)
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    return config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_edit("paper-7b", model_type=None), "'model_type' is missing"),
        ({"model_type": "llama", "hidden_size": 4096}, "'model_type' is 'llama'"),
        (_edit("jamba-1.5-mini", attn_layer_period=1, attn_layer_offset=0), "not a hybrid model"),
        (_edit("nemotron-h-8b", hybrid_override_pattern="*-*-", num_hidden_layers=4), "not a hybrid model"),
        (_edit("qwen3-next-80b-a3b", full_attention_interval=1), "not a hybrid model"),
        (_edit("paper-7b", num_state_layers=0), "not a hybrid model"),
        (_edit("qwen3-next-80b-a3b", linear_num_value_heads=None), "'linear_num_value_heads' is missing"),
        (_edit("qwen3-next-80b-a3b", layer_types=["full_attention"]), "'layer_types'"),
        (_edit("qwen3-next-80b-a3b", layer_types=["sliding_attention"] * 48), "unsupported entries"),
        (_edit("qwen3-next-80b-a3b", mlp_only_layers=3), "'mlp_only_layers'"),
        (_edit("nemotron-h-8b", hybrid_override_pattern="M-M-"), "num_hidden_layers is 52"),
        (_edit("nemotron-h-8b", hybrid_override_pattern="M-X-", num_hidden_layers=4), "unknown layer codes"),
        (_edit("nemotron-h-8b", hybrid_override_pattern=None), "'hybrid_override_pattern'"),
        (_edit("nemotron-h-8b", moe_latent_size=1024), "'moe_latent_size'"),
        (_edit("nemotron-h-8b", mamba_num_heads=0), "'mamba_num_heads' must be an integer >= 1"),
        (_edit("jamba-1.5-mini", attn_layer_offset=8), "'attn_layer_offset'"),
        (_edit("jamba-1.5-mini", mamba_d_state="16"), "'mamba_d_state'"),
        (_edit("jamba-1.5-mini", num_attention_heads=7, num_key_value_heads=7), "'head_dim' is missing"),
        (_edit("jamba-1.5-mini", torch_dtype=None), "'torch_dtype'"),
        (_edit("jamba-1.5-mini", torch_dtype="int4"), "unknown dtype"),
        (_edit("paper-7b", state_layer_kind="rwkv"), "'state_layer_kind'"),
        (_edit("paper-7b", mlp_gated=None), "'mlp_gated'"),
        (_edit("paper-7b", expand=None), "'expand' is missing"),
    ],
)
def test_bad_configs_name_the_problem(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_spec_from_hf_config(config)
