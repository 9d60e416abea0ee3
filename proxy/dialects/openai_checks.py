"""OpenAI's rules for request fields the proxy accepts without acting on them (they change nothing
sampled, yet OpenAI's API answers a wrong one with a 400), and for tool and schema names."""

from __future__ import annotations

import re
from typing import Any

from proxy.errors import InvalidRequest

# OpenAI's pattern for function and JSON-schema names.
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
_STRINGS = ("user", "prompt_cache_key", "safety_identifier")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_CHOICES: dict[str, tuple[str, ...]] = {
    "service_tier": ("auto", "default", "flex", "scale", "priority"),
    "prompt_cache_retention": ("in-memory", "24h"),
}


def check_inert_fields(extras: dict[str, Any] | None) -> None:
    """`user` and the cache and safety keys are strings, `store` a boolean, `service_tier` and
    `prompt_cache_retention` one of their values, `metadata` at most 16 string pairs (keys up to 64
    characters, values up to 512). Null is unset."""
    fields = extras or {}
    for name in _STRINGS:
        if fields.get(name) is not None and not isinstance(fields[name], str):
            raise InvalidRequest(f"{name} must be a string", param=name)
    if fields.get("store") is not None and type(fields["store"]) is not bool:
        raise InvalidRequest("store must be a boolean", param="store")
    for name, choices in _CHOICES.items():
        if fields.get(name) is not None and fields[name] not in choices:
            raise InvalidRequest(f"{name} must be one of {', '.join(choices)}", param=name)
    check_metadata(fields.get("metadata"))


def check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object of string values", param="metadata")
    if len(metadata) > METADATA_PAIRS:
        raise InvalidRequest(f"metadata holds at most {METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise InvalidRequest(
                f"metadata keys are at most {METADATA_KEY_CHARS} characters", param="metadata"
            )
        if not isinstance(value, str):
            raise InvalidRequest(f"metadata.{key} must be a string", param=f"metadata.{key}")
        if len(value) > METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"metadata values are at most {METADATA_VALUE_CHARS} characters", param=f"metadata.{key}"
            )


def check_name(name: Any, param: str, what: str = "a function") -> None:
    """A function's or JSON schema's name: letters, digits, underscores and dashes, 1 to 64."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest(f"{what}'s name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", param=param)


def check_function_fields(tool: dict[str, Any], param: str) -> None:
    """A function tool's name, and the types of its description and strict flag."""
    check_name(tool.get("name"), f"{param}.name")
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise InvalidRequest("a function's description must be a string", param=f"{param}.description")
    if tool.get("strict") is not None and type(tool["strict"]) is not bool:
        raise InvalidRequest("a function's strict must be a boolean", param=f"{param}.strict")
