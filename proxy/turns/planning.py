"""Everything before the engine call: the parent a request extends, its prompt ids, its token budget.

The prompt of a turn that echoes a recorded history is the recorded context (prompt + sampled
output, verbatim) plus the fixed-base delta of the appended messages; anything else opens a new
segment with a fresh render.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

import numpy as np

from proxy.chat.messages import Message, reasoning_consistent
from proxy.chat.renderer import LARGE_TEXT_CHARS, Delta, DeltaUnavailable, PromptTooLong, Renderer
from proxy.engines.base import Engine, SamplingParams
from proxy.engines.prompt_json import items_of, joined
from proxy.errors import ContextLengthExceeded, InvalidRequest
from proxy.store.codec import IdArray, unpack_ids
from proxy.store.prompts import ContextCache, Recorded, extend, text_chars
from proxy.store.turn_store import ContinuedCall, TurnStore
from proxy.turns.budget import bounded_sampling
from proxy.turns.request import PromptPlan, TurnRequest

log = logging.getLogger("tito_proxy.turns")

_Rendered = TypeVar("_Rendered", list[int], Delta)


class TurnPlanner:
    """Plans the prompt ids of a request and bounds its sampling to what the context leaves."""

    def __init__(
        self,
        *,
        renderer: Renderer,
        engine: Engine,
        store: TurnStore,
        contexts: ContextCache,
        context_length: int | None,
        history_mode: str,
    ) -> None:
        self.renderer = renderer
        self.engine = engine
        self.store = store
        self.contexts = contexts
        self.context_length = context_length
        self.history_mode = history_mode
        # Renders of large requests: two at a time, so they cannot take every core from the loop.
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tito-render")

    async def plan(
        self,
        session_id: str,
        request: TurnRequest,
        template_now: datetime,
        candidates: Sequence[ContinuedCall] | None = None,
    ) -> tuple[PromptPlan, SamplingParams]:
        """The prompt ids of the request and its sampling parameters, bounded by the context.
        `candidates`: the calls recorded under the request's history key (history_key), when the
        caller read them already; else they are read here."""
        plan = await self.plan_prompt(session_id, request, template_now, candidates)
        params = bounded_sampling(request, len(plan.prompt), self.engine.limits, self.context_length)
        # One pass: a negative int32 id is past every vocabulary as a uint32.
        if len(plan.added) and int(plan.added.view(np.uint32).max()) >= self.renderer.vocab_size:
            # One id outside the vocabulary is enough to kill an SGLang server.
            raise InvalidRequest("the prompt holds a token id outside the vocabulary", param="prompt")
        if params.routed_experts is not None:
            params = replace(
                params, routed_experts=replace(params.routed_experts, start=_experts_start(plan))
            )
        return plan, params

    async def plan_prompt(
        self,
        session_id: str,
        request: TurnRequest,
        template_now: datetime,
        candidates: Sequence[ContinuedCall] | None = None,
    ) -> PromptPlan:
        """The prompt ids of the request alone: the continuation of the recorded call it extends,
        else a fresh render. Reads the record, writes nothing."""
        if request.prompt_ids is not None:
            return await self._plan_tokens(session_id, request.prompt_ids)
        parent, appended = await self._find_parent(session_id, request, candidates)
        return await self._plan_messages(request, parent, appended, template_now)

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
        return PromptPlan(
            prompt=ids, added=ids, parent=None, boundary_edits=[], new_segment_reason="token_prompt"
        )

    @staticmethod
    def history_key(request: TurnRequest) -> tuple[int, str] | None:
        """Where a message request's echoed history ends (after its last assistant message) and the
        key of that history; None when it echoes none or ends with an assistant message."""
        if request.prompt_ids is not None:
            return None
        messages = request.messages
        # From the end: the last assistant turn is near it, and a long history has ~130 messages.
        last_assistant = next(
            (i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None
        )
        if last_assistant is None or last_assistant == len(messages) - 1:
            return None
        echoed = last_assistant + 1
        return echoed, request.history_hash.key(echoed, None, request.tools, request.template_kwargs)

    async def _find_parent(
        self, session_id: str, request: TurnRequest, candidates: Sequence[ContinuedCall] | None
    ) -> tuple[ContinuedCall | None, list[Message]]:
        """The recorded call whose conversation the request extends, and the messages appended to it."""
        found = self.history_key(request)
        if found is None:
            return None, []
        end, key = found
        if candidates is None:
            candidates = await self.store.calls_with_history(session_id, key)
        messages = request.messages
        echoed = messages[:end]
        for candidate in candidates:
            recorded = (await self._recorded(candidate)).conversation
            if len(recorded) == len(echoed) and all(
                reasoning_consistent(e, r) for e, r in zip(echoed, recorded, strict=True)
            ):
                return candidate, messages[end:]
        return None, []

    async def _recorded(self, call: ContinuedCall) -> Recorded:
        found = self.contexts.get(call.id)
        if found is None:
            found = await self._rebuilt(call)
            self.contexts.put(call.id, found)
        return found

    async def _rebuilt(self, call: ContinuedCall) -> Recorded:
        """The context of a call this process has not cached (another worker or replica recorded
        it, or it was evicted): from its nearest cached ancestor, reading only the calls after it
        (with turns alternating between two replicas, one call), else from the segment's root."""
        parents = await self.store.segment_links(call.segment_id)
        missing: list[int] = []
        current: int | None = call.id
        base = None
        while current is not None:
            base = self.contexts.get(current)
            if base is not None:
                break
            missing.append(current)
            current = parents[current]
        by_id = {row.id: row for row in await self.store.calls(missing)}
        return extend(base, [by_id[call_id] for call_id in reversed(missing)])

    async def _plan_messages(
        self,
        request: TurnRequest,
        parent: ContinuedCall | None,
        appended: Sequence[Message],
        template_now: datetime,
    ) -> PromptPlan:
        """The continuation of `parent` when it exists (and, in template mode, equals a fresh render),
        else a fresh render opening a new segment."""
        continued: PromptPlan | None = None
        # Why a fresh render opens a new segment (the metrics and the viewer's branch tree show it).
        reason = (
            "history_not_matched"
            if any(m["role"] == "assistant" for m in request.messages)
            else ("new_conversation")
        )
        if parent is not None:
            try:
                continued = await self._continue(request, parent, appended, template_now)
            except DeltaUnavailable as exc:
                reason = "delta_unavailable"
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
        if continued is not None:
            reason = "template_render_differs"
        return PromptPlan(
            prompt=prompt,
            added=prompt,
            parent=None,
            boundary_edits=[],
            new_segment_reason=reason,
            prompt_items=items_of(prompt),
        )

    async def _continue(
        self,
        request: TurnRequest,
        parent: ContinuedCall,
        appended: Sequence[Message],
        template_now: datetime,
    ) -> PromptPlan:
        """The fixed-base continuation: the parent's recorded context, then the delta of `appended`."""
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
                tools_key=request.tools_key,
            ),
        )
        recorded = await self._recorded(parent)
        context = recorded.ids
        close = self.renderer.token_id(delta.close)
        last = int(context[-1])
        if close is None:
            raise DeltaUnavailable(f"close token {delta.close!r} is not in the vocabulary")
        if (
            last != close
            and last not in self.renderer.close_token_ids
            and _says_nothing(parent.response_message)
        ):
            return await self._continue_empty(request, parent, appended, template_now, recorded)
        edits, added = self._boundary(len(context), last, close)
        added_ids = np.asarray([*added, *delta.ids], dtype=np.int32)
        return _continuing(request, parent, recorded, added_ids, edits=edits, appended=appended)

    def _boundary(self, context_len: int, last: int, close: int) -> tuple[list[dict[str, Any]], list[int]]:
        """The edits where the recorded context meets the delta, and the ids added before the delta."""
        if last == close:
            return [], []
        if last in self.renderer.close_token_ids:
            if self.renderer.verdict.opener_close:
                # GLM: the sampled stop token opens the next message; it must be the one that follows.
                raise DeltaUnavailable("the turn ended with another opener than the appended message's")
            # A sampled close the template writes differently in history (<|return|> for <|end|>):
            # kept as sampled (decision 4), its position named.
            edit = {
                "kind": "stop_token_rewrite",
                "position": context_len - 1,
                "sampled": last,
                "rendered": close,
            }
            return [edit], []
        # The turn ended without its close (length, stop string, another stop token): the template
        # expects one, so it is synthesized with mask 0 (decision 3).
        return [{"kind": "truncation_close_synthesized", "position": context_len, "token": close}], [close]

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
        return _continuing(request, parent, recorded, added_ids, edits=[], appended=appended)

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


