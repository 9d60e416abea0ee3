"""Request bodies of the OpenAI surface, validated strictly: what we cannot honour is a 400."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from proxy.chat.messages import HistoryHash, canonical_json
from proxy.dialects.openai_checks import (
    REASONING_EFFORTS,
    check_function_fields,
    check_inert_fields,
    check_name,
)
from proxy.errors import InvalidRequest, UnsupportedParameter
from proxy.json_limits import MAX_JSON_DEPTH, too_deep
from proxy.store.prompts import tools_key_of

# Ids and cursors a database integer can hold (SQLite INTEGER, PostgreSQL BIGINT): a larger one is a
# 400, not an overflow inside the query.
MAX_DB_INTEGER = 2**63 - 1
RowId = Annotated[int, Field(ge=0, le=MAX_DB_INTEGER)]

# Each choice is its own engine request and branch; more than this is a batch job, not a turn.
MAX_CHOICES = 64


def shallow_json(value: Any) -> Any:
    """A free-form JSON value within the nesting cap (proxy/json_limits.py), else a 400 json_too_deep."""
    if too_deep(value):
        raise PydanticCustomError(
            "json_too_deep", "JSON nested deeper than {limit} levels", {"limit": MAX_JSON_DEPTH}
        )
    return value


# Free-form JSON is checked where it enters: the typed parts of a body cannot nest.
Shallow = BeforeValidator(shallow_json)

# What an export row can carry: orjson writes integers of up to 64 bits, and JSON has no infinity.
_INTEGERS = range(-(2**63), 2**64)


def exportable_json(value: Any) -> Any:
    """Free-form JSON that is exported as it was given (a session's metadata) has only finite numbers
    and integers of up to 64 bits: the standard library's parser reads `1e400` as infinity (which
    would be written back as null) and any integer (which no export row could write)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending += item.values()
        elif isinstance(item, list):
            pending += item
        elif isinstance(item, float) and not math.isfinite(item):
            raise PydanticCustomError("finite_number", "numbers must be finite, not {value}", {"value": item})
        elif isinstance(item, int) and not isinstance(item, bool) and item not in _INTEGERS:
            raise PydanticCustomError("integer_too_large", "integers must fit in 64 bits")
    return value


Exportable = AfterValidator(exportable_json)

# Fields that change nothing about the sample: accepted and not acted on.
_INERT_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})
# Values of fields this proxy otherwise refuses that ask for nothing it does not do anyway.
_NO_OPS: dict[str, Any] = {"logit_bias": {}, "modalities": ["text"]}


def refuse_unsupported(extras: dict[str, Any] | None, inert: frozenset[str]) -> None:
    """A field this proxy cannot honour (not a declared one, not `inert`) is a 400 naming it. One
    sent as null (unset: many clients send every field) or with a value that asks for nothing
    (`logit_bias: {}`) is honoured as it is."""
    for name, value in (extras or {}).items():
        if name in inert or value is None or (name in _NO_OPS and value == _NO_OPS[name]):
            continue
        raise UnsupportedParameter(f"parameter {name!r} is not supported by tito-proxy", param=name)


# Every request model is strict, as OpenAI's and Anthropic's APIs are: "32" is not an integer and
# 1 is not true (pydantic's lax mode would take both, and sample what the client never asked for).


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: Annotated[str | dict[str, Any], Shallow] = "{}"


