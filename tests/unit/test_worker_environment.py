"""`--workers` processes get the parent's settings, and one reasoning secret between them."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import worker_environment
from proxy.config import Settings
from proxy.dialects.seals import Sealer


def test_workers_share_one_reasoning_secret_when_none_is_configured(
    monkeypatch: pytest.MonkeyPatch, qwen_dir: Path
) -> None:
    env = worker_environment(Settings(tokenizer=qwen_dir, served_model_name="m", workers=2))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    first, second = Settings(), Settings()
    assert first.workers == 2
    assert first.served_model_name == "m"
    # Each worker builds its own Sealer: a signature one issued verifies on the other.
    signature = Sealer(first.reasoning_secret).signature("thinking")
    assert Sealer(second.reasoning_secret).verifies("thinking", signature)


def test_a_configured_reasoning_secret_is_passed_on_unchanged(qwen_dir: Path) -> None:
    env = worker_environment(Settings(tokenizer=qwen_dir, reasoning_secret="s3cret", workers=2))
    assert env["TITO_REASONING_SECRET"] == "s3cret"
