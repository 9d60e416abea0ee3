"""A real HTTP server that speaks SGLang's native protocol (../shared/docs/sglang-generate.md) and
answers with scripted token ids and logprobs, so tests know exactly what the engine "sampled".

LoRA as SGLang's source has it (entrypoints/http_server.py, lora/lora_registry.py): `/v1/models` lists
each loaded adapter as {"id": name, "root": path, "parent": served model}; `/generate` takes
`lora_path` (an adapter's name) and refuses one not loaded with a 400 "The following requested LoRA
adapters are not loaded: ..."; `/load_lora_adapter` and `/unload_lora_adapter` change the set.
Routed experts (managers/io_struct.py, tokenizer_manager.py): with `routed_experts_shape` set (the
server's --enable-return-routed-experts), a request with `return_routed_experts` gets
`meta_info["routed_experts"]`, base64 of int32 (positions, layers, top_k) over
[routed_experts_start_len, prompt + output - 1); streamed, in the chunk with the finish reason."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
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

SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
    }
)


def routing(position: int, token: int, shape: tuple[int, int], num_experts: int = 300) -> list[list[int]]:
    """The stand-ins' made-up routing of the forward pass fed `token` at `position`: a function of
    both, so tests recompute what any split of a sequence over requests must add up to."""
    layers, top_k = shape
    return [
        [(token * 31 + position * 7 + layer * 5 + k) % num_experts for k in range(top_k)]
        for layer in range(layers)
    ]


@dataclass
class ScriptedOutput:
    """What the fake engine samples next: ids with their logprobs, cut by the request's stop rules."""

    ids: list[int]
    logprobs: list[float]
    weight_version: str | None = None
    # Sent as meta_info.finish_reason instead of the one the stop rules give (bad answers under test).
    finish: dict[str, Any] | None = None


