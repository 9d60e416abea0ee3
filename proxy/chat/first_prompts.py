"""The rendered texts of first prompts, kept in a bounded LRU cache: an RL run sends each many times.

Every rollout of a task opens its session with the same messages and tools, so the chat template
would render the same text again (its tool list through json.dumps, tool by tool). A render depends
on nothing but its inputs where the template draws no random value and the date it reads is pinned,
so the text is kept under an exact key of those inputs: their pickle, which tells apart every
value and type the template could (1 and 1.0 and True, NaN and None, key order).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from proxy.chat.bounded_texts import BoundedTexts

MAX_ENTRIES = 1024
MAX_CHARS = 8 * 1024 * 1024


class FirstPrompts(BoundedTexts):
    """Texts by the exact inputs of their render; `key` is None where a render must run anyway."""

    def __init__(
        self, *, pure: bool, reads_date: bool, max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS
    ) -> None:
        """`pure`: the template draws no random value; `reads_date`: the date is part of the key."""
        super().__init__(max_entries=max_entries, max_chars=max_chars)
        self._pure, self._reads_date = pure, reads_date

    def key(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        add_generation_prompt: bool,
        now: datetime | None,
        shape: tuple[str, ...],
    ) -> bytes | None:
        """The render's inputs as bytes (`shape`: how the renderer passes calls), or None when the
        render may differ on equal inputs, its inputs do not pickle, or it is no first prompt: a
        history rendered afresh holds assistant turns, and is seldom sent twice."""
        if not self._pure or (self._reads_date and now is None):
            return None  # an unpinned date is read from the clock
        if any(message.get("role") == "assistant" for message in messages):
            return None
        inputs = (messages, tools, template_kwargs, add_generation_prompt, now if self._reads_date else None)
        try:
            return pickle.dumps((shape, inputs), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
            return None
