"""What the Responses and Anthropic dialects share: a translated request becomes the turn core's
TurnRequest (sampling, constraints, retry identity), and a tool call's arguments become an object."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy.api.retries import RetryIdentity
from proxy.app_state import AppState
from proxy.chat.constraints import response_format_constraint, tool_choice_constraint
from proxy.chat.messages import HistoryHash, Message, parse_arguments
from proxy.dialects.converted_history import Forms
from proxy.engines.base import SamplingParams
from proxy.engines.routed_experts import ExpertsAsk
from proxy.errors import UnsupportedParameter
from proxy.turns import TurnRequest


def sampling_constraint(
    state: AppState,
    tool_choice: str | dict[str, Any] | None,
    response_format: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    *,
    format_param: str = "text.format",
    one_call: bool | None = None,
) -> Any:
    """The one grammar a request may sample under: a forced tool call or a JSON output format, named
    in errors by the dialect's own parameter (`format_param`)."""
    forced = tool_choice_constraint(tool_choice, tools, state.turns.parser.name, one_call=one_call)
    formatted = response_format_constraint(response_format)
    chosen = [c for c in (forced, formatted) if c is not None]
    if not chosen:
        return None
    if len(chosen) > 1:
        raise UnsupportedParameter(
            f"a forced tool call and a JSON {format_param} cannot be combined (one grammar per request)",
            param=format_param,
        )
    if formatted is not None and tools and tool_choice != "none":
        # The JSON grammar admits no tool call: the tools offered could never be called.
        raise UnsupportedParameter(
            f"a JSON {format_param} with tools the model may call would keep it from calling any (the"
            " grammar admits only the JSON): set tool_choice to 'none', or leave out the format",
            param=format_param,
        )
    if not state.engine.supports_constraints:
        raise UnsupportedParameter(
            f"the {state.engine.name} engine cannot constrain sampling (tool_choice/{format_param})",
            param="tool_choice" if forced is not None else format_param,
        )
    return chosen[0]


def turn_request(
    state: AppState,
    *,
    dialect: str,
    messages: list[Message] | Forms,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    template_kwargs: dict[str, Any] | None,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None = None,
    stop: tuple[str, ...] = (),
    response_format: dict[str, Any] | None = None,
    raw: dict[str, Any],
    identity: RetryIdentity | None,
    callable_tools: list[dict[str, Any]] | None = None,
    format_param: str = "text.format",
    one_call: bool | None = None,
) -> TurnRequest:
    """The turn core's request; `tools` and `tool_choice` in chat's shape; `messages` with their
    canonical forms and history hash when the dialect has them (proxy/dialects/converted_history.py).
    A forced call may name any of `callable_tools` (default `tools`): Anthropic's loaded deferred
    tools are callable without being in the prompt's tool list."""
    sampling = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=-1 if top_k is None or top_k == 0 else top_k,
        stop=stop,
        stop_token_ids=state.renderer.stop_token_ids,
        constraint=sampling_constraint(
            state,
            tool_choice,
            response_format,
            tools if callable_tools is None else callable_tools,
            format_param=format_param,
            one_call=one_call,
        ),
    )
    canonical: list[bytes] | None = None
    history: HistoryHash | None = None
    if isinstance(messages, Forms):
        canonical, history, messages = messages.canonical, messages.hash, messages.messages
    return TurnRequest(
        messages=messages,
        known_canonical=canonical,
        known_hash=history,
        tools=tools or None,
        template_kwargs=template_kwargs or None,
        sampling=sampling,
        max_tokens_requested=max_tokens,
        raw=raw,
        parse_tools=tool_choice != "none",
        idempotency_key=identity.idempotency_key if identity else None,
        request_hash=identity.request_hash if identity else None,
        dialect=dialect,
    )


async def for_model(state: AppState, request: TurnRequest, model: str | None) -> TurnRequest:
    """The request sampled by the weights its `model` names (a LoRA adapter, or the base model: see
    proxy/api/model_names.py), asking for routed experts when they are recorded (the planner sets
    the position they start at)."""
    facts = state.engine_facts
    if facts is not None and not facts.known:
        await facts.before_turn()  # an engine down at start: its context first, if it answers now
    choice = await state.model_names.choose(model)
    asks = ExpertsAsk(0, state.routed_experts_shape) if state.settings.record_routed_experts else None
    if choice.adapter is None and asks is None:
        return request
    return replace(request, sampling=replace(request.sampling, adapter=choice.adapter, routed_experts=asks))


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (Anthropic's `input`); anything else is wrapped, not lost."""
    value = parse_arguments(arguments)
    return value if isinstance(value, dict) else {"arguments": value}
