"""tiktoken's byte-pair encoder for ASCII text, where the tokenizer is proven to give the same ids.

Hugging Face's BPE merges a word's adjacent pair with the lowest rank in the tokenizer's merge list;
tiktoken merges the adjacent pair whose concatenation has the lowest id in the vocabulary, and is
~5x faster (its pre-tokenizer regex and merge loop, ~0.13 ms for a 500-token tool result where
Hugging Face's pipeline takes ~0.7 ms). The two give the same ids on every word when:

1. merge results are vocabulary tokens whose ids rise with the merge's rank (so both order the pairs
   they both know alike), every single byte is a token, and
2. every merge tiktoken makes is in the merge list. A part tiktoken forms is always a token its own
   run on that token's bytes forms too (the merges inside a part never depended on what lay around
   it), and it forms it from one split: the token's canonical split. So it suffices that every
   token tiktoken can form has its canonical split in the merge list. By induction over the tokens'
   length, given (1), that holds exactly when Hugging Face's own BPE (without the `ignore_merges`
   shortcut) encodes each token's bytes to that one token, or to 3+ parts (a token no merge run
   reaches: tiktoken forms it only as a whole word, which it then emits whole, so that is allowed
   only where Hugging Face's `ignore_merges` does the same). Two parts mean a canonical split the
   merge list lacks. Then both loops make the same merge at every step: the pair tiktoken picks is
   in the merge list, and no pair Hugging Face knows ranks below it.

The check costs about a second (every token of the vocabulary encoded once), so a proxy makes it on
a worker thread once it has encoded enough text to gain from it. It is used only where the rest of
the pipeline is the identity or the same on both sides: ASCII text (NFC and its kin change no ASCII,
and every regex engine agrees on ASCII's letters, digits and spaces) without added tokens, for a
pre-tokenizer that is the byte-level regex split alone. A probe of every ASCII character in varied
surroundings must then give Hugging Face's ids.
"""

from __future__ import annotations

import operator
import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from tokenizers import Tokenizer

from proxy.chat.token_trie import trie_pattern

# Hugging Face's ByteLevel pre-tokenizer splits with GPT-2's pattern when `use_regex` is set.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Normalizers that leave every ASCII text as it is.
_ASCII_IDENTITY_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


class RankBpeRefused(Exception):
    """Why tiktoken would not give this tokenizer's ids (the plain encode is kept)."""


@dataclass(frozen=True)
class _Spec:
    """What tiktoken needs of a tokenizer: its split pattern, byte-level vocabulary and merges."""

    pattern: str
    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    ignore_merges: bool


