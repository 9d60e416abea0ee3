"""/v1/completions: text or token-id prompts, sent and recorded token for token."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang
from tests.support import segments, token_id


def _complete(url: str, session: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(
        f"{url}/sessions/{session}/v1/completions", json={"model": "m", "max_tokens": 32, **body}, timeout=30
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _script(engine: FakeSGLang, tokenizer: Tokenizer, text: str, stop: bool = True) -> list[int]:
    ids = tokenizer.encode(text).ids + ([token_id(tokenizer, "<|im_end|>")] if stop else [])
    engine.push(ids, [-0.5 - i / 8 for i in range(len(ids))])
    return ids


def test_text_prompt_is_tokenized_once_and_answered_with_legacy_logprobs(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    output = _script(engine, qwen_tokenizer, " the answer is 4")
    answer = _complete(proxy_url, "t", prompt="2 + 2 =", logprobs=2, return_token_ids=True)
    assert engine.requests[-1]["input_ids"] == qwen_tokenizer.encode("2 + 2 =").ids
    [choice] = answer["choices"]
    assert answer["object"] == "text_completion"
    assert choice["text"] == " the answer is 4"
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == output
    assert answer["prompt_token_ids"] == qwen_tokenizer.encode("2 + 2 =").ids
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"] == [-0.5 - i / 8 for i in range(len(output) - 1)]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(output) - 1)]


def test_a_streamed_completions_text_offsets_run_over_the_whole_text(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """Each chunk's text_offset counts from the start of the completion, as unstreamed (and as vLLM
    streams them), not from the start of the chunk."""
    body = {"model": "m", "max_tokens": 32, "prompt": "2 + 2 =", "logprobs": 1}
    _script(engine, qwen_tokenizer, " the answer is 4, surely")
    whole = _complete(proxy_url, "whole", **{k: v for k, v in body.items() if k != "model"})
    _script(engine, qwen_tokenizer, " the answer is 4, surely")
    streamed = httpx.post(f"{proxy_url}/sessions/parts/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    offsets = [o for c in chunks for o in ((c["choices"][0]["logprobs"] or {}).get("text_offset") or [])]
    tokens = [t for c in chunks for t in ((c["choices"][0]["logprobs"] or {}).get("tokens") or [])]
    assert len([c for c in chunks if (c["choices"][0]["logprobs"] or {}).get("tokens")]) > 1
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_count_characters_split_across_tokens_once(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, stream: bool
) -> None:
    """A character whose bytes span tokens (an emoji, a CJK character in pieces) is one character of
    the text: each offset is where its token starts in the text, never past its end."""
    text = " 東京 🌧 ok"
    _script(engine, qwen_tokenizer, text)
    body = {"model": "m", "prompt": "Weather:", "max_tokens": 32, "logprobs": 1, "stream": stream}
    response = httpx.post(f"{proxy_url}/sessions/off-{stream}/v1/completions", json=body, timeout=30)
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    if not stream:
        chunks = [response.json()]
    answer = "".join(c["choices"][0]["text"] for c in chunks)
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    offsets = [o for lp in logprobs for o in lp["text_offset"]]
    tokens = [t for lp in logprobs for t in lp["tokens"]]
    assert any(t.startswith("bytes:") for t in tokens), tokens  # the emoji is split across tokens
    assert offsets == sorted(offsets)
    assert all(offset <= len(answer) for offset in offsets)
    for offset, token in zip(offsets, tokens, strict=True):
        if not token.startswith("bytes:"):
            assert answer[offset : offset + len(token)] == token
    assert answer == text


@pytest.mark.parametrize("count", [0, 2])
def test_top_logprobs_always_hold_the_sampled_token(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, count: int
) -> None:
    """OpenAI: "The API will always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements": also when the engine's top k leave out what a temperature sample picked."""
    engine.sampled_in_top = False
    output = _script(engine, qwen_tokenizer, " Hello there.")
    answer = _complete(proxy_url, f"top{count}", prompt="Say:", logprobs=count)
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["top_logprobs"]) == len(output) - 1
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert top[token] == logprob
        assert len(top) == count + 1


