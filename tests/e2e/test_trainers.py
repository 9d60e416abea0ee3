"""The trainer recipes on a branched, multi-segment session with rewards, recorded through the
served proxy: SkyRL's GeneratorOutput (merged and step-wise), verl's padded rollout batch, and
verifiers' rollout outputs (what prime-rl trains on). Each shape is checked against a named release:
none of the three installs here without its GPU stack or on Python 3.11 (skyrl-train needs 3.12,
verl needs torch + ray + vllm/sglang, verifiers 0.1.14 pulls its environment stack), so the field
names and dtypes below are quoted from the released files (pip download --no-deps)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from proxy.client import TitoClient
from proxy.export.samples import merge_steps
from proxy.trainers.skyrl import GENERATOR_OUTPUT_KEYS, generator_output
from proxy.trainers.verifiers import rollout_outputs
from proxy.trainers.verl import verl_batch
from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.support import token_id

# skyrl-train 0.3.1, skyrl_train/generators/base.py:
#   class GeneratorOutput(TypedDict):
#       prompt_token_ids: List[List[int]]; response_ids: List[List[int]];
#       rewards: Union[List[float], List[List[float]]]; loss_masks: List[List[int]];
#       stop_reasons: Optional[List[str]]; rollout_metrics: Optional[Dict[str, Any]];
#       rollout_logprobs: Optional[List[List[float]]]; trajectory_ids: Optional[List[TrajectoryID]];
#       is_last_step: Optional[List[bool]]
#   @dataclass class TrajectoryID: instance_id: str; repetition_id: int
SKYRL_0_3_1_GENERATOR_OUTPUT = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_metrics",
    "rollout_logprobs",
    "trajectory_ids",
    "is_last_step",
)
# verl 0.9.1, verl/experimental/agent_loop/agent_loop.py, AgentLoopWorker._postprocess: the batch
# TensorDict's keys; prompts padded left, responses right (_agent_loop_postprocess: padding_side);
# ids and masks torch.int64, rollout_log_probs torch.float32, rm_scores float32 with the score at
# the last response token; position_ids = clip(cumsum(attention_mask) - 1, 0) (verl/utils/model.py
# compute_position_id_with_mask); GRPO groups by non_tensor_batch["uid"] (ray_trainer.py).
VERL_0_9_1_TENSORS = {
    "prompts": torch.int64,
    "responses": torch.int64,
    "response_mask": torch.int64,
    "input_ids": torch.int64,
    "attention_mask": torch.int64,
    "position_ids": torch.int64,
    "rollout_log_probs": torch.float32,
    "rm_scores": torch.float32,
}
# verifiers 0.1.14, verifiers/types.py: TrajectoryStepTokens, TrajectoryStep, RolloutOutput's
# required fields ("example_id, prompt, completion, reward, timing, is_completed, is_truncated, metrics").
VERIFIERS_0_1_14_STEP_TOKENS = {
    "prompt_ids": list,
    "prompt_mask": list,
    "completion_ids": list,
    "completion_mask": list,
    "completion_logprobs": list,
    "overlong_prompt": bool,
    "is_truncated": bool,
    "routed_experts": type(None),
}
VERIFIERS_0_1_14_STEP = (
    "prompt",
    "completion",
    "response",
    "tokens",
    "reward",
    "advantage",
    "is_truncated",
    "trajectory_id",
    "extras",
)
VERIFIERS_0_1_14_ROLLOUT_REQUIRED = (
    "example_id",
    "prompt",
    "completion",
    "reward",
    "timing",
    "is_completed",
    "is_truncated",
    "metrics",
)


def _say(engine: FakeSGLang, tok: Tokenizer, text: str, close: bool = True) -> None:
    ids = tok.encode(text, add_special_tokens=False).ids
    engine.push([*ids, token_id(tok, "<|im_end|>")] if close else ids)


def _turn(url: str, session: str, messages: list[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    body = {"model": "m", "messages": messages, "max_tokens": 32, **extra}
    response = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return [c["message"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def _record_group(url: str, engine: FakeSGLang, tok: Tokenizer) -> None:
    """Group "prompt-7" of two rollouts. Sample 0 branches (n=2 at its first turn), is cut by
    max_tokens and continued (a synthesized close), then restarts from a summary (a second
    segment); it has a reward and a call reward. Sample 1 is one turn."""
    with TitoClient(url) as client:
        client.create_session("r0", group_id="prompt-7", sample_index=0, group_size=2)
        history: list[dict[str, Any]] = [{"role": "user", "content": "solve it"}]
        _say(engine, tok, "option one")
        _say(engine, tok, "option two")
        kept = _turn(url, "r0", history, n=2)[1]
        history += [kept, {"role": "user", "content": "more"}]
        _say(engine, tok, "a long answer that goes on", close=False)
        history += [*_turn(url, "r0", history, max_tokens=3), {"role": "user", "content": "go on"}]
        _say(engine, tok, "done")
        _turn(url, "r0", history)
        _say(engine, tok, "fresh start")
        summary = [{"role": "user", "content": "summary: solved it halfway"}]
        summary += [*_turn(url, "r0", summary), {"role": "user", "content": "finish"}]
        _say(engine, tok, "the end")
        _turn(url, "r0", summary)
        client.reward("r0", 1.0, call_rewards={3: 0.5})
        client.finish("r0")
        headers = {"X-Tito-Group-Id": "prompt-7", "X-Tito-Sample-Index": "1"}
        _say(engine, tok, "quick answer")
        body = {"model": "m", "messages": [{"role": "user", "content": "solve it"}], "max_tokens": 32}
        answer = httpx.post(f"{url}/sessions/r1/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        client.reward("r1", 0.0)
        client.finish("r1")


@pytest.fixture
def group(start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer) -> Iterator[str]:
    with start_proxy() as url:
        _record_group(url, engine, qwen_tokenizer)
        yield url


def _rows(url: str, mode: str) -> list[dict[str, Any]]:
    with TitoClient(url) as client:
        return list(client.iter_samples(mode, whole_groups=True))  # type: ignore[arg-type]


def test_the_recorded_group_is_branched_multi_segment_and_rewarded(group: str) -> None:
    merged = _rows(group, "merged")
    r0 = [r for r in merged if r["session_id"] == "r0"]
    assert sorted((r["segment_id"], r["branch"], r["num_calls"]) for r in r0) == [
        (1, "sample", 1),  # each first call opens a segment: the n=2 choices are two
        (2, "final", 3),
        (3, "final", 2),  # the restart from a summary
    ]
    assert any(e["kind"] == "truncation_close_synthesized" for r in r0 for e in r["boundary_edits"])
    assert {r["reward"] for r in r0} == {1.0}
    assert 0.5 in [c for r in r0 for c in r["call_rewards"]]
    assert [(r["session_id"], r["group_id"], r["sample_index"]) for r in merged][-1] == ("r1", "prompt-7", 1)


def _skyrl_validate(output: dict[str, Any], count: int) -> None:
    """skyrl-train 0.3.1 skyrl_train/utils/trainer_utils.py validate_generator_output, its checks."""
    assert len(output["response_ids"]) == count == len(output["prompt_token_ids"])
    for key in ("response_ids", "loss_masks", "rewards", "rollout_logprobs"):
        assert len(output[key]) == len(output["response_ids"])
    for response, mask, reward in zip(
        output["response_ids"], output["loss_masks"], output["rewards"], strict=True
    ):
        assert len(response) == len(mask)
        if isinstance(reward, list):
            assert len(reward) == len(response)


def test_skyrl_generator_output_merged_and_stepwise(group: str) -> None:
    merged = _rows(group, "merged")
    output = generator_output(merged)
    assert tuple(output) == SKYRL_0_3_1_GENERATOR_OUTPUT == GENERATOR_OUTPUT_KEYS
    _skyrl_validate(output, len(merged))
    for index, row in enumerate(merged):  # the round trip: every recorded value, unchanged
        assert output["prompt_token_ids"][index] == row["prompt_ids"]
        assert output["response_ids"][index] == row["response_ids"]
        assert output["loss_masks"][index] == row["loss_mask"]
        assert output["rollout_logprobs"][index] == row["rollout_logprobs"]
        assert output["rewards"][index] == row["reward"]
        assert output["stop_reasons"][index] == row["finish_reasons"][-1]
    assert output["is_last_step"] is None
    ids = [(t.instance_id, t.repetition_id) for t in output["trajectory_ids"]]
    assert len(set(ids)) == len(ids)
    assert {instance for instance, _ in ids} == {"prompt-7"}

    steps = _rows(group, "stepwise")
    stepwise = generator_output(steps)
    _skyrl_validate(stepwise, len(steps))
    assert stepwise["is_last_step"] == [s["is_last_step"] for s in steps]
    # The session's reward is on each step a merged row ends at (each sample's, the final one's).
    ends = {row["call_ids"][-1]: row["reward"] for row in merged}
    assert [sum(r) for r in stepwise["rewards"]] == [
        (ends[s["call_id"]] if ends[s["call_id"]] is not None else s["call_reward"] or 0.0)
        if s["call_id"] in ends
        else s["call_reward"] or 0.0
        for s in steps
    ]
    per_session = {s["session_id"]: t for s, t in zip(steps, stepwise["trajectory_ids"], strict=True)}
    assert {(t.instance_id, t.repetition_id) for t in per_session.values()} == {
        ("prompt-7", 0),
        ("prompt-7", 1),
    }
    reordered = generator_output(steps, order=["r1", "r0"])
    assert reordered["response_ids"][0] == steps[-1]["response_ids"]  # r1's single step first
    assert reordered["response_ids"][1:] == stepwise["response_ids"][:-1]
    # Step-wise rows merge back into exactly the merged rows.
    rebuilt = merge_steps(steps)
    for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "call_ids"):
        assert sorted(map(str, (r[key] for r in rebuilt))) == sorted(map(str, (r[key] for r in merged)))


def test_verl_batch_has_verls_names_dtypes_and_padding(group: str) -> None:
    merged = _rows(group, "merged")
    batch = verl_batch(merged, pad_id=-1, as_torch=True)
    assert {k: v.dtype for k, v in batch.tensors.items()} == VERL_0_9_1_TENSORS
    prompts, responses = batch.tensors["prompts"], batch.tensors["responses"]
    width_p, width_r = prompts.shape[1], responses.shape[1]
    for index, row in enumerate(merged):
        p, r = len(row["prompt_ids"]), len(row["response_ids"])
        assert prompts[index, width_p - p :].tolist() == row["prompt_ids"]  # left-padded
        assert set(prompts[index, : width_p - p].tolist()) <= {-1}
        assert responses[index, :r].tolist() == row["response_ids"]  # right-padded
        assert batch.tensors["response_mask"][index, :r].tolist() == row["loss_mask"]
        assert batch.tensors["response_mask"][index, r:].sum() == 0
        assert np.allclose(batch.tensors["rollout_log_probs"][index, :r].numpy(), row["rollout_logprobs"])
        assert batch.tensors["rm_scores"][index].tolist()[r - 1] == row["reward"]
        attention = batch.tensors["attention_mask"][index]
        assert attention.sum() == p + r
        assert (
            batch.tensors["input_ids"][index][attention.bool()].tolist()
            == row["prompt_ids"] + row["response_ids"]
        )
        positions = batch.tensors["position_ids"][index][attention.bool()].tolist()
        assert positions == list(range(p + r))
    assert batch.tensors["input_ids"].shape == (len(merged), width_p + width_r)
    assert list(batch.non_tensors["uid"]) == ["prompt-7"] * len(merged)
    # verl's agent loops count the prompt, each assistant turn and each observation between two.
    assert list(batch.non_tensors["__num_turns__"]) == [2 * row["num_calls"] for row in merged]
    plain = verl_batch(merged)
    assert plain.tensors["prompts"].dtype == np.int64
    assert plain.tensors["rollout_log_probs"].dtype == np.float32
    with pytest.raises(ValueError, match="response_length"):
        verl_batch(merged, response_length=2)
    with pytest.raises(ValueError, match="merged rows"):
        verl_batch(_rows(group, "stepwise"))


def test_verifiers_rollout_outputs_round_trip(group: str) -> None:
    steps = _rows(group, "stepwise")
    outputs = rollout_outputs(steps)
    assert [o["info"]["session_id"] for o in outputs] == ["r0", "r1"]
    assert [o["reward"] for o in outputs] == [1.0, 0.0]
    assert len({o["example_id"] for o in outputs}) == 1
    for output in outputs:
        assert set(VERIFIERS_0_1_14_ROLLOUT_REQUIRED) <= set(output)
        for step in output["trajectory"]:
            assert tuple(step) == VERIFIERS_0_1_14_STEP
            assert {k: type(v) for k, v in step["tokens"].items()} == VERIFIERS_0_1_14_STEP_TOKENS
    # Back to step rows, and merged: the merged export, token for token.
    back = [
        {
            "trajectory_id": step["trajectory_id"],
            "prompt_ids": step["tokens"]["prompt_ids"],
            "response_ids": step["tokens"]["completion_ids"],
            "loss_mask": step["tokens"]["completion_mask"],
            "rollout_logprobs": step["tokens"]["completion_logprobs"],
            "call_id": step["extras"]["call_id"],
        }
        for output in outputs
        for step in output["trajectory"]
    ]
    merged = _rows(group, "merged")
    rebuilt = merge_steps(back)
    for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "call_ids"):
        assert sorted(map(str, (r[key] for r in rebuilt))) == sorted(map(str, (r[key] for r in merged)))
    truncated = [s["tokens"]["is_truncated"] for o in outputs for s in o["trajectory"]]
    assert truncated.count(True) == 1  # the turn cut by max_tokens


def test_verifiers_example_ids_never_share_a_number_between_groups(group: str) -> None:
    [step, *_] = _rows(group, "stepwise")

    def ids(groups: list[str]) -> list[int]:
        rows = [{**step, "session_id": f"s{i}", "group_id": g} for i, g in enumerate(groups)]
        return [o["example_id"] for o in rollout_outputs(rows)]

    assert ids(["7", "3", "7"]) == [7, 3, 7]  # a dataset's row indices are kept
    assert ids(["alpha", "beta", "1"]) == [0, 1, 2]  # "1" and the second named group: not both 1
    assert ids(["1", "01"]) == [0, 1]  # one number, two groups