def _continuing(
    request: TurnRequest,
    parent: ContinuedCall,
    recorded: Recorded,
    added_ids: IdArray,
    *,
    edits: list[dict[str, Any]],
    appended: Sequence[Message],
) -> PromptPlan:
    """The plan that continues `parent`: its recorded context, then `added_ids`; the prompt's JSON
    items are the context's (written by the turn that recorded it, or now) and the added ids'."""
    context_items = recorded.items if recorded.items is not None else items_of(recorded.ids)
    return PromptPlan(
        prompt=np.concatenate([recorded.ids, added_ids]),
        added=added_ids,
        parent=parent,
        boundary_edits=edits,
        history=recorded.conversation,
        appended=list(appended),
        prompt_items=joined(context_items, items_of(added_ids)),
        # Its parent's tools, written the very same? The history keys of both match already, but
        # those sort keys: the record keeps the order the client sent.
        tools_inherited=request.tools_key is not None and request.tools_key == recorded.tools_key,
    )


def _experts_start(plan: PromptPlan) -> int:
    """Where a call's routed experts begin: at its parent's last sampled token (which the parent's own
    request never fed back), so the calls of a path cover every position once; 0 for a new segment."""
    if plan.parent is None:
        return 0
    return max(0, len(plan.prompt) - len(plan.added) - 1)


def _says_nothing(reply: Message) -> bool:
    """An assistant reply without text, reasoning or calls: its turn was cut before it said anything."""
    return not reply.get("content") and not reply.get("reasoning_content") and not reply.get("tool_calls")
