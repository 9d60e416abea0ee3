"""A multi-turn conversation per template family through the proxy over HTTP.

The fake engine "samples" what the family's own template writes for each assistant turn, so every
family answers in its real format. Each segment must satisfy I1-I6, appends the self-test did not
prove safe must open new segments, and the drift report must explain every difference.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from proxy.app import create_app
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.config import Settings
from tests.fakes.sglang import FakeSGLang
from tests.fakes.vllm import FakeVLLM
from tests.families import FAMILIES, Family, build_tokenizer_dir
from tests.invariants import assert_invariants
from tests.support import serve

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _sampled_text(
    renderer: Renderer,
    messages: list[dict[str, Any]],
    reply: dict[str, Any],
    tools: list[dict[str, Any]] | None,
    follower: str,
) -> str:
    """The text a model of this family samples for `reply`, close token included."""
    prompt = renderer.render_text(messages, tools=tools, add_generation_prompt=True)
    full = renderer.render_text([*messages, reply], tools=tools)
    verdict = renderer.verdict
    stops = [renderer.decode([i]) for i in renderer.stop_token_ids]
    opened = ""
    if not full.startswith(prompt) and messages[0]["role"] == "system":
        # Mistral-Nemo writes the system prompt only into a user message that is last: the model's
        # reply is what the template writes for the same turn without it.
        bare = messages[1:]
        bare_prompt = renderer.render_text(bare, tools=tools, add_generation_prompt=True)
        if renderer.render_text([*bare, reply], tools=tools).startswith(bare_prompt):
            return _sampled_text(renderer, bare, reply, tools, follower)
    if not full.startswith(prompt):
        # The generation prompt opens reasoning that the history render strips (DeepSeek, Nemotron):
        # the model closes the reasoning, then writes what the render shows for the turn.
        assert prompt.endswith("<think>\n"), (prompt[-80:], full[-80:])
        prompt = prompt.removesuffix("<think>\n")
        assert full.startswith(prompt)
        opened = f"{reply.get('reasoning_content', '')}\n</think>\n\n"
    text = full[len(prompt) :]
    if opened and text.startswith("<think>"):
        # The render writes its own think block for this turn: continue it after the prompt's opener.
        opened, text = "", text.removeprefix("<think>")
    ends = [at + len(stop) for stop in stops if (at := text.find(stop)) >= 0]
    if ends:
        return opened + text[: min(ends)]
    # GLM: the turn is ended by sampling the next message's opener.
    closer = verdict.close_by_append[follower]
    assert closer is not None
    return opened + text.rstrip("\n") + closer


def _turns(family: Family) -> list[tuple[dict[str, Any], str, list[dict[str, Any]]]]:
    """(assistant reply to sample, kind of message that follows, messages the harness appends)."""
    call = {
        "id": "call_x",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    answer = {
        "role": "assistant",
        "content": "It is sunny in Paris.",
        "reasoning_content": "The tool said sunny.",
    }
    if family.tools:
        tool_turn = {"role": "assistant", "content": "", "tool_calls": [call]}
        return [
            (tool_turn, "tool", [{"role": "tool", "content": "Sunny, 21 C"}]),
            (answer, "user", [{"role": "user", "content": "And tomorrow?"}]),
            ({"role": "assistant", "content": "Rain tomorrow."}, "user", []),
        ]
    return [
        (answer, "user", [{"role": "user", "content": "And tomorrow?"}]),
        ({"role": "assistant", "content": "Rain tomorrow."}, "user", [{"role": "user", "content": "Thanks"}]),
        ({"role": "assistant", "content": "You are welcome."}, "user", []),
    ]


@pytest.fixture(scope="module")
def family_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("family-conversations")


@pytest.fixture
def family_proxy(
    request: pytest.FixtureRequest, family_root: Path, tmp_path: Path
) -> Iterator[tuple[str, FakeSGLang, Renderer]]:
    """The proxy on the SGLang stand-in; `family@vllm` puts it on the vLLM stand-in instead."""
    name, _, engine_kind = str(request.param).partition("@")
    family = FAMILIES[name]
    directory = build_tokenizer_dir(family, family_root / family.name)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    renderer = Renderer(load_tokenizer_files(directory))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    fake: Any
    if engine_kind == "vllm":
        fake = FakeVLLM(tokenizer=tokenizer, eos_ids=renderer.stop_token_ids, vocab_size=vocab_size)
    else:
        fake = FakeSGLang(tokenizer=tokenizer, eos_ids=renderer.stop_token_ids, vocab_size=vocab_size)
    with serve(fake.app()) as engine_url:
        settings = Settings(
            engine=engine_kind or "sglang",
            engine_url=engine_url,
            tokenizer=directory,
            db=f"sqlite:///{tmp_path / 'f.db'}",
        )
        with serve(create_app(settings)) as url:
            yield url, fake, renderer
    if engine_kind == "vllm":
        assert fake.ignored == [], "a sampling key vLLM does not know was sent (vLLM drops it silently)"
    else:
        assert not fake.crashed


@pytest.mark.parametrize(
    "family_proxy", [*sorted(FAMILIES), "qwen3@vllm", "llama3_1@vllm", "gpt_oss@vllm"], indirect=True
)
def test_family_conversation_keeps_every_sampled_token(
    family_proxy: tuple[str, FakeSGLang, Renderer],
) -> None:
    url, engine, renderer = family_proxy
    name = next(n for n, f in FAMILIES.items() if renderer.files.directory.name == n)
    family = FAMILIES[name]
    tools = TOOLS if family.tools else None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    if family.name == "gemma3":
        messages = messages[1:]  # Gemma folds a system prompt into the first user turn; keep it simple
    outputs = []
    expected_segments = 1
    for reply, follower, appended in _turns(family):
        text = _sampled_text(renderer, messages, reply, tools, follower)
        outputs.append(engine.push(renderer.encode(text)))
        body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 300}
        if tools:
            body["tools"] = tools
        response = httpx.post(f"{url}/sessions/fam/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        message.pop("reasoning_content", None)  # as most OpenAI clients do
        if reply.get("tool_calls"):
            assert message.get("tool_calls"), f"{name}: no tool call parsed from {text!r}"
        else:
            assert message["content"].strip() == reply["content"], f"{name}: {text!r}"
        messages.append(message)
        for extra in appended:
            answer_to = {"tool_call_id": message["tool_calls"][0]["id"]} if extra["role"] == "tool" else {}
            messages.append({**extra, **answer_to})
        if appended and not renderer.verdict.continues(appended[0]["role"]):
            expected_segments += 1
    trajectory = httpx.get(f"{url}/sessions/fam/trajectory").json()
    segments = trajectory["segments"]
    assert len(segments) == expected_segments, [s["num_calls"] for s in segments]
    for segment in segments:
        calls = [c - 1 for c in segment["call_ids"]]
        assert_invariants(segment, [engine.requests[c] for c in calls], [outputs[c] for c in calls])
        drift = segment["drift"]
        assert drift["unclassified"] == 0, (name, drift["differences"])


@pytest.mark.parametrize("family_proxy", ["glm4_moe"], indirect=True)
def test_glm_turn_ended_by_another_opener_than_what_follows_splits(
    family_proxy: tuple[str, FakeSGLang, Renderer],
) -> None:
    url, engine, renderer = family_proxy
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    # The model ends its turn by sampling <|user|>, but the harness sends a tool result.
    engine.push(renderer.encode("\n<think></think>\nLet me check.<|user|>"))
    reply = httpx.post(
        f"{url}/sessions/glm/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=30
    ).json()["choices"][0]["message"]
    assert reply["content"] == "Let me check."
    messages += [reply, {"role": "user", "content": "Go on"}]
    engine.push(renderer.encode("\n<think></think>\nDone.<|user|>"))
    httpx.post(
        f"{url}/sessions/glm/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=30
    )
    # The sampled <|user|> opens the next message itself: kept once, not duplicated, one segment.
    second = engine.requests[1]["input_ids"]
    user_id = renderer.token_id("<|user|>")
    assert second[: len(engine.requests[0]["input_ids"])] == engine.requests[0]["input_ids"]
    tail = renderer.decode(second[len(engine.requests[0]["input_ids"]) :])
    assert tail.count("<|user|>") == 1
    assert second.count(user_id) == 2  # the first prompt's and the sampled one
    # "Done." ended with <|user|>, but a tool result follows: the sampled opener does not fit, so
    # the proxy renders afresh instead of writing <|user|><|observation|>.
    messages += [{"role": "assistant", "content": "Done."}, {"role": "tool", "content": "x"}]
    httpx.post(
        f"{url}/sessions/glm/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=30
    )
    segments = httpx.get(f"{url}/sessions/glm/trajectory").json()["segments"]
    assert [s["num_calls"] for s in segments] == [2, 1]


@pytest.mark.parametrize("family_proxy", ["glm4_moe"], indirect=True)
def test_glm_string_arguments_are_kept_as_written(family_proxy: tuple[str, FakeSGLang, Renderer]) -> None:
    """XML call formats write every value as text: an argument the tool's schema types as a string
    keeps its text (vLLM's glm45 parser does so), others are read as JSON where they parse."""
    url, engine, renderer = family_proxy
    properties = {"city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"}}
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"properties": properties}}}
    ]
    call = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>null</arg_value>\n"
        "<arg_key>zip</arg_key>\n<arg_value>01.50</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    engine.push(renderer.encode(f"\n<think></think>\n{call}<|observation|>"))
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": tools}
    reply = httpx.post(f"{url}/sessions/glm-args/v1/chat/completions", json=body, timeout=30).json()
    [tool_call] = reply["choices"][0]["message"]["tool_calls"]
    assert orjson.loads(tool_call["function"]["arguments"]) == {"city": "null", "zip": "01.50", "days": 3}


