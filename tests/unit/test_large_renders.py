"""Large texts are encoded with the GIL released, to the same ids; one far past the context is refused
from a prefix; concurrent renders with different pinned dates do not see each other's date."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest

from proxy.chat.renderer import LARGE_TEXT_CHARS, PromptTooLong, Renderer
from proxy.chat.template import ChatTemplate
from proxy.chat.tokenizer import load_tokenizer_files


@pytest.fixture(scope="module")
def renderer(qwen_dir: Path) -> Renderer:
    return Renderer(load_tokenizer_files(qwen_dir))


def _text(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    alphabet = ["word", " ", "\n", "é", "漢字", "🌍", "  ", "12", ".", "<|im_end|>", "\t", "'s"]
    parts: list[str] = []
    total = 0
    while total < chars:
        parts.append(rng.choice(alphabet))
        total += len(parts[-1])
    return "".join(parts)


@pytest.mark.parametrize("chars", [LARGE_TEXT_CHARS - 1, LARGE_TEXT_CHARS, 5 * LARGE_TEXT_CHARS])
def test_large_texts_encode_to_the_same_ids(renderer: Renderer, chars: int) -> None:
    for seed in range(3):
        text = _text(chars, seed)
        assert renderer.encode(text) == renderer.tokenizer.encode(text, add_special_tokens=False).ids
        assert renderer.encode(text, at_most=10**6) == renderer.encode(text)


def test_a_text_past_the_limit_is_refused(renderer: Renderer) -> None:
    text = _text(200_000, 0)
    tokens = len(renderer.tokenizer.encode(text, add_special_tokens=False).ids)
    with pytest.raises(PromptTooLong):
        renderer.encode(text, at_most=tokens - 1)
    with pytest.raises(PromptTooLong):  # refused from a prefix
        renderer.encode(text, at_most=1000)
    assert len(renderer.encode(text, at_most=tokens)) == tokens


def test_concurrent_renders_keep_their_own_date() -> None:
    template = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}", {})
    days = [datetime(2020, 1, day) for day in range(1, 29)] * 20
    with ThreadPoolExecutor(8) as pool:
        rendered = list(pool.map(lambda now: template.render([], now=now), days))
    assert rendered == [now.strftime("%Y-%m-%d") for now in days]
