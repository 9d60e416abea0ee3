"""Several engines of one model behind the Engine protocol: a session's calls stay on one engine.

Rule: a session's turns go to the engine it is assigned to (its prefix cache holds the session); a
new session goes to the least loaded healthy engine (fewest turns in flight, then fewest sessions).
An engine that fails its health check (every `engine_health_interval_s`), or whose connection is
lost mid-call, is taken out: no new calls, and each of its sessions is moved to a healthy engine on
its next turn. Nothing about tokens changes: the proxy renders the same prompt ids for any engine.
The assignment is stored in the database (AffinityStore), so `--workers` processes agree on it.
A lone engine that is down is still tried (a health check may be stale), as with no pool at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from proxy.engines.base import (
    ContextLimits,
    Engine,
    EngineInfo,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
)
from proxy.engines.members import AffinityStore, Connect, EngineRegistry, Member, MemoryAffinity
from proxy.errors import Conflict, EngineError, EngineUnavailable, InvalidRequest, NotFound, ProxyError

log = logging.getLogger("tito_proxy.pool")
_REMEMBERED = 100_000  # sessions whose engine this process keeps in memory


class EnginePool:
    """Engines of one model; implements Engine, choosing the engine of each call by its affinity."""

    def __init__(
        self,
        members: list[Member],
        *,
        store: AffinityStore | None = None,
        health_interval_s: float = 5.0,
        connect: Connect | None = None,
    ) -> None:
        assert members, "a pool needs an engine"
        self.members: dict[str, Member] = {m.id: m for m in members}
        first = members[0].engine
        self.name: str = first.name
        self.supports_constraints: bool = all(m.engine.supports_constraints for m in members)
        self.limits: ContextLimits = first.limits
        self.store: AffinityStore = store or MemoryAffinity()
        self.registry: EngineRegistry | None = None  # None: this process's engines are the only ones
        self.health_interval_s = health_interval_s
        self._connect = connect
        self._running: dict[str, Member] = {}  # request id -> the member running it
        # Session -> engine id, as last seen by this process (the newest first out of the store).
        self._local: OrderedDict[str, str] = OrderedDict()
        self._health: asyncio.Task[None] | None = None
        self._drains: set[asyncio.Task[None]] = set()
        self.model: str | None = None  # the model every engine must serve

    def __getattr__(self, attribute: str) -> Any:
        # An engine's extras (report, honours_seed, wire_sampling...): the engines are of one kind.
        first = next(iter(self.__dict__["members"].values()))
        return getattr(first.engine, attribute)

    # -- choosing --------------------------------------------------------------------------------

    def _least_loaded(self, avoid: set[str]) -> Member | None:
        candidates = [m for m in self.members.values() if m.usable and m.id not in avoid]
        if not candidates:  # none healthy: a stale check must not stop a lone engine from being tried
            candidates = [
                m
                for m in self.members.values()
                if not m.draining and m.id not in avoid and (m.model_known or len(self.members) == 1)
            ]
        return min(candidates, key=lambda m: (m.in_flight, m.sessions), default=None)

    async def _pick(self, affinity: str | None, avoid: set[str]) -> Member:
        if affinity is None:
            member = self._least_loaded(avoid)
        else:
            member = await self._assigned(affinity, avoid)
        if member is None:
            raise EngineUnavailable("no engine of this proxy is available; retry later")
        return member

    async def _assigned(self, session_id: str, avoid: set[str]) -> Member | None:
        if len(self.members) == 1:
            # One engine: nothing to choose, so nothing to store (a read and a durable insert per new
            # session otherwise). Sessions placed once a second engine is added are stored then.
            [only] = self.members.values()
            return None if only.id in avoid else self._remember(session_id, only)
        engine_id = self._local.get(session_id)
        if engine_id is None or engine_id not in self.members:
            engine_id = await self.store.get(session_id)
        current = self.members.get(engine_id) if engine_id is not None else None
        if current is not None and current.usable and current.id not in avoid:
            return self._remember(session_id, current)
        chosen = self._least_loaded(avoid)
        if chosen is None or chosen is current:
            return current if current is not None and current.id not in avoid else chosen
        # Counted (as a session, and as the call it is about to make) before the store's write is
        # awaited: new sessions picked meanwhile (a batch of rollouts starting together) see this one,
        # instead of all taking the same least loaded engine.
        chosen.sessions += 1
        chosen.in_flight += 1
        try:
            winner = self.members.get(await self.store.assign(session_id, chosen.id, replacing=engine_id))
        finally:
            chosen.sessions -= 1
            chosen.in_flight -= 1
        if winner is not None and winner.usable and winner.id not in avoid:
            chosen = winner  # another process assigned it first
        if current is not None:
            log.info("session %s moves from engine %s to %s", session_id, current.id, chosen.id)
        return self._remember(session_id, chosen)

    def _remember(self, session_id: str, member: Member) -> Member:
        previous = self._local.pop(session_id, None)
        if previous != member.id:
            member.sessions += 1
            if previous in self.members:
                self.members[previous].sessions -= 1
        self._local[session_id] = member.id
        if len(self._local) > _REMEMBERED:
            self._local.popitem(last=False)  # the store still has it
        return member

    # -- calls -----------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        rid = request_id or uuid.uuid4().hex
        tried: set[str] = set()
        while True:
            member = await self._pick(affinity, tried)
            member.begin()
            self._running[rid] = member
            try:
                return await member.engine.generate(input_ids, params, rid, affinity=affinity)
            except EngineUnavailable as exc:
                # Nothing of the call reached the caller: it is sampled afresh on another engine.
                if not self._lost(member, exc, tried):
                    raise
            finally:
                member.end()
                self._running.pop(rid, None)

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        tried: set[str] = set()
        while True:
            member = await self._pick(affinity, tried)
            try:
                chunks = await member.engine.stream(input_ids, params, request_id, affinity=affinity)
                break
            except EngineUnavailable as exc:  # refused before any chunk: opened on another engine
                if not self._lost(member, exc, tried):
                    raise
        return self._counted(member, request_id, chunks)

    async def _counted(
        self, member: Member, request_id: str, chunks: AsyncIterator[StreamChunk]
    ) -> AsyncIterator[StreamChunk]:
        # Counted from the first read: a stream never read never runs its `finally` either.
        member.begin()
        self._running[request_id] = member
        try:
            async for chunk in chunks:
                yield chunk
        except EngineError as exc:
            # Cut mid-stream: what was streamed stays (the resuming wrapper continues it); the engine
            # is checked now so the continuation and the session's next turns go elsewhere if it is gone.
            if not await self._check(member):
                member.last_error = exc.message
            raise
        finally:
            member.end()
            self._running.pop(request_id, None)
            if isinstance(chunks, AsyncGenerator):
                await chunks.aclose()

    def _lost(self, member: Member, exc: EngineError, tried: set[str]) -> bool:
        """Take a member that could not be reached out; whether another one is left to try."""
        tried.add(member.id)
        self._mark(member, healthy=False, error=exc.message)
        return any(m.id not in tried and not m.draining for m in self.members.values())

    async def abort(self, request_id: str) -> None:
        member = self._running.get(request_id)
        targets = [member] if member is not None else list(self.members.values())
        await asyncio.gather(*(m.engine.abort(request_id) for m in targets))

    async def abort_all(self) -> None:
        async def one(member: Member) -> None:
            abort_all = getattr(member.engine, "abort_all", None)
            if callable(abort_all):
                await abort_all()

        await asyncio.gather(*(one(m) for m in self.members.values()))

    async def info(self) -> EngineInfo:
        usable = [m for m in self.members.values() if m.usable] or list(self.members.values())
        return await usable[0].engine.info()

    async def ready(self) -> bool:
        checks = await asyncio.gather(*(self._check(m) for m in self.members.values() if not m.draining))
        return any(checks)

    async def aclose(self) -> None:
        for task in [self._health, *self._drains]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for member in self.members.values():
            await member.engine.aclose()

    # -- health and membership -------------------------------------------------------------------

    def start(self) -> None:
        """Start the periodic health check (inside the serving event loop)."""
        if self._health is None:
            self._health = asyncio.create_task(self._check_forever())

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.reconcile()
                await asyncio.gather(*(self._check(m) for m in list(self.members.values())))
            except Exception:  # a health round must never stop the next one
                log.exception("engine health check failed")

    async def reconcile(self) -> None:
        """Follow the engines other processes added or removed at run time (and, at start, those
        added or removed before a restart)."""
        if self.registry is None:
            return
        for engine_id, url, removed in await self.registry.entries():
            member = self.members.get(engine_id)
            if removed and member is not None and not member.draining:
                if all(m.draining or m is member for m in self.members.values()):
                    continue  # never this process's last engine
                member.draining = True
                self._drains.add(asyncio.create_task(self._drain(member)))
                self._drains = {task for task in self._drains if not task.done()}
            elif not removed and member is None:
                try:
                    await self._join(url, engine_id)
                except Exception as exc:  # tried again next round
                    log.warning(
                        "engine %s (%s) registered elsewhere cannot be added here: %s", engine_id, url, exc
                    )

    async def _check(self, member: Member) -> bool:
        try:
            ok = await asyncio.wait_for(member.engine.ready(), timeout=10.0)
        except Exception as exc:  # an engine's probe failing in any way is an unhealthy engine
            ok = False
            member.last_error = str(exc) or type(exc).__name__
        if ok and not member.model_known:
            ok = await self._model_found(member)
        self._mark(member, healthy=ok, error=None if ok else member.last_error or "health check failed")
        return ok

    async def _model_found(self, member: Member) -> bool:
        """Whether an engine that was down at start serves the pool's model, now that it answers: one
        serving another model never takes a call (its tokens would be recorded as this model's)."""
        try:
            await self.check_model(member.engine, member.url)
        except ProxyError as exc:
            member.last_error = exc.message
            return False
        member.model_known = True
        log.info("engine %s (%s) serves this proxy's model", member.id, member.url)
        return True

    def _mark(self, member: Member, *, healthy: bool, error: str | None) -> None:
        if member.healthy != healthy:
            if healthy:
                log.info("engine %s (%s) is healthy again", member.id, member.url)
            else:
                log.warning("engine %s (%s) is out: %s", member.id, member.url, error)
        member.healthy = healthy
        if error is not None:
            member.last_error = error

    async def add(self, url: str, engine_id: str | None = None) -> Member:
        """Register an engine at run time: identified and probed as at start, same model required."""
        url = url.rstrip("/")
        if engine_id in self.members:
            raise Conflict(f"an engine with id {engine_id!r} is registered already", code="engine_exists")
        if any(m.url == url for m in self.members.values()):
            raise Conflict(f"the engine at {url} is registered already", code="engine_exists")
        return await self._join(url, engine_id, record=True)

    async def _join(self, url: str, engine_id: str | None, *, record: bool = False) -> Member:
        assert self._connect is not None, "this pool takes no engines at run time"
        engine, kind = await self._connect(url)
        try:
            await self.check_model(engine, url)
            if engine_id in self.members:  # registered meanwhile by a concurrent call
                raise Conflict(f"an engine with id {engine_id!r} is registered already", code="engine_exists")
            engine_id = await self._record(url, engine_id) if record else engine_id or self._new_id()
        except BaseException:
            await engine.aclose()
            raise
        member = Member(engine_id, url, kind, engine)
        self.members[engine_id] = member
        self.supports_constraints = self.supports_constraints and engine.supports_constraints
        log.info("engine %s (%s) added", engine_id, url)
        return member

    async def check_model(self, engine: Engine, url: str) -> None:
        """Every engine must serve the model the others serve (the ids rendered mean the same tokens)."""
        try:
            model = (await engine.info()).model
        except ProxyError as exc:
            raise InvalidRequest(
                f"the engine at {url} did not tell its model: {exc.message}", code="engine_unreachable"
            ) from exc
        if self.model is None or model == "unknown":
            self.model = self.model or (model if model != "unknown" else None)
            return
        if model != self.model:
            raise InvalidRequest(
                f"the engine at {url} serves {model!r}, not {self.model!r} as this proxy's engines do",
                code="engine_model_mismatch",
            )

    async def _record(self, url: str, engine_id: str | None) -> str:
        """Store a registration for every process; an id made up here skips those taken elsewhere."""
        if engine_id is not None or self.registry is None:
            engine_id = engine_id or self._new_id()
            if self.registry is not None:
                await self.registry.added(engine_id, url)
            return engine_id
        taken: set[str] = set()
        while True:
            candidate = self._new_id(taken)
            try:
                await self.registry.added(candidate, url)
                return candidate
            except Conflict:
                taken.add(candidate)

    def _new_id(self, taken: set[str] | None = None) -> str:
        index = len(self.members)
        while f"engine-{index}" in self.members or f"engine-{index}" in (taken or set()):
            index += 1
        return f"engine-{index}"

    async def remove(self, engine_id: str) -> Member:
        """Drain an engine: no new calls; its calls in flight finish; its sessions move on their next
        turn. Returns once it has no call left."""
        member = self.members.get(engine_id)
        if member is None:
            raise NotFound(f"no engine with id {engine_id!r}", code="engine_not_found")
        if all(m.draining or m is member for m in self.members.values()):
            raise Conflict("the proxy's last engine cannot be removed; add another first", code="last_engine")
        member.draining = True
        if self.registry is not None:
            await self.registry.removed(engine_id, member.url)
        await self._drain(member)
        return member

    async def _drain(self, member: Member) -> None:
        await member.idle.wait()
        if self.members.get(member.id) is member:
            del self.members[member.id]
            await member.engine.aclose()
            log.info("engine %s (%s) removed", member.id, member.url)

    def engines_report(self) -> list[dict[str, Any]]:
        return [m.report() for m in self.members.values()]
