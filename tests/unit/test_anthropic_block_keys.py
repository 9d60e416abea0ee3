"""The keys an Anthropic content block may hold are the ones the installed `anthropic` SDK's block
params declare: a harness echoing `block.model_dump()` sends every one of them."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from anthropic.types import (
    RedactedThinkingBlockParam,
    TextBlockParam,
    ThinkingBlockParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)

from proxy.dialects.anthropic_input import _BLOCK_KEYS, anthropic_messages
from proxy.dialects.seals import Sealer
from proxy.errors import InvalidRequest

PARAMS = {
    "text": TextBlockParam,
    "thinking": ThinkingBlockParam,
    "redacted_thinking": RedactedThinkingBlockParam,
    "tool_use": ToolUseBlockParam,
    "tool_result": ToolResultBlockParam,
}


@pytest.mark.parametrize("kind", PARAMS)
def test_a_block_takes_every_key_its_sdk_param_declares(kind: str) -> None:
    assert set(typing.get_type_hints(PARAMS[kind])) <= _BLOCK_KEYS[kind]


def test_an_echoed_tool_use_with_its_toolset_name_is_read() -> None:
    call: dict[str, Any] = {
        "type": "tool_use",
        "id": "t1",
        "name": "f",
        "input": {},
        "toolset_name": None,
        "caller": None,
    }
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "ok", "toolset_name": "files"}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    converted = anthropic_messages(None, messages, Sealer(None), None)
    assert [m["role"] for m in converted] == ["user", "assistant", "tool"]
    with pytest.raises(InvalidRequest):
        anthropic_messages(
            None,
            [*messages[:1], {"role": "assistant", "content": [{**call, "toolset_name": 5}]}],
            Sealer(None),
            None,
        )
