"""What the engine says of itself (its model, context length, weight version), read at start; an
engine that was down then is asked again, in the background and before any turn, until it answers.

Without it, a proxy started before its engine served every turn with no context length (a
`max_tokens` past the context was cut short by the engine instead of refused) and under the
tokenizer's name, however long the engine had been up since.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from proxy.engines.base import Engine, EngineInfo
from proxy.errors import ProxyError

log = logging.getLogger("tito_proxy.engine")

# How often an engine that has not answered yet is asked again in the background.
RETRY_S = 1.0


class EngineFacts:
    def __init__(self, engine: Engine, apply: Callable[[EngineInfo], None], retry_s: float = RETRY_S) -> None:
        self.engine = engine
        self.apply = apply
        self.retry_s = retry_s
        self.known = False
        self._lock = asyncio.Lock()

    async def learn(self) -> bool:
        """Ask the engine once (one question at a time); whether its facts are known now."""
        async with self._lock:
            if self.known:
                return True
            try:
                info = await self.engine.info()
            except ProxyError as exc:
                log.warning("engine info unavailable (%s); asked again before each turn", exc.message)
                return False
            self.apply(info)
            self.known = True
            return True

    async def follow(self) -> None:
        """Until the engine has answered: ask it again every `retry_s` (GET /v1/models, for one,
        names its model without waiting for a turn)."""
        while not self.known:
            await asyncio.sleep(self.retry_s)
            await self.learn()
