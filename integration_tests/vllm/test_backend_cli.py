"""Plugin loading, the version guard and ``--prefix-cache-backend`` on vLLM's own argument parser."""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_prefix_cache import patches
from hybrid_prefix_cache.adapters.vllm.plugin import register
from hybrid_prefix_cache.patches import UnsupportedEngineVersion, vllm_block_pool, vllm_engine_args


def serve_parser() -> Any:
    """The parser ``vllm serve`` builds (plugins load inside ``AsyncEngineArgs.add_cli_args``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def engine_args(*argv: str) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    # Parsed first: building the parser loads the plugins, which patch from_cli_args.
    parsed = serve_parser().parse_args(["--model", "some-model", *argv])
    return AsyncEngineArgs.from_cli_args(parsed)


@pytest.mark.parametrize("name", ["marconi", "marconi/lru", "mamba-radix", "none"])
def test_the_flag_lands_in_additional_config(name: str) -> None:
    assert engine_args("--prefix-cache-backend", name).additional_config["prefix_cache_backend"] == name
    assert "prefix_cache_backend" not in engine_args().additional_config


def test_the_flag_agrees_with_additional_config() -> None:
    flag = ("--prefix-cache-backend", "marconi")
    same = engine_args(*flag, "--additional-config", '{"prefix_cache_backend": "marconi"}')
    assert same.additional_config["prefix_cache_backend"] == "marconi"
    with pytest.raises(ValueError, match="contradicts"):
        engine_args(*flag, "--additional-config", '{"prefix_cache_backend": "mamba-radix"}')


def test_an_unknown_name_fails_parsing_with_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        engine_args("--prefix-cache-backend", "marconi-turbo")
    error = capsys.readouterr().err
    assert "marconi-turbo" in error and "choose from mamba-radix, marconi" in error


def test_register_is_idempotent() -> None:
    register()
    register()
    assert not vllm_block_pool.apply()
    assert not vllm_engine_args.apply()


def test_an_unknown_name_in_the_environment_fails_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRID_PREFIX_CACHE_BACKEND", "lru-please")
    with pytest.raises(ValueError, match=r"HYBRID_PREFIX_CACHE_BACKEND = 'lru-please'.*choose from"):
        register()


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_other_vllm_versions_are_refused_with_one_message(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(patches.metadata, "version", lambda distribution: version)
    with pytest.raises(UnsupportedEngineVersion) as raised:
        register()
    message = str(raised.value)
    assert version in message and "0.32.x, 0.33.x" in message


@pytest.mark.parametrize("version", ["0.32.0", "0.32.4+cpu", "0.33.1"])
def test_supported_versions_load(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(patches.metadata, "version", lambda distribution: version)
    register()