EMPTY_TURNS = [
    # (family, what the engine samples before max_tokens cuts it: nothing, or a partial opener)
    ("gpt_oss", ""),
    ("gpt_oss", "<|channel|>"),
    ("glm4_moe", ""),
    ("glm4_moe", "\n<think>"),
    ("deepseek_r1", ""),
    ("qwen3", ""),
    ("qwen3", "<think>"),
    ("qwen2_5", ""),
]


@pytest.mark.parametrize(
    ("family_proxy", "sampled"),
    EMPTY_TURNS,
    indirect=["family_proxy"],
    ids=[f"{f}-{s!r}" for f, s in EMPTY_TURNS],
)
def test_an_empty_turn_continued_is_what_a_render_of_an_empty_reply_gives(
    family_proxy: tuple[str, FakeSGLang, Renderer], sampled: str
) -> None:
    """A turn cut before it said anything, then a user message: the next prompt is what the template
    writes for an empty assistant reply (continuing, or in a new segment), never a close synthesized
    right after the generation prompt or after a dangling opener."""
    url, engine, renderer = family_proxy
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    ids = renderer.encode(sampled)
    # Nothing at all (the engine ends the turn with no token), or a partial opener cut by max_tokens.
    engine.push([*ids, *renderer.encode(" and more")] if ids else [])
    body = {"model": "m", "messages": messages, "max_tokens": len(ids) or 5}
    first = httpx.post(f"{url}/sessions/empty/v1/chat/completions", json=body, timeout=30).json()
    assert first["choices"][0]["finish_reason"] == "length"
    message = first["choices"][0]["message"]
    assert not message.get("content")
    assert not message.get("tool_calls")
    messages += [message, {"role": "user", "content": "Go on"}]
    answer = {"role": "assistant", "content": "Sure."}
    engine.push(renderer.encode(_sampled_text(renderer, messages, answer, None, "user")))
    response = httpx.post(
        f"{url}/sessions/empty/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=30
    )
    assert response.status_code == 200, response.text
    fresh = renderer.render_prompt(messages, tools=None, template_kwargs=None, now=datetime.now())
    assert renderer.decode(engine.requests[1]["input_ids"]) == renderer.decode(fresh)
    assert engine.requests[1]["input_ids"] == fresh
    # The segment the second turn belongs to explains every difference from a render.
    last = httpx.get(f"{url}/sessions/empty/trajectory").json()["segments"][-1]
    assert last["drift"]["unclassified"] == 0, last["drift"]


