"""The chunk cache (proxy/chat/piece_cache.py) gives the plain encode's ids on the Qwen tokenizer and every
family's, cold and cached; a tokenizer whose added tokens strip whitespace keeps the plain encode; an
offset-sensitive pre-tokenizer is still exact; the cache stays within its bounds."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from proxy.chat.piece_cache import PieceCache, ids_of
from proxy.chat.renderer import LARGE_TEXT_CHARS, PromptTooLong, Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from tests.families import FAMILIES, MISTRAL_NEMO_FAMILY, build_tokenizer_dir

FILLERS = [
    "\n",
    " ",
    "\n\n",
    "  ",
    "\t",
    "é",
    "漢字",
    "🌍",
    "12",
    "'s",
    "word",
    "x",
    ".",
    '{"a": 1}',
    "<|",
    "|>",
]


def _plain(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _added(tokenizer: Tokenizer) -> list[str]:
    return [str(t.content) for t in tokenizer.get_added_tokens_decoder().values()]


def _random_texts(tokenizer: Tokenizer, count: int, seed: int) -> list[str]:
    """Texts mixing the tokenizer's added tokens, partial copies of them and ordinary text."""
    rng = random.Random(seed)
    added = _added(tokenizer)
    alphabet = [
        *FILLERS,
        *added,
        *(token[: rng.randrange(1, len(token))] for token in added if len(token) > 1),
    ]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))) for _ in range(count)]


def _check_equal(cache: PieceCache, tokenizer: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        plain = _plain(tokenizer, text)
        assert cache.encode(text) == plain, text  # cold
        assert cache.encode(text) == plain, text  # from the cache


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))


def test_the_qwen_tokenizer_is_proven_and_chunked_encodes_equal_plain_ones(qwen: Tokenizer) -> None:
    cache = PieceCache(qwen)
    assert cache.proven, cache.reason
    assert cache.split_tokens == len(_added(qwen))
    _check_equal(cache, qwen, _random_texts(qwen, 400, seed=1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(
            st.sampled_from(
                [*FILLERS, "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>"]
            ),
            st.text(max_size=10),
        ),
        max_size=12,
    ).map("".join)
)
def test_any_text_encodes_as_the_plain_encode_on_qwen(qwen: Tokenizer, text: str) -> None:
    cache = PieceCache(qwen, max_ids=1000, max_chars=4000)
    _check_equal(cache, qwen, [text, "<|im_start|>system\n" + text + "<|im_end|>\n"])


def test_real_renders_encode_the_same_and_repeat_from_the_cache(qwen_dir: Path) -> None:
    renderer = Renderer(load_tokenizer_files(qwen_dir))
    assert renderer.verdict.as_json()["encode_cache"]["proven"] is True
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool_{n}", "description": "é 漢字 " * n, "parameters": {"type": "object"}},
        }
        for n in range(5)
    ]
    for task in range(20):
        messages = [
            {"role": "system", "content": "You are a coding agent.\n\n  Be brief. "},
            {"role": "user", "content": f"Task {task}: fix   the bug\n\tin src/{task}.py 🌍"},
        ]
        text = renderer.render_text(messages, tools=tools, add_generation_prompt=True)
        for _ in range(2):  # the second time the system prompt, tools and task come from the cache
            assert renderer.render_prompt(messages, tools=tools, template_kwargs=None, now=None) == _plain(
                renderer.tokenizer, text
            )


@pytest.mark.parametrize("name", [*FAMILIES, MISTRAL_NEMO_FAMILY.name])
def test_every_family_tokenizer_is_proven_and_exact(name: str, tmp_path: Path) -> None:
    family = FAMILIES.get(name, MISTRAL_NEMO_FAMILY)
    tokenizer = Tokenizer.from_file(str(build_tokenizer_dir(family, tmp_path) / "tokenizer.json"))
    cache = PieceCache(tokenizer)
    assert cache.proven, cache.reason
    _check_equal(cache, tokenizer, _random_texts(tokenizer, 150, seed=sum(map(ord, name))))


def _with_token(qwen_dir: Path, target: Path, token: AddedToken) -> Path:
    shutil.copytree(qwen_dir, target)
    tokenizer = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([token])
    tokenizer.save(str(target / "tokenizer.json"))
    return target


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_an_added_token_that_looks_past_its_text_keeps_the_plain_encode(
    qwen_dir: Path, tmp_path: Path, flag: str
) -> None:
    directory = _with_token(qwen_dir, tmp_path / "tok", AddedToken("<mask>", special=True, **{flag: True}))
    renderer = Renderer(load_tokenizer_files(directory))
    report = renderer.verdict.as_json()["encode_cache"]
    assert report["proven"] is False
    assert flag in report["reason"]
    assert "<mask>" in report["reason"]
    texts = ["hello <mask> world", "a<mask>b", "x  <mask>  y<|im_end|>\n<mask>"]
    for text in texts:
        assert renderer.encode(text) == _plain(renderer.tokenizer, text)
    if flag == "lstrip":
        # Why: cutting before the token would keep the space it strips.
        naive = [i for c in renderer.pieces.chunks(texts[0]) for i in _plain(renderer.tokenizer, c)]
        assert naive != _plain(renderer.tokenizer, texts[0])


