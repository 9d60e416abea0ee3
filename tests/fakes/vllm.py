"""A real HTTP server that speaks vLLM's token routes as vLLM 0.33.0's source defines them, with
scripted token ids and logprobs (../shared/docs/vllm-generate.md has every shape with its source file).

Shapes served (vLLM 0.33.0, `scale_out/token_in_token_out/protocol.py`, `serving.py`,
`entrypoints/openai/completion/`, `entrypoints/rl/online/api_router.py`):

- `POST /inference/v1/generate` `{"request_id", "token_ids": [int], "sampling_params": {...},
  "stream", "output_mode": "tokens"}` -> `{"request_id": "generate-tokens-<id>", "model", "created",
  "usage": {"prompt_tokens", "total_tokens", "completion_tokens", ...}, ..., "output_mode": "tokens",
  "choices": [{"index": 0, "finish_reason": "stop"|"length"|"abort", "stop_reason": null|int|str,
  "token_ids": [int], "routed_experts": null (base64 .npy with routed_experts_prompt_start on a
  server given routed_experts_shape), "sampling_mask": null,
  "weight_versions": [{"version", "start", "end"}], "logprobs": {"content": [{"token_id", "logprob",
  "rank", "top_logprobs": [sampled first, then the top k]}]}}]}`. Streamed: deltas, one token per
  chunk, `finish_reason`/`stop_reason`/`weight_versions` only in the last, then `data: [DONE]`;
  errors the engine finds come as HTTP 200 and `data: {"error": {...}}`. Without
  `--enable-scale-out` (scale_out=False): 403 PermissionDeniedError.
- `POST /v1/completions` with `prompt: [int]`, `return_token_ids`, `return_tokens_as_token_ids`:
  `choices[0]` has `text`, `token_ids`, `prompt_token_ids`, `finish_reason`, `stop_reason`,
  `weight_versions` (with `return_weight_versions`), `logprobs: {"text_offset", "token_logprobs",
  "tokens": ["token_id:N"], "top_logprobs": [{"token_id:N": lp, ...}]}` (the first logprobs + 1
  candidates, sampled first). `max_tokens` null or omitted is 16; prompt + max_tokens beyond the
  context is clamped.
- `GET /version` `{"version": "0.33.0"}`; `GET /v1/models` cards `owned_by: "vllm"` with
  `max_model_len`; `GET /health` 200 empty; dev mode only (VLLM_SERVER_DEV_MODE=1): `/server_info`,
  `/pause`, `/resume`, `/is_paused`, `/update_weight_version`, `/weight_info`, `/abort_requests`.
- Sampling keys vLLM does not know are dropped silently; the stand-in lists them in `ignored`.
- Errors: `{"error": {"message", "type", "param", "code"}}`; unknown routes `{"detail": "Not Found"}`;
  with an api key, `/v1` and `/inference` need `Authorization: Bearer <key>`, else 401
  `{"error": "Unauthorized"}`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer

from tests.fakes.sglang import ScriptedOutput, routing

# vLLM 0.33.0's SamplingParams fields (sampling_params.py); anything else is dropped silently.
SAMPLING_KEYS = frozenset(
    {
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "logprob_token_ids",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "structured_outputs",
        "stream_interval",
        "repetition_detection",
        "thinking_token_budget",
        "routed_experts_prompt_start",
        "extra_args",
    }
)
# /v1/completions' own request fields besides the sampling ones (entrypoints/openai/completion/protocol.py).
COMPLETION_KEYS = frozenset(
    {
        "model",
        "prompt",
        "echo",
        "stream",
        "stream_options",
        "suffix",
        "user",
        "best_of",
        "request_id",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "return_weight_versions",
        "cache_salt",
        "priority",
        "session_id",
    }
)
MAX_LOGPROBS = 20


def _error(
    message: str, status: int, kind: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


class _Refused(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind


@dataclass
class _Sample:
    ids: list[int]
    logprobs: list[float]
    finish: str
    stop_reason: int | str | None
    version: str
    prompt: list[int] = field(default_factory=list)
    experts_from: int | None = None  # routed_experts_prompt_start, on a server that returns them


@dataclass
class FakeVLLM:
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]  # the tokenizer's EOS first, then generation_config.json's
    vocab_size: int
    context_length: int = 32768
    model_name: str = "fake-vllm-model"
    version: str = "0.33.0"
    scale_out: bool = True  # --enable-scale-out
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1
    logprobs_mode: str = "raw_logprobs"
    api_key: str | None = None
    weight_version: str = "default"
    script: deque[ScriptedOutput] = field(default_factory=deque)
    requests: list[dict[str, Any]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # sampling keys vLLM would drop silently
    aborted: list[str] = field(default_factory=list)
    # Every sample drawn: prompt, ids, logprobs, version (a cut stream sends a prefix of it).
    sampled: list[dict[str, Any]] = field(default_factory=list)
    paused: bool = False
    # Aborts scripted as a weight update's: the next requests end "abort" after this many tokens,
    # and the weights then carry version_after_abort (when set).
    abort_at: deque[int] = field(default_factory=deque)
    version_after_abort: str | None = None
    chunk_delay_s: float = 0.0
    # Loaded LoRA adapters (name -> path): /v1/models cards with a parent; `model` selects one.
    adapters: dict[str, str] = field(default_factory=dict)
    # (layers, top_k) of a MoE model served with --enable-return-routed-experts; None: served without.
    routed_experts_shape: tuple[int, int] | None = None
    _running: dict[str, asyncio.Event] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def push(self, ids: list[int], logprobs: list[float] | None = None) -> ScriptedOutput:
        if logprobs is None:
            logprobs = [-0.01 * (i % 97 + 1) for i in range(len(ids))]
        scripted = ScriptedOutput(list(ids), list(logprobs))
        self.script.append(scripted)
        return scripted

    @staticmethod
    def prompt_of(body: dict[str, Any]) -> list[int]:
        prompt: list[int] = body.get("token_ids") or body.get("prompt") or []
        return prompt

    # --- the fake distribution: the sampled token is rank 1 at even positions, rank 2 at odd ones ---

    def distribution(self, token: int, logprob: float, position: int, k: int) -> list[tuple[int, float]]:
        """The k most likely tokens at this position, best first."""
        size = self.vocab_size
        runners = [((token + r) % size, logprob - r) for r in range(1, k + 1)]
        if position % 2:  # a likelier token than the sampled one
            ranked = [((token + 1) % size, logprob + 0.1), (token, logprob), *runners[1:]]
        else:
            ranked = [(token, logprob), *runners]
        return ranked[:k]

    def _entry(self, token: int, logprob: float, position: int, k: int) -> dict[str, Any]:
        rank = 2 if position % 2 else 1
        top = [(token, logprob, rank)] + [
            (t, lp, r + 1)
            for r, (t, lp) in enumerate(self.distribution(token, logprob, position, k))
            if t != token
        ]
        return {
            "token_id": token,
            "logprob": logprob,
            "rank": rank,
            "top_logprobs": [{"token_id": t, "logprob": lp, "rank": r} for t, lp, r in top],
        }

    # --- sampling ---

    def _check(self, prompt: Any, params: dict[str, Any]) -> int | None:
        """vLLM's checks; the output cap."""
        self.ignored.extend(sorted(set(params) - SAMPLING_KEYS))
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise _Refused(
                "1 validation error: token_ids must be a non-empty list of ints", kind="Bad Request"
            )
        if self.paused:
            raise _Refused(
                "Generation is paused. Please retry after it resumes.", 503, "ServiceUnavailableError"
            )
        temperature = params.get("temperature", 1.0)
        if not 0 <= temperature <= 2:
            raise _Refused(f"temperature must be in [0, 2], got {temperature}. (parameter=temperature)")
        if not 0 < params.get("top_p", 1.0) <= 1:
            raise _Refused("top_p must be in (0, 1]. (parameter=top_p)")
        logprobs = params.get("logprobs")
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise _Refused(f"Requested sample logprobs of {logprobs}, which is greater than max allowed: 20")
        for token in prompt:
            if not 0 <= token < self.vocab_size:
                raise _Refused(f"Token id {token} is out of vocabulary")
        max_tokens = params.get("max_tokens")
        if max_tokens is not None and max_tokens < 1:
            raise _Refused(f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens)")
        room = self.context_length - len(prompt)
        if room < 1:
            raise _Refused(
                f"The decoder prompt (length {len(prompt)}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {self.context_length}."
            )
        return room if max_tokens is None else min(max_tokens, room)

    def _sample(self, params: dict[str, Any], cap: int | None, prompt: list[int] | None = None) -> _Sample:
        sample = self._draw(params, cap)
        self.sampled.append(
            {"prompt": prompt, "ids": sample.ids, "logprobs": sample.logprobs, "version": sample.version}
        )
        return sample

    def _draw(self, params: dict[str, Any], cap: int | None) -> _Sample:
        with self._lock:
            scripted = self.script.popleft() if self.script else self._default_output()
        eos = self.eos_ids[0]
        ignore_eos = params.get("ignore_eos", False)
        stop_ids = set(params.get("stop_token_ids") or []) | (set() if ignore_eos else set(self.eos_ids[1:]))
        stops = params.get("stop") or []
        ids: list[int] = []
        logprobs: list[float] = []
        with self._lock:
            abort_at = self.abort_at.popleft() if self.abort_at else None
        for token, logprob in zip(scripted.ids, scripted.logprobs, strict=True):
            if abort_at is not None and len(ids) >= abort_at:
                version = self.weight_version
                if self.version_after_abort is not None:
                    self.weight_version = self.version_after_abort
                return _Sample(ids, logprobs, "abort", None, version)
            if cap is not None and len(ids) >= cap:
                return _Sample(ids, logprobs, "length", None, self.weight_version)
            ids.append(token)
            logprobs.append(logprob)
            if token == eos and not ignore_eos:
                return _Sample(ids, logprobs, "stop", None, self.weight_version)
            if token in stop_ids:
                return _Sample(ids, logprobs, "stop", token, self.weight_version)
            text = self.tokenizer.decode(ids, skip_special_tokens=params.get("skip_special_tokens", True))
            for stop in stops:
                if stop in text:
                    return _Sample(ids, logprobs, "stop", stop, self.weight_version)
        return _Sample(ids, logprobs, "length", None, self.weight_version)

    def _default_output(self) -> ScriptedOutput:
        ids = [*self.tokenizer.encode("ok", add_special_tokens=False).ids, self.eos_ids[0]]
        return ScriptedOutput(ids, [-0.5] * len(ids))

    def _authorized(self, request: Request) -> bool:
        return self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}"

    # --- /inference/v1/generate ---

    async def generate(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if not self.scale_out:
            return _error(
                "Scale-out endpoints are disabled. "
                "Restart vllm serve with --enable-scale-out to enable them.",
                403,
                "PermissionDeniedError",
            )
        body = await request.json()
        if not isinstance(body.get("token_ids"), list) or not isinstance(body.get("sampling_params"), dict):
            return _error(
                "1 validation error:\n  {'type': 'missing', 'loc': ('body', 'token_ids')}", 400, "Bad Request"
            )
        self.requests.append(body)
        params = body["sampling_params"]
        rid = f"generate-tokens-{body.get('request_id') or uuid.uuid4().hex}"
        model = body.get("model")
        if model is not None and model != self.model_name and model not in self.adapters:
            return _error(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        try:
            cap = self._check(body["token_ids"], params)
        except _Refused as refused:
            if body.get("stream"):  # found by the engine: a 200 and an error event
                event = {
                    "error": {
                        "message": refused.message,
                        "type": refused.kind,
                        "param": None,
                        "code": refused.status,
                    }
                }
                return StreamingResponse(
                    iter([f"data: {json.dumps(event)}\n\n", "data: [DONE]\n\n"]),
                    media_type="text/event-stream",
                )
            return _error(refused.message, refused.status, refused.kind)
        sample = self._sample(params, cap, body["token_ids"])
        sample.prompt = list(body["token_ids"])
        if self.routed_experts_shape is not None and "routed_experts_prompt_start" in params:
            sample.experts_from = int(params["routed_experts_prompt_start"])
        k = int(params.get("logprobs") or 0)
        if body.get("stream"):
            return StreamingResponse(self._generate_stream(rid, sample, k), media_type="text/event-stream")
        n = len(sample.ids)
        return JSONResponse(
            {
                "request_id": rid,
                "model": self.model_name,
                "created": int(time.time()),
                "usage": {
                    "prompt_tokens": len(body["token_ids"]),
                    "total_tokens": len(body["token_ids"]) + n,
                    "completion_tokens": n,
                    "prompt_tokens_details": None,
                    "completion_tokens_details": None,
                },
                "prompt_logprobs": None,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": body["token_ids"] if body.get("return_token_ids") else None,
                "mm_placeholders": None,
                "metrics": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "output_mode": "tokens",
                "choices": [self._choice(sample, 0, n, k, last=True)],
            }
        )

    def _choice(self, sample: _Sample, start: int, end: int, k: int, *, last: bool) -> dict[str, Any]:
        return {
            "index": 0,
            "finish_reason": sample.finish if last else None,
            "stop_reason": sample.stop_reason if last else None,
            "token_ids": sample.ids[start:end],
            "routed_experts": self._routing(sample) if last else None,
            "sampling_mask": None,
            "weight_versions": [{"version": sample.version, "start": 0, "end": len(sample.ids)}]
            if last
            else None,
            "logprobs": {
                "content": [self._entry(sample.ids[i], sample.logprobs[i], i, k) for i in range(start, end)]
            },
        }

    def _routing(self, sample: _Sample) -> str | None:
        """base64 of a .npy (tokens - 1 from routed_experts_prompt_start, layers, top_k) array."""
        if sample.experts_from is None or self.routed_experts_shape is None:
            return None
        stream = [*sample.prompt, *sample.ids]
        rows = [
            routing(position, stream[position], self.routed_experts_shape)
            for position in range(sample.experts_from, len(stream) - 1)
        ]
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(rows, dtype=np.int32).reshape(-1, *self.routed_experts_shape))
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    async def _generate_stream(self, rid: str, sample: _Sample, k: int) -> Any:
        stop = asyncio.Event()
        self._running[rid] = stop
        try:
            for end in range(1, len(sample.ids) + 1):
                if stop.is_set():
                    kept = end - 1
                    aborted = _Sample(
                        sample.ids[:kept],
                        sample.logprobs[:kept],
                        "abort",
                        None,
                        sample.version,
                        sample.prompt,
                        sample.experts_from,
                    )
                    chunk = self._choice(aborted, end - 1, end - 1, k, last=True)
                    event = {"request_id": rid, "usage": None, "output_mode": "tokens", "choices": [chunk]}
                    yield f"data: {json.dumps(event)}\n\n"
                    break
                choice = self._choice(sample, end - 1, end, k, last=end == len(sample.ids))
                event = {"request_id": rid, "usage": None, "output_mode": "tokens", "choices": [choice]}
                yield f"data: {json.dumps(event)}\n\n"
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            yield "data: [DONE]\n\n"
        finally:
            self._running.pop(rid, None)

    # --- /v1/completions with a token prompt ---

    async def completions(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        body = await request.json()
        self.requests.append(body)
        params = {key: value for key, value in body.items() if key not in COMPLETION_KEYS}
        params.setdefault("max_tokens", 16)
        if params["max_tokens"] is None:
            params["max_tokens"] = 16
        prompt = body.get("prompt")
        rid = f"cmpl-{body.get('request_id') or uuid.uuid4().hex}-0"
        if isinstance(prompt, list) and len(prompt) > self.context_length:
            return _error(
                f"This model's maximum context length is {self.context_length} tokens. However, your prompt "
                f"contains {len(prompt)} input tokens. (parameter=input_tokens, value={len(prompt)})",
                400,
            )
        try:
            cap = self._check(prompt, params)
        except _Refused as refused:
            return _error(refused.message, refused.status, refused.kind)
        sample = self._sample(params, cap, prompt)
        k = int(params.get("logprobs") or 0)
        if body.get("stream"):
            return StreamingResponse(
                self._completion_stream(rid, body, sample, k), media_type="text/event-stream"
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [self._completion_choice(body, sample, 0, len(sample.ids), k, last=True)],
                "service_tier": None,
                "system_fingerprint": f"vllm-{self.version}-1f2e3d4c",
                "usage": {
                    "prompt_tokens": len(prompt),
                    "total_tokens": len(prompt) + len(sample.ids),
                    "completion_tokens": len(sample.ids),
                    "prompt_tokens_details": None,
                    "completion_tokens_details": None,
                },
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )

    def _completion_choice(
        self, body: dict[str, Any], sample: _Sample, start: int, end: int, k: int, *, last: bool
    ) -> dict[str, Any]:
        ids = sample.ids[start:end]
        names = [f"token_id:{t}" for t in ids]
        tops = []
        for i in range(start, end):
            entry = self._entry(sample.ids[i], sample.logprobs[i], i, k)
            tops.append({f"token_id:{c['token_id']}": c["logprob"] for c in entry["top_logprobs"][: k + 1]})
        return {
            "index": 0,
            "text": self.tokenizer.decode(ids, skip_special_tokens=True),
            "finish_reason": sample.finish if last else None,
            "stop_reason": sample.stop_reason if last else None,
            "logprobs": {
                "text_offset": [sum(len(n) for n in names[:i]) for i in range(len(names))],
                "token_logprobs": sample.logprobs[start:end],
                "tokens": names,
                "top_logprobs": tops,
            },
            "token_ids": ids if body.get("return_token_ids") else None,
            "prompt_logprobs": None,
            "prompt_token_ids": body["prompt"] if body.get("return_token_ids") and start == 0 else None,
            "routed_experts": None,
            "weight_versions": [{"version": sample.version, "start": 0, "end": len(sample.ids)}]
            if last and body.get("return_weight_versions")
            else None,
        }

    async def _completion_stream(self, rid: str, body: dict[str, Any], sample: _Sample, k: int) -> Any:
        for end in range(1, len(sample.ids) + 1):
            choice = self._completion_choice(body, sample, end - 1, end, k, last=end == len(sample.ids))
            event = {
                "id": rid,
                "object": "text_completion",
                "created": 0,
                "model": self.model_name,
                "choices": [choice],
            }
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    # --- info, health, abort, trainer routes ---

    async def version_route(self, _: Request) -> JSONResponse:
        return JSONResponse({"version": self.version})

    async def models(self, request: Request) -> JSONResponse:
        if not self._authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": f"/models/{self.model_name}",
            "parent": None,
            "max_model_len": self.context_length,
            "permission": [],
        }
        adapters = [
            {**card, "id": name, "root": path, "parent": self.model_name, "max_model_len": None}
            for name, path in self.adapters.items()
        ]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    async def health(self, _: Request) -> Response:
        return Response(status_code=200)

    async def abort(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        body = await request.json()
        # The dev-mode /abort_requests aborts everything when given no ids.
        everything = not body.get("request_ids") and request.url.path == "/abort_requests"
        for rid in list(self._running) if everything else body.get("request_ids") or []:
            self.aborted.append(rid)
            if rid in self._running:
                self._running[rid].set()
        return Response(status_code=200)

    def _dev(self, handler: Any) -> Any:
        async def guarded(request: Request) -> Response:
            if not self.dev_mode:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            result: Response = await handler(request)
            return result

        return guarded

    async def server_info(self, request: Request) -> JSONResponse:
        if request.query_params.get("config_format") == "json":
            config: Any = {"model_config": {"model": self.model_name, "logprobs_mode": self.logprobs_mode}}
        else:
            config = f"model='{self.model_name}', logprobs_mode={self.logprobs_mode}"
        return JSONResponse({"vllm_config": config, "vllm_env": {}, "system_env": {}})

    async def pause(self, request: Request) -> JSONResponse:
        self.paused = True
        if request.query_params.get("mode", "abort") == "abort":
            for stop in self._running.values():
                stop.set()
        return JSONResponse({"status": "paused"})

    async def resume(self, _: Request) -> JSONResponse:
        self.paused = False
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, _: Request) -> JSONResponse:
        return JSONResponse({"is_paused": self.paused})

    async def update_weight_version(self, request: Request) -> JSONResponse:
        self.weight_version = str((await request.json())["new_version"])
        return JSONResponse({"success": True, "new_version": self.weight_version})

    async def weight_info(self, _: Request) -> JSONResponse:
        return JSONResponse({"weight_version": self.weight_version})

    def app(self) -> Starlette:
        dev = self._dev
        return Starlette(
            routes=[
                Route("/inference/v1/generate", self.generate, methods=["POST"]),
                Route("/inference/v1/abort_requests", self.abort, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/version", self.version_route),
                Route("/health", self.health),
                Route("/ping", self.health, methods=["GET", "POST"]),
                Route("/server_info", dev(self.server_info)),
                Route("/abort_requests", dev(self.abort), methods=["POST"]),
                Route("/pause", dev(self.pause), methods=["POST"]),
                Route("/resume", dev(self.resume), methods=["POST"]),
                Route("/is_paused", dev(self.is_paused)),
                Route("/update_weight_version", dev(self.update_weight_version), methods=["POST"]),
                Route("/weight_info", dev(self.weight_info)),
            ]
        )
