"""Tool-calling conversations over HTTP for the families whose calls were lost or refused (issue 12
items 1, 3, 4, 9): DeepSeek's call is in the next prompt, Mistral's sampled ids make the round trip,
Llama 3.1's sampled <|eom_id|> closes the turn, and the chosen tool parser is reported."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from proxy.app import create_app
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.config import Settings
from tests.fakes.sglang import FakeSGLang
from tests.families import FAMILIES, MISTRAL_NEMO_FAMILY, Family, build_tokenizer_dir
from tests.invariants import assert_invariants
from tests.support import serve

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# A ChatML template whose calls no parser reads: `<call:NAME>ARGS</call>`.
UNKNOWN_FORMAT = """
{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.tool_calls %}
{%- for c in m.tool_calls %}<call:{{ c.function.name }}>{{ c.function.arguments | tojson }}</call>{% endfor %}
{%- else %}
{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@contextmanager
def _proxy(
    directory: Path, db: Path, *, stop_ids: tuple[str, ...] = ()
) -> Iterator[tuple[str, FakeSGLang, Renderer]]:
    """The proxy on `directory`'s template before a fake engine that stops only on `stop_ids` and
    on whatever the proxy tells it to stop on."""
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    renderer = Renderer(load_tokenizer_files(directory))
    ids = tuple(i for text in stop_ids if (i := renderer.token_id(text)) is not None)
    fake = FakeSGLang(
        tokenizer=tokenizer,
        eos_ids=ids or renderer.stop_token_ids,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
    )
    with serve(fake.app()) as engine_url:
        settings = Settings(engine_url=engine_url, tokenizer=directory, db=f"sqlite:///{db}")
        with serve(create_app(settings)) as url:
            yield url, fake, renderer
    assert not fake.crashed


def _family_dir(family: Family, tmp_path: Path) -> Path:
    return build_tokenizer_dir(family, tmp_path / family.name)


def _post(url: str, session: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": messages, "max_tokens": 200, "tools": TOOLS, **extra}
    response = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def _find(haystack: list[int], needle: list[int]) -> int:
    return next(
        (i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle), -1
    )


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_r1"])
def test_deepseek_next_prompt_holds_the_model_tool_call(name: str, tmp_path: Path) -> None:
    with _proxy(_family_dir(FAMILIES[name], tmp_path), tmp_path / "d.db") as (url, engine, renderer):
        call = (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        )
        # The generation prompt opened `<think>\n`; the model closes it, then calls.
        engine.push(renderer.encode("</think>\n\n" + call))
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Weather in Tokyo?"},
        ]
        choice = _post(url, "ds", messages)
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert message["content"] is None
        (tool_call,) = message["tool_calls"]
        assert json.loads(tool_call["function"]["arguments"]) == {"city": "Tokyo"}
        # The harness echoes the message as an OpenAI client does (content null), then the result.
        messages += [message, {"role": "tool", "tool_call_id": tool_call["id"], "content": "Sunny, 21 C"}]
        engine.push(renderer.encode("</think>\n\nIt is sunny.<｜end▁of▁sentence｜>"))
        _post(url, "ds", messages)
        second = engine.requests[1]["input_ids"]
        text = renderer.decode(second)
        assert "<｜Assistant｜><｜tool▁calls▁begin｜>" in text, text
        # The call the model sampled is in the next prompt, token for token, before the result.
        sampled_call = renderer.encode(call.partition("<｜tool▁call▁end｜>")[0] + "<｜tool▁call▁end｜>")
        at = _find(second, sampled_call)
        assert at >= 0, text
        assert at < _find(second, renderer.encode("Sunny, 21 C"))


@pytest.fixture
def mistral(tmp_path: Path) -> Iterator[tuple[str, FakeSGLang, Renderer]]:
    with _proxy(_family_dir(MISTRAL_NEMO_FAMILY, tmp_path), tmp_path / "m.db") as found:
        yield found


def test_mistral_tool_round_trip_keeps_the_sampled_id(mistral: tuple[str, FakeSGLang, Renderer]) -> None:
    url, engine, renderer = mistral
    outputs = [
        engine.push(
            renderer.encode(
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]</s>'
            )
        )
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    message = _post(url, "mi", messages)["message"]
    assert [c["id"] for c in message["tool_calls"]] == ["a1B2c3D4e"]
    messages += [message, {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "Sunny"}]
    outputs.append(engine.push(renderer.encode("It is sunny in Paris.</s>")))
    answer = _post(url, "mi", messages)["message"]
    assert answer["content"] == "It is sunny in Paris."
    # The tool result continued the segment: the prompt extends the first prompt + the call.
    first = engine.requests[0]["input_ids"] + outputs[0].ids
    assert engine.requests[1]["input_ids"][: len(first)] == first
    # A user message moves the system prompt in Mistral's template: a fresh render, with the id.
    messages += [answer, {"role": "user", "content": "And tomorrow?"}]
    outputs.append(engine.push(renderer.encode("Rain tomorrow.</s>")))
    assert _post(url, "mi", messages)["message"]["content"] == "Rain tomorrow."
    assert '"id": "a1B2c3D4e"' in renderer.decode(engine.requests[2]["input_ids"])
    segments = httpx.get(f"{url}/sessions/mi/trajectory").json()["segments"]
    assert [s["num_calls"] for s in segments] == [2, 1]
    for segment in segments:
        calls = [c - 1 for c in segment["call_ids"]]
        assert_invariants(segment, [engine.requests[c] for c in calls], [outputs[c] for c in calls])
        assert segment["drift"]["unclassified"] == 0, segment["drift"]
    report = httpx.get(f"{url}/v1/template").json()
    assert report["tool_parser"]["name"] == "mistral"
    assert report["tool_parser"]["matches_template"] is True
    assert report["appends"]["tool"]["continues"] is True


def test_mistral_call_sampled_without_an_id_gets_one_the_template_takes(
    mistral: tuple[str, FakeSGLang, Renderer],
) -> None:
    url, engine, renderer = mistral
    engine.push(renderer.encode('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]</s>'))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    message = _post(url, "mi2", messages)["message"]
    (call,) = message["tool_calls"]
    assert len(call["id"]) == 9
    assert call["id"].isalnum()
    messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "Snow"}]
    engine.push(renderer.encode("Snow in Oslo.</s>"))
    assert _post(url, "mi2", messages)["message"]["content"] == "Snow in Oslo."


