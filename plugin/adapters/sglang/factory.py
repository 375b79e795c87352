"""The radix-cache factory SGLang calls (``create_tree_cache``) for a hybrid-prefix-cache backend name."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hybrid_prefix_cache.core import EvictionPolicy, LRUEviction
from hybrid_prefix_cache.cost_model import ModelSpec, model_spec_from_hf_config
from hybrid_prefix_cache.registry import Backend, resolve_backend

from .settings import SERVER_ARGS_ATTRIBUTE, PrefixCacheSettings

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)


def settings_of(server_args: Any) -> PrefixCacheSettings:
    """The settings the launcher stored on the ServerArgs record (defaults when the backend was selected with
    ``--radix-cache-backend`` and no ``--prefix-cache-*`` flag)."""
    return PrefixCacheSettings.from_mapping(getattr(server_args, SERVER_ARGS_ATTRIBUTE, None))


def model_spec_of(model_config: Any) -> ModelSpec:
    """The cost model of SGLang's ``ModelConfig``: its HF config, else its text config (multimodal wrappers)."""
    errors = []
    for attribute in ("hf_config", "hf_text_config"):
        config = getattr(model_config, attribute, None)
        if config is None:
            continue
        try:
            as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            name = getattr(model_config, "model_path", None) or as_dict.get("model_type") or "model"
            return model_spec_from_hf_config(as_dict, str(name))
        except (ValueError, TypeError) as error:
            errors.append(f"{attribute}: {error}")
    raise ValueError("; ".join(errors) or "the model config has no hf_config")


def eviction_for(backend: Backend, settings: PrefixCacheSettings, model_config: Any) -> tuple[EvictionPolicy,
                                                                                                ModelSpec | None]:
    """The backend's eviction policy; FLOP-aware needs the model's cost model and falls back to LRU without it."""
    if backend.eviction == "lru":
        return LRUEviction(), None
    try:
        spec = model_spec_of(model_config)
    except ValueError as error:
        logger.warning(
            "hybrid-prefix-cache %s: cannot build the FLOP cost model from the model config (%s); "
            "evicting in LRU order instead of %s", backend.name, error, backend.eviction)
        return LRUEviction(), None
    return backend.make_eviction(spec, settings.alpha), spec


def build_tree_cache(backend_name: str, ctx: TreeCacheBuildContext) -> BasePrefixCache:
    """The cache for ``--radix-cache-backend backend_name``: ours for a hybrid SSM model, SGLang's default when
    the model is not one or prefix caching is off."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    if not ctx.is_hybrid_ssm:
        logger.warning("hybrid-prefix-cache: %s is for hybrid SSM models and this model is not one; using SGLang's "
                       "default prefix cache", backend_name)
        return default_radix_cache_factory(ctx)
    if ctx.disable_radix_cache:
        logger.info("hybrid-prefix-cache: the radix cache is disabled; %s is not used", backend_name)
        return default_radix_cache_factory(ctx)
    if ctx.is_hybrid_swa:
        logger.warning("hybrid-prefix-cache: %s does not manage sliding-window KV; using SGLang's default prefix "
                       "cache for this hybrid SWA + SSM model", backend_name)
        return default_radix_cache_factory(ctx)
    if ctx.enable_hierarchical_cache:
        raise ValueError(f"--enable-hierarchical-cache is not supported by the hybrid-prefix-cache backend "
                         f"{backend_name!r}; drop one of the two")

    from .cache import HybridPrefixCache

    backend = resolve_backend(backend_name)
    settings = settings_of(ctx.server_args)
    eviction, spec = eviction_for(backend, settings, ctx.model_config)
    cache = HybridPrefixCache(ctx.params, backend=backend, eviction=eviction, settings=settings, model_spec=spec)
    logger.info(
        "hybrid-prefix-cache: backend %s (admission %s, eviction %s), %s strategy, page %d, branch points every "
        "%d tokens", backend.name, backend.admission, type(eviction).__name__,
        "extra_buffer" if cache.enable_mamba_extra_buffer else "no_buffer", cache.page_size,
        cache.tree.state_chunk_size)
    return cache
