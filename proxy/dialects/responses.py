"""The OpenAI Responses dialect: POST /v1/responses (also under /sessions/{id}) -> a turn request, and
the turn's result -> a Response object, plain or as Responses server-sent events.

A response id names its session, so `previous_response_id` continues a recorded response in its own
session without the client resending history (the proxy holds the record, whatever `store` says).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.answering import retried_session
from proxy.api.deps import SessionIdDep, StateDep, check_session_id
from proxy.api.harness_route import FieldNamedRoute
from proxy.api.retries import RetryIdentity
from proxy.api.schemas import Shallow, refuse_unsupported
from proxy.app_state import AppState
from proxy.chat.messages import Message
from proxy.dialects.converted_history import (
    Converted,
    ConvertedHistories,
    Forms,
    converted,
    forms_of,
    item_texts,
)
from proxy.dialects.openai_checks import REASONING_EFFORTS, check_inert_fields, check_name
from proxy.dialects.responses_input import (
    chat_tool_choice,
    chat_tools,
    check_call_pairs,
    input_conversion,
    input_messages,
)
from proxy.dialects.responses_output import RESPONSES_FIELD_NAMES, ResponseShape
from proxy.dialects.responses_stream import response_events
from proxy.dialects.seals import Sealer
from proxy.dialects.shared import for_model, turn_request
from proxy.dialects.turn_events import answer_turn
from proxy.errors import InvalidRequest, NotFound, UnsupportedParameter
from proxy.store.prompts import rebuild
from proxy.store.repository import Repository


class ResponsesRoute(FieldNamedRoute):
    field_names = RESPONSES_FIELD_NAMES


router = APIRouter(prefix="/v1", tags=["responses"], route_class=ResponsesRoute)

# Fields that change nothing about the sample: accepted and recorded.
_INERT = frozenset(
    {
        "metadata",
        "user",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "client_metadata",
        "stream_options",
    }
)
# `include` values we can fill: what to put in the answer, never what is sampled.
_INCLUDES = frozenset({"reasoning.encrypted_content"})


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    # Free-form values are checked for depth where they enter (proxy/json_limits.py), extras too.
    __pydantic_extra__: dict[str, Annotated[Any, Shallow]] = Field(init=False)

    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]] | None, Shallow] = None
    tool_choice: Annotated[str | dict[str, Any] | None, Shallow] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: Annotated[dict[str, Any] | None, Shallow] = None
    reasoning: Annotated[dict[str, Any] | None, Shallow] = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    truncation: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        refuse_unsupported(self.model_extra, _INERT)
        check_inert_fields(self.model_extra)
        check_reasoning(self.reasoning)
        if self.parallel_tool_calls is False:
            raise UnsupportedParameter(
                "parallel_tool_calls=false cannot be enforced", param="parallel_tool_calls"
            )
        for value in self.include or []:
            if value not in _INCLUDES:
                raise UnsupportedParameter(f"include value {value!r} is not supported", param="include")
        if self.truncation == "auto":
            raise UnsupportedParameter(
                "truncation 'auto' would drop history the record holds; only 'disabled'", param="truncation"
            )
        if self.truncation not in (None, "disabled"):
            raise InvalidRequest("truncation must be 'auto' or 'disabled'", param="truncation")
        if self.background:
            raise UnsupportedParameter("background responses are not supported", param="background")
        if self.top_logprobs:
            raise UnsupportedParameter("top_logprobs is not supported on /v1/responses", param="top_logprobs")
        if set((self.text or {}).keys()) - {"format", "verbosity"}:
            raise UnsupportedParameter("text supports format only", param="text")
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise UnsupportedParameter("text.verbosity has no engine counterpart", param="text.verbosity")

    def response_format(self) -> dict[str, Any] | None:
        """text.format in chat's response_format shape."""
        found = (self.text or {}).get("format")
        if found is not None and not isinstance(found, dict):
            raise InvalidRequest("text.format must be an object with a type", param="text.format")
        if found is None or found.get("type") == "text":
            return None
        if found.get("type") == "json_object":
            return {"type": "json_object"}
        if found.get("type") == "json_schema":
            check_name(found.get("name"), "text.format.name", "a JSON schema")
            schema = {k: v for k, v in found.items() if k in ("name", "schema", "strict", "description")}
            return {"type": "json_schema", "json_schema": schema}
        raise UnsupportedParameter(f"text.format {found.get('type')!r} is not supported", param="text.format")

    def template_kwargs(self) -> dict[str, Any] | None:
        # Templates that read a reasoning effort (gpt-oss) render it; others render the same tokens.
        effort = (self.reasoning or {}).get("effort")
        return {"reasoning_effort": effort} if effort else None


REASONING_SUMMARIES = ("auto", "concise", "detailed")


def check_reasoning(reasoning: dict[str, Any] | None) -> None:
    """`reasoning`: an effort and a summary among OpenAI's values (the summary asked for is the
    reasoning itself: the sampled text is returned whole)."""
    given = reasoning or {}
    unknown = set(given) - {"effort", "summary", "generate_summary"}
    if unknown:
        raise UnsupportedParameter(f"reasoning.{sorted(unknown)[0]} is not supported", param="reasoning")
    if given.get("effort") is not None and given["effort"] not in REASONING_EFFORTS:
        raise InvalidRequest(
            f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning.effort"
        )
    for key in ("summary", "generate_summary"):
        if given.get(key) is not None and given[key] not in REASONING_SUMMARIES:
            raise InvalidRequest(
                f"reasoning.{key} must be one of {', '.join(REASONING_SUMMARIES)}", param=f"reasoning.{key}"
            )


