"""vLLM's wire format: the request bodies the proxy sends and the answers it accepts, checked field by field.

Two routes carry token ids (../shared/docs/vllm-generate.md): `/inference/v1/generate` (vLLM 0.11.1+,
served with `--enable-scale-out` from 0.30; integer `token_id` logprob entries from 0.32, strings
`"token_id:N"` before) and, where that route is missing or disabled, `/v1/completions` with a token-id
prompt, `return_token_ids` and `return_tokens_as_token_ids`. Sampling keys are vLLM's own
`SamplingParams` names: vLLM drops unknown keys silently, so SGLang's names are never sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.engines.base import FinishReason, PromptIds, SamplingParams, TopLogprobs
from proxy.engines.prompt_json import json_value
from proxy.errors import EngineError, InvalidEngineAnswer, UnsupportedParameter
from proxy.weight_versions import named

Route = Literal["generate", "completions"]
GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
# vLLM writes -inf and NaN logprobs, and a sampled token missing from its map, as this number.
MISSING_LOGPROB = -9999.0
# SamplingParams.constraint kinds (SGLang's keys) -> vLLM's structured_outputs keys.
_STRUCTURED_KEYS = {
    "json_schema": "json",
    "regex": "regex",
    "ebnf": "grammar",
    "structural_tag": "structural_tag",
}


def vllm_sampling(params: SamplingParams, *, max_tokens: int | None) -> dict[str, Any]:
    """`params` under vLLM's SamplingParams names, every field explicit (vLLM's /v1/completions would
    fill omitted ones from the model's generation_config.json)."""
    if 0 < params.temperature < 0.01:
        # vLLM silently raises these to 0.01: not the temperature asked for.
        raise UnsupportedParameter(
            "vLLM samples temperatures between 0 and 0.01 at 0.01; send 0 (greedy) or at least 0.01",
            param="temperature",
        )
    sampling: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "n": 1,  # each choice is its own request, recorded as its own branch
        "seed": params.seed,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": False,
        "min_tokens": 0,
        # 0: the sampled token's logprob only; k: k alternatives besides.
        "logprobs": params.top_logprobs,
        # Text is never used (the proxy decodes the ids), but stop strings match against it: tool and
        # think markers must be in it as the proxy's own decode has them.
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "include_stop_str_in_output": False,
    }
    if params.constraint is not None:
        kind, grammar = params.constraint
        sampling["structured_outputs"] = {_STRUCTURED_KEYS[kind]: grammar}
    return sampling


def generate_payload(
    prompt: PromptIds, params: SamplingParams, request_id: str, *, stream: bool
) -> dict[str, Any]:
    """A `/inference/v1/generate` body; `max_tokens: null` is vLLM's "up to the context limit";
    `model` names a LoRA adapter (omitted: the base model)."""
    sampling = vllm_sampling(params, max_tokens=params.max_new_tokens)
    if params.routed_experts is not None:
        sampling["routed_experts_prompt_start"] = params.routed_experts.start
    payload = {
        "request_id": request_id,
        "token_ids": json_value(prompt),
        "sampling_params": sampling,
        "output_mode": "tokens",
        "return_token_ids": False,
        "stream": stream,
    }
    if params.adapter is not None:
        payload["model"] = params.adapter
    return payload


def completions_payload(
    prompt: PromptIds,
    params: SamplingParams,
    request_id: str,
    *,
    model: str,
    max_tokens: int,
    stream: bool,
) -> dict[str, Any]:
    """A `/v1/completions` body with a token prompt; max_tokens is always a number there (null is 16)."""
    return {
        "model": model,
        "prompt": json_value(prompt),
        **vllm_sampling(params, max_tokens=max_tokens),
        "echo": False,
        "request_id": request_id,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "return_weight_versions": True,
        "stream": stream,
    }


