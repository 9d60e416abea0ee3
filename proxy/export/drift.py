"""Where a recorded token stream differs from a fresh chat-template render of the same messages.

Both sequences are cut at special tokens and aligned piece by piece; every differing region is
classified with a kind of chat-templates.md section 5 (or `system_relocated`) and the stream
position where it starts. A region is classified by what differs in it, not by what it touches:
only the assistant's own sampled text, whitespace and BPE splits may be canonicalized; a missing,
extra or changed marker token (role, tool call, any added token) or non-assistant token is a bug,
reported as `unclassified` at the position of the first such token.

Three rules keep that judgement on what really differs:
- A run the stream holds and the render lacks may sit anywhere between equal tokens (gpt-oss's
  `<|end|><|start|>assistant` before or after an analysis message); it is judged where it holds the
  fewest prompt tokens, as the engine sampled it.
- What a render writes to close a turn cut short (max_tokens, a stop string) is split off the region:
  the close token, with the end of reasoning the turn left open, is `truncation_close_synthesized`
  (whether the proxy synthesized it mid-stream or only the render writes it after a last turn), a
  separator after it `final_separator_absent`; the rest of the region is judged on its own.
- `repeated_opener_dropped` (allowed, a render artefact): DeepSeek V3/R1 templates write the
  openers of a tool-call turn (the Assistant role and tool-calls-begin markers) and of tool results
  (tool-outputs-begin) only for the first such block of a conversation (`ns.is_first` and
  `ns.is_output_first` are never reset), so a fresh render writes later ones without them (a call
  turn as `\n` and its calls). The stream, as the engine got it, is right. Named only when the render
  writes at most whitespace in their place and writes those same markers, before the same next
  token, exactly once in the conversation and earlier; any other missing marker stays a bug.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

DriftMode = Literal["strict", "ignore_strippable", "disable"]

ALLOWED_KINDS = frozenset(
    {
        "separator_inserted",
        "final_separator_absent",
        "assistant_bpe",
        "gen_prompt_merge",
        "assistant_canonicalization",
        "history_reasoning_stripped",
        "think_wrapper",
        "stop_token_rewrite",
        "truncation_close_synthesized",
        "date_changed",
        "system_relocated",
        "repeated_opener_dropped",
    }
)
_DATE = re.compile(r"\d{1,4}[-/ ]\w{2,9}[-/ ]\d{2,4}")
_THINK_TAGS = re.compile(r"</?think>")
_EMPTY_THINK = re.compile(r"^\s*<think>\s*</think>\s*")
_UNCLOSED_THINK = re.compile(r"\s*<think>(?:(?!</think>).)*", re.DOTALL)
_OPENS_THINK = re.compile(r"<think>\s*$")
_CLOSES_THINK = re.compile(r"\s*</think>")
# A reasoning block as the stream holds it: `<think>...</think>`, or a harmony analysis message up to
# the next assistant header (the token alignment may leave its one `<|channel|>` on either side).
_REASONING_BLOCKS = (
    re.compile(r"<think>.*?</think>", re.DOTALL),
    re.compile(
        r"<\|channel\|>analysis<\|message\|>.*?<\|end\|><\|start\|>assistant(?!<\|channel\|>)", re.DOTALL
    ),
    re.compile(
        r"(?<!<\|channel\|>)analysis<\|message\|>.*?<\|end\|><\|start\|>assistant<\|channel\|>", re.DOTALL
    ),
)


@dataclass(frozen=True)
class Difference:
    kind: str
    position: int  # index in the stream (prompt + response) where the difference starts
    stream_text: str
    render_text: str
    whitespace_only: bool

    @property
    def allowed(self) -> bool:
        return self.kind in ALLOWED_KINDS

    def as_json(self, prompt_len: int) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "allowed": self.allowed,
            "position": self.position,
            "response_position": self.position - prompt_len,
            "stream_text": self.stream_text[:200],
            "render_text": self.render_text[:200],
            "whitespace_only": self.whitespace_only,
        }


@dataclass(frozen=True)
class StreamFacts:
    """What the recorder knows about each stream position."""

    ids: Sequence[int]
    sampled: Sequence[bool]  # True where the engine produced the token (loss mask 1)
    synthesized: frozenset[int]  # positions of synthesized closes
    close_ids: frozenset[int]
    # The conversation's system prompts: Mistral templates write them into the last user message only.
    system_texts: tuple[str, ...] = ()
    # Where the outputs of calls answered with tool calls start.
    call_starts: frozenset[int] = frozenset()


def _pieces(ids: Sequence[int], specials: frozenset[int]) -> list[tuple[int, int]]:
    """(start, end) spans: each special token alone, each run of ordinary tokens together."""
    spans: list[tuple[int, int]] = []
    start = 0
    for index, token in enumerate(ids):
        if token in specials:
            if start < index:
                spans.append((start, index))
            spans.append((index, index + 1))
            start = index + 1
    if start < len(ids):
        spans.append((start, len(ids)))
    return spans


def _drops_reasoning_block(s_text: str, r_text: str) -> bool:
    """The stream's text is the render's with one reasoning block more, whitespace aside."""
    for block in _REASONING_BLOCKS:
        rest, found = block.subn("", s_text, count=1)
        if found and not block.search(r_text) and _whitespace_only(rest, r_text):
            return True
    return False


def _whitespace_only(a: str, b: str) -> bool:
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op != "equal" and (a[a0:a1].strip() or b[b0:b1].strip()):
            return False
    return True


class DriftClassifier:
    def __init__(self, decode: Any, specials: frozenset[int], markers: frozenset[int] = frozenset()) -> None:
        self._decode = decode
        self._specials = specials
        # Tokens that carry structure (roles, tool calls, think tags): the specials and other added tokens.
        self._markers = specials | markers

    def compare(self, stream: StreamFacts, render: Sequence[int]) -> list[Difference]:
        s_spans = _pieces(stream.ids, self._specials)
        r_spans = _pieces(render, self._specials)
        s_keys = [tuple(stream.ids[a:b]) for a, b in s_spans]
        r_keys = [tuple(render[a:b]) for a, b in r_spans]
        matcher = difflib.SequenceMatcher(a=s_keys, b=r_keys, autojunk=False)
        differences: list[Difference] = []
        opcodes = matcher.get_opcodes()
        for n, (op, i0, i1, j0, j1) in enumerate(opcodes):
            if op == "equal":
                continue
            s0 = s_spans[i0][0] if i0 < len(s_spans) else len(stream.ids)
            s1 = s_spans[i1 - 1][1] if i1 > i0 else s0
            r0 = r_spans[j0][0] if j0 < len(r_spans) else len(render)
            r1 = r_spans[j1 - 1][1] if j1 > j0 else r0
            if r0 == r1:
                # Equal pieces on either side (opcodes alternate): how far the run may slide.
                low = s_spans[opcodes[n - 1][1]][0] if n else s0
                high = s_spans[opcodes[n + 1][2] - 1][1] if n + 1 < len(opcodes) else s1
                shift = _slide(stream, (s0, s1), (low, high))
                s0, s1, r0, r1 = s0 + shift, s1 + shift, r0 + shift, r1 + shift
            differences.extend(self._region(stream, render, (s0, s1), (r0, r1)))
        return _check_relocations(differences)

    def _region(
        self, stream: StreamFacts, render: Sequence[int], span: tuple[int, int], render_span: tuple[int, int]
    ) -> list[Difference]:
        """A region's differences: the render's close of a turn cut short on its own, the rest judged
        as a region (nothing if the rest is equal)."""
        (s0, s1), (r0, r1) = span, render_span
        cut = self._closing_tail(stream, render, span, render_span)
        if cut is None:
            return [self._classify(stream, render, span, render_span)]
        differences = []
        if list(stream.ids[s0:s1]) != list(render[r0:cut]):
            differences.append(self._classify(stream, render, span, (r0, cut)))
        specials = [i for i in range(cut, r1) if render[i] in self._specials]
        close_end = specials[-1] + 1 if specials else r1
        close = self._decode(list(render[cut:close_end]))
        differences.append(Difference("truncation_close_synthesized", s1, "", close, False))
        if close_end < r1:  # after a last turn: the separator that follows its close
            separator = self._decode(list(render[close_end:r1]))
            differences.append(Difference("final_separator_absent", s1, "", separator, bool(separator)))
        return differences

    def _closing_tail(
        self, stream: StreamFacts, render: Sequence[int], span: tuple[int, int], render_span: tuple[int, int]
    ) -> int | None:
        """Where the render starts closing a turn cut short that the region ends: the end of the
        reasoning it left open (`</think>`), then (after a last turn) the close token and what follows
        it. None if the region ends no such turn, or the render writes no such tail."""
        s1, (r0, r1) = span[1], render_span
        # A last turn ends on a sampled token that is no close; a continued one at a synthesized close.
        last_turn_cut = (
            s1 == len(stream.ids) > 0
            and r1 == len(render)
            and stream.sampled[-1]
            and stream.ids[-1] not in stream.close_ids
        )
        if not (last_turn_cut or (s1 < len(stream.ids) and s1 in stream.synthesized)):
            return None
        texts = [self._decode([t]) for t in render[r0:r1]]
        close = self._close_start(stream, render, render_span, texts) if last_turn_cut else r1
        if close is None:
            return None
        cut = self._reasoning_end(stream, render, span, (r0, close), texts)
        return cut if cut < r1 else None

    def _close_start(
        self, stream: StreamFacts, render: Sequence[int], render_span: tuple[int, int], texts: list[str]
    ) -> int | None:
        """Where the render's trailing specials and whitespace start with a close token (its end if
        there are none; None if they start with another special, which no cut turn explains)."""
        r0, r1 = render_span
        cut = r1
        while cut > r0 and (render[cut - 1] in self._specials or not texts[cut - 1 - r0].strip()):
            cut -= 1
        # Whitespace before the close stays: the turn's own text, as the render joins it.
        while cut < r1 and render[cut] not in self._specials:
            cut += 1
        return None if cut < r1 and render[cut] not in stream.close_ids else cut

    def _reasoning_end(
        self,
        stream: StreamFacts,
        render: Sequence[int],
        span: tuple[int, int],
        render_span: tuple[int, int],
        texts: list[str],
    ) -> int:
        """Where the render's end of the reasoning a cut turn left open starts (`</think>` just before
        `render_span`'s end), or that end. `texts` are the render's tokens from `render_span`'s start."""
        (s0, s1), (r0, cut) = span, render_span
        end = cut
        while end > r0 and not texts[end - 1 - r0].strip():
            end -= 1
        s_text, r_text = self._decode(list(stream.ids[s0:s1])), self._decode(list(render[r0:end]))
        if not (
            end > r0
            and texts[end - 1 - r0] == "</think>"
            and s_text.count("</think>") < r_text.count("</think>")
            # Beyond the stream's, the render closes more blocks than it opens: a block it opens
            # and closes itself (Qwen3's empty think block on a last turn) closes nothing left open.
            and r_text.count("<think>") - s_text.count("<think>")
            < r_text.count("</think>") - s_text.count("</think>")
        ):
            return cut
        cut = end - 1
        # The template's whitespace before it too, once the stream's tokens are all matched (else
        # that whitespace is the counterpart of the turn's own last tokens).
        matched = r0 + (s1 - s0)
        if list(stream.ids[s0:s1]) == list(render[r0:matched]):
            while cut > matched and not texts[cut - 1 - r0].strip():
                cut -= 1
        return cut

    def _classify(
        self, stream: StreamFacts, render: Sequence[int], span: tuple[int, int], render_span: tuple[int, int]
    ) -> Difference:
        (s0, s1), (r0, r1) = span, render_span
        s_ids, r_ids = list(stream.ids[s0:s1]), list(render[r0:r1])
        common = 0
        while common < min(len(s_ids), len(r_ids)) and s_ids[common] == r_ids[common]:
            common += 1
        tail = 0
        # A last turn cut short ends the stream on a sampled token, where the render writes a close
        # and a separator: a sampled newline there only looks like the separator, it is not one.
        truncated_end = s1 == len(stream.ids) and r1 == len(render) and stream.sampled[s1 - 1]
        while (
            not truncated_end
            and tail < min(len(s_ids), len(r_ids)) - common
            and s_ids[-1 - tail] == r_ids[-1 - tail]
        ):
            tail += 1
        # Judge the differing tokens only: a text piece also holds role headers and shared text.
        s_diff, r_diff = s_ids[common : len(s_ids) - tail], r_ids[common : len(r_ids) - tail]
        s_text, r_text = self._decode(s_diff), self._decode(r_diff)
        # Judged on tokens: the same text in other ids (a BPE split) is not a whitespace difference.
        whitespace = s_text != r_text and _whitespace_only(s_text, r_text)
        first, last = s0 + common, s0 + len(s_ids) - tail
        sampled = [stream.sampled[i] for i in range(first, last)] or [
            stream.sampled[min(first, len(stream.ids) - 1)]
        ]

        def diff(kind: str, position: int = first) -> Difference:
            return Difference(kind, position, s_text, r_text, whitespace)

        if not s_diff and s0 == len(stream.ids) and r1 == len(render):
            # After the last sampled close, a render may add a separator (and an EOS, as Phi-3 does).
            tail_ok = all(t in self._specials or not self._decode([t]).strip() for t in r_diff)
            return diff("final_separator_absent" if tail_ok else "unclassified")
        if s_diff and all(i in stream.synthesized for i in range(first, last)) and not r_diff:
            return diff("truncation_close_synthesized")
        if (
            len(s_diff) == 1 == len(r_diff)
            and s_diff[0] in stream.close_ids
            and r_diff[0] in stream.close_ids
        ):
            return diff("stop_token_rewrite")
        if any(sampled):
            if (
                s_diff
                and not r_diff
                and last == len(stream.ids)
                and all(sampled)
                and all(t in stream.close_ids for t in s_diff)
            ):
                return diff("stop_token_rewrite")  # GLM: the sampled opener that ended the last turn
            if s_text == r_text:
                return diff("assistant_bpe" if all(sampled) else "gen_prompt_merge")
            r_after = self._decode(list(render[r0 + len(r_ids) - tail : r0 + len(r_ids) - tail + 4]))
            kind = self._reasoning_kind(stream, first, s_diff, (s_text, r_text), r_after)
            if kind is not None:
                return diff(kind)
            unexplained = self._first_unexplained(stream, first, s_diff, r_diff)
            if unexplained is None:
                return diff("assistant_canonicalization")
            if self._repeated_opener(stream, render, (first, r0 + common), (s_diff, r_diff)):
                return diff("repeated_opener_dropped")
            return diff("unclassified", unexplained)
        before_sample = last < len(stream.ids) and stream.sampled[last]
        if before_sample and not _THINK_TAGS.sub("", s_text + r_text).strip():
            # The generation prompt pre-fills a think opener the history render writes differently.
            return diff("think_wrapper")
        if _relocated_system(s_text, r_text, stream.system_texts):
            return diff("system_relocated")
        if _DATE.sub("<date>", s_text) == _DATE.sub("<date>", r_text) != s_text:
            return diff("date_changed")
        if _drops_reasoning_block(s_text, r_text):
            # Reasoning a fresh render wrote into the prompt (an assistant turn after the last user
            # message), which the render of the later conversation strips as the template does.
            return diff("history_reasoning_stripped")
        if self._repeated_opener(stream, render, (first, r0 + common), (s_diff, r_diff)):
            return diff("repeated_opener_dropped")
        return diff("unclassified")

    def _reasoning_kind(
        self, stream: StreamFacts, first: int, s_diff: list[int], texts: tuple[str, str], r_after: str
    ) -> str | None:
        """An empty think block on one side only, or the stream's reasoning that a render strips,
        with nothing else differing but whitespace. `texts`: the stream's and the render's differing
        text; `r_after`: the render's text after it."""
        s_text, r_text = texts
        for longer, shorter in ((s_text, r_text), (r_text, s_text)):
            wrapper = _EMPTY_THINK.match(longer)
            if wrapper and longer[wrapper.end() :].strip() == shorter.strip():
                return "think_wrapper"
        # What the stream holds beyond the assistant's own tokens may only be a pre-filled think opener.
        prompt_part = [t for i, t in enumerate(s_diff) if not stream.sampled[first + i]]
        if _THINK_TAGS.sub("", self._decode(prompt_part)).strip():
            return None
        after_turn = first + len(s_diff)
        if (
            (after_turn == len(stream.ids) or stream.ids[after_turn] in stream.close_ids)
            and _UNCLOSED_THINK.fullmatch(s_text)
            and not r_text.strip()
        ):
            return "history_reasoning_stripped"  # reasoning cut by max_tokens, dropped by the render
        if _drops_reasoning_block(s_text, r_text):
            return "history_reasoning_stripped"
        # The render keeps an empty think block (GLM, Nemotron): only the text inside it went. The
        # render closes it where the stream does, or where the stream's turn was cut (`r_after`).
        before = self._decode(list(stream.ids[max(0, first - 4) : first]))
        after = self._decode(list(stream.ids[first + len(s_diff) : first + len(s_diff) + 4]))
        if (
            not r_text.strip()
            and _OPENS_THINK.search(before)
            and (_CLOSES_THINK.match(after) or _CLOSES_THINK.match(r_after))
            and "<think>" not in s_text
            and "</think>" not in s_text
        ):
            return "history_reasoning_stripped"
        return None

    def _repeated_opener(
        self,
        stream: StreamFacts,
        render: Sequence[int],
        starts: tuple[int, int],
        diffs: tuple[list[int], list[int]],
    ) -> bool:
        """The stream holds openers the render leaves out here (empty or own think blocks aside),
        writing at most whitespace in their place, while it writes the same markers, before the token
        that follows them here, once in the whole conversation and earlier: a template that opens
        such a block only once (see the module docstring). `starts`: where the differing tokens
        `diffs` start, in the stream and in the render."""
        (first, r_first), (s_diff, r_diff) = starts, diffs
        r_next = r_first + len(r_diff)
        last = first + len(s_diff)
        if (
            any(t in self._markers for t in r_diff)
            or r_next >= len(render)
            or last >= len(stream.ids)
            or stream.ids[last] != render[r_next]
        ):
            return False
        keep = self._without_think_blocks(s_diff, lambda k: self._own_or_think(stream, first + k))
        marks = [k for k in keep if s_diff[k] in self._markers]
        text = self._decode([s_diff[k] for k in keep if s_diff[k] not in self._markers])
        if not marks or not _whitespace_only(text, self._decode(r_diff)):
            return False
        opener = [s_diff[k] for k in _sampled_openers(stream, first, marks)]
        pattern, ids = [*opener, render[r_next]], list(render)
        found = [i for i in range(len(ids) - len(pattern) + 1) if ids[i : i + len(pattern)] == pattern]
        return len(found) == 1 and found[0] + len(pattern) <= r_first

    def _first_unexplained(
        self, stream: StreamFacts, first: int, s_diff: list[int], r_diff: list[int]
    ) -> int | None:
        """The stream position of the first difference that is not a canonicalization of the
        assistant's own text: a marker token missing, extra or changed, a changed or lost
        non-assistant token, or text the render adds away from the assistant's tokens. None if all
        are. Markers are paired first, so that text is only ever compared with its counterpart."""
        positions = [first + k for k in range(len(s_diff))]
        # Reasoning the stream holds and the render drops, and an empty think block on either side,
        # are not structure lost (the close of a turn cut short is split off before: `_region`).
        s_keep = self._without_think_blocks(s_diff, lambda k: self._own_or_think(stream, positions[k]))
        r_keep = self._without_think_blocks(r_diff, lambda k: False)
        s_marks = [n for n, k in enumerate(s_keep) if s_diff[k] in self._markers]
        r_marks = [n for n, k in enumerate(r_keep) if r_diff[k] in self._markers]
        s_seq, r_seq = [s_diff[s_keep[n]] for n in s_marks], [r_diff[r_keep[n]] for n in r_marks]
        if s_seq != r_seq:
            # The special token that opened a turn answered with tool calls (not a close), which
            # the render leaves out, nothing else of the structure differing: the prefix of a call
            # the template writes back without it (Llama's `<|python_tag|>` before a JSON call).
            # Judged with the text around it below. A call answered as text keeps its marker in
            # the answer's place: one the render lacks there is a bug.
            own = [n for n in s_marks if positions[s_keep[n]] in stream.call_starts]
            rest = [n for n in s_marks if n not in own]
            if len(own) == 1 and [s_diff[s_keep[n]] for n in rest] == r_seq:
                s_marks, s_seq = rest, r_seq
        if s_seq != r_seq:
            pairs = zip(s_seq, r_seq, strict=False)
            k = next((n for n, (a, b) in enumerate(pairs) if a != b), min(len(s_seq), len(r_seq)))
            if k < len(s_marks):
                return positions[s_keep[s_marks[k]]]
            return positions[s_keep[s_marks[k - 1]]] + 1 if k else first
        s_bounds, r_bounds = [-1, *s_marks, len(s_keep)], [-1, *r_marks, len(r_keep)]
        for n in range(len(s_bounds) - 1):
            kept = s_keep[s_bounds[n] + 1 : s_bounds[n + 1]]
            anchor = positions[s_keep[s_bounds[n]]] + 1 if n else first
            s_part = [s_diff[k] for k in kept]
            r_part = [r_diff[k] for k in r_keep[r_bounds[n] + 1 : r_bounds[n + 1]]]
            bad = self._text_unexplained(stream, [positions[k] for k in kept], anchor, s_part, r_part)
            if bad is not None:
                return bad
        return None

    def _own_or_think(self, stream: StreamFacts, position: int) -> bool:
        """Sampled, or part of a think opener the generation prompt pre-filled."""
        return (
            stream.sampled[position] or not _THINK_TAGS.sub("", self._decode([stream.ids[position]])).strip()
        )

    def _without_think_blocks(self, tokens: list[int], removable: Any) -> list[int]:
        """Indices of `tokens` without `<think>...</think>` blocks that are empty, or whose every token
        is `removable`."""
        keep = list(range(len(tokens)))
        texts = [self._decode([t]) if t in self._markers else "" for t in tokens]
        for opener in [k for k, text in enumerate(texts) if text == "<think>"]:
            closer = next((k for k in range(opener + 1, len(tokens)) if texts[k] == "</think>"), None)
            if closer is None:
                continue
            span = range(opener, closer + 1)
            empty = not self._decode(tokens[opener + 1 : closer]).strip()
            if (empty or all(removable(k) for k in span)) and all(k in keep for k in span):
                keep = [k for k in keep if k not in span]
        return keep

    def _prompt_text_kept(self, s_sub: list[int], own: list[bool], r_sub: list[int]) -> bool:
        """Prompt tokens around the assistant's own tokens whose text the render keeps as it is: only
        the split into tokens and the assistant's text differ."""
        run = _split_own(own)
        if run is None:
            return False
        before, after = self._decode(s_sub[: run[0]]), self._decode(s_sub[run[1] :])
        text = self._decode(r_sub)
        return len(text) >= len(before) + len(after) and text.startswith(before) and text.endswith(after)

    def _text_unexplained(
        self, stream: StreamFacts, positions: list[int], anchor: int, s_part: list[int], r_part: list[int]
    ) -> int | None:
        """Where two marker-free texts differ in more than the assistant's own tokens, or None.
        `positions` are the stream positions of `s_part`, `anchor` where it starts. Judged on the
        differing middle as a whole: a token-level alignment of BPE pieces is arbitrary."""
        head = 0
        while head < min(len(s_part), len(r_part)) and s_part[head] == r_part[head]:
            head += 1
        tail = 0
        while tail < min(len(s_part), len(r_part)) - head and s_part[-1 - tail] == r_part[-1 - tail]:
            tail += 1
        s_mid, r_mid = s_part[head : len(s_part) - tail], r_part[head : len(r_part) - tail]
        at_mid = positions[head : len(positions) - tail]
        if not s_mid:
            if not r_mid:
                return None
            at = positions[head] if head < len(positions) else (positions[-1] + 1 if positions else anchor)
            # Text the template writes into the assistant's turn (JSON spacing, newlines).
            return None if _next_to_sampled(stream, at) else at
        own = [stream.sampled[p] for p in at_mid]
        if all(own) or (any(own) and self._prompt_text_kept(s_mid, own, r_mid)):
            return None  # the assistant's text, and prompt tokens fused with it whose text is kept
        return at_mid[own.index(False)]


