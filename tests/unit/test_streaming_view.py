"""Property: streamed deltas, for any text split anywhere, reassemble to the final parse."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.chat.parsing import OutputParser
from proxy.chat.streaming import StreamedMessage

PIECES = st.sampled_from(
    [
        "<think>",
        "</think>",
        "\n",
        "\n\n",
        " ",
        "plan",
        "ü",
        "🌍",
        "answer",
        "<tool_call>",
        "</tool_call>",
        '\n{"name": "f", "arguments": {"a": 1}}\n',
        "<tool_",
        "call>",
        "ST",
        "OP",
        "text",
    ]
)


@settings(max_examples=1500, deadline=None)
@given(
    pieces=st.lists(PIECES, max_size=14),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
    parser_name=st.sampled_from(["hermes", "qwen3_coder", "glm45", "mistral"]),
    reasoning_open=st.booleans(),
    stops=st.sampled_from([(), ("STOP",)]),
)
def test_deltas_reassemble_to_the_final_parse(
    pieces: list[str], cuts: list[int], parser_name: str, reasoning_open: bool, stops: tuple[str, ...]
) -> None:
    text = "".join(pieces)
    if stops and "STOP" in text:
        text = text[: text.index("STOP")]  # the engine stops there; the final text ends before it
    parser = OutputParser(parser_name, parse_reasoning=True, special_texts=("<|im_end|>",))
    view = StreamedMessage(parser, reasoning_open=reasoning_open, stop_strings=stops)
    sent = {"reasoning_content": "", "content": ""}
    for cut in sorted({min(c, len(text)) for c in cuts}):
        for key, value in view.update(text[:cut]).items():
            sent[key] += value
    final = parser.parse(text, reasoning_open=reasoning_open)
    tail, calls = view.finish(final)
    for key, value in tail.items():
        sent[key] += value
    assert not view.diverged
    assert sent["reasoning_content"] == (final.reasoning_content or "")
    assert sent["content"] == (final.content or "")
    assert len([c for c in calls if "id" in c]) == len(final.tool_calls)


def test_nothing_from_a_complete_stop_string_on_is_streamed() -> None:
    """A chunk that already holds the whole stop string (twice, even) streams only what precedes it."""
    parser = OutputParser("hermes", parse_reasoning=False, special_texts=("<|im_end|>",))
    view = StreamedMessage(parser, stop_strings=("--",))
    assert view.update("alpha beta ---- gamma") == {"content": "alpha beta"}
    assert view.update("alpha beta ---- gamma delta") == {}