@dataclass
class ParsedChoice:
    """One choice of an answer or a stream chunk: ids aligned with their logprobs."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None
    finish: FinishReason | None
    weight_versions: list[dict[str, Any]] | None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def weight_version(self) -> str | None:
        """The version of the newest span; vLLM's "default" label names no version."""
        if not self.weight_versions:
            return None
        label = self.weight_versions[-1].get("version")
        return named(label)


def check_counts(parsed: ParsedChoice, total: int, usage: Any = None) -> None:
    """An answer's own counts agree with the `total` output ids it came with: the weight version
    spans tile them (`[start, end)` from 0 to the end, in order, each naming a version), and the
    usage counts them. A chunk sent twice, or ids lost, would otherwise be recorded as sampled."""
    counted = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(counted, int) and counted != total:
        raise InvalidEngineAnswer(f"vLLM answered {total} output ids and counted {counted}")
    spans = parsed.weight_versions
    if spans is None:
        return
    at = 0
    for span in spans:
        start, end = (span.get("start"), span.get("end")) if isinstance(span, dict) else (None, None)
        if type(start) is not int or type(end) is not int or start != at or end < start:
            raise InvalidEngineAnswer(f"vLLM's weight version spans do not tile its {total} output ids")
        if not isinstance(span.get("version"), str):
            raise InvalidEngineAnswer("vLLM named a weight version that is not a string")
        at = end
    if at != total:
        raise InvalidEngineAnswer(f"vLLM's weight version spans do not tile its {total} output ids")


def single_choice(body: Any) -> dict[str, Any] | None:
    """The one choice of an answer or chunk; None for a usage-only chunk."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise EngineError("vLLM answered without a choices list")
    choices = body["choices"]
    if not choices:
        return None
    if len(choices) != 1 or not isinstance(choices[0], dict) or choices[0].get("index", 0) != 0:
        raise EngineError(f"vLLM answered {len(choices)} choices for one prompt and n=1")
    choice: dict[str, Any] = choices[0]
    return choice


def parse_choice(choice: dict[str, Any], route: Route, *, top_k: int, final: bool) -> ParsedChoice:
    """A choice of either route; `final` requires a finish reason (an unstreamed answer)."""
    ids = choice.get("token_ids")
    if ids is None and not final and choice.get("finish_reason") is not None:
        ids = []  # an abort's last chunk may carry no ids
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise EngineError("vLLM answered without integer token_ids (is return_token_ids supported?)")
    if route == "generate":
        logprobs, top = _generate_logprobs(ids, choice.get("logprobs"), top_k)
    else:
        logprobs, top = _completions_logprobs(ids, choice.get("logprobs"), top_k)
    raw_finish = choice.get("finish_reason")
    if raw_finish is None and final:
        raise EngineError("vLLM answered without a finish_reason")
    spans = choice.get("weight_versions")
    stop_reason = choice.get("stop_reason")
    return ParsedChoice(
        output_ids=list(ids),
        logprobs=logprobs,
        top_logprobs=top,
        finish=finish_reason(raw_finish, stop_reason, ids) if raw_finish is not None else None,
        weight_versions=spans if isinstance(spans, list) else None,
        meta={"stop_reason": stop_reason} if raw_finish is not None else {},
    )


def finish_reason(raw: Any, stop_reason: Any, ids: list[int]) -> FinishReason:
    """vLLM's finish_reason string and stop_reason: an int is the stop token, a string the stop string,
    null the tokenizer's EOS (the last id)."""
    if raw == "stop":
        if isinstance(stop_reason, int) and not isinstance(stop_reason, bool):
            return FinishReason("stop", matched_token=stop_reason)
        if isinstance(stop_reason, str):
            return FinishReason("stop", matched_text=stop_reason)
        return FinishReason("stop", matched_token=ids[-1] if ids else None)
    if raw == "length":
        return FinishReason("length")
    if raw == "abort":
        return FinishReason("abort", message="the engine aborted the request")
    raise EngineError(f"vLLM returned an unexpected finish_reason: {raw!r}")


