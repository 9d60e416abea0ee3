"""The Anthropic Messages dialect through the official anthropic SDK: a tool loop with thinking,
plain and streamed, one exact segment (I1-I6); signatures we did not issue; errors and count_tokens."""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from tokenizers import Tokenizer

from proxy.app import create_app
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.config import Settings
from tests.conftest import ProxyFactory
from tests.e2e.test_responses import call_text, push
from tests.fakes.sglang import FakeSGLang
from tests.families import FAMILIES, build_tokenizer_dir
from tests.invariants import assert_invariants
from tests.support import segments, serve

TOOLS: Any = [
    {
        "name": "lookup",
        "description": "Look a word up",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},
    }
]
THINKING: Any = {"type": "enabled", "budget_tokens": 1024}


def client_for(url: str, session: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{url}/sessions/{session}", api_key="unused", max_retries=0)


def _turn(client: anthropic.Anthropic, messages: list[Any], *, streamed: bool) -> Any:
    arguments: Any = {
        "model": "m",
        "max_tokens": 2048,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": messages,
        "tools": TOOLS,
        "thinking": THINKING,
        "metadata": {"user_id": "u1"},
    }
    if not streamed:
        return client.messages.create(**arguments)
    with client.messages.stream(**arguments) as stream:
        for _ in stream:
            pass
        return stream.get_final_message()


def test_tool_loop_with_thinking_plain_and_streamed_is_one_exact_segment(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, request: pytest.FixtureRequest
) -> None:
    client = client_for(proxy_url, "a-loop")
    request.addfinalizer(client.close)
    outputs = [
        push(
            engine, qwen_tokenizer, "<think>\nLook a up.\n</think>\n\n" + call_text("lookup", {"word": "a"})
        ),
        push(engine, qwen_tokenizer, "<think>\nNow b.\n</think>\n\n" + call_text("lookup", {"word": "b"})),
        push(engine, qwen_tokenizer, "<think>\nDone.\n</think>\n\nBoth found."),
    ]
    messages: list[Any] = [{"role": "user", "content": "Define a and b."}]
    for turn in range(3):
        message = _turn(client, messages, streamed=turn == 1)
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        )
        uses = [b for b in message.content if b.type == "tool_use"]
        if uses:
            assert message.stop_reason == "tool_use"
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": u.id, "content": "found"} for u in uses
                    ],
                }
            )
    assert message.stop_reason == "end_turn"
    assert message.content[0].type == "thinking"
    assert message.content[-1].text == "Both found."
    [segment] = segments(proxy_url, "a-loop")
    assert segment["num_calls"] == 3
    assert_invariants(segment, engine.requests, outputs)


def test_a_signature_we_did_not_issue_opens_a_new_segment(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, request: pytest.FixtureRequest
) -> None:
    client = client_for(proxy_url, "a-forged")
    request.addfinalizer(client.close)
    push(engine, qwen_tokenizer, "<think>\nHm.\n</think>\n\n" + call_text("lookup", {"word": "a"}))
    first = _turn(client, [{"role": "user", "content": "Define a."}], streamed=False)
    blocks = [b.model_dump(exclude_none=True) for b in first.content]
    blocks[0]["signature"] = "not-ours"
    tool_use = first.content[1]
    messages: list[Any] = [
        {"role": "user", "content": "Define a."},
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "x"}]},
    ]
    push(engine, qwen_tokenizer, "ok")
    _turn(client, messages, streamed=False)
    assert len(segments(proxy_url, "a-forged")) == 2


