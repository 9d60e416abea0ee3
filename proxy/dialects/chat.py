"""The Chat Completions dialect: /v1/chat/completions (also under /sessions/{id}) -> a turn request,
and turn results -> chat.completion answers (plain, or streamed by proxy/api/streaming.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request, Response

from proxy.api.answering import answer, retried_session
from proxy.api.deps import SessionIdDep, StateDep
from proxy.api.harness_route import HarnessRoute
from proxy.api.json_route import OrjsonRequest
from proxy.api.logprobs import answered_logprobs, chat_logprobs
from proxy.api.retries import RetryIdentity
from proxy.api.schemas import ChatCompletionRequest
from proxy.api.streaming import StreamOptions
from proxy.app_state import AppState
from proxy.dialects.shared import for_model, sampling_constraint
from proxy.engines.base import ConstraintKind, SamplingParams
from proxy.errors import ProxyError
from proxy.turns import TurnRequest, TurnResult


class ChatBodyRequest(OrjsonRequest):
    """A chat body validated with its session's known history reused (proxy/api/message_prefix.py);
    FastAPI validates what that does not take, so its errors are unchanged."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            session_id = self.path_params.get("session_id") or self.headers.get("x-session-id")
            state: AppState = self.app.state.proxy
            self._json = state.message_prefixes.read(session_id, await self.body())
        return self._json


class ChatRoute(HarnessRoute):
    request_class = ChatBodyRequest


router = APIRouter(prefix="/v1", tags=["openai"], route_class=ChatRoute)


def sampling_params(
    body: Any,
    *,
    stop_token_ids: tuple[int, ...],
    state: AppState,
    top_logprobs: int = 0,
    constraint: tuple[ConstraintKind, str] | None = None,
) -> SamplingParams:
    """The request's sampling fields as SGLang's, shared by chat and text completions. `seed` is best
    effort as in OpenAI's API: SGLang's sampling_seed, deterministic only on a server started with
    --enable-deterministic-inference."""
    return SamplingParams(
        max_new_tokens=body.requested_max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None or body.top_k == 0 else body.top_k,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        stop=body.stop_sequences,
        stop_token_ids=stop_token_ids,
        seed=body.seed,
        top_logprobs=top_logprobs,
        constraint=constraint,
    )


def _turn_request(
    body: ChatCompletionRequest, state: AppState, identity: RetryIdentity | None
) -> TurnRequest:
    tools = body.plain_tools()
    params = sampling_params(
        body,
        stop_token_ids=state.renderer.stop_token_ids,
        state=state,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        constraint=sampling_constraint(
            state, body.tool_choice, body.response_format, tools, format_param="response_format"
        ),
    )
    plain, canonical = body.message_forms()
    return TurnRequest(
        messages=plain,
        known_canonical=canonical,
        known_hash=body.history_hash(),
        known_tools_key=body.tools_key(),
        tools=tools,
        template_kwargs=body.template_kwargs(),
        sampling=params,
        max_tokens_requested=body.requested_max_tokens,
        raw=body.model_dump(exclude={"messages", "tools", "chat_template_kwargs"}, exclude_none=True),
        choices=body.n or 1,
        parse_tools=body.tool_choice != "none",
        idempotency_key=identity.idempotency_key if identity else None,
        request_hash=identity.request_hash if identity else None,
    )


def _completion_body(
    results: Sequence[TurnResult], model: str, state: AppState, top_logprobs: int | None
) -> dict[str, Any]:
    choices = []
    for result in results:
        message: dict[str, Any] = {"role": "assistant", "content": result.output.content}
        if result.output.reasoning_content is not None:
            message["reasoning_content"] = result.output.reasoning_content
        if result.output.tool_calls:
            message["tool_calls"] = result.output.tool_calls
        logprobs = None
        if top_logprobs is not None:
            logprobs = answered_logprobs(chat_logprobs, state.pieces, result.generation, top_logprobs)
        choices.append(
            {
                "index": result.choice_index,
                "message": message,
                "finish_reason": result.finish_reason,
                "logprobs": logprobs,
            }
        )
    completion_tokens = sum(r.completion_tokens for r in results)
    return {
        "id": f"chatcmpl-{results[0].request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": results[0].prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": results[0].prompt_tokens + completion_tokens,
        },
    }


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest,
    state: StateDep,
    session: SessionIdDep,
    http_request: Request,
) -> Response:
    body.check_supported()
    identity = RetryIdentity.from_request(http_request.headers, await http_request.body())
    session_id = await retried_session(state, session, identity)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    options = StreamOptions.of(body, keepalive_s=state.settings.stream_keepalive_s, top_logprobs=top_logprobs)
    try:
        return await answer(
            state,
            session_id,
            await for_model(state, _turn_request(body, state, identity), body.model),
            identity,
            stream=bool(body.stream),
            options=options,
            text_completion=False,
            body_of=lambda results: _completion_body(results, body.model, state, top_logprobs),
            client=http_request,
        )
    except ProxyError as exc:
        # The turn core names its limit max_tokens; a client that sent only the newer field reads
        # about the field it sent.
        if exc.param == "max_tokens" and body.max_tokens is None and body.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"
        raise
