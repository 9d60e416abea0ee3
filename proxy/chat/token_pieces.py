"""The bytes and display text of single token ids, as OpenAI's logprob entries report them."""

from __future__ import annotations

import re
from functools import lru_cache

from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: byte-level BPE vocabularies spell every
    byte as one printable character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


class TokenPieces:
    """What one token contributes to the text: its bytes (a UTF-8 character may span tokens) and a
    printable form of them."""

    def __init__(self, tokenizer: Tokenizer, special_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._special_ids = special_ids
        self._byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self._alphabet = _byte_level_alphabet()
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes_of)

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode()
        if self._byte_level and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        # SentencePiece spells a leading space as U+2581.
        return piece.replace("\u2581", " ").encode()

    def text_of(self, token_id: int) -> str:
        """The token's text; a token holding part of a UTF-8 character shows its bytes escaped, as
        OpenAI does (`bytes:\\xe6\\x97`)."""
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
