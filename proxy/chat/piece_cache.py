"""Exact encoding piece by piece between added tokens, the pieces' ids kept in a bounded LRU cache.

A Hugging Face tokenizer first cuts its input at the added tokens that are not normalized (the
longest match, leftmost first), then normalizes, pre-tokenizes and encodes each piece between them on
its own, and post-processing adds nothing without `add_special_tokens`. So the ids of a text are the
ids of its chunks concatenated, a chunk being an added token with the text up to the next one (and
the text before the first): each chunk starts where the tokenizer itself starts a piece, and keeps the
token before its text so that a pre-tokenizer that treats the text's very start differently (Metaspace's
`prepend_scheme="first"`) sees the same thing. The same system prompt and tool list start most
prompts of an RL run (every rollout of a task, every epoch), so their chunk costs a dict lookup.

That holds only for the plain case, decided at start-up from the tokenizer itself: no added token that
strips whitespace or must stand as a single word (those look past their own text), special tokens
split (`encode_special_tokens` off), no truncation, padding or BPE dropout; then a self-check on texts
that hold every added token in varied surroundings must give the plain encode's ids. Anything else
keeps the plain encode (the reason is reported at GET /v1/template as `encode_cache`).

Once the process has encoded FAST_BPE_AFTER_TOKENS tokens, a worker thread tries to prove tiktoken
exact for the tokenizer (rank_bpe.py); from then on a chunk's ASCII text is encoded by it, ~5x faster.
"""

from __future__ import annotations

import operator
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from proxy import native_memory
from proxy.chat.rank_bpe import RankBpe, RankBpeRefused
from proxy.chat.token_trie import trie_pattern

# The cache's bounds: ids (Python ints in tuples, ~36 bytes each) and the chunks' characters.
MAX_IDS = 512 * 1024
MAX_CHARS = 4 * 1024 * 1024
# A chunk larger than this share of a bound is encoded but not kept (a one-off large tool result).
_LARGEST_SHARE = 8
# Tokens encoded by the tokenizer itself before tiktoken's equivalence is checked: the check takes
# ~1 s of a worker thread (~0.5 s of it holding the GIL), which a process repays after encoding some
# ~2M tokens at ~0.5 us a token saved; a proxy serving an RL run gets there in minutes, one started
# for a few requests never pays it.
FAST_BPE_AFTER_TOKENS = 100_000
# The largest chunk of a large text tiktoken encodes (~64k tokens, ~2 MB of Python ints built before
# the prompt's length is checked); larger ones are counted by the tokenizer before their ids exist.
FAST_LARGE_CHARS = 256 * 1024

# What surrounds each added token in the self-check: words glued to it, spaces and newlines on either
# side, text that merges across a cut in a single encode, non-ASCII, digits, contractions, nothing.
_SURROUNDINGS = (
    ("", ""),
    ("hello", "world"),
    ("x ", " y"),
    (" ", " "),
    ("end.\n", "\n\n  indented\n\tline"),
    ("données ", "é 123 ünïcödé 漢字 🙂"),
    ("  ", "  "),
    ("a\n", "\n"),
    ("12", "34"),
    ("it", "'s"),
    ("\n\n", "!"),
)


class PromptTooLong(Exception):
    """A render holds more ids than a prompt can: found from the count, before the ids are built."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"{tokens} tokens")
        self.tokens = tokens


def encoding_of(tokenizer: Tokenizer, text: str, *, special: bool = False) -> Any:
    """The tokenizer's encoding of `text` (`special`: with its BOS/EOS): its own encode, minus the
    tokens' character offsets, which `encode` computes and nothing here reads (~10% of the time of
    an encode); the batch call releases the GIL while it works, where `encode` holds it."""
    (encoding,) = tokenizer.encode_batch_fast([text], add_special_tokens=special)
    return encoding


def ids_of(tokenizer: Tokenizer, text: str) -> list[int]:
    """The tokenizer's ids of `text`, without BOS/EOS (encoding_of)."""
    return list(encoding_of(tokenizer, text).ids)


