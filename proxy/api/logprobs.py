"""Recorded logprobs in OpenAI's two shapes: chat (`logprobs.content`) and legacy completions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from proxy.chat.token_pieces import TokenPieces
from proxy.engines.base import Generation, TopLogprobs

# chat_logprobs or completion_logprobs: (pieces, ids, logprobs, alternatives, how many) -> JSON.
LogprobsShape = Callable[
    [TokenPieces, Sequence[int], Sequence[float], Sequence[TopLogprobs] | None, int], dict[str, Any]
]


def answered_positions(output_ids: Sequence[int], matched_token: int | None) -> int:
    """How many output tokens the answer covers: all but a stop token that ended the turn."""
    if matched_token is not None and output_ids and output_ids[-1] == matched_token:
        return len(output_ids) - 1
    return len(output_ids)


def chat_logprobs(
    pieces: TokenPieces,
    output_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[TopLogprobs] | None,
    top_count: int,
) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion: one entry per sampled token, in order."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": pieces.text_of(token_id),
            "logprob": logprob,
            "bytes": list(pieces.bytes_of(token_id)),
        }

    content = []
    for position, (token_id, logprob) in enumerate(zip(output_ids, logprobs, strict=True)):
        alternatives = top[position][:top_count] if top is not None else []
        content.append({**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for t, lp in alternatives]})
    return {"content": content, "refusal": None}


def completion_logprobs(
    pieces: TokenPieces,
    output_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[TopLogprobs] | None,
    top_count: int,
) -> dict[str, Any]:
    """`choices[].logprobs` of a legacy completion: parallel lists and character offsets."""
    tokens = [pieces.text_of(t) for t in output_ids]
    offsets = []
    offset = 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [
            {pieces.text_of(t): lp for t, lp in (top[i][:top_count] if top is not None else [])}
            for i in range(len(tokens))
        ]
        if top_count
        else None,
        "text_offset": offsets,
    }


def answered_logprobs(
    shape: LogprobsShape, pieces: TokenPieces, generation: Generation, top_count: int
) -> dict[str, Any]:
    """`shape` over the tokens an answer covers: all sampled ones but a stop token that ended it."""
    upto = answered_positions(generation.output_ids, generation.finish.matched_token)
    top = generation.top_logprobs
    return shape(
        pieces,
        generation.output_ids[:upto],
        generation.logprobs[:upto],
        top[:upto] if top is not None else None,
        top_count,
    )
