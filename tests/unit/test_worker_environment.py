"""`--workers` processes get the parent's settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import worker_environment
from proxy.config import Settings


def test_workers_get_the_parents_settings_and_no_secret_of_their_own_making(
    monkeypatch: pytest.MonkeyPatch, qwen_dir: Path
) -> None:
    env = worker_environment(Settings(tokenizer=qwen_dir, served_model_name="m", workers=2))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    first = Settings()
    assert first.workers == 2
    assert first.served_model_name == "m"
    # Without a configured secret every worker reads the database's, as replicas and restarts do
    # (tests/e2e/test_replicas.py); one made here would differ after a restart.
    assert "TITO_REASONING_SECRET" not in env
    assert first.reasoning_secret is None


def test_a_configured_reasoning_secret_is_passed_on_unchanged(qwen_dir: Path) -> None:
    env = worker_environment(Settings(tokenizer=qwen_dir, reasoning_secret="s3cret", workers=2))
    assert env["TITO_REASONING_SECRET"] == "s3cret"
