"""What a vLLM server is, read once at start: release, token route, context length, logprobs mode.

Logprobs mode (vLLM's `--logprobs-mode`): `raw_logprobs` (vLLM's default) is the model's log-softmax
before temperature, top-k/top-p and every logits processor; `processed_logprobs` is the distribution
actually sampled from, which an RL trainer's importance ratios need; the two `*_logits` modes return
logits, not logprobs. vLLM tells its mode only through `/server_info` (served with
`VLLM_SERVER_DEV_MODE=1`); otherwise the operator may declare it (`--vllm-logprobs-mode`), else it is
unknown and reported as such.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from proxy.engines.base import SamplingParams
from proxy.engines.vllm_protocol import Route

LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = (
    "raw_logprobs",
    "processed_logprobs",
    "raw_logits",
    "processed_logits",
)
ModeSource = Literal["server_info", "declared", "unknown"]


@dataclass(frozen=True)
class VLLMProbe:
    version: str | None
    route: Route
    model: str
    context_length: int | None
    logprobs_mode: LogprobsMode | None
    mode_source: ModeSource

    @property
    def sampled_distribution(self) -> bool | None:
        """Whether the reported logprobs are those of the distribution sampled from (None: unknown)."""
        if self.logprobs_mode is None:
            return None
        return self.logprobs_mode == "processed_logprobs"

    def warning(self) -> str | None:
        """The loud start-up warning when the logprobs may not be the sampled distribution."""
        if self.logprobs_mode == "processed_logprobs":
            return None
        if self.logprobs_mode is None:
            return (
                "vLLM's logprobs mode is UNKNOWN (its /server_info needs VLLM_SERVER_DEV_MODE=1): vLLM's "
                "default raw_logprobs is taken BEFORE temperature and top-k/top-p, not the distribution "
                "sampled from. Start vLLM with --logprobs-mode processed_logprobs and declare it with "
                "--vllm-logprobs-mode processed_logprobs."
            )
        return (
            f"vLLM runs with --logprobs-mode {self.logprobs_mode}: recorded logprobs are NOT the "
            "distribution sampled from (except at temperature 1 with no top-k/top-p/min-p, penalty or "
            "grammar). RL importance ratios need --logprobs-mode processed_logprobs."
        )

    def report(self) -> dict[str, Any]:
        return {
            "kind": "vllm",
            "version": self.version,
            "route": self.route,
            "model": self.model,
            "context_length": self.context_length,
            "logprobs_mode": self.logprobs_mode,
            "logprobs_mode_source": self.mode_source,
            "logprobs_are_sampled_distribution": self.sampled_distribution,
            "warning": self.warning(),
        }

    def call_meta(self, params: SamplingParams) -> dict[str, Any]:
        """What each recorded call says about its logprobs."""
        return {
            "engine": "vllm",
            "route": self.route,
            "logprobs_mode": self.logprobs_mode,
            "logprobs_mode_source": self.mode_source,
            "sampled_distribution": sampled_distribution(self.logprobs_mode, params),
        }


def sampled_distribution(mode: LogprobsMode | None, params: SamplingParams) -> bool | None:
    """Whether this call's logprobs are those it was sampled from: always with processed_logprobs;
    with raw_logprobs only when no temperature, truncation, penalty or grammar changed the logits."""
    if mode is None:
        return None
    if mode == "processed_logprobs":
        return True
    if mode != "raw_logprobs":
        return False
    return (
        params.temperature == 1.0
        and params.top_p == 1.0
        and params.top_k in (-1, 0)
        and params.min_p == 0.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and params.constraint is None
    )


_MODE_IN_TEXT = re.compile(
    r"logprobs_mode\W{0,4}(?:LogprobsMode\.)?(raw_logprobs|processed_logprobs|raw_logits|processed_logits)",
    re.IGNORECASE,
)


def mode_in_server_info(body: Any) -> LogprobsMode | None:
    """The `logprobs_mode` anywhere in a /server_info answer (its config as JSON, or as text)."""
    if isinstance(body, dict):
        value = body.get("logprobs_mode")
        if isinstance(value, str):
            return _mode(value)
        for item in body.values():
            found = mode_in_server_info(item)
            if found is not None:
                return found
    elif isinstance(body, list):
        for item in body:
            found = mode_in_server_info(item)
            if found is not None:
                return found
    elif isinstance(body, str):
        match = _MODE_IN_TEXT.search(body)
        if match:
            return _mode(match.group(1))
    return None


def _mode(value: str) -> LogprobsMode | None:
    # The enum may be written as "LogprobsMode.PROCESSED_LOGPROBS" in text dumps.
    name = value.rsplit(".", 1)[-1].lower()
    for mode in LOGPROBS_MODES:
        if mode == name:
            return mode
    return None


def base_model(models: Any) -> tuple[str, int | None]:
    """The served model's name and max_model_len from /v1/models (LoRA cards have a parent)."""
    data = models.get("data") if isinstance(models, dict) else None
    cards = [c for c in data or [] if isinstance(c, dict) and c.get("parent") is None]
    if not cards:
        return "unknown", None
    length = cards[0].get("max_model_len")
    return str(cards[0].get("id", "unknown")), length if isinstance(length, int) else None
