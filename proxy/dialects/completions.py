"""/v1/completions: a text or token-id prompt sent as ids, recorded like a chat turn.

A token prompt that starts with a recorded call's prompt + output continues that call's segment,
so a token-in/token-out multi-turn client gets the same merged trajectories as a chat harness.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request, Response

from proxy.api.answering import answer, retried_session
from proxy.api.deps import SessionIdDep, StateDep
from proxy.api.harness_route import FieldNamedRoute
from proxy.api.logprobs import answered_logprobs, completion_logprobs
from proxy.api.retries import RetryIdentity
from proxy.api.schemas import CompletionRequest
from proxy.api.streaming import COMPLETION_FIELD_NAMES, StreamOptions
from proxy.app_state import AppState
from proxy.dialects.chat import sampling_params
from proxy.dialects.shared import for_model
from proxy.turns import TurnRequest, TurnResult


class CompletionsRoute(FieldNamedRoute):
    field_names = COMPLETION_FIELD_NAMES


router = APIRouter(prefix="/v1", tags=["openai"], route_class=CompletionsRoute)


async def _prompt_ids(body: CompletionRequest, state: AppState) -> list[int]:
    prompt = body.single_prompt
    if isinstance(prompt, list):
        return prompt
    # As SGLang and vLLM tokenize a text prompt: the tokenizer's own special tokens (a BOS) included.
    return await state.turns.encode_prompt_text(prompt)


def _body(
    results: Sequence[TurnResult], body: CompletionRequest, state: AppState, prompt_ids: list[int]
) -> dict[str, Any]:
    choices = []
    for result in results:
        choice: dict[str, Any] = {
            "index": result.choice_index,
            "text": result.output.content or "",
            "logprobs": None,
            "finish_reason": result.finish_reason,
        }
        if body.logprobs is not None:
            choice["logprobs"] = answered_logprobs(
                completion_logprobs, state.pieces, result.generation, body.logprobs
            )
        if body.return_token_ids:
            choice["token_ids"] = result.generation.output_ids
        choices.append(choice)
    completion_tokens = sum(r.completion_tokens for r in results)
    answer: dict[str, Any] = {
        "id": f"cmpl-{results[0].request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": results[0].prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": results[0].prompt_tokens + completion_tokens,
        },
    }
    if body.return_token_ids:
        answer["prompt_token_ids"] = prompt_ids
    return answer


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest, state: StateDep, session: SessionIdDep, http_request: Request
) -> Response:
    body.check_supported()
    prompt_ids = await _prompt_ids(body, state)
    identity = RetryIdentity.from_request(http_request.headers, await http_request.body())
    session_id = await retried_session(state, session, identity)
    top = body.logprobs or 0
    request = TurnRequest(
        messages=[],
        tools=None,
        template_kwargs=None,
        sampling=sampling_params(
            body, stop_token_ids=state.renderer.stop_token_ids, state=state, top_logprobs=top
        ),
        max_tokens_requested=body.requested_max_tokens,
        raw=body.model_dump(exclude={"prompt"}, exclude_none=True),
        choices=body.n or 1,
        prompt_ids=prompt_ids,
        dialect="completions",
        idempotency_key=identity.idempotency_key if identity else None,
        request_hash=identity.request_hash if identity else None,
    )
    options = StreamOptions.of(
        body, keepalive_s=state.settings.stream_keepalive_s, top_logprobs=body.logprobs
    )
    return await answer(
        state,
        session_id,
        await for_model(state, request, body.model),
        identity,
        stream=bool(body.stream),
        options=options,
        text_completion=True,
        body_of=lambda results: _body(results, body, state, prompt_ids),
        client=http_request,
    )
