"""merge_steps: step-wise rows merged back into sequences keep every step's own loss mask and
logprobs, and the fields a trainer needs; for a single-segment session they equal the merged export."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.export.branches import BRANCH_FILTERS, BranchFilter
from proxy.export.samples import MergeRefused, merge_steps, merged_rows, stepwise_rows
from proxy.store.codec import unpack_ids, unpack_logprobs
from proxy.store.models import CallRow
from tests.call_trees import Output, SessionBuilder

TOKENS = st.integers(min_value=0, max_value=151_000)
LOGPROBS = st.floats(min_value=-20.0, max_value=-0.0625, width=32)
VERSIONS = st.sampled_from([None, "v1", "v2", "v3"])
FINISHES = st.sampled_from(["stop", "length"])
# Fields a merged run shares with the merged export; the property compares all of them.
SHARED = (
    "session_id",
    "segment_id",
    "call_ids",
    "num_calls",
    "prompt_ids",
    "response_ids",
    "loss_mask",
    "rollout_logprobs",
    "reward",
    "call_rewards",
    "finish_reasons",
    "weight_versions",
    "weight_version_min",
    "weight_version_max",
    "metadata",
    "branch",
)


@st.composite
def outputs(draw: st.DrawFn) -> Output:
    ids = draw(st.lists(TOKENS, max_size=5))
    return ids, [draw(LOGPROBS) for _ in ids]


@st.composite
def linear_sessions(draw: st.DrawFn, *, retries: bool = True) -> SessionBuilder:
    """One segment; a turn may be resent (retried) before the harness continues its last attempt."""
    builder = SessionBuilder(reward=draw(st.sampled_from([1.0, -0.5, 0.0])))
    parent: CallRow | None = None
    turns = draw(st.integers(min_value=1, max_value=6))
    for turn in range(turns):
        attempts = draw(st.integers(min_value=1, max_value=3)) if retries and turn < turns - 1 else 1
        first_prompt = draw(st.lists(TOKENS, min_size=1, max_size=6))
        for _ in range(attempts):
            # A resent first request has the same prompt (another one is a conversation of its own).
            added = first_prompt if parent is None else draw(st.lists(TOKENS, max_size=6))
            (call,) = builder.turn(
                parent,
                added,
                [draw(outputs())],
                finish=draw(FINISHES),
                weight_version=draw(VERSIONS),
                reward=draw(st.sampled_from([None, 0.25])),
            )
        parent = call
    return builder


@st.composite
def call_trees(draw: st.DrawFn) -> SessionBuilder:
    """Any shape: new conversations (some resending an earlier first prompt), continuations of any
    recorded call, resent turns, n > 1 choices, aborted calls."""
    builder = SessionBuilder()
    roots: list[list[int]] = []
    for _ in range(draw(st.integers(min_value=1, max_value=10))):
        done = [c for c in builder.calls if c.status == "ok"]
        parent = draw(st.sampled_from([None, *done])) if done else None
        if parent is None and roots and draw(st.booleans()):
            added = draw(st.sampled_from(roots))
        else:
            added = draw(st.lists(TOKENS, min_size=1 if parent is None else 0, max_size=4))
        if parent is None:
            roots.append(added)
        choices = draw(st.lists(outputs(), min_size=1, max_size=3))
        status = draw(st.sampled_from(["ok", "ok", "ok", "aborted"]))
        builder.turn(parent, added, choices, weight_version=draw(VERSIONS), status=status)
    return builder


def _sampled(call: CallRow) -> list[tuple[int, float]]:
    return list(zip(unpack_ids(call.output_ids).tolist(), unpack_logprobs(call.output_logprobs), strict=True))


def assert_mask_one_is_sampled(row: dict[str, Any], calls: list[CallRow]) -> None:
    """Mask 1 exactly on the outputs of the row's calls, in order, each with its own logprob."""
    by_id = {c.id: c for c in calls}
    response, mask, logprobs = row["response_ids"], row["loss_mask"], row["rollout_logprobs"]
    assert len(response) == len(mask) == len(logprobs)
    trained = [(t, lp) for t, m, lp in zip(response, mask, logprobs, strict=True) if m == 1]
    assert trained == [pair for call_id in row["call_ids"] for pair in _sampled(by_id[call_id])]
    assert all(lp == 0.0 for m, lp in zip(mask, logprobs, strict=True) if m == 0)
    assert set(mask) <= {0, 1}