def _token_id(entry: dict[str, Any]) -> int:
    """An entry's id: an integer `token_id` (0.32+) or a `"token_id:N"` string."""
    value = entry.get("token_id")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return token_of(entry.get("token"))


def token_of(text: Any) -> int:
    if isinstance(text, str) and text.startswith("token_id:"):
        try:
            return int(text[9:])
        except ValueError:
            pass
    raise EngineError(f"vLLM named a token as {text!r}, not by id (return_tokens_as_token_ids)")


def checked_logprob(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise EngineError("vLLM returned a non-numeric logprob for a sampled token")
    number = float(value)
    if not math.isfinite(number) or number <= MISSING_LOGPROB:
        # -9999.0 is how vLLM writes "no logprob"; recording it would corrupt the trainer's ratios.
        raise EngineError(f"vLLM returned no usable logprob for a sampled token ({number})")
    return number


def best(candidates: list[tuple[int, float]], k: int) -> TopLogprobs:
    """The k most likely of the engine's candidates (the sampled token first, then the top k: k + 1
    entries when the sampled token is not among the top k)."""
    unique = dict(candidates)
    return sorted(unique.items(), key=lambda item: -item[1])[:k]


def _generate_logprobs(ids: list[int], raw: Any, top_k: int) -> tuple[list[float], list[TopLogprobs] | None]:
    entries = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise EngineError("vLLM answered without one logprobs.content entry per token id")
    logprobs: list[float] = []
    top: list[TopLogprobs] = []
    for token, entry in zip(ids, entries, strict=True):
        if not isinstance(entry, dict) or _token_id(entry) != token:
            raise EngineError("a vLLM logprob entry does not match its token id")
        logprobs.append(checked_logprob(entry.get("logprob")))
        if top_k:
            alternatives = entry.get("top_logprobs")
            if not isinstance(alternatives, list):
                raise EngineError("vLLM answered without top_logprobs")
            top.append(best([_candidate(a) for a in alternatives], top_k))
    return logprobs, (top if top_k else None)


def _candidate(entry: Any) -> tuple[int, float]:
    if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), int | float):
        raise EngineError("vLLM returned a malformed top-logprob entry")
    return _token_id(entry), float(entry["logprob"])


def _completions_logprobs(
    ids: list[int], raw: Any, top_k: int
) -> tuple[list[float], list[TopLogprobs] | None]:
    if not isinstance(raw, dict):
        raise EngineError("vLLM's completion answered without logprobs")
    tokens, values, alternatives = raw.get("tokens"), raw.get("token_logprobs"), raw.get("top_logprobs")
    if not (isinstance(tokens, list) and isinstance(values, list)) or not (
        len(tokens) == len(values) == len(ids)
    ):
        raise EngineError("vLLM's completion logprobs are not aligned with its token_ids")
    if [token_of(t) for t in tokens] != ids:
        raise EngineError("vLLM's completion logprob tokens do not match its token_ids")
    logprobs = [checked_logprob(v) for v in values]
    if not top_k:
        return logprobs, None
    if not isinstance(alternatives, list) or len(alternatives) != len(ids):
        raise EngineError("vLLM's completion answered without top_logprobs per token")
    top: list[TopLogprobs] = []
    for position in alternatives:
        if not isinstance(position, dict) or not all(isinstance(v, int | float) for v in position.values()):
            raise EngineError("vLLM returned a malformed top_logprobs entry")
        top.append(best([(token_of(t), float(v)) for t, v in position.items()], top_k))
    return logprobs, top


def error_message(status: int, content: bytes) -> str:
    """vLLM's error text: `{"error": {"message": ...}}`, `{"error": "Unauthorized"}` or FastAPI's detail."""
    import orjson

    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content[:500].decode(errors="replace") or f"HTTP {status}"
    if isinstance(body, dict):
        error = body.get("error", body.get("detail"))
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
    return str(body)[:500]
