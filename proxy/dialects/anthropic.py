"""The Anthropic Messages dialect: POST /v1/messages and /v1/messages/count_tokens (also under
/sessions/{id}) -> a turn request, and the turn's result -> a Message, plain or as Anthropic's
server-sent events. Errors on these routes come in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.answering import retried_session
from proxy.api.deps import SessionIdDep, StateDep
from proxy.api.harness_route import HarnessRoute
from proxy.api.retries import RetryIdentity
from proxy.api.schemas import Shallow
from proxy.dialects.anthropic_checks import check_fields, check_tool_pairs, thinking_omitted
from proxy.dialects.anthropic_errors import error_body
from proxy.dialects.anthropic_input import (
    anthropic_message,
    anthropic_messages,
    chat_tool_choice,
    one_call,
    system_messages,
)
from proxy.dialects.anthropic_output import MessageShape
from proxy.dialects.anthropic_stream import message_events
from proxy.dialects.anthropic_tools import AnthropicTools
from proxy.dialects.converted_history import ConvertedHistories, Forms, ItemByItem, item_texts
from proxy.dialects.seals import Sealer
from proxy.dialects.shared import for_model, turn_request
from proxy.dialects.turn_events import answer_turn
from proxy.errors import ContextLengthExceeded, InvalidRequest, UnsupportedParameter


async def _app_answer(request: Request, exc: Exception) -> Response:
    """What the app's own handler for `exc` answers (it has one for Exception: always found)."""
    handlers = request.app.exception_handlers
    handler = next(handlers[kind] for kind in type(exc).__mro__ if kind in handlers)
    answer: Response = await handler(request, exc)
    return answer


class AnthropicRoute(HarnessRoute):
    """Errors of these routes, including validation and keys, in Anthropic's error shape: the app's
    own handler answers (status, Retry-After, metrics, the log of an unexpected error), and its
    envelope is reworded as Anthropic's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def in_anthropic_shape(request: Request) -> Response:
            try:
                response = await handler(request)
            except Exception as exc:
                answer = await _app_answer(request, exc)
                error = json.loads(bytes(answer.body))["error"]
                body = error_body(answer.status_code, error["message"], error.get("request_id"))
                kept = ("retry-after", "x-should-retry")
                headers = {k: v for k, v in answer.headers.items() if k.lower() in kept}
                response = JSONResponse(body, status_code=answer.status_code, headers=headers)
            # `request-id`, which Anthropic's SDKs read, is set with x-request-id on every answer
            # (proxy/observe/request_ids.py).
            return response

        return in_anthropic_shape


router = APIRouter(prefix="/v1", tags=["anthropic"], route_class=AnthropicRoute)

# Fields that change nothing about the sample (routing, caching, accounting): accepted and recorded.
_INERT = frozenset(
    {
        "metadata",
        "service_tier",
        "cache_control",
        "inference_geo",
        "speed",
        "user_profile_id",
        "workspace_id",
        "diagnostics",
    }
)


def template_kwargs(
    thinking: dict[str, Any] | None, output_config: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The template variables a request sets: the same for a turn and for count_tokens."""
    kwargs: dict[str, Any] = {}
    if (thinking or {}).get("type") == "disabled":
        kwargs["enable_thinking"] = False  # read by Qwen3 and GLM templates
    effort = (output_config or {}).get("effort")
    if effort:
        if not isinstance(effort, str):
            raise InvalidRequest("output_config.effort must be a string", param="output_config.effort")
        kwargs["reasoning_effort"] = effort  # read by gpt-oss
    return kwargs or None


class _Conversation(BaseModel):
    """The fields a Messages request and a count_tokens request share (sampling fields included:
    count_tokens checks them as /v1/messages does, and counts none)."""

    model_config = ConfigDict(extra="allow", strict=True)
    # Free-form values are checked for depth where they enter (proxy/json_limits.py), extras too.
    __pydantic_extra__: dict[str, Annotated[Any, Shallow]] = Field(init=False)

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=32)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: Annotated[list[dict[str, Any]] | None, Shallow] = None
    tool_choice: Annotated[dict[str, Any] | None, Shallow] = None
    thinking: Annotated[dict[str, Any] | None, Shallow] = None
    stream: bool | None = None
    context_management: Annotated[dict[str, Any] | None, Shallow] = None
    output_config: Annotated[dict[str, Any] | None, Shallow] = None

    max_tokens: int | None

    def _check_fields(self, beta: str | None) -> None:
        check_fields(
            self.model_extra,
            _INERT,
            context_management=self.context_management,
            output_config=self.output_config,
            thinking=self.thinking,
            max_tokens=self.max_tokens,
            beta=beta,
        )


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)

    def check_supported(self, beta: str | None) -> None:
        """What Anthropic's API refuses beyond the fields' types, and what this proxy cannot honour;
        `beta` is the request's `anthropic-beta` header."""
        self._check_fields(beta)
        if "" in (self.stop_sequences or []):
            # An empty sequence would end every turn before its first token.
            raise InvalidRequest("stop_sequences must not hold an empty string", param="stop_sequences")
        if self.messages[-1].get("role") == "assistant":
            # A prefill asks the model to continue that text inside its turn; the turn core samples
            # whole turns after a generation prompt, so it cannot be honoured exactly.
            raise UnsupportedParameter(
                "a final assistant message (prefill) is not supported", param="messages"
            )

    def template_kwargs(self) -> dict[str, Any] | None:
        return template_kwargs(self.thinking, self.output_config)

    def response_format(self) -> dict[str, Any] | None:
        """output_config.format as chat's response_format (checked by check_output_config)."""
        found = (self.output_config or {}).get("format")
        if found is None:
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": found["schema"]}}


