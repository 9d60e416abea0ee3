"""tiktoken's encoder (proxy/chat/rank_bpe.py) is proven for Qwen's byte-level BPE and gives its ids
on any ASCII text; each condition of the proof refuses a tokenizer that breaks it, and each such
tokenizer really encodes differently under tiktoken; the chunk cache uses it once proven, from the
start or after enough tokens, and reports where it stands."""

from __future__ import annotations

import string
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from proxy.chat import rank_bpe
from proxy.chat.piece_cache import PieceCache, PromptTooLong
from proxy.chat.rank_bpe import GPT2_PATTERN, RankBpe, RankBpeRefused, byte_level_alphabet
from tests.families import FAMILIES, build_tokenizer_dir

# ASCII as agents' tool results hold it: code, logs, JSON, paths, numbers, contractions, whitespace.
ASCII_PIECES = [
    *string.printable,
    "'s",
    "'LL",
    "  ",
    "\n\n",
    "\r\n",
    "    ",
    "\t\t",
    "def ",
    "return",
    "12345",
    "0x1F",
    '{"key": [1, 2]}',
    "src/main.py:12:",
    "...",
    "---",
    "\x00",
    "\x0b",
    "\x1c",
    "\x7f",
]


def _plain(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def qwen_bpe(qwen_tokenizer: Tokenizer) -> RankBpe:
    return RankBpe.prove(qwen_tokenizer)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(ASCII_PIECES), max_size=60).map("".join))
def test_any_ascii_text_gets_the_qwen_tokenizers_ids(
    qwen_tokenizer: Tokenizer, qwen_bpe: RankBpe, text: str
) -> None:
    assert qwen_bpe.ids(text) == _plain(qwen_tokenizer, text)


def test_tool_results_get_the_qwen_tokenizers_ids(qwen_tokenizer: Tokenizer, qwen_bpe: RankBpe) -> None:
    # Real code, as a tool reads it, without its few non-ASCII characters.
    source = Path(rank_bpe.__file__).read_text(encoding="utf-8").encode("ascii", "ignore").decode()
    texts = [source, source.upper(), source.replace("\n", "\r\n"), " " * 300 + "x", "9" * 400]
    for text in texts:
        assert qwen_bpe.ids(text) == _plain(qwen_tokenizer, text)


def test_text_it_cannot_vouch_for_is_left_to_the_tokenizer(qwen_bpe: RankBpe) -> None:
    assert qwen_bpe.ids("café") is None  # not ASCII: normalization and Unicode classes differ by version
    assert qwen_bpe.ids("naïve 漢字") is None


# The families share Qwen's vocabulary and differ in their added tokens: a few distinct sets.
@pytest.mark.parametrize("name", ["llama3_1", "deepseek_v3"])
def test_byte_level_families_are_proven(name: str, tmp_path: Path) -> None:
    directory = build_tokenizer_dir(FAMILIES[name], tmp_path)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    encoder = RankBpe.prove(tokenizer)
    added = [str(t.content) for t in tokenizer.get_added_tokens_decoder().values()]
    for text in ["Hello, world!\n\n  indented\tline it's 123", string.printable, *added]:
        assert encoder.ids(text) in (None, _plain(tokenizer, text))
    assert all(encoder.ids(f"x {token} y") is None for token in added)


# Tiny byte-level tokenizers: every byte, then the tokens and merges a case needs.
def _tiny(
    tokens: list[str], merges: list[tuple[str, str]], *, ignore_merges: bool = False, **document: Any
) -> Tokenizer:
    vocab = {char: byte for char, byte in byte_level_alphabet().items()}
    vocab.update({token: 256 + n for n, token in enumerate(tokens)})
    spec: dict[str, Any] = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": [list(merge) for merge in merges],
        },
        **document,
    }
    return Tokenizer.from_str(orjson.dumps(spec).decode())


def _raw_tiktoken(tokenizer: Tokenizer) -> Any:
    """tiktoken over the tokenizer's vocabulary with no proof: what would be sent without the checks."""
    to_byte = byte_level_alphabet()
    ranks = {
        bytes(to_byte[c] for c in token): i
        for token, i in tokenizer.get_vocab(with_added_tokens=False).items()
    }
    return tiktoken.Encoding("raw", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})


def _refusal(tokenizer: Tokenizer) -> str:
    with pytest.raises(RankBpeRefused) as refused:
        RankBpe.prove(tokenizer)
    return str(refused.value)


def test_a_tiny_consistent_tokenizer_is_proven() -> None:
    tokenizer = _tiny(["ab", "bc", "abc"], [("a", "b"), ("b", "c"), ("ab", "c")])
    encoder = RankBpe.prove(tokenizer)
    for text in ["abc", "abcabc", "xabcx bc ab", "cab abca"]:
        assert encoder.ids(text) == _plain(tokenizer, text)


def test_merge_ids_out_of_rank_order_are_refused_and_would_differ() -> None:
    # "ab" is merged first, but "bc" has the lower id: tiktoken would merge "bc" first.
    tokenizer = _tiny(["bc", "ab"], [("a", "b"), ("b", "c")])
    assert "lower id" in _refusal(tokenizer)
    assert _raw_tiktoken(tokenizer).encode_ordinary("abc") != _plain(tokenizer, "abc")


