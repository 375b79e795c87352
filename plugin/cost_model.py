"""FLOP and memory cost model for hybrid (attention + recurrent-state) models.

Marconi's eviction weighs a cached prefix by the prefill FLOPs it saves per byte it holds. This module gives
those two numbers for a model described by a :class:`ModelSpec`, built from a bundled config
(:data:`BUNDLED_MODELS`) or from a Hugging Face ``config.json``.

FLOPs count a multiply-add as 2 and cover the layers' matrix products and scans; embeddings, the LM head,
norms and activations are left out, as in Marconi. Prefilling L tokens costs ``a*L + b*L**2``: every term
but attention's score/value products is linear in L. Marconi's per-layer formulas (hidden size D, SSM
state size N) are reproduced exactly for the model shapes they were written for:

* attention ``8*L*D**2 + 4*L**2*D``; generalised to ``2*L*D*(q_width*(1 + output_gate) + 2*kv_width) +
  2*L*q_width*D + 4*L**2*q_width`` with ``q_width = heads*head_dim`` and ``kv_width = kv_heads*head_dim``.
  Like Marconi it counts the full L x L score matrix (no causal halving).
* MLP ``16*L*D**2`` (ungated, intermediate 4D); generally ``6*L*D*I`` gated or ``4*L*D*I`` ungated.
* MoE: router ``2*L*D*experts`` plus the active routed experts and the shared experts, each an MLP.
* Mamba1/Mamba2 ``12*L*D**2 + 16*L*D*N + 10*L*D``, written for inner width ``d_inner = 2D``; generalised to
  ``6*L*D*d_inner + 8*L*d_inner*N + 5*L*d_inner``. Like Marconi it leaves out the small B/C/dt projections.
* GatedDeltaNet: projections ``2*L*D*(2*key_dim + 2*value_dim + 2*v_heads) + 2*L*value_dim*D``, depthwise conv
  ``2*L*kernel*conv_dim`` and the chunked delta rule (chunk C, per value head with key/value head dims dk, dv)
  ``L*(6*dk*dv + C*(6*dk + 4*dv) + C**2/3)``; see ``docs/cost_model.md`` for the derivation.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from math import prod
from pathlib import Path
from typing import Any

STATE_LAYER_KINDS = ("mamba2", "mamba1", "gdn")

# FLA's chunk length for the chunked gated delta rule, which both engines run for GatedDeltaNet prefill.
GDN_CHUNK_SIZE = 64

_SSM_STATE_RANK = {"mamba2": 3, "mamba1": 2, "gdn": 3}

_DTYPE_BYTES = {
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float32": 4,
    "float": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes of a hybrid model that its prefill FLOPs and cache bytes depend on (whole model, no TP split).

    ``conv_state_shape`` is 2-D: one axis is the conv channel count, the other ``conv_kernel - 1``, in
    either order (engines disagree); the larger axis is taken as the channel count. ``ssm_state_shape`` is
    ``(heads, head_dim, d_state)`` for Mamba2, ``(d_inner, d_state)`` for Mamba1 and
    ``(value_heads, key_head_dim, value_head_dim)`` for GatedDeltaNet. The conv state is stored in
    ``dtype_bytes``, the SSM state in ``state_dtype_bytes``, as both engines do.

    The defaulted fields refine the FLOP count: ``mlp_gated`` applies to dense MLPs and experts alike;
    ``num_experts`` is the router width; ``shared_expert_intermediate_size`` defaults to
    ``moe_intermediate_size``; ``attention_output_gate`` doubles the query projection (Qwen3-Next);
    ``state_inner_size`` is Mamba's projected width ``d_inner`` when it differs from the SSM state's
    channel count (Marconi's paper model keeps a D-wide state behind a 2D-wide projection).
    """

    name: str
    hidden_size: int
    num_attention_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_state_layers: int
    state_layer_kind: str
    conv_state_shape: tuple[int, ...]
    ssm_state_shape: tuple[int, ...]
    num_mlp_layers: int
    intermediate_size: int
    num_moe_layers: int
    moe_intermediate_size: int
    num_experts_per_tok: int
    num_shared_experts: int
    dtype_bytes: int
    state_dtype_bytes: int
    mlp_gated: bool = True
    num_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    attention_output_gate: bool = False
    state_inner_size: int | None = None
    _linear_flops_per_token: float = field(init=False, repr=False, compare=False)
    _quadratic_flops: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "conv_state_shape", tuple(self.conv_state_shape))
        object.__setattr__(self, "ssm_state_shape", tuple(self.ssm_state_shape))
        self._validate()
        linear = (
            self.num_attention_layers * self._attention_linear_flops_per_token()
            + self.num_state_layers * self._state_layer_flops_per_token()
            + self.num_mlp_layers * self._ffn_flops_per_token(self.intermediate_size)
            + self.num_moe_layers * self._moe_flops_per_token()
        )
        object.__setattr__(self, "_linear_flops_per_token", float(linear))
        quadratic = self.num_attention_layers * 4 * self.num_attention_heads * self.head_dim
        object.__setattr__(self, "_quadratic_flops", float(quadratic))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token holds over all attention layers."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes * self.num_attention_layers

    @property
    def state_bytes_per_layer(self) -> int:
        """Bytes of one sequence's conv + SSM state in one state layer."""
        return prod(self.conv_state_shape) * self.dtype_bytes + prod(self.ssm_state_shape) * self.state_dtype_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state over all state layers (one cached state)."""
        return self.state_bytes_per_layer * self.num_state_layers

    def prefill_flops(self, num_tokens: int) -> float:
        """Whole-model FLOPs to prefill ``num_tokens`` tokens from scratch."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return self._linear_flops_per_token * num_tokens + self._quadratic_flops * num_tokens * num_tokens

    def extend_flops(self, prefix_len: int, num_tokens: int) -> float:
        """FLOPs to prefill ``num_tokens`` tokens after a cached prefix of ``prefix_len`` tokens.

        Defined as ``prefill_flops(prefix_len + num_tokens) - prefill_flops(prefix_len)`` so that costs add
        up: the new tokens pay attention's quadratic term against the prefix too.
        """
        if prefix_len < 0 or num_tokens < 0:
            raise ValueError(f"prefix_len and num_tokens must be >= 0, got {prefix_len} and {num_tokens}")
        return self.segment_flops(prefix_len, prefix_len + num_tokens)

    def flops_saved(self, prefix_len: int) -> float:
        """FLOPs a cache hit on ``prefix_len`` tokens saves: the prefill of that prefix."""
        return self.prefill_flops(prefix_len)

    def segment_flops(self, start: int, end: int) -> float:
        """FLOPs saved by caching tokens ``[start, end)`` when ``[0, start)`` is already cached."""
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
        return self._linear_flops_per_token * (end - start) + self._quadratic_flops * (end * end - start * start)

    def _validate(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("ModelSpec.name must be a non-empty string")
        counts = {
            "hidden_size": self.hidden_size,
            "num_attention_layers": self.num_attention_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_state_layers": self.num_state_layers,
            "num_mlp_layers": self.num_mlp_layers,
            "intermediate_size": self.intermediate_size,
            "num_moe_layers": self.num_moe_layers,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_shared_experts": self.num_shared_experts,
            "dtype_bytes": self.dtype_bytes,
            "state_dtype_bytes": self.state_dtype_bytes,
            "num_experts": self.num_experts,
        }
        for key, value in counts.items():
            if not _is_int(value) or value < 0:
                raise ValueError(f"ModelSpec.{key} must be a non-negative integer, got {value!r}")
        for key in ("hidden_size", "dtype_bytes", "state_dtype_bytes"):
            if counts[key] == 0:
                raise ValueError(f"ModelSpec.{key} must be positive")
        for key in ("shared_expert_intermediate_size", "state_inner_size"):
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or value <= 0):
                raise ValueError(f"ModelSpec.{key} must be a positive integer or None, got {value!r}")
        if self.num_attention_layers:
            for key in ("num_attention_heads", "num_kv_heads", "head_dim"):
                if counts[key] == 0:
                    raise ValueError(f"ModelSpec.{key} must be positive when there are attention layers")
            if self.num_attention_heads % self.num_kv_heads:
                raise ValueError(
                    f"ModelSpec.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                    f"num_kv_heads ({self.num_kv_heads})"
                )
        if self.num_mlp_layers and not self.intermediate_size:
            raise ValueError("ModelSpec.intermediate_size must be positive when there are MLP layers")
        if self.num_moe_layers:
            for key in ("moe_intermediate_size", "num_experts_per_tok"):
                if counts[key] == 0:
                    raise ValueError(f"ModelSpec.{key} must be positive when there are MoE layers")
            if self.num_experts and self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"ModelSpec.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                    f"num_experts ({self.num_experts})"
                )
        self._validate_state_shapes()

    def _validate_state_shapes(self) -> None:
        if self.state_layer_kind not in STATE_LAYER_KINDS:
            raise ValueError(
                f"ModelSpec.state_layer_kind must be one of {STATE_LAYER_KINDS}, got {self.state_layer_kind!r}"
            )
        for key, rank in (("conv_state_shape", 2), ("ssm_state_shape", _SSM_STATE_RANK[self.state_layer_kind])):
            shape = getattr(self, key)
            if len(shape) != rank or not all(_is_int(size) and size > 0 for size in shape):
                raise ValueError(
                    f"ModelSpec.{key} for {self.state_layer_kind} must be {rank} positive integers, got {shape!r}"
                )
        if self.state_layer_kind == "gdn":
            qk_width = self._conv_channels() - self._gdn_value_width()
            if qk_width <= 0 or qk_width % 2:
                raise ValueError(
                    f"ModelSpec.conv_state_shape {self.conv_state_shape} does not fit GatedDeltaNet: the conv "
                    f"channels must be 2*key_dim + value_dim with value_dim {self._gdn_value_width()}"
                )

    def _conv_channels(self) -> int:
        return max(self.conv_state_shape)

    def _conv_kernel(self) -> int:
        return min(self.conv_state_shape) + 1

    def _gdn_value_width(self) -> int:
        value_heads, _, value_head_dim = self.ssm_state_shape
        return value_heads * value_head_dim

    def _attention_linear_flops_per_token(self) -> int:
        query_width = self.num_attention_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        query_projection = 2 * self.hidden_size * query_width * (2 if self.attention_output_gate else 1)
        return query_projection + 2 * self.hidden_size * 2 * kv_width + 2 * query_width * self.hidden_size

    def _ffn_flops_per_token(self, intermediate_size: int) -> int:
        return (6 if self.mlp_gated else 4) * self.hidden_size * intermediate_size

    def _moe_flops_per_token(self) -> int:
        shared_size = self.shared_expert_intermediate_size or self.moe_intermediate_size
        return (
            2 * self.hidden_size * self.num_experts
            + self.num_experts_per_tok * self._ffn_flops_per_token(self.moe_intermediate_size)
            + self.num_shared_experts * self._ffn_flops_per_token(shared_size)
        )

    def _state_layer_flops_per_token(self) -> float:
        if self.state_layer_kind == "gdn":
            return self._gdn_flops_per_token()
        d_state = self.ssm_state_shape[-1]
        inner = self.state_inner_size or prod(self.ssm_state_shape[:-1])
        return 6 * self.hidden_size * inner + 8 * inner * d_state + 5 * inner

    def _gdn_flops_per_token(self) -> float:
        value_heads, key_head_dim, value_head_dim = self.ssm_state_shape
        value_width = self._gdn_value_width()
        conv_channels = self._conv_channels()
        key_width = (conv_channels - value_width) // 2
        projections = 2 * self.hidden_size * (2 * key_width + 2 * value_width + 2 * value_heads)
        projections += 2 * value_width * self.hidden_size
        conv = 2 * self._conv_kernel() * conv_channels
        chunk = GDN_CHUNK_SIZE
        delta_rule_per_head = (
            6 * key_head_dim * value_head_dim + chunk * (6 * key_head_dim + 4 * value_head_dim) + chunk * chunk / 3
        )
        return projections + conv + value_heads * delta_rule_per_head


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bundled_models_dir() -> Path:
    return Path(str(resources.files("hybrid_prefix_cache") / "models"))


