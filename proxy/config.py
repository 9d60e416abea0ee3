"""Settings of one proxy process, read from flags and `TITO_*` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

EngineKind = Literal["sglang", "local"]


class Settings(BaseSettings):
    """Everything a proxy process needs; no instance exists at import time."""

    model_config = SettingsConfigDict(env_prefix="TITO_", extra="forbid")

    engine: EngineKind = "sglang"
    engine_url: str = "http://127.0.0.1:30000"
    engine_timeout_s: float = Field(default=600.0, gt=0)
    model: Path | None = None
    tokenizer: Path | None = None
    served_model_name: str | None = None
    context_length: int | None = Field(default=None, gt=0)
    db: str = "sqlite:///tito-proxy.db"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # A comment is sent on a silent stream this often, so that proxies and clients keep it open.
    stream_keepalive_s: float = Field(default=15.0, gt=0)
    # Sessions with no call for this long are finished (and so exported); 0 turns it off.
    session_idle_timeout_s: float = Field(default=3600.0, ge=0)
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
    # Bearer keys: the harness key opens the OpenAI surface; the admin key opens sessions, trajectories,
    # exports and weight versions. Without an admin key those need the harness key (if one is set).
    api_key: SecretStr | None = None
    admin_key: SecretStr | None = None

    @model_validator(mode="after")
    def _tokenizer_source(self) -> Settings:
        if self.tokenizer is None and self.model is None:
            raise ValueError(
                "a tokenizer is needed: pass --tokenizer DIR (or --model DIR, whose tokenizer is used)"
            )
        if self.engine == "local" and self.model is None:
            raise ValueError("the local engine needs --model DIR")
        return self

    @property
    def tokenizer_dir(self) -> Path:
        source = self.tokenizer or self.model
        assert source is not None  # guaranteed by the validator
        return source

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.tokenizer_dir.name
