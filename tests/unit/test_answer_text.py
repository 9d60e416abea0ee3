"""Whether a prompt opened reasoning is read from its last ids, remembered per tail: the same answer
as decoding them every time, for prompts that end inside or outside a `<think>`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from proxy.chat.call_format import choose_parser
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.turns.answer_text import AnswerText


def test_reasoning_open_is_read_from_the_prompt_tail(qwen_dir: Path) -> None:
    renderer = Renderer(load_tokenizer_files(qwen_dir))
    parser = replace(choose_parser(renderer)[0], parse_reasoning=True)
    answers = AnswerText(renderer, parser)
    texts = [
        "<|im_start|>assistant\n<think>\n",
        "<|im_start|>assistant\n<think>\n\n",
        "<|im_start|>assistant\n",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "hi <think>",
        "<think>",
    ]
    for _ in range(2):  # decoded, then remembered
        for text in texts:
            prompt = np.asarray(renderer.encode(text, special=True), dtype=np.int32)
            expected = renderer.decode(prompt[-4:].tolist()).rstrip("\n").endswith("<think>")
            assert answers.reasoning_open(prompt) is expected, text
    assert answers.reasoning_open(np.asarray(renderer.encode("<think>\n", special=True), dtype=np.int32))
    without = AnswerText(renderer, replace(parser, parse_reasoning=False))
    assert not without.reasoning_open(np.asarray(renderer.encode("<think>\n", special=True), dtype=np.int32))
