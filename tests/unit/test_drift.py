"""The drift classifier on hand-made streams: every kind it names, and a real bug left unclassified."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from proxy.export.drift import DriftClassifier, StreamFacts, report
from tests.support import token_id


@pytest.fixture(scope="module")
def tok(qwen_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))


def _setup(tok: Tokenizer) -> tuple[DriftClassifier, int]:
    specials = frozenset(int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return DriftClassifier(lambda ids: tok.decode(ids, skip_special_tokens=False), specials), token_id(
        tok, "<|im_end|>"
    )


def _enc(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def _facts(ids: list[int], sampled_from: int, sampled_to: int, close: int) -> StreamFacts:
    return StreamFacts(
        ids=ids,
        sampled=[sampled_from <= i < sampled_to for i in range(len(ids))],
        synthesized=frozenset(),
        close_ids=frozenset({close}),
    )


def test_identical_streams_have_no_drift(tok: Tokenizer) -> None:
    classifier, close = _setup(tok)
    ids = _enc(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>")
    assert classifier.compare(_facts(ids, len(ids) - 3, len(ids), close), ids) == []


def test_assistant_bpe_and_final_separator(tok: Tokenizer) -> None:
    classifier, close = _setup(tok)
    prompt = _enc(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    sampled = [*_enc(tok, "hel"), *_enc(tok, "lo there"), close]  # not how "hello there" tokenizes
    render = [*prompt, *_enc(tok, "hello there"), close, *_enc(tok, "\n")]
    stream = [*prompt, *sampled]
    kinds = [d.kind for d in classifier.compare(_facts(stream, len(prompt), len(stream), close), render)]
    assert kinds == ["assistant_bpe", "final_separator_absent"]


def test_a_changed_user_message_is_a_bug(tok: Tokenizer) -> None:
    classifier, close = _setup(tok)
    stream = _enc(tok, "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nok<|im_end|>")
    render = _enc(tok, "<|im_start|>user\nhi  there<|im_end|>\n<|im_start|>assistant\nok<|im_end|>")
    [difference] = classifier.compare(_facts(stream, len(stream) - 2, len(stream), close), render)
    assert difference.kind == "unclassified"
    assert not difference.allowed
    assert difference.whitespace_only
    assert report([difference], "strict", 0)["unclassified"] == 1
    # ignore_strippable decides on the difference itself: whitespace only, so not flagged.
    assert report([difference], "ignore_strippable", 0)["differences"] == []


def test_stripped_reasoning_and_think_wrapper(tok: Tokenizer) -> None:
    classifier, close = _setup(tok)
    prompt = _enc(tok, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    for sampled_text, kind in [
        ("<think>\nplan\n</think>\n\nanswer", "history_reasoning_stripped"),
        ("<think>\n\n</think>\n\nanswer", "think_wrapper"),
    ]:
        stream = [*prompt, *_enc(tok, sampled_text), close]
        render = [*prompt, *_enc(tok, "answer"), close]
        [difference] = classifier.compare(_facts(stream, len(prompt), len(stream), close), render)
        assert difference.kind == kind
        assert difference.position >= len(prompt)


def test_a_synthesized_close_is_named(tok: Tokenizer) -> None:
    classifier, close = _setup(tok)
    head = _enc(tok, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\ncut")
    stream = [*head, close]
    facts = StreamFacts(
        ids=stream,
        sampled=[False] * (len(head) - 1) + [True, False],
        synthesized=frozenset({len(head)}),
        close_ids=frozenset({close}),
    )
    [difference] = classifier.compare(facts, head)
    assert difference.kind == "truncation_close_synthesized"
    assert difference.position == len(head)
