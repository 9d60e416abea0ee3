"""create_app(settings): the FastAPI app and the lifespan that owns the engine, DB and tokenizer."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import math
import os
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import SecretStr
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession as DbSession
from sqlalchemy.ext.asyncio import async_sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy import native_memory
from proxy.api import admin, engines, export, health, models, sessions, weight_sync
from proxy.api.auth import require_admin_key, require_harness_key
from proxy.api.engine_facts import EngineFacts
from proxy.api.groups import group_from_headers
from proxy.api.harness_route import include_flat
from proxy.api.limits import BodyLimit
from proxy.api.retries import RetryGuard
from proxy.api.schema_errors import with_documented_refusals
from proxy.api.shutdown_answer import ShutdownAnswer
from proxy.app_state import AppState
from proxy.chat.call_format import choose_parser
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.config import Settings
from proxy.dialects import anthropic, chat, completions, responses
from proxy.dialects.anthropic_errors import error_body as anthropic_error_body
from proxy.dialects.anthropic_errors import is_anthropic_path
from proxy.dialects.seals import Sealer
from proxy.engines.base import Engine, EngineInfo
from proxy.engines.checked import CheckedEngine
from proxy.engines.resuming import ResumingEngine
from proxy.engines.setup import open_pool
from proxy.errors import (
    ClientClosedRequest,
    EngineError,
    InvalidRequest,
    ProxyError,
    with_request_id,
)
from proxy.export.summaries import store_on_finish
from proxy.observe import context, metrics_route, ui
from proxy.observe.framework_telemetry import fastapi_telemetry
from proxy.observe.logs import configure as configure_logs
from proxy.observe.logs import install_record_ids
from proxy.observe.metrics import Metrics
from proxy.observe.request_ids import RequestIdMiddleware
from proxy.shared_pause import SharedPause
from proxy.store.affinity import DatabaseAffinity, DatabaseRegistry
from proxy.store.claims import RetryClaims
from proxy.store.database import (
    create_engine,
    database_error,
    is_database_failure,
    session_factory,
    upgrade_to_head,
)
from proxy.store.models import REASONING_SECRET_KEY
from proxy.store.repository import Repository, first_setting, utcnow
from proxy.store.stores import open_turn_store
from proxy.trainer_version import TrainerVersion
from proxy.turns import TurnRunner
from proxy.weight_sync import PauseGate

log = logging.getLogger("tito_proxy")


class ObservedApp(FastAPI):
    """The app with request ids outermost: even a 500 answered by Starlette itself carries one."""

    # The Retry-After of the 503 a request cancelled at shutdown gets (--retry-after-s).
    retry_after_s: float = 5.0

    def build_middleware_stack(self) -> ASGIApp:
        stack = ShutdownAnswer(super().build_middleware_stack(), retry_after_s=self.retry_after_s)
        return RequestIdMiddleware(stack, also_named=_anthropic_id_header)


def _anthropic_id_header(path: str) -> bytes | None:
    """Anthropic's API names its request in `request-id`, which its SDKs read into `_request_id` and
    an error's `request_id`."""
    return b"request-id" if is_anthropic_path(path) else None


def _named_model(reported: str) -> str | None:
    """The engine's name for its model (SGLang's --served-model-name, vLLM's model id), unless it is
    a path or unknown: then the proxy's own (a hub id, or the tokenizer directory's name) is used."""
    if not reported or reported == "unknown" or reported.startswith(("/", ".", "~")):
        return None
    return reported


# How long the shutdown waits for the turns uvicorn cancelled to end before closing what they use.
SETTLE_S = 5.0


async def _turns_settled(turns: TurnRunner, limit_s: float = SETTLE_S) -> None:
    """uvicorn cancels the requests still running past --shutdown-grace-s and starts the lifespan's
    shutdown at once, without waiting for them: a cancelled stream still aborts its engine request
    and records its partial turn as aborted, which needs the engine client and the store open."""
    if not await turns.settled(limit_s):
        log.warning("%d turns still running at shutdown", sum(turns.in_flight.values()))


def _apply_engine_info(state: AppState, info: EngineInfo) -> None:
    """The engine's facts where a configured value does not override them: its model's name, its
    context length, and its weight version for calls whose answer names none until the trainer
    sets one."""
    settings = state.settings
    state.turns.context_length = settings.context_length or info.context_length
    state.model_name = settings.served_model_name or _named_model(info.model) or state.model_name
    state.model_names.serve_also(state.model_name)
    state.turns.trainer_version.fallback = info.weight_version


