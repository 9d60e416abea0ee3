"""`tito-proxy show`: one path of a session in the terminal, coloured as in the viewer (ANSI)."""

from __future__ import annotations

import math
from typing import Any

RESET = "\x1b[0m"
DIM = "\x1b[2;37m"  # mask 0: template and tool text
SPECIAL = "\x1b[1;35m"
UNDERLINE = "\x1b[4m"
# Background colours of the 256-colour palette, from unlikely (red) to certain (green) sampled tokens.
_SCALE = (196, 202, 208, 214, 220, 226, 190, 154, 118, 82, 46)


def logprob_colour(logprob: float) -> str:
    probability = math.exp(max(logprob, -50.0))
    step = _SCALE[min(len(_SCALE) - 1, int(probability * len(_SCALE)))]
    return f"\x1b[30;48;5;{step}m"


def _marks(data: dict[str, Any]) -> dict[int, str]:
    marks = {edit["position"]: f"edit:{edit['kind']}" for edit in data["edits"]}
    for difference in data["drift"]:
        marks.setdefault(difference["position"], f"drift:{difference['kind']}")
    return marks


def render(data: dict[str, Any]) -> str:
    """The path's tokens: mask 1 on a logprob-coloured background, mask 0 dim, specials bold,
    boundary edits and drift underlined and listed below with their positions."""
    marks = _marks(data)
    out = [
        f"session {data['session_id']} · segment {data['segment_id']} · {data['branch']} · "
        f"{len(data['ids'])} tokens (prompt {data['prompt_len']}) · reward {data['reward']}\n",
        f"legend: {logprob_colour(0.0)}sampled p≈1{RESET} {logprob_colour(-3.0)}sampled p≈0.05{RESET} "
        f"{DIM}mask 0{RESET} {SPECIAL}special{RESET} {UNDERLINE}edit/drift{RESET}\n\n",
    ]
    for position, piece in enumerate(data["pieces"]):
        style = logprob_colour(data["logprobs"][position]) if data["mask"][position] else DIM
        if data["special"][position]:
            style += SPECIAL
        if position in marks:
            style += UNDERLINE
        out.append(f"{style}{piece}{RESET}")
    out.append("\n\n")
    for call in data["calls"]:
        out.append(
            f"call {call['call_id']}: tokens {call['start']}-{call['end']} · weights {call['weight_version']}"
            f" · {call['finish_reason']}\n"
        )
    for position, mark in sorted(marks.items()):
        out.append(f"{mark} @ {position}\n")
    return "".join(out)


def pick_path(detail: dict[str, Any], segment: int | None) -> int:
    """The path to show: the kept (final) line of `segment`, else its first; default the first path."""
    paths = detail["paths"]
    if segment is not None:
        paths = [p for p in paths if p["segment_id"] == segment]
        if not paths:
            raise LookupError(f"session {detail['id']} has no segment {segment}")
    if not paths:
        raise LookupError(f"session {detail['id']} has no recorded path")
    final = [p for p in paths if p["branch"] == "final"]
    index: int = (final or paths)[0]["index"]
    return index
