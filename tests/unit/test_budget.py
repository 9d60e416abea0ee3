"""A turn that asks for no max_tokens is bounded by the room its context leaves: the bounded
parameters equal dataclasses.replace's, whatever else they set."""

from __future__ import annotations

from dataclasses import replace

from proxy.engines.base import ContextLimits, SamplingParams
from proxy.engines.routed_experts import ExpertsAsk
from proxy.turns.budget import bounded_sampling
from proxy.turns.request import TurnRequest


def _request(params: SamplingParams, max_tokens: int | None) -> TurnRequest:
    return TurnRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=None,
        template_kwargs=None,
        sampling=params,
        max_tokens_requested=max_tokens,
    )


def test_the_room_left_is_set_as_replace_sets_it() -> None:
    for params in (
        SamplingParams(max_new_tokens=None),
        SamplingParams(
            max_new_tokens=None,
            temperature=0.5,
            stop=("x",),
            stop_token_ids=(1, 2),
            seed=7,
            constraint=("json_schema", "{}"),
            top_logprobs=3,
            adapter="lora",
            routed_experts=ExpertsAsk(0, (2, 4)),
        ),
    ):
        for limits in (ContextLimits(), ContextLimits(default_max_new_tokens=16)):
            bounded = bounded_sampling(_request(params, None), 100, limits, 1000)
            room = limits.room(1000, 100)
            expected = replace(params, max_new_tokens=room if limits.default_max_new_tokens is None else 16)
            assert bounded == expected
            assert hash(bounded) == hash(expected)
            assert vars(bounded) == vars(expected)
            assert params.max_new_tokens is None  # the request's own are unchanged
        unbounded = bounded_sampling(
            _request(params, None), 100, ContextLimits(default_max_new_tokens=16), None
        )
        assert unbounded == replace(params, max_new_tokens=16)
        assert bounded_sampling(_request(params, 8), 100, ContextLimits(), 1000) is params
