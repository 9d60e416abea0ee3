"""One regex matching the longest of many literal tokens at a position: a chat format's added tokens."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


def trie_pattern(tokens: Sequence[str]) -> str:
    """A regex matching the longest of `tokens` at a position, as the tokenizer's leftmost-longest
    matcher does: a trie, so that thousands of added tokens (Gemma's) cost a walk, not a scan each.
    At a node that ends a token, the longer continuation is tried first (a greedy `?`)."""
    trie: dict[str, Any] = {}
    for token in tokens:
        node = trie
        for char in token:
            node = node.setdefault(char, {})
        node[""] = {}  # a token ends here

    def pattern(node: dict[str, Any]) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in node.items() if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return pattern(trie)
