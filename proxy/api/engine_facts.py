"""What the engine says of itself (its model, context length, weight version), read at start; an
engine that was down then is asked again, in the background and before a turn, until it answers.

Without it, a proxy started before its engine served every turn with no context length (a
`max_tokens` past the context was cut short by the engine instead of refused) and under the
tokenizer's name, however long the engine had been up since.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from proxy.engines.base import Engine, EngineInfo
from proxy.errors import ProxyError

log = logging.getLogger("tito_proxy.engine")

# How often an engine that has not answered yet is asked again in the background.
RETRY_S = 1.0
# How long a turn waits for the engine's answer before it goes on without it (its own call to an
# engine that cannot answer fails as it would have).
TURN_WAIT_S = 2.0


class EngineFacts:
    def __init__(self, engine: Engine, apply: Callable[[EngineInfo], None], retry_s: float = RETRY_S) -> None:
        self.engine = engine
        self.apply = apply
        self.retry_s = retry_s
        self.known = False
        self._asking: asyncio.Task[bool] | None = None
        self._warned = False

    async def learn(self) -> bool:
        """Ask the engine, or wait for the question already asked (concurrent turns share one);
        whether its facts are known now."""
        if self.known:
            return True
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._asking)

    async def before_turn(self) -> None:
        """A turn's wait for the facts, at most TURN_WAIT_S."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.learn(), TURN_WAIT_S)

    async def _ask(self) -> bool:
        try:
            info = await self.engine.info()
        except ProxyError as exc:
            if not self._warned:  # once, not every second or every turn
                log.warning("engine info unavailable (%s); asked again until it answers", exc.message)
                self._warned = True
            return False
        self.apply(info)
        self.known = True
        if self._warned:
            log.info("engine info read: model %s, context %s", info.model, info.context_length)
        return True

    async def follow(self) -> None:
        """Until the engine has answered: ask it again every `retry_s` (GET /v1/models, for one,
        names its model without waiting for a turn)."""
        while not self.known:
            await asyncio.sleep(self.retry_s)
            await self.learn()
