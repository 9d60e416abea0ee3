"""One chat turn: plan the prompt ids, call the engine, record the call, derive the answer.

The prompt of a turn that echoes a recorded history is the recorded context (prompt + sampled
output, verbatim) plus the fixed-base delta of the appended messages; anything else opens a new
segment with a fresh render. The call is committed before the caller sees the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, NoReturn, TypeVar

import anyio
import numpy as np

from proxy.chat.call_format import choose_parser
from proxy.chat.messages import Message, canonical, key_of_canonical, reasoning_consistent
from proxy.chat.parsing import OutputParser, ParsedOutput
from proxy.chat.renderer import LARGE_TEXT_CHARS, Delta, DeltaUnavailable, PromptTooLong, Renderer
from proxy.engines.base import Engine, FinishReason, Generation, SamplingParams
from proxy.errors import (
    ClientClosedRequest,
    ContextLengthExceeded,
    EngineError,
    InvalidRequest,
    ProxyError,
    SessionFinished,
)
from proxy.store.codec import IdArray, pack_ids, pack_logprobs, unpack_ids
from proxy.store.prompts import ContextCache, Recorded, rebuild, text_chars
from proxy.store.turn_store import ContinuedCall, NewCall, TurnStore, TurnWrite

log = logging.getLogger("tito_proxy.turns")

# How long an aborted engine request may take to answer with what it sampled before it is dropped.
ABORT_ANSWER_S = 10.0

_Rendered = TypeVar("_Rendered", list[int], Delta)


@dataclass(frozen=True)
class TurnRequest:
    """A chat request reduced to what decides the tokens."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any] | None
    sampling: SamplingParams
    max_tokens_requested: int | None
    raw: dict[str, Any] = field(default_factory=dict)
    choices: int = 1  # OpenAI's n: each choice is sampled and recorded as its own branch
    parse_tools: bool = True  # False for tool_choice "none"
    idempotency_key: str | None = None
    request_hash: str | None = None
    # A /v1/completions prompt as ids: sent as given, continuing a recorded call it extends.
    prompt_ids: list[int] | None = None
    # The wire format the request came in (proxy/dialects/), recorded with the call; nothing else reads it.
    dialect: str = "chat"

    @property
    def is_completion(self) -> bool:
        return self.prompt_ids is not None

    @functools.cached_property
    def canonical_messages(self) -> list[list[Any]]:
        """The messages in matching form, once: both the parent lookup and the new call key on them."""
        return [canonical(m) for m in self.messages]


@dataclass(frozen=True)
class PromptPlan:
    prompt: IdArray
    added: IdArray
    parent: ContinuedCall | None
    boundary_edits: list[dict[str, Any]]
    history: list[Message] = field(default_factory=list)  # the parent's recorded conversation
    appended: list[Message] = field(default_factory=list)


@dataclass(frozen=True)
class PreparedTurn:
    """A turn ready for the engine."""

    session_id: str
    request: TurnRequest
    plan: PromptPlan
    params: SamplingParams
    template_now: datetime
    dispatched_version: str | None
    started: float
    rendered: float
    reasoning_open: bool
    parser: OutputParser
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # shared by the request's choices


@dataclass(frozen=True)
class TurnResult:
    call_id: int
    session_id: str
    output: ParsedOutput
    finish_reason: str | None  # None: aborted, answered with an error
    prompt_tokens: int
    completion_tokens: int
    generation: Generation
    choice_index: int = 0
    # The request's id (shared by its choices): answers are named by it, plain, streamed or replayed.
    request_id: str = ""


