"""Where our classes enter vLLM: the replacements our patches install, inert unless a backend is chosen.

``Scheduler.__init__`` builds the ``KVCacheManager``, whose coordinator builds one ``BlockPool`` and one manager
per KV-cache group through two module globals of ``vllm.v1.core.kv_cache_coordinator``. The patches replace
those globals with :func:`make_block_pool` and :func:`make_manager`, and wrap ``Scheduler.__init__`` with
:func:`scheduler_init`, which reads the backend from the engine's ``additional_config`` (or the process
default, or the environment; see :mod:`.settings`) and marks the construction with it. Outside such a
construction, or with no backend chosen, the replacements build exactly what vLLM builds.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybrid_prefix_cache.adapters.vllm.block_index import BlockCosts
from hybrid_prefix_cache.adapters.vllm.settings import BackendSettings, settings_for
from hybrid_prefix_cache.cost_model import model_spec_from_hf_config

# A child of vLLM's logger: vLLM configures handlers for "vllm" only, so a logger of our own would drop INFO.
logger = logging.getLogger(f"vllm.{__name__}")

# What the scheduler attribute names, for tests and introspection: the backend running in this scheduler.
SCHEDULER_ATTRIBUTE = "hybrid_prefix_cache_backend"


@dataclass(frozen=True, slots=True)
class _Build:
    settings: BackendSettings
    vllm_config: Any
    kv_cache_config: Any


_ACTIVE: contextvars.ContextVar[_Build | None] = contextvars.ContextVar("hybrid_prefix_cache_vllm_build", default=None)


def _layout(settings: BackendSettings, kv_cache_config: Any) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from hybrid_prefix_cache.adapters.vllm.pool import PoolLayout

    fa_groups, state_groups, others = [], [], []
    block_sizes = set()
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        block_sizes.add(spec.block_size)
        if isinstance(spec, MambaSpec):
            state_groups.append(group_id)
        elif type(spec) is FullAttentionSpec:
            fa_groups.append(group_id)
        else:
            others.append(type(spec).__name__)
    if not state_groups:
        raise ValueError(
            f"hybrid-prefix-cache {settings.name}: the model has no Mamba/linear-attention KV cache group; "
            "the backends are for hybrid models (drop the prefix-cache backend setting for this model)"
        )
    if others:
        raise ValueError(
            f"hybrid-prefix-cache {settings.name}: KV cache groups of kind {sorted(set(others))} are not supported "
            "(only full attention + Mamba/linear attention)"
        )
    if len(block_sizes) != 1:
        raise ValueError(
            f"hybrid-prefix-cache {settings.name}: KV cache groups use block sizes {sorted(block_sizes)}; "
            "vLLM's align mode gives all groups one block size, which the backends rely on"
        )
    return PoolLayout(tuple(fa_groups), tuple(state_groups), block_sizes.pop())


# Keys of a config.json that transformers' config classes keep as attributes but leave out of ``to_dict``
# (NemotronHConfig replaces ``hybrid_override_pattern`` by ``layers_block_type``).
_ATTRIBUTE_ONLY_KEYS = ("hybrid_override_pattern",)


def _hf_config_dict(hf_config: Any) -> dict[str, Any]:
    """The model's config as the cost model reads a config.json (only the parsed config survives in vLLM)."""
    config = hf_config.to_dict()
    for key in _ATTRIBUTE_ONLY_KEYS:
        value = getattr(hf_config, key, None)
        if key not in config and value is not None:
            config[key] = value
    return config


def _costs(settings: BackendSettings, vllm_config: Any, kv_cache_config: Any, layout: Any) -> BlockCosts:
    hf_config = _hf_config_dict(vllm_config.model_config.hf_config)
    try:
        model = model_spec_from_hf_config(hf_config, name=str(vllm_config.model_config.model))
    except ValueError as error:
        raise ValueError(
            f"hybrid-prefix-cache {settings.name}: FLOP-aware eviction needs the model's FLOP model, but its "
            f"config cannot be read ({error}); choose an LRU backend such as mamba-radix or marconi/lru"
        ) from None
    # The groups' tensors overlay one allocation: a block id costs its share of every tensor.
    block_bytes = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks
    return BlockCosts(model, layout.block_size, max(block_bytes, 1), len(layout.fa_groups), len(layout.state_groups))


