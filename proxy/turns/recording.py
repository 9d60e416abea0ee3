"""After the engine call: build the recorded calls, commit a request's choices, remember their contexts."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

import anyio
import numpy as np

from proxy.chat.messages import Message, canonical_json
from proxy.chat.parsing import ParsedOutput
from proxy.engines.base import Engine, Generation, SamplingParams
from proxy.engines.prompt_json import items_of, joined
from proxy.errors import ClientClosedRequest, ProxyError
from proxy.observe.metrics import Metrics
from proxy.store.codec import pack_ids, pack_logprobs
from proxy.store.prompts import ContextCache, Recorded
from proxy.store.turn_store import NewCall, TurnStore, TurnWrite
from proxy.trainer_version import DISPATCHED_VERSION
from proxy.turns.answer_text import AnswerText, finish_for_openai, status_of
from proxy.turns.request import PreparedTurn, TurnResult
from proxy.weight_versions import covering, labelled, span_versions

log = logging.getLogger("tito_proxy.turns")

# How long an aborted engine request may take to answer with what it sampled before it is dropped.
ABORT_ANSWER_S = 10.0


class TurnRecorder:
    """Commits sampled turns to the store; a committed call's context is kept for its continuations."""

    def __init__(
        self,
        *,
        engine: Engine,
        store: TurnStore,
        contexts: ContextCache,
        answers: AnswerText,
        clock: Callable[[], float],
        alone: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine = engine
        # Whether the turn being recorded is the only one under way (its commit may then block the loop).
        self._alone = alone
        self.store = store
        self.contexts = contexts
        self.answers = answers
        self._clock = clock
        self.metrics: Metrics | None = None  # set by the app; None in tests that build a runner alone
        self._wire: Callable[[SamplingParams], dict[str, Any]] | None = None

    def _wire_sampling(self, params: SamplingParams) -> dict[str, Any]:
        """The sampling parameters as recorded. The engine's way is looked up once, on the first call
        (a pool has no member to ask before its engines are set up), not through its wrappers each turn."""
        if self._wire is None:
            self._wire = _sampling_recorder(self.engine)
        return self._wire(params)

    async def record_choices(
        self,
        turn: PreparedTurn,
        generations: Sequence[tuple[int, Generation]],
        *,
        status: str | None = None,
    ) -> list[TurnResult]:
        """Commit the calls of one request in one transaction, then remember their contexts."""
        generated = self._clock()
        # One dict for the request's calls, filled once they are built (parse_ms times the building):
        # no copy of each call to set it.
        timings: dict[str, float] = {}
        built = [
            self._new_call(turn, index, generation, status or status_of(generation), timings)
            for index, generation in generations
        ]
        done = self._clock()
        timings.update(_timings(turn.started, turn.rendered, generated, done))
        call_ids = await self.store.record(
            TurnWrite(
                session_id=turn.session_id, template_now=turn.template_now, calls=[call for call, _ in built]
            ),
            alone=self._alone(),
        )
        if self.metrics is not None:
            statuses = [call.status for call, _ in built]
            sampled = sum(len(generation.output_ids) for _, generation in generations)
            self._observe(self.metrics, turn, statuses, sampled, (generated, done))
        results = []
        for call_id, (call, output), (index, generation) in zip(call_ids, built, generations, strict=True):
            if call.status == "ok":
                self._remember(turn, call_id, generation, output.as_message())
                if turn.plan.parent is not None:
                    # A child takes over its parent's context: memory holds about one per live branch.
                    self.contexts.drop(turn.plan.parent.id)
            results.append(
                TurnResult(
                    call_id=call_id,
                    session_id=turn.session_id,
                    output=output,
                    finish_reason=call.finish_detail["openai"],
                    prompt_tokens=len(turn.plan.prompt),
                    completion_tokens=len(generation.output_ids),
                    generation=generation,
                    choice_index=index,
                    request_id=turn.request_id,
                )
            )
        return results

    def _observe(
        self, metrics: Metrics, turn: PreparedTurn, statuses: list[str], sampled: int, at: tuple[float, float]
    ) -> None:
        recorded = self._clock()
        generated, done = at
        metrics.turn_recorded(
            turn.request.dialect,
            statuses,
            {
                "render": turn.rendered - turn.started,
                "engine": generated - turn.rendered,
                "record": recorded - done,
                "total": recorded - turn.started,
            },
            (len(turn.plan.prompt) * len(statuses), sampled),
        )
        if turn.plan.parent is None:  # each call opens its own segment (n > 1: one per choice)
            metrics.segments.labels(turn.plan.new_segment_reason).inc(len(statuses))

    async def abandon(
        self, turn: PreparedTurn, sampling: asyncio.Future[list[Generation]], request_ids: list[str]
    ) -> NoReturn:
        """The client left: stop sampling, keep what was sampled as aborted, answer nobody."""
        with anyio.CancelScope(shield=True):
            if not sampling.done():
                for request_id in request_ids:
                    await self.engine.abort(request_id)
            try:
                # An aborted SGLang request answers at once with what it sampled so far.
                generations = await asyncio.wait_for(sampling, ABORT_ANSWER_S)
                await self.record_choices(turn, list(enumerate(generations)), status="aborted")
            except (ProxyError, TimeoutError) as exc:
                log.info("session %s: the abandoned turn is not recorded: %s", turn.session_id, exc)
        raise ClientClosedRequest("the client left before its answer; the turn was aborted")

    def _remember(self, turn: PreparedTurn, call_id: int, generation: Generation, reply: Message) -> None:
        plan = turn.plan
        output = np.asarray(generation.output_ids, dtype=np.int32)
        context = np.concatenate([plan.prompt, output])
        # The next turn's request body starts with these: written here once, from the prompt's.
        items = joined(plan.prompt_items, items_of(output)) if plan.prompt_items is not None else None
        conversation = [
            *plan.history,
            *(plan.appended if plan.parent is not None else turn.request.messages),
            reply,
        ]
        extends = plan.parent.id if plan.parent is not None else None
        recorded = Recorded(context, conversation, items, tools_key=turn.request.tools_key)
        self.contexts.put(call_id, recorded, extends=extends)

    def _new_call(
        self, turn: PreparedTurn, index: int, generation: Generation, status: str, timings: dict[str, float]
    ) -> tuple[NewCall, ParsedOutput]:
        plan, request = turn.plan, turn.request
        output = self.answers.parse(generation, reasoning_open=turn.reasoning_open, parser=turn.parser)
        reply = output.as_message()
        # Only a call answered "ok" gave its client a finish reason.
        finish = finish_for_openai(generation, output) if status == "ok" else None
        version, spans = _versions(turn, generation)
        call = NewCall(
            session_id=turn.session_id,
            segment_id=plan.parent.segment_id if plan.parent is not None else None,
            parent_id=plan.parent.id if plan.parent is not None else None,
            depth=plan.parent.depth + 1 if plan.parent is not None else 0,
            status=status,
            # A completion is never the history a chat request echoes.
            history_key=""
            if request.is_completion
            else request.history_hash.key(
                len(request.canonical_parts), canonical_json(reply), request.tools, request.template_kwargs
            ),
            prompt_len=len(plan.prompt),
            prompt_added=pack_ids(plan.added),
            output_ids=pack_ids(generation.output_ids),
            output_logprobs=pack_logprobs(generation.logprobs),
            finish_reason=generation.finish.kind,
            finish_detail=_finish_detail(turn, index, generation, finish),
            boundary_edits=plan.boundary_edits,
            request=_recorded_request(turn),
            response_message=reply,
            sampling_params=self._wire_sampling(turn.params),
            weight_version=version,
            engine_meta=_engine_meta(turn, generation, spans),
            timings=timings,
            idempotency_key=request.idempotency_key,
            request_hash=request.request_hash,
            adapter=turn.params.adapter,
            routed_experts=generation.routed_experts.pack()
            if generation.routed_experts is not None
            else None,
        )
        return call, output


def _finish_detail(
    turn: PreparedTurn, index: int, generation: Generation, finish: str | None
) -> dict[str, Any]:
    """How the call ended: the client's finish reason, its choice, and the engine's match."""
    return {
        "openai": finish,
        "choice": index,
        "request_id": turn.request_id,
        "matched_token": generation.finish.matched_token,
        "matched_text": generation.finish.matched_text,
        "message": generation.finish.message,
        # Why this call opened a new segment (the viewer shows it on the branch tree).
        **({"segment_reason": turn.plan.new_segment_reason} if turn.plan.parent is None else {}),
    }


def _recorded_request(turn: PreparedTurn) -> dict[str, Any]:
    """The request as recorded. A continuation stores only what it appended; its history is its
    parent's conversation."""
    plan, request = turn.plan, turn.request
    return {
        **({"messages_added": plan.appended} if plan.parent is not None else {"messages": request.messages}),
        # A continuation sent with its parent's tools finds them there (chain_tools).
        **({} if plan.tools_inherited else {"tools": request.tools}),
        "chat_template_kwargs": request.template_kwargs,
        "body": request.raw,
        **({"kind": "completion"} if request.is_completion else {}),
        "dialect": request.dialect,
    }


# A call's per-token weight versions: [{"version", "start", "end"}] over its output.
Spans = list[dict[str, object]]


def _versions(turn: PreparedTurn, generation: Generation) -> tuple[str | None, Spans | None]:
    """The call's weight version (its first token's, as at its dispatch) and its per-token spans,
    where the engine gave spans: what the engine left unnamed (vLLM's "default", or no version) is
    the trainer's at the dispatch, as the engine wrapper saw it (after a pause, newer than the one the
    turn read at its start)."""
    meta = generation.meta
    label = meta.get(DISPATCHED_VERSION, turn.dispatched_version)
    found = covering(meta.get("weight_versions"), len(generation.output_ids))
    if found is None:
        return generation.weight_version or label, None
    spans = labelled(found, label)
    return span_versions(spans)[0], spans


def _engine_meta(turn: PreparedTurn, generation: Generation, spans: Spans | None) -> dict[str, Any]:
    """The engine's metadata with its version spans named (`_versions`), plus the alternatives a
    logprobs request asked for (kept so that a retry is answered exactly as the first attempt was),
    and whether routed experts asked for are missing (the engine runs without
    --enable-return-routed-experts, or a restart lost them)."""
    meta = generation.meta
    if DISPATCHED_VERSION in meta or spans is not None:
        meta = {k: v for k, v in meta.items() if k != DISPATCHED_VERSION}
        if spans is not None:
            meta["weight_versions"] = spans
    if turn.params.routed_experts is not None and generation.routed_experts is None:
        _warn_experts_missing()
        meta = {**meta, "routed_experts_missing": True}
    if generation.top_logprobs is None:
        return meta
    return {**meta, "top_logprobs": [[[t, lp] for t, lp in top] for top in generation.top_logprobs]}


@functools.cache
def _warn_experts_missing() -> None:
    """Once per process: every later call without them is flagged in its engine_meta."""
    log.warning(
        "routed experts were asked for and the engine sent none: start SGLang with "
        "--enable-return-routed-experts (vLLM: --enable-return-routed-experts); such calls are "
        "recorded without them (engine_meta.routed_experts_missing)"
    )


def _sampling_recorder(engine: Engine) -> Callable[[SamplingParams], dict[str, Any]]:
    """How sampling parameters are recorded: as the engine gets them (vLLM's names for vLLM, SGLang's
    otherwise)."""
    wire = getattr(engine, "wire_sampling", None)
    if callable(wire):
        return cast("Callable[[SamplingParams], dict[str, Any]]", wire)
    return SamplingParams.as_sglang


def _timings(started: float, rendered: float, generated: float, done: float) -> dict[str, float]:
    return {
        "render_ms": round((rendered - started) * 1000, 3),
        "engine_ms": round((generated - rendered) * 1000, 3),
        "parse_ms": round((done - generated) * 1000, 3),
    }