@settings(max_examples=80, deadline=None)
@given(linear_sessions())
def test_merging_the_steps_of_a_single_segment_session_gives_its_merged_export(
    builder: SessionBuilder,
) -> None:
    steps = stepwise_rows(builder.session, builder.calls)
    [merged] = merged_rows(builder.session, builder.calls, None, "disable")
    [rebuilt] = merge_steps(steps)
    assert set(SHARED) <= set(merged) & set(rebuilt)
    assert {key: rebuilt[key] for key in SHARED} == {key: merged[key] for key in SHARED}
    assert rebuilt["steps"] == [s["step"] for s in steps]
    assert rebuilt["is_last_step"] is True
    assert rebuilt["finish_reason"] == steps[-1]["finish_reason"]
    assert rebuilt["trajectory_id"] == builder.session.id
    assert sum(rebuilt["token_rewards"]) == sum(sum(s["token_rewards"]) for s in steps)
    assert len(rebuilt["token_rewards"]) == len(rebuilt["response_ids"])


@settings(max_examples=80, deadline=None)
@given(call_trees(), st.sampled_from(BRANCH_FILTERS))
def test_every_trained_token_of_a_merged_row_is_a_sampled_token_with_its_logprob(
    builder: SessionBuilder, branches: BranchFilter
) -> None:
    steps = stepwise_rows(builder.session, builder.calls, branches=branches)
    runs = merge_steps(steps)
    for row in runs:
        assert_mask_one_is_sampled(row, builder.calls)
    # Each call's output is trained in one run only, samples and shared prefixes included.
    assert sorted(i for run in runs for i in run["call_ids"]) == sorted(s["call_id"] for s in steps)
    for row in merged_rows(builder.session, builder.calls, None, "disable", branches=branches):
        assert_mask_one_is_sampled(row, builder.calls)


@settings(max_examples=60, deadline=None)
@given(linear_sessions(retries=False), st.data())
def test_merged_rows_merge_again_with_their_observation_tokens_kept_at_mask_0(
    builder: SessionBuilder, data: st.DataObject
) -> None:
    steps = stepwise_rows(builder.session, builder.calls)
    cuts = sorted(data.draw(st.sets(st.integers(min_value=1, max_value=max(1, len(steps) - 1)))))
    chunks = [steps[a:b] for a, b in zip([0, *cuts], [*cuts, len(steps)], strict=True) if steps[a:b]]
    premerged = [run for chunk in chunks for run in merge_steps(chunk)]
    assert merge_steps(premerged) == merge_steps(steps)


def _step(step: int, prompt: list[int], response: list[int], mask: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "trajectory_id": "t",
        "step": step,
        "prompt_ids": prompt,
        "response_ids": response,
        "loss_mask": mask,
        "rollout_logprobs": [-0.5 if m else 0.0 for m in mask],
        "reward": 0.0,
        "is_last_step": False,
        "finish_reason": "stop",
        **extra,
    }


def test_a_step_that_already_carries_observation_tokens_keeps_them_at_mask_0() -> None:
    # A step from another source: its response holds a tool result (mask 0) between two outputs.
    first = _step(0, [1, 2], [3, 90, 91, 4], [1, 0, 0, 1])
    last = _step(1, [1, 2, 3, 90, 91, 4, 92], [5], [1], reward=1.0, is_last_step=True, finish_reason="length")
    [run] = merge_steps([first, last])
    assert run["response_ids"] == [3, 90, 91, 4, 92, 5]
    assert run["loss_mask"] == [1, 0, 0, 1, 0, 1]
    assert run["rollout_logprobs"] == [-0.5, 0.0, 0.0, -0.5, 0.0, -0.5]
    assert (run["is_last_step"], run["finish_reason"], run["reward"]) == (True, "length", 1.0)
    assert run["finish_reasons"] == ["stop", "length"]
    assert run["steps"] == [0, 1]


def test_steps_that_disagree_with_themselves_are_refused() -> None:
    with pytest.raises(MergeRefused, match="loss_mask"):
        merge_steps([_step(0, [1], [2, 3], [1])])
    with pytest.raises(MergeRefused, match="logprobs"):
        merge_steps([{**_step(0, [1], [2, 3], [1, 1]), "rollout_logprobs": [0.0]}])
    with pytest.raises(MergeRefused, match="loss mask"):
        merge_steps([_step(0, [1], [2], [2])])


def test_a_merged_runs_oldest_version_counts_a_resumed_steps_older_tokens() -> None:
    """A step resumed across a weight update holds tokens of two versions; the run's bounds count
    both, as the merged export's do, whatever the steps' own versions say."""
    spans = [{"version": "v0", "start": 0, "end": 1}, {"version": "v1", "start": 1, "end": 2}]
    first = _step(0, [1, 2], [3, 4], [1, 1], weight_version="v0", weight_version_spans=spans)
    last = _step(1, [1, 2, 3, 4, 90], [5], [1], weight_version="v2")
    [run] = merge_steps([first, last])
    assert run["weight_versions"] == ["v0", "v2"]
    assert (run["weight_version_min"], run["weight_version_max"]) == ("v0", "v2")
    [again] = merge_steps([{**first, "weight_version": "v1"}, last])
    assert again["weight_version_min"] == "v0"  # from the spans alone
    assert "_versions" not in again
