"""The model-name rule: served names and aliases are the base model, listed adapters are sampled with
themselves, other names are the base model (or a 404 when strict), and a name once listed as an
adapter is never the base model; listings are cached briefly and refreshed on an unknown name."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from proxy.api.model_names import ModelChoice, ModelNames
from proxy.config import Settings
from proxy.errors import EngineUnavailable, ModelNotFound


class Engine:
    """An engine whose adapter listing the test changes, counting the listings."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.listings = 0
        self.down = False

    async def adapters(self) -> dict[str, str]:
        self.listings += 1
        if self.down:
            raise EngineUnavailable("down")
        return dict(self.loaded)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _names(engine: Engine, clock: Clock, *, strict: bool = False) -> ModelNames:
    return ModelNames(engine, base_names=["qwen", None, "alias"], strict=strict, clock=clock)


def test_names_resolve_by_the_rule() -> None:
    engine, clock = Engine(), Clock()
    engine.loaded = {"math": "/a/math"}
    names = _names(engine, clock)

    async def run() -> None:
        assert await names.choose("qwen") == ModelChoice("qwen", None)
        assert await names.choose("alias") == ModelChoice("alias", None)
        assert await names.choose(None) == ModelChoice(None, None)
        assert await names.choose("math") == ModelChoice("math", "math")
        assert await names.choose("gpt-5-codex") == ModelChoice("gpt-5-codex", None)
        strict = _names(engine, clock, strict=True)
        with pytest.raises(ModelNotFound) as refused:
            await strict.choose("gpt-5-codex")
        assert (refused.value.status_code, refused.value.code) == (404, "model_not_found")
        assert await strict.choose("math") == ModelChoice("math", "math")

    asyncio.run(run())


def test_listings_are_cached_and_refreshed_for_unknown_names_at_most_once_a_second() -> None:
    engine, clock = Engine(), Clock()
    names = _names(engine, clock)

    async def run() -> None:
        await names.choose("late")
        await names.choose("late")
        assert engine.listings == 1  # the second unknown name within a second lists nothing again
        engine.loaded = {"late": "/a/late"}
        clock.now += 1.5
        assert await names.choose("late") == ModelChoice("late", "late")
        listings = engine.listings
        clock.now += 1.0
        await names.choose("late")  # a known adapter within the cache's life: no listing
        assert engine.listings == listings

    asyncio.run(run())


def test_a_name_once_listed_as_an_adapter_is_never_the_base_model() -> None:
    engine, clock = Engine(), Clock()
    engine.loaded = {"gone": "/a/gone"}
    names = _names(engine, clock)

    async def run() -> None:
        assert (await names.choose("gone")).adapter == "gone"
        engine.loaded = {}
        clock.now += 10
        with pytest.raises(ModelNotFound):
            await names.choose("gone")

    asyncio.run(run())


def test_an_engine_that_cannot_list_keeps_the_last_listing() -> None:
    engine, clock = Engine(), Clock()
    engine.loaded = {"math": "/a/math"}
    names = _names(engine, clock)

    async def run() -> None:
        await names.adapters()
        engine.down = True
        clock.now += 10
        assert await names.choose("math") == ModelChoice("math", "math")
        assert await names.choose("qwen") == ModelChoice("qwen", None)
        with pytest.raises(EngineUnavailable):
            await names.choose("unknown")  # perhaps an adapter loaded meanwhile: not guessed

    asyncio.run(run())


def test_the_flags_reach_the_settings_and_the_workers(qwen_dir: Path) -> None:
    import argparse

    from proxy.cli import _serve_parser, _settings_from, settings_environment

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "serve",
            "--tokenizer",
            str(qwen_dir),
            "--engine",
            "vllm",
            "--model-aliases",
            "a, b",
            "--strict-model-names",
            "--record-routed-experts",
            "--routed-experts-shape",
            "48,8",
        ]
    )
    settings = _settings_from(args)
    assert settings.model_alias_names == ["a", "b"]
    assert (settings.strict_model_names, settings.record_routed_experts) == (True, True)
    assert settings.routed_experts_dims == (48, 8)
    environment: dict[str, Any] = {
        name.removeprefix("TITO_").lower(): value for name, value in settings_environment(settings).items()
    }
    assert Settings(**environment) == settings


def test_a_name_waits_for_a_restarting_engine_to_be_listed_again() -> None:
    """Within the restart wait, an unknown name is judged on the restarted engine's listing: it may
    have come back with the adapter loaded."""
    engine, clock = Engine(), Clock()
    names = ModelNames(engine, base_names=["served"], strict=False, restart_wait_s=5.0, clock=clock)

    async def run() -> None:
        await names.adapters()
        engine.down = True
        clock.now += 10  # the listing is stale: the next unknown name lists again, and fails

        async def restart() -> None:
            await asyncio.sleep(0.6)
            engine.loaded, engine.down = {"fresh": "/a/fresh"}, False

        restarting = asyncio.create_task(restart())
        assert await names.choose("fresh") == ModelChoice("fresh", "fresh")
        assert await names.choose("other") == ModelChoice("other", None)
        await restarting

    asyncio.run(run())


def test_the_listing_is_kept_fresh_while_harness_names_arrive() -> None:
    """A harness sends its default name on every turn, often more than a second apart: the listing is
    renewed in the background, so that turn reads it instead of waiting for the engine, and an adapter
    loaded meanwhile is still served under its name. Once such names stop, so do the listings."""
    engine = Engine()
    names = ModelNames(engine, base_names=["qwen"], strict=False, keep_fresh_s=0.8, refresh_s=0.5)

    async def run() -> None:
        assert await names.choose("gpt-5-codex") == ModelChoice("gpt-5-codex", None)
        await asyncio.sleep(0.6)  # longer than a listing is trusted for an unknown name
        listed = engine.listings
        assert listed >= 2  # renewed meanwhile, without a request
        assert await names.choose("gpt-5-codex") == ModelChoice("gpt-5-codex", None)
        assert engine.listings == listed  # chosen from that listing: the turn did not wait for one
        engine.loaded = {"math": "/a/math"}
        await asyncio.sleep(0.35)
        assert await names.choose("math") == ModelChoice("math", "math")
        await asyncio.sleep(1.2)  # no name but the base model's for longer than keep_fresh_s
        idle = engine.listings
        await asyncio.sleep(0.6)
        assert engine.listings == idle
        assert await names.choose("qwen") == ModelChoice("qwen", None)
        await asyncio.sleep(0.35)
        assert engine.listings == idle  # the base model's names need no listing
        await names.choose("gpt-5-codex")
        await names.aclose()
        stopped = engine.listings
        await asyncio.sleep(0.35)
        assert engine.listings == stopped

    asyncio.run(run())
