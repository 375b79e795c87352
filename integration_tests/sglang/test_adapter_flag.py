"""``--prefix-cache-backend`` and the plugin entry point, against SGLang 0.5.20's real argument parsing, plugin
loader, backend registry and ``create_tree_cache``; the last test does it in a spawned process, as SGLang runs its
scheduler."""

from __future__ import annotations

import logging
import multiprocessing
import os
from contextlib import ExitStack

import pytest
from fixtures_sglang import PoolSetup, build_in_scheduler_process, sglang_config, tree_cache_context

from hybrid_prefix_cache.adapters.sglang import plugin
from hybrid_prefix_cache.adapters.sglang.settings import SERVER_ARGS_ATTRIBUTE, PrefixCacheSettings

DEFAULT_SETTINGS = PrefixCacheSettings().to_dict()


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    """SGLang's own loader runs our entry point (as launch_server does before parsing arguments)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture
def extra_backends_env(monkeypatch):
    monkeypatch.delenv(plugin.EXTRA_BACKENDS_ENV, raising=False)


def parse(*flags: str):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", "dummy", *flags])


def test_entry_point_registered_the_backends():
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    names = registered_radix_cache_backends()
    for name in ("mamba-radix", "marconi", "all/lru", "all/flop-aware", "marconi/lru", "marconi/flop-aware"):
        assert name in names


def test_flag_selects_sglangs_backend_and_carries_the_settings(extra_backends_env):
    server_args = parse("--prefix-cache-backend", "marconi",
                        "--prefix-cache-config", '{"alpha_grid": [0, 2], "tuning_window": 40}',
                        "--prefix-cache-tuning-window", "80", "--prefix-cache-state-chunk-size", "128")
    assert server_args.radix_cache_backend == "marconi"
    assert getattr(server_args, SERVER_ARGS_ATTRIBUTE) == {
        **DEFAULT_SETTINGS, "alpha_grid": [0.0, 2.0], "tuning_window": 80, "state_chunk_size": 128,
    }
    server_args.resolve_once()  # SGLang's resolution keeps both
    assert server_args.radix_cache_backend == "marconi"
    assert getattr(server_args, SERVER_ARGS_ATTRIBUTE)["tuning_window"] == 80


def test_radix_cache_backend_alone_still_selects_a_backend():
    server_args = parse("--radix-cache-backend", "marconi/lru")
    assert server_args.radix_cache_backend == "marconi/lru"
    assert not hasattr(server_args, SERVER_ARGS_ATTRIBUTE)


def test_a_pair_with_a_parameter_is_registered_when_parsed(extra_backends_env):
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    server_args = parse("--prefix-cache-backend", "periodic:32/lru")
    assert server_args.radix_cache_backend == "periodic:32/lru"
    assert get_radix_cache_factory("periodic:32/lru") is not None
    assert os.environ[plugin.EXTRA_BACKENDS_ENV] == "periodic:32/lru"  # for the spawned scheduler processes


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--prefix-cache-backend", "lfu"), "unknown prefix-cache backend 'lfu'; choose from mamba-radix, marconi"),
        (("--prefix-cache-backend", "marconi/mru"), "unknown eviction policy 'mru'"),
        (("--prefix-cache-config", "{oops"), "--prefix-cache-config is not valid JSON"),
        (("--prefix-cache-config", '{"window": 3}'), "unknown prefix-cache setting(s) 'window'; known:"),
        (("--prefix-cache-alpha-grid", "0,x"), "alpha grid items must be numbers, got 'x'"),
        (("--prefix-cache-alpha", "-1"), "'alpha' must be a finite number >= 0"),
        (("--prefix-cache-state-chunk-size", "0"), "expected an integer >= 1"),
    ],
)
def test_bad_flags_exit_with_a_clear_message(capsys, flags, message):
    with pytest.raises(SystemExit) as exited:
        parse(*flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_conflicting_or_orphan_settings_are_refused():
    with pytest.raises(ValueError, match="conflicts with --radix-cache-backend"):
        parse("--prefix-cache-backend", "marconi", "--radix-cache-backend", "mamba-radix")
    with pytest.raises(ValueError, match="need a hybrid-prefix-cache backend"):
        parse("--prefix-cache-alpha", "1")


@pytest.fixture
def config():
    with ExitStack() as stack:
        yield lambda **kwargs: stack.enter_context(sglang_config(**kwargs))


def test_factory_builds_ours_for_a_hybrid_model_and_sglangs_default_otherwise(config, caplog):
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    server_args = config()
    factory = get_radix_cache_factory("marconi")
    cache = factory(tree_cache_context(PoolSetup(), server_args))
    assert type(cache).__name__ == "HybridPrefixCache"
    assert (cache.backend.name, type(cache.tree.eviction).__name__) == ("marconi", "FlopAwareEviction")
    with caplog.at_level(logging.WARNING):
        default = factory(tree_cache_context(PoolSetup(), server_args, hybrid_ssm=False))
    assert type(default).__name__ != "HybridPrefixCache"
    assert "is for hybrid SSM models and this model is not one; using SGLang's default" in caplog.text


def test_flop_aware_falls_back_to_lru_when_the_model_config_is_not_understood(config, caplog):
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    server_args = config()
    with caplog.at_level(logging.WARNING):
        cache = get_radix_cache_factory("marconi")(
            tree_cache_context(PoolSetup(), server_args, hf_config={"model_type": "llama"})
        )
    assert type(cache.tree.eviction).__name__ == "LRUEviction"
    assert cache.tuning is None
    assert "cannot build the FLOP cost model" in caplog.text and "'llama'" in caplog.text


def test_unsupported_sglang_version_is_one_clear_error(config, monkeypatch):
    from sglang.srt.mem_cache import registry

    import hybrid_prefix_cache.patches as patches

    monkeypatch.setattr(patches, "installed_version", lambda *names: ("sglang", "0.5.21"))
    monkeypatch.setattr(registry, "_RADIX_CACHE_REGISTRY", {})
    with pytest.raises(patches.UnsupportedEngineVersion) as raised:
        plugin.register()
    assert "sglang 0.5.21 is not supported; supported sglang versions: 0.5.20" in str(raised.value)
    # SGLang's loader only logs that error; selecting a backend raises it again where the user sees it.
    server_args = config()
    with pytest.raises(patches.UnsupportedEngineVersion) as selected:
        registry.get_radix_cache_factory("marconi")(tree_cache_context(PoolSetup(), server_args))
    assert str(selected.value) == str(raised.value)


def test_flag_reaches_create_tree_cache_in_a_spawned_scheduler_process(extra_backends_env):
    records = []
    for flags in (("--prefix-cache-backend", "marconi", "--prefix-cache-alpha-grid", "0,3"),
                  ("--prefix-cache-backend", "periodic:16/lru"),
                  ("--radix-cache-backend", "mamba-radix")):
        server_args = parse(*flags)
        server_args._mamba_cache_chunk_size = 4  # what the model config would give (no model here)
        records.append(server_args)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=build_in_scheduler_process, args=(records, results))
    process.start()
    report = results.get(timeout=600)
    process.join(timeout=60)
    assert "error" not in report, report.get("error")
    assert "marconi" not in report["registered_before"]  # nothing survives the spawn: load_plugins registers
    assert "periodic:16/lru" in report["registered"]  # inherited through HYBRID_PREFIX_CACHE_BACKENDS
    assert report["caches"] == [
        {"class": "HybridPrefixCache", "backend": "marconi", "eviction": "FlopAwareEviction",
         "settings": {**DEFAULT_SETTINGS, "alpha_grid": [0.0, 3.0]}},
        {"class": "HybridPrefixCache", "backend": "periodic:16/lru", "eviction": "LRUEviction",
         "settings": DEFAULT_SETTINGS},
        {"class": "HybridPrefixCache", "backend": "mamba-radix", "eviction": "LRUEviction",
         "settings": DEFAULT_SETTINGS},
    ]
