"""What a Messages (or count_tokens) request must hold beyond its fields' types: Anthropic's own
rules, which its API answers with a 400, and the fields this proxy cannot honour."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.api.schemas import refuse_unsupported
from proxy.errors import InvalidRequest, UnsupportedParameter

THINKING_TYPES = (None, "enabled", "disabled", "adaptive", "between_tools")
# "summarized" returns the thinking (the sampled reasoning, which this proxy returns whole);
# "omitted" leaves it out and carries it in the signature.
THINKING_DISPLAYS = (None, "summarized", "omitted")
THINKING_KEYS = frozenset({"type", "budget_tokens", "display"})
EFFORTS = ("low", "medium", "high", "xhigh", "max")
_CHOICES: dict[str, tuple[str, ...]] = {
    "service_tier": ("auto", "standard_only"),
    "speed": ("standard", "fast"),
}
TOOL_CHOICE_KEYS = frozenset({"type", "name", "disable_parallel_tool_use"})


# Anthropic's floor for an enabled thinking budget (its API answers a smaller one with a 400).
MIN_THINKING_BUDGET = 1024
# With this beta, a budget counts across a whole turn's thinking blocks and may exceed max_tokens.
INTERLEAVED_THINKING_BETA = "interleaved-thinking-"


def check_keys(value: dict[str, Any], known: frozenset[str], param: str) -> None:
    """Anthropic's refusal of a key its types do not hold, at any depth."""
    for key in value:
        if key not in known:
            raise InvalidRequest(f"{param}.{key}: Extra inputs are not permitted", param=f"{param}.{key}")


def check_thinking(
    thinking: dict[str, Any] | None, max_tokens: int | None = None, beta: str | None = None
) -> None:
    """`thinking`: a known type and display; an enabled one has an integer budget of at least 1,024
    tokens, below `max_tokens` unless the `anthropic-beta` header asks for interleaved thinking, as
    Anthropic's API requires. The budget itself is a soft target (at Anthropic too): it is checked
    and recorded, and the template's thinking is not cut at it."""
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise UnsupportedParameter(f"unknown thinking type {kind!r}", param="thinking.type")
    for key in thinking:
        if key not in THINKING_KEYS or (key == "budget_tokens" and kind == "disabled"):
            raise InvalidRequest(
                f"thinking.{kind}.{key}: Extra inputs are not permitted", param=f"thinking.{key}"
            )
    if thinking.get("display") not in THINKING_DISPLAYS:
        raise InvalidRequest("thinking.display is 'summarized' or 'omitted'", param="thinking.display")
    budget = thinking.get("budget_tokens")
    if budget is None:
        if kind == "enabled":
            raise InvalidRequest(
                "thinking.enabled.budget_tokens: Field required", param="thinking.budget_tokens"
            )
        return
    if type(budget) is not int:
        raise InvalidRequest("thinking.budget_tokens must be an integer", param="thinking.budget_tokens")
    if budget < MIN_THINKING_BUDGET:
        raise InvalidRequest(
            f"thinking.budget_tokens: Input should be greater than or equal to {MIN_THINKING_BUDGET}",
            param="thinking.budget_tokens",
        )
    interleaved = INTERLEAVED_THINKING_BETA in (beta or "")
    if kind == "enabled" and max_tokens is not None and budget >= max_tokens and not interleaved:
        raise InvalidRequest(
            "`max_tokens` must be greater than `thinking.budget_tokens` (or send the"
            " interleaved-thinking beta, under which the budget spans the whole turn)",
            param="max_tokens",
        )


def thinking_omitted(thinking: dict[str, Any] | None) -> bool:
    return (thinking or {}).get("display") == "omitted"


def check_inert_values(extras: dict[str, Any] | None) -> None:
    """The fields accepted as inert (they change nothing sampled) hold values of Anthropic's types."""
    fields = extras or {}
    for name, choices in _CHOICES.items():
        if fields.get(name) is not None and fields[name] not in choices:
            raise InvalidRequest(f"{name}: Input should be {', '.join(map(repr, choices))}", param=name)
    if fields.get("inference_geo") is not None and not isinstance(fields["inference_geo"], str):
        raise InvalidRequest("inference_geo: Input should be a valid string", param="inference_geo")


def check_metadata(extras: dict[str, Any] | None) -> None:
    """`metadata` holds `user_id` (a string, or null) and nothing else."""
    metadata = (extras or {}).get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object", param="metadata")
    for key, value in metadata.items():
        if key != "user_id":
            raise InvalidRequest(f"metadata.{key}: only user_id is allowed", param=f"metadata.{key}")
        if value is not None and not isinstance(value, str):
            raise InvalidRequest("metadata.user_id must be a string", param="metadata.user_id")


