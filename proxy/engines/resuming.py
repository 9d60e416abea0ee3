"""An Engine wrapper that survives weight syncs: calls wait at the trainer's pause, and a generation the
engine aborted (a weight update's abort-all, vLLM's /pause) or lost to a restart continues from the
prompt plus the output already held, so the turn core sees one generation.

The continued generation keeps every sampled token with its logprob; `meta.weight_versions` gives
per-token version spans over the whole output (each attempt's own spans, shifted to its offset, the
ones the engine left unnamed labelled with the trainer's version at that attempt's dispatch) and
`meta.resumed` how many times it was continued. Every generation's meta (a stream's first and last
chunk's) names the trainer's version at its first dispatch (proxy/trainer_version.py): a call held at
the pause goes out under the version the trainer set before the resume, not the one its turn read.
A stop string split across the abort point is not seen by the engine (it only sees the
continuation's text): a known limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from proxy.engines.base import (
    ContextLimits,
    Engine,
    EngineInfo,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
    TopLogprobs,
)
from proxy.engines.routed_experts import RoutedExperts
from proxy.errors import (
    EngineError,
    EngineMismatch,
    EngineTimeout,
    InvalidEngineAnswer,
    InvalidRequest,
    ProxyError,
)
from proxy.trainer_version import DISPATCHED_VERSION, TrainerVersion
from proxy.weight_sync import PauseGate
from proxy.weight_versions import labelled

log = logging.getLogger("tito_proxy.resuming")


@dataclass
class _Held:
    """The output gathered over a generation's attempts."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[TopLogprobs] | None = None
    spans: list[dict[str, Any]] = field(default_factory=list)
    resumed: int = 0
    attempt_start: int = 0  # where the running attempt's output begins
    # Routed experts over the attempts so far; None once an attempt ended without them.
    experts: RoutedExperts | None = None
    experts_lost: bool = False
    # The session every attempt is sent for: with several engines, a continuation goes where the
    # session lives (or, once that engine is lost, where it moved).
    affinity: str | None = None
    # The trainer's version at the running attempt's dispatch, and at the first attempt's.
    label: str | None = None
    first_label: str | None = None
    dispatches: int = 0

    def dispatched(self, label: str | None) -> None:
        """An attempt goes out, under the trainer's `label`."""
        self.label = label
        if not self.dispatches:
            self.first_label = label
        self.dispatches += 1

    def add(self, ids: list[int], logprobs: list[float], top: list[TopLogprobs] | None) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        if top is not None:
            self.top = [*(self.top or []), *top]

    def add_experts(self, asked: bool, experts: RoutedExperts | None) -> None:
        """An attempt's routed experts, after the previous attempts' (an attempt without any, such
        as one cut by a restart, leaves the whole generation without them)."""
        if not asked or self.experts_lost:
            return
        if experts is None:
            self.experts, self.experts_lost = None, True
            return
        try:
            self.experts = experts if self.experts is None else self.experts.then(experts)
        except InvalidEngineAnswer as exc:  # the tokens are fine; only their routings cannot be joined
            log.warning("routed experts of a resumed generation dropped: %s", exc.message)
            self.experts, self.experts_lost = None, True

    def close_attempt(self, version: str | None, engine_spans: Any) -> None:
        """Record the finished attempt's version spans, shifted to where its output begins; what the
        engine left unnamed is the trainer's version at the attempt's dispatch."""
        start, end = self.attempt_start, len(self.ids)
        spans = engine_spans if isinstance(engine_spans, list) and engine_spans else None
        if spans is None and end > start:
            spans = [{"version": version, "start": 0, "end": end - start}]
        shifted = [
            {"version": span.get("version"), "start": start + span["start"], "end": start + span["end"]}
            for span in spans or []
        ]
        # Spans already held are named (or None without any label): joining them changes no label.
        self.spans = labelled([*self.spans, *labelled(shifted, self.label)], None)
        self.attempt_start = end

    @property
    def first_version(self) -> str | None:
        """The version of the first token sampled: the call's, recorded as at its dispatch."""
        return str(self.spans[0]["version"]) if self.spans and self.spans[0]["version"] is not None else None

    def meta(self) -> dict[str, Any]:
        if not self.resumed:
            return {DISPATCHED_VERSION: self.first_label}
        return {"weight_versions": self.spans, "resumed": self.resumed, DISPATCHED_VERSION: self.first_label}


