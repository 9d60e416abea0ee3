"""The short delta render (proxy/chat/short_context.py) gives exactly today's ids on every family, and a
template whose appended text reads the dropped context is detected and keeps the full render."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.chat.messages import Message
from proxy.chat.renderer import Delta, DeltaUnavailable, Renderer
from proxy.chat.template import ChatTemplate
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.demo_model import copy_qwen_tokenizer
from proxy.errors import TemplateError
from tests.families import FAMILIES, build_tokenizer_dir

NOW = datetime(2026, 3, 4, 5, 6)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "read_file")
]
CALL_IDS = ("call00001", "call00002")

texts = st.lists(
    st.one_of(
        st.sampled_from(
            ["\n", " ", "\n\n", "é", "漢字", "🌍", "12", "<tool_response>", "</tool_response>", "'s"]
        ),
        st.text(max_size=8),
    ),
    min_size=1,
    max_size=6,
).map("".join)


@st.composite
def turns(
    draw: st.DrawFn,
) -> tuple[Message, list[Message], list[dict[str, Any]] | None, dict[str, Any] | None]:
    """A previous assistant turn (text, reasoning, calls), the messages appended after it, tools, kwargs."""
    previous: Message = {"role": "assistant", "content": draw(st.one_of(st.none(), texts))}
    if draw(st.booleans()):
        previous["reasoning_content"] = draw(texts)
    calls = draw(st.integers(0, 2))
    if calls:
        previous["tool_calls"] = [
            {
                "id": CALL_IDS[n],
                "type": "function",
                "function": {"name": TOOLS[n]["function"]["name"], "arguments": json.dumps({"arg": f"v{n}"})},
            }
            for n in range(calls)
        ]
    elif not previous["content"]:
        previous["content"] = "fine"
    appended: list[Message] = []
    for n, role in enumerate(
        draw(st.lists(st.sampled_from(["user", "tool", "system"]), min_size=1, max_size=3))
    ):
        message: Message = {"role": role, "content": draw(texts)}
        if role == "tool":
            message["tool_call_id"] = CALL_IDS[n % max(calls, 1)]
        appended.append(message)
    tools = draw(st.sampled_from([None, TOOLS[:1], TOOLS]))
    kwargs = draw(st.sampled_from([None, {"enable_thinking": False}]))
    return previous, appended, tools, kwargs


def _reference(directory: Path) -> Renderer:
    """Today's path: the full fixed-base render, through Jinja's own sandbox."""
    renderer = Renderer(load_tokenizer_files(directory))
    renderer.short_context = None
    renderer.template = ChatTemplate(
        renderer.files.chat_template, renderer.files.special_tokens, sandbox=ImmutableSandboxedEnvironment
    )
    return renderer


def _outcome(renderer: Renderer, previous: Message, appended: list[Message], tools: Any, kwargs: Any) -> Any:
    if not all(renderer.verdict.continues(m["role"]) for m in appended):
        return "not continued"  # planning renders no delta for these
    try:
        delta: Delta = renderer.render_delta(previous, appended, tools=tools, template_kwargs=kwargs, now=NOW)
    except (DeltaUnavailable, TemplateError) as exc:
        return type(exc).__name__
    return delta.ids, delta.close


_RENDERERS: dict[str, tuple[Renderer, Renderer]] = {}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Renderer, Renderer]]:
    root = tmp_path_factory.mktemp("short-context")
    for name, family in FAMILIES.items():
        directory = build_tokenizer_dir(family, root / name)
        _RENDERERS[name] = (Renderer(load_tokenizer_files(directory)), _reference(directory))
    return _RENDERERS


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_real_templates_are_proven(name: str, pairs: dict[str, tuple[Renderer, Renderer]]) -> None:
    short = pairs[name][0].short_context
    assert short is not None
    assert short.proven, short.reason
    reported = pairs[name][0].verdict.as_json()["short_delta"]  # as GET /v1/template shows it
    assert reported["proven"] is True
    assert set(reported["base_roles"]) <= {"system", "user"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turn=turns())
def test_short_render_gives_todays_ids(
    name: str,
    pairs: dict[str, tuple[Renderer, Renderer]],
    turn: tuple[Message, list[Message], list[dict[str, Any]] | None, dict[str, Any] | None],
) -> None:
    renderer, reference = pairs[name]
    previous, appended, tools, kwargs = turn
    expected = _outcome(reference, previous, appended, tools, kwargs)
    # The first request of a shape decides it; the next ones take the short render when proven.
    for _ in range(2):
        assert _outcome(renderer, previous, appended, tools, kwargs) == expected


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turn=turns(), system=st.one_of(st.none(), texts))
def test_full_renders_equal_jinjas_own_sandbox(
    name: str,
    pairs: dict[str, tuple[Renderer, Renderer]],
    turn: tuple[Message, list[Message], list[dict[str, Any]] | None, dict[str, Any] | None],
    system: str | None,
) -> None:
    """The sandbox's shortcuts (proxy/chat/template.py) change no text, on whole conversations."""
    renderer, reference = pairs[name]
    previous, appended, tools, kwargs = turn
    opening: list[Message] = [{"role": "system", "content": system}] if system is not None else []
    conversation = [*opening, {"role": "user", "content": "Go."}, previous, *appended]
    outcomes = []
    for each in (renderer, reference):
        try:
            outcomes.append(
                each.render_text(
                    conversation, tools=tools, add_generation_prompt=True, template_kwargs=kwargs, now=NOW
                )
            )
        except TemplateError as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes[0] == outcomes[1]


