"""The turn core's plain data: the request it takes, the plan and prepared turn, the result it gives."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from proxy.chat.messages import HistoryHash, Message, canonical_json
from proxy.chat.parsing import OutputParser, ParsedOutput
from proxy.engines.base import Generation, SamplingParams
from proxy.engines.prompt_json import with_items
from proxy.ids import random_hex
from proxy.store.codec import IdArray
from proxy.store.prompts import tools_key_of
from proxy.store.turn_store import ContinuedCall


@dataclass(frozen=True)
class TurnRequest:
    """A chat request reduced to what decides the tokens."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any] | None
    sampling: SamplingParams
    max_tokens_requested: int | None
    raw: dict[str, Any] = field(default_factory=dict)
    choices: int = 1  # OpenAI's n: each choice is sampled and recorded as its own branch
    parse_tools: bool = True  # False for tool_choice "none"
    idempotency_key: str | None = None
    request_hash: str | None = None
    # A /v1/completions prompt as ids: sent as given, continuing a recorded call it extends.
    prompt_ids: list[int] | None = None
    # The wire format the request came in (proxy/dialects/), recorded with the call; nothing else reads it.
    dialect: str = "chat"
    # Each message's canonical_json when the dialect already has them (a history it saw before), and
    # their running hash, started from the session's previous request.
    known_canonical: list[bytes] | None = None
    known_hash: HistoryHash | None = None
    # tools_key, when the dialect has it already (the session's previous request sent the same list).
    known_tools_key: bytes | None = None

    @property
    def is_completion(self) -> bool:
        return self.prompt_ids is not None

    @functools.cached_property
    def canonical_parts(self) -> list[bytes]:
        """The messages in matching form, once: both the parent lookup and the new call key on them."""
        if self.known_canonical is not None:
            return self.known_canonical
        return [canonical_json(m) for m in self.messages]

    @functools.cached_property
    def tools_key(self) -> bytes | None:
        """A digest of the tools as orjson writes them: a continuation sent with its parent's does
        not store them, and a delta's render is proven per tool list."""
        return self.known_tools_key if self.known_tools_key is not None else tools_key_of(self.tools)

    @functools.cached_property
    def history_hash(self) -> HistoryHash:
        """What keys the request's history (parent lookup) and its call (history + reply)."""
        return self.known_hash if self.known_hash is not None else HistoryHash(self.canonical_parts)


@dataclass(frozen=True)
class PromptPlan:
    prompt: IdArray
    added: IdArray
    parent: ContinuedCall | None
    boundary_edits: list[dict[str, Any]]
    history: list[Message] = field(default_factory=list)  # the parent's recorded conversation
    appended: list[Message] = field(default_factory=list)
    new_segment_reason: str = "new_conversation"  # why a plan without a parent opens a segment
    # The prompt's JSON items (proxy/engines/prompt_json.py), built from its context's and its added
    # ids'; None where nobody wrote them (the engine then writes the ids).
    prompt_items: bytes | None = None
    # Whether the request's tools are its parent's, written the very same (the same tools_key): its
    # call then does not store them again (chain_tools finds them).
    tools_inherited: bool = False

    def engine_prompt(self) -> IdArray:
        """The prompt as the engine call takes it: carrying its JSON items when they are known."""
        return with_items(self.prompt, self.prompt_items)


@dataclass(frozen=True)
class PreparedTurn:
    """A turn ready for the engine."""

    session_id: str
    request: TurnRequest
    plan: PromptPlan
    params: SamplingParams
    template_now: datetime
    dispatched_version: str | None
    started: float
    rendered: float
    reasoning_open: bool
    parser: OutputParser
    # Shared by the request's choices: 32 random hex digits, as a uuid4's hex.
    request_id: str = field(default_factory=random_hex)


@dataclass(frozen=True)
class TurnResult:
    call_id: int
    session_id: str
    output: ParsedOutput
    finish_reason: str | None  # None: aborted, answered with an error
    prompt_tokens: int
    completion_tokens: int
    generation: Generation
    choice_index: int = 0
    # The request's id (shared by its choices): answers are named by it, plain, streamed or replayed.
    request_id: str = ""
