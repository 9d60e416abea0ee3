"""Several engine URLs: a repeated --engine-url, commas in it or in TITO_ENGINE_URL, passed on to
--workers processes whole."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.cli import _serve_parser, _settings_from, worker_environment
from proxy.config import Settings

A, B, C = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_the_flag_repeats_and_takes_commas(qwen_dir: Path) -> None:
    args = _serve_args("--engine-url", A, "--engine-url", f"{B}, {C}/", "--tokenizer", str(qwen_dir))
    assert _settings_from(args).engine_urls == [A, B, C]
    assert _settings_from(_serve_args("--tokenizer", str(qwen_dir))).engine_urls == ["http://127.0.0.1:30000"]


def test_the_environment_takes_commas_and_workers_get_every_url(
    monkeypatch: pytest.MonkeyPatch, qwen_dir: Path
) -> None:
    monkeypatch.setenv("TITO_ENGINE_URL", f"{A},{B}")
    monkeypatch.setenv("TITO_TOKENIZER", str(qwen_dir))
    settings = Settings()
    assert settings.engine_urls == [A, B]
    assert Settings(engine_url=[A, C], tokenizer=qwen_dir).engine_urls == [A, C]
    env = worker_environment(Settings(engine_url=f"{A},{B}", tokenizer=qwen_dir, workers=2))
    monkeypatch.setenv("TITO_ENGINE_URL", env["TITO_ENGINE_URL"])
    assert Settings().engine_urls == [A, B]


@pytest.mark.parametrize(("urls", "problem"), [(f"{A},{A}/", "twice"), (" , ", "no engine")])
def test_a_repeated_or_empty_list_is_refused(qwen_dir: Path, urls: str, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        Settings(engine_url=urls, tokenizer=qwen_dir)