class PieceCache:
    """`encode(text)` gives the tokenizer's own ids for `text` (without its BOS/EOS), from cached
    chunks where the tokenizer is proven to encode that way; `proven` says whether it is."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        max_ids: int = MAX_IDS,
        max_chars: int = MAX_CHARS,
        large_chars: int = 8192,
        fast_bpe_after: int | None = FAST_BPE_AFTER_TOKENS,
    ) -> None:
        """`large_chars`: chunks to encode that hold this many characters together are encoded in one
        batch and counted against the prompt limit before their ids are built. `fast_bpe_after`: the
        tokens to encode before tiktoken is tried (0: now, on this thread; None: never)."""
        self._tokenizer = tokenizer
        self._large_chars = large_chars
        self.max_ids, self.max_chars = max_ids, max_chars
        # Tuples: the garbage collector stops tracking a tuple of ints, so a full cache costs it nothing.
        self._chunks: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._ids = 0
        self._chars = 0
        self._lock = threading.Lock()
        decoder = tokenizer.get_added_tokens_decoder()
        added = {str(decoder[i].content): decoder[i] for i in sorted(decoder)}
        cut_at = [text for text, t in added.items() if not t.normalized and text]
        self.split_tokens = len(cut_at)
        self.reason: str | None
        try:
            self._cuts = re.compile("(" + trie_pattern(cut_at) + ")") if cut_at else None
        except (re.error, RecursionError):
            self._cuts, self.reason = None, "the added tokens do not compile into one pattern"
        else:
            self.reason = _refusal(tokenizer, added) or self._self_check(list(added))
        self.proven = self.reason is None
        self._added_ids = {text: int(i) for i, t in decoder.items() if (text := str(t.content)) in cut_at}
        self.fast = _FastBpe(tokenizer, fast_bpe_after if self.proven else None)

    def as_json(self) -> dict[str, Any]:
        """What GET /v1/template reports: proven, or why the plain encode is kept, and the bounds."""
        return {
            "proven": self.proven,
            "reason": self.reason,
            "split_tokens": self.split_tokens,
            "max_ids": self.max_ids,
            "max_chars": self.max_chars,
            "fast_bpe": self.fast.as_json(),
        }

    def chunks(self, text: str) -> list[str]:
        """`text` cut before every added token the tokenizer cuts at."""
        if self._cuts is None:
            return [text] if text else []
        parts = self._cuts.split(text)
        head = [parts[0]] if parts[0] else []
        return head + list(map(operator.add, parts[1::2], parts[2::2]))

    def encode(self, text: str, *, at_most: int | None = None) -> list[int]:
        """The ids of `text`, chunk by chunk; chunks not cached are encoded, then kept if not too large.
        PromptTooLong past `at_most` ids, counted before the ids of large chunks are built."""
        chunks = self.chunks(text)
        with self._lock:
            found = [self._chunks.get(chunk) for chunk in chunks]
            for chunk, ids in zip(chunks, found, strict=True):
                if ids is not None:
                    self._chunks.move_to_end(chunk)
        missing = [chunk for chunk, ids in zip(chunks, found, strict=True) if ids is None]
        encoded: list[list[int]] = []
        if missing:
            cached = 0 if at_most is None else sum(len(ids) for ids in found if ids is not None)
            encoded = self._encode_each(missing, cached, at_most)
            self._keep(missing, encoded)
        fresh = iter(encoded)
        out: list[int] = []
        for ids in found:
            out.extend(next(fresh) if ids is None else ids)
        if at_most is not None and len(out) > at_most:
            raise PromptTooLong(len(out))
        return out

    def _encode_each(self, chunks: Sequence[str], cached: int, at_most: int | None) -> list[list[int]]:
        """The ids of each chunk; PromptTooLong when they and `cached` ids are more than `at_most`."""
        if sum(map(len, chunks)) < self._large_chars:
            return [self._chunk_ids(chunk) for chunk in chunks]
        # The tokenizer's ids of a refused prompt would hold the GIL for ~0.5 us a token to build, so
        # the chunks left to it are counted first; tiktoken's cost ~10 ns a token (up to a bound on
        # the Python ints a chunk may make before the count).
        found = [self._fast_ids(chunk) if len(chunk) <= FAST_LARGE_CHARS else None for chunk in chunks]
        rest = [chunk for chunk, ids in zip(chunks, found, strict=True) if ids is None]
        encodings = self._tokenizer.encode_batch_fast(rest, add_special_tokens=False) if rest else []
        slow_tokens = sum(len(e) for e in encodings)
        self.fast.encoded(slow_tokens)
        count = cached + slow_tokens + sum(len(ids) for ids in found if ids is not None)
        if at_most is not None and count > at_most:
            raise PromptTooLong(count)
        slow = iter(encodings)
        return [ids if ids is not None else next(slow).ids for ids in found]

    def _chunk_ids(self, chunk: str) -> list[int]:
        """The ids of one chunk: tiktoken's where it applies, else the tokenizer's."""
        ids = self._fast_ids(chunk)
        if ids is None:
            ids = ids_of(self._tokenizer, chunk)
            self.fast.encoded(len(ids))
        return ids

    def _fast_ids(self, chunk: str) -> list[int] | None:
        """The chunk's added token's id, then tiktoken's ids of its text; None where tiktoken is not
        proven or not for this text."""
        encoder = self.fast.encoder
        if encoder is None:
            return None
        head = self._cuts.match(chunk) if self._cuts is not None else None
        token = head.group() if head is not None else ""
        ids = encoder.ids(chunk[len(token) :])
        if ids is None:
            return None
        return [self._added_ids[token], *ids] if token else ids

    def _keep(self, chunks: Sequence[str], ids: Sequence[list[int]]) -> None:
        with self._lock:
            for chunk, chunk_ids in zip(chunks, ids, strict=True):
                if chunk in self._chunks or not self._fits(len(chunk), len(chunk_ids)):
                    continue
                while self._chunks and (
                    self._ids + len(chunk_ids) > self.max_ids or self._chars + len(chunk) > self.max_chars
                ):
                    oldest, oldest_ids = self._chunks.popitem(last=False)
                    self._ids -= len(oldest_ids)
                    self._chars -= len(oldest)
                self._chunks[chunk] = tuple(chunk_ids)
                self._ids += len(chunk_ids)
                self._chars += len(chunk)

    def _fits(self, chars: int, ids: int) -> bool:
        return chars * _LARGEST_SHARE <= self.max_chars and ids * _LARGEST_SHARE <= self.max_ids

    def clear(self) -> None:
        """Forget every chunk (bench.rerender times cold encodes with it)."""
        with self._lock:
            self._chunks.clear()
            self._ids = self._chars = 0

    def cached(self) -> tuple[int, int, int]:
        """Chunks, ids and characters held now."""
        with self._lock:
            return len(self._chunks), self._ids, self._chars

    def _self_check(self, added: Sequence[str]) -> str | None:
        """Why chunked encodes differ from plain ones on the check texts, or None when none does."""
        for text in _check_texts(added):
            plain = list(self._tokenizer.encode(text, add_special_tokens=False).ids)
            chunked = [
                i
                for chunk in self.chunks(text)
                for i in self._tokenizer.encode(chunk, add_special_tokens=False).ids
            ]
            if plain != chunked:
                return f"a chunked encode differs from the plain one on {text[:80]!r}"
        return None


def _refusal(tokenizer: Tokenizer, added: dict[str, Any]) -> str | None:
    """Why the tokenizer's own settings rule out encoding chunk by chunk, or None."""
    for text, token in added.items():
        quirks = [flag for flag in ("lstrip", "rstrip", "single_word") if getattr(token, flag)]
        if quirks:
            return f"added token {text!r} has {', '.join(quirks)}: its match looks past its own text"
        if not text:
            return "an added token is empty"
    if tokenizer.encode_special_tokens:
        return "encode_special_tokens is set: special tokens do not cut the input"
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return "the tokenizer truncates or pads"
    if getattr(tokenizer.model, "dropout", None):
        return "the model has BPE dropout: its encodes are random"
    return None