def _finish_for_openai(generation: Generation, output: ParsedOutput) -> str | None:
    """The finish_reason the client is answered with; None for an aborted generation, whose client
    got an error and no finish reason."""
    if generation.finish.kind == "abort":
        return None
    if generation.finish.kind == "length":
        return "length"
    return "tool_calls" if output.tool_calls else "stop"


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
    ) -> None:
        self.renderer = renderer
        self.engine = engine
        self.store = store
        self.context_length = context_length
        self.history_mode = history_mode
        # Set by the trainer (POST /admin/weight_version); used when the engine reports no version.
        self.trainer_weight_version: str | None = None
        self.parser = parser or choose_parser(renderer)[0]
        self.contexts = contexts or ContextCache()
        self._clock = clock
        # Renders of large requests: two at a time, so they cannot take every core from the loop.
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tito-render")
        # Sessions with a turn under way in this process: the idle sweep leaves them open.
        self.in_flight: Counter[str] = Counter()

    @contextlib.contextmanager
    def busy(self, session_id: str) -> Iterator[None]:
        """Marks the session as having a turn under way until the turn is answered."""
        self.in_flight[session_id] += 1
        try:
            yield
        finally:
            self.in_flight[session_id] -= 1
            if not self.in_flight[session_id]:
                del self.in_flight[session_id]

    async def prepare(self, session_id: str, request: TurnRequest) -> PreparedTurn:
        """Everything before the engine call: the session, the prompt ids, bounded sampling."""
        started = self._clock()
        session = await self.store.session_state(session_id)
        if session is not None and session.status == "finished":
            raise SessionFinished(f"session {session_id!r} is finished; start a new one", param="session_id")
        # A new session pins the date it is first rendered with; it is created with its first call.
        template_now = session.template_now if session is not None else datetime.now()
        if request.prompt_ids is not None:
            plan = await self._plan_tokens(session_id, request.prompt_ids)
        else:
            parent, appended = await self._find_parent(session_id, request)
            plan = await self._plan(request, parent, appended, template_now)
        params = self._bounded_sampling(request, len(plan.prompt))
        if len(plan.added) and (
            int(plan.added.max()) >= self.renderer.vocab_size or int(plan.added.min()) < 0
        ):
            # One id outside the vocabulary is enough to kill an SGLang server.
            raise InvalidRequest("the prompt holds a token id outside the vocabulary", param="prompt")
        return PreparedTurn(
            session_id=session_id,
            request=request,
            plan=plan,
            params=params,
            template_now=template_now,
            # The trainer-set version current when the call goes out.
            dispatched_version=self.trainer_weight_version,
            started=started,
            rendered=self._clock(),
            reasoning_open=self._reasoning_open(plan.prompt),
            parser=self.parser_for(request),
        )

    def parser_for(self, request: TurnRequest) -> OutputParser:
        if request.is_completion:
            return replace(self.parser, parse_reasoning=False, tool_calls=False)  # raw text
        return self.parser if request.parse_tools else replace(self.parser, tool_calls=False)

    async def _plan_tokens(self, session_id: str, prompt_ids: list[int]) -> PromptPlan:
        """A token prompt continues the newest recorded call whose prompt + output it starts with."""
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        vocab = self.renderer.vocab_size
        if any(not 0 <= token < vocab for token in prompt_ids):
            raise InvalidRequest("the prompt holds a token id outside the vocabulary", param="prompt")
        ids = np.asarray(prompt_ids, dtype=np.int32)
        for candidate in await self.store.latest_answered(session_id, limit=8):
            recorded = await self._recorded(candidate)
            size = len(recorded.ids)
            if size <= len(ids) and np.array_equal(recorded.ids, ids[:size]):
                return PromptPlan(
                    prompt=ids,
                    added=ids[size:],
                    parent=candidate,
                    boundary_edits=[],
                    history=recorded.conversation,
                )
        return PromptPlan(prompt=ids, added=ids, parent=None, boundary_edits=[])

    async def run(
        self, session_id: str, request: TurnRequest, *, client_gone: asyncio.Event | None = None
    ) -> list[TurnResult]:
        """Sample every choice, then commit them together: all are recorded, or none. When
        `client_gone` is set before the commit, the engine requests are aborted and what they
        sampled is recorded as aborted (never exported), then ClientClosedRequest is raised."""
        gone = client_gone or asyncio.Event()
        turn = await self.prepare(session_id, request)
        if gone.is_set():
            raise ClientClosedRequest("the client left before its turn was sampled")
        request_ids = [uuid.uuid4().hex for _ in range(request.choices)]  # fixed length: see sglang.py
        sampling: asyncio.Future[list[Generation]] = asyncio.ensure_future(
            asyncio.gather(*(self.engine.generate(turn.plan.prompt, turn.params, rid) for rid in request_ids))
        )
        watching: asyncio.Future[Any] = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({sampling, watching}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            sampling.cancel()
            raise
        finally:
            watching.cancel()
        if gone.is_set():
            await self._abandon(turn, sampling, request_ids)
        generations = await sampling
        results = await self.record_choices(turn, list(enumerate(generations)))
        for generation in generations:
            if generation.finish.kind == "abort":
                raise EngineError(
                    f"the engine aborted the request: {generation.finish.message}", code="engine_aborted"
                )
        return results

    async def _abandon(
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
        generated = self._clock()
        built = [
            self._new_call(turn, index, generation, status or _status(generation))
            for index, generation in generations
        ]
        done = self._clock()
        call_ids = await self.store.record(
            TurnWrite(
                session_id=turn.session_id,
                template_now=turn.template_now,
                calls=[
                    _with_timings(call, turn.started, turn.rendered, generated, done) for call, _ in built
                ],
            )
        )
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

    def _remember(self, turn: PreparedTurn, call_id: int, generation: Generation, reply: Message) -> None:
        plan = turn.plan
        context = np.concatenate([plan.prompt, np.asarray(generation.output_ids, dtype=np.int32)])
        conversation = [
            *plan.history,
            *(plan.appended if plan.parent is not None else turn.request.messages),
            reply,
        ]
        extends = plan.parent.id if plan.parent is not None else None
        self.contexts.put(call_id, Recorded(context, conversation), extends=extends)

    def _new_call(
        self, turn: PreparedTurn, index: int, generation: Generation, status: str
    ) -> tuple[NewCall, ParsedOutput]:
        plan, request = turn.plan, turn.request
        output = self.parse(generation, reasoning_open=turn.reasoning_open, parser=turn.parser)
        reply = output.as_message()
        # Only a call answered "ok" gave its client a finish reason.
        finish = _finish_for_openai(generation, output) if status == "ok" else None
        call = NewCall(
            session_id=turn.session_id,
            segment_id=plan.parent.segment_id if plan.parent is not None else None,
            parent_id=plan.parent.id if plan.parent is not None else None,
            depth=plan.parent.depth + 1 if plan.parent is not None else 0,
            status=status,
            # A completion is never the history a chat request echoes.
            history_key=""
            if request.is_completion
            else key_of_canonical(
                [*request.canonical_messages, canonical(reply)], request.tools, request.template_kwargs
            ),
            prompt_len=len(plan.prompt),
            prompt_added=pack_ids(plan.added),
            output_ids=pack_ids(generation.output_ids),
            output_logprobs=pack_logprobs(generation.logprobs),
            finish_reason=generation.finish.kind,
            finish_detail={
                "openai": finish,
                "choice": index,
                "request_id": turn.request_id,
                "matched_token": generation.finish.matched_token,
                "matched_text": generation.finish.matched_text,
                "message": generation.finish.message,
            },
            boundary_edits=plan.boundary_edits,
            # A continuation stores only what it appended; its history is its parent's conversation.
            request={
                **(
                    {"messages_added": plan.appended}
                    if plan.parent is not None
                    else {"messages": request.messages}
                ),
                "tools": request.tools,
                "chat_template_kwargs": request.template_kwargs,
                "body": request.raw,
                **({"kind": "completion"} if request.is_completion else {}),
                "dialect": request.dialect,
            },
            response_message=reply,
            sampling_params=_recorded_sampling(self.engine, turn.params),
            weight_version=generation.weight_version or turn.dispatched_version,
            engine_meta=_engine_meta(generation),
            timings={},
            idempotency_key=request.idempotency_key,
            request_hash=request.request_hash,
        )
        return call, output

    def _reasoning_open(self, prompt: IdArray) -> bool:
        """Whether the generation prompt itself opened reasoning (DeepSeek R1's `<think>\\n`)."""
        if not self.parser.parse_reasoning:
            return False
        tail = self.renderer.decode(prompt[-4:].tolist())
        return tail.rstrip("\n").endswith("<think>")

    async def _find_parent(
        self, session_id: str, request: TurnRequest
    ) -> tuple[ContinuedCall | None, list[Message]]:
        """The recorded call whose conversation the request extends, and the messages appended to it."""
        messages = request.messages
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last_assistant is None or last_assistant == len(messages) - 1:
            return None, []
        echoed = messages[: last_assistant + 1]
        key = key_of_canonical(
            request.canonical_messages[: last_assistant + 1], request.tools, request.template_kwargs
        )
        for candidate in await self.store.calls_with_history(session_id, key):
            recorded = (await self._recorded(candidate)).conversation
            if len(recorded) == len(echoed) and all(
                reasoning_consistent(e, r) for e, r in zip(echoed, recorded, strict=True)
            ):
                return candidate, messages[last_assistant + 1 :]
        return None, []

    async def _recorded(self, call: ContinuedCall) -> Recorded:
        found = self.contexts.get(call.id)
        if found is None:
            found = rebuild(await self.store.segment_rows(call.segment_id), call.id)
            self.contexts.put(call.id, found)
        return found

    async def _plan(
        self,
        request: TurnRequest,
        parent: ContinuedCall | None,
        appended: Sequence[Message],
        template_now: datetime,
    ) -> PromptPlan:
        continued: PromptPlan | None = None
        if parent is not None:
            try:
                continued = await self._continue(request, parent, appended, template_now)
            except DeltaUnavailable as exc:
                log.info("session %s: new segment: %s", parent.session_id, exc)
        if continued is not None and self.history_mode == "exact":
            return continued
        rendered = await self._off_loop_if_large(
            text_chars(request.messages),
            functools.partial(
                self.renderer.render_prompt,
                request.messages,
                tools=request.tools,
                template_kwargs=request.template_kwargs,
                now=template_now,
                max_tokens=self.context_length,
            ),
        )
        prompt = np.asarray(rendered, dtype=np.int32)
        if continued is not None and np.array_equal(continued.prompt, prompt):
            return continued  # template mode: the stream is exactly what a fresh render gives
        return PromptPlan(prompt=prompt, added=prompt, parent=None, boundary_edits=[])

    async def _continue(
        self,
        request: TurnRequest,
        parent: ContinuedCall,
        appended: Sequence[Message],
        template_now: datetime,
    ) -> PromptPlan:
        verdict = self.renderer.verdict
        refused = sorted({m["role"] for m in appended if not verdict.continues(m["role"])})
        if refused:
            raise DeltaUnavailable(f"the template self-test did not prove {', '.join(refused)} appends safe")
        delta = await self._off_loop_if_large(
            text_chars(appended),
            functools.partial(
                self.renderer.render_delta,
                parent.response_message,
                appended,
                tools=request.tools,
                template_kwargs=request.template_kwargs,
                now=template_now,
                max_tokens=self.context_length,
            ),
        )
        recorded = await self._recorded(parent)
        context = recorded.ids
        edits: list[dict[str, Any]] = []
        added: list[int] = []
        close = self.renderer.token_id(delta.close)
        last = int(context[-1])
        if close is None:
            raise DeltaUnavailable(f"close token {delta.close!r} is not in the vocabulary")
        if last == close:
            pass
        elif last in self.renderer.close_token_ids:
            if verdict.opener_close:
                # GLM: the sampled stop token opens the next message; it must be the one that follows.
                raise DeltaUnavailable("the turn ended with another opener than the appended message's")
            # A sampled close the template writes differently in history (<|return|> for <|end|>):
            # kept as sampled (decision 4), its position named.
            edits.append(
                {
                    "kind": "stop_token_rewrite",
                    "position": len(context) - 1,
                    "sampled": last,
                    "rendered": close,
                }
            )
        elif _says_nothing(parent.response_message):
            return await self._continue_empty(request, parent, appended, template_now, recorded)
        else:
            # The turn ended without its close (length, stop string, another stop token): the template
            # expects one, so it is synthesized with mask 0 (decision 3).
            edits.append({"kind": "truncation_close_synthesized", "position": len(context), "token": close})
            added.append(close)
        added.extend(delta.ids)
        added_ids = np.asarray(added, dtype=np.int32)
        return PromptPlan(
            prompt=np.concatenate([context, added_ids]),
            added=added_ids,
            parent=parent,
            boundary_edits=edits,
            history=recorded.conversation,
            appended=list(appended),
        )

    async def _continue_empty(
        self,
        request: TurnRequest,
        parent: ContinuedCall,
        appended: Sequence[Message],
        template_now: datetime,
        recorded: Recorded,
    ) -> PromptPlan:
        """After a turn that said nothing (no token, or a partial opener), continue only with what a
        render of the empty reply writes after the generation prompt, starting with what was sampled;
        a close synthesized there would be a structure no render produces."""
        tail = self.renderer.render_after_empty_turn(
            parent.response_message,
            appended,
            tools=request.tools,
            template_kwargs=request.template_kwargs,
            now=template_now,
        )
        rows = await self.store.segment_rows(parent.segment_id)
        sampled = next(unpack_ids(row.output_ids).tolist() for row in rows if row.id == parent.id)
        if tail[: len(sampled)] != sampled:
            raise DeltaUnavailable("a render of the empty reply does not start with what was sampled")
        added_ids = np.asarray(tail[len(sampled) :], dtype=np.int32)
        return PromptPlan(
            prompt=np.concatenate([recorded.ids, added_ids]),
            added=added_ids,
            parent=parent,
            boundary_edits=[],
            history=recorded.conversation,
            appended=list(appended),
        )

    async def _off_loop_if_large(self, chars: int, render: Callable[[], _Rendered]) -> _Rendered:
        """`render()`, on a worker thread when its messages are large: Jinja then shares the GIL in
        5 ms slices and the encode releases it, so other sessions' turns go on. A typical turn's
        render is cheaper than the hop, and stays here."""
        try:
            if chars < LARGE_TEXT_CHARS:
                return render()
            return await asyncio.get_running_loop().run_in_executor(self._workers, render)
        except PromptTooLong as exc:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_length} tokens, but the prompt has "
                f"more ({exc.tokens} tokens rendered).",
                param="messages",
            ) from exc

    async def encode_prompt_text(self, text: str) -> list[int]:
        """A /v1/completions text prompt as SGLang tokenizes it (the tokenizer's BOS included)."""
        render = functools.partial(self.renderer.encode, text, at_most=self.context_length, special=True)
        return await self._off_loop_if_large(len(text), render)

    def close(self) -> None:
        """Stop the render workers; a render still running ends on its own (it cannot be interrupted)."""
        self._workers.shutdown(wait=False, cancel_futures=True)

    def _bounded_sampling(self, request: TurnRequest, prompt_len: int) -> SamplingParams:
        """The sampling parameters with max_new_tokens set, within the engine's own limits: a turn the
        proxy accepts is one the engine accepts, and it samples at most max_tokens, never fewer
        because the engine quietly capped them."""
        params = request.sampling
        limits = self.engine.limits
        default = limits.default_max_new_tokens
        requested = request.max_tokens_requested
        if self.context_length is None:
            return params if requested is not None or default is None else _replace_max(params, default)
        longest = limits.longest_prompt(self.context_length)
        if prompt_len > longest:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_length} tokens, and the engine "
                f"takes prompts of at most {longest} tokens; the prompt has {prompt_len} tokens.",
                param="messages",
            )
        room = limits.room(self.context_length, prompt_len)
        if requested is not None and requested > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_length} tokens. The prompt has "
                f"{prompt_len} tokens and {requested} completion tokens were requested; at most {room} fit.",
                param="max_tokens",
            )
        if requested is not None:
            return params
        return _replace_max(params, room if default is None else min(room, default))

    def output_text(self, output_ids: Sequence[int], finish: FinishReason | None) -> str:
        """The text of sampled ids as parsers see it: special tokens kept, the stop token and a matched
        stop string removed (they end the turn; they are not text)."""
        ids = list(output_ids)
        if (
            finish is not None
            and finish.matched_token is not None
            and ids
            and ids[-1] == finish.matched_token
        ):
            ids = ids[:-1]
        text = self.renderer.decode(ids)
        matched = finish.matched_text if finish is not None else None
        if matched and matched in text:
            text = text[: self._stop_string_at(ids, text, matched)]
        return text

    def _stop_string_at(self, ids: list[int], text: str, matched: str) -> int:
        """Where the engine's match of `matched` starts. The engine checks the decoded tail after each
        token, so its match is the first occurrence that ends inside the last token: the last token
        may hold the string twice, and the match may start in an earlier token."""
        before = self.renderer.decode(ids[:-1])
        # Characters of `text` decoded before the last token (a split UTF-8 character may differ).
        pairs = zip(before, text, strict=False)
        boundary = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(before), len(text)))
        found = text.find(matched, max(0, boundary - len(matched) + 1))
        return found if found >= 0 else text.find(matched)

    def parse(
        self, generation: Generation, *, reasoning_open: bool = False, parser: OutputParser | None = None
    ) -> ParsedOutput:
        return (parser or self.parser).parse(
            self.output_text(generation.output_ids, generation.finish), reasoning_open=reasoning_open
        )