def test_token_prompts_that_extend_a_record_continue_its_segment(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    prompt = qwen_tokenizer.encode("Question: what is 2 + 2?\nAnswer:").ids
    first = _script(engine, qwen_tokenizer, " 4.", stop=False)
    _complete(proxy_url, "tok", prompt=prompt, max_tokens=len(first))
    observation = qwen_tokenizer.encode("\nQuestion: and 3 + 3?\nAnswer:").ids
    second = _script(engine, qwen_tokenizer, " 6.", stop=False)
    _complete(proxy_url, "tok", prompt=prompt + first + observation, max_tokens=len(second))
    assert engine.requests[-1]["input_ids"] == prompt + first + observation
    [segment] = segments(proxy_url, "tok")
    assert segment["num_calls"] == 2
    assert segment["prompt_ids"] == prompt
    assert segment["response_ids"] == first + observation + second
    assert segment["loss_mask"] == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    assert "skipped" in segment["drift"]


def test_streamed_completion_reassembles_to_the_plain_text(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen_tokenizer, " Grüße aus 東京, friend")
    plain = _complete(proxy_url, "p", prompt="Say hi:")["choices"][0]["text"]
    _script(engine, qwen_tokenizer, " Grüße aus 東京, friend")
    texts: list[str] = []
    finish = None
    body = {"model": "m", "prompt": "Say hi:", "max_tokens": 32, "stream": True}
    with httpx.stream("POST", f"{proxy_url}/sessions/s/v1/completions", json=body, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        [choice] = json.loads(line[6:])["choices"]
        texts.append(choice["text"])
        finish = choice["finish_reason"] or finish
    assert "".join(texts) == plain
    assert len([t for t in texts if t]) > 3
    assert finish == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [10**7]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ],
)
def test_bad_completion_requests_are_400(
    proxy_url: str, engine: FakeSGLang, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(f"{proxy_url}/v1/completions", json={"model": "m", **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not engine.requests


def test_completion_retries_are_answered_from_the_record(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen_tokenizer, " once")
    url = f"{proxy_url}/sessions/retry/v1/completions"
    body = {"model": "m", "prompt": "Say it:", "max_tokens": 8}
    first = httpx.post(url, json=body, headers={"Idempotency-Key": "c1"}, timeout=30)
    again = httpx.post(url, json=body, headers={"Idempotency-Key": "c1"}, timeout=30)
    assert again.headers["X-Tito-Replayed"] == "true"
    assert again.json()["choices"] == first.json()["choices"]
    streamed = httpx.post(url, json={**body, "stream": True}, headers={"Idempotency-Key": "c2"}, timeout=30)
    replayed = httpx.post(url, json={**body, "stream": True}, headers={"Idempotency-Key": "c2"}, timeout=30)
    assert len(engine.requests) == 2

    def text(response: httpx.Response) -> str:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        return "".join(choice["text"] for event in events for choice in event["choices"])

    assert text(replayed) == text(streamed) == "ok"


@pytest.mark.parametrize("stream", [False, True])
def test_completions_errors_name_the_prompt_not_messages(proxy_url: str, stream: bool) -> None:
    """The turn core names the prompt `messages`, as chat does; a completions client sent `prompt`."""
    body = {"model": "m", "max_tokens": 4, "prompt": [100] * 40_000, "stream": stream}
    answer = httpx.post(f"{proxy_url}/sessions/long/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"


def test_a_completion_streams_error_event_names_the_prompt() -> None:
    from proxy.api.streaming import TextChunkWriter

    event = TextChunkWriter("cmpl-x", "m").error({"error": {"message": "too long", "param": "messages"}})
    assert json.loads(event.removeprefix(b"data: "))["error"]["param"] == "prompt"