# Tokens per self-check text, and how many (the first by id: a chat format's own) are checked in
# every surrounding; all others in a few. One text per token would cost seconds with thousands of them.
_TOKENS_PER_CHECK = 16
_THOROUGH = 256


def _check_texts(added: Sequence[str]) -> list[str]:
    """Texts holding every added token next to another, after a partial copy of itself, at the
    very start and end, and the first _THOROUGH in every surrounding; and plain texts without any."""
    texts = ["", " leading space", "plain text, no token", "données 漢字 🙂\n\n\t 12"]
    for start in range(0, len(added), _TOKENS_PER_CHECK):
        parts, short = [], []
        for n, token in enumerate(added[start : start + _TOKENS_PER_CHECK], start=start):
            other = added[(n + 1) % len(added)]
            short.append(" " + token + "\n" + other + token[:-1] + token + "x " + token)
            if n < _THOROUGH:
                around = "".join(before + token + after for before, after in _SURROUNDINGS)
                parts.append(token + around + token + other + token[:-1] + token + " " + token)
        texts.append(short[0])  # one at the very start of a text
        texts.append("tail".join(short))
        if parts:
            texts.append("".join(parts))
    return texts


class _FastBpe:
    """Whether tiktoken encodes for this tokenizer: waiting for enough text, building, proven or
    refused (with the reason). One proof per tokenizer in the process, shared by its caches."""

    def __init__(self, tokenizer: Tokenizer, after: int | None) -> None:
        self._tokenizer = tokenizer
        self._left = after
        self.encoder: RankBpe | None = None
        self.state = "off" if after is None else "waiting"
        self.reason: str | None = None
        known = _PROOFS.get(id(tokenizer))
        if known is not None and after is not None:
            self._take(known[1])
        elif after == 0:
            self._take(_proof(tokenizer))

    def encoded(self, tokens: int) -> None:
        """Count tokens the tokenizer encoded; past the bound, start the proof on a worker thread."""
        if self._left is None or self.state != "waiting":
            return
        self._left -= tokens
        if self._left <= 0:
            self.state = "building"
            threading.Thread(target=self._build, name="fast-bpe proof", daemon=True).start()

    def _build(self) -> None:
        self._take(_proof(self._tokenizer))

    def _take(self, proof: RankBpe | str) -> None:
        if isinstance(proof, str):
            self.state, self.reason = "refused", proof
        else:
            self.encoder, self.state = proof, "proven"

    def as_json(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason}


# The proofs made in this process, by tokenizer (kept alive beside its proof, so its id stays its own).
_PROOFS: dict[int, tuple[Tokenizer, RankBpe | str]] = {}
_PROOFS_KEPT = 4
_PROOFS_LOCK = threading.Lock()


def _proof(tokenizer: Tokenizer) -> RankBpe | str:
    """tiktoken's encoder for `tokenizer`, or why it is refused; made once per tokenizer."""
    with _PROOFS_LOCK:
        known = _PROOFS.get(id(tokenizer))
        if known is not None:
            return known[1]
        try:
            proof: RankBpe | str = RankBpe.prove(tokenizer)
        except RankBpeRefused as refused:
            proof = str(refused)
        # The proof parsed the whole tokenizer.json (~45 MB of Python objects, now freed).
        native_memory.trim()
        _PROOFS[id(tokenizer)] = (tokenizer, proof)
        while len(_PROOFS) > _PROOFS_KEPT:
            del _PROOFS[next(iter(_PROOFS))]
        return proof