def _log_self_test(state: AppState) -> None:
    verdict, parser = state.renderer.verdict, state.tool_parser
    if parser is None:  # set by the lifespan before this is called
        return
    log.info(
        "template self-test: closes %s, separator %r, appends %s, dated %s; tool parser %s (%s); "
        "context %s; engine %s",
        sorted(verdict.close_tokens),
        verdict.separator,
        {kind: v.continues for kind, v in verdict.appends.items()},
        verdict.date_dependent,
        parser.name,
        "set by --tool-parser" if parser.chosen_by == "flag" else "from the chat template",
        state.context_length,
        state.engine.name,
    )


def create_app(settings: Settings, *, engine: Engine | None = None) -> FastAPI:
    """The app for these settings; `engine` replaces the configured one (tests pass fakes here)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        native_memory.fix_mmap_threshold()
        pool = await open_pool(settings, engine)
        await upgrade_to_head(settings.db)
        db_engine = create_engine(settings.db)
        pool.store = DatabaseAffinity(session_factory(db_engine))
        pool.registry = DatabaseRegistry(session_factory(db_engine))
        await pool.reconcile()  # engines added or removed at run time, before a restart too
        pool.start()
        after = settings.fast_bpe_after_tokens
        renderer = Renderer(
            load_tokenizer_files(settings.tokenizer_dir), fast_bpe_after=None if after < 0 else after
        )
        # Every engine answer passes the checks before it is recorded or streamed; every engine call
        # passes the trainer's pause gate, and aborted generations are continued.
        inference = ResumingEngine(
            CheckedEngine(
                pool,
                vocab_size=renderer.vocab_size,
                stop_ids=renderer.special_ids | frozenset(renderer.stop_token_ids),
            ),
            PauseGate(settings.pause_mode, settings.pause_max_wait_s, settings.retry_after_s),
            restart_wait_s=settings.engine_restart_wait_s,
        )
        parser, parser_report = choose_parser(renderer, settings.tool_parser)
        db_sessions = session_factory(db_engine)
        turn_store = open_turn_store(settings.db, db_engine)
        turn_store.on_commit = metrics.committed
        # Read with every turn's start, and again at a call's dispatch after a pause or a resume.
        trainer_version = TrainerVersion(turn_store.trainer_version, inference.gate)
        inference.trainer_version = trainer_version
        app.state.proxy = AppState(
            settings=settings,
            engine=inference,
            db_engine=db_engine,
            db_sessions=db_sessions,
            renderer=renderer,
            turns=TurnRunner(
                renderer=renderer,
                engine=inference,
                store=turn_store,
                context_length=settings.context_length,
                parser=parser,
                history_mode=settings.history_mode,
                trainer_version=trainer_version,
            ),
            # Until the engine says otherwise (below): the configured name.
            model_name=settings.model_name,
            tool_parser=parser_report,
            retries=RetryGuard(claims=RetryClaims(db_sessions) if _shared_database(settings) else None),
            pool=pool,
            sealer=Sealer(settings.reasoning_secret or await _stored_secret(db_sessions)),
        )
        app.state.proxy.turns.metrics = metrics
        facts = app.state.proxy.engine_facts = EngineFacts(
            inference, functools.partial(_apply_engine_info, app.state.proxy)
        )
        await facts.learn()
        _log_self_test(app.state.proxy)
        if parser_report.warning:
            log.warning("tool calls: %s", parser_report.warning)
        sweeper = asyncio.create_task(_finish_idle_sessions(app.state.proxy))
        background = [sweeper, asyncio.create_task(facts.follow())]
        if _shared_database(settings):
            shared = app.state.proxy.shared_pause = SharedPause(db_sessions, inference)
            await shared.start()
            background.append(asyncio.create_task(shared.follow()))
        _freeze_startup_heap()
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await _turns_settled(app.state.proxy.turns)
            await app.state.proxy.model_names.aclose()
            app.state.proxy.turns.close()
            await turn_store.close()
            await inference.aclose()
            await db_engine.dispose()

    # The docs are served by _install_docs, behind the admin key like the routes they describe.
    install_record_ids()
    app = ObservedApp(
        title="tito-proxy",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        **fastapi_telemetry(),
    )
    app.retry_after_s = settings.retry_after_s
    metrics = app.state.metrics = Metrics()
    # Outside every route, so a new surface cannot forget it.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, metrics=metrics)
    harness = [Depends(require_harness_key), Depends(group_from_headers)]
    for surface in (models.router, chat.router, completions.router, responses.router, anthropic.router):
        include_flat(app, surface, dependencies=harness)
        include_flat(app, surface, prefix="/sessions/{session_id}", dependencies=harness)
    for recorded in (
        sessions.router,
        export.router,
        admin.router,
        engines.router,
        weight_sync.router,
        metrics_route.router,
    ):
        app.include_router(recorded, dependencies=[Depends(require_admin_key)])
    app.include_router(health.router)
    app.include_router(ui.page_router)
    app.include_router(ui.api_router)
    _install_docs(app)
    _install_error_handlers(app)
    if settings.workers > 1:
        app.add_middleware(WorkerHeader)
    return app


def _shared_database(settings: Settings) -> bool:
    """Whether other processes may serve from this database: `--workers`, or a database server
    (PostgreSQL), which replicas share. Duplicates of a request are then ordered in the database."""
    return settings.workers > 1 or make_url(settings.db).get_backend_name() != "sqlite"


async def _stored_secret(db_sessions: async_sessionmaker[DbSession]) -> SecretStr:
    """The deployment's reasoning secret when none is configured: made by the first process to start
    on this database and kept there, so that every worker and replica, and a restart, verify a seal."""
    stored = await first_setting(db_sessions, REASONING_SECRET_KEY, secrets.token_hex(32))
    return SecretStr(stored)


def _install_docs(app: FastAPI) -> None:
    """/openapi.json, /docs and /redoc; with keys set they need the admin key (the harness key gets a
    403), since they map every route that reads or changes recorded data."""
    guarded = [Depends(require_admin_key)]
    app.openapi = with_documented_refusals(app)  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False, dependencies=guarded)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guarded)
    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False, dependencies=guarded)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")


# FastAPI's first location part says where a parameter was read; OpenAI's `param` names only it.
_LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})


def _param_of(error: Mapping[str, Any]) -> str | None:
    """The parameter an error is in: `mode`, `messages.0.role`; none for a JSON syntax error, whose
    location is a character offset, not a field."""
    if error.get("type") == "json_invalid":
        return None
    location = list(error.get("loc", ()))
    if location and location[0] in _LOCATIONS:
        location = location[1:]
    named = [str(part) for part in location if not _is_pydantic_tag(part)]
    return ".".join(named) or None


# Scalar union members pydantic names in a location (`content.str`); generic ones carry brackets.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "bytes", "dict", "list", "none"})


def _is_pydantic_tag(part: object) -> bool:
    """A location part that is pydantic's, not the request's: a union member or a dict's `[key]`."""
    return isinstance(part, str) and (part in _UNION_MEMBERS or "[" in part)