BUNDLED_MODELS: tuple[str, ...] = tuple(sorted(path.stem for path in _bundled_models_dir().glob("*.json")))


def load_model_spec(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """Spec of a bundled model (see :data:`BUNDLED_MODELS`) or of a Hugging Face ``config.json``.

    A path may name the file itself or a directory holding ``config.json``.
    """
    if isinstance(name_or_path, str) and name_or_path in BUNDLED_MODELS:
        return model_spec_from_hf_config(_read_json(_bundled_models_dir() / f"{name_or_path}.json"), name_or_path)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
        name = path.parent.name
    else:
        name = path.parent.name if path.name == "config.json" else path.stem
    if not path.is_file():
        raise ValueError(
            f"{os.fspath(name_or_path)!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}) "
            f"nor a config.json file or a directory containing one"
        )
    return model_spec_from_hf_config(_read_json(path), name or "custom")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def model_spec_from_hf_config(config: dict[str, Any], name: str = "custom") -> ModelSpec:
    """Spec from a Hugging Face config dict.

    Understands ``model_type`` ``qwen3_next``, ``nemotron_h`` (``hybrid_override_pattern``), ``jamba``
    (``attn_layer_period``/``offset``, ``expert_layer_period``/``offset``) and this package's own
    ``hybrid_layer_counts`` (layer counts given directly, used by ``paper-7b``). Raises ValueError naming
    the missing or invalid key otherwise.
    """
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    model_type = config.get("model_type")
    parsers = {
        "qwen3_next": _parse_qwen3_next,
        "nemotron_h": _parse_nemotron_h,
        "jamba": _parse_jamba,
        "hybrid_layer_counts": _parse_layer_counts,
    }
    if model_type is None:
        raise ValueError("config key 'model_type' is missing")
    if model_type not in parsers:
        raise ValueError(f"config key 'model_type' is {model_type!r}; supported: {', '.join(parsers)}")
    fields = parsers[model_type](config)
    if fields["num_state_layers"] == 0:
        raise ValueError(f"not a hybrid model: config ({model_type}) has no Mamba/GatedDeltaNet layers")
    dtype_bytes = _dtype_bytes(config)
    ssm_dtype = config.get("mamba_ssm_cache_dtype")
    state_dtype_bytes = dtype_bytes if ssm_dtype is None else _dtype_name_bytes("mamba_ssm_cache_dtype", ssm_dtype)
    return ModelSpec(name=name, dtype_bytes=dtype_bytes, state_dtype_bytes=state_dtype_bytes, **fields)


def _require_int(config: dict[str, Any], key: str, *, minimum: int = 1) -> int:
    if key not in config:
        raise ValueError(f"config key {key!r} is missing")
    value = config[key]
    if not _is_int(value) or value < minimum:
        raise ValueError(f"config key {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _optional_int(config: dict[str, Any], key: str, default: int, *, minimum: int = 0) -> int:
    return _require_int(config, key, minimum=minimum) if config.get(key) is not None else default


def _dtype_name_bytes(key: str, dtype: object) -> int:
    dtype_name = dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype
    if dtype_name not in _DTYPE_BYTES:
        raise ValueError(f"config key {key!r} has unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype_name]


def _dtype_bytes(config: dict[str, Any]) -> int:
    for key in ("torch_dtype", "dtype"):
        if config.get(key) is not None:
            return _dtype_name_bytes(key, config[key])
    raise ValueError("config key 'torch_dtype' (or 'dtype') is missing")


def _attention_fields(config: dict[str, Any]) -> dict[str, int]:
    hidden_size = _require_int(config, "hidden_size")
    heads = _require_int(config, "num_attention_heads")
    kv_heads = _optional_int(config, "num_key_value_heads", heads, minimum=1)
    head_dim_key = "head_dim" if config.get("head_dim") is not None else "attention_head_dim"
    if config.get(head_dim_key) is not None:
        head_dim = _require_int(config, head_dim_key)
    elif hidden_size % heads:
        raise ValueError(
            f"config key 'head_dim' is missing and hidden_size {hidden_size} is not a multiple of "
            f"num_attention_heads {heads}"
        )
    else:
        head_dim = hidden_size // heads
    return {"num_attention_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}


def _mamba2_state(config: dict[str, Any], inner_size: int | None) -> dict[str, Any]:
    """Mamba2 state shapes; ``inner_size`` None means the inner width is heads * head_dim."""
    heads = _require_int(config, "mamba_num_heads")
    head_dim = _require_int(config, "mamba_head_dim")
    d_state = _require_int(config, "ssm_state_size")
    groups = _require_int(config, "n_groups")
    kernel = _require_int(config, "conv_kernel", minimum=2)
    inner = heads * head_dim if inner_size is None else inner_size
    return {
        "state_layer_kind": "mamba2",
        "conv_state_shape": (inner + 2 * groups * d_state, kernel - 1),
        "ssm_state_shape": (heads, head_dim, d_state),
        "state_inner_size": inner_size,
    }


def _mamba1_state(config: dict[str, Any]) -> dict[str, Any]:
    inner = _require_int(config, "mamba_expand") * _require_int(config, "hidden_size")
    kernel = _require_int(config, "mamba_d_conv", minimum=2)
    return {
        "state_layer_kind": "mamba1",
        "conv_state_shape": (inner, kernel - 1),
        "ssm_state_shape": (inner, _require_int(config, "mamba_d_state")),
    }


def _gdn_state(config: dict[str, Any]) -> dict[str, Any]:
    key_heads = _require_int(config, "linear_num_key_heads")
    value_heads = _require_int(config, "linear_num_value_heads")
    key_head_dim = _require_int(config, "linear_key_head_dim")
    value_head_dim = _require_int(config, "linear_value_head_dim")
    kernel = _require_int(config, "linear_conv_kernel_dim", minimum=2)
    conv_channels = 2 * key_heads * key_head_dim + value_heads * value_head_dim
    return {
        "state_layer_kind": "gdn",
        "conv_state_shape": (conv_channels, kernel - 1),
        "ssm_state_shape": (value_heads, key_head_dim, value_head_dim),
    }


def _no_moe() -> dict[str, int]:
    return {
        "num_moe_layers": 0,
        "moe_intermediate_size": 0,
        "num_experts_per_tok": 0,
        "num_shared_experts": 0,
        "num_experts": 0,
    }


def _parse_qwen3_next(config: dict[str, Any]) -> dict[str, Any]:
    num_layers = _require_int(config, "num_hidden_layers")
    layer_types = config.get("layer_types")
    if layer_types is None:
        interval = _require_int(config, "full_attention_interval")
        layer_types = [
            "full_attention" if (index + 1) % interval == 0 else "linear_attention" for index in range(num_layers)
        ]
    elif not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"config key 'layer_types' must be a list of num_hidden_layers ({num_layers}) entries")
    unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"config key 'layer_types' has unsupported entries {unknown}")
    num_attention_layers = layer_types.count("full_attention")
    num_experts = _optional_int(config, "num_experts", 0)
    sparse_step = _optional_int(config, "decoder_sparse_step", 1, minimum=1)
    mlp_only_layers = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only_layers, list) or not all(_is_int(index) for index in mlp_only_layers):
        raise ValueError(f"config key 'mlp_only_layers' must be a list of layer indices, got {mlp_only_layers!r}")
    num_moe_layers = sum(
        1
        for index in range(num_layers)
        if num_experts > 0 and index not in mlp_only_layers and (index + 1) % sparse_step == 0
    )
    num_mlp_layers = num_layers - num_moe_layers
    fields: dict[str, Any] = {
        **_attention_fields(config),
        **_gdn_state(config),
        "hidden_size": _require_int(config, "hidden_size"),
        "num_attention_layers": num_attention_layers,
        "num_state_layers": num_layers - num_attention_layers,
        "num_mlp_layers": num_mlp_layers,
        "intermediate_size": _require_int(config, "intermediate_size") if num_mlp_layers else 0,
        "attention_output_gate": bool(config.get("attn_output_gate", True)),
        **_no_moe(),
    }
    if num_moe_layers:
        shared_size = _optional_int(config, "shared_expert_intermediate_size", 0)
        fields.update(
            num_moe_layers=num_moe_layers,
            moe_intermediate_size=_require_int(config, "moe_intermediate_size"),
            num_experts_per_tok=_require_int(config, "num_experts_per_tok"),
            num_experts=num_experts,
            num_shared_experts=1 if shared_size else 0,
            shared_expert_intermediate_size=shared_size or None,
        )
    return fields


_NEMOTRON_LAYER_CODES = {"M": "state", "*": "attention", "-": "mlp", "E": "moe"}


def _parse_nemotron_h(config: dict[str, Any]) -> dict[str, Any]:
    pattern = config.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("config key 'hybrid_override_pattern' is missing or not a non-empty string")
    unknown = sorted(set(pattern) - set(_NEMOTRON_LAYER_CODES))
    if unknown:
        raise ValueError(
            f"config key 'hybrid_override_pattern' has unknown layer codes {unknown}; "
            f"known: {''.join(_NEMOTRON_LAYER_CODES)}"
        )
    num_layers = config.get("num_hidden_layers")
    if num_layers is not None and num_layers != len(pattern):
        raise ValueError(
            f"config key 'hybrid_override_pattern' has {len(pattern)} layers but num_hidden_layers is {num_layers}"
        )
    if config.get("moe_latent_size") is not None:
        raise ValueError("config key 'moe_latent_size' is set: latent-projected MoE is not modelled")
    num_mlp_layers = pattern.count("-")
    fields: dict[str, Any] = {
        **_attention_fields(config),
        "hidden_size": _require_int(config, "hidden_size"),
        "num_attention_layers": pattern.count("*"),
        "num_state_layers": pattern.count("M"),
        "num_mlp_layers": num_mlp_layers,
        "intermediate_size": _require_int(config, "intermediate_size") if num_mlp_layers else 0,
        # Nemotron-H's MLPs and experts are up/down projections around a squared ReLU, without a gate.
        "mlp_gated": False,
        **_mamba2_state(config, inner_size=None),
        **_no_moe(),
    }
    num_moe_layers = pattern.count("E")
    if num_moe_layers:
        shared_size = _optional_int(config, "moe_shared_expert_intermediate_size", 0)
        fields.update(
            num_moe_layers=num_moe_layers,
            moe_intermediate_size=_require_int(config, "moe_intermediate_size"),
            num_experts_per_tok=_require_int(config, "num_experts_per_tok"),
            num_experts=_require_int(config, "n_routed_experts"),
            num_shared_experts=_optional_int(config, "n_shared_experts", 1 if shared_size else 0),
            shared_expert_intermediate_size=shared_size or None,
        )
    return fields


def _periodic_layers(config: dict[str, Any], period_key: str, offset_key: str, num_layers: int) -> int:
    period = _require_int(config, period_key)
    offset = _require_int(config, offset_key, minimum=0)
    if offset >= period:
        raise ValueError(f"config key {offset_key!r} ({offset}) must be smaller than {period_key!r} ({period})")
    return sum(1 for index in range(num_layers) if index % period == offset)


def _parse_jamba(config: dict[str, Any]) -> dict[str, Any]:
    num_layers = _require_int(config, "num_hidden_layers")
    num_attention_layers = _periodic_layers(config, "attn_layer_period", "attn_layer_offset", num_layers)
    num_experts = _optional_int(config, "num_experts", 1, minimum=1)
    num_moe_layers = (
        _periodic_layers(config, "expert_layer_period", "expert_layer_offset", num_layers) if num_experts > 1 else 0
    )
    intermediate_size = _require_int(config, "intermediate_size")
    fields: dict[str, Any] = {
        **_attention_fields(config),
        **_mamba1_state(config),
        "hidden_size": _require_int(config, "hidden_size"),
        "num_attention_layers": num_attention_layers,
        "num_state_layers": num_layers - num_attention_layers,
        "num_mlp_layers": num_layers - num_moe_layers,
        "intermediate_size": intermediate_size,
        **_no_moe(),
    }
    if num_moe_layers:
        fields.update(
            num_moe_layers=num_moe_layers,
            moe_intermediate_size=intermediate_size,
            num_experts_per_tok=_require_int(config, "num_experts_per_tok"),
            num_experts=num_experts,
        )
    return fields


def _parse_layer_counts(config: dict[str, Any]) -> dict[str, Any]:
    kind = config.get("state_layer_kind")
    if kind not in STATE_LAYER_KINDS:
        raise ValueError(f"config key 'state_layer_kind' must be one of {STATE_LAYER_KINDS}, got {kind!r}")
    if not isinstance(config.get("mlp_gated"), bool):
        raise ValueError("config key 'mlp_gated' must be true or false")
    hidden_size = _require_int(config, "hidden_size")
    if kind == "mamba2":
        state = _mamba2_state(config, inner_size=_require_int(config, "expand") * hidden_size)
    elif kind == "mamba1":
        state = _mamba1_state(config)
    else:
        state = _gdn_state(config)
    num_attention_layers = _require_int(config, "num_attention_layers", minimum=0)
    num_mlp_layers = _require_int(config, "num_mlp_layers", minimum=0)
    num_moe_layers = _optional_int(config, "num_moe_layers", 0)
    fields: dict[str, Any] = {
        **state,
        "hidden_size": hidden_size,
        "num_attention_layers": num_attention_layers,
        "num_state_layers": _require_int(config, "num_state_layers", minimum=0),
        "num_mlp_layers": num_mlp_layers,
        "intermediate_size": _require_int(config, "intermediate_size") if num_mlp_layers else 0,
        "mlp_gated": config["mlp_gated"],
        **_no_moe(),
    }
    if num_attention_layers:
        fields.update(_attention_fields(config))
    else:
        fields.update(num_attention_heads=0, num_kv_heads=0, head_dim=0)
    if num_moe_layers:
        shared_size = _optional_int(config, "shared_expert_intermediate_size", 0)
        fields.update(
            num_moe_layers=num_moe_layers,
            moe_intermediate_size=_require_int(config, "moe_intermediate_size"),
            num_experts_per_tok=_require_int(config, "num_experts_per_tok"),
            num_experts=_require_int(config, "num_experts"),
            num_shared_experts=_optional_int(config, "num_shared_experts", 1 if shared_size else 0),
            shared_expert_intermediate_size=shared_size or None,
        )
    return fields
