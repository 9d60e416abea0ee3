"""The drift classifier on hand-made streams: every kind it names, and a real bug left unclassified."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from proxy.export.drift import Difference, DriftClassifier, StreamFacts, report
from tests.families import DEEPSEEK_SPECIALS, FAMILIES, build_tokenizer_dir
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


def test_reasoning_a_fresh_render_wrote_into_the_prompt_is_stripped_reasoning(tok: Tokenizer) -> None:
    """A first request whose history ends in an assistant tool call with reasoning, after the last
    user message: Qwen3 renders that reasoning into the prompt (not sampled). Once a later user
    message follows, the render strips it: the template's own rule, allowed."""
    classifier, close = _setup(tok)
    head = _enc(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    call = _enc(tok, '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>')
    tail = _enc(tok, "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n")
    prompt_with_reasoning = [*head, *_enc(tok, "<think>\nbrown\n</think>\n\n"), *call, *tail]
    answer = [*_enc(tok, "<|im_start|>assistant\n"), *_enc(tok, "ok"), close]
    stream = [*prompt_with_reasoning, *answer]
    render = [*head, *call, *tail, *answer]
    sampled_from = len(prompt_with_reasoning) + 3
    [difference] = classifier.compare(_facts(stream, sampled_from, len(stream), close), render)
    assert difference.kind == "history_reasoning_stripped"
    assert difference.allowed
    assert difference.position < len(head) + 8


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


# Structure, not proximity to a sampled token, decides: each family's own markers, real templates' text.


@pytest.fixture(scope="module")
def family_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("drift-families")


def _family(
    root: Path, name: str, *, specials_only: tuple[str, ...] = ()
) -> tuple[Tokenizer, DriftClassifier]:
    """A family's tokenizer and a classifier with its specials (or only `specials_only`, as a real
    tokenizer that registers the other markers as ordinary added tokens) and every added token."""
    tok = Tokenizer.from_file(str(build_tokenizer_dir(FAMILIES[name], root / name) / "tokenizer.json"))
    decoder = tok.get_added_tokens_decoder()
    specials = frozenset(
        int(i) for i, t in decoder.items() if t.special and (not specials_only or t.content in specials_only)
    )
    added = frozenset(int(i) for i in decoder)
    return tok, DriftClassifier(lambda ids: tok.decode(ids, skip_special_tokens=False), specials, added)


def _stream(
    tok: Tokenizer, parts: list[tuple[str, bool]], closes: str, systems: tuple[str, ...] = ()
) -> StreamFacts:
    """Stream facts from (text, sampled) parts, each encoded on its own as a turn is."""
    ids: list[int] = []
    sampled: list[bool] = []
    for text, own in parts:
        encoded = _enc(tok, text)
        ids += encoded
        sampled += [own] * len(encoded)
    return StreamFacts(
        ids=ids,
        sampled=sampled,
        synthesized=frozenset(),
        close_ids=frozenset(token_id(tok, close) for close in closes.split()),
        system_texts=systems,
    )


def _kinds(differences: list[Difference]) -> list[str]:
    return [d.kind for d in differences]


GLM_PROMPT = "[gMASK]<sop><|user|>\nWeather?"
GLM_REPLY = "\n<think></think>\nSunny."


def test_a_missing_glm_assistant_opener_is_a_bug(family_root: Path) -> None:
    tok, classifier = _family(family_root, "glm4_moe")
    stream = _stream(tok, [(GLM_PROMPT, False), (GLM_REPLY, True)], "<|user|>")
    render = _enc(tok, f"{GLM_PROMPT}<|assistant|>{GLM_REPLY}")
    [difference] = classifier.compare(stream, render)
    assert difference.kind == "unclassified"
    assert difference.position == len(_enc(tok, GLM_PROMPT))
    # The other way round: an opener the stream holds and the render does not.
    stream = _stream(tok, [(GLM_PROMPT + "<|assistant|>", False), (GLM_REPLY, True)], "<|user|>")
    assert _kinds(classifier.compare(stream, _enc(tok, GLM_PROMPT + GLM_REPLY))) == ["unclassified"]


(BOS, EOS, USER, ASSISTANT, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END) = DEEPSEEK_SPECIALS[:8]
(OUTPUTS_BEGIN, OUTPUTS_END, OUTPUT_BEGIN, OUTPUT_END, SEP) = DEEPSEEK_SPECIALS[8:]
DS_PROMPT = f"{BOS}You are a bot.{USER}Weather in Tokyo?{ASSISTANT}"
DS_CALL = (
    f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n"
    f'```json\n{{"city": "Tokyo"}}\n```{CALL_END}{CALLS_END}{EOS}'
)
DS_RESULT = f"{OUTPUTS_BEGIN}{OUTPUT_BEGIN}Sunny, 21 C{OUTPUT_END}{OUTPUTS_END}"


def test_a_dropped_deepseek_tool_call_is_a_bug(family_root: Path) -> None:
    tok, classifier = _family(family_root, "deepseek_v3")
    stream = _stream(
        tok,
        [(DS_PROMPT, False), (DS_CALL, True), (DS_RESULT, False), (f"Sunny.{EOS}", True)],
        EOS,
    )
    # A fresh render that loses the call (content "" where the template wants none): issue 12 item 1.
    render = _enc(tok, f"{DS_PROMPT}{EOS}{DS_RESULT}Sunny.{EOS}")
    [difference] = classifier.compare(stream, render)
    assert difference.kind == "unclassified"
    assert difference.position == len(_enc(tok, DS_PROMPT))


@pytest.mark.parametrize("tool_tokens_special", [True, False])
def test_a_corrupted_token_in_a_deepseek_tool_result_is_a_bug(
    family_root: Path, tool_tokens_special: bool
) -> None:
    # DeepSeek's real tokenizer registers its tool markers as ordinary added tokens: then the tool
    # result and the next sampled answer are one text piece, and one region.
    only = () if tool_tokens_special else (BOS, EOS, USER)
    tok, classifier = _family(family_root, "deepseek_v3", specials_only=only)
    stream = _stream(
        tok,
        [
            (DS_PROMPT, False),
            (DS_CALL, True),
            (DS_RESULT.replace("21", "27"), False),
            (f"Sunny.  {EOS}", True),
        ],
        EOS,
    )
    render = _enc(tok, f"{DS_PROMPT}{DS_CALL}{DS_RESULT}Sunny.{EOS}")
    differences = classifier.compare(stream, render)
    bad = [d for d in differences if d.kind == "unclassified"]
    assert len(bad) == 1, differences
    assert tok.decode(stream.ids[bad[0].position : bad[0].position + 1]) == "7"  # named where it is
    # The answer's own trailing spaces, alone in their region or not, stay canonicalization.
    assert {d.kind for d in differences} <= {"unclassified", "assistant_canonicalization"}


def test_a_dropped_hermes_tool_call_is_a_bug_its_reserialized_arguments_are_not(tok: Tokenizer) -> None:
    specials = frozenset(int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special)
    added = frozenset(int(i) for i in tok.get_added_tokens_decoder())
    classifier = DriftClassifier(lambda ids: tok.decode(ids, skip_special_tokens=False), specials, added)
    prompt = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    sampled = 'Checking.\n<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call><|im_end|>'
    stream = _stream(tok, [(prompt, False), (sampled, True)], "<|im_end|>")
    canonical = sampled.replace('{"name":"f","arguments":{"a":1}}', '{"name": "f", "arguments": {"a": 1}}')
    assert _kinds(classifier.compare(stream, _enc(tok, prompt + canonical))) == ["assistant_canonicalization"]
    dropped = prompt + "Checking.<|im_end|>"
    [difference] = classifier.compare(stream, _enc(tok, dropped))
    assert difference.kind == "unclassified"


def test_legit_drift_keeps_its_kind(family_root: Path, tok: Tokenizer) -> None:
    classifier, _ = _setup(tok)
    prompt = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    # The template trims the assistant's text: whitespace canonicalization.
    stream = _stream(tok, [(prompt, False), ("answer  \n<|im_end|>", True)], "<|im_end|>")
    [trimmed] = classifier.compare(stream, _enc(tok, prompt + "answer<|im_end|>"))
    assert (trimmed.kind, trimmed.whitespace_only) == ("assistant_canonicalization", True)
    # DeepSeek R1: the prompt pre-fills `<think>\n`, the history render drops the reasoning.
    ds, ds_classifier = _family(family_root, "deepseek_r1")
    stream = _stream(
        ds,
        [(DS_PROMPT + "<think>\n", False), (f"plan\n</think>\n\nSunny.{EOS}", True)],
        EOS,
    )
    render = _enc(ds, f"{DS_PROMPT}Sunny.{EOS}")
    assert _kinds(ds_classifier.compare(stream, render)) == ["history_reasoning_stripped"]
    # gpt-oss: the analysis message of the last turn is not rendered in history.
    oss, oss_classifier = _family(family_root, "gpt_oss")
    head = "<|start|>user<|message|>q<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>Sunny.<|return|>"
    stream = _stream(
        oss,
        [(head, False), ("<|channel|>analysis<|message|>plan<|end|><|start|>assistant" + final, True)],
        "<|end|> <|return|>",
    )
    render = _enc(oss, head + final.replace("<|return|>", "<|end|>"))
    assert _kinds(oss_classifier.compare(stream, render)) == [
        "history_reasoning_stripped",
        "stop_token_rewrite",
    ]


def test_ignore_strippable_keeps_bpe_drift(tok: Tokenizer) -> None:
    classifier, close = _setup(tok)
    prompt = _enc(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    stream = [*prompt, *_enc(tok, "hel"), *_enc(tok, "lo there"), close]
    render = [*prompt, *_enc(tok, "hello there"), close]
    [bpe] = classifier.compare(_facts(stream, len(prompt), len(stream), close), render)
    assert bpe.kind == "assistant_bpe"
    assert not bpe.whitespace_only  # the same text in other ids is not a whitespace difference
    assert [d["kind"] for d in report([bpe], "ignore_strippable", 0)["differences"]] == ["assistant_bpe"]


SYSTEM = "You are a weather bot."


def test_system_prompt_moved_to_the_last_user_message_is_named(family_root: Path) -> None:
    tok, classifier = _family(family_root, "mistral_style")
    turn1 = (f"<s>[INST] {SYSTEM}\n\nWeather?[/INST]", False)
    # Mistral-Nemo writes the system prompt only when a user message is the last message: a render
    # that ends with the assistant's reply has it nowhere.
    stream = _stream(tok, [turn1, (" Sunny.</s>", True)], "</s>", (SYSTEM,))
    [moved] = classifier.compare(stream, _enc(tok, "<s>[INST] Weather?[/INST] Sunny.</s>"))
    assert (moved.kind, moved.allowed) == ("system_relocated", True)
    # Into the later last user message.
    parts = [turn1, (" Sunny.</s>", True), ("[INST] And tomorrow?[/INST]", False), (" Rain.</s>", True)]
    stream = _stream(tok, parts, "</s>", (SYSTEM,))
    render = _enc(
        tok, f"<s>[INST] Weather?[/INST] Sunny.</s>[INST] {SYSTEM}\n\nAnd tomorrow?[/INST] Rain.</s>"
    )
    assert _kinds(classifier.compare(stream, render)) == ["system_relocated", "system_relocated"]


def test_only_a_system_prompt_moving_forward_is_a_relocation(family_root: Path) -> None:
    tok, classifier = _family(family_root, "mistral_style")
    reply = (" Sunny.</s>", True)
    # Moved, and the user text changed too.
    stream = _stream(tok, [(f"<s>[INST] {SYSTEM}\n\nWeather?[/INST]", False), reply], "</s>", (SYSTEM,))
    assert _kinds(classifier.compare(stream, _enc(tok, "<s>[INST] Weather now?[/INST] Sunny.</s>"))) == [
        "unclassified"
    ]
    # The stream never had it: the render's copy is not a move.
    stream = _stream(tok, [("<s>[INST] Weather?[/INST]", False), reply], "</s>", (SYSTEM,))
    render = _enc(tok, f"<s>[INST] {SYSTEM}\n\nWeather?[/INST] Sunny.</s>")
    assert _kinds(classifier.compare(stream, render)) == ["unclassified"]
    # Other text than the system prompt.
    stream = _stream(tok, [("<s>[INST] Be brief.\n\nWeather?[/INST]", False), reply], "</s>", (SYSTEM,))
    assert _kinds(classifier.compare(stream, _enc(tok, "<s>[INST] Weather?[/INST] Sunny.</s>"))) == [
        "unclassified"
    ]
    # Twice in the stream (a continuation that kept it in an earlier user message too).
    parts = [
        (f"<s>[INST] {SYSTEM}\n\nWeather?[/INST]", False),
        reply,
        (f"[INST] {SYSTEM}\n\nAnd tomorrow?[/INST]", False),
        (" Rain.</s>", True),
    ]
    stream = _stream(tok, parts, "</s>", (SYSTEM,))
    render = _enc(tok, "<s>[INST] Weather?[/INST] Sunny.</s>[INST] And tomorrow?[/INST] Rain.</s>")
    assert _kinds(classifier.compare(stream, render)) == ["unclassified", "unclassified"]


def test_combined_legit_drift_stays_allowed(tok: Tokenizer) -> None:
    """Legit differences that share one region: each part is judged on its own."""
    specials = frozenset(int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special)
    added = frozenset(int(i) for i in tok.get_added_tokens_decoder())
    classifier = DriftClassifier(lambda ids: tok.decode(ids, skip_special_tokens=False), specials, added)
    prompt = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    # The render adds an empty think block and trims the assistant's trailing space.
    stream = _stream(tok, [(prompt, False), (f"0 \n{call}<|im_end|>", True)], "<|im_end|>")
    render = _enc(tok, f"{prompt}<think>\n\n</think>\n\n0\n{call}<|im_end|>")
    assert [d.allowed for d in classifier.compare(stream, render)] == [True]
    # The prompt's last newline fuses with sampled ones, and the assistant's text is trimmed.
    stream = _stream(tok, [(prompt, False), (f"\n\n! \n{call}<|im_end|>", True)], "<|im_end|>")
    render = _enc(tok, f"{prompt}\n\n!\n{call}<|im_end|>")
    assert [d.allowed for d in classifier.compare(stream, render)] == [True]
    stream = _stream(tok, [(prompt, False), ("\n0 \n<|im_end|>", True)], "<|im_end|>")
    render = _enc(tok, f"{prompt}\n\n0\n<|im_end|>\n")  # the prompt's "\n" fuses into one "\n\n\n"
    assert [d.allowed for d in classifier.compare(stream, render)] == [True, True]
    # Reasoning stripped and the call's JSON re-serialized in the same region.
    stream = _stream(
        tok,
        [
            (prompt, False),
            (
                '<think>\nplan\n</think>\n\n<tool_call>\n{"name":"f","arguments":{}}\n</tool_call><|im_end|>',
                True,
            ),
        ],
        "<|im_end|>",
    )
    assert [d.allowed for d in classifier.compare(stream, _enc(tok, f"{prompt}{call}<|im_end|>"))] == [True]
    # A last turn cut inside a UTF-8 character: the render re-encodes it and closes the turn.
    head, cut = _enc(tok, prompt), _enc(tok, "ok \U000f506b")[:-2]  # two of its four byte tokens
    sampled = [False] * len(head) + [True] * len(cut)
    facts = StreamFacts([*head, *cut], sampled, frozenset(), frozenset({token_id(tok, "<|im_end|>")}))
    render = _enc(tok, prompt + tok.decode(cut) + "<|im_end|>\n")
    assert all(d.allowed for d in classifier.compare(facts, render))


def test_reasoning_cut_by_max_tokens_stays_allowed(tok: Tokenizer) -> None:
    classifier, close = _setup(tok)
    prompt = _enc(tok, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    cut = _enc(tok, "<think>\nplan")
    # The last turn: the render ends the open reasoning and closes the turn.
    stream = [*prompt, *cut]
    render = _enc(
        tok, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nplan\n</think>\n\n<|im_end|>\n"
    )
    assert all(d.allowed for d in classifier.compare(_facts(stream, len(prompt), len(stream), close), render))
    # Continued with a synthesized close, then rendered without the reasoning.
    tail = _enc(tok, "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    stream = [*prompt, *cut, close, *_enc(tok, "\n"), *tail, *_enc(tok, "ok"), close]
    facts = StreamFacts(
        stream,
        [False] * len(prompt) + [True] * len(cut) + [False] * (2 + len(tail)) + [True] * 2,
        frozenset({len(prompt) + len(cut)}),
        frozenset({close}),
    )
    render = [*prompt, close, *_enc(tok, "\n"), *tail, *_enc(tok, "ok"), close]
    assert [d.kind for d in classifier.compare(facts, render)] == ["history_reasoning_stripped"]


def test_a_last_turn_cut_after_its_reasoning_stays_allowed(tok: Tokenizer) -> None:
    classifier, close = _setup(tok)
    prompt = _enc(tok, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    stream = [*prompt, *_enc(tok, "<think>\nplan\n\n</think>")]
    render = [*prompt, *_enc(tok, "<think>\nplan\n</think>\n\n<|im_end|>\n")]
    assert all(d.allowed for d in classifier.compare(_facts(stream, len(prompt), len(stream), close), render))


def test_a_last_turn_cut_in_its_reasoning_after_a_newline_stays_allowed(tok: Tokenizer) -> None:
    """The stream's last sampled newline lines up with the render's separator: still the tail."""
    classifier, close = _setup(tok)
    prompt = _enc(tok, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    stream = [*prompt, *_enc(tok, "<think>\n000"), *_enc(tok, " "), *_enc(tok, "\n")]
    render = [*prompt, *_enc(tok, "<think>\n000 \n</think>\n\n<|im_end|>\n")]
    assert all(d.allowed for d in classifier.compare(_facts(stream, len(prompt), len(stream), close), render))


def test_truncated_last_turn_of_one_newline_merges_with_the_generation_prompt(tok: Tokenizer) -> None:
    """A last turn cut after a sampled newline: the render fuses it with the header's newline and
    writes a close and separator; the stream's newline is sampled, never the render's separator."""
    classifier, close = _setup(tok)
    prompt = _enc(tok, "<|im_start|>user\nTask<|im_end|>\n<|im_start|>assistant\n")
    stream = [*prompt, *_enc(tok, "\n")]
    render = _enc(tok, "<|im_start|>user\nTask<|im_end|>\n<|im_start|>assistant\n\n<|im_end|>\n")
    differences = classifier.compare(_facts(stream, len(prompt), len(stream), close), render)
    assert differences
    assert all(d.allowed for d in differences), differences


# Shapes found by an outside test: ordinary conversations, each difference named by what it is.


def test_gpt_oss_analysis_before_a_tool_call_is_stripped_reasoning(family_root: Path) -> None:
    """The fresh render drops the analysis before a call; the alignment first puts the user's
    `<|end|><|start|>assistant` in the run, which holds the same ids as the analysis's own end."""
    tok, classifier = _family(family_root, "gpt_oss")
    head = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
    call = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    result = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>Sunny<|end|>"
    final = "<|channel|>final<|message|>Sunny.<|return|>"
    analysis = "<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant"
    parts = [(head, False), (analysis + call, True), (result + "<|start|>assistant", False), (final, True)]
    stream = _stream(tok, parts, "<|end|> <|return|> <|call|>")
    [difference] = classifier.compare(stream, _enc(tok, f"{head}{call}{result}<|start|>assistant{final}"))
    assert difference.kind == "history_reasoning_stripped"
    assert difference.position == len(_enc(tok, head))  # the first sampled token, not the user's end
    assert difference.stream_text == analysis


def test_glm_reasoning_cut_by_max_tokens_then_continued(family_root: Path) -> None:
    """GLM keeps an empty think block in history: it drops the reasoning and writes the `</think>`
    the cut turn never sampled, before the close the proxy synthesized."""
    glm, classifier = _family(family_root, "glm4_moe")
    head = "[gMASK]<sop><|user|>\nSolve it.<|assistant|>"
    parts = [
        (head, False),
        ("\n<think>A very long chain", True),
        ("<|user|>\nGo on.<|assistant|>", False),
        ("\n<think>Short.</think>\nDone.<|user|>", True),
    ]
    stream = _stream(glm, parts, "<|user|> <|observation|>")
    close_at = len(_enc(glm, head + "\n<think>A very long chain"))
    stream = replace(stream, synthesized=frozenset({close_at}))
    render = _enc(glm, f"{head}\n<think></think><|user|>\nGo on.<|assistant|>\n<think>Short.</think>\nDone.")
    differences = classifier.compare(stream, render)
    assert _kinds(differences) == [
        "history_reasoning_stripped",
        "truncation_close_synthesized",
        "stop_token_rewrite",
    ]
    assert (differences[1].position, differences[1].render_text) == (close_at, "</think>")
    # The same shape where the render keeps the reasoning (Qwen3 inside a tool cycle): only the close.
    qwen, qwen_classifier = _family(family_root, "qwen3")
    prompt = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    parts = [(prompt, False), ("<think>\nplan", True), ("<|im_end|>\n<|im_start|>user\nmore", False)]
    stream = _stream(qwen, parts, "<|im_end|>")
    stream = replace(stream, synthesized=frozenset({len(_enc(qwen, prompt + "<think>\nplan"))}))
    render = _enc(qwen, f"{prompt}<think>\nplan\n</think>\n\n<|im_end|>\n<|im_start|>user\nmore")
    assert _kinds(qwen_classifier.compare(stream, render)) == ["truncation_close_synthesized"]


DS_CALL_IN = DS_CALL.replace("Tokyo", "Lyon")


def test_deepseek_openers_its_template_writes_once_are_a_render_artefact(family_root: Path) -> None:
    """DeepSeek's template writes a tool-call turn's Assistant and tool-calls-begin markers and the
    tool outputs' opener only for the first ones of a conversation: a later call turn is rendered as
    `\\n` and its calls. The stream, as the engine got it, keeps them."""
    tok, classifier = _family(family_root, "deepseek_v3")
    results = DS_RESULT.replace("Sunny, 21 C", "Rain")
    parts = [
        (DS_PROMPT, False),
        (DS_CALL, True),
        (DS_RESULT, False),
        (f"Sunny.{EOS}", True),
        (f"{USER}And Lyon?{ASSISTANT}<think>\n", False),
        (f"\n</think>\n\n{DS_CALL_IN}", True),
        (results, False),
        (f"Rain.{EOS}", True),
    ]
    stream = _stream(tok, parts, EOS)
    quirk = DS_CALL_IN.replace(f"{CALLS_BEGIN}", "\n", 1)
    later_results = results.replace(OUTPUTS_BEGIN, "", 1)
    render = _enc(
        tok, f"{DS_PROMPT}{DS_CALL}{DS_RESULT}Sunny.{EOS}{USER}And Lyon?{quirk}{later_results}Rain.{EOS}"
    )
    differences = classifier.compare(stream, render)
    assert _kinds(differences) == ["repeated_opener_dropped", "repeated_opener_dropped"]
    assert all(d.allowed for d in differences)
    # Openers the render never wrote before are missing structure: still a bug.
    stream = _stream(tok, [(DS_PROMPT, False), (DS_CALL, True)], EOS)
    [difference] = classifier.compare(
        stream, _enc(tok, DS_PROMPT.replace(ASSISTANT, "") + DS_CALL.replace(CALLS_BEGIN, "\n"))
    )
    assert difference.kind == "unclassified"


LLAMA_PROMPT = (
    "<|start_header_id|>user<|end_header_id|>\n\nSay it.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.mark.parametrize(
    ("family", "prompt", "close", "separator"),
    [
        (
            "llama3_1",
            LLAMA_PROMPT,
            "<|eot_id|>",
            "",
        ),
        ("qwen3", "<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>", "\n"),
        ("deepseek_v3", DS_PROMPT, EOS, ""),
        (
            "gpt_oss",
            "<|start|>user<|message|>Say it.<|end|><|start|>assistant<|channel|>final<|message|>",
            "<|return|>",
            "",
        ),
    ],
)
def test_the_close_a_render_writes_after_a_last_turn_cut_short(
    family_root: Path, family: str, prompt: str, close: str, separator: str
) -> None:
    """A last turn cut by max_tokens or ended by a stop string holds no close; the render writes the
    close the proxy would synthesize had the conversation gone on, then the family's separator."""
    tok, classifier = _family(family_root, family)
    tail = ["truncation_close_synthesized"] + (["final_separator_absent"] * bool(separator))
    cut = _stream(tok, [(prompt, False), ("A long answer", True)], close)
    differences = classifier.compare(cut, _enc(tok, f"{prompt}A long answer{close}{separator}"))
    assert _kinds(differences) == tail
    assert [d.render_text for d in differences] == [close, separator][: len(tail)]
    assert {d.position for d in differences} == {len(cut.ids)}
    # Ended by a stop string: the message leaves it out, the stream keeps it as sampled.
    stopped = _stream(tok, [(prompt, False), ("Part one. STOP", True)], close)
    differences = classifier.compare(stopped, _enc(tok, f"{prompt}Part one.{close}{separator}"))
    assert _kinds(differences) == ["assistant_canonicalization", *tail]
    assert differences[0].stream_text.strip() == "STOP"


def test_a_render_that_opens_and_closes_its_own_think_block_closes_no_reasoning(family_root: Path) -> None:
    """Qwen3 writes an empty think block before a last assistant turn: its </think> closes no
    reasoning the cut turn left open, so the block is the template's wrapper, and only the close
    and separator after the turn are the render's tail."""
    tok, classifier = _family(family_root, "qwen3")
    prompt = "<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\n"
    cut = _stream(tok, [(prompt, False), (" ", True)], "<|im_end|>")
    differences = classifier.compare(cut, _enc(tok, f"{prompt}<think>\n\n</think>\n\n <|im_end|>\n"))
    assert "unclassified" not in _kinds(differences)
    assert _kinds(differences)[-2:] == ["truncation_close_synthesized", "final_separator_absent"]
