"""When the fixed-base delta may be rendered without the fixed base: the proof, per template and shape.

The fixed-base delta is the text a render of [system, user, stub, appended] (with the request's
tools) puts from the stub's close on. The base and the tools cost most of that render and are the same
every turn, but a template may read them while writing the appended messages (Mistral writes the
tools into the last user message, Llama 3.1 into the first, some templates number messages from the
conversation's start, check the first message's role or scan the conversation for a role). So a
short render, [stub, appended] without tools (or [user, stub, appended] where the template wants a
user first, as Gemma does), is used only where both of these hold:

1. At start-up, for every probe case (answers and tool calls, one or two appended user, tool and
   system messages, no tools and tools holding tracing strings), the short render puts exactly the
   same text from the stub's close on as the full one.
2. Per request shape (tools, template kwargs, the previous turn's shape, the appended messages'
   roles and fields), the first request of that shape renders both ways, and the texts agree.

Only then, and only when the close token is one the tokenizer splits its input at (so the ids after it
depend on nothing before it), does a request of that shape take the short render: same text from the
close on, so the same ids. Anything else keeps the full render.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from datetime import datetime
from itertools import product
from typing import TYPE_CHECKING, Any

import orjson

from proxy.chat.messages import Message
from proxy.errors import TemplateError

if TYPE_CHECKING:
    from proxy.chat.renderer import Renderer

# Request shapes remembered (proven or refused): a session's tools and turn kinds give a handful.
_SHAPES = 1024
_TRACE = "tito-proxy trace"
_TRACE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": f"trace_tool_{n}",
            "description": f"{_TRACE} tool {n}",
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
        },
    }
    for n in (1, 2)
]
# Nine alphanumerics: Mistral's templates refuse any other call id.
_PROOF_DATE = datetime(2025, 1, 15, 12, 0)
_CALL_IDS = ("trace0001", "trace0002")
_ROLES = ("user", "tool", "system")


def _call(n: int) -> dict[str, Any]:
    return {
        "id": _CALL_IDS[n],
        "type": "function",
        "function": {"name": f"trace_tool_{n + 1}", "arguments": '{"arg": "x"}'},
    }


def _previous_turns() -> list[Message]:
    """The turns a delta follows in the probe: an answer, a call with text, a lone call, two calls."""
    return [
        {"role": "assistant", "content": f"{_TRACE} answer"},
        {"role": "assistant", "content": f"{_TRACE} calling", "tool_calls": [_call(0)]},
        {"role": "assistant", "content": None, "tool_calls": [_call(0)]},
        {"role": "assistant", "content": None, "tool_calls": [_call(0), _call(1)]},
    ]


def _appended(roles: Sequence[str]) -> list[Message]:
    messages: list[Message] = []
    for n, role in enumerate(roles):
        message: Message = {"role": role, "content": f"{_TRACE} {role} {n}"}
        if role == "tool":
            message["tool_call_id"] = _CALL_IDS[n % 2]
        messages.append(message)
    return messages


def _json(value: Any) -> bytes | None:
    """A digest of `value` as JSON (a shape holds digests, so a large tool list costs 16 bytes)."""
    try:
        text = orjson.dumps(value, option=orjson.OPT_SORT_KEYS) if value else b""
    except TypeError:
        return None
    return hashlib.blake2b(text, digest_size=16).digest()


class ShortContext:
    """Decides, per template and per request shape, whether the delta's short render is proven."""

    def __init__(self, renderer: Renderer, fixed_base: tuple[Message, ...]) -> None:
        """`fixed_base`: the messages the full render puts before the stub (a system, a user)."""
        self.renderer = renderer
        self.fixed_base = fixed_base
        self._shapes: OrderedDict[Hashable, bool] = OrderedDict()
        self._lock = threading.Lock()
        # The fixed-base messages the short render keeps before the stub.
        self.base, self.reason = self._prove()
        self.proven = self.reason is None

    def _prove(self) -> tuple[tuple[Message, ...], str | None]:
        """The fewest fixed-base messages (none, the user, both) with which every probe case agrees,
        and None; else the whole base and why the template keeps the full render."""
        if not self.renderer.splitting_closes():
            return self.fixed_base, "the tokenizer does not split its input at the template's close tokens"
        failure = "no probe conversation renders a delta"
        for base in ((), self.fixed_base[1:], self.fixed_base):
            failure = self._disagreement(base) or ""
            if not failure:
                return base, None
        return self.fixed_base, failure

    def _disagreement(self, base: tuple[Message, ...]) -> str | None:
        """Why a render from `base` without tools is not proven to give the full delta, or None."""
        agreed = 0
        sequences = [*product(_ROLES, repeat=1), *product(_ROLES, repeat=2)]
        for previous, roles, tools in product(_previous_turns(), sequences, (None, _TRACE_TOOLS)):
            if not all(self.renderer.verdict.continues(role) for role in roles):
                continue  # never rendered as a delta (the self-test refused that append)
            appended = _appended(roles)
            try:
                full = self.renderer.delta_text(previous, appended, None, _PROOF_DATE, tools=tools)
            except TemplateError:
                continue  # a conversation this template refuses (Gemma has no tool role)
            try:
                short = self.renderer.delta_text(previous, appended, None, _PROOF_DATE, base=base)
            except TemplateError:
                short = None
            if full != short:
                appended_roles = ", ".join(roles)
                return f"the delta reads the fixed base or the tools ({appended_roles} appended)"
            agreed += full is not None
        return None if agreed else "no probe conversation renders a delta"

    def shape(
        self,
        previous: Message,
        appended: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        tools_key: bytes | None = None,
    ) -> Hashable | None:
        """What a request's delta render may depend on besides message text and ids; None when the
        template is not proven at all (or the request's tools are not plain JSON). `tools_key`: a
        digest of the tools' JSON the caller made already (a session's requests resend one list:
        hashing tens of KB of it on every turn was a quarter of a turn's planning)."""
        if not self.proven or not all(self.renderer.verdict.continues(m.get("role", "")) for m in appended):
            return None
        tools_json = tools_key if tools_key is not None else _json(tools)
        kwargs_json = _json(template_kwargs)
        if tools_json is None or kwargs_json is None:
            return None
        calls = tuple(c.get("function", {}).get("name") for c in previous.get("tool_calls") or ())
        return (
            tools_json,
            kwargs_json,
            bool(previous.get("content")),
            calls,
            tuple(
                (
                    m.get("role"),
                    type(m.get("content")).__name__,
                    tuple(sorted(k for k, v in m.items() if v is not None)),
                )
                for m in appended
            ),
        )

    def as_json(self) -> dict[str, Any]:
        """What GET /v1/template reports: proven, the base messages a short render keeps, or why not."""
        return {
            "proven": self.proven,
            "base_roles": [m["role"] for m in self.base] if self.proven else None,
            "reason": self.reason,
        }

    def shapes(self) -> int:
        """How many request shapes are remembered (at most _SHAPES)."""
        return len(self._shapes)

    def verdict(self, shape: Hashable) -> bool | None:
        """True: proven for this shape; False: refused; None: not decided yet."""
        return self._shapes.get(shape)

    def decide(
        self, shape: Hashable, full_tail: tuple[str, str] | None, short: Callable[[], tuple[str, str] | None]
    ) -> None:
        """Record whether the short render agrees with the full one on this request's shape."""
        try:
            agrees = full_tail is not None and short() == full_tail
        except TemplateError:
            agrees = False
        with self._lock:  # large renders run on worker threads
            self._shapes[shape] = agrees
            while len(self._shapes) > _SHAPES:
                self._shapes.popitem(last=False)
