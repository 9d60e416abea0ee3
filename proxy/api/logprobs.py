"""Recorded logprobs in OpenAI's two shapes: chat (`logprobs.content`) and legacy completions."""

from __future__ import annotations

import codecs
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
    """`choices[].logprobs` of a legacy completion: parallel lists and character offsets. Each
    position's `top_logprobs` holds the `top_count` likeliest tokens and always the sampled one
    ("up to logprobs+1 elements", as OpenAI's reference says)."""
    tokens = [pieces.text_of(t) for t in output_ids]
    alternatives = [top[i][:top_count] if top is not None else [] for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [
            _with_sampled(pieces, alternatives[i], (output_ids[i], token, logprobs[i]))
            for i, token in enumerate(tokens)
        ],
        "text_offset": TextOffsets().of(pieces, output_ids),
    }


def _with_sampled(
    pieces: TokenPieces, alternatives: TopLogprobs, sampled: tuple[int, str, float]
) -> dict[str, float]:
    """A position's alternatives by text, the sampled token among them even when the engine's top
    ones leave it out (a temperature sample outside them)."""
    token_id, token, logprob = sampled
    found = {pieces.text_of(t): lp for t, lp in alternatives}
    if all(t != token_id for t, _ in alternatives):
        found[token] = logprob
    return found


class TextOffsets:
    """Where each token starts in the text the tokens decode to, in characters: a character whose
    bytes span tokens is counted once its last byte arrives (its first tokens start where it does)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def of(self, pieces: TokenPieces, ids: Sequence[int]) -> list[int]:
        offsets = []
        for token_id in ids:
            offsets.append(self.chars)
            self.chars += len(self._decoder.decode(pieces.bytes_of(token_id)))
        return offsets


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
