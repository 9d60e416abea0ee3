"""`--workers` processes get the parent's settings; every process on a database keeps one stored secret."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.cli import worker_environment
from proxy.config import Settings
from proxy.store.database import create_engine, session_factory, upgrade_blocking
from proxy.store.repository import first_setting


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


def test_processes_starting_on_one_database_keep_the_first_stored_secret(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'secret.db'}"
    upgrade_blocking(url)

    async def scenario() -> list[str]:
        engine = create_engine(url)
        try:
            db_sessions = session_factory(engine)
            # Two starting at once, then a restart: all end with the value stored first.
            first = await asyncio.gather(
                *(first_setting(db_sessions, "secret", f"made-{n}") for n in range(2))
            )
            return [*first, await first_setting(db_sessions, "secret", "made-later")]
        finally:
            await engine.dispose()

    values = asyncio.run(scenario())
    assert len(set(values)) == 1
    assert values[0] in {"made-0", "made-1"}
