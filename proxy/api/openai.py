"""The OpenAI surface: /v1/chat/completions and /v1/models, also under /sessions/{id}."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from proxy.api.deps import SessionIdDep, StateDep
from proxy.api.schemas import ChatCompletionRequest
from proxy.api.streaming import sse_events
from proxy.engines.base import SamplingParams
from proxy.errors import UnsupportedParameter
from proxy.turns import TurnRequest, TurnResult

router = APIRouter(prefix="/v1", tags=["openai"])


def _sampling(
    body: ChatCompletionRequest, *, stop_token_ids: tuple[int, ...], seed_honoured: bool
) -> SamplingParams:
    if body.seed is not None and not seed_honoured:
        raise UnsupportedParameter(
            "seed is only honoured by the local engine (SGLang needs --enable-deterministic-inference)",
            param="seed",
        )
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
    )


def _completion_body(result: TurnResult, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.output.content}
    if result.output.reasoning_content is not None:
        message["reasoning_content"] = result.output.reasoning_content
    if result.output.tool_calls:
        message["tool_calls"] = result.output.tool_calls
    return {
        "id": f"chatcmpl-{result.call_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": result.finish_reason, "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
    }


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, state: StateDep, session: SessionIdDep, response: Response
) -> dict[str, Any] | StreamingResponse:
    session_id, _ = session
    body.check_supported()
    request = TurnRequest(
        messages=[m.as_plain() for m in body.messages],
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        template_kwargs=body.chat_template_kwargs or None,
        sampling=_sampling(
            body,
            stop_token_ids=state.renderer.stop_token_ids,
            seed_honoured=state.engine.name == "local",
        ),
        max_tokens_requested=body.requested_max_tokens,
        raw=body.model_dump(exclude={"messages", "tools", "chat_template_kwargs"}, exclude_none=True),
    )
    if body.stream:
        turn = await state.turns.prepare(session_id, request)
        request_id = uuid.uuid4().hex  # fixed length: SGLang aborts by rid prefix
        # Opening the engine stream raises here, before any byte is sent, when the engine refuses.
        chunks = await state.engine.stream(turn.plan.prompt.tolist(), turn.params, request_id)
        events = sse_events(
            turns=state.turns,
            engine=state.engine,
            turn=turn,
            chunks=chunks,
            request_id=request_id,
            model=body.model,
            include_usage=bool((body.stream_options or {}).get("include_usage")),
            keepalive_s=state.settings.stream_keepalive_s,
        )
        headers = {"X-Session-Id": session_id, "Cache-Control": "no-cache"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    result = await state.turns.run(session_id, request)
    response.headers["X-Session-Id"] = session_id
    return _completion_body(result, body.model)


@router.get("/template")
async def template_report(state: StateDep) -> dict[str, Any]:
    """The start-up self-test's verdict on the served chat template."""
    return state.renderer.verdict.as_json()


@router.get("/models")
async def list_models(state: StateDep) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "tito-proxy",
                "max_model_len": state.context_length,
            }
        ],
    }
