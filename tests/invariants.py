"""Assertions of the invariants I1-I6 of chat-templates.md on an exported segment."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tests.fakes.sglang import ScriptedOutput


def assert_invariants(
    segment: dict[str, Any], engine_requests: Sequence[dict[str, Any]], outputs: Sequence[ScriptedOutput]
) -> None:
    """`engine_requests[k]` and `outputs[k]` are what the engine received and sampled for call k."""
    prompt = segment["prompt_ids"]
    response = segment["response_ids"]
    mask = segment["loss_mask"]
    logprobs = segment["rollout_logprobs"]
    stream = prompt + response
    # I4 alignment.
    assert len(response) == len(mask) == len(logprobs)
    expected_mask = [0] * len(response)
    expected_logprobs = [0.0] * len(response)
    previous: list[int] | None = None
    for request, output in zip(engine_requests, outputs, strict=True):
        # SGLang's input_ids; vLLM's token_ids (/inference/v1/generate) or prompt (/v1/completions).
        sent = request.get("input_ids") or request.get("token_ids") or request["prompt"]
        # I6: what the engine got is exactly the exported stream up to that call.
        assert stream[: len(sent)] == sent
        # I2: each prompt extends the previous prompt + output verbatim.
        if previous is not None:
            assert sent[: len(previous)] == previous
        # I1: the sampled ids follow, verbatim.
        start = len(sent) - len(prompt)
        assert response[start : start + len(output.ids)] == output.ids
        for offset, value in enumerate(output.logprobs):
            expected_mask[start + offset] = 1
            expected_logprobs[start + offset] = value
        previous = sent + output.ids
    # I3: mask 1 exactly on sampled tokens; I4: their logprobs are the engine's, 0.0 elsewhere.
    assert mask == expected_mask
    np.testing.assert_allclose(
        np.asarray(logprobs), np.asarray(expected_logprobs, dtype=np.float32), rtol=1e-6
    )
    assert [v for v, m in zip(logprobs, mask, strict=True) if m == 0] == [0.0] * mask.count(0)
