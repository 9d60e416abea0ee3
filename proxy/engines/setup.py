"""Engines from settings: each URL built, identified and probed, and all of them in one EnginePool."""

from __future__ import annotations

import logging

from proxy.config import Settings
from proxy.engines.base import Engine
from proxy.engines.members import Member
from proxy.engines.pool import EnginePool
from proxy.errors import EngineMismatch, EngineUnavailable, InvalidRequest, ProxyError

log = logging.getLogger("tito_proxy")

__all__ = ["build_engine", "check_engine", "connect_engine", "open_pool"]


def build_engine(settings: Settings, url: str | None = None) -> Engine:
    """The engine at `url` (the first --engine-url when None), not yet checked."""
    url = url or settings.engine_urls[0]
    if settings.engine == "local":
        from proxy.engines.local import LocalEngine

        assert settings.model is not None
        return LocalEngine(settings.model, default_max_new_tokens=settings.local_max_new_tokens)
    if settings.engine == "vllm":
        from proxy.engines.vllm import VLLMEngine

        return VLLMEngine(
            url,
            timeout_s=settings.engine_timeout_s,
            declared_logprobs_mode=settings.vllm_logprobs_mode,
            api_key=_engine_key(settings),
        )
    from proxy.engines.sglang import SGLangEngine

    return SGLangEngine(url, timeout_s=settings.engine_timeout_s)


def _engine_key(settings: Settings) -> str | None:
    return settings.engine_api_key.get_secret_value() if settings.engine_api_key else None


async def check_engine(settings: Settings, inference: Engine, url: str | None = None) -> Engine:
    """At start: the engine URL must speak the configured engine's protocol (else EngineMismatch, which
    stops the start); a vLLM server is probed for its route and logprobs mode, with a loud warning when
    its logprobs are not the sampled distribution; an SGLang URL that is an sglang-router gets the
    session's routing key on every call. An engine not up yet is checked when it answers (the engine
    returned is then wrapped in a ProtocolGuard)."""
    from proxy.engines.detect import ProtocolGuard, check_identity, identify
    from proxy.engines.sglang import SGLangEngine
    from proxy.engines.vllm import VLLMEngine

    url = url or settings.engine_urls[0]
    key = _engine_key(settings)
    identity = await identify(url, api_key=key)
    try:
        check_identity(settings.engine, url, identity)
        if identity.kind == "unreachable":
            log.warning("the engine at %s does not answer yet; its protocol is checked when it does", url)
            return ProtocolGuard(inference, settings.engine, url, api_key=key)
        log.info("the engine at %s speaks %s", url, identity.describe())
        if isinstance(inference, SGLangEngine):
            inference.router = identity.router
        if isinstance(inference, VLLMEngine):
            probe = await inference.start()
            log.info("vLLM: %s", probe.report())
            if probe.warning():
                log.warning("%s\n%s\n%s", "!" * 72, probe.warning(), "!" * 72)
    except EngineMismatch as exc:
        log.error("tito-proxy cannot start: %s", exc.message)
        raise
    except EngineUnavailable as exc:
        log.warning("the engine is not ready (%s); it is probed again on first use", exc.message)
    return inference


async def connect_engine(settings: Settings, url: str) -> tuple[Engine, str]:
    """An engine registered at run time (POST /admin/engines): it must answer now and speak the
    configured protocol; a refusal is the caller's 400, never a start-up error."""
    from proxy.engines.detect import identify

    if settings.engine == "local":
        raise InvalidRequest("the local engine runs in this process: it takes no other engines")
    identity = await identify(url, api_key=_engine_key(settings))
    if identity.kind == "unreachable":
        raise InvalidRequest(f"nothing answers at {url}", code="engine_unreachable", param="url")
    inference = build_engine(settings, url)
    try:
        checked = await check_engine(settings, inference, url)
    except EngineMismatch as exc:
        await inference.aclose()
        raise InvalidRequest(exc.message, code="engine_mismatch", param="url") from exc
    return checked, settings.engine


async def open_pool(settings: Settings, engine: Engine | None = None) -> EnginePool:
    """The pool of the configured engines (or of `engine`, a test's), checked as at start: every URL
    speaks the configured protocol and all serve one model (else EngineMismatch stops the start)."""
    if engine is not None or settings.engine == "local":
        inference = engine or build_engine(settings)
        member = Member("engine-0", settings.engine_urls[0], inference.name, inference)
        pool = _pool(settings, [member])
        await _same_model(pool, [member])  # the model an engine registered later must serve
        return pool
    members: list[Member] = []
    try:
        for index, url in enumerate(settings.engine_urls):
            inference = build_engine(settings, url)
            members.append(Member(f"engine-{index}", url, settings.engine, inference))
            members[-1].engine = await check_engine(settings, inference, url)
        pool = _pool(settings, members)
        await _same_model(pool, members)
    except BaseException:
        for member in members:
            await member.engine.aclose()
        raise
    return pool


def _pool(settings: Settings, members: list[Member]) -> EnginePool:
    async def connect(url: str) -> tuple[Engine, str]:
        return await connect_engine(settings, url)

    return EnginePool(members, health_interval_s=settings.engine_health_interval_s, connect=connect)


async def _same_model(pool: EnginePool, members: list[Member]) -> None:
    for member in members:
        try:
            await pool.check_model(member.engine, member.url)
        except ProxyError as exc:
            if exc.code == "engine_unreachable":
                log.warning(
                    "engine %s: %s; it takes no call until it is found serving this model",
                    member.id,
                    exc.message,
                )
                member.model_known = False
                continue
            log.error("tito-proxy cannot start: %s", exc.message)
            raise EngineMismatch(exc.message) from exc