def check_output_config(output_config: dict[str, Any] | None) -> None:
    config = output_config or {}
    if set(config) - {"effort", "format"}:
        raise UnsupportedParameter("output_config supports effort and format", param="output_config")
    if config.get("effort") is not None and config["effort"] not in EFFORTS:
        raise InvalidRequest(
            f"output_config.effort: Input should be {', '.join(map(repr, EFFORTS))}",
            param="output_config.effort",
        )
    found = config.get("format")
    if found is None:
        return
    if not isinstance(found, dict):
        raise InvalidRequest("output_config.format must be an object", param="output_config.format")
    if found.get("type") != "json_schema":
        raise UnsupportedParameter("output_config.format must be json_schema", param="output_config.format")
    if not isinstance(found.get("schema"), dict):
        raise InvalidRequest(
            "output_config.format of type json_schema needs its schema (an object)",
            param="output_config.format.schema",
        )


def check_fields(
    extras: dict[str, Any] | None,
    inert: frozenset[str],
    *,
    context_management: dict[str, Any] | None,
    output_config: dict[str, Any] | None,
    thinking: dict[str, Any] | None,
    max_tokens: int | None,
    beta: str | None,
) -> None:
    """The checks a Messages request and a count_tokens request share: fields this proxy cannot
    honour (all but the declared and `inert` ones), then each field's own rules."""
    refuse_unsupported(extras, inert)
    check_inert_values(extras)
    check_metadata(extras)
    check_context_management(context_management)
    check_output_config(output_config)
    check_thinking(thinking, max_tokens, beta)


def check_context_management(context_management: dict[str, Any] | None) -> None:
    edits = (context_management or {}).get("edits") or []
    if not isinstance(edits, list) or not all(isinstance(edit, dict) for edit in edits):
        raise InvalidRequest("context_management.edits must be a list of objects", param="context_management")
    for edit in edits:
        # Edits that keep everything change nothing; others would rewrite the history server-side.
        if edit.get("keep") != "all":
            raise UnsupportedParameter(
                f"context edit {edit.get('type')!r} would drop history; only keep: all",
                param="context_management",
            )


def _partner(messages: list[dict[str, Any]], index: int, step: int) -> int | None:
    """The message before (step -1) or after (+1) `index`, system messages passed over (Claude Code
    puts them mid-conversation)."""
    index += step
    while 0 <= index < len(messages):
        if messages[index].get("role") != "system":
            return index
        index += step
    return None


def _blocks_of(message: dict[str, Any], role: str, kind: str) -> list[dict[str, Any]]:
    content = message.get("content")
    if message.get("role") != role or not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == kind]


# The tool_use ids of an assistant message, or the tool_use_ids of a user message's results.
IdsOf = Callable[[dict[str, Any]], list[Any]]


def _uses(message: dict[str, Any]) -> list[Any]:
    return [block.get("id") for block in _blocks_of(message, "assistant", "tool_use")]


def _results(message: dict[str, Any]) -> list[Any]:
    return [block.get("tool_use_id") for block in _blocks_of(message, "user", "tool_result")]


def _unmatched(
    messages: list[dict[str, Any]], index: int, own: IdsOf, partners: IdsOf, step: int
) -> list[Any]:
    """The ids `own` finds in the message at `index` that `partners` does not find in its partner
    message (the one after, step 1, or before, step -1)."""
    ids = own(messages[index])
    if not ids:
        return []
    partner = _partner(messages, index, step)
    matched = set(partners(messages[partner])) if partner is not None else set()
    return [i for i in ids if i not in matched]


def check_tool_pairs(messages: list[dict[str, Any]], changed: list[int]) -> None:
    """Each tool_use is answered by a tool_result in the next message, and each tool_result answers a
    tool_use of the message before, as Anthropic's API requires. Checked around the messages
    `changed`: the others, sent the very same at the same places, were checked when first sent."""
    around: set[int] = set()
    for index in changed:
        around.add(index)
        around.update(
            i for i in (_partner(messages, index, -1), _partner(messages, index, 1)) if i is not None
        )
    for index in sorted(around):
        missing = _unmatched(messages, index, _uses, _results, 1)
        if missing:
            raise InvalidRequest(
                f"messages.{index}: tool_use ids were found without tool_result blocks immediately "
                f"after: {', '.join(map(str, missing))}. Each tool_use block must have a "
                "corresponding tool_result block in the next message.",
                param=f"messages[{index}].content",
            )
        unexpected = _unmatched(messages, index, _results, _uses, -1)
        if unexpected:
            raise InvalidRequest(
                f"messages.{index}.content: unexpected tool_use_id found in tool_result blocks: "
                f"{', '.join(map(str, unexpected))}. Each tool_result block must have a "
                "corresponding tool_use block in the previous message.",
                param=f"messages[{index}].content",
            )
