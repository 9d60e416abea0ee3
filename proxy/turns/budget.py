"""The context budget: a turn's sampling bounded by the context window and the engine's own limits."""

from __future__ import annotations

from dataclasses import replace

from proxy.engines.base import ContextLimits, SamplingParams
from proxy.errors import ContextLengthExceeded
from proxy.turns.request import TurnRequest


def bounded_sampling(
    request: TurnRequest, prompt_len: int, limits: ContextLimits, context_length: int | None
) -> SamplingParams:
    """The sampling parameters with max_new_tokens set, within the engine's own limits: a turn the
    proxy accepts is one the engine accepts, and it samples at most max_tokens, never fewer
    because the engine quietly capped them."""
    params = request.sampling
    default = limits.default_max_new_tokens
    requested = request.max_tokens_requested
    if context_length is None:
        return params if requested is not None or default is None else _replace_max(params, default)
    longest = limits.longest_prompt(context_length)
    if prompt_len > longest:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens, and the engine "
            f"takes prompts of at most {longest} tokens; the prompt has {prompt_len} tokens.",
            param="messages",
        )
    room = limits.room(context_length, prompt_len)
    if requested is not None and requested > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. The prompt has "
            f"{prompt_len} tokens and {requested} completion tokens were requested; at most {room} fit.",
            param="max_tokens",
        )
    if requested is not None:
        return params
    return _replace_max(params, room if default is None else min(room, default))


def _replace_max(params: SamplingParams, max_new_tokens: int) -> SamplingParams:
    """replace(params, max_new_tokens=...): its fields copied, one changed. dataclasses.replace runs
    the frozen __init__ over all 14 fields (~15 µs, on every turn that sets no max_tokens); with no
    __post_init__ to run, the copy is the same value."""
    if hasattr(SamplingParams, "__post_init__"):
        return replace(params, max_new_tokens=max_new_tokens)
    copied = object.__new__(SamplingParams)
    copied.__dict__.update(params.__dict__)
    object.__setattr__(copied, "max_new_tokens", max_new_tokens)
    return copied
