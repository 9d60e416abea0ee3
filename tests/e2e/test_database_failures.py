"""A database that fails for real (a full disk, a lost server): every route answers 503 in the
envelope, a stream ends with an error event, nothing is half-written, and the proxy recovers."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import postgres_server
from tests.conftest import ProxyFactory
from tests.support import chat

USER = [{"role": "user", "content": "hi"}]


@contextmanager
def _tiny_disk(root: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `root` (needs root; skipped elsewhere)."""
    root.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def _fill(disk: Path) -> Path:
    """Fill the filesystem to its last byte; returns the filler (delete it to free the space)."""
    filler = disk / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for block in (1 << 16, 1 << 12, 1 << 9, 1):
            while True:
                try:
                    os.write(descriptor, b"\0" * block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(descriptor)
    return filler


def _unavailable(response: httpx.Response, code: str = "database_unavailable") -> dict[str, Any]:
    assert response.status_code == 503, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["code"] == code
    return error


def _streamed(url: str, session: str) -> list[str]:
    body = {"model": "m", "messages": USER, "max_tokens": 8, "stream": True}
    with httpx.stream(
        "POST", f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=60
    ) as answer:
        assert answer.status_code == 200
        return [line for line in answer.iter_lines() if line.startswith("data: ")]


def test_a_full_disk_is_a_503_on_every_writing_route_and_nothing_is_half_written(
    start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    with _tiny_disk(tmp_path / "disk") as disk, start_proxy(db=disk / "proxy.db") as url:
        chat(url, USER, "kept")
        chat(url, USER, "done")
        assert httpx.post(f"{url}/sessions/done/finish").status_code == 200
        assert httpx.post(f"{url}/admin/weight_version", json={"weight_version": "v1"}).status_code == 200
        before = httpx.get(f"{url}/sessions/kept").json()
        filler = _fill(disk)

        # A turn whose commit fails is not answered: a 503, or a stream's error event then [DONE].
        big = [{"role": "user", "content": "x" * 200_000}]
        plain = httpx.post(
            f"{url}/sessions/kept/v1/chat/completions", json={"model": "m", "messages": big}, timeout=60
        )
        _unavailable(plain, "record_failed")
        events = _streamed(url, "kept")
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "record_failed"
        assert not [line for line in events if '"finish_reason":"stop"' in line]

        _unavailable(httpx.post(f"{url}/sessions", json={"id": "new", "metadata": {"k": "v" * 100_000}}))
        _unavailable(httpx.post(f"{url}/sessions/kept/reward", json={"reward": 1.0}))
        _unavailable(httpx.post(f"{url}/sessions/kept/finish"))
        _unavailable(httpx.delete(f"{url}/sessions/kept"))
        _unavailable(httpx.post(f"{url}/export/ack", json={"consumer": "t", "session_ids": ["done"]}))
        _unavailable(httpx.post(f"{url}/admin/weight_version", json={"weight_version": "v2"}))

        # Nothing half-written: every refused write left the record as it was; reads still work.
        assert httpx.get(f"{url}/admin/weight_version").json() == {"weight_version": "v1"}
        assert httpx.get(f"{url}/sessions/kept").json() == before
        assert httpx.get(f"{url}/sessions/new").status_code == 404
        assert [row["session_id"] for row in _export(url, consumer="t")] == ["done"]

        # Space again: the same proxy records again, without a restart.
        filler.unlink()
        chat(url, USER, "kept")
        assert httpx.post(f"{url}/sessions/kept/finish").status_code == 200
        assert httpx.get(f"{url}/sessions/kept").json()["calls_by_status"] == {"ok": 2}


def _export(url: str, **params: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/export", params={"mode": "stepwise", **params}, timeout=60)
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line]


def test_a_lost_database_server_is_a_503_on_every_route_and_the_proxy_recovers(
    start_proxy: ProxyFactory,
) -> None:
    if not postgres_server.available():
        pytest.skip("PostgreSQL's server programs (initdb, pg_ctl) are not installed")
    # A server of its own, since it is stopped mid-test (in /tmp: the server's user must reach it).
    with tempfile.TemporaryDirectory() as folder, postgres_server.postgres_server(Path(folder)) as server_url:
        root = Path(folder)
        port = int(server_url.rsplit(":", 1)[1].split("/")[0])
        database = postgres_server.new_database(server_url)
        with start_proxy(db=database) as url:
            chat(url, USER, "done")
            assert httpx.post(f"{url}/sessions/done/finish").status_code == 200
            postgres_server.stop(root)

            body = {"model": "m", "messages": USER, "max_tokens": 8}
            for stream in (False, True):
                turn = httpx.post(
                    f"{url}/sessions/s/v1/chat/completions", json={**body, "stream": stream}, timeout=60
                )
                _unavailable(turn)  # the turn's first read fails, before any byte of a stream
            for method, path, payload in [
                ("POST", "/sessions", {"id": "new"}),
                ("GET", "/sessions", None),
                ("GET", "/sessions/done", None),
                ("GET", "/sessions/done/trajectory", None),
                ("POST", "/sessions/done/reward", {"reward": 1.0}),
                ("POST", "/sessions/done/finish", None),
                ("DELETE", "/sessions/done", None),
                ("GET", "/export", None),
                ("POST", "/export/ack", {"consumer": "t", "session_ids": ["done"]}),
                ("POST", "/admin/weight_version", {"weight_version": "v2"}),
            ]:
                _unavailable(httpx.request(method, url + path, json=payload, timeout=60))

            postgres_server.start(root, port)
            chat(url, USER, "done-2")
            assert [row["session_id"] for row in _export(url)] == ["done"]
