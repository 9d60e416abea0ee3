"""Property tests: random agent conversations through the proxy over HTTP keep I1-I6 on Qwen templates."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.families import FAMILIES, build_tokenizer_dir
from tests.invariants import assert_invariants
from tests.support import token_id

EDGES = st.sampled_from(["", " ", "\n", "\n\n", "  \n", "\t"])
WORDS = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="<>"),
    max_size=24,
)
TEXT = st.builds(lambda a, w, b: a + w + b, EDGES, WORDS, EDGES)
ARGS = st.dictionaries(
    st.sampled_from(["path", "query", "n", "flag"]),
    st.one_of(st.integers(-5, 99), st.booleans(), WORDS),
    max_size=3,
)
TURN = st.fixed_dictionaries(
    {
        "reasoning": st.one_of(st.none(), TEXT.filter(lambda t: t.strip() != "")),
        "content": TEXT,
        "calls": st.lists(st.tuples(st.sampled_from(["read", "search", "run"]), ARGS), max_size=3),
        "results": st.lists(TEXT, min_size=3, max_size=3),
        "truncate": st.booleans(),
        "retokenize": st.booleans(),
        "echo_reasoning": st.booleans(),
        "user": TEXT,
    }
)


def _sampled_text(turn: dict[str, Any]) -> str:
    text: str = f"<think>\n{turn['reasoning']}\n</think>\n\n" if turn["reasoning"] is not None else ""
    text += turn["content"]
    for name, arguments in turn["calls"]:
        text += "\n<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        text += "\n</tool_call>"
    return text


def _encode(tokenizer: Tokenizer, text: str, *, retokenize: bool) -> list[int]:
    if not retokenize:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    ids: list[int] = []
    for piece in text.replace("<", "\0<").replace(">", ">\0").split("\0"):
        chunks = [piece] if piece.startswith("<") else [piece[i : i + 2] for i in range(0, len(piece), 2)]
        for chunk in chunks:
            ids.extend(tokenizer.encode(chunk, add_special_tokens=False).ids)
    return ids


@pytest.fixture(params=["qwen3", "qwen2_5"])
def template_proxy(
    request: pytest.FixtureRequest, start_proxy: ProxyFactory, qwen_dir: Path, tmp_path: Path
) -> Iterator[str]:
    directory = (
        qwen_dir if request.param == "qwen3" else build_tokenizer_dir(FAMILIES["qwen2_5"], tmp_path / "q25")
    )
    with start_proxy(tokenizer=directory) as url:
        yield url


# A failing example's report reprs the fixtures (over 200 kB): the failure itself must show, not that.
@pytest.mark.filterwarnings("ignore:Generating overly large repr")
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(TURN, min_size=2, max_size=4))
def test_random_conversations_keep_every_sampled_token(
    template_proxy: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, turns: list[dict[str, Any]]
) -> None:
    session = uuid.uuid4().hex  # Hypothesis replays examples: each needs a session of its own
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    first_request = len(engine.requests)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Agent."},
        {"role": "user", "content": "Task"},
    ]
    outputs = []
    with httpx.Client(base_url=template_proxy, timeout=60) as client:
        for turn in turns:
            truncated = turn["truncate"] and not turn["calls"]
            ids = _encode(qwen_tokenizer, _sampled_text(turn), retokenize=turn["retokenize"])
            if not ids:
                ids = _encode(qwen_tokenizer, "ok", retokenize=False)
            if truncated:
                ids = ids[: max(1, len(ids) // 2)]
            outputs.append(engine.push(ids if truncated else [*ids, im_end]))
            body = {"model": "m", "messages": messages, "max_tokens": len(ids) if truncated else 4096}
            response = client.post(f"/sessions/{session}/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            if not turn["echo_reasoning"]:
                message.pop("reasoning_content", None)
            messages.append(message)
            calls = message.get("tool_calls") or []
            if calls:
                messages.extend(
                    {"role": "tool", "tool_call_id": c["id"], "content": r}
                    for c, r in zip(calls, turn["results"], strict=False)
                )
            else:
                messages.append({"role": "user", "content": turn["user"]})
        [segment] = client.get(f"/sessions/{session}/trajectory").json()["segments"]
    assert_invariants(segment, engine.requests[first_request:], outputs)
    assert segment["drift"]["unclassified"] == 0, segment["drift"]["differences"]