def test_a_split_missing_from_the_merges_is_refused_and_would_differ() -> None:
    # "abc" is listed as a + bc, but "ab" merges before "bc": Hugging Face never reaches "abc",
    # tiktoken does (it merges any two parts that make a token).
    tokenizer = _tiny(["ab", "bc", "abc"], [("a", "b"), ("b", "c"), ("a", "bc")])
    assert "'abc'" in _refusal(tokenizer)
    assert _raw_tiktoken(tokenizer).encode_ordinary("abca") != _plain(tokenizer, "abca")


def test_a_token_no_merge_reaches_needs_ignore_merges() -> None:
    # "abc" is a token without merges: Hugging Face spells the word out, tiktoken emits it whole...
    tokenizer = _tiny(["abc"], [])
    assert "not reached" in _refusal(tokenizer)
    assert _raw_tiktoken(tokenizer).encode_ordinary("abc") != _plain(tokenizer, "abc")
    # ...unless the tokenizer, like tiktoken, takes a word that is a token whole (Llama 3's setting).
    whole = _tiny(["abc"], [], ignore_merges=True)
    encoder = RankBpe.prove(whole)
    for text in ["abc", "abcd", " abc"]:
        assert encoder.ids(text) == _plain(whole, text)


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        ({"normalizer": {"type": "Lowercase"}}, "Lowercase normalizer"),
        (
            {
                "pre_tokenizer": {
                    "type": "ByteLevel",
                    "add_prefix_space": True,
                    "trim_offsets": False,
                    "use_regex": True,
                }
            },
            "prefix space",
        ),
        (
            {"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}},
            "byte-level",
        ),
        (
            {
                "pre_tokenizer": {
                    "type": "Sequence",
                    "pretokenizers": [
                        {"type": "Digits", "individual_digits": True},
                        {
                            "type": "ByteLevel",
                            "add_prefix_space": False,
                            "trim_offsets": False,
                            "use_regex": True,
                        },
                    ],
                }
            },
            "one regex split",
        ),
    ],
)
def test_pipelines_other_than_one_regex_split_are_refused(document: dict[str, Any], reason: str) -> None:
    assert reason in _refusal(_tiny(["ab"], [("a", "b")], **document))


def test_a_vocabulary_outside_the_byte_alphabet_is_refused() -> None:
    tokenizer = _tiny(["a b"], [])  # a raw space: byte-level BPE writes it as "Ġ"
    assert "byte-level alphabet" in _refusal(tokenizer)


def test_the_cache_uses_it_from_the_start_and_stays_exact(qwen_tokenizer: Tokenizer) -> None:
    cache = PieceCache(qwen_tokenizer, fast_bpe_after=0)
    assert cache.as_json()["fast_bpe"] == {"state": "proven", "reason": None}
    texts = [
        "<|im_start|>user\nfix src/a.py: it's broken\n\n  x = 1<|im_end|>\n",
        '<tool_response>\nTraceback (most recent call last):\n  File "x.py"\n</tool_response>',
        "<|im_start|>assistant\ncafé 漢字 and ASCII<|im_end|>",  # a chunk left to the tokenizer
        "no added token at all\r\n",
    ]
    for text in texts:
        assert cache.encode(text) == _plain(qwen_tokenizer, text), text


def test_the_cache_proves_it_on_a_worker_thread_after_enough_tokens(qwen_dir: Path) -> None:
    # A tokenizer object of its own: proofs are kept per tokenizer in the process.
    tokenizer = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    cache = PieceCache(tokenizer, fast_bpe_after=200)
    assert cache.as_json()["fast_bpe"]["state"] == "waiting"
    text = "def f(x):\n    return x + 1\n" * 20  # ~200 tokens
    assert cache.encode(text) == _plain(tokenizer, text)
    deadline = time.monotonic() + 60
    while cache.as_json()["fast_bpe"]["state"] == "building" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.as_json()["fast_bpe"] == {"state": "proven", "reason": None}
    assert cache.fast.encoder is not None
    later = "class A:\n    pass\n" * 30
    assert cache.encode(later) == _plain(tokenizer, later)
    assert PieceCache(tokenizer).as_json()["fast_bpe"]["state"] == "proven"  # the proof is shared


def test_the_cache_can_be_kept_off_it(qwen_tokenizer: Tokenizer) -> None:
    cache = PieceCache(qwen_tokenizer, fast_bpe_after=None)
    cache.encode("x " * 5000)
    assert cache.as_json()["fast_bpe"] == {"state": "off", "reason": None}
    assert cache.fast.encoder is None


def test_large_texts_take_it_and_are_still_counted_against_the_limit(qwen_tokenizer: Tokenizer) -> None:
    cache = PieceCache(qwen_tokenizer, large_chars=1000, fast_bpe_after=0)
    code = Path(rank_bpe.__file__).read_text(encoding="utf-8").encode("ascii", "ignore").decode()
    texts = [
        "<|im_start|>user\n<tool_response>\n" + code + "\n</tool_response><|im_end|>\n",  # tiktoken
        "<|im_start|>user\n" + code + "\ncafé<|im_end|>\n" + code,  # one chunk left to the tokenizer
    ]
    for text in texts:
        plain = _plain(qwen_tokenizer, text)
        cache.clear()
        assert cache.encode(text, at_most=len(plain)) == plain
        cache.clear()
        with pytest.raises(PromptTooLong) as refused:
            cache.encode(text, at_most=len(plain) - 1)
        assert refused.value.tokens == len(plain)