def _validation_code(error: Mapping[str, Any]) -> str:
    """json_too_deep for JSON past the nesting cap, whether our validators or the parser found it."""
    if error.get("type") == "json_too_deep":
        return "json_too_deep"
    if error.get("type") == "json_invalid" and "depth limit" in str((error.get("ctx") or {}).get("error")):
        return "json_too_deep"  # orjson stops at 1,024 levels
    return "invalid_value"


def app_from_env() -> FastAPI:
    """The app of one `--workers` process (uvicorn imports it by name): settings from TITO_*. A worker
    is a fresh process: its logging is set up here as `serve` set up its own (format, level, request
    ids), or its lines would be Python's bare defaults."""
    settings = Settings()
    configure_logs(settings.log_level, settings.log_format)
    return create_app(settings)


class WorkerHeader:
    """Names the serving process in `X-Tito-Worker` (its pid), so that a client of several workers
    can tell which one answered. Plain ASGI: no per-request task as a BaseHTTPMiddleware would cost."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.header = (b"x-tito-worker", str(os.getpid()).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, named)


# Container allocations between collections of the youngest generation (CPython's default: 700).
YOUNG_GC_THRESHOLD = 20_000


def _freeze_startup_heap() -> None:
    """Keep the start-up heap (tokenizer, templates, SQLAlchemy, FastAPI) out of every collection.

    Without this, the first full (generation 2) collection while serving walks those ~million objects
    and stalls the event loop for 60-200 ms: the lone slow turn seen around turn 50 of a long
    conversation. Frozen objects are never scanned; what serving allocates is still collected.

    A turn allocates thousands of containers, so at the default first threshold (700) the young
    generation is collected several times a turn and its survivors promoted into ever more middle
    collections. At 5,000 the collector's CPU under `bench.concurrency` fell by a third (0.41 s -> 0.28 s
    over 2,048 turns, timed with gc.callbacks), with the same resident memory under
    `bench.memory_soak` and no worse p99 in `bench.turn_latency`.

    At 20,000 (#17): under that load most of what a young collection walks is the state of the ~256
    requests in flight (coroutines, their frames, bodies), walked again at every collection and again
    in the middle generation. Collected four times less often, the collector's CPU fell from ~0.08 to
    ~0.03 ms a turn (4 interleaved pairs, gc.callbacks timed with thread_time), its longest pause no
    longer (~15-20 ms: a young collection now, a middle one before). A sequential conversation
    allocates too little to be collected more than once in ~200 turns at either threshold."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, middle, old)


async def _finish_idle_sessions(state: AppState) -> None:
    """Finish sessions idle past the timeout, so that harnesses that never finish still export. A
    session with a turn under way here is left open; a turn elsewhere that commits after the sweep
    is refused like any turn after a finish."""
    timeout = state.settings.session_idle_timeout_s
    if timeout <= 0:
        return
    while True:
        await asyncio.sleep(min(60.0, timeout / 4))
        try:
            finished = []
            async with state.db_sessions() as db, db.begin():
                repo = Repository(db)
                idle_before = utcnow() - timedelta(seconds=timeout)
                for session in await repo.idle_sessions(idle_before):
                    if session.id not in state.turns.in_flight and await repo.finish_session(
                        session, idle_before=idle_before
                    ):
                        finished.append(session)
            if finished:
                log.info("finished %d idle sessions", len(finished))
                await store_on_finish(
                    state.db_sessions, finished, state.renderer, state.settings.drift_report
                )
        except Exception:  # a sweep must never take the proxy down; the next one retries
            log.exception("idle-session sweep failed")


def _install_error_handlers(app: FastAPI) -> None:
    metrics: Metrics = app.state.metrics

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        if not isinstance(exc, ClientClosedRequest):
            # A client that hung up is counted as its aborted calls only, as a stream's is: nobody
            # reads this answer.
            metrics.refused(request.url.path, exc.status_code, exc.code, engine=isinstance(exc, EngineError))
        retry = exc.retry_after_s
        if retry is None and exc.status_code == 503:
            retry = app.state.proxy.settings.retry_after_s if hasattr(app.state, "proxy") else 5.0
        headers = {"Retry-After": str(max(1, math.ceil(retry)))} if retry is not None else {}
        if exc.should_retry is not None:
            headers["x-should-retry"] = "true" if exc.should_retry else "false"
        return JSONResponse(exc.envelope(), status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = _param_of(first)
        message = f"{first.get('msg', 'invalid request')}" + (f" (at {param})" if param else "")
        error = InvalidRequest(message, param=param, code=_validation_code(first))
        metrics.refused(request.url.path, 400, error.code)
        return JSONResponse(error.envelope(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """The router's own refusals (no such route, 404; a route without this method, 405 with its
        `Allow` header), in the envelope of the dialect the path belongs to."""
        metrics.failed(exc.status_code, None, False)
        headers = dict(exc.headers or {})
        if is_anthropic_path(request.url.path):
            anthropic = anthropic_error_body(exc.status_code, str(exc.detail), context.request_id.get())
            return JSONResponse(anthropic, status_code=exc.status_code, headers=headers)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = with_request_id(
            {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        )
        return JSONResponse(body, status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        if is_database_failure(exc):  # raised outside a guarded session (GuardedSession maps those)
            mapped = database_error(exc)
            log.warning("database failure: %s", mapped.message)
            metrics.refused(request.url.path, mapped.status_code, mapped.code)
            retry = app.state.proxy.settings.retry_after_s if hasattr(app.state, "proxy") else 5.0
            return JSONResponse(
                mapped.envelope(),
                status_code=mapped.status_code,
                headers={"Retry-After": str(max(1, math.ceil(retry)))},
            )
        log.exception("unexpected error", exc_info=exc)
        metrics.refused(request.url.path, 500, "internal_error")
        error = ProxyError("internal error in tito-proxy; see its log")
        return JSONResponse(error.envelope(), status_code=500)
