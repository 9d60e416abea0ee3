"""TurnRunner: one turn end to end (plan, sample, record, answer text) for every session.

It composes the planner (proxy/turns/planning.py), the recorder (recording.py) and the answer text
(answer_text.py); the call is committed before the caller sees the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any

from proxy.chat.call_format import choose_parser
from proxy.chat.parsing import OutputParser, ParsedOutput
from proxy.chat.renderer import Renderer
from proxy.engines.base import Engine, FinishReason, Generation
from proxy.errors import ClientClosedRequest, EngineError, SessionFinished
from proxy.ids import random_hex
from proxy.observe.metrics import Metrics
from proxy.store.prompts import ContextCache
from proxy.store.turn_store import ContinuedCall, SessionState, TurnStore
from proxy.trainer_version import TrainerVersion
from proxy.turns.answer_text import AnswerText
from proxy.turns.planning import TurnPlanner
from proxy.turns.recording import TurnRecorder
from proxy.turns.request import PreparedTurn, TurnRequest, TurnResult
from proxy.weight_sync import PauseGate


class TurnRunner:
    """Runs chat turns for every session of this process."""

    def __init__(
        self,
        *,
        renderer: Renderer,
        engine: Engine,
        store: TurnStore,
        context_length: int | None,
        parser: OutputParser | None = None,
        history_mode: str = "exact",
        contexts: ContextCache | None = None,
        clock: Callable[[], float] = time.perf_counter,
        trainer_version: TrainerVersion | None = None,
    ) -> None:
        self.renderer = renderer
        self.engine = engine
        self.store = store
        self.history_mode = history_mode
        # The trainer-set version (POST /admin/weight_version, kept in the database and read with
        # every turn's start), shared with the engine wrapper that dispatches the calls (the app's
        # ResumingEngine, whose pause gate it follows); one of its own for other engines.
        self.trainer_version = trainer_version or TrainerVersion(store.trainer_version, PauseGate())
        self.parser = parser or choose_parser(renderer)[0]
        self.contexts = contexts or ContextCache()
        self._clock = clock
        # Sessions with a turn under way in this process: the idle sweep leaves them open.
        self.in_flight: Counter[str] = Counter()
        self._idle = asyncio.Event()  # set while no turn is under way
        self._idle.set()
        # The parts share the renderer, store and context cache: what one records the other continues.
        self.answers = AnswerText(renderer, self.parser)
        self.planner = TurnPlanner(
            renderer=renderer,
            engine=engine,
            store=store,
            contexts=self.contexts,
            context_length=context_length,
            history_mode=history_mode,
        )
        self.recorder = TurnRecorder(
            engine=engine,
            store=store,
            contexts=self.contexts,
            answers=self.answers,
            clock=clock,
            alone=self._alone,
        )

    @property
    def context_length(self) -> int | None:
        """The model's context (None: unknown, nothing is bounded by it); the planner's."""
        return self.planner.context_length

    @context_length.setter
    def context_length(self, context_length: int | None) -> None:
        self.planner.context_length = context_length

    @property
    def metrics(self) -> Metrics | None:
        """The app's metrics (None in tests that build a runner alone); the recorder updates them."""
        return self.recorder.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics | None) -> None:
        self.recorder.metrics = metrics

    def _alone(self) -> bool:
        """Whether at most one turn is under way in this process (the one being recorded)."""
        return len(self.in_flight) <= 1 and sum(self.in_flight.values()) <= 1

    @contextlib.contextmanager
    def busy(self, session_id: str) -> Iterator[None]:
        """Marks the session as having a turn under way until the turn is answered."""
        self.in_flight[session_id] += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight[session_id] -= 1
            if not self.in_flight[session_id]:
                del self.in_flight[session_id]
            if not self.in_flight:
                self._idle.set()

    async def settled(self, limit_s: float) -> bool:
        """Whether every turn under way ended within `limit_s` (a cancelled one ends once it has
        aborted its engine request and recorded what was sampled)."""
        try:
            await asyncio.wait_for(self._idle.wait(), limit_s)
        except TimeoutError:
            return False
        return True

    async def prepare(self, session_id: str, request: TurnRequest) -> PreparedTurn:
        """Everything before the engine call: the session, the prompt ids, bounded sampling."""
        started = self._clock()
        session, trainer_version, candidates = await self._start(session_id, request)
        if session is not None and session.status == "finished":
            raise SessionFinished(f"session {session_id!r} is finished; start a new one", param="session_id")
        template_now = render_date(session)
        plan, params = await self.planner.plan(session_id, request, template_now, candidates)
        return PreparedTurn(
            session_id=session_id,
            request=request,
            plan=plan,
            params=params,
            template_now=template_now,
            # The trainer-set version at the turn's start, whichever process set it: the calls' unless
            # the engine wrapper says it dispatched them under a newer one (after a pause).
            dispatched_version=trainer_version or self.trainer_version.fallback,
            started=started,
            rendered=self._clock(),
            reasoning_open=self.answers.reasoning_open(plan.prompt),
            parser=self.parser_for(request),
        )

    async def _start(
        self, session_id: str, request: TurnRequest
    ) -> tuple[SessionState | None, str | None, list[ContinuedCall] | None]:
        """The session's state, the trainer-set weight version and, for a request that echoes a
        history, the calls recorded under it (both reads in one statement)."""
        history = self.planner.history_key(request)
        epoch = self.trainer_version.epoch()
        if history is None:
            session, trainer_version = await self.store.turn_start(session_id)
            self.trainer_version.note(trainer_version, epoch)
            return session, trainer_version, None
        started = await self.store.turn_start_with_history(session_id, history[1])
        self.trainer_version.note(started[1], epoch)
        return started

    async def prompt_length(self, session_id: str, request: TurnRequest) -> int:
        """The length of the prompt `request` would be sent as the session's next turn: planned as
        that turn plans it (the session's pinned date, the recorded call it continues), nothing
        sampled nor recorded."""
        session, _, candidates = await self._start(session_id, request)
        plan = await self.planner.plan_prompt(session_id, request, render_date(session), candidates)
        return len(plan.prompt)

    async def template_now(self, session_id: str) -> datetime:
        """The date the session's next turn renders with: what a render outside a turn must use,
        so that it gives the prompt that turn sends."""
        return render_date(await self.store.session_state(session_id))

    def parser_for(self, request: TurnRequest) -> OutputParser:
        return self.answers.parser_for(request)

    async def run(
        self, session_id: str, request: TurnRequest, *, client_gone: asyncio.Future[Any] | None = None
    ) -> list[TurnResult]:
        """Sample every choice, then commit them together: all are recorded, or none. When
        `client_gone` completes before the commit (the client hung up), the engine requests are
        aborted and what they sampled is recorded as aborted (never exported), then
        ClientClosedRequest is raised. A future rather than an event: no task per turn to wait on it."""
        turn = await self.prepare(session_id, request)
        if _completed(client_gone):
            raise ClientClosedRequest("the client left before its turn was sampled")
        # 32 hex digits as a uuid4's (fixed length: see sglang.py).
        request_ids = [random_hex() for _ in range(request.choices)]
        sampling: asyncio.Future[list[Generation]] = asyncio.ensure_future(self._sample(turn, request_ids))
        if client_gone is not None:
            try:
                await _either(sampling, client_gone)
            except asyncio.CancelledError:
                sampling.cancel()
                raise
            if _completed(client_gone):
                await self.recorder.abandon(turn, sampling, request_ids)
        generations = await sampling  # cancelled with this task, as the engine requests must be
        results = await self.record_choices(turn, list(enumerate(generations)))
        for generation in generations:
            if generation.finish.kind == "abort":
                raise EngineError(
                    f"the engine aborted the request: {generation.finish.message}", code="engine_aborted"
                )
        return results

    async def _sample(self, turn: PreparedTurn, request_ids: list[str]) -> list[Generation]:
        """Every choice's generation, in order. One choice (nearly every turn) is awaited in this task:
        a gather would add a task and a future per turn."""
        prompt, params, session_id = turn.plan.engine_prompt(), turn.params, turn.session_id
        if len(request_ids) == 1:
            return [await self.engine.generate(prompt, params, request_ids[0], affinity=session_id)]
        return list(
            await asyncio.gather(
                *(
                    self.engine.generate(prompt, params.for_choice(index), rid, affinity=session_id)
                    for index, rid in enumerate(request_ids)
                )
            )
        )

    async def record(
        self, turn: PreparedTurn, generation: Generation, *, status: str | None = None, choice_index: int = 0
    ) -> TurnResult:
        """Commit one call, then remember its context; the caller answers only after this returns."""
        (result,) = await self.record_choices(turn, [(choice_index, generation)], status=status)
        return result

    async def record_choices(
        self,
        turn: PreparedTurn,
        generations: Sequence[tuple[int, Generation]],
        *,
        status: str | None = None,
    ) -> list[TurnResult]:
        """Commit the calls of one request in one transaction, then remember their contexts."""
        return await self.recorder.record_choices(turn, generations, status=status)

    async def encode_prompt_text(self, text: str) -> list[int]:
        """A /v1/completions text prompt as SGLang tokenizes it (the tokenizer's BOS included)."""
        return await self.planner.encode_prompt_text(text)

    def close(self) -> None:
        """Stop the render workers; a render still running ends on its own (it cannot be interrupted)."""
        self.planner.close()

    def output_text(self, output_ids: Sequence[int], finish: FinishReason | None) -> str:
        """The text of sampled ids as parsers see it (stop token and matched stop string removed)."""
        return self.answers.output_text(output_ids, finish)

    def parse(
        self, generation: Generation, *, reasoning_open: bool = False, parser: OutputParser | None = None
    ) -> ParsedOutput:
        return self.answers.parse(generation, reasoning_open=reasoning_open, parser=parser)


def render_date(session: SessionState | None) -> datetime:
    """The date a session's templates print: pinned when it was first rendered (or created by POST
    /sessions), so that a later turn extends its prompt; a session not yet recorded renders today's."""
    return session.template_now if session is not None else datetime.now()


async def _either(first: asyncio.Future[Any], second: asyncio.Future[Any]) -> None:
    """Returns once either future is done: asyncio.wait(..., FIRST_COMPLETED) without the sets of
    done and pending futures it builds, nor its checks of what it is given."""
    waiter: asyncio.Future[None] = first.get_loop().create_future()

    def wake(_: asyncio.Future[Any]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    first.add_done_callback(wake)
    second.add_done_callback(wake)
    try:
        await waiter
    finally:
        first.remove_done_callback(wake)
        second.remove_done_callback(wake)


def _completed(future: asyncio.Future[Any] | None) -> bool:
    """Whether `future` finished with a result (one that failed or was cancelled says nothing)."""
    return future is not None and future.done() and not future.cancelled() and future.exception() is None
