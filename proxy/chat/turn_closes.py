"""Every token that ends an assistant turn, per kind of message that follows, under every switch
of the served template.

A template may write another close for the same turn when a caller sets one of its optional
variables through chat_template_kwargs (Llama 3.1 ends a tool call with <|eom_id|> instead of
<|eot_id|> once builtin_tools is set), and a model may sample either. The probe's turns are rendered
with each such variable set; a token counts as a close only where it stands in place of a known
close and the rest of the render after the turn is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from proxy.chat.probe import ANSWER, APPEND_KINDS, AppendKind, appended, conversation
from proxy.errors import TemplateError

if TYPE_CHECKING:
    from proxy.chat.renderer import Renderer

FOLLOWERS = (*APPEND_KINDS, "end")  # "end": the turn is the last message, as when sampled
_TURNS = ("answer", "calls")

Key = tuple[str, str]


class TurnCloses:
    def __init__(self, renderer: Renderer, known: frozenset[str]) -> None:
        self.renderer = renderer
        self.known = known  # the closes the default renders showed

    def by_following(self) -> dict[str, list[str]]:
        closes: dict[str, list[str]] = {follower: [] for follower in FOLLOWERS}
        defaults = {(turn, f): self._tail(turn, f, {}) for turn in _TURNS for f in FOLLOWERS}
        for (_, follower), tail in defaults.items():
            _add(closes[follower], self._first_close(tail))
        for kwargs in self._variants():
            # Cheap first look: a switch that changes no close of a last turn is not explored further.
            if not any(self._swapped(defaults[(t, "end")], self._tail(t, "end", kwargs)) for t in _TURNS):
                continue
            for (turn, follower), default in defaults.items():
                _add(closes[follower], self._swapped(default, self._tail(turn, follower, kwargs)))
        return closes

    def _variants(self) -> list[dict[str, Any]]:
        # Each switch set to an empty list (it passes `is defined` and loops) and to True (it passes `if`).
        names = sorted(self.renderer.template.optional_variables())
        trials: tuple[Any, ...] = ([], True)
        return [{name: value} for name in names for value in trials]

    def _tail(self, turn: str, follower: str, kwargs: dict[str, Any]) -> list[str] | None:
        """The render after the probe turn's marker: text, special token, text, ... text."""
        messages = conversation(system=True, tool_cycle=False, call=turn == "calls", calls_only=True)
        if follower != "end":
            messages += appended(cast("AppendKind", follower))
        try:
            text = self.renderer.render_text(messages, template_kwargs=kwargs or None)
        except TemplateError:
            return None
        at = text.rfind(ANSWER)
        if at < 0:
            return None
        at += len(ANSWER)
        pieces: list[str] = []
        while (found := self.renderer.first_special_after(text, at)) is not None:
            pieces += [text[at : found[0]], found[1]]
            at = found[0] + len(found[1])
        pieces.append(text[at:])
        return pieces

    def _first_close(self, tail: list[str] | None) -> str | None:
        return next((piece for piece in (tail or [])[1::2] if piece in self.known), None)

    def _swapped(self, default: list[str] | None, variant: list[str] | None) -> str | None:
        """The token a variant writes in place of a known close, when that is its only difference."""
        if default is None or variant is None or len(default) != len(variant):
            return None
        differing = [i for i, (a, b) in enumerate(zip(default, variant, strict=True)) if a != b]
        if len(differing) != 1 or differing[0] % 2 == 0 or default[differing[0]] not in self.known:
            return None
        return variant[differing[0]]


def _add(closes: list[str], close: str | None) -> None:
    if close is not None and close not in closes:
        closes.append(close)
