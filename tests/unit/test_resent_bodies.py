"""A chat body that starts with the very bytes of its session's last one is read from its new part
alone (proxy/api/message_prefix.py), and reads exactly as a full parse and validation would, whatever
the client's serializer, edits, duplicate or escaped keys, or malformed tails."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.api.message_prefix import MessagePrefixes
from proxy.api.schemas import ChatCompletionRequest

Serializer = Callable[[dict[str, Any]], bytes]

SERIALIZERS: dict[str, Serializer] = {
    "orjson": orjson.dumps,
    # What httpx's json= sends (the OpenAI and Anthropic SDKs' bodies).
    "httpx": lambda body: httpx.Request("POST", "http://proxy/", json=body).content,
    # httpx >= 0.28 and the OpenAI SDK: compact, non-ASCII as it is.
    "compact": lambda body: json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(),
    # requests' json= and the standard library's defaults.
    "spaced": lambda body: json.dumps(body).encode(),
}

texts = st.text(st.characters(codec="utf-8"), max_size=12)
message = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, texts),
    st.builds(lambda t: {"role": "assistant", "content": t}, texts),
    st.builds(lambda t: {"role": "tool", "tool_call_id": "c1", "content": t}, texts),
    st.just({"role": "user", "content": "messages"}),  # the key's name as a message's text
    st.just({"role": "user", "content": [{"type": "text", "text": "a"}]}),
    st.just({"role": "robot", "content": "x"}),  # invalid: FastAPI must answer it
)


def _full(raw: bytes) -> Any:
    """What FastAPI would be handed without the shortcut: the validated body, or the parsed JSON."""
    data = orjson.loads(raw)
    try:
        return ChatCompletionRequest.model_validate(data)
    except Exception:
        return data


def _same(read: Any, full: Any) -> None:
    if isinstance(full, ChatCompletionRequest):
        assert isinstance(read, ChatCompletionRequest)
        assert read.model_dump() == full.model_dump()
        assert read.model_fields_set == full.model_fields_set
        assert read.message_forms() == full.message_forms()
    else:
        assert read == full


@settings(max_examples=150, deadline=None)
@given(
    turns=st.lists(st.lists(message, min_size=1, max_size=3), min_size=1, max_size=6),
    serializer=st.sampled_from(sorted(SERIALIZERS)),
    edit_at=st.integers(min_value=-1, max_value=5),
)
def test_a_growing_conversation_reads_as_a_full_parse(
    turns: list[list[dict[str, Any]]], serializer: str, edit_at: int
) -> None:
    prefixes = MessagePrefixes()
    messages: list[dict[str, Any]] = []
    for index, added in enumerate(turns):
        if index == edit_at and messages:
            messages[0] = {**messages[0], "content": "edited"}  # history rewritten: not resent
        messages = [*messages, *added]
        raw = SERIALIZERS[serializer]({"model": "m", "messages": messages, "max_tokens": 8})
        _same(prefixes.read("s", raw), _full(raw))


def _bodies(after: bytes, before: bytes = b"") -> tuple[bytes, bytes]:
    """Two compact bodies of one session, the second resending the first's messages; `before` and
    `after` are top-level members written around the message list of the second."""
    first = b'{"model":"m",' + before + b'"messages":[{"role":"user","content":"a"}],"max_tokens":8}'
    resent = (
        b'[{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"}]'
    )
    second = b'{"model":"m",' + before + b'"messages":' + resent + b',"max_tokens":8' + after + b"}"
    return first, second


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (b"", b""),
        # Of duplicate keys a parser keeps the last: the resent list is not the one read.
        (b"", b',"messages":[{"role":"user","content":"z"},{"role":"user","content":"w"}]'),
        (b"", b',"m\\u0065ssages":[{"role":"user","content":"z"},{"role":"user","content":"w"}]'),
        (b'"m\\u0065ssages":[{"role":"user","content":"y"}],', b""),
        # A member before the list that holds a list of the same text, nested: the first found.
        (b'"metadata":{"messages":[{"role":"user","content":"a"}]},', b""),
        (b'"metadata":{"messages":[{"role":"user","content":"a"},{"role":"user","content":"q"}]},', b""),
    ],
)
def test_duplicate_escaped_or_nested_message_keys_read_as_a_full_parse(before: bytes, after: bytes) -> None:
    first, second = _bodies(after, before)
    prefixes = MessagePrefixes()
    _same(prefixes.read("s", first), _full(first))
    _same(prefixes.read("s", second), _full(second))


def test_a_malformed_tail_after_resent_messages_fails_as_a_full_parse() -> None:
    first, _ = _bodies(b"")
    prefixes = MessagePrefixes()
    prefixes.read("s", first)
    broken = first[: first.index(b"]")] + b',{"role":"user","content":"c"}, "max_tokens":8}'
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(broken)
    with pytest.raises(orjson.JSONDecodeError):
        prefixes.read("s", broken)


def test_a_resent_body_is_read_from_its_new_part_alone() -> None:
    """The shortcut is taken: the resent body's known messages are the very objects validated before."""
    first, second = _bodies(b"")
    prefixes = MessagePrefixes()
    known = prefixes.read("s", first)
    again = prefixes._resent("s", second)  # None: the body would be parsed whole
    assert isinstance(known, ChatCompletionRequest)
    assert isinstance(again, ChatCompletionRequest)
    assert again.messages[0] is known.messages[0]
    third = second[:-1].replace(b'"max_tokens":8', b'"max_tokens":9')
    third = third.replace(b'"content":"c"}]', b'"content":"c"},{"role":"assistant","content":"d"}]') + b"}"
    latest = prefixes.read("s", third)
    assert isinstance(latest, ChatCompletionRequest)
    assert latest.messages[:3] == again.messages
    assert latest.max_tokens == 9
    _same(latest, _full(third))


@pytest.mark.parametrize("serializer", ["orjson", "httpx", "compact"])
def test_compact_clients_take_the_shortcut(serializer: str) -> None:
    """Bodies as compact clients write them, non-ASCII text and escapes included, are read from
    their new part on every turn after the first."""
    prefixes = MessagePrefixes()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Agent. \u00e9\n\t\u001b[0m ✓"}]
    for turn in range(4):
        messages.append({"role": "user", "content": f'turn {turn}: «ok» "quoted"'})
        raw = SERIALIZERS[serializer]({"model": "m", "messages": messages, "max_tokens": 8})
        fast = prefixes._resent("s", raw) if turn else None
        read = fast if fast is not None else prefixes.read("s", raw)
        assert (fast is not None) == (turn > 0)
        _same(read, _full(raw))
        messages.append({"role": "assistant", "content": f"done {turn}"})