def test_llama_eom_closes_the_call_turn_without_a_synthesized_eot(tmp_path: Path) -> None:
    directory = _family_dir(FAMILIES["llama3_1"], tmp_path)
    # The engine stops on <|eom_id|> only if the proxy asks it to.
    with _proxy(directory, tmp_path / "l.db", stop_ids=("<|eot_id|>",)) as (url, engine, renderer):
        eom, eot = renderer.token_id("<|eom_id|>"), renderer.token_id("<|eot_id|>")
        outputs = [
            engine.push(renderer.encode('{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>'))
        ]
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Weather in Paris?"},
        ]
        choice = _post(url, "ll", messages)
        assert eom in engine.requests[0]["sampling_params"]["stop_token_ids"]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        messages += [
            message,
            {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "Sunny"},
        ]
        outputs.append(engine.push(renderer.encode("It is sunny.<|eot_id|>")))
        _post(url, "ll", messages)
        first = engine.requests[0]["input_ids"] + outputs[0].ids
        second = engine.requests[1]["input_ids"]
        assert first[-1] == eom
        assert second[: len(first)] == first  # the sampled <|eom_id|> is kept ...
        assert second[len(first)] != eot  # ... and nothing is synthesized after it
        assert renderer.decode(second[len(first) :]).startswith("<|start_header_id|>ipython")
        (segment,) = httpx.get(f"{url}/sessions/ll/trajectory").json()["segments"]
        assert_invariants(segment, engine.requests[:2], outputs)
        # Named at its response position, on the call that continued after it.
        position = len(first) - 1 - len(segment["prompt_ids"])
        assert segment["boundary_edits"] == [
            {
                "kind": "stop_token_rewrite",
                "position": position,
                "sampled": eom,
                "rendered": eot,
                "call_id": 2,
            }
        ]
        kinds = [d["kind"] for d in segment["drift"]["differences"]]
        assert "truncation_close_synthesized" not in kinds
        assert segment["drift"]["unclassified"] == 0, segment["drift"]


def _unknown_format_dir(tmp_path: Path) -> Path:
    directory = build_tokenizer_dir(FAMILIES["qwen2_5"], tmp_path / "unknown")
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": UNKNOWN_FORMAT}))
    return directory


def test_unknown_call_format_is_warned_at_start_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tito_proxy")
    with _proxy(_unknown_format_dir(tmp_path), tmp_path / "u.db") as (url, _, _):
        report = httpx.get(f"{url}/v1/template").json()["tool_parser"]
    assert report["name"] == "hermes"
    assert report["matches_template"] is False
    assert "<call:get_probe_value>" in report["template_call"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("tool calls:" in w and "does not read" in w for w in warnings), warnings
    started = [r.getMessage() for r in caplog.records if "template self-test" in r.getMessage()]
    assert started
    assert "tool parser hermes" in started[0]


def test_check_template_reports_the_tool_parser(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check-template", "--tokenizer", str(_unknown_format_dir(tmp_path))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(result.stdout)["tool_parser"]
    assert report["matches_template"] is False
    assert "warning: tool calls:" in result.stderr
