"""kill -9 of the proxy under concurrent load, repeated: every answered turn survives, the database
stays intact, and every session continues after the restart."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.fakes.sglang import FakeSGLang
from tests.support import spawn_proxy

SESSIONS = 16
KILLS = 3


class Conversation:
    """One session driven by a worker: the history it has been answered, and the answering call ids."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.messages: list[dict[str, Any]] = []
        self.answered: list[int] = []

    def turn(self, url: str) -> bool:
        """Send the next turn; False once the proxy is gone."""
        messages = [*self.messages, {"role": "user", "content": f"step {len(self.answered)}"}]
        try:
            response = httpx.post(
                f"{url}/sessions/{self.session_id}/v1/chat/completions",
                json={"model": "m", "messages": messages, "max_tokens": 16},
                timeout=30,
            )
        except httpx.TransportError:
            return False
        assert response.status_code == 200, response.text
        body = response.json()
        self.answered.append(int(response.headers["X-Tito-Call-Ids"]))
        self.messages = [*messages, body["choices"][0]["message"]]
        return True


def _load(url: str, conversations: list[Conversation]) -> list[threading.Thread]:
    def work(conversation: Conversation) -> None:
        while conversation.turn(url):
            pass

    threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in conversations]
    for thread in threads:
        thread.start()
    return threads


def test_kill_9_under_load_loses_no_answered_turn(engine: FakeSGLang, qwen_dir: Path, tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    env = {"TITO_DB": f"sqlite:///{db}", "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    args = ["--tokenizer", str(qwen_dir), "--log-level", "warning"]
    conversations = [Conversation(f"crash-{i}") for i in range(SESSIONS)]
    for _ in range(KILLS):
        with spawn_proxy(args, env, tmp_path / "proxy.log") as (process, url):
            before = sum(len(c.answered) for c in conversations)
            threads = _load(url, conversations)
            deadline = time.monotonic() + 30
            while sum(len(c.answered) for c in conversations) < before + 3 * SESSIONS:
                assert time.monotonic() < deadline, "no load reached the proxy"
                time.sleep(0.05)
            process.kill()  # SIGKILL: no shutdown, no flush
            process.wait(timeout=30)
            for thread in threads:
                thread.join(timeout=60)
    with sqlite3.connect(db) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        recorded = {row[0] for row in connection.execute("select id from calls where status = 'ok'")}
    answered = [call for c in conversations for call in c.answered]
    assert len(answered) >= KILLS * 3 * SESSIONS
    assert set(answered) <= recorded, "a turn whose answer was received is missing"
    with spawn_proxy(args, env, tmp_path / "proxy.log") as (_, url):
        for conversation in conversations:
            assert conversation.turn(url)
            # The new turn extends the branch of every answered turn: one segment holds them all.
            segments = httpx.get(f"{url}/sessions/{conversation.session_id}/trajectory").json()["segments"]
            chain = next(s["call_ids"] for s in segments if s["call_ids"][-1] == conversation.answered[-1])
            assert chain == conversation.answered
            assert httpx.post(f"{url}/sessions/{conversation.session_id}/finish").status_code == 200
        exported = httpx.get(f"{url}/export").text
    assert all(c.session_id in exported for c in conversations)


def test_kill_9_right_after_a_lone_turn_is_answered_keeps_it(
    engine: FakeSGLang, qwen_dir: Path, tmp_path: Path
) -> None:
    """One conversation, one turn at a time: each is committed on the event loop (no other turn is
    under way), and it is as durable there as on the writer thread, answered only once committed."""
    db = tmp_path / "lone.db"
    env = {"TITO_DB": f"sqlite:///{db}", "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    args = ["--tokenizer", str(qwen_dir), "--log-level", "warning"]
    conversation = Conversation("lone")
    for _ in range(2):
        with spawn_proxy(args, env, tmp_path / "proxy.log") as (process, url):
            for _ in range(3):
                assert conversation.turn(url)
            process.kill()  # at once after the last answer: no shutdown, no flush
            process.wait(timeout=30)
    with sqlite3.connect(db) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        recorded = [
            row[0] for row in connection.execute("select id from calls where status = 'ok' order by id")
        ]
    assert recorded == conversation.answered  # every answered turn, in order, and nothing else