def _says_nothing(reply: Message) -> bool:
    """An assistant reply without text, reasoning or calls: its turn was cut before it said anything."""
    return not reply.get("content") and not reply.get("reasoning_content") and not reply.get("tool_calls")


def _status(generation: Generation) -> str:
    return "aborted" if generation.finish.kind == "abort" else "ok"


def _engine_meta(generation: Generation) -> dict[str, Any]:
    """The engine's metadata, plus the alternatives a logprobs request asked for (kept so that a
    retry is answered exactly as the first attempt was)."""
    if generation.top_logprobs is None:
        return generation.meta
    return {
        **generation.meta,
        "top_logprobs": [[[t, lp] for t, lp in top] for top in generation.top_logprobs],
    }


def _recorded_sampling(engine: Engine, params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters as the engine got them (vLLM's names for vLLM, SGLang's otherwise)."""
    wire = getattr(engine, "wire_sampling", None)
    recorded: dict[str, Any] = wire(params) if callable(wire) else params.as_sglang()
    return recorded


def _replace_max(params: SamplingParams, max_new_tokens: int) -> SamplingParams:
    return replace(params, max_new_tokens=max_new_tokens)


def _with_timings(call: NewCall, started: float, rendered: float, generated: float, done: float) -> NewCall:
    return replace(
        call,
        timings={
            "render_ms": round((rendered - started) * 1000, 3),
            "engine_ms": round((generated - rendered) * 1000, 3),
            "parse_ms": round((done - generated) * 1000, 3),
        },
    )