def byte_level_alphabet() -> dict[str, int]:
    """The printable character GPT-2's byte-level BPE writes for each byte, mapped back to the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {byte: byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + shifted
            shifted += 1
    return {chr(char): byte for byte, char in chars.items()}


class RankBpe:
    """`ids(text)`: the tokenizer's ids of `text`, or None where its own encode must be used (text
    that is not ASCII or holds an added token, which the tokenizer cuts out first). Built by `prove`,
    which raises RankBpeRefused when the equivalence cannot be shown."""

    def __init__(self, encoding: Any, added: re.Pattern[str] | None) -> None:
        self._encode = encoding.encode_ordinary
        self._added = added

    def ids(self, text: str) -> list[int] | None:
        if not text.isascii():
            return None
        # The tokenizer cuts added tokens out first (a search of their trie: ~0.6 us on 1 KB of text).
        if self._added is not None and self._added.search(text):
            return None
        ids: list[int] = self._encode(text)
        return ids

    @classmethod
    def prove(cls, tokenizer: Tokenizer) -> RankBpe:
        """The encoder for `tokenizer` once every condition holds; RankBpeRefused naming the first that
        does not."""
        document = orjson.loads(tokenizer.to_str())
        spec = _spec_of(document)
        ranks = _ranks(spec.vocab)
        _check_merge_order(spec)
        _check_canonical_splits(spec, document, tokenizer)
        encoding = _tiktoken_encoding(spec.pattern, ranks)
        added = [
            text for token in tokenizer.get_added_tokens_decoder().values() if (text := str(token.content))
        ]
        encoder = cls(encoding, re.compile(trie_pattern(added)) if added else None)
        _check_probe(tokenizer, encoder)
        return encoder


def _spec_of(document: dict[str, Any]) -> _Spec:
    model = document.get("model") or {}
    if model.get("type") != "BPE":
        raise RankBpeRefused(f"the model is {model.get('type')}, not BPE")
    if model.get("dropout") or model.get("byte_fallback"):
        raise RankBpeRefused("the BPE model has dropout or byte fallback")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise RankBpeRefused("the BPE model marks subwords (a prefix or suffix)")
    _check_normalizer(document.get("normalizer"))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    if any(len(merge) != 2 for merge in merges):
        raise RankBpeRefused("a merge is not a pair")
    return _Spec(
        pattern=_split_pattern(document.get("pre_tokenizer")),
        vocab=dict(model.get("vocab") or {}),
        merges=[(str(a), str(b)) for a, b in merges],
        ignore_merges=bool(model.get("ignore_merges")),
    )


def _check_normalizer(normalizer: dict[str, Any] | None) -> None:
    if normalizer is None:
        return
    kind = normalizer.get("type")
    if kind == "Sequence":
        for step in normalizer.get("normalizers", []):
            _check_normalizer(step)
    elif kind not in _ASCII_IDENTITY_NORMALIZERS:
        raise RankBpeRefused(f"the {kind} normalizer may change ASCII text")


def _split_pattern(pre_tokenizer: dict[str, Any] | None) -> str:
    """The one regex the pre-tokenizer splits with before its byte-level mapping."""
    steps = [pre_tokenizer] if pre_tokenizer is not None else []
    if pre_tokenizer is not None and pre_tokenizer.get("type") == "Sequence":
        steps = list(pre_tokenizer.get("pretokenizers", []))
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        raise RankBpeRefused("the pre-tokenizer is not byte-level without a prefix space")
    if len(steps) == 1 and steps[0].get("use_regex", True):
        return GPT2_PATTERN
    if len(steps) == 2 and not steps[1].get("use_regex", True):
        split = steps[0]
        regex = (split.get("pattern") or {}).get("Regex")
        isolated = split.get("type") == "Split" and split.get("behavior") == "Isolated"
        if isolated and not split.get("invert") and isinstance(regex, str):
            return regex
    raise RankBpeRefused("the pre-tokenizer is not one regex split then the byte-level mapping")


class _ToLatin1(dict[int, int]):
    """str.translate's table: each byte-level character to the Latin-1 character of its byte, and any
    other character to one Latin-1 cannot encode."""

    def __missing__(self, char: int) -> str:
        return "\U0010ffff"


def _ranks(vocab: dict[str, int]) -> dict[bytes, int]:
    to_latin1 = _ToLatin1({ord(char): byte for char, byte in byte_level_alphabet().items()})
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        try:
            ranks[token.translate(to_latin1).encode("latin-1")] = token_id
        except UnicodeEncodeError:
            raise RankBpeRefused(f"token {token!r} is not written in the byte-level alphabet") from None
    if len(ranks) != len(vocab) or len(set(ranks.values())) != len(ranks):
        raise RankBpeRefused("two tokens share bytes or an id")
    if any(bytes([byte]) not in ranks for byte in range(256)):
        raise RankBpeRefused("a single byte is not a token")
    return ranks


def _check_merge_order(spec: _Spec) -> None:
    """Condition 1: each merge makes the token of its concatenation, with ids rising with the rank."""
    vocab = spec.vocab
    made = [
        vocab.get(left + right, -1) if left in vocab and right in vocab else -1 for left, right in spec.merges
    ]
    if -1 in made:
        rank = made.index(-1)
        raise RankBpeRefused(f"merge {rank} {spec.merges[rank]} is not of vocabulary tokens")
    if not all(map(operator.lt, made, made[1:])):
        rank = next(n for n in range(1, len(made)) if made[n] <= made[n - 1])
        raise RankBpeRefused(f"merge {rank} {spec.merges[rank]} makes a lower id than the one before")


def _check_canonical_splits(spec: _Spec, document: dict[str, Any], tokenizer: Tokenizer) -> None:
    """Condition 2: Hugging Face's BPE, shortcut off, encodes every token to itself or to 3+ parts."""
    words = [token for token in spec.vocab if len(token) > 1]
    if spec.ignore_merges:
        # The model alone with its shortcut off (no normalizer, no pre-tokenizer: a text is one word).
        model = {**document["model"], "ignore_merges": False, "dropout": None}
        bare = Tokenizer.from_str(orjson.dumps({"version": "1.0", "model": model}).decode())
        parts = list(map(len, bare.encode_batch_fast(words, add_special_tokens=False)))
    else:
        # The tokenizer's own model, a word at a time: slower than one batch, but never holding the
        # GIL for long (the proof runs beside a serving event loop), where parsing a second model would.
        tokenize = tokenizer.model.tokenize
        parts = [len(tokenize(word)) for word in words]
    if 2 in parts:
        raise RankBpeRefused(f"token {words[parts.index(2)]!r} is formed from a split its merges do not list")
    unreached = next((n for n, count in enumerate(parts) if count > 2), None)
    if unreached is not None and not spec.ignore_merges:
        raise RankBpeRefused(
            f"token {words[unreached]!r} is not reached by its merges, and a word equal to it is"
        )


def _tiktoken_encoding(pattern: str, ranks: dict[bytes, int]) -> Any:
    try:
        import tiktoken
    except ImportError as exc:  # pragma: no cover - a dependency of the proxy
        raise RankBpeRefused("tiktoken is not installed") from exc
    try:
        encoding = tiktoken.Encoding("tito-proxy", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    except ValueError as exc:  # its regex engine refused the pattern
        raise RankBpeRefused(f"tiktoken cannot use the split pattern: {exc}") from None
    # The Encoding keeps this dict (~14 MB for 150k tokens) only for methods never called here; its
    # Rust core holds its own copy, which encode_ordinary reads.
    ranks.clear()
    return encoding


# Surroundings of every ASCII character in the probe: words, digits, spaces, newlines, contractions.
_PROBE_AROUND = ("", "a", "A", "ab", "1", "12", " ", "  ", "\n", "\r\n", "\t", "'", "'s", ".", "-")


def _probe_texts() -> Iterable[str]:
    chars = [chr(code) for code in range(128)]
    for char in chars:
        yield "".join(before + char + after for before in _PROBE_AROUND for after in _PROBE_AROUND)
        yield char * 3 + " " + char + "\n" + char
    yield string.printable * 3
    yield "it's  They'RE we'Ve I'M you'LL he'D  x  \n\n  y\t\t\nz   "


def _check_probe(tokenizer: Tokenizer, encoder: RankBpe) -> None:
    texts: Sequence[str] = list(_probe_texts())
    expected = tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
    for text, encoding in zip(texts, expected, strict=True):
        if encoder.ids(text) not in (None, list(encoding.ids)):
            raise RankBpeRefused(f"tiktoken's ids differ from the tokenizer's on {text[:40]!r}")
