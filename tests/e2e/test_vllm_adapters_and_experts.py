"""vLLM: a LoRA adapter is named in `model` (never SGLang's `lora_path`), an adapter vLLM no longer
serves is a 404 model_not_found, and routed experts come from `routed_experts_prompt_start` and the
last chunk's `.npy` array, concatenated over a resumed generation (vLLM 0.33.0's shapes,
../shared/docs/vllm-generate.md)."""

from __future__ import annotations

from typing import Any

import httpx
from tokenizers import Tokenizer

from tests.e2e.test_vllm import VLLMProxy, vllm, vllm_proxy  # noqa: F401  (fixtures)
from tests.fakes.sglang import routing
from tests.fakes.vllm import FakeVLLM
from tests.support import stream_events

USER = [{"role": "user", "content": "hi"}]
SHAPE = (2, 3)


def _chat(url: str, session: str, **body: Any) -> httpx.Response:
    payload = {"model": "m", "messages": USER, "max_tokens": 32, **body}
    return httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=payload, timeout=30)


def _step(url: str, session: str) -> dict[str, Any]:
    [row] = httpx.get(f"{url}/sessions/{session}/samples").json()["samples"]
    return dict(row)


def test_vllm_samples_an_adapter_by_its_model_name(vllm: FakeVLLM, vllm_proxy: VLLMProxy) -> None:  # noqa: F811
    vllm.adapters["sql-lora"] = "/adapters/sql"
    with vllm_proxy() as url:
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(card["id"], card["parent"]) for card in listed] == [
            ("fake-vllm-model", None),
            ("sql-lora", "fake-vllm-model"),
        ]
        assert _chat(url, "v-lora", model="sql-lora").status_code == 200
        assert vllm.requests[-1]["model"] == "sql-lora"
        assert "lora_path" not in vllm.requests[-1]
        assert _step(url, "v-lora")["adapter"] == "sql-lora"
        assert _chat(url, "v-base", model="other").status_code == 200
        assert "model" not in vllm.requests[-1]  # the base model
        del vllm.adapters["sql-lora"]
        gone = _chat(url, "v-gone", model="sql-lora")
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "model_not_found"


def test_vllm_routed_experts_are_recorded_through_a_resumed_stream(
    vllm: FakeVLLM,  # noqa: F811
    vllm_proxy: VLLMProxy,  # noqa: F811
    qwen_tokenizer: Tokenizer,
) -> None:
    vllm.routed_experts_shape = SHAPE
    words = qwen_tokenizer.encode("one two three four five", add_special_tokens=False).ids
    eos = vllm.eos_ids[0]
    with vllm_proxy(record_routed_experts=True) as url:
        for session, streamed in (("v-moe", False), ("v-moe-s", True)):
            vllm.requests.clear()
            vllm.abort_at.append(2)  # a weight update's abort after 2 tokens
            vllm.push([*words, eos])
            vllm.push([*words[2:], eos])
            body = {"model": "m", "messages": USER, "max_tokens": 32, "stream": streamed}
            if streamed:
                stream_events(url, body, session)
            else:
                assert _chat(url, session).status_code == 200
            first, second = vllm.requests
            assert first["sampling_params"]["routed_experts_prompt_start"] == 0
            assert second["sampling_params"]["routed_experts_prompt_start"] == len(first["token_ids"]) + 1
            row = _step(url, session)
            ids = row["prompt_ids"] + row["response_ids"]
            assert row["response_ids"] == [*words, eos]
            assert row["routed_experts"] == [routing(p, ids[p], SHAPE) for p in range(len(ids) - 1)]
