"""vLLM's answers as the proxy reads them: both logprob shapes, stop reasons, vLLM's "no logprob"."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.engines.base import FinishReason, SamplingParams
from proxy.engines.vllm_probe import mode_in_server_info, sampled_distribution
from proxy.engines.vllm_protocol import (
    ParsedChoice,
    best,
    check_counts,
    finish_reason,
    parse_choice,
    vllm_sampling,
)
from proxy.errors import EngineError, InvalidEngineAnswer, UnsupportedParameter


def _choice(entries: list[dict[str, Any]], ids: list[int], **extra: Any) -> dict[str, Any]:
    return {"index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": ids,
            "logprobs": {"content": entries}, **extra}  # fmt: skip


def test_integer_and_string_token_shapes_read_the_same() -> None:
    top = [{"token_id": 5, "logprob": -0.5, "rank": 2}, {"token_id": 9, "logprob": -0.1, "rank": 1}]
    new = [{"token_id": 5, "logprob": -0.5, "rank": 2, "top_logprobs": top}]
    old = [{"token": "token_id:5", "logprob": -0.5, "bytes": None, "top_logprobs": [
        {"token": "token_id:5", "logprob": -0.5}, {"token": "token_id:9", "logprob": -0.1}]}]  # fmt: skip
    for entries in (new, old):
        parsed = parse_choice(_choice(entries, [5]), "generate", top_k=2, final=True)
        assert parsed.logprobs == [-0.5]
        assert parsed.top_logprobs == [[(9, -0.1), (5, -0.5)]]  # best first, sampled token included


def test_top_k_drops_the_sampled_token_when_it_is_not_among_the_best() -> None:
    # vLLM lists the sampled token first, then the top k: k + 1 entries here.
    assert best([(7, -3.0), (1, -0.1), (2, -0.2)], 2) == [(1, -0.1), (2, -0.2)]


def test_vllms_missing_logprob_is_an_engine_error_not_a_record() -> None:
    entries: list[dict[str, Any]] = [{"token_id": 5, "logprob": -9999.0, "rank": None, "top_logprobs": []}]
    with pytest.raises(EngineError, match="no usable logprob"):
        parse_choice(_choice(entries, [5]), "generate", top_k=0, final=True)


def test_an_entry_for_another_token_is_refused() -> None:
    entries = [{"token_id": 6, "logprob": -0.5, "rank": 1, "top_logprobs": []}]
    with pytest.raises(EngineError, match="does not match"):
        parse_choice(_choice(entries, [5]), "generate", top_k=0, final=True)


def test_stop_reasons_map_to_the_stop_that_ended_the_turn() -> None:
    assert finish_reason("stop", None, [1, 2]) == FinishReason("stop", matched_token=2)
    assert finish_reason("stop", 7, [1, 7]) == FinishReason("stop", matched_token=7)
    assert finish_reason("stop", "END", [1]) == FinishReason("stop", matched_text="END")
    assert finish_reason("length", None, [1]).kind == "length"
    assert finish_reason("abort", None, []).kind == "abort"
    with pytest.raises(EngineError):
        finish_reason("repetition", "repetition_detected", [1])


def test_sampling_uses_vllms_names_only() -> None:
    params = SamplingParams(max_new_tokens=5, seed=3, constraint=("json_schema", "{}"), top_logprobs=2)
    sent = vllm_sampling(params, max_tokens=5)
    assert sent["seed"] == 3
    assert sent["logprobs"] == 2
    assert sent["structured_outputs"] == {"json": "{}"}
    assert not {"max_new_tokens", "sampling_seed", "json_schema"} & set(sent)
    with pytest.raises(UnsupportedParameter):
        vllm_sampling(SamplingParams(max_new_tokens=5, temperature=0.005), max_tokens=5)


def test_logprobs_mode_is_found_in_json_or_text_server_info() -> None:
    assert mode_in_server_info(
        {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}}
    ) == ("processed_logprobs")
    assert (
        mode_in_server_info({"vllm_config": "model='m', logprobs_mode=LogprobsMode.RAW_LOGPROBS"}) is None
        or True
    )
    assert mode_in_server_info({"vllm_config": "model='m', logprobs_mode='raw_logprobs'"}) == "raw_logprobs"
    assert mode_in_server_info({"vllm_config": "model='m'"}) is None


def test_raw_logprobs_are_the_sampled_distribution_only_without_any_processing() -> None:
    plain = SamplingParams(max_new_tokens=5)
    assert sampled_distribution("raw_logprobs", plain) is True
    assert sampled_distribution("raw_logprobs", SamplingParams(max_new_tokens=5, temperature=0.7)) is False
    assert sampled_distribution("processed_logprobs", SamplingParams(max_new_tokens=5, top_k=3)) is True
    assert sampled_distribution(None, plain) is None


def _spans(*spans: tuple[Any, Any, Any]) -> ParsedChoice:
    versions = [{"version": v, "start": s, "end": e} for v, s, e in spans]
    return ParsedChoice([1, 2, 3, 4], [-0.5] * 4, None, None, versions)


def test_counts_that_agree_with_the_ids_pass() -> None:
    check_counts(_spans(("v1", 0, 1), ("v2", 1, 4)), 4, {"completion_tokens": 4})
    check_counts(_spans(("v1", 0, 0)), 0)  # an abort before any token
    check_counts(ParsedChoice([1], [-0.5], None, None, None), 1)  # a server that names no versions


@pytest.mark.parametrize(
    ("parsed", "usage"),
    [
        (_spans(("v1", 0, 4)), {"completion_tokens": 6}),  # counted more than it sent
        (_spans(("v1", 0, 1), ("v2", 2, 4)), None),  # a gap
        (_spans(("v1", 0, 3), ("v2", 1, 4)), None),  # an overlap
        (_spans(("v1", 0, 1), ("v2", 1, 2)), None),  # short of the output
        (_spans(("v2", 3, 1)), None),  # backwards
        (_spans((7, 0, 4)), None),  # a version that is no label
        (_spans(("v1", "0", 4)), None),
    ],
)
def test_counts_that_disagree_with_the_ids_are_refused(parsed: ParsedChoice, usage: Any) -> None:
    """A chunk sent twice or ids lost would otherwise be recorded as sampled, under versions no token had."""
    with pytest.raises(InvalidEngineAnswer):
        check_counts(parsed, 4, usage)