def _sampled_openers(stream: StreamFacts, first: int, marks: list[int]) -> list[int]:
    """The openers to look for earlier in the render: the sampled ones where markers the generation
    prompt ended with come first (DeepSeek V3's close of the tool outputs, which a render of the
    same turn leaves out, with the calls opener the model sampled after it); else all of them."""
    sampled = [k for k in marks if stream.sampled[first + k]]
    prompt = [k for k in marks if not stream.sampled[first + k]]
    if not sampled or not prompt or max(prompt) > min(sampled):
        return marks
    prompt_end = max(prompt) + 1  # the generation prompt's last marker, right before the output
    if first + prompt_end >= len(stream.ids) or not stream.sampled[first + prompt_end]:
        return marks
    return sampled


def _slide(stream: StreamFacts, span: tuple[int, int], bounds: tuple[int, int]) -> int:
    """How far to move a run only the stream holds, within equal tokens `bounds`, so that it holds
    the fewest prompt tokens (the nearest such place): moved by one, it drops a token at one end and
    takes the same id at the other, an equally valid alignment."""
    (s0, s1), (low, high) = span, bounds
    ids, sampled = stream.ids, stream.sampled
    shifts = [0]
    while s1 + shifts[-1] < high and ids[s0 + shifts[-1]] == ids[s1 + shifts[-1]]:
        shifts.append(shifts[-1] + 1)
    left = 0
    while s0 + left > low and ids[s0 + left - 1] == ids[s1 + left - 1]:
        left -= 1
        shifts.append(left)

    def prompt_tokens(shift: int) -> tuple[int, int]:
        return sum(not sampled[i] for i in range(s0 + shift, s1 + shift)), abs(shift)

    return min(shifts, key=prompt_tokens)