class CountTokensRequest(_Conversation):
    max_tokens: int | None = Field(default=None, ge=1)

    def check_supported(self, beta: str | None) -> None:
        """As a Messages request is checked; a count is one answer, never a stream."""
        self._check_fields(beta)
        if self.stream:
            raise InvalidRequest("count_tokens does not stream", param="stream")


# What a Messages request's items are converted under (no more than the dialect: the system text is
# the first message, made anew every time); another dialect's entry for the session is never taken.
_CONTEXT = b"anthropic"


def message_forms(
    histories: ConvertedHistories,
    sealer: Sealer,
    session: tuple[str, bool],
    body: MessagesRequest,
    tools: AnthropicTools,
) -> Forms:
    """The request's messages and their forms; a message the session's previous request sent the
    very same, at the same place, is not converted again (proxy/dialects/converted_history.py),
    unless it read the tool list (a tool result's tool_reference blocks: they load deferred tools,
    in order, and show the tools' definitions). Tool uses and results are checked to pair up
    around the messages converted anew, and at the history's end, before the conversion is kept: a
    history refused once is never taken again unchecked."""
    named = None if session[1] else session[0]  # a new session's id is never sent again
    known = histories.find(named, _CONTEXT)
    texts: list[bytes | None] = (
        item_texts(body.messages) if named is not None else [None] * len(body.messages)
    )
    conversion = ItemByItem(known, texts, system_messages(body.system))
    index = 0
    changed: list[int] = []
    while index < len(body.messages):
        taken = conversion.take_again(index)
        if taken:
            index += taken
            continue
        read = tools.references
        made = anthropic_message(body.messages[index], index, sealer, tools)
        conversion.add(index, made, reusable=tools.references == read)
        changed.append(index)
        index += 1
    # The last message too: a history cut after it leaves its tool uses without their results, though
    # it was sent the very same before.
    check_tool_pairs(body.messages, [*changed, len(body.messages) - 1])
    forms, made_now = conversion.finished(_CONTEXT)
    histories.keep(named, made_now)
    return forms


@router.post("/messages", response_model=None)
async def create_message(
    body: MessagesRequest, state: StateDep, session: SessionIdDep, http_request: Request
) -> Response:
    body.check_supported(http_request.headers.get("anthropic-beta"))
    sealer = state.sealer
    identity = RetryIdentity.from_request(http_request.headers, await http_request.body())
    session_id = await retried_session(state, session, identity)
    tools = AnthropicTools.of(body.tools)
    messages = message_forms(state.converted_histories, sealer, session, body, tools)
    request = turn_request(
        state,
        dialect="anthropic",
        messages=messages,
        tools=tools.declared,
        tool_choice=chat_tool_choice(body.tool_choice),
        callable_tools=tools.callable(),
        template_kwargs=body.template_kwargs(),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=tuple(body.stop_sequences or ()),
        response_format=body.response_format(),
        format_param="output_config.format",
        one_call=one_call(body.tool_choice),
        raw=body.model_dump(exclude={"messages", "system", "tools"}, exclude_none=True),
        identity=identity,
    )
    request = await for_model(state, request, body.model)

    def shape(request_id: str) -> MessageShape:
        # Named by the turn's request id: a retry answered from the record has the original's.
        return MessageShape(
            f"msg_{request_id}",
            body.model,
            sealer,
            tuple(body.stop_sequences or ()),
            omit_thinking=thinking_omitted(body.thinking),
        )

    return await answer_turn(
        state,
        session_id,
        request,
        identity,
        stream=bool(body.stream),
        client=http_request,
        events=lambda answer, held: message_events(shape(answer.request_id), answer, held),
        body=lambda result: shape(result.request_id).message(result),
    )


@router.post("/messages/count_tokens")
async def count_tokens(
    body: CountTokensRequest, state: StateDep, session: SessionIdDep, http_request: Request
) -> dict[str, Any]:
    """The length of the prompt this request would be sent as its session's next turn: planned by the
    turn core (the session's pinned date, a continued recorded call's ids), nothing sampled."""
    body.check_supported(http_request.headers.get("anthropic-beta"))
    await state.model_names.choose(body.model)  # a name /v1/messages refuses is refused here too
    session_id, _ = session
    tools = AnthropicTools.of(body.tools)
    messages = anthropic_messages(body.system, body.messages, state.sealer, tools)
    kwargs = template_kwargs(body.thinking, body.output_config)
    # tool_choice changes what may be sampled, not the prompt; sampling fields are not counted.
    request = turn_request(
        state,
        dialect="anthropic",
        messages=messages,
        tools=tools.declared,
        tool_choice=None,
        template_kwargs=kwargs,
        max_tokens=None,
        temperature=None,
        top_p=None,
        raw={},
        identity=None,
    )
    try:
        return {"input_tokens": await state.turns.prompt_length(session_id, request)}
    except ContextLengthExceeded:
        # The turn would be refused; the count still says how long the prompt is.
        now = await state.turns.template_now(session_id)
        rendered = state.renderer.render_prompt(
            messages, tools=tools.declared or None, template_kwargs=kwargs, now=now
        )
        return {"input_tokens": len(rendered)}
