"""Settings of one proxy process, read from flags and `TITO_*` environment variables."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from proxy.model_source import ModelSource, resolve

EngineKind = Literal["sglang", "vllm", "local"]
VLLMLogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]


class Settings(BaseSettings):
    """Everything a proxy process needs; no instance exists at import time."""

    model_config = SettingsConfigDict(env_prefix="TITO_", extra="forbid")

    engine: EngineKind = "sglang"
    # One engine URL, or several separated by commas (TITO_ENGINE_URL=http://a:30000,http://b:30000).
    engine_url: str = "http://127.0.0.1:30000"
    # How often every engine's health is checked; a failing engine gets no new turns and its sessions
    # move to a healthy one on their next turn.
    engine_health_interval_s: float = Field(default=5.0, gt=0)
    engine_timeout_s: float = Field(default=600.0, gt=0)
    # vLLM's --api-key, sent as a Bearer token to the engine (vLLM guards its /v1 and /inference routes).
    engine_api_key: SecretStr | None = None
    # The --logprobs-mode vLLM was started with, for servers that do not tell it (no dev mode).
    vllm_logprobs_mode: VLLMLogprobsMode | None = None
    model: Path | None = None
    # The local engine's max_new_tokens for a request without max_tokens (it samples one turn at a time).
    local_max_new_tokens: int = Field(default=512, gt=0)
    tokenizer: Path | None = None
    served_model_name: str | None = None
    # More names of the served model (comma-separated), accepted as it under --strict-model-names.
    model_aliases: str | None = None
    # A request model that is neither the served model, an alias nor a loaded LoRA adapter: sampled by
    # the base model and recorded as requested (default), or a 404 model_not_found (strict).
    strict_model_names: bool = False
    # Ask the engine for the MoE experts every position was routed to, and record them (routing replay).
    record_routed_experts: bool = False
    # "LAYERS,TOP_K" of the MoE model, where its config.json is not beside the tokenizer.
    routed_experts_shape: str | None = Field(default=None, pattern=r"^\d+[,x]\d+$")
    context_length: int | None = Field(default=None, gt=0)
    db: str = "sqlite:///tito-proxy.db"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # While the trainer pauses generation (POST /admin/pause): new turns wait up to pause_max_wait_s
    # ("wait") or are refused at once ("reject"), both with 429 and Retry-After when they cannot run.
    pause_mode: Literal["wait", "reject"] = "wait"
    pause_max_wait_s: float = Field(default=300.0, ge=0)
    # Sent as Retry-After on 429 and 503 answers.
    retry_after_s: float = Field(default=5.0, gt=0)
    # A generation lost to an engine restart is continued once the engine is back within this long;
    # 0: the turn fails with 503 at once.
    engine_restart_wait_s: float = Field(default=0.0, ge=0)
    # json: one JSON object per line (time, level, logger, message, request_id, session_id).
    log_format: Literal["text", "json"] = "text"
    # uvicorn's line per request (at info), with the request and session ids like every line.
    access_log: bool = False
    # A comment is sent on a silent stream this often, so that proxies and clients keep it open.
    stream_keepalive_s: float = Field(default=15.0, gt=0)
    # Sessions with no call for this long are finished (and so exported); 0 turns it off.
    session_idle_timeout_s: float = Field(default=3600.0, ge=0)
    # On SIGTERM, turns in flight get this long to finish; then they are cancelled (a stream's partial
    # turn recorded as aborted) and the server exits.
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    # exact: continue with the sampled tokens; template: a fresh render wins whenever they differ.
    history_mode: Literal["exact", "template"] = "exact"
    drift_report: Literal["strict", "ignore_strippable", "disable"] = "strict"
    tool_parser: Literal[
        "auto",
        "hermes",
        "qwen3_coder",
        "glm45",
        "llama3_json",
        "deepseek_v3",
        "mistral",
        "kimi_k2",
        "gpt_oss",
    ] = "auto"
    # A larger request body is a 413. A 64k-token agent context is ~250 KB of JSON, a 1M-token one
    # ~4-6 MB (more with non-ASCII text \u-escaped), and tool results are bounded by the context too:
    # 32 MiB passes any request a model can take, and bounds what one request makes the proxy parse.
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    # Tokens the process encodes with the tokenizer before it tries to prove tiktoken exact for it
    # (proxy/chat/rank_bpe.py): 0 at start-up, -1 never.
    fast_bpe_after_tokens: int = Field(default=100_000, ge=-1)
    # Bearer keys: the harness key opens the OpenAI surface; the admin key opens sessions, trajectories,
    # exports and weight versions. Without an admin key those need the harness key (if one is set).
    api_key: SecretStr | None = None
    admin_key: SecretStr | None = None
    # Binding beyond loopback without both keys lets anyone on the network drive turns and read every
    # trajectory; it needs saying so explicitly.
    allow_unauthenticated: bool = False
    # Signs the reasoning we sampled (Anthropic thinking signatures, Responses encrypted_content), so an
    # echoed copy is recognised after a restart too; random per process when unset.
    reasoning_secret: SecretStr | None = None
    # Processes serving one port (uvicorn workers); they share only the database.
    workers: int = Field(default=1, ge=1, le=64)

    @field_validator("engine_url", mode="before")
    @classmethod
    def _engine_url_list(cls, value: object) -> object:
        # A list (repeated --engine-url flags, or Settings(engine_url=[...])) is held as one string.
        if isinstance(value, list | tuple):
            return ",".join(str(url) for url in value)
        return value

    @model_validator(mode="after")
    def _engine_urls(self) -> Settings:
        urls = self.engine_urls
        if not urls:
            raise ValueError("--engine-url names no engine")
        if len(set(urls)) != len(urls):
            raise ValueError(f"--engine-url names an engine twice: {', '.join(urls)}")
        if self.engine == "local" and len(urls) > 1:
            raise ValueError("the local engine runs in this process: it takes no --engine-url list")
        return self

    @property
    def engine_urls(self) -> list[str]:
        """Every engine URL given, in order (their ids are engine-0, engine-1...)."""
        return [url.strip().rstrip("/") for url in self.engine_url.split(",") if url.strip()]

    @model_validator(mode="after")
    def _tokenizer_source(self) -> Settings:
        if self.tokenizer is None and self.model is None:
            raise ValueError(
                "a tokenizer is needed: pass --tokenizer DIR (or --model DIR, whose tokenizer is used)"
            )
        if self.engine == "local" and self.model is None:
            raise ValueError("the local engine needs --model DIR")
        return self

    @model_validator(mode="after")
    def _routed_experts_readable(self) -> Settings:
        if not self.record_routed_experts:
            return self
        if self.engine == "local":
            raise ValueError("--record-routed-experts: the local engine cannot return routed experts")
        if self.engine == "sglang" and self.routed_experts_dims is None:
            raise ValueError(
                "--record-routed-experts: SGLang sends routed experts without their shape, and no "
                "config.json with num_hidden_layers and num_experts_per_tok is beside the tokenizer "
                "or model: set --routed-experts-shape LAYERS,TOP_K"
            )
        return self

    @property
    def routed_experts_dims(self) -> tuple[int, int] | None:
        """(layers, top_k) of the MoE model: the flag, else its config.json."""
        from proxy.model_source import routed_experts_shape

        return routed_experts_shape(self.routed_experts_shape, [self.tokenizer_dir, self.model])

    @model_validator(mode="after")
    def _keys_beyond_loopback(self) -> Settings:
        if is_loopback(self.host) or self.allow_unauthenticated:
            return self
        missing = [
            name
            for name, key in (
                ("--api-key (TITO_API_KEY)", self.api_key),
                ("--admin-key (TITO_ADMIN_KEY)", self.admin_key),
            )
            if key is None or not key.get_secret_value()
        ]
        if missing:
            raise ValueError(
                f"binding {self.host}, beyond loopback, needs {' and '.join(missing)}: "
                "pass --allow-unauthenticated (TITO_ALLOW_UNAUTHENTICATED=1) if an open proxy is wanted"
            )
        return self

    @property
    def model_alias_names(self) -> list[str]:
        return [name.strip() for name in (self.model_aliases or "").split(",") if name.strip()]

    @property
    def model_source(self) -> ModelSource:
        """The tokenizer's directory (a hub id is found in the local hub cache) and the model's name."""
        source = self.tokenizer or self.model
        assert source is not None  # guaranteed by the validator
        return resolve(source)

    @property
    def tokenizer_dir(self) -> Path:
        return self.model_source.directory

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model_source.name


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this host only (a name other than localhost is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