def continues_exactly(params: SamplingParams) -> bool:
    """Whether a continuation from the prompt plus the output held samples as the cut generation
    would have. Not under a grammar (the engine would start it afresh at the continuation's first
    token) nor presence or frequency penalties (engines count the output's tokens only, and the held
    ones come back as prompt); a repetition penalty counts the prompt too, so it carries over."""
    return params.constraint is None and params.presence_penalty == 0 and params.frequency_penalty == 0


def _continued(prompt: PromptIds, params: SamplingParams, held: _Held) -> tuple[Any, SamplingParams]:
    ids = np.concatenate([np.asarray(prompt, dtype=np.int32), np.asarray(held.ids, dtype=np.int32)])
    if params.routed_experts is not None:
        # The continuation's routings begin at the last held token, which no attempt fed back yet.
        params = replace(params, routed_experts=replace(params.routed_experts, start=len(ids) - 1))
    if params.max_new_tokens is None:
        return ids, params
    return ids, replace(params, max_new_tokens=params.max_new_tokens - len(held.ids))


class ResumingEngine:
    """Wraps an engine: admission at the pause gate, in-flight counting, and resumption."""

    def __init__(
        self, inner: Engine, gate: PauseGate, *, restart_wait_s: float = 0.0, max_resumes: int = 8
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.supports_constraints = inner.supports_constraints
        self.limits: ContextLimits = inner.limits
        self.gate = gate
        self._restart_wait_s = restart_wait_s
        self._max_resumes = max_resumes
        self._current: dict[str, str] = {}  # a generation's request id -> its running attempt's
        # Generations the proxy itself aborted (their client left): never continued.
        self._abandoned: set[str] = set()
        # The newest version the engine reported (or named at a resume): the label of the tokens of an
        # attempt cut by a restart before the engine said which version sampled them.
        self.last_version: str | None = None
        # The trainer-set version, as current at each attempt's dispatch (set by the app; None: none).
        self.trainer_version: TrainerVersion | None = None

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.inner, attribute)  # report, honours_seed, wire_sampling...

    async def _wait_to_continue(self, error: Exception | None) -> None:
        """Before another attempt: the end of the pause, or (after a lost connection) the engine back."""
        if error is None:
            await self.gate.wait_open(self.gate.max_wait_s)
            return
        deadline = time.monotonic() + self._restart_wait_s
        while time.monotonic() < deadline:
            if await self.inner.ready():
                await self.gate.wait_open(self.gate.max_wait_s)
                return
            await asyncio.sleep(0.25)
        raise error

    async def _dispatch(self, held: _Held) -> None:
        """An attempt is about to go out, past the gate: the trainer's version it goes out under."""
        held.dispatched(await self.trainer_version.at_dispatch() if self.trainer_version else None)

    async def _abort_if_running(self, attempt: str, error: EngineError) -> None:
        """An attempt the proxy stopped waiting for (its timeout) may still be generating on the
        engine, which would spend its time on output nobody reads: it is aborted (best effort)."""
        if isinstance(error, EngineTimeout):
            with contextlib.suppress(ProxyError):
                await self.inner.abort(attempt)

    def _resumable(self, held: _Held, params: SamplingParams, produced: int, pauses_before: int) -> bool:
        """Whether an engine abort is a weight sync's, to be continued: it cut sampled output, or a
        pause began meanwhile. An abort before any token with no pause (an engine's refusal at
        admission looks the same) is retried once only. Output held under sampling a continuation
        cannot carry on ends the call aborted (never recorded as a training sample)."""
        if held.resumed >= self._max_resumes or not self._continuable(held, params):
            return False
        if produced or self.gate.paused or self.gate.pauses != pauses_before:
            return True
        return held.resumed == 0

    @staticmethod
    def _continuable(held: _Held, params: SamplingParams) -> bool:
        if held.ids and not continues_exactly(params):
            log.warning(
                "generation cut after %d tokens cannot be continued exactly (a grammar or presence/"
                "frequency penalties): it ends aborted",
                len(held.ids),
            )
            return False
        return True

    def _may_retry(self, held: _Held, params: SamplingParams, error: Exception) -> bool:
        # A refusal (4xx) is the request's fault: never retried. A lost engine is, within the budget.
        return (
            self._restart_wait_s > 0
            and not isinstance(error, InvalidRequest | EngineMismatch)
            and isinstance(error, EngineError)
            and held.resumed < self._max_resumes
            and self._continuable(held, params)
        )

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        await self.gate.admit()
        rid = request_id or uuid.uuid4().hex
        self.gate.in_flight += 1
        self._current[rid] = rid
        try:
            return await self._generate(input_ids, params, rid, _Held(affinity=affinity))
        finally:
            self.gate.in_flight -= 1
            self._current.pop(rid, None)
            self._abandoned.discard(rid)

    async def _generate(
        self, prompt: PromptIds, params: SamplingParams, request_id: str, held: _Held
    ) -> Generation:
        attempt = request_id
        while True:
            ids, continued = _continued(prompt, params, held) if held.resumed else (prompt, params)
            pauses = self.gate.pauses
            await self._dispatch(held)
            try:
                generation = await self.inner.generate(ids, continued, attempt, affinity=held.affinity)
            except EngineError as exc:
                await self._abort_if_running(attempt, exc)
                if request_id in self._abandoned or not self._may_retry(held, params, exc):
                    raise
                log.warning("engine lost mid-generation (%s); continuing when it is back", exc.message)
                await self._wait_to_continue(exc)
                held.resumed += 1
                continue
            self.last_version = generation.weight_version or self.last_version
            if (
                not held.resumed
                and generation.finish.kind != "abort"
                and (params.routed_experts is not None or generation.routed_experts is None)
            ):
                # One attempt, finished: what is held below would rebuild the very same generation
                # (dataclasses' replace alone cost ~10 µs a turn). Its meta is this call's own dict.
                generation.meta[DISPATCHED_VERSION] = held.first_label
                return generation
            held.add(generation.output_ids, generation.logprobs, generation.top_logprobs)
            held.add_experts(params.routed_experts is not None, generation.routed_experts)
            held.close_attempt(generation.weight_version, generation.meta.get("weight_versions"))
            produced = len(generation.output_ids)
            if (
                generation.finish.kind != "abort"
                or request_id in self._abandoned
                or not self._resumable(held, params, produced, pauses)
            ):
                return replace(
                    generation,
                    output_ids=held.ids,
                    logprobs=held.logprobs,
                    top_logprobs=held.top,
                    weight_version=held.first_version or generation.weight_version,
                    meta={**generation.meta, **held.meta()},
                    routed_experts=held.experts,
                )
            log.info("generation aborted by the engine after %d tokens; resuming", len(held.ids))
            await self._wait_to_continue(None)
            held.resumed += 1
            self.gate.resumed_generations += 1
            attempt = uuid.uuid4().hex  # fixed length, as the first
            self._current[request_id] = attempt

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        await self.gate.admit()
        held = _Held(affinity=affinity)
        chunks = await self._open(input_ids, params, request_id, held)
        self.gate.in_flight += 1
        self._current[request_id] = request_id
        return self._resumed(input_ids, params, request_id, chunks, held)

    async def _open(
        self, prompt: PromptIds, params: SamplingParams, attempt: str, held: _Held
    ) -> AsyncIterator[StreamChunk]:
        """Open a stream of the generation's next attempt; an engine that is down is waited for."""
        while True:
            ids, continued = _continued(prompt, params, held) if held.ids else (prompt, params)
            await self._dispatch(held)
            try:
                return await self.inner.stream(ids, continued, attempt, affinity=held.affinity)
            except EngineError as exc:
                await self._abort_if_running(attempt, exc)
                if not self._may_retry(held, params, exc):
                    raise
                await self._wait_to_continue(exc)
                held.resumed += 1

    async def _resumed(
        self,
        prompt: PromptIds,
        params: SamplingParams,
        request_id: str,
        chunks: AsyncIterator[StreamChunk],
        held: _Held,
    ) -> AsyncIterator[StreamChunk]:
        sent = False  # whether a chunk went out yet: the first names the dispatched version
        try:
            while True:
                error: Exception | None = None
                seen: str | None = None  # the version this attempt's chunks named, if any
                started = self.last_version  # the engine's version when this attempt began
                pauses = self.gate.pauses
                try:
                    async for chunk in chunks:
                        held.add(chunk.output_ids, chunk.logprobs, chunk.top_logprobs)
                        if chunk.weight_version is not None:
                            seen = self.last_version = chunk.weight_version
                        aborted = chunk.finish is not None and chunk.finish.kind == "abort"
                        produced = len(held.ids) - held.attempt_start
                        resumable = (
                            aborted
                            and request_id not in self._abandoned
                            and self._resumable(held, params, produced, pauses)
                        )
                        if chunk.finish is not None:
                            held.add_experts(params.routed_experts is not None, chunk.routed_experts)
                        if chunk.finish is None or resumable:
                            if chunk.output_ids:
                                first = not sent
                                sent = True
                                yield replace(
                                    chunk,
                                    finish=None,
                                    routed_experts=None,
                                    meta={**chunk.meta, **held.meta()} if first else chunk.meta,
                                )
                            if aborted:
                                held.close_attempt(chunk.weight_version, chunk.meta.get("weight_versions"))
                                break
                            continue
                        held.close_attempt(chunk.weight_version, chunk.meta.get("weight_versions"))
                        yield replace(
                            chunk,
                            weight_version=(held.first_version or chunk.weight_version)
                            if held.resumed
                            else chunk.weight_version,
                            meta={**chunk.meta, **held.meta()},
                            routed_experts=held.experts,
                        )
                        return
                except EngineError as exc:
                    await self._abort_if_running(self._current.get(request_id, request_id), exc)
                    if request_id in self._abandoned or not self._may_retry(held, params, exc):
                        raise
                    if len(held.ids) > held.attempt_start:  # its tokens came without their routings
                        held.add_experts(params.routed_experts is not None, None)
                    held.close_attempt(seen or started, None)
                    error = exc
                await self._wait_to_continue(error)
                held.resumed += 1
                self.gate.resumed_generations += 1
                attempt = uuid.uuid4().hex  # fixed length, as the first
                self._current[request_id] = attempt
                chunks = await self._open(prompt, params, attempt, held)
        finally:
            self.gate.in_flight -= 1
            self._current.pop(request_id, None)
            self._abandoned.discard(request_id)

    async def refresh_version(self) -> None:
        """Read the engine's current weight version (at a resume: the version that samples next)."""
        try:
            version = (await self.inner.info()).weight_version
        except ProxyError:
            return
        self.last_version = version or self.last_version

    async def abort(self, request_id: str) -> None:
        """The proxy's own abort (the client left): the generation ends, it is not continued."""
        if request_id in self._current:
            self._abandoned.add(request_id)
        await self.inner.abort(self._current.get(request_id, request_id))

    async def abort_in_flight(self) -> None:
        """Abort every running generation (they resume after the pause): streams by id, and the rest
        through the engine's abort-all where it has one."""
        for attempt in list(self._current.values()):
            await self.inner.abort(attempt)
        abort_all = getattr(self.inner, "abort_all", None)
        if callable(abort_all):
            await abort_all()

    async def info(self) -> EngineInfo:
        return await self.inner.info()

    async def ready(self) -> bool:
        return await self.inner.ready()

    async def aclose(self) -> None:
        await self.inner.aclose()