def test_errors_come_in_anthropics_shape(proxy_url: str) -> None:
    url = f"{proxy_url}/sessions/a-err/v1/messages"
    base: dict[str, Any] = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    for body in (
        {"model": "m", "messages": []},
        {**base, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
        {**base, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
        {**base, "frequency_penalty": 1},
        {**base, "messages": [*base["messages"], {"role": "assistant", "content": "Sure,"}]},
    ):
        answer = httpx.post(url, json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "invalid_request_error"
    with client_for(proxy_url, "a-err") as client, pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=16, messages=[], metadata={})


def test_keys_are_read_from_x_api_key(start_proxy: Any) -> None:
    with start_proxy(api_key="harness") as url:
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        refused = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=30)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        accepted = httpx.post(
            f"{url}/v1/messages?beta=true",
            json=body,
            headers={"x-api-key": "harness", "anthropic-version": "2023-06-01", "anthropic-beta": "x"},
            timeout=30,
        )
        assert accepted.status_code == 200, accepted.text


def test_count_tokens_is_the_rendered_prompt(proxy_url: str, engine: FakeSGLang) -> None:
    body: Any = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    with client_for(proxy_url, "a-count") as client:
        counted = client.messages.count_tokens(**body)
        message = client.messages.create(max_tokens=8, **body)
    assert counted.input_tokens == message.usage.input_tokens
    assert len(engine.requests[-1]["input_ids"]) == counted.input_tokens


def test_a_stop_sequence_ends_the_turn_and_is_named(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.push(qwen_tokenizer.encode("abc STOP def").ids)
    with client_for(proxy_url, "a-stop") as client:
        message = client.messages.create(
            model="m",
            max_tokens=64,
            messages=[{"role": "user", "content": "go"}],
            stop_sequences=["STOP"],
            extra_body={"top_k": 5},
        )
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "STOP"
    [block] = message.content
    assert block.type == "text"
    assert block.text == "abc "  # the text before the stop sequence, as chat's stop strings
    assert engine.requests[-1]["sampling_params"]["top_k"] == 5


def test_count_tokens_counts_what_messages_renders_with_every_template_field(tmp_path: Path) -> None:
    """Every field that reaches the template counts: gpt-oss's template writes
    `output_config.effort` as its reasoning effort (and `thinking` off changes nothing there)."""
    directory = build_tokenizer_dir(FAMILIES["gpt_oss"], tmp_path / "gpt-oss")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    stops = Renderer(load_tokenizer_files(directory)).stop_token_ids
    engine = FakeSGLang(tokenizer=tokenizer, eos_ids=stops, vocab_size=tokenizer.get_vocab_size())
    base: Any = {"model": "m", "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}
    with serve(engine.app()) as engine_url:
        settings = Settings(engine_url=engine_url, tokenizer=directory, db=f"sqlite:///{tmp_path / 'c.db'}")
        with serve(create_app(settings)) as url:
            for extra in (
                {},
                {"output_config": {"effort": "max"}},
                {"tools": TOOLS, "thinking": {"type": "disabled"}, "output_config": {"effort": "low"}},
            ):
                body = {**base, **extra}
                counted = httpx.post(f"{url}/v1/messages/count_tokens", json=body, timeout=30)
                assert counted.status_code == 200, counted.text
                sent = httpx.post(f"{url}/v1/messages", json={**body, "max_tokens": 4}, timeout=30)
                assert sent.status_code == 200, sent.text
                assert counted.json()["input_tokens"] == len(engine.requests[-1]["input_ids"]), extra
    assert not engine.crashed


# Qwen3's template with a line in front that prints the date as "March 3, 2021": its day has one
# digit or two, so the number of its tokens changes with the day (Qwen's vocabulary splits digits;
# the real templates print the day with two digits, as long on every day).
_DATE_LINE = (
    "<|im_start|>system\nToday is {{ strftime_now('%B') }} {{ strftime_now('%d') | int }}, "
    "{{ strftime_now('%Y') }}.<|im_end|>\n"
)


def _date_text(day: datetime) -> str:
    return f"{day:%B} {day.day}, {day:%Y}"


def _a_day_counted_otherwise(tokenizer: Tokenizer) -> datetime:
    """A day whose date line has another number of tokens than today's: counted with today's date,
    its prompt would have another length than the one its turn sends."""

    def length(day: datetime) -> int:
        return len(tokenizer.encode(_date_text(day)).ids)

    today = length(datetime.now())
    return next(day for day in (datetime(2021, 3, 3, 10), datetime(2021, 3, 23, 10)) if length(day) != today)


def test_count_tokens_in_a_session_renders_the_sessions_pinned_date(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    directory = build_tokenizer_dir(FAMILIES["qwen3"], tmp_path / "dated")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = _DATE_LINE + config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    pinned = _a_day_counted_otherwise(qwen_tokenizer)
    db = tmp_path / "dated.db"
    body: Any = {"model": "m", "system": "Be brief.", "messages": [{"role": "user", "content": "date?"}]}
    engine.push(
        [*qwen_tokenizer.encode("<think>\nplan\n</think>\n\nIt is today.").ids, im_end(qwen_tokenizer)]
    )
    with start_proxy(tokenizer=directory, db=db) as url:
        # A session whose date was pinned another day (as by a turn it ran then), without calls yet.
        with sqlite3.connect(db) as connection:
            connection.execute(
                "insert into sessions (id, status, created_at, updated_at, template_now) values "
                "('dated', 'active', ?, ?, ?)",
                (str(pinned), str(pinned), str(pinned)),
            )
        by_path = httpx.post(f"{url}/sessions/dated/v1/messages/count_tokens", json=body, timeout=30)
        by_header = httpx.post(
            f"{url}/v1/messages/count_tokens", json=body, headers={"x-session-id": "dated"}, timeout=30
        )
        sent = httpx.post(f"{url}/sessions/dated/v1/messages", json={**body, "max_tokens": 64}, timeout=30)
        assert sent.status_code == 200, sent.text
        [segment] = segments(url, "dated")
        # The next turn continues the recorded one (its sampled reasoning kept, which a fresh render
        # of Qwen3's would drop): counted as that turn is sent.
        body["messages"] += [
            {"role": "assistant", "content": sent.json()["content"]},
            {"role": "user", "content": "and tomorrow?"},
        ]
        counted = httpx.post(f"{url}/sessions/dated/v1/messages/count_tokens", json=body, timeout=30)
        again = httpx.post(f"{url}/sessions/dated/v1/messages", json={**body, "max_tokens": 8}, timeout=30)
        assert again.status_code == 200, again.text
        assert [s["num_calls"] for s in segments(url, "dated")] == [2]
    assert counted.json()["input_tokens"] == len(engine.requests[-1]["input_ids"])
    prompt = engine.requests[0]["input_ids"]
    assert _date_text(pinned) in qwen_tokenizer.decode(prompt, skip_special_tokens=False)
    assert by_path.status_code == by_header.status_code == 200, (by_path.text, by_header.text)
    assert by_path.json()["input_tokens"] == by_header.json()["input_tokens"] == len(prompt)
    assert len(segment["prompt_ids"]) == len(prompt) == sent.json()["usage"]["input_tokens"]
    # The export's fresh render, too, prints the session's date and not today's.
    assert "date_changed" not in segment["drift"]["counts"], segment["drift"]


def im_end(tokenizer: Tokenizer) -> int:
    found = tokenizer.token_to_id("<|im_end|>")
    assert found is not None
    return int(found)


def test_count_tokens_counts_a_prompt_past_the_context(start_proxy: ProxyFactory) -> None:
    """The turn would be refused (400 context_length_exceeded); the count still says how long."""
    body: Any = {"model": "m", "messages": [{"role": "user", "content": "word " * 100}]}
    with start_proxy(context_length=64) as url:
        counted = httpx.post(f"{url}/sessions/long/v1/messages/count_tokens", json=body, timeout=30)
        refused = httpx.post(f"{url}/sessions/long/v1/messages", json={**body, "max_tokens": 4}, timeout=30)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > 100
    assert refused.status_code == 400, refused.text


def test_a_resent_history_edited_before_its_end_is_converted_anew(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, request: pytest.FixtureRequest
) -> None:
    """The proxy keeps a session's last converted messages (proxy/dialects/converted_history.py): a
    history that goes on is converted from its new messages, one edited anywhere before is not."""
    client = client_for(proxy_url, "a-edited")
    request.addfinalizer(client.close)
    messages: list[Any] = [{"role": "user", "content": "Define a."}]
    for word in ("a", "b"):
        push(engine, qwen_tokenizer, "<think>\nLook.\n</think>\n\n" + call_text("lookup", {"word": word}))
        message = _turn(client, messages, streamed=False)
        use = next(b for b in message.content if b.type == "tool_use")
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": f"{word}=1"}],
            },
        ]
    assert len(segments(proxy_url, "a-edited")) == 1
    messages[2]["content"][0]["content"] = "a=2"  # the first tool result, edited
    push(engine, qwen_tokenizer, "Done.")
    _turn(client, messages, streamed=False)
    sent = qwen_tokenizer.decode(engine.requests[-1]["input_ids"], skip_special_tokens=False)
    assert "a=2" in sent
    assert "a=1" not in sent
    assert "b=1" in sent
    assert len(segments(proxy_url, "a-edited")) == 2


def test_claude_codes_moving_cache_marker_and_system_shapes_keep_one_exact_segment(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, request: pytest.FixtureRequest
) -> None:
    """As Claude Code sends its history: the cache marker on the newest message only (taken off the
    one before), and a mid-conversation system message as blocks on one turn and as a string on the
    next. The proxy converts only what changed (proxy/dialects/converted_history.py); the record is
    one segment whose every token is the one sampled or rendered."""
    client = client_for(proxy_url, "a-moving")
    request.addfinalizer(client.close)
    marker: Any = {"type": "ephemeral"}
    outputs = [
        push(engine, qwen_tokenizer, "<think>\nLook.\n</think>\n\n" + call_text("lookup", {"word": w}))
        for w in ("a", "b")
    ]
    outputs.append(push(engine, qwen_tokenizer, "<think>\nDone.\n</think>\n\nBoth found."))
    note = "Reminder: be brief."
    history: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "Define a and b."}]}]
    for turn in range(3):
        *blocks, newest = history[-1]["content"]
        shown = [*history[:-1], {**history[-1], "content": [*blocks, {**newest, "cache_control": marker}]}]
        shown.insert(1, {"role": "system", "content": [{"type": "text", "text": note}] if turn % 2 else note})
        message = _turn(client, shown, streamed=False)
        history.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        )
        uses = [b for b in message.content if b.type == "tool_use"]
        if uses:
            history.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "found"}],
                }
            )
    [segment] = segments(proxy_url, "a-moving")
    assert segment["num_calls"] == 3
    assert_invariants(segment, engine.requests, outputs)


