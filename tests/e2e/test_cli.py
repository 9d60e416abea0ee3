"""`tito-proxy serve` as users run it: a separate process, configured by flags and TITO_* variables."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.fakes.sglang import FakeSGLang


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_serve_command_starts_migrates_and_answers(
    engine: FakeSGLang, qwen_dir: Path, tmp_path: Path
) -> None:
    port = _free_port()
    env = {**os.environ, "TITO_DB": f"sqlite:///{tmp_path / 'cli.db'}", "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--tokenizer",
                str(qwen_dir),
                "--port",
                str(port),
                "--served-model-name",
                "qwen-test",
            ],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the proxy did not become healthy"
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "qwen-test"
        reply = httpx.post(
            f"{url}/sessions/c/v1/chat/completions",
            json={"model": "qwen-test", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert reply.status_code == 200, reply.text
    finally:
        process.terminate()
        process.wait(timeout=30)
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
