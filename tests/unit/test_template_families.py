"""Every fixture family: our renders equal transformers' apply_chat_template, and the self-test's
verdict is what the family's template really does (chat-templates.md section 3)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from tests.families import FAMILIES, Family, build_tokenizer_dir

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_tokenizer_dir(family, root / name) for name, family in FAMILIES.items()}


def _conversations(family: Family) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    chats: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
        ([{"role": "user", "content": "Hi there"}], None),
        (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": " spaced \n"},
                {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": "Again? ünï 🌍"},
            ],
            None,
        ),
    ]
    if family.tools:
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
        chats.append(
            (
                [
                    {"role": "system", "content": "Use tools."},
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
                ],
                [WEATHER_TOOL],
            )
        )
    return chats


def _arguments_as(message: dict[str, Any], form: str) -> dict[str, Any]:
    """The reference gets arguments in the form the template needs (DeepSeek concatenates text)."""
    if form == "object" or not message.get("tool_calls"):
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_first_prompt_render_equals_apply_chat_template(name: str, family_dirs: dict[str, Path]) -> None:
    family = FAMILIES[name]
    renderer = Renderer(load_tokenizer_files(family_dirs[name]))
    hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(family_dirs[name]))
    now = datetime.now()
    for messages, tools in _conversations(family):
        ours = renderer.render_prompt(messages, tools=tools, template_kwargs=None, now=now)
        reference = [_arguments_as(m, renderer.arguments_as) for m in messages]
        theirs = hf.apply_chat_template(
            reference,
            tools=tools,  # type: ignore[arg-type]
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert ours == theirs, f"{name}: {renderer.decode(ours)!r}"
        if family.bos:
            bos = renderer.token_id(family.bos)
            assert ours.count(bos) <= 1, "never a second BOS"  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_self_test_verdict_matches_the_family(name: str, family_dirs: dict[str, Path]) -> None:
    family = FAMILIES[name]
    verdict = Renderer(load_tokenizer_files(family_dirs[name])).verdict
    assert verdict.close_tokens, f"{name}: no close token found"
    assert verdict.continues("user") == family.user_appends_continue, verdict.appends["user"].reason
    assert verdict.continues("system") == family.system_appends_continue, verdict.appends["system"].reason
    if family.tools:
        assert verdict.continues("tool") == family.tool_appends_continue, verdict.appends["tool"].reason


def test_family_specific_facts(family_dirs: dict[str, Path]) -> None:
    def verdict(name: str) -> Any:
        return Renderer(load_tokenizer_files(family_dirs[name])).verdict

    qwen = verdict("qwen2_5")
    assert qwen.separator == "\n"
    assert qwen.close_tokens == {"<|im_end|>"}
    llama = verdict("llama3_1")
    assert llama.separator == ""
    assert llama.template_emits_bos
    assert verdict("llama3_2").date_dependent
    glm = verdict("glm4_moe")
    assert glm.opener_close
    assert glm.close_by_append["tool"] == "<|observation|>"
    assert glm.close_by_append["user"] == "<|user|>"
    oss = verdict("gpt_oss")
    assert oss.last_turn_close == "<|return|>"
    assert oss.close_by_append["user"] == "<|end|>"
    assert verdict("deepseek_v3").arguments_as == "string"
