"""Tool calls kept as the model made them (issue 12 items 1, 3, 4, 9): every family renders a
calls-only turn in the shape its template needs, Mistral's sampled call ids survive, Llama 3.1's
<|eom_id|> is a close, and the parser is checked against the template's own call format."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from proxy.chat.call_format import choose_parser
from proxy.chat.messages import for_template
from proxy.chat.parsing import OutputParser
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from tests.families import FAMILIES, MISTRAL_NEMO_FAMILY, Family, build_tokenizer_dir

# Every family whose template writes tool calls, DeepSeek R1-distill included.
CALLING = sorted(n for n, f in FAMILIES.items() if f.tools or n == "deepseek_r1")


@pytest.fixture(scope="module")
def renderers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Renderer]:
    root = tmp_path_factory.mktemp("tool-call-families")
    families: list[Family] = [*FAMILIES.values(), MISTRAL_NEMO_FAMILY]
    return {f.name: Renderer(load_tokenizer_files(build_tokenizer_dir(f, root / f.name))) for f in families}


def _calls_only(call_id: str = "a1B2c3D4e", content: Any = None) -> list[dict[str, Any]]:
    """A tool call as an OpenAI client echoes it: content null, arguments as a JSON string."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Tokyo"})},
    }
    return [
        {"role": "user", "content": "Weather in Tokyo?"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny"},
    ]


@pytest.mark.parametrize("name", CALLING)
@pytest.mark.parametrize("content", [None, ""])
def test_a_turn_that_only_called_a_tool_renders_its_call(
    name: str, content: Any, renderers: dict[str, Renderer]
) -> None:
    renderer = renderers[name]
    text = renderer.render_text(_calls_only(content=content), add_generation_prompt=True)
    assert "get_weather" in text, f"{name} dropped the call: {text!r}"
    assert text.count("Tokyo") == 2  # the question and the call's arguments
    assert "None" not in text
    if name.startswith("deepseek"):
        assert "<｜Assistant｜><｜tool▁calls▁begin｜>" in text


@pytest.mark.parametrize("name", CALLING)
def test_the_shaped_render_equals_transformers_jinja(name: str, renderers: dict[str, Renderer]) -> None:
    """Our Jinja environment renders the shaped messages as transformers' does (content none kept)."""
    renderer = renderers[name]
    shaped = [
        for_template(m, arguments_as=renderer.arguments_as, calls_only_content=renderer.calls_only_content)
        for m in _calls_only()
    ]
    special_tokens: dict[str, Any] = dict(renderer.files.special_tokens)
    theirs = render_jinja_template(
        conversations=[shaped],
        chat_template=renderer.files.chat_template,
        add_generation_prompt=True,
        **special_tokens,
    )
    assert renderer.render_text(_calls_only(), add_generation_prompt=True) == theirs[0][0]


def test_the_probe_finds_the_shape_deepseek_needs(renderers: dict[str, Renderer]) -> None:
    for name in ("deepseek_v3", "deepseek_r1"):
        verdict = renderers[name].verdict
        # Its templates concatenate arguments as text and render calls only when content is none.
        assert verdict.arguments_as == "string", name
        assert verdict.calls_only_content == "none", name
        assert verdict.renders_tool_calls
    # GLM prints a none content as "None": it gets "".
    assert renderers["glm4_moe"].verdict.calls_only_content == "empty"
    # R1-distill closes nothing after a lone call: its per-call end is no turn close nor a stop.
    r1 = renderers["deepseek_r1"].verdict
    assert "<｜tool▁call▁end｜>" not in r1.close_tokens | r1.sampled_stop_tokens


def test_mistral_keeps_the_sampled_call_ids() -> None:
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]'
    parsed = OutputParser("mistral", parse_reasoning=False).parse(text)
    assert [c["id"] for c in parsed.tool_calls] == ["a1B2c3D4e"]


def test_mistral_probe_uses_ids_its_template_accepts(renderers: dict[str, Renderer]) -> None:
    verdict = renderers["mistral_nemo"].verdict
    assert verdict.continues("tool"), verdict.appends["tool"].reason
    assert verdict.arguments_as == "object"  # the template writes `"arguments": {...}` with tojson
    assert verdict.call_id_style == "alphanumeric9"
    assert not verdict.continues("user")  # the system prompt moves to the last user message


def test_a_call_sampled_without_an_id_gets_one_the_template_accepts(renderers: dict[str, Renderer]) -> None:
    renderer = renderers["mistral_nemo"]
    parser, report = choose_parser(renderer)
    assert report.name == "mistral"
    assert report.matches_template
    (call,) = parser.parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]').tool_calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]), call["id"]
    messages = _calls_only(call_id=call["id"])
    messages[1]["tool_calls"] = [call]
    assert call["id"] in renderer.render_text(messages)  # and the template takes it back
    # Other families keep OpenAI-style ids.
    assert renderers["qwen3"].verdict.call_id_style == "openai"


def test_llama_3_1_eom_is_a_close_and_a_stop(renderers: dict[str, Renderer]) -> None:
    renderer = renderers["llama3_1"]
    verdict = renderer.verdict
    assert "<|eom_id|>" in verdict.close_tokens
    assert "<|eom_id|>" in verdict.sampled_stop_tokens
    assert "<|eom_id|>" in verdict.closes_by_following["tool"]  # a call followed by its result
    assert "<|eot_id|>" in verdict.closes_by_following["tool"]
    eom = renderer.token_id("<|eom_id|>")
    assert eom in renderer.stop_token_ids
    assert eom in renderer.close_token_ids
    # A template variable that changes nothing but the close adds no close elsewhere.
    assert renderers["qwen3"].verdict.close_tokens == {"<|im_end|>"}
    assert renderers["llama3_2"].verdict.close_tokens == {"<|eot_id|>"}


@pytest.mark.parametrize("name", sorted([*FAMILIES, "mistral_nemo"]))
def test_the_parser_reads_the_template_call_format(name: str, renderers: dict[str, Renderer]) -> None:
    _, report = choose_parser(renderers[name])
    if name in ("gemma3", "phi3"):
        assert report.matches_template is None
        assert report.warning
    else:
        assert report.matches_template, report.as_json()
        assert report.warning is None


# A ChatML template whose calls no parser reads: `<call:NAME>ARGS</call>`.
_UNKNOWN_FORMAT = """
{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.tool_calls %}
{%- for c in m.tool_calls %}<call:{{ c.function.name }}>{{ c.function.arguments | tojson }}</call>{% endfor %}
{%- else %}
{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_an_unknown_call_format_is_reported_not_silently_hermes(tmp_path: Path) -> None:
    directory = build_tokenizer_dir(FAMILIES["qwen2_5"], tmp_path / "unknown")
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": _UNKNOWN_FORMAT}))
    renderer = Renderer(load_tokenizer_files(directory))
    _, report = choose_parser(renderer)
    assert report.name == "hermes"
    assert report.chosen_by == "template"
    assert report.matches_template is False
    assert report.parsers_matching == []
    assert report.template_call is not None
    assert "<call:get_probe_value>" in report.template_call
    assert report.warning is not None
    assert "does not read" in report.warning
    # A parser named by flag is checked the same way.
    _, flagged = choose_parser(renderer, "mistral")
    assert flagged.chosen_by == "flag"
    assert flagged.matches_template is False