def response_id_of(request_id: str, session_id: str) -> str:
    """A response is named by its turn's request id (32 hex digits, the same in a retry answered
    from the record) and its session."""
    return f"resp_{request_id}_{session_id}"


def session_of(response_id: str) -> str:
    if not response_id.startswith("resp_") or len(response_id) < 39 or response_id[37] != "_":
        raise NotFound(f"no response {response_id!r}", param="previous_response_id")
    return check_session_id(response_id[38:])


async def _stored_conversation(state: AppState, session_id: str, response_id: str) -> list[Message]:
    """The conversation a recorded response ended, without the instructions its request gave: as in
    OpenAI's API, a previous response's instructions are not carried over."""
    async with state.db_sessions() as db:
        rows = await Repository(db).session_calls(session_id)
    request_id = response_id[5:37]
    for row in rows:
        body = row.request.get("body") or {}
        # Calls recorded before responses were named by their request id hold the name they got.
        named = row.finish_detail.get("request_id") == request_id or body.get("response_id") == response_id
        if row.status == "ok" and named:
            recorded = rebuild(await state.turns.store.segment_rows(row.segment_id), row.id)
            conversation = list(recorded.conversation)
            given = {"role": "system", "content": body.get("instructions")}
            if given["content"] and conversation and conversation[0] == given:
                return conversation[1:]
            return conversation
    raise NotFound(f"no response {response_id!r} in session {session_id!r}", param="previous_response_id")


async def _messages(
    state: AppState, session: tuple[str, bool], session_id: str, body: ResponsesRequest
) -> list[Message] | Forms:
    if body.previous_response_id is None:
        return input_forms(state.converted_histories, state.sealer, session, body)
    added = input_messages(None, body.input, state.sealer)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    stored = await _stored_conversation(state, session_id, body.previous_response_id)
    return [*system, *stored, *added]


def input_forms(
    histories: ConvertedHistories, sealer: Sealer, session: tuple[str, bool], body: ResponsesRequest
) -> Forms:
    """The whole input's messages (instructions first) and their forms; the messages of the items the
    session's previous request sent first, the very same, under the same instructions, are not made
    again, up to the last of those items after which no assistant turn was open
    (proxy/dialects/converted_history.py)."""
    items = body.input
    if session[1] or isinstance(items, str):  # a new session's id is never sent again
        messages, _ = input_conversion(body.instructions, items, sealer)
        return forms_of(messages, [None] * len(messages), None)
    context = b"responses " + orjson.dumps(body.instructions)  # another dialect's entry never matches
    known = histories.find(session[0], context)
    texts = item_texts(items)
    resumed = _resumed(known, texts)
    items_done, done = resumed if resumed is not None else (0, [])
    messages, starts = input_conversion(body.instructions, items, sealer, resumed)
    canonical = [*(known.canonical[: len(done)] if known else []), *([None] * (len(messages) - len(done)))]
    forms = forms_of(messages, canonical, known)
    every = [*(known.starts[:items_done] if known else []), *starts]
    histories.keep(session[0], converted(forms, context, known, texts, taken=items_done, starts=every))
    return forms


def _resumed(known: Converted | None, texts: list[bytes | None]) -> tuple[int, list[Message]] | None:
    """The items the known request sent first, the very same, up to the last one after which no
    assistant turn was open, and their messages; None for none."""
    if known is None:
        return None
    same, end, known_texts = 0, min(len(texts), len(known.texts)), known.texts
    while same < end and texts[same] is not None and texts[same] == known_texts[same]:
        same += 1
    while same > 0 and known.starts[same] is None:
        same -= 1
    made = known.starts[same]
    return (same, known.messages[:made]) if same > 0 and made is not None else None


def _session(session: tuple[str, bool], body: ResponsesRequest) -> str:
    session_id, created = session
    if body.previous_response_id is None:
        return session_id
    owner = session_of(body.previous_response_id)
    if created:
        return owner  # no session named: the previous response's own
    if owner != session_id:
        raise InvalidRequest(
            "previous_response_id belongs to another session than this request's",
            param="previous_response_id",
        )
    return session_id


@router.post("/responses", response_model=None)
async def create_response(
    body: ResponsesRequest, state: StateDep, session: SessionIdDep, http_request: Request
) -> Response:
    body.check_supported()
    identity = RetryIdentity.from_request(http_request.headers, await http_request.body())
    # A previous response names the session; else an SDK retry's is its original's.
    if body.previous_response_id is not None:
        session_id = _session(session, body)
    else:
        session_id = await retried_session(state, session, identity)
    sealer = state.sealer
    messages = await _messages(state, session, session_id, body)
    conversation = messages.messages if isinstance(messages, Forms) else messages
    if not conversation:
        raise InvalidRequest("input is empty", param="input")
    check_call_pairs(conversation)
    request = turn_request(
        state,
        dialect="responses",
        messages=messages,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        template_kwargs=body.template_kwargs(),
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        response_format=body.response_format(),
        raw=body.model_dump(exclude={"input"}, exclude_none=True),
        identity=identity,
    )
    request = await for_model(state, request, body.model)
    echoed = body.model_dump(exclude={"input"}, exclude_none=True)
    created_at = int(time.time())

    def shape(request_id: str) -> ResponseShape:
        return ResponseShape(
            response_id=response_id_of(request_id, session_id),
            body=echoed,
            model=body.model,
            created_at=created_at,
            sealer=sealer if "reasoning.encrypted_content" in (body.include or []) else None,
            reasoning_tokens=state.reasoning_tokens,
        )

    return await answer_turn(
        state,
        session_id,
        request,
        identity,
        stream=bool(body.stream),
        client=http_request,
        events=lambda answer, held: response_events(shape(answer.request_id), answer, held),
        body=lambda result: shape(result.request_id).completed(result),
    )
