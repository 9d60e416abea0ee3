"""Cutting a render after a close token: encoding from the close gives exactly the ids a full encode
puts after it (the tokenizer splits at the close before anything else runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files

CLOSE = "<|im_end|>"
# Text a template puts around a close: whitespace runs, unicode, digits and other special tokens.
pieces = st.sampled_from(
    ["\n", " ", "  ", "\t", "a", "é", "漢", "🌍", "12", "<|im_start|>", "user", ".", "'s"]
)
texts = st.lists(st.one_of(pieces, st.text(max_size=6)), max_size=12).map("".join)


@pytest.fixture(scope="module")
def renderer(qwen_dir: Path) -> Renderer:
    return Renderer(load_tokenizer_files(qwen_dir))


def test_the_qwen_close_is_one_the_tokenizer_splits_at(renderer: Renderer) -> None:
    assert renderer.close_splits_input(CLOSE)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=texts, after=texts)
def test_the_cut_equals_the_tail_of_a_full_encode(renderer: Renderer, before: str, after: str) -> None:
    before = before.replace(CLOSE, "")
    head = renderer.encode(before + CLOSE)
    whole = renderer.encode(before + CLOSE + after)
    assert whole[: len(head)] == head
    assert renderer.cut_after_close(before + CLOSE + after, 0).ids == whole[len(head) :]
