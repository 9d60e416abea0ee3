"""A built-in CPU engine on transformers: slow, exact, and good for trying the proxy without a GPU.

It samples token by token with a KV cache and reports logprobs the way SGLang does:
log_softmax(logits / temperature), taken before top-k/top-p/min-p truncation. One request samples at
a time (a lock shared by all sessions), so every generation is bounded (a default max_new_tokens) and
cancellable between tokens: a request that is cancelled or aborted, or a server shutting down, stops
it and frees the lock for the next.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np

from proxy.engines.base import (
    ContextLimits,
    EngineInfo,
    FinishReason,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
    TopLogprobs,
)
from proxy.errors import EngineError, InvalidRequest, UnsupportedParameter

# max_new_tokens of a request that sets no max_tokens: a CPU turn up to the whole context would hold
# the lock for hours.
DEFAULT_MAX_NEW_TOKENS = 512
# Below this temperature sampling is greedy, as SGLang's sampling params make it (logits divided by
# 1e-38 overflow float32, and no sample could differ from the argmax anyway).
GREEDY_BELOW_TEMPERATURE = 1e-6
# How often a request waiting for the lock checks whether it was cancelled.
_LOCK_POLL_S = 0.05
# Called from the sampling thread with each sampled token, its logprob and its alternatives.
OnToken = Callable[[int, float, TopLogprobs | None], None]


class LocalEngine:
    """Runs a Hugging Face causal LM in this process, one request at a time."""

    name = "local"
    supports_constraints = False

    def __init__(
        self,
        model_dir: Path,
        *,
        weight_version: str | None = None,
        default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    ) -> None:
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
        self._cache_name = _kv_cache_name(self._model)
        self._model_dir = model_dir
        config = self._model.config
        self._vocab_size = int(config.vocab_size)
        # Ids the tokenizer knows: a model's embedding rows past them are padding (the demo model's
        # 151,680 against Qwen's 151,669 ids), never sampled, and left out of every logprob.
        self._cached_tokenizer = _model_tokenizer(model_dir)  # also decodes for stop strings
        known = (
            self._cached_tokenizer.get_vocab_size(with_added_tokens=True) if self._cached_tokenizer else None
        )
        self._output_vocab = min(self._vocab_size, known or self._vocab_size)
        self._context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        eos = getattr(self._model.generation_config, "eos_token_id", None)
        self._eos_ids: tuple[int, ...] = (
            tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        )
        self._weight_version = weight_version
        self.limits = ContextLimits(default_max_new_tokens=default_max_new_tokens)
        self._lock = threading.Lock()
        # The cancel flag of every generation in flight, and of the streams by request id.
        self._running: set[threading.Event] = set()
        self._streams: dict[str, threading.Event] = {}

    def _prompt(self, prompt: PromptIds) -> list[int]:
        input_ids = [int(token) for token in prompt]
        if not input_ids:
            raise InvalidRequest("empty prompt")
        if max(input_ids) >= self._vocab_size or min(input_ids) < 0:
            raise InvalidRequest("prompt holds a token id outside the model's vocabulary")
        return input_ids

    async def generate(
        self,
        prompt: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        _refuse_unsupported(params)
        cancel = threading.Event()
        if request_id is not None:
            self._streams[request_id] = cancel  # abort(request_id) stops it between two tokens
        try:
            return await self._run(self._prompt(prompt), params, cancel, None)
        finally:
            if request_id is not None:
                self._streams.pop(request_id, None)

    async def _run(
        self, input_ids: list[int], params: SamplingParams, cancel: threading.Event, on_token: OnToken | None
    ) -> Generation:
        """Sample in a worker thread; if the caller is cancelled, the thread stops at its next token."""
        self._running.add(cancel)
        try:
            return await asyncio.to_thread(self._generate_blocking, input_ids, params, cancel, on_token)
        except asyncio.CancelledError:
            cancel.set()
            raise
        finally:
            self._running.discard(cancel)

    def _generate_blocking(
        self, input_ids: list[int], params: SamplingParams, cancel: threading.Event, on_token: OnToken | None
    ) -> Generation:
        while not self._lock.acquire(timeout=_LOCK_POLL_S):
            if cancel.is_set():
                return self._aborted([], [], None)
        try:
            with self._torch.inference_mode():
                return self._sample(input_ids, params, cancel, on_token)
        except RuntimeError as exc:  # e.g. a NaN in the logits: torch refuses to sample
            raise EngineError(f"the local engine failed to sample: {exc}") from exc
        finally:
            self._lock.release()

    def _aborted(self, output: list[int], logprobs: list[float], top: list[TopLogprobs] | None) -> Generation:
        return Generation(
            output_ids=output,
            logprobs=logprobs,
            finish=FinishReason("abort", message="cancelled"),
            weight_version=self._weight_version,
            top_logprobs=top,
        )

    def _sample(
        self, input_ids: list[int], params: SamplingParams, cancel: threading.Event, on_token: OnToken | None
    ) -> Generation:
        torch = self._torch
        # numpy's PCG64 takes the whole 64-bit seed (torch's CPU generator keeps only its low 32 bits,
        # so seeds 1 and 2**32 + 1 would sample alike).
        generator = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
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
            budget = self.limits.default_max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        for _ in range(max(budget, 0)):
            if cancel.is_set():
                return self._aborted(output, logprobs, top if params.top_logprobs else None)
            result = self._model(input_ids=step_input, use_cache=True, **{self._cache_name: past})
            past = getattr(result, self._cache_name)
            logits = result.logits[0, -1, : self._output_vocab].float()
            logits = self._apply_penalties(logits, counts, input_ids, params)
            token, logprob = self._pick(logits, params, generator)
            if params.top_logprobs:
                top.append(self._alternatives(logits, params))
            if on_token is not None:
                on_token(token, logprob, top[-1] if params.top_logprobs else None)
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
        scale = params.temperature if params.temperature >= GREEDY_BELOW_TEMPERATURE else 1.0
        values, ids = torch.topk(torch.log_softmax(logits / scale, dim=-1), params.top_logprobs)
        return [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]

    def _apply_penalties(
        self, logits: Any, counts: dict[int, int], prompt: list[int], params: SamplingParams
    ) -> Any:
        torch = self._torch
        if params.repetition_penalty != 1.0:
            # Only ids with a logit here: a token-id prompt may hold padding ids the model embeds.
            seen_ids = sorted(token for token in set(prompt) | set(counts) if token < self._output_vocab)
            seen = torch.tensor(seen_ids, dtype=torch.long)
            values = logits[seen]
            logits[seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
        if counts and (params.presence_penalty or params.frequency_penalty):
            ids = torch.tensor(list(counts), dtype=torch.long)
            freq = torch.tensor(list(counts.values()), dtype=logits.dtype)
            logits[ids] -= params.frequency_penalty * freq + params.presence_penalty
        return logits

    def _pick(self, logits: Any, params: SamplingParams, generator: np.random.Generator) -> tuple[int, float]:
        torch = self._torch
        if params.temperature < GREEDY_BELOW_TEMPERATURE:
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
        # Inverse transform sampling: the first id whose cumulative probability passes a uniform draw
        # (an id of probability 0 never does).
        cumulative = torch.cumsum(probs.double(), dim=-1)
        draw = generator.random() * float(cumulative[-1])
        token = int(torch.searchsorted(cumulative, torch.tensor([draw], dtype=torch.float64), right=True))
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
        tokenizer = self._cached_tokenizer
        if tokenizer is None:  # no tokenizer.json: loading it raises tokenizers' own error
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(self._model_dir / "tokenizer.json"))
            self._cached_tokenizer = tokenizer
        return tokenizer

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        _refuse_unsupported(params)
        return self._chunks(self._prompt(input_ids), params, request_id)

    async def _chunks(
        self, input_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[StreamChunk]:
        """One chunk per sampled token as the thread samples it, then one with the finish reason."""
        loop = asyncio.get_running_loop()
        sampled: asyncio.Queue[StreamChunk] = asyncio.Queue()

        def on_token(token: int, logprob: float, top: TopLogprobs | None) -> None:
            chunk = StreamChunk([token], [logprob], top_logprobs=None if top is None else [top])
            loop.call_soon_threadsafe(sampled.put_nowait, chunk)

        cancel = self._streams[request_id] = threading.Event()
        run = asyncio.ensure_future(self._run(input_ids, params, cancel, on_token))
        run.add_done_callback(_retrieved)
        waiter: asyncio.Future[StreamChunk] | None = None
        try:
            # The thread's token callbacks reach the loop before its result does: none is lost.
            while not (run.done() and sampled.empty()):
                if not sampled.empty():
                    yield sampled.get_nowait()
                    continue
                waiter = asyncio.ensure_future(sampled.get())
                await asyncio.wait({waiter, run}, return_when=asyncio.FIRST_COMPLETED)
                if waiter.done():
                    yield waiter.result()
                else:
                    waiter.cancel()  # the run ended with every chunk already taken
            generation = run.result()
            top: list[TopLogprobs] | None = None if generation.top_logprobs is None else []
            yield StreamChunk([], [], generation.finish, generation.weight_version, top_logprobs=top)
        finally:
            if waiter is not None:
                waiter.cancel()  # left waiting when the consumer stopped early
            cancel.set()  # a no-op once finished; else the thread stops at its next token
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        cancel = self._streams.get(request_id)
        if cancel is not None:
            cancel.set()

    async def info(self) -> EngineInfo:
        return EngineInfo(
            model=self._model_dir.name,
            context_length=self._context_length,
            weight_version=self._weight_version,
        )

    async def ready(self) -> bool:
        return True

    async def aclose(self) -> None:
        # Shutting down: whatever still samples stops at its next token, so the process can exit.
        for cancel in [*self._running, *self._streams.values()]:
            cancel.set()


def _retrieved(run: asyncio.Future[Generation]) -> None:
    """Marks a finished run's outcome as seen: a stream closed early never reads it."""
    if not run.cancelled():
        run.exception()


def _refuse_unsupported(params: SamplingParams) -> None:
    """The local engine runs the base weights only, and records no MoE routing."""
    if params.adapter is not None:
        raise UnsupportedParameter(
            f"the local engine serves no LoRA adapters (asked for {params.adapter!r})", param="model"
        )
    if params.routed_experts is not None:
        raise UnsupportedParameter("the local engine cannot return routed experts", param="model")


def _kv_cache_name(model: Any) -> str:
    """What the model's forward calls its key/value cache, in and out.

    transformers 5.24 renamed `past_key_values` to `cache` and warns on the old name; older
    releases know only the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _model_tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer, or None for a model directory without tokenizer.json."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