def _metaspace_tokenizer() -> Tokenizer:
    """Metaspace with prepend_scheme="first" marks only the start of the whole text, and a lowercase
    normalizer with a normalized added token: offsets and normalization per piece must be respected."""
    words = ["hello", "world", "<low>"]
    vocab = {"[UNK]": 0, **{w: n + 1 for n, w in enumerate(words)}}
    vocab.update({"\u2581" + w: len(vocab) + n for n, w in enumerate(words)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.add_special_tokens([AddedToken("<sep>", special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken("<LOW>", normalized=True)])
    return tokenizer


def test_an_offset_sensitive_pre_tokenizer_is_still_exact() -> None:
    tokenizer = _metaspace_tokenizer()
    cache = PieceCache(tokenizer)
    assert cache.proven, cache.reason
    texts = ["hello<sep>hello world", "<sep>hello", " hello <sep> world<LOW>x", "HELLO<low><sep><sep>world"]
    _check_equal(cache, tokenizer, texts)
    # Encoding the text after a token on its own would mark it as the start of the whole text.
    assert _plain(tokenizer, "hello") != _plain(tokenizer, "<sep>hello")[1:]


class _CutsBeforeSpaces(PieceCache):
    def chunks(self, text: str) -> list[str]:
        return [part for part in text.replace(" ", "\0 ").split("\0") if part]


def test_the_self_check_refuses_cuts_the_tokenizer_does_not_make(qwen: Tokenizer) -> None:
    cache = _CutsBeforeSpaces(qwen)
    assert not cache.proven
    assert "differs from the plain one" in (cache.reason or "")


def test_the_cache_is_bounded_by_ids_and_characters(qwen: Tokenizer) -> None:
    cache = PieceCache(qwen, max_ids=2_000, max_chars=8_000)
    texts = [f"<|im_start|>user\ntask number {n} with some words<|im_end|>\n" for n in range(500)]
    for text in texts:
        assert cache.encode(text) == _plain(qwen, text)
        _chunks, ids, chars = cache.cached()
        assert ids <= 2_000
        assert chars <= 8_000
    assert cache.encode(texts[-1]) == _plain(qwen, texts[-1])
    _, _, chars = cache.cached()
    assert chars > 8_000 // 2, "the cache fills up to its bound"
    assert "<|im_start|>user\ntask number 499 with some words" in cache._chunks  # the newest is kept
    assert "<|im_start|>user\ntask number 0 with some words" not in cache._chunks  # the oldest went
    large = "<|im_start|>" + "word " * 400
    assert cache.encode(large) == _plain(qwen, large)
    assert large not in cache._chunks, "a chunk over an eighth of a bound is encoded, not kept"
    assert sum(len(ids) for ids in cache._chunks.values()) == cache.cached()[1]
    assert sum(len(chunk) for chunk in cache._chunks) == cache.cached()[2]


def test_large_texts_from_the_cache_keep_the_prompt_limit(qwen_dir: Path) -> None:
    renderer = Renderer(load_tokenizer_files(qwen_dir))
    text = "<|im_start|>system\n" + "word é 12\n" * (LARGE_TEXT_CHARS // 5) + "<|im_end|>\n"
    tokens = len(_plain(renderer.tokenizer, text))
    for _ in range(2):
        assert renderer.encode(text, at_most=tokens) == _plain(renderer.tokenizer, text)
        with pytest.raises(PromptTooLong) as refused:
            renderer.encode(text, at_most=tokens - 1)
        assert refused.value.tokens == tokens


def test_overlapping_added_tokens_are_cut_where_the_tokenizer_cuts(qwen_dir: Path) -> None:
    """The longest token at the leftmost position, as the tokenizer's matcher takes it."""
    tokenizer = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    overlapping = ["<x", "<x>", "<x>>", "x>", "<<x", "<|im", "im_end|>\n", "[A][B]", "[A]", "[B]"]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in overlapping])
    tokenizer.add_special_tokens(
        [AddedToken(f"<unused{n}>", special=True, normalized=False) for n in range(300)]
    )
    cache = PieceCache(tokenizer)
    assert cache.proven, cache.reason
    _check_equal(cache, tokenizer, _random_texts(tokenizer, 300, seed=7))
    _check_equal(
        cache, tokenizer, ["<<x>>", "<x>x>", "[A][B][A]", "<|im_end|>\n<|im", "<unused29><unused299>"]
    )


def test_a_prompt_refused_from_cached_and_new_chunks_counts_them_all(qwen: Tokenizer) -> None:
    cache = PieceCache(qwen)
    head = "<|im_start|>system\n" + "cached words " * 200
    cache.encode(head)
    text = head + "<|im_start|>user\n" + "new words é 12\n" * (LARGE_TEXT_CHARS // 10)
    tokens = len(_plain(qwen, text))
    with pytest.raises(PromptTooLong) as refused:
        cache.encode(text, at_most=tokens - 1)
    assert refused.value.tokens == tokens
    assert cache.encode(text, at_most=tokens) == _plain(qwen, text)


@pytest.mark.parametrize("name", [*FAMILIES, MISTRAL_NEMO_FAMILY.name, "metaspace-first"])
def test_ids_without_offsets_are_the_plain_encode_of_every_tokenizer(name: str, tmp_path: Path) -> None:
    """The proxy encodes without the tokens' character offsets (encode_batch_fast): the same pipeline
    less the offsets, so the same ids, which this checks on every family's tokenizer and on the one
    whose pre-tokenizer reads offsets (Metaspace marking only the start of the whole text)."""
    if name == "metaspace-first":
        tokenizer = _metaspace_tokenizer()
        texts = ["hello<sep>hello world", "<sep>hello", " hello <sep> world<LOW>x", "HELLO<low>"]
    else:
        family = FAMILIES.get(name, MISTRAL_NEMO_FAMILY)
        tokenizer = Tokenizer.from_file(str(build_tokenizer_dir(family, tmp_path) / "tokenizer.json"))
        texts = _random_texts(tokenizer, 150, seed=len(name))
    for text in texts:
        assert ids_of(tokenizer, text) == _plain(tokenizer, text), text
