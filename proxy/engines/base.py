"""The Engine protocol and the plain data that crosses it."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from proxy.engines.routed_experts import ExpertsAsk, RoutedExperts

FinishKind = Literal["stop", "length", "abort"]
# SGLang's structured generation: at most one grammar per request (a sampling_params key).
ConstraintKind = Literal["json_schema", "ebnf", "regex", "structural_tag"]
# Alternatives at one output position, best first: (token id, logprob).
TopLogprobs = list[tuple[int, float]]
# A prompt as the proxy holds it (an int32 array, sent without a Python list in between) or a list.
PromptIds = Sequence[int] | npt.NDArray[np.int32]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters the proxy can honour exactly; names follow SGLang's sampling_params."""

    # None: up to the context limit (SGLang's null).
    max_new_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Grammar the output must follow, passed as the sampling_params key of the same name.
    constraint: tuple[ConstraintKind, str] | None = None
    # Alternatives wanted per output position (SGLang's top-level top_logprobs_num, not a sampling key).
    top_logprobs: int = 0
    # The LoRA adapter to sample with, by the name the engine lists it under (None: the base weights).
    # Top-level on the wire: SGLang's lora_path, vLLM's model.
    adapter: str | None = None
    # Ask for the MoE experts each position was routed to (None: not asked); see routed_experts.py.
    routed_experts: ExpertsAsk | None = None

    def for_choice(self, index: int) -> SamplingParams:
        """The params of choice `index` of a request's n: each is its own engine request, so one seed
        would make every choice the same sample; as vLLM seeds its n children, choice i gets seed + i
        (kept within int64, the seeds engines take)."""
        if self.seed is None or index == 0:
            return self
        seed = (self.seed + index + 2**63) % 2**64 - 2**63
        return dataclasses.replace(self, seed=seed)

    def as_sglang(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            # Tool and think markers must survive; we build text from ids anyway.
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        if self.constraint is not None:
            kind, grammar = self.constraint
            params[kind] = grammar
        return params


@dataclass(frozen=True)
class FinishReason:
    kind: FinishKind
    matched_token: int | None = None
    matched_text: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class Generation:
    """What the engine sampled for one prompt: ids and logprobs aligned one to one."""

    output_ids: list[int]
    logprobs: list[float]
    finish: FinishReason
    weight_version: str | None = None
    cached_tokens: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # Set when SamplingParams.top_logprobs asked for alternatives; one list per output position.
    top_logprobs: list[TopLogprobs] | None = None
    # Set when SamplingParams.routed_experts_from asked for them (proxy/engines/routed_experts.py).
    routed_experts: RoutedExperts | None = None

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError("output_ids and logprobs must be aligned")
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.output_ids):
            raise ValueError("top_logprobs must hold one list per output id")


@dataclass(frozen=True)
class ContextLimits:
    """What of its context length an engine lets a prompt and its output take (engines differ)."""

    # Context tokens a prompt never gets: the longest prompt accepted is context_length - prompt_reserve.
    prompt_reserve: int = 1
    # Context tokens generation never gets: it may sample context_length - output_reserve - prompt.
    output_reserve: int = 0
    # max_new_tokens for a request that sets none; None: up to the room left.
    default_max_new_tokens: int | None = None

    def longest_prompt(self, context_length: int) -> int:
        return context_length - self.prompt_reserve

    def room(self, context_length: int, prompt_len: int) -> int:
        """The most tokens the engine will sample after a prompt of this length."""
        return context_length - self.output_reserve - prompt_len


@dataclass(frozen=True)
class EngineInfo:
    model: str
    context_length: int | None
    weight_version: str | None = None


@dataclass(frozen=True)
class StreamChunk:
    """New output ids and their logprobs; `finish` is set on the last chunk only."""

    output_ids: list[int]
    logprobs: list[float]
    finish: FinishReason | None = None
    weight_version: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    top_logprobs: list[TopLogprobs] | None = None
    # Engines send them with the last chunk only (over the whole output).
    routed_experts: RoutedExperts | None = None


class Engine(Protocol):
    """An inference engine reachable from the proxy."""

    name: str
    # Whether SamplingParams.constraint (grammar-constrained sampling) is honoured.
    supports_constraints: bool
    # The engine's own context budget, so that a turn the proxy accepts is one the engine accepts.
    limits: ContextLimits

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        """Sample a whole turn; `request_id` is what abort() names it by (made up when None).
        `affinity` (a session id) names calls that should reach the same engine or router worker,
        whose prefix cache holds their shared prefix; an engine alone may ignore it."""
        ...

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        """Sample incrementally. Raises EngineError subclasses before the first chunk if refused."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def info(self) -> EngineInfo: ...

    async def ready(self) -> bool: ...

    async def aclose(self) -> None: ...