def _check_engine(settings: BackendSettings, vllm_config: Any) -> bool:
    """Whether the backend applies to this engine; raises on a configuration it cannot run."""
    if not vllm_config.cache_config.enable_prefix_caching:
        logger.warning("hybrid-prefix-cache: backend %s has no effect: prefix caching is off", settings.name)
        return False
    if vllm_config.speculative_config is not None:
        raise ValueError(
            f"hybrid-prefix-cache {settings.name}: speculative decoding is not supported (the backends were "
            "verified without it); drop the prefix-cache backend setting or speculative decoding"
        )
    return True


def scheduler_init(original: Callable[..., None]) -> Callable[..., None]:
    """AROUND wrapper of ``Scheduler.__init__``: builds the KV cache manager with the chosen backend."""
    signature = inspect.signature(original)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        vllm_config = bound.arguments["vllm_config"]
        settings = settings_for(vllm_config.additional_config)
        setattr(self, SCHEDULER_ATTRIBUTE, None)
        if settings is None or not _check_engine(settings, vllm_config):
            original(self, *args, **kwargs)
            return
        token = _ACTIVE.set(_Build(settings, vllm_config, bound.arguments["kv_cache_config"]))
        try:
            original(self, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)
        setattr(self, SCHEDULER_ATTRIBUTE, settings.name)
        logger.info("hybrid-prefix-cache: prefix-cache backend %s active", settings.name)

    init.__wrapped__ = original  # type: ignore[attr-defined]
    init.__doc__ = original.__doc__
    return init


def make_block_pool(original: type) -> Callable[..., Any]:
    """Replacement for the coordinator's ``BlockPool``: ours when the backend needs it, else vLLM's."""

    def build(*args: Any, **kwargs: Any) -> Any:
        build_context = _ACTIVE.get()
        if build_context is None or not build_context.settings.needs_own_pool:
            return original(*args, **kwargs)
        from hybrid_prefix_cache.adapters.vllm.pool import HybridBlockPool

        pool = HybridBlockPool(*args, **kwargs)
        if not pool.enable_caching:
            return pool
        settings, kv_cache_config = build_context.settings, build_context.kv_cache_config
        layout = _layout(settings, kv_cache_config)
        costs = _costs(settings, build_context.vllm_config, kv_cache_config, layout) if settings.flop_aware else None
        pool.configure(layout, costs, tune_window=settings.tune_window, tune_every=settings.tune_every)
        return pool

    build.__wrapped__ = original  # type: ignore[attr-defined]
    return build


def make_manager(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for the coordinator's ``get_manager_for_kv_cache_spec``: our Mamba manager under a backend."""

    def get_manager(
        kv_cache_spec: Any, max_in_flight_tokens: int, max_model_len: int, role: str | None = None, **kwargs: Any
    ) -> Any:
        build_context = _ACTIVE.get()
        if build_context is None or not kwargs.get("enable_caching", False):
            return original(kv_cache_spec, max_in_flight_tokens, max_model_len, role, **kwargs)
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

        if KVCacheSpecRegistry.get_manager_class(kv_cache_spec, role) is not MambaManager:
            return original(kv_cache_spec, max_in_flight_tokens, max_model_len, role, **kwargs)
        from hybrid_prefix_cache.adapters.vllm.managers import AdmissionMambaManager

        group_id = kwargs["kv_cache_group_id"]
        first_state_group = _layout(build_context.settings, build_context.kv_cache_config).state_groups[0]
        return AdmissionMambaManager(
            kv_cache_spec,
            settings=build_context.settings,
            reports_requests=group_id == first_state_group,
            **kwargs,
        )

    get_manager.__wrapped__ = original  # type: ignore[attr-defined]
    return get_manager