def _split_own(own: list[bool]) -> tuple[int, int] | None:
    """(start, end) of the sampled run when `own` is prompt tokens, sampled ones, prompt tokens."""
    start = own.index(True)
    end = len(own) - own[::-1].index(True)
    return (start, end) if all(own[start:end]) else None


def _next_to_sampled(stream: StreamFacts, at: int) -> bool:
    return (at > 0 and stream.sampled[at - 1]) or (at < len(stream.ids) and stream.sampled[at])


def _relocated_system(s_text: str, r_text: str, system_texts: Sequence[str]) -> bool:
    """Exactly one system prompt (and the whitespace joining it to the user text) on one side only:
    a Mistral template writes it into whichever user message is last."""
    for system in system_texts:
        if not system.strip():
            continue
        for longer, shorter in ((s_text, r_text), (r_text, s_text)):
            if system in longer and longer.replace(system, "", 1).strip() == shorter.strip():
                return True
    return False


def _check_relocations(differences: list[Difference]) -> list[Difference]:
    """A relocation moves the system prompt forward: out of one user message of the stream, into at
    most one later place of the render. Anything else (a stream without it, two copies) is a bug."""
    moves = [i for i, d in enumerate(differences) if d.kind == "system_relocated"]
    removed = [differences[i].position for i in moves if _has_system_in_stream(differences[i])]
    added = [differences[i].position for i in moves if not _has_system_in_stream(differences[i])]
    if not moves or (len(removed) == 1 and len(added) <= 1 and all(at > removed[0] for at in added)):
        return differences
    return [replace(d, kind="unclassified") if i in moves else d for i, d in enumerate(differences)]


def _has_system_in_stream(difference: Difference) -> bool:
    return len(difference.stream_text.strip()) > len(difference.render_text.strip())


def report(differences: Sequence[Difference], mode: DriftMode, prompt_len: int) -> dict[str, Any]:
    kept = [d for d in differences if not (mode == "ignore_strippable" and d.whitespace_only)]
    counts = Counter(d.kind for d in kept)
    return {
        "mode": mode,
        "differences": [d.as_json(prompt_len) for d in kept],
        "counts": dict(sorted(counts.items())),
        "unclassified": sum(1 for d in kept if not d.allowed),
    }
