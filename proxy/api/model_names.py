"""Which weights a request's `model` names: the served model (or an alias), a LoRA adapter the engine
serves, or neither.

The rule for a name that is neither (harnesses send their own defaults, such as Codex CLI's
`gpt-5-codex` or Claude Code's `claude-sonnet-4-5`): it is sampled by the base model and recorded as
requested; with --strict-model-names it is a 404 `model_not_found`. A name the engine listed as an
adapter in this process's life is never sampled by the base weights: once unloaded, it is a 404.

Adapters are the engine's `/v1/models` cards with a `parent` (SGLang and vLLM both list them so),
read at start and cached briefly; an unknown name reads them again (at most once a second), so an
adapter loaded at run time is served without a restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.errors import ModelNotFound, ProxyError

log = logging.getLogger("tito_proxy.models")

# How long a listing of the engine's adapters is used for names it holds.
ADAPTERS_TTL_S = 5.0
# How often at most an unknown name makes the proxy list them again.
REFRESH_S = 1.0


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.base_names = frozenset(name for name in base_names if name)
        self.strict = strict
        self._clock = clock
        self._listed: dict[str, str] = {}
        self._listed_at: float | None = None
        self._lock: asyncio.Lock | None = None
        self._ever_listed: set[str] = set()

    @property
    def serves_adapters(self) -> bool:
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
                return self._listed
            self._listed, self._listed_at = listed, self._clock()
            self._ever_listed |= listed.keys()
        return self._listed

    def _fresh(self, older_than: float) -> bool:
        return self._listed_at is not None and self._clock() - self._listed_at < older_than

    async def choose(self, name: str | None) -> ModelChoice:
        if name is None or name in self.base_names:
            return ModelChoice(name, None)
        listed = await self.adapters()
        if name not in listed:
            listed = await self.adapters(older_than=REFRESH_S)  # loaded since the last listing?
        if name in listed:
            return ModelChoice(name, name)
        if name in self._ever_listed:
            raise ModelNotFound(
                f"the LoRA adapter {name!r} is no longer loaded on the engine; it is never sampled by "
                "the base model under its name"
            )
        if self.strict:
            served = ", ".join(sorted(self.base_names | listed.keys()))
            raise ModelNotFound(f"The model {name!r} does not exist: this proxy serves {served}")
        return ModelChoice(name, None)


def routed_experts_shape(declared: str | None, directories: Iterable[Path | None]) -> tuple[int, int] | None:
    """(layers, top_k) of a MoE model: `LAYERS,TOP_K` as declared, else its config.json's
    num_hidden_layers and num_experts_per_tok (what SGLang sizes its routing buffers by)."""
    if declared:
        layers, _, top_k = declared.replace("x", ",").partition(",")
        return int(layers), int(top_k)
    for directory in directories:
        config_file = directory / "config.json" if directory is not None else None
        if config_file is None or not config_file.is_file():
            continue
        config = json.loads(config_file.read_text())
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        layers, top_k = text.get("num_hidden_layers"), text.get("num_experts_per_tok")
        if isinstance(layers, int) and isinstance(top_k, int):
            return layers, top_k
    return None