class ToolCall(BaseModel):
    # Wire-only keys such as `index` are ignored (decision 2).
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_of_a_text_part(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs its text (a string)")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text_content(self) -> str | None:
        if not isinstance(self.content, list):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise UnsupportedParameter(
                    f"content parts of type {part.type!r} are not supported; send text parts",
                    param="messages",
                )
            texts.append(part.text)
        return "\n".join(texts)

    def as_plain(self) -> dict[str, Any]:
        """The message as the renderer and the record hold it."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text_content()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": call.function.arguments
                        if isinstance(call.function.arguments, str)
                        else _dumps(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


# (plain messages, their canonical_json), in message order.
MessageForms = tuple[list[dict[str, Any]], list[bytes]]


def _dumps(value: Any) -> str:
    import orjson

    return orjson.dumps(value).decode()


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1)  # a tool without a name cannot be called (OpenAI: a 400 too)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class SamplingRequest(BaseModel):
    """The fields chat and text completions share: model, sampling, choices, streaming."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: StrictBool | None = None
    stream_options: Annotated[dict[str, Any] | None, Shallow] = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # int64, as SGLang and torch take it

    @model_validator(mode="after")
    def _shallow_extras(self) -> SamplingRequest:
        # Accepted extra fields (metadata, user) are recorded with the request.
        if self.model_extra:
            shallow_json(self.model_extra)
        return self

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 32:
            raise ValueError("at most 32 stop sequences")
        if value == "" or (isinstance(value, list) and any(not s for s in value)):
            raise ValueError("stop sequences must be non-empty")
        return value

    def check_supported(self) -> None:
        """Reject what this proxy cannot honour exactly, naming the parameter."""
        refuse_unsupported(self.model_extra, _INERT_FIELDS)
        check_inert_fields(self.model_extra)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options")
        # Obfuscation pads stream events to hide their sizes; this proxy never pads them.
        asked = {
            k for k, v in (self.stream_options or {}).items() if (k, v) != ("include_obfuscation", False)
        }
        if asked - {"include_usage"}:
            raise UnsupportedParameter(
                "stream_options supports include_usage (and include_obfuscation: false) only",
                param="stream_options",
            )

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


@dataclass
class _Derived:
    """What a chat request derives from its messages and tools."""

    # The plain and canonical forms of the first messages and their running hash, taken from the
    # session's previous request when it sent the same ones (proxy/api/message_prefix.py).
    reused_forms: MessageForms | None = None
    reused_hash: HistoryHash | None = None
    # This request's, once derived.
    forms: MessageForms | None = None
    hash: HistoryHash | None = None
    # The tools as plain dicts, and their digest; taken from the previous request when it sent the
    # same list.
    plain_tools: list[dict[str, Any]] | None = None
    tools_key: bytes | None = None
    # The tools passed OpenAI's name and flag rules (carried with a reused list: not checked again).
    tools_checked: bool = False


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[ToolDefinition] | None, Shallow] = None
    tool_choice: Annotated[str | dict[str, Any] | None, Shallow] = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    parallel_tool_calls: StrictBool | None = None
    response_format: Annotated[dict[str, Any] | None, Shallow] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, Shallow] = None
    # OpenAI's reasoning effort: passed to the template as its `reasoning_effort` (gpt-oss reads it).
    reasoning_effort: str | None = None
    # What the request derives once, or takes from the session's previous one (_Derived). One
    # private attribute: pydantic sets each one's default on every validation (~1 µs apiece).
    _derived: _Derived | None = PrivateAttr(default=None)

    def _cached(self) -> _Derived:
        """Read through pydantic's private dict: its attribute access to a private attribute costs
        ~3 µs (its __getattr__ probes the class attribute for a descriptor, by exception)."""
        private = self.__pydantic_private__
        assert private is not None  # set by validation and by model_construct
        derived: _Derived | None = private["_derived"]
        if derived is None:
            derived = private["_derived"] = _Derived()
        return derived

    def message_forms(self) -> MessageForms:
        """Each message as the renderer and the record hold it (as_plain: shared, nothing changes a
        message), and its canonical_json; a reused history's are not derived again."""
        cached = self._cached()
        if cached.forms is None:
            plain, canonical = cached.reused_forms or ([], [])
            added = [message.as_plain() for message in self.messages[len(plain) :]]
            cached.forms = ([*plain, *added], [*canonical, *(canonical_json(m) for m in added)])
        return cached.forms

    def history_hash(self) -> HistoryHash:
        """The running hash of the messages' canonical forms (it keys history lookups and calls)."""
        cached = self._cached()
        if cached.hash is None:
            cached.hash = HistoryHash(self.message_forms()[1], start=cached.reused_hash)
        return cached.hash

    def reuse_forms(self, earlier: ChatCompletionRequest) -> None:
        """Take the message forms of `earlier`, whose messages are the first of this request's."""
        known, cached = earlier._cached(), self._cached()
        if known.forms is not None:
            cached.reused_forms = known.forms
            cached.reused_hash = known.hash

    def plain_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the renderer and the record hold them (None fields left out), or None
        without tools; a reused tool list's are not written again."""
        cached = self._cached()
        if cached.plain_tools is None and self.tools:
            cached.plain_tools = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return cached.plain_tools

    def tools_key(self) -> bytes | None:
        """A digest of the plain tools' JSON (proxy/store/prompts.py's tools_key_of), made once for
        a session's tool list."""
        cached = self._cached()
        if cached.tools_key is None:
            cached.tools_key = tools_key_of(self.plain_tools())
        return cached.tools_key

    def _check_tools(self) -> None:
        """OpenAI's rules for each function's name and strict flag, once per session's tool list."""
        cached = self._cached()
        if cached.tools_checked:
            return
        for index, tool in enumerate(self.tools or ()):
            function = tool.function
            fields = {"name": function.name, "strict": (function.model_extra or {}).get("strict")}
            check_function_fields(fields, f"tools[{index}].function")
        cached.tools_checked = True

    def reuse_tools(self, earlier: ChatCompletionRequest) -> None:
        """Take the validated tools of `earlier`, which sent the very same tool list."""
        self.tools = earlier.tools
        known, cached = earlier._cached(), self._cached()
        cached.plain_tools, cached.tools_key = known.plain_tools, known.tools_key
        cached.tools_checked = known.tools_checked

    def check_supported(self) -> None:
        super().check_supported()
        self._check_tools()
        response_format = self.response_format or {}
        if response_format.get("type") == "json_schema":
            spec = response_format.get("json_schema")
            name = spec.get("name") if isinstance(spec, dict) else None
            check_name(name, "response_format.json_schema.name", "a JSON schema")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise InvalidRequest(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
        if self.parallel_tool_calls is False:
            raise UnsupportedParameter(
                "parallel_tool_calls=false cannot be enforced", param="parallel_tool_calls"
            )
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and (self.max_tokens != self.max_completion_tokens)
        ):
            raise InvalidRequest("max_tokens and max_completion_tokens disagree", param="max_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort as the template's own (one given in both
        must agree: a template renders one effort)."""
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is None:
            return kwargs or None
        given = (kwargs or {}).get("reasoning_effort", self.reasoning_effort)
        if given != self.reasoning_effort:
            raise InvalidRequest(
                "reasoning_effort and chat_template_kwargs.reasoning_effort disagree",
                param="reasoning_effort",
            )
        return {**(kwargs or {}), "reasoning_effort": self.reasoning_effort}


# OpenAI's default for legacy completions, where max_tokens is optional.
DEFAULT_COMPLETION_TOKENS = 16


class CompletionRequest(SamplingRequest):
    """/v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool | None = None
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    # vLLM's extension: the prompt and output ids in the answer, for token-in/token-out clients.
    return_token_ids: StrictBool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and not isinstance(self.prompt[0], int):
            raise UnsupportedParameter(
                "one prompt per request; send a batch as separate requests", param="prompt"
            )
        if self.echo:
            raise UnsupportedParameter("echo is not supported", param="echo")
        if self.suffix:
            raise UnsupportedParameter("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise UnsupportedParameter(
                "best_of must equal n: every sample is returned and recorded", param="best_of"
            )

    @property
    def single_prompt(self) -> str | list[int]:
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        return prompt if isinstance(prompt, str) else [int(i) for i in prompt]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens or DEFAULT_COMPLETION_TOKENS