@dataclass
class FakeSGLang:
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    context_length: int = 32768
    model_name: str = "fake-model"
    weight_version: str | None = "v0"  # None: the engine names no version
    vocab_size: int = 0
    script: deque[ScriptedOutput] = field(default_factory=deque)
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    crashed: bool = False
    # Tokens the KV cache holds; below the context length it lowers SGLang's input limit too.
    kv_capacity: int | None = None
    incremental: bool = False  # like --incremental-streaming-output: chunks carry deltas
    chunk_delay_s: float = 0.0  # pause between streamed chunks
    # False: the alternatives are likelier tokens than the sampled one, which a temperature sample can
    # pick from outside SGLang's top k (its top_logprobs then leave the sampled token out).
    sampled_in_top: bool = True
    stream_closed: bool = False  # set when a client went away mid-stream
    # A fault for every /generate call: "http500", "malformed_json", "hang", "cut_stream",
    # "late_error" (a stream that is only an error event, as SGLang sends errors found after admission),
    # "error_mid_stream" (the same after the first chunk), "no_finish" (chunks that never carry a
    # finish reason, then [DONE]).
    fault: str | None = None
    hang_s: float = 30.0
    # Loaded LoRA adapters, name -> path, listed in /v1/models as SGLang lists its LoRA registry.
    adapters: dict[str, str] = field(default_factory=dict)
    # (layers, top_k) of a MoE model served with --enable-return-routed-experts; None: served without.
    routed_experts_shape: tuple[int, int] | None = None
    num_experts: int = 300  # past 255: the proxy's compact storage must widen to uint16
    healthy: bool = True  # False: /health and /ready answer 503 (a server going down)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Plain requests under way, by rid: /abort_request ends their hang with an abort, as SGLang does.
    _hanging: dict[str, asyncio.Event] = field(default_factory=dict)

    def push(
        self, ids: list[Any], logprobs: list[Any] | None = None, *, finish: dict[str, Any] | None = None
    ) -> ScriptedOutput:
        if logprobs is None:
            logprobs = [-0.01 * (i % 97 + 1) for i in range(len(ids))]
        scripted = ScriptedOutput(list(ids), list(logprobs), finish=finish)
        self.script.append(scripted)
        return scripted

    @property
    def max_req_input_len(self) -> int:
        """SGLang's scheduler refuses inputs of this many tokens or more (measured: 2042 of 2048)."""
        capacity = self.context_length if self.kv_capacity is None else self.kv_capacity
        return min(self.context_length - 1, capacity - 1) - 5

    @property
    def max_req_len(self) -> int:
        return min(self.context_length - 1, (self.kv_capacity or self.context_length) - 1)

    def _default_output(self) -> ScriptedOutput:
        ids = [*self.tokenizer.encode("ok", add_special_tokens=False).ids, self.eos_ids[0]]
        return ScriptedOutput(ids, [-0.5] * len(ids))

    def _sample(self, params: dict[str, Any]) -> tuple[list[int], list[float], dict[str, Any] | None]:
        with self._lock:
            scripted = self.script.popleft() if self.script else self._default_output()
            if scripted.weight_version is not None:  # the weights that sample it, from now on
                self.weight_version = scripted.weight_version
        ids, logprobs, finish = self._cut(scripted, params)
        if self.fault == "no_finish":
            return ids, logprobs, None
        return ids, logprobs, scripted.finish or finish

    def _cut(
        self, scripted: ScriptedOutput, params: dict[str, Any]
    ) -> tuple[list[int], list[float], dict[str, Any]]:
        stop_ids = set(params.get("stop_token_ids") or []) | (
            set() if params.get("ignore_eos") else set(self.eos_ids)
        )
        stops = params.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        limit = params.get("max_new_tokens", 128)
        ids: list[int] = []
        logprobs: list[float] = []
        for token, logprob in zip(scripted.ids, scripted.logprobs, strict=True):
            if limit is not None and len(ids) >= limit:
                return ids, logprobs, {"type": "length", "length": len(ids)}
            ids.append(token)
            logprobs.append(logprob)
            if token in stop_ids:
                return ids, logprobs, {"type": "stop", "matched": token}
            text = self._text(ids, skip_special_tokens=False)
            for stop in stops:
                if stop in text:
                    return ids, logprobs, {"type": "stop", "matched": stop}
        return ids, logprobs, {"type": "length", "length": len(ids)}

    def _text(self, ids: list[Any], *, skip_special_tokens: bool) -> str:
        """The text of the ids; "" for scripted ids that are no tokens (bad answers under test)."""
        if not all(type(t) is int and 0 <= t < self.vocab_size for t in ids):
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def _top(self, ids: list[int], logprobs: list[float], count: int) -> list[list[list[Any]]]:
        """Alternatives as SGLang sends them: the sampled token first, then made-up runners-up (or,
        with sampled_in_top off, likelier tokens only)."""
        if not self.sampled_in_top:
            return [
                [[lp + count - rank, (token + rank + 1) % self.vocab_size, None] for rank in range(count)]
                for token, lp in zip(ids, logprobs, strict=True)
            ]
        return [
            [[lp - rank, (token + rank) % self.vocab_size, None] for rank in range(count)]
            for token, lp in zip(ids, logprobs, strict=True)
        ]

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        if self.fault == "http500":
            return JSONResponse(
                {"error": {"message": "CUDA error: an illegal memory access"}}, status_code=500
            )
        if self.fault == "malformed_json":
            return Response(b'{"text": "oops", "output_ids": [1, 2', media_type="application/json")
        aborted = False
        if self.fault == "hang":
            rid = str(body.get("rid"))
            self._hanging[rid] = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hanging[rid].wait(), self.hang_s)
            aborted = self._hanging.pop(rid).is_set()
        params = body.get("sampling_params") or {}
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:
            return JSONResponse(
                {"error": f"unknown field {unknown[0]!r} in sampling_params"}, status_code=400
            )
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not input_ids or not all(isinstance(i, int) for i in input_ids):
            return JSONResponse(
                {"error": {"message": "input_ids must be a non-empty list of ints"}}, status_code=400
            )
        if max(input_ids) >= self.vocab_size or min(input_ids) < 0:
            # The real server's scheduler dies here; make the test fail loudly instead.
            self.crashed = True
            return JSONResponse(
                {"error": {"message": "token id out of vocabulary: server crashed"}}, status_code=500
            )
        lora = body.get("lora_path")
        if lora is not None and lora not in self.adapters:
            # TokenizerManager's LoRA registry lookup, a ValueError answered as 400.
            message = (
                f"The following requested LoRA adapters are not loaded: {lora}\n"
                f"Loaded adapters: {self.adapters.keys()}."
            )
            return JSONResponse({"error": {"message": message}}, status_code=400)
        temperature = params.get("temperature", 1.0)
        top_p = params.get("top_p", 1.0)
        if temperature < 0 or not 0 < top_p <= 1:
            return JSONResponse({"error": {"message": "invalid sampling parameters"}}, status_code=400)
        refused = self._refusal(input_ids, params.get("max_new_tokens", 128))
        if refused is not None:
            return refused
        if len(input_ids) >= self.max_req_input_len:
            # Refused by the scheduler, after the tokenizer manager admitted it.
            message = (
                f"Input length ({len(input_ids)} tokens) exceeds the maximum allowed length "
                f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
            if body.get("stream"):
                return StreamingResponse(self._admission_abort(body, message), media_type="text/event-stream")
            return JSONResponse({"error": {"message": message}}, status_code=400)
        # The scheduler caps generation at the room left, whatever max_new_tokens says (measured).
        cap = self.max_req_len - len(input_ids) - 1
        max_new = params.get("max_new_tokens", 128)
        params = {**params, "max_new_tokens": cap if max_new is None else min(max_new, cap)}
        ids, logprobs, finish = self._sample(params)
        if aborted:  # SGLang answers an aborted request with what it sampled so far
            ids, logprobs = ids[:1], logprobs[:1]
            finish = {"type": "abort", "message": "Abort in waiting queue"}
        top_count = int(body.get("top_logprobs_num") or 0)
        if body.get("stream"):
            return StreamingResponse(
                self._stream(body, input_ids, ids, logprobs, finish), media_type="text/event-stream"
            )
        meta_top = {"output_top_logprobs": self._top(ids, logprobs, top_count)} if top_count else {}
        text_ids = (
            ids[:-1]
            if finish is not None and finish.get("type") == "stop" and isinstance(finish.get("matched"), int)
            else ids
        )
        return JSONResponse(
            {
                "text": self._text(text_ids, skip_special_tokens=params.get("skip_special_tokens", True)),
                "output_ids": ids,
                "meta_info": {
                    "id": body.get("rid") or uuid.uuid4().hex,
                    "finish_reason": finish,
                    "prompt_tokens": len(input_ids),
                    "completion_tokens": len(ids),
                    "cached_tokens": 0,
                    "weight_version": self.weight_version,
                    "weight_versions": [{"version": self.weight_version, "start": 0, "end": len(ids)}],
                    "e2e_latency": 0.001,
                    "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs, strict=True)],
                    **meta_top,
                    **self._routing(body, input_ids, ids),
                },
            }
        )

    def _routing(self, body: dict[str, Any], prompt: list[int], ids: list[int]) -> dict[str, Any]:
        """meta_info["routed_experts"] as SGLang sends it: base64 of a C-order int32 array
        (positions, layers, top_k) over [routed_experts_start_len, len(prompt + output) - 1)."""
        if not body.get("return_routed_experts") or self.routed_experts_shape is None:
            return {}
        start = int(body.get("routed_experts_start_len") or 0)
        stream = [*prompt, *ids]
        rows = [self.experts_at(position, stream[position]) for position in range(start, len(stream) - 1)]
        layers, top_k = self.routed_experts_shape
        array = np.asarray(rows, dtype=np.int32).reshape(-1, layers, top_k)
        return {"routed_experts": base64.b64encode(array.tobytes()).decode("ascii")}

    def experts_at(self, position: int, token: int) -> list[list[int]]:
        assert self.routed_experts_shape is not None
        return routing(position, token, self.routed_experts_shape, self.num_experts)

    def _error_event(self) -> str:
        """An error SGLang finds after admitting a stream: an event in the 200 stream (measured)."""
        error = {
            "message": "Requested token count exceeds the model's maximum context length",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
        return f"data: {json.dumps({'error': error})}\n\n"

    def _refusal(self, input_ids: list[int], max_new: int | None) -> Response | None:
        """The tokenizer manager's checks: plain HTTP 400s, streamed or not."""
        if len(input_ids) >= self.context_length:
            message = (
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
            return JSONResponse({"error": {"message": message}}, status_code=400)
        if max_new is not None and len(input_ids) + max_new > self.context_length:
            return JSONResponse(
                {"error": {"message": "Requested token count exceeds the model's maximum context length"}},
                status_code=400,
            )
        return None

    async def _admission_abort(self, body: dict[str, Any], message: str) -> Any:
        """A streamed refusal at admission as SGLang 0.5.23 sends it: HTTP 200, one chunk with a fake
        output id 0 and no logprobs, an abort finish reason with the status code, then [DONE]."""
        chunk = {
            "text": "",
            "output_ids": [0],
            "meta_info": {
                "id": body.get("rid"),
                "finish_reason": {
                    "type": "abort",
                    "message": message,
                    "status_code": 400,
                    "err_type": "BadRequestError",
                },
                "prompt_tokens": 1,
                "weight_version": self.weight_version,
                "output_token_logprobs": [],
                "completion_tokens": 1,
                "cached_tokens": 0,
            },
        }
        yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    def _meta(
        self,
        body: dict[str, Any],
        prompt: list[int],
        piece: tuple[list[int], list[float]],
        finish: dict[str, Any] | None,
        total: int,
        *,
        sampled: list[int] | None = None,
    ) -> dict[str, Any]:
        ids, logprobs = piece
        top_count = int(body.get("top_logprobs_num") or 0)
        top = {"output_top_logprobs": self._top(ids, logprobs, top_count)} if top_count else {}
        # Routings come with the finish, over the whole output.
        routing = self._routing(body, prompt, sampled or []) if finish is not None else {}
        return {
            **top,
            **routing,
            "id": body.get("rid"),
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": total,
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs, strict=True)],
        }

    async def _stream(
        self,
        body: dict[str, Any],
        prompt: list[int],
        ids: list[int],
        logprobs: list[float],
        finish: dict[str, Any] | None,
    ) -> Any:
        """SSE as SGLang sends it: cumulative chunks by default, one token each here."""
        try:
            if self.fault == "late_error":
                yield self._error_event()
                yield "data: [DONE]\n\n"
                return
            for end in range(1, len(ids) + 1):
                start = end - 1 if self.incremental else 0
                last = end == len(ids)
                chunk = {
                    "text": "",
                    "output_ids": ids[start:end],
                    "meta_info": self._meta(
                        body,
                        prompt,
                        (ids[start:end], logprobs[start:end]),
                        finish if last else None,
                        end,
                        sampled=ids[:end],
                    ),
                }
                yield f"data: {json.dumps(chunk)}\n\n"
                if self.fault == "error_mid_stream":
                    yield self._error_event()
                    break
                if self.fault == "cut_stream" and end * 2 >= len(ids):
                    raise ConnectionResetError("the engine died mid-stream")
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            if not ids:
                # Nothing sampled (an abort before the first token): one chunk still names the finish.
                chunk = {
                    "text": "",
                    "output_ids": [],
                    "meta_info": self._meta(body, prompt, ([], []), finish, 0),
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.stream_closed = True
            raise

    async def models(self, _: Request) -> JSONResponse:
        # SGLang's /v1/models: the base model, then each loaded adapter with root (its path) and parent.
        adapters = [
            {"id": name, "object": "model", "root": path, "parent": self.model_name, "max_model_len": None}
            for name, path in self.adapters.items()
        ]
        base = {
            "id": self.model_name,
            "object": "model",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.context_length,
        }
        return JSONResponse({"object": "list", "data": [base, *adapters]})

    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.adapters[str(body["lora_name"])] = str(body["lora_path"])
        return JSONResponse({"success": True, "loaded_adapters": dict(self.adapters)})

    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.adapters.pop(str(body["lora_name"]), None)
        return JSONResponse({"success": True, "loaded_adapters": dict(self.adapters)})

    async def model_info(self, _: Request) -> JSONResponse:
        return JSONResponse({"model_path": self.model_name, "weight_version": self.weight_version})

    async def health(self, _: Request) -> JSONResponse:
        return JSONResponse({}, status_code=200 if self.healthy else 503)

    async def abort(self, request: Request) -> JSONResponse:
        body = await request.json()
        rid = str(body.get("rid"))
        self.aborted.append(rid)
        for hanging, event in self._hanging.items():
            if hanging.startswith(rid):  # SGLang matches rids by prefix
                event.set()
        return JSONResponse({})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/generate", self.generate, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/model_info", self.model_info),
                Route("/health", self.health),
                Route("/ready", self.health),
                Route("/abort_request", self.abort, methods=["POST"]),
                Route("/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                Route("/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            ]
        )


def main() -> None:
    """Serve the stand-in on its own: `python -m tests.fakes.sglang --tokenizer DIR --port N --reply TEXT`."""
    import argparse

    import uvicorn

    from tests.support import token_id

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reply", default="ok", help="text sampled for every request, followed by EOS")
    parser.add_argument("--context-length", type=int, default=131072)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(f"{args.tokenizer}/tokenizer.json")
    eos = token_id(tokenizer, "<|im_end|>")
    fake = FakeSGLang(
        tokenizer=tokenizer,
        eos_ids=(eos,),
        context_length=args.context_length,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
    )
    reply = [*tokenizer.encode(args.reply, add_special_tokens=False).ids, eos]
    fake._default_output = lambda: ScriptedOutput(reply, [-0.25] * len(reply))  # type: ignore[method-assign]
    uvicorn.run(fake.app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