@pytest.mark.parametrize("family_proxy", ["gpt_oss"], indirect=True)
def test_gpt_oss_reasoning_tokens_are_its_analysis_messages(
    family_proxy: tuple[str, FakeSGLang, Renderer],
) -> None:
    """gpt-oss closes no `</think>`: its reasoning is the analysis channel, counted whole (header and
    end included) in a Responses usage, whether the turn ends normally or is cut in its analysis."""
    url, engine, renderer = family_proxy
    analysis = "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    final = "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
    engine.push(renderer.encode(analysis + final))
    body = {"model": "m", "input": "Hi"}
    usage = httpx.post(f"{url}/sessions/oss/v1/responses", json=body, timeout=30).json()["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == len(renderer.encode(analysis))
    assert usage["output_tokens"] == len(renderer.encode(analysis + final))
    engine.push(renderer.encode(analysis + final))
    cut = httpx.post(
        f"{url}/sessions/oss-cut/v1/responses", json={**body, "max_output_tokens": 6}, timeout=30
    )
    assert cut.json()["usage"]["output_tokens_details"]["reasoning_tokens"] == 6


@pytest.mark.parametrize("family_proxy", ["deepseek_v3"], indirect=True)
def test_deepseek_v3_tool_calls_in_a_row_have_no_unclassified_drift(
    family_proxy: tuple[str, FakeSGLang, Renderer],
) -> None:
    """After a tool result the generation prompt closes the outputs block and the model opens its
    calls; a fresh render of that turn writes neither (DeepSeek V3's template opens calls once, and
    leaves the outputs block open): repeated_opener_dropped, not unclassified."""
    url, engine, renderer = family_proxy
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"  # noqa: RUF001
        '{"city": "%s"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'  # noqa: RUF001
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in two cities?"}]
    # The first generation prompt opens reasoning (closed at once); one after a tool result does not.
    for opened, city in (("\n</think>\n\n", "Paris"), ("", "London")):
        engine.push(renderer.encode(opened + call % city))
        body = {"model": "m", "messages": messages, "tools": tools}
        reply = httpx.post(f"{url}/sessions/ds/v1/chat/completions", json=body, timeout=30).json()
        message = reply["choices"][0]["message"]
        assert message.get("tool_calls"), reply
        messages += [
            message,
            {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "Sunny"},
        ]
    httpx.post(f"{url}/sessions/ds/finish").raise_for_status()
    rows = httpx.get(f"{url}/export", params={"session_ids": "ds"}).text.splitlines()
    kinds = [d["kind"] for row in rows for d in orjson.loads(row)["drift"]["differences"]]
    assert "unclassified" not in kinds, kinds
    assert "repeated_opener_dropped" in kinds, kinds


@pytest.mark.parametrize("family_proxy", ["llama3_1"], indirect=True)
def test_a_llama_call_sampled_after_python_tag_is_canonicalization(
    family_proxy: tuple[str, FakeSGLang, Renderer],
) -> None:
    """Llama 3.1 may open a JSON call with `<|python_tag|>` (vLLM's llama3_json reads it), which the
    template does not write back for such a call: the assistant's own sampled token, not structure."""
    url, engine, renderer = family_proxy
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    call = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
    for sampled in (call, "Sunny in Paris.<|eot_id|>"):
        engine.push(renderer.encode(sampled))
        body = {"model": "m", "messages": messages, "tools": tools}
        message = httpx.post(f"{url}/sessions/py/v1/chat/completions", json=body, timeout=30).json()
        messages.append(message["choices"][0]["message"])
        if messages[-1].get("tool_calls"):
            messages.append(
                {"role": "tool", "tool_call_id": messages[-1]["tool_calls"][0]["id"], "content": "Sunny"}
            )
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    httpx.post(f"{url}/sessions/py/finish").raise_for_status()
    rows = httpx.get(f"{url}/export", params={"session_ids": "py"}).text.splitlines()
    kinds = [d["kind"] for row in rows for d in orjson.loads(row)["drift"]["differences"]]
    assert "unclassified" not in kinds, kinds
    assert "assistant_canonicalization" in kinds, kinds
    # The same marker before text, answered as text: the harness's history lacks it where the model
    # sampled it, which no template canonicalization explains.
    engine.push(renderer.encode("<|python_tag|>Sunny in Paris.<|eot_id|>"))
    first = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"model": "m", "messages": first, "tools": tools}
    text = httpx.post(f"{url}/sessions/py-text/v1/chat/completions", json=body, timeout=30).json()
    assert not text["choices"][0]["message"].get("tool_calls")
    httpx.post(f"{url}/sessions/py-text/finish").raise_for_status()
    rows = httpx.get(f"{url}/export", params={"session_ids": "py-text"}).text.splitlines()
    assert "unclassified" in [d["kind"] for row in rows for d in orjson.loads(row)["drift"]["differences"]]
