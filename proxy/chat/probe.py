"""The start-up self-test of the served chat template.

Small probe conversations are rendered once to find out which special tokens close an assistant
turn (per kind of message that follows: GLM closes a turn with the next message's opener), the
separator after a close, BOS handling, whether the template reads the date, how a turn that only
called tools must be passed for its calls to be rendered (arguments as objects or text, content
none or ""), which call ids the template accepts, and, for user, tool and system appends,
whether the fixed-base delta equals what a full render puts after the last assistant turn in
several real contexts and holds the appended text. An append kind that is not proven safe starts a
new segment with a fresh render.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from proxy.chat.messages import CallsOnlyContent, Message
from proxy.chat.parsing import CallIdStyle
from proxy.errors import TemplateError

if TYPE_CHECKING:
    from proxy.chat.renderer import Renderer

AppendKind = Literal["user", "tool", "system"]
APPEND_KINDS: tuple[AppendKind, ...] = ("user", "tool", "system")
ANSWER = "Probe answer."
PROBE_FUNCTION = "get_probe_value"
# Nine alphanumerics: Mistral's templates refuse any other call id, and every template takes these.
PROBE_CALL_IDS = ("probe0000", "probe0001")
ARGUMENT_FORMS: tuple[Literal["object", "string"], ...] = ("object", "string")
CALLS_ONLY_CONTENTS: tuple[CallsOnlyContent, ...] = ("none", "empty", "absent")
_PINNED = datetime(2025, 1, 15, 12, 0)


@dataclass(frozen=True)
class AppendVerdict:
    continues: bool
    reason: str


@dataclass(frozen=True)
class TemplateVerdict:
    """What the probe proved about the served template; exposed at GET /v1/template."""

    arguments_as: Literal["object", "string"]
    close_by_append: dict[str, str | None]
    last_turn_close: str | None
    call_close: str | None
    opener_close: bool
    separator: str | None
    bos_token: str | None
    template_emits_bos: bool
    date_dependent: bool
    appends: dict[str, AppendVerdict]
    # The content an assistant turn that only called tools is rendered with: "none" (DeepSeek renders
    # calls only when content is none), "empty" or "absent".
    calls_only_content: CallsOnlyContent = "empty"
    renders_tool_calls: bool = False
    # The ids the template accepts for calls sampled without one: OpenAI's, or nine alphanumerics.
    call_id_style: CallIdStyle = "openai"
    # Every token that ends an assistant turn (a plain answer or a tool call), per kind of message
    # that follows ("end": the turn is last, what a model samples), including the ones a template
    # variable writes instead (Llama 3.1's <|eom_id|> after a call in ipython mode).
    closes_by_following: dict[str, list[str]] = field(default_factory=dict)
    # Whether the delta may be rendered without the fixed base and the tools (proxy/chat/short_context.py):
    # proven, the base messages kept, or why not. Set by the renderer after the probe.
    short_delta: dict[str, Any] = field(default_factory=dict)
    # Whether prompts are encoded chunk by chunk between added tokens, from a bounded cache
    # (proxy/chat/piece_cache.py): proven, or why the plain encode is kept. Set by the renderer.
    encode_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def close_tokens(self) -> frozenset[str]:
        """Every token that may end an assistant turn, in a render or in a sample."""
        found = {c for c in self.close_by_append.values() if c is not None}
        found.update(c for c in (self.last_turn_close, self.call_close) if c is not None)
        found.update(c for closes in self.closes_by_following.values() for c in closes)
        return frozenset(found)

    @property
    def sampled_stop_tokens(self) -> frozenset[str]:
        """Tokens a model samples to end its turn. Not every close seen in history: gpt-oss writes
        <|end|> after its analysis message in mid-turn."""
        found = {c for c in (self.last_turn_close, self.call_close) if c is not None}
        found.update(self.closes_by_following.get("end", ()))
        if self.opener_close or self.last_turn_close is None:
            # GLM: a turn ends by sampling the opener of the message that follows.
            found.update(c for c in self.close_by_append.values() if c is not None)
        return frozenset(found)

    def continues(self, kind: str) -> bool:
        verdict = self.appends.get(kind)
        return verdict is not None and verdict.continues

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "close_tokens": sorted(self.close_tokens),
            "sampled_stop_tokens": sorted(self.sampled_stop_tokens),
        }


def _tool_call(call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": PROBE_FUNCTION, "arguments": json.dumps({"key": ANSWER})},
    }


def conversation(*, system: bool, tool_cycle: bool, call: bool, calls_only: bool = False) -> list[Message]:
    """A probe conversation ending with an assistant turn that holds ANSWER (in its content, or in
    its call's arguments when `calls_only`: the turn only called a tool, as models mostly do)."""
    messages: list[Message] = []
    if system:
        messages.append({"role": "system", "content": "Probe system prompt."})
    messages.append({"role": "user", "content": "Probe question?"})
    if tool_cycle:
        messages.append(
            {"role": "assistant", "content": "Probe earlier.", "tool_calls": [_tool_call(PROBE_CALL_IDS[0])]}
        )
        messages.append(
            {"role": "tool", "tool_call_id": PROBE_CALL_IDS[0], "content": "Probe earlier result."}
        )
    last: Message = {"role": "assistant", "content": None if call and calls_only else ANSWER}
    if call:
        last["tool_calls"] = [_tool_call(PROBE_CALL_IDS[1])]
    messages.append(last)
    return messages


def appended(kind: AppendKind) -> list[Message]:
    if kind == "tool":
        return [{"role": "tool", "tool_call_id": PROBE_CALL_IDS[1], "content": "Probe appended tool result."}]
    if kind == "user":
        return [{"role": "user", "content": "Probe appended question?"}]
    return [{"role": "system", "content": "Probe appended system note."}]


def shows_call(text: str) -> bool:
    """Whether a render holds the probe's call as a template should write it: its name and its
    arguments, no Python repr of a mapping (a template that wants text) and no "None" printed."""
    return PROBE_FUNCTION in text and ANSWER in text and "{'key'" not in text and "None" not in text


class TemplateProbe:
    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer

    def _text(self, messages: list[Message], **kwargs: Any) -> str | None:
        try:
            return self.renderer.render_text(messages, **kwargs)
        except TemplateError:
            return None

    def _close_after_answer(self, messages: list[Message]) -> str | None:
        text = self._text(messages)
        if text is None:
            return None
        found = self.renderer.first_special_after(text, text.rfind(ANSWER) + len(ANSWER))
        return found[1] if found else None

    def _close_after_call(self) -> str | None:
        """The token that ends a tool-calling turn (gpt-oss: <|call|>): the last special token of a
        render that ends with such a turn, if it comes after the call's arguments."""
        text = self._text(conversation(system=True, tool_cycle=False, call=True, calls_only=True))
        if text is None:
            text = self._text(conversation(system=True, tool_cycle=False, call=True))
        if text is None:
            return None
        at = text.rfind(ANSWER) + len(ANSWER)
        last = None
        while (found := self.renderer.first_special_after(text, at)) is not None:
            last, at = found[1], found[0] + len(found[1])
        if last is not None and self._ends_each_call(last):
            return None  # DeepSeek R1 closes nothing after a lone call: its call end is no turn close
        return last

    def _ends_each_call(self, token: str) -> bool:
        """Whether `token` also stands between two calls of one turn: a call's end, not the turn's."""
        messages = conversation(system=True, tool_cycle=False, call=True, calls_only=True)
        messages[-1]["tool_calls"] = [_tool_call(PROBE_CALL_IDS[0]), *messages[-1]["tool_calls"]]
        text = self._text(messages)
        if text is None or text.count(ANSWER) < 2:
            return False  # one call per turn (Llama 3)
        first = text.find(ANSWER) + len(ANSWER)
        return token in text[first : text.find(ANSWER, first)]

    def _call_shape(self) -> tuple[Literal["object", "string"], CallsOnlyContent, bool]:
        """How a turn that only called a tool must be passed for the template to render the call:
        arguments as objects or text, content none, "" or absent. The first shape that shows the
        call wins (objects first, as SGLang and vLLM pass them; then content none, the OpenAI shape)."""
        calls_only = conversation(system=True, tool_cycle=False, call=True, calls_only=True)
        with_content = conversation(system=True, tool_cycle=False, call=True)
        for messages, contents in ((calls_only, CALLS_ONLY_CONTENTS), (with_content, ("empty",))):
            for arguments in ARGUMENT_FORMS:
                for content in contents:
                    self.renderer.arguments_as, self.renderer.calls_only_content = arguments, content
                    text = self._text(messages)
                    if text is not None and shows_call(text):
                        return arguments, content, True
        return "object", "empty", False

    def _call_id_style(self) -> CallIdStyle:
        """Whether the template takes the proxy's OpenAI-style call ids, or only nine alphanumerics."""
        messages = conversation(system=True, tool_cycle=False, call=True, calls_only=True)
        messages[-1]["tool_calls"][0]["id"] = "call_" + "0" * 24
        text = self._text(messages)
        return "openai" if text is not None and shows_call(text) else "alphanumeric9"

    def run(self) -> TemplateVerdict:
        from proxy.chat.turn_closes import TurnCloses

        arguments_as, calls_only_content, renders_calls = self._call_shape()
        self.renderer.arguments_as = arguments_as
        self.renderer.calls_only_content = calls_only_content
        base = conversation(system=True, tool_cycle=False, call=False)
        close_by_append: dict[str, str | None] = {
            kind: self._close_after_answer([*base, *appended(kind)]) for kind in APPEND_KINDS
        }
        closes = {c for c in close_by_append.values() if c is not None}
        separator = None
        user_close = close_by_append["user"]
        user_text = self._text([*base, *appended("user")])
        if user_text is not None and user_close is not None:
            close_at = user_text.find(user_close, user_text.rfind(ANSWER)) + len(user_close)
            following = self.renderer.first_special_after(user_text, close_at)
            separator = user_text[close_at : following[0]] if following else None
        rendered = self._text(base) or ""
        bos = self.renderer.files.special_tokens.get("bos_token")
        last_turn_close = self._close_after_answer(base)
        call_close = self._close_after_call()
        known = {*closes, *(c for c in (last_turn_close, call_close) if c is not None)}
        verdict = TemplateVerdict(
            arguments_as=arguments_as,
            close_by_append=close_by_append,
            last_turn_close=last_turn_close,
            call_close=call_close,
            opener_close=len(closes) > 1,
            separator=separator,
            bos_token=bos,
            template_emits_bos=bool(bos) and rendered.startswith(bos or "\0"),
            date_dependent=self._text(base, now=datetime(2024, 1, 2))
            != self._text(base, now=datetime(2025, 7, 8)),
            appends={},
            calls_only_content=calls_only_content,
            renders_tool_calls=renders_calls,
            call_id_style=self._call_id_style() if renders_calls else "openai",
            closes_by_following=TurnCloses(self.renderer, frozenset(known)).by_following(),
        )
        self.renderer.verdict = verdict
        appends = {kind: self._check_append(kind) for kind in APPEND_KINDS}
        return TemplateVerdict(**{**verdict.__dict__, "appends": appends})

    def _check_append(self, kind: AppendKind) -> AppendVerdict:
        call = kind == "tool"
        # After a call, both shapes a turn takes: with text beside the call, and the call alone.
        shapes = (False, True) if call else (False,)
        contexts = [
            conversation(system=system, tool_cycle=cycle, call=call, calls_only=calls_only)
            for system, cycle in ((True, False), (True, True), (False, False))
            for calls_only in shapes
        ]
        new = appended(kind)
        checked = 0
        for context in contexts:
            if self._text(context, now=_PINNED) is None:
                continue  # a context this template cannot render at all (Gemma has no tool role)
            failure = self._append_failure(kind, context, new)
            if failure is not None:
                return AppendVerdict(False, failure)
            checked += 1
        if not checked:
            return AppendVerdict(False, f"the template renders no probe conversation with a {kind} append")
        return AppendVerdict(
            True, "the fixed-base delta equals the tail of full renders in every probe context"
        )

    def _append_failure(self, kind: AppendKind, context: list[Message], new: list[Message]) -> str | None:
        """Why the fixed-base delta is not what a full render of `context + new` puts after the turn."""
        from proxy.chat.renderer import DeltaUnavailable

        text = self._text([*context, *new], add_generation_prompt=True, now=_PINNED)
        if text is None:
            return f"the template refuses a {kind} message after an assistant turn"
        try:
            tail = self.renderer.cut_after_close(text, text.rfind(ANSWER) + len(ANSWER))
        except DeltaUnavailable as exc:
            return f"in a full render: {exc}"
        try:
            delta = self.renderer.render_delta(
                context[-1], new, tools=None, template_kwargs=None, now=_PINNED
            )
        except (DeltaUnavailable, TemplateError) as exc:
            return f"no fixed-base delta: {exc}"
        if delta.ids != tail.ids:
            return (
                f"a full render puts other tokens after the assistant turn than the fixed-base delta when a "
                f"{kind} message follows (the template rewrites earlier turns or moves messages)"
            )
        if new[0]["content"] not in self.renderer.decode(delta.ids):
            return f"the appended {kind} message is rendered elsewhere than after the turn"
        return None