@pytest.mark.parametrize("streamed", [False, True])
def test_omitted_thinking_is_left_out_and_its_echo_continues_the_segment(
    proxy_url: str,
    engine: FakeSGLang,
    qwen_tokenizer: Tokenizer,
    request: pytest.FixtureRequest,
    streamed: bool,
) -> None:
    """thinking.display "omitted": the answer's thinking block is empty and its signature carries the
    reasoning, so the echoed block continues the turn exactly as the full one would."""
    session = f"a-omitted-{streamed}"
    client = client_for(proxy_url, session)
    request.addfinalizer(client.close)
    outputs = [
        push(
            engine, qwen_tokenizer, "<think>\nSecret plan.\n</think>\n\n" + call_text("lookup", {"word": "a"})
        ),
        push(engine, qwen_tokenizer, "<think>\nDone.\n</think>\n\nFound."),
    ]
    arguments: Any = {
        "model": "m",
        "max_tokens": 2048,
        "tools": TOOLS,
        "thinking": {**THINKING, "display": "omitted"},
    }
    messages: list[Any] = [{"role": "user", "content": "Define a."}]
    deltas: list[str] = []
    if streamed:
        with client.messages.stream(messages=messages, **arguments) as stream:
            deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
            first = stream.get_final_message()
    else:
        first = client.messages.create(messages=messages, **arguments)
    thinking = first.content[0]
    assert thinking.type == "thinking"
    assert thinking.thinking == ""
    assert thinking.signature
    assert "Secret plan" not in first.model_dump_json()
    if streamed:
        assert "thinking_delta" not in deltas
        assert "signature_delta" in deltas
    use = first.content[1]
    assert use.type == "tool_use"
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "found"}]},
    ]
    client.messages.create(messages=messages, **arguments)
    [segment] = segments(proxy_url, session)
    assert segment["num_calls"] == 2
    assert_invariants(segment, engine.requests[-2:], outputs)


def test_count_tokens_refuses_what_messages_refuses_beyond_the_conversation(
    start_proxy: ProxyFactory,
) -> None:
    """The same model rule (404 under --strict-model-names), the same fields and types; a count is
    never streamed. The sampling fields of a Messages request are checked, not counted."""
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with start_proxy(strict_model_names=True, served_model_name="m") as url:
        count = f"{url}/v1/messages/count_tokens"
        assert httpx.post(count, json=base).status_code == 200
        assert httpx.post(count, json={**base, "max_tokens": 64, "temperature": 0.5}).status_code == 200
        unknown = httpx.post(count, json={**base, "model": "claude-sonnet-4-5"})
        assert unknown.status_code == 404, unknown.text
        assert unknown.json()["error"]["type"] == "not_found_error"
        for change in ({"foo": 1}, {"max_tokens": "x"}, {"temperature": 5}, {"stream": True}):
            refused = httpx.post(count, json={**base, **change})
            assert refused.status_code == 400, (change, refused.text)
            assert refused.json()["error"]["type"] == "invalid_request_error"
