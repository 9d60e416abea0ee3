"""Stop strings end the answer where SGLang's own match ends it: at the first occurrence, even when
the last sampled token holds the stop string more than once."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang
from tests.support import assemble_stream, segments, stream_events


def _ids(tokenizer: Tokenizer, *pieces: str) -> list[int]:
    return [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False).ids]


def _continue_with(url: str, session: str, answer: str) -> None:
    """Echo the answer and go on: the record holds exactly this answer iff one segment results."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "more"},
    ]
    response = httpx.post(
        f"{url}/sessions/{session}/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 8},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert [s["num_calls"] for s in segments(url, session)] == [2]


# The last token (" ----" and "---", one token each) holds the stop string "--" twice; in the second
# case the first occurrence starts in the token before it.
CASES = [(("alpha", " beta", " ----"), "alpha beta "), (("alpha", " beta -", "---"), "alpha beta ")]


@pytest.mark.parametrize(("pieces", "expected"), CASES)
def test_stop_string_twice_in_the_last_token_is_cut_at_the_first(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, pieces: tuple[str, ...], expected: str
) -> None:
    ids = _ids(qwen_tokenizer, *pieces)
    assert len(qwen_tokenizer.encode(pieces[-1], add_special_tokens=False).ids) == 1
    engine.push(ids)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["--"]}
    answer = httpx.post(f"{proxy_url}/sessions/plain/v1/chat/completions", json=body, timeout=30).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == expected
    _continue_with(proxy_url, "plain", expected)


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_streamed_stop_string_twice_in_the_last_token_is_cut_at_the_first(
    proxy_url: str,
    engine: FakeSGLang,
    qwen_tokenizer: Tokenizer,
    case: tuple[tuple[str, ...], str],
    incremental: bool,
) -> None:
    pieces, expected = case
    engine.incremental = incremental
    engine.push(_ids(qwen_tokenizer, *pieces))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["--"], "stream": True}
    events, _ = stream_events(proxy_url, body, "streamed")
    streamed = assemble_stream(events)
    assert streamed["content"] == expected
    assert streamed["finish_reason"] == "stop"
    _continue_with(proxy_url, "streamed", expected)
