"""The per-process state the lifespan builds and the routes read through dependencies."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.ext.asyncio import AsyncSession as DbSession

from proxy.api.message_prefix import MessagePrefixes
from proxy.api.retries import RetryGuard
from proxy.chat.call_format import ToolParserReport
from proxy.chat.renderer import Renderer
from proxy.chat.token_pieces import TokenPieces
from proxy.config import Settings
from proxy.engines.base import Engine
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
    context_length: int | None
    retries: RetryGuard = field(default_factory=RetryGuard)
    tool_parser: ToolParserReport | None = None  # which parser reads the template's calls
    # Chat histories already validated, per session: a resent history is not validated again.
    message_prefixes: MessagePrefixes = field(default_factory=MessagePrefixes)
    # When this process started serving (Unix seconds, UTC): /v1/models' `created`.
    started_at: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.pieces = TokenPieces(self.renderer.tokenizer, self.renderer.special_ids)
