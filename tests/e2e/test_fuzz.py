"""Fuzzed requests over HTTP: whatever a client sends, the proxy answers in the envelope, never 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# A live proxy for the whole module: fuzzing must not pay a start-up per example.


@pytest.fixture(scope="module")
def fuzz_url(tmp_path_factory: pytest.TempPathFactory, qwen_dir: Any) -> Iterator[str]:
    from tokenizers import Tokenizer

    from proxy.app import create_app
    from proxy.config import Settings
    from tests.fakes.sglang import FakeSGLang
    from tests.support import serve, token_id

    tokenizer = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    fake = FakeSGLang(
        tokenizer=tokenizer,
        eos_ids=(token_id(tokenizer, "<|im_end|>"),),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
    )
    db = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    with serve(fake.app()) as engine_url:
        settings_ = Settings(engine_url=engine_url, tokenizer=qwen_dir, db=f"sqlite:///{db}")
        with serve(create_app(settings_)) as url:
            yield url
    assert not fake.crashed, "a fuzzed request put an id outside the vocabulary on the wire"


def _assert_answered_in_the_envelope(response: Any, path: str = "") -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        body = response.json()
        if path.endswith(("/messages", "/messages/count_tokens")):
            # The Anthropic dialect answers in Anthropic's error shape.
            assert body["type"] == "error"
            assert set(body["error"]) == {"type", "message", "request_id"}
            assert body["request_id"] == body["error"]["request_id"]
            return
        assert set(body["error"]) == {"message", "type", "param", "code", "request_id"}


def test_schemathesis_finds_no_server_error(fuzz_url: str) -> None:
    """Every operation of our own OpenAPI schema, with cases schemathesis derives from it."""
    schema = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) > 15

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            _assert_answered_in_the_envelope(case.call(base_url=fuzz_url, timeout=30), case.path)

        check()
        # A fuzzed POST /admin/pause must not hold the next operations' turns.
        httpx.post(f"{fuzz_url}/admin/resume", timeout=30)


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "bot"])},
    optional={
        "content": _JSON,
        "tool_calls": _JSON,
        "tool_call_id": _JSON,
        "reasoning_content": _JSON,
        "name": _JSON,
    },
)
_CHAT = st.fixed_dictionaries(
    {"model": st.text(max_size=8), "messages": st.lists(_MESSAGE, max_size=4)},
    optional={
        key: _JSON
        for key in (
            "tools",
            "tool_choice",
            "n",
            "max_tokens",
            "stop",
            "temperature",
            "top_p",
            "logprobs",
            "top_logprobs",
            "response_format",
            "stream",
            "chat_template_kwargs",
            "seed",
        )
    },
)


@given(body=_CHAT)
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_chat_bodies_never_get_a_server_error(fuzz_url: str, body: dict[str, Any]) -> None:
    _assert_answered_in_the_envelope(httpx.post(f"{fuzz_url}/v1/chat/completions", json=body, timeout=30))


@given(
    body=st.fixed_dictionaries(
        {"model": st.text(max_size=4), "prompt": _JSON},
        optional={"max_tokens": _JSON, "logprobs": _JSON, "n": _JSON},
    )
)
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_completion_bodies_never_get_a_server_error(fuzz_url: str, body: dict[str, Any]) -> None:
    _assert_answered_in_the_envelope(httpx.post(f"{fuzz_url}/v1/completions", json=body, timeout=30))
