"""`tito-proxy serve` as users run it: a separate process, configured by flags and TITO_* variables."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.fakes.sglang import FakeSGLang
from tests.support import spawn_proxy


def test_serve_command_starts_migrates_and_answers(
    engine: FakeSGLang, qwen_dir: Path, tmp_path: Path
) -> None:
    env = {"TITO_DB": f"sqlite:///{tmp_path / 'cli.db'}", "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    args = ["--tokenizer", str(qwen_dir), "--served-model-name", "qwen-test"]
    with spawn_proxy(args, env, tmp_path / "serve.log") as (_, url):
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "qwen-test"
        reply = httpx.post(
            f"{url}/sessions/c/v1/chat/completions",
            json={"model": "qwen-test", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert reply.status_code == 200, reply.text
    assert (tmp_path / "cli.db").is_file()


def test_migrate_command_builds_the_schema(tmp_path: Path) -> None:
    db = tmp_path / "migrated.db"
    subprocess.run(
        [sys.executable, "-m", "proxy", "migrate", "--db", f"sqlite:///{db}"], check=True, timeout=60
    )
    with sqlite3.connect(db) as connection:
        tables = {row[0] for row in connection.execute("select name from sqlite_master where type='table'")}
    assert {"sessions", "segments", "calls"} <= tables


def test_serve_without_a_tokenizer_explains_itself() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TITO_")}
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--tokenizer" in result.stderr


def test_check_template_prints_the_verdict(qwen_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check-template", "--tokenizer", str(qwen_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    verdict = json.loads(result.stdout)
    assert verdict["close_tokens"] == ["<|im_end|>"]
    assert verdict["appends"]["tool"]["continues"] is True


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["export", "--url", "http://127.0.0.1:9", "--out", "{out}"], "cannot reach the proxy"),
        (["export", "--url", "notaurl", "--out", "{out}"], "not an http(s) URL"),
        (["show", "s", "--url", "http://127.0.0.1:9"], "cannot reach the proxy"),
        (["export", "--url", "{proxy}", "--out", "/nonexistent/dir/rows.jsonl"], "No such file"),
    ],
)
def test_client_commands_fail_in_one_line(proxy_url: str, tmp_path: Path, args: list[str], says: str) -> None:
    """A proxy out of reach, a bad URL or an unwritable output: a message, exit 1, no traceback."""
    filled = [a.format(out=tmp_path / "rows.jsonl", proxy=proxy_url) for a in args]
    result = subprocess.run(
        [sys.executable, "-m", "proxy", *filled], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr


def test_a_turn_cancelled_at_shutdown_is_a_503_in_its_dialects_envelope(
    engine: FakeSGLang, qwen_dir: Path, tmp_path: Path
) -> None:
    """Past --shutdown-grace-s uvicorn cancels the requests still running: one not yet answered gets
    a 503 in its dialect's envelope (never uvicorn's plain-text 500), with Retry-After."""
    import signal
    import threading
    import time

    engine.fault, engine.hang_s = "hang", 6.0
    env = {"TITO_DB": f"sqlite:///{tmp_path / 'stop.db'}", "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    args = ["--tokenizer", str(qwen_dir), "--shutdown-grace-s", "0.5", "--retry-after-s", "9"]
    answers: dict[str, httpx.Response] = {}
    bodies = {
        "chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        "messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    }
    with spawn_proxy(args, env, tmp_path / "serve.log") as (process, url):

        def turn(route: str) -> None:
            answers[route] = httpx.post(
                f"{url}/sessions/{route[:4]}/v1/{route}", json=bodies[route], timeout=60
            )

        threads = [threading.Thread(target=turn, args=(route,)) for route in bodies]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while len(engine.requests) < 2:
            assert time.monotonic() < deadline, "the turns did not reach the engine"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=30)
        process.wait(timeout=30)
    chat, anthropic = answers["chat/completions"], answers["messages"]
    for answer in (chat, anthropic):
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "9"  # --retry-after-s, as every other 503's
        assert answer.headers["x-request-id"]
    assert chat.json()["error"]["code"] == "shutting_down"
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "overloaded_error"
    assert anthropic.headers["request-id"] == anthropic.headers["x-request-id"]


def test_a_stream_cut_at_shutdown_has_its_partial_turn_recorded_as_aborted(
    engine: FakeSGLang, qwen_dir: Path, tmp_path: Path
) -> None:
    """uvicorn starts the lifespan's shutdown right after cancelling the requests still running:
    the proxy waits for them, so a cut stream still aborts its engine request and records what was
    sampled as aborted (before, the store was closed under it and the turn was lost)."""
    import signal
    import sqlite3
    import threading
    import time

    words = engine.tokenizer.encode(
        "one two three four five six seven eight nine ten", add_special_tokens=False
    )
    engine.push([*words.ids, engine.eos_ids[0]])
    engine.chunk_delay_s = 0.4
    db = tmp_path / "cut.db"
    env = {"TITO_DB": f"sqlite:///{db}", "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    args = ["--tokenizer", str(qwen_dir), "--shutdown-grace-s", "0.5"]
    received: list[bytes] = []
    with spawn_proxy(args, env, tmp_path / "serve.log") as (process, url):

        def stream() -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            try:
                with httpx.stream(
                    "POST", f"{url}/sessions/cut/v1/chat/completions", json=body, timeout=60
                ) as r:
                    received.extend(r.iter_bytes())
            except httpx.HTTPError:
                pass  # the stream is cut

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 10
        while not received:
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        thread.join(timeout=30)
        process.wait(timeout=30)
    with sqlite3.connect(db) as connection:
        rows = connection.execute("select status, length(output_ids) from calls").fetchall()
    assert [status for status, _ in rows] == ["aborted"]
    assert rows[0][1] > 0
    assert engine.aborted  # its engine request was aborted too
