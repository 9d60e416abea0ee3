"""A built-in CPU engine on transformers: slow, exact, and good for trying the proxy without a GPU.

It samples token by token with a KV cache and reports logprobs the way SGLang does:
log_softmax(logits / temperature), taken before top-k/top-p/min-p truncation.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from proxy.engines.base import (
    EngineInfo,
    FinishReason,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
    TopLogprobs,
)
from proxy.errors import InvalidRequest


class LocalEngine:
    """Runs a Hugging Face causal LM in this process, one request at a time."""

    name = "local"
    supports_constraints = False

    def __init__(self, model_dir: Path, *, weight_version: str | None = None) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "the local engine needs the 'local' extra: pip install 'tito-proxy[local]'"
            ) from exc
        self._torch = torch
        torch.set_num_threads(max(1, torch.get_num_threads()))
        self._model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self._model.train(False)  # inference mode: no dropout
        self._model_dir = model_dir
        config = self._model.config
        self._vocab_size = int(config.vocab_size)
        self._context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        eos = getattr(self._model.generation_config, "eos_token_id", None)
        self._eos_ids: tuple[int, ...] = (
            tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        )
        self._weight_version = weight_version
        self._lock = threading.Lock()

    async def generate(
        self, prompt: PromptIds, params: SamplingParams, request_id: str | None = None
    ) -> Generation:
        input_ids = [int(token) for token in prompt]
        if not input_ids:
            raise InvalidRequest("empty prompt")
        if max(input_ids) >= self._vocab_size or min(input_ids) < 0:
            raise InvalidRequest("prompt holds a token id outside the model's vocabulary")
        return await asyncio.to_thread(self._generate_blocking, input_ids, params)

    def _generate_blocking(self, input_ids: list[int], params: SamplingParams) -> Generation:
        with self._lock, self._torch.inference_mode():
            return self._sample(input_ids, params)

    def _sample(self, input_ids: list[int], params: SamplingParams) -> Generation:
        torch = self._torch
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        stop_ids = set(params.stop_token_ids) | set(self._eos_ids)
        output: list[int] = []
        logprobs: list[float] = []
        top: list[TopLogprobs] = []
        counts: dict[int, int] = {}
        past: Any = None
        step_input = torch.tensor([input_ids], dtype=torch.long)
        finish = FinishReason("length")
        budget = params.max_new_tokens
        if budget is None:
            budget = (self._context_length or len(input_ids) + 1024) - len(input_ids)
        for _ in range(max(budget, 0)):
            result = self._model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = result.past_key_values
            logits = result.logits[0, -1].float()
            logits = self._apply_penalties(logits, counts, input_ids, params)
            token, logprob = self._pick(logits, params, generator)
            if params.top_logprobs:
                top.append(self._alternatives(logits, params))
            output.append(token)
            logprobs.append(logprob)
            counts[token] = counts.get(token, 0) + 1
            if token in stop_ids:
                finish = FinishReason("stop", matched_token=token)
                break
            matched = self._matched_stop_string(output, params.stop)
            if matched is not None:
                finish = FinishReason("stop", matched_text=matched)
                break
            step_input = torch.tensor([[token]], dtype=torch.long)
        return Generation(
            output_ids=output,
            logprobs=logprobs,
            finish=finish,
            weight_version=self._weight_version,
            top_logprobs=top if params.top_logprobs else None,
        )

    def _alternatives(self, logits: Any, params: SamplingParams) -> TopLogprobs:
        """The best alternatives, with logprobs on the same scale as the sampled token's."""
        torch = self._torch
        scale = params.temperature if params.temperature > 0.0 else 1.0
        values, ids = torch.topk(torch.log_softmax(logits / scale, dim=-1), params.top_logprobs)
        return [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]

    def _apply_penalties(
        self, logits: Any, counts: dict[int, int], prompt: list[int], params: SamplingParams
    ) -> Any:
        torch = self._torch
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(counts)), dtype=torch.long)
            values = logits[seen]
            logits[seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
        if counts and (params.presence_penalty or params.frequency_penalty):
            ids = torch.tensor(list(counts), dtype=torch.long)
            freq = torch.tensor(list(counts.values()), dtype=logits.dtype)
            logits[ids] -= params.frequency_penalty * freq + params.presence_penalty
        return logits

    def _pick(self, logits: Any, params: SamplingParams, generator: Any) -> tuple[int, float]:
        torch = self._torch
        if params.temperature == 0.0:
            token = int(torch.argmax(logits))
            return token, float(torch.log_softmax(logits, dim=-1)[token])
        scaled_logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        probs = scaled_logprobs.exp()
        if params.top_k > 0:
            kth = torch.topk(probs, min(params.top_k, probs.numel())).values[-1]
            probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > params.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        if params.min_p > 0.0:
            probs = torch.where(probs < params.min_p * probs.max(), torch.zeros_like(probs), probs)
        token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
        return token, float(scaled_logprobs[token])

    def _matched_stop_string(self, output: list[int], stops: tuple[str, ...]) -> str | None:
        if not stops:
            return None
        tokenizer = self._tokenizer()
        tail = tokenizer.decode(output[-64:], skip_special_tokens=False)
        for stop in stops:
            if stop in tail:
                return stop
        return None

    def _tokenizer(self) -> Any:
        tokenizer = getattr(self, "_cached_tokenizer", None)
        if tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(self._model_dir / "tokenizer.json"))
            self._cached_tokenizer = tokenizer
        return tokenizer

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str
    ) -> AsyncIterator[StreamChunk]:
        # The CPU engine samples the whole turn, then hands it over as one chunk.
        generation = await self.generate(input_ids, params)
        return _single_chunk(generation)

    async def abort(self, request_id: str) -> None:
        return None

    async def info(self) -> EngineInfo:
        return EngineInfo(
            model=self._model_dir.name,
            context_length=self._context_length,
            weight_version=self._weight_version,
        )

    async def ready(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


async def _single_chunk(generation: Generation) -> AsyncIterator[StreamChunk]:
    yield StreamChunk(
        generation.output_ids,
        generation.logprobs,
        generation.finish,
        generation.weight_version,
        top_logprobs=generation.top_logprobs,
    )
