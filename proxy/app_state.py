"""The per-process state the lifespan builds and the routes read through dependencies."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.ext.asyncio import AsyncSession as DbSession

from proxy.api.engine_facts import EngineFacts
from proxy.api.message_prefix import MessagePrefixes
from proxy.api.model_names import ModelNames
from proxy.api.retries import RetryGuard
from proxy.chat.call_format import ToolParserReport
from proxy.chat.reasoning_tokens import ReasoningTokens
from proxy.chat.renderer import Renderer
from proxy.chat.token_pieces import TokenPieces
from proxy.config import Settings
from proxy.dialects.converted_history import ConvertedHistories
from proxy.dialects.seals import Sealer
from proxy.engines.base import Engine
from proxy.engines.pool import EnginePool
from proxy.shared_pause import SharedPause
from proxy.turns import TurnRunner


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    db_engine: AsyncEngine
    db_sessions: async_sessionmaker[DbSession]
    renderer: Renderer
    turns: TurnRunner
    model_name: str
    retries: RetryGuard = field(default_factory=RetryGuard)
    tool_parser: ToolParserReport | None = None  # which parser reads the template's calls
    # The engines behind `engine` (GET/POST/DELETE /admin/engines).
    pool: EnginePool | None = None
    # Seals sampled reasoning under the deployment's secret (configured, or kept in the database).
    sealer: Sealer = field(default_factory=lambda: Sealer(None))
    # With other processes on the database: the trainer's pause as they all follow it.
    shared_pause: SharedPause | None = None
    # Chat histories already validated, per session: a resent history is not validated again.
    message_prefixes: MessagePrefixes = field(default_factory=MessagePrefixes)
    # The same for the Anthropic and Responses dialects: a resent history is not converted again.
    converted_histories: ConvertedHistories = field(default_factory=ConvertedHistories)
    # The engine's model name, context length and weight version, asked again until it answers.
    engine_facts: EngineFacts | None = None
    # When this process started serving (Unix seconds, UTC): /v1/models' `created`.
    started_at: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.pieces = TokenPieces(self.renderer.tokenizer, self.renderer.special_ids)
        # Responses' usage.output_tokens_details.reasoning_tokens, for the model's output format.
        self.reasoning_tokens = ReasoningTokens.of(self.renderer, self.turns.parser.name)
        settings = self.settings
        self.model_names = ModelNames(
            self.engine,
            base_names=[self.model_name, settings.model_name, *settings.model_alias_names],
            strict=settings.strict_model_names,
            restart_wait_s=settings.engine_restart_wait_s,
        )
        self.routed_experts_shape = self._routed_experts_shape()

    @property
    def context_length(self) -> int | None:
        """The model's context, as the turn core bounds requests by it (None: unknown)."""
        return self.turns.context_length

    def _routed_experts_shape(self) -> tuple[int, int] | None:
        """The MoE shape routed experts are read in; the start fails where they cannot be recorded."""
        settings = self.settings
        if not settings.record_routed_experts:
            return None
        if not getattr(self.engine, "supports_routed_experts", False):
            raise ValueError(f"--record-routed-experts: the {self.engine.name} engine cannot return them")
        return settings.routed_experts_dims
