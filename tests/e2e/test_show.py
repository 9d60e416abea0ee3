"""`tito-proxy show`: a session's segment in the terminal with the viewer's colouring."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from proxy.cli import main
from proxy.observe.terminal import DIM, RESET, SPECIAL, UNDERLINE, logprob_colour
from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.viewed_sessions import record_viewed_sessions


def test_show_prints_a_segment_coloured_by_mask_and_logprob(
    start_proxy: ProxyFactory,
    engine: FakeSGLang,
    qwen_tokenizer: Tokenizer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with start_proxy(admin_key="adm", api_key="har") as url:
        record_viewed_sessions(url, engine, qwen_tokenizer, key="adm")
        assert main(["show", "viewed", "--url", url, "--admin-key", "adm"]) == 0
        shown = capsys.readouterr().out
        assert main(["show", "viewed", "--url", url, "--admin-key", "adm", "--segment", "99"]) == 1
        assert "no segment 99" in capsys.readouterr().err
        assert main(["show", "viewed", "--url", url, "--admin-key", "har"]) == 1
        assert "HTTP 403" in capsys.readouterr().err
    assert "session viewed · segment 1 · final" in shown
    assert f"{DIM}count" in shown  # the user's text: mask 0
    assert f"{DIM}{SPECIAL}<|im_start|>" in shown
    # Sampled tokens sit on the colour of their logprob (the fake engine's first token has -0.01).
    assert f"{logprob_colour(-0.01)}one{RESET}" in shown
    assert UNDERLINE in shown
    assert "edit:truncation_close_synthesized @ 119" in shown
    assert "drift:final_separator_absent @ 154" in shown
    assert "weights v0" in shown


def test_logprob_colours_run_from_red_to_green() -> None:
    assert logprob_colour(0.0) == "\x1b[30;48;5;46m"
    assert logprob_colour(-10.0) == "\x1b[30;48;5;196m"
    assert logprob_colour(float("-inf")) == "\x1b[30;48;5;196m"
