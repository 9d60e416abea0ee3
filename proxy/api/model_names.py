"""Which weights a request's `model` names: the served model (or an alias), a LoRA adapter the engine
serves, or neither.

The rule for a name that is neither (harnesses send their own defaults, such as Codex CLI's
`gpt-5-codex` or Claude Code's `claude-sonnet-4-5`): it is sampled by the base model and recorded as
requested; with --strict-model-names it is a 404 `model_not_found`. A name the engine listed as an
adapter in this process's life is never sampled by the base weights: once unloaded, it is a 404.

Adapters are the engine's `/v1/models` cards with a `parent` (SGLang and vLLM both list them so),
read at start and cached briefly; an unknown name reads them again (at most once a second), so an
adapter loaded at run time is served without a restart. While such names arrive, the listing is kept
that fresh in the background, so that a turn does not wait for it (a harness sends its own default
name on every turn, often more than a second after the last). While the engine cannot be listed (it is
restarting), an unknown name waits for a listing as long as a turn waits for a restarting engine
(--engine-restart-wait-s), then is refused (503) rather than guessed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from proxy.errors import ModelNotFound, ProxyError

log = logging.getLogger("tito_proxy.models")

# How long a listing of the engine's adapters is used for names it holds.
ADAPTERS_TTL_S = 5.0
# How often at most an unknown name makes the proxy list them again.
REFRESH_S = 1.0
# How often an engine that cannot be listed is tried again while a name waits on it.
RESTART_POLL_S = 0.5
# How long after the last name that is not the base model's the listing is kept fresh in the
# background: one every half second while a harness is at work, none once it has stopped.
KEEP_FRESH_S = 60.0


@dataclass(frozen=True)
class ModelChoice:
    requested: str | None
    adapter: str | None  # None: the base weights


class ModelNames:
    """Resolves request model names against the served names and the engine's adapters."""

    def __init__(
        self,
        engine: Any,
        *,
        base_names: Iterable[str | None],
        strict: bool,
        restart_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        keep_fresh_s: float = KEEP_FRESH_S,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.engine = engine
        self.base_names = frozenset(name for name in base_names if name)
        self.strict = strict
        # How long a name is held while the engine cannot be listed (--engine-restart-wait-s): the
        # turn would wait that long for a restarting engine anyway.
        self.restart_wait_s = restart_wait_s
        self._clock = clock
        self._listed: dict[str, str] = {}
        self._listed_at: float | None = None
        self._lock: asyncio.Lock | None = None
        self._ever_listed: set[str] = set()
        # Why the last listing failed: an unknown name is then refused, since it may be an adapter.
        self._failure: ProxyError | None = None
        self.keep_fresh_s = keep_fresh_s
        self.refresh_s = refresh_s
        self._refresher: asyncio.Task[None] | None = None
        self._other_name_at = 0.0  # time.monotonic() of the last name that is not the base model's

    def serve_also(self, name: str) -> None:
        """The base model answers to this name too (the engine's, once it could be asked)."""
        self.base_names = self.base_names | {name}

    @functools.cached_property
    def serves_adapters(self) -> bool:
        """Whether the engine lists adapters; asked once (through its wrappers' __getattr__ it cost
        ~1% of a turn's CPU when asked on every turn that names another model)."""
        return callable(getattr(self.engine, "adapters", None))

    async def adapters(self, *, older_than: float = ADAPTERS_TTL_S) -> dict[str, str]:
        """The engine's adapters (name -> path), listed again when the last listing is older than this."""
        if not self.serves_adapters:
            return {}
        if self._fresh(older_than):
            return self._listed
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._fresh(older_than):  # listed by a request that held the lock first
                return self._listed
            try:
                listed = await self.engine.adapters()
            except ProxyError as exc:
                log.warning("cannot list the engine's LoRA adapters: %s", exc.message)
                self._failure = exc
                return self._listed
            self._listed, self._listed_at, self._failure = listed, self._clock(), None
            self._ever_listed |= listed.keys()
        return self._listed

    async def _list_after_restart(self) -> dict[str, str]:
        """The engine's adapters once it can be listed again, within the restart wait: a restarted
        engine may serve other adapters, so an unknown name is judged on a new listing only."""
        deadline = time.monotonic() + self.restart_wait_s
        while self._failure is not None and time.monotonic() < deadline:
            await asyncio.sleep(min(RESTART_POLL_S, max(0.0, deadline - time.monotonic())))
            await self.adapters(older_than=0.0)
        return self._listed

    def _fresh(self, older_than: float) -> bool:
        return self._listed_at is not None and self._clock() - self._listed_at < older_than

    async def choose(self, name: str | None) -> ModelChoice:
        if name is None or name in self.base_names:
            return ModelChoice(name, None)
        self._keep_fresh()
        if self._failure is None and self._fresh(self.refresh_s):
            # Listed within the refresh interval: the lookups below would all read this listing (a
            # harness's own default name is looked up on every turn).
            return self._chosen(name, self._listed)
        listed = await self.adapters()
        if name not in listed:
            listed = await self.adapters(older_than=self.refresh_s)  # loaded since the last listing?
        if name not in listed and self._failure is not None:
            listed = await self._list_after_restart()
        return self._chosen(name, listed)

    def _keep_fresh(self) -> None:
        """Keeps the listing within the refresh interval in the background while names that are not
        the base model's arrive, so that choosing one reads a listing instead of waiting for one."""
        if not self.serves_adapters:
            return
        self._other_name_at = time.monotonic()
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_while_used())

    async def _refresh_while_used(self) -> None:
        while time.monotonic() - self._other_name_at < self.keep_fresh_s:
            # Listed again at half the interval: a request finds it fresh even while a listing runs.
            await self.adapters(older_than=self.refresh_s / 2)
            await asyncio.sleep(self.refresh_s / 2)

    async def aclose(self) -> None:
        """Stops the background listing (at shutdown)."""
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)

    def _chosen(self, name: str, listed: dict[str, str]) -> ModelChoice:
        """The choice for a name that is not the base model's, given the engine's current listing."""
        if name in listed:
            return ModelChoice(name, name)
        if self._failure is not None:
            raise self._failure  # it may name an adapter loaded meanwhile: never guess the base model
        if name in self._ever_listed:
            raise ModelNotFound(
                f"the LoRA adapter {name!r} is no longer loaded on the engine; it is never sampled by "
                "the base model under its name"
            )
        if self.strict:
            served = ", ".join(sorted(self.base_names | listed.keys()))
            raise ModelNotFound(f"The model {name!r} does not exist: this proxy serves {served}")
        return ModelChoice(name, None)