def test_a_proven_shape_takes_the_short_render(pairs: dict[str, tuple[Renderer, Renderer]]) -> None:
    renderer, _ = pairs["qwen3"]
    previous: Message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        ],
    }
    appended: list[Message] = [{"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    short = renderer.short_context
    assert short is not None
    shape = short.shape(previous, appended, TOOLS, None)
    first = renderer.render_delta(previous, appended, tools=TOOLS, template_kwargs=None, now=NOW)
    assert short.verdict(shape) is True
    seen = _RenderSpy(renderer.template)
    renderer.template = seen  # type: ignore[assignment]
    try:
        assert renderer.render_delta(previous, appended, tools=TOOLS, template_kwargs=None, now=NOW) == first
    finally:
        renderer.template = seen.template
    assert seen.renders == [(["assistant", "tool"], False)], (
        "one render: the stub and the tool result, no tools"
    )


def test_request_shapes_are_bounded(pairs: dict[str, tuple[Renderer, Renderer]]) -> None:
    renderer, _ = pairs["qwen2_5"]
    short = renderer.short_context
    assert short is not None
    previous: Message = {"role": "assistant", "content": "Done."}
    appended: list[Message] = [{"role": "user", "content": "More?"}]
    for n in range(1100):
        tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": f"version {n}"}}]
        renderer.render_delta(previous, appended, tools=tools, template_kwargs=None, now=NOW)
    assert short.shapes() <= 1024


class _RenderSpy:
    """A chat template that notes the roles and whether tools were given, for each render."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.renders: list[tuple[list[str], bool]] = []

    def render(self, messages: list[Message], **kwargs: Any) -> str:
        self.renders.append(([m["role"] for m in messages], kwargs.get("tools") is not None))
        return self.template.render(messages, **kwargs)


CHATML_HEAD = "{%- for message in messages %}"
CHATML_TAIL = """
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
# Each reads what the short render drops while writing an appended message.
READS_DROPPED = {
    # the message's position from the conversation's start
    "position": CHATML_HEAD + "{{- loop.index0 }}" + CHATML_TAIL,
    # the first message of the conversation
    "first_message": CHATML_HEAD + "{{- messages[0].role }}" + CHATML_TAIL,
    # the tool list, in the generation prompt
    "tools": CHATML_HEAD
    + CHATML_TAIL.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n' + (tools | length | string)"
    ),
    # reads later messages while rendering the first: counts the conversation's system messages up
    # front, and writes the count into every message after
    "scans_ahead": "{%- set ns = namespace(systems=0) %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.systems = ns.systems + 1 %}{%- endif %}"
    "{%- endfor %}" + CHATML_HEAD + "{{- ns.systems }}" + CHATML_TAIL,
}


def _with_template(directory: Path, template: str) -> Renderer:
    copy_qwen_tokenizer(directory)
    config = {"chat_template": template, "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Renderer(load_tokenizer_files(directory))


def test_plain_chatml_is_proven(tmp_path: Path) -> None:
    short = _with_template(tmp_path, CHATML_HEAD + CHATML_TAIL).short_context
    assert short is not None
    assert short.proven, short.reason


@pytest.mark.parametrize("kind", sorted(READS_DROPPED))
def test_a_template_reading_the_dropped_context_keeps_the_full_render(tmp_path: Path, kind: str) -> None:
    renderer = _with_template(tmp_path, READS_DROPPED[kind])
    short = renderer.short_context
    assert short is not None
    assert not short.proven
    if any(renderer.verdict.continues(kind) for kind in ("user", "tool", "system")):
        assert short.reason is not None
        assert "reads the fixed base or the tools" in short.reason
    previous: Message = {"role": "assistant", "content": "Done."}
    appended: list[Message] = [{"role": "user", "content": "More?"}]
    assert short.shape(previous, appended, TOOLS, None) is None
    assert renderer.verdict.as_json()["short_delta"] == {
        "proven": False,
        "base_roles": None,
        "reason": short.reason,
    }


def test_a_shape_the_start_up_proof_misses_is_refused_on_its_first_request(tmp_path: Path) -> None:
    """Proven at start-up (no kwargs there), but a kwarg makes the delta read the first message: the
    first request of that shape compares both renders and keeps the full one from then on."""
    template = CHATML_HEAD + CHATML_TAIL.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n' + (messages[0].role if flag else '')"
    )
    renderer = _with_template(tmp_path, template)
    reference = _reference(tmp_path)
    short = renderer.short_context
    assert short is not None
    assert short.proven, short.reason
    previous: Message = {"role": "assistant", "content": "Done."}
    appended: list[Message] = [{"role": "user", "content": "More?"}]
    kwargs = {"flag": True}
    expected = reference.render_delta(previous, appended, tools=None, template_kwargs=kwargs, now=NOW)
    for _ in range(3):
        delta = renderer.render_delta(previous, appended, tools=None, template_kwargs=kwargs, now=NOW)
        assert delta == expected
    assert short.verdict(short.shape(previous, appended, None, kwargs)) is False
