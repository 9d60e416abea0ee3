"""A first prompt sent again is rendered once (proxy/chat/first_prompts.py): the same ids as a fresh
render, keys that tell apart every input a template could tell apart, the date in the key only where
the template reads it, no cache for a template that draws random values, and bounded memory. The
templates' tojson keeps its dumps the same way (proxy/chat/tojson.py)."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.chat.first_prompts import FirstPrompts
from proxy.chat.renderer import Renderer
from proxy.chat.template import ChatTemplate
from proxy.chat.tojson import CachedToJson
from proxy.chat.tokenizer import load_tokenizer_files

DUMP = "{{ messages | tojson }}|{{ tools | tojson }}|{{ flag | tojson }}|{{ add_generation_prompt }}"
DATED = "{{ strftime_now('%Y-%m-%d') }} {{ messages[0].content }}"
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]


def _key(memo: FirstPrompts, messages: list[dict[str, Any]], **inputs: Any) -> bytes | None:
    return memo.key(
        messages,
        tools=inputs.get("tools"),
        template_kwargs=inputs.get("template_kwargs"),
        add_generation_prompt=inputs.get("add_generation_prompt", True),
        now=inputs.get("now"),
        shape=("object", "empty"),
    )


def test_a_repeated_first_prompt_is_rendered_once_to_the_same_ids(qwen_dir: Path) -> None:
    renderer = Renderer(load_tokenizer_files(qwen_dir))
    messages = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Fix it."}]
    now = datetime(2026, 1, 2)
    first = renderer.render_prompt(messages, tools=TOOLS, template_kwargs=None, now=now)
    entries, _ = renderer.first_prompts.cached()
    again = renderer.render_prompt(messages, tools=TOOLS, template_kwargs=None, now=now)
    assert renderer.first_prompts.cached()[0] == entries, "the second render came from the cache"
    text = renderer.render_text(messages, tools=TOOLS, add_generation_prompt=True, now=now)
    assert first == again == renderer.plain_encode(text)
    other = renderer.render_prompt(messages, tools=None, template_kwargs=None, now=now)
    assert other != first
    history = [*messages, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "More."}]
    entries, _ = renderer.first_prompts.cached()
    renderer.render_prompt(history, tools=TOOLS, template_kwargs=None, now=now)
    assert renderer.first_prompts.cached()[0] == entries, "a history rendered afresh is not kept"


# Pairs of inputs a template renders differently: each must have its own key.
VARIANTS: list[dict[str, Any]] = [
    {"flag": 1},
    {"flag": 1.0},
    {"flag": True},
    {"flag": None},
    {"flag": math.nan},
    {"flag": -0.0},
    {"flag": 0.0},
    {"flag": "1"},
    {"flag": [1, 2]},
    {"flag": {"a": 1, "b": 2}},
    {"flag": {"b": 2, "a": 1}},
]


def test_inputs_a_template_tells_apart_have_different_keys() -> None:
    template = ChatTemplate(DUMP, {})
    memo = FirstPrompts(pure=template.pure, reads_date=template.reads_date)
    messages = [{"role": "user", "content": "hi"}]
    seen: dict[bytes, str] = {}
    for kwargs in VARIANTS:
        for tools in (None, TOOLS, [{**TOOLS[0], "extra": 1}]):
            for add_generation_prompt in (True, False):
                text = template.render(
                    messages, tools=tools, template_kwargs=kwargs, add_generation_prompt=add_generation_prompt
                )
                key = _key(
                    memo,
                    messages,
                    tools=tools,
                    template_kwargs=kwargs,
                    add_generation_prompt=add_generation_prompt,
                )
                assert key is not None
                assert seen.setdefault(key, text) == text, "one key, two texts"
    assert len(set(seen.values())) == len(seen)


def test_the_date_is_in_the_key_only_where_the_template_reads_it() -> None:
    dated = ChatTemplate(DATED, {})
    memo = FirstPrompts(pure=dated.pure, reads_date=dated.reads_date)
    messages = [{"role": "user", "content": "hi"}]
    assert _key(memo, messages, now=None) is None, "an unpinned date is read from the clock"
    assert _key(memo, messages, now=datetime(2026, 1, 1)) != _key(memo, messages, now=datetime(2026, 1, 2))
    plain = ChatTemplate("{{ messages[0].content }}", {})
    undated = FirstPrompts(pure=plain.pure, reads_date=plain.reads_date)
    assert _key(undated, messages, now=datetime(2026, 1, 1)) == _key(
        undated, messages, now=datetime(2026, 1, 2)
    )


@pytest.mark.parametrize("source", ["{{ [1, 2, 3] | random }}", "{{ lipsum(1) }}"])
def test_a_template_that_draws_random_values_is_never_cached(source: str) -> None:
    template = ChatTemplate(source, {})
    assert not template.pure
    memo = FirstPrompts(pure=template.pure, reads_date=template.reads_date)
    assert _key(memo, [{"role": "user", "content": "hi"}]) is None


def test_the_cache_is_bounded_by_entries_and_characters() -> None:
    memo = FirstPrompts(pure=True, reads_date=False, max_entries=50, max_chars=20_000)
    for n in range(500):
        key = _key(memo, [{"role": "user", "content": f"task {n}"}])
        assert key is not None
        memo.put(key, "x" * 300)
        entries, chars = memo.cached()
        assert entries <= 50
        assert chars <= 20_000
    newest = _key(memo, [{"role": "user", "content": "task 499"}])
    oldest = _key(memo, [{"role": "user", "content": "task 0"}])
    assert newest is not None
    assert oldest is not None
    assert memo.get(newest) == "x" * 300
    assert memo.get(oldest) is None
    large = _key(memo, [{"role": "user", "content": "large"}])
    assert large is not None
    memo.put(large, "x" * 5_000)
    assert memo.get(large) is None, "an entry over an eighth of the bound is not kept"


def _with_ascii_default(options: dict[str, Any]) -> dict[str, Any]:
    """json.dumps' arguments as the filter's defaults give them (ensure_ascii off, as transformers)."""
    return {"ensure_ascii": False, **options}


def test_cached_tojson_dumps_as_json_dumps_does_and_tells_values_apart() -> None:
    dumps = CachedToJson()
    values: list[Any] = [
        *(v["flag"] for v in VARIANTS),
        [1, 1.0, True, None, math.nan, "é", {"k": [math.inf, -0.0]}],
        {"a": "é 漢字", "b": {"c": [1, 2.5]}},
        {1: "int key"},
        {True: "bool key"},
        {"1": "str key"},
    ]
    for _ in range(2):  # cold, then from the cache
        for value in values:
            options: dict[str, Any]
            for options in (
                {},
                {"ensure_ascii": True},
                {"indent": 2},
                {"sort_keys": True},
                {"separators": (",", ":")},
            ):
                assert dumps(value, **options) == json.dumps(value, **_with_ascii_default(options))
    assert dumps.cached()[0] > 0


def test_cached_tojson_is_bounded() -> None:
    dumps = CachedToJson(max_entries=20, max_chars=10_000)
    for n in range(300):
        assert dumps({"n": n, "text": "x" * 100}) == json.dumps({"n": n, "text": "x" * 100})
        entries, chars = dumps.cached()
        assert entries <= 20
        assert chars <= 10_000
    large = {"text": "x" * 2_000}
    assert dumps(large) == json.dumps(large)
    assert dumps.cached()[0] <= 20
