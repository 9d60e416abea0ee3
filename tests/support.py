"""Test plumbing: serving an ASGI app with uvicorn on a free loopback port, in a thread."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from tokenizers import Tokenizer

from proxy.api.one_send import OneSendHttpToolsProtocol


def token_id(tokenizer: Tokenizer, text: str) -> int:
    """The id of a token that must exist in this vocabulary."""
    found = tokenizer.token_to_id(text)
    assert found is not None, f"{text!r} is not a token"
    return int(found)


@contextmanager
def serve(app: Any, port: int = 0) -> Iterator[str]:
    """Run `app` under uvicorn (lifespan included) and yield its base URL; stop it on exit. `port` 0:
    any free one."""
    # The HTTP protocol `tito-proxy serve` runs (a response's head and body in one write).
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", http=OneSendHttpToolsProtocol
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server failed to start")
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not start in 60 s")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def chat(url: str, messages: list[dict[str, Any]], session: str, **extra: Any) -> dict[str, Any]:
    """One chat completion in `session` (max_tokens 64 unless given); it must succeed."""
    body = {"model": "m", "messages": messages, "max_tokens": 64, **extra}
    response = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def reply(url: str, messages: list[dict[str, Any]], session: str, **extra: Any) -> dict[str, Any]:
    """The assistant message of one successful chat completion."""
    message: dict[str, Any] = chat(url, messages, session, **extra)["choices"][0]["message"]
    return message


def segments(url: str, session: str) -> list[dict[str, Any]]:
    """The session's exported segments."""
    response = httpx.get(f"{url}/sessions/{session}/trajectory")
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()["segments"]
    return found


def stream_events(
    url: str, body: dict[str, Any], session: str, headers: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """A streamed chat completion: its parsed events and its raw lines."""
    events: list[dict[str, Any]] = []
    raw: list[str] = []
    with httpx.stream(
        "POST", f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=60, headers=headers
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                raw.append(line)
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events, raw


def assemble_stream(events: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
    """One choice of a stream reassembled: text, reasoning, tool calls by index, finish_reason."""
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for event in events:
        for choice in event["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slot = message["tool_calls"].setdefault(
                    call["index"], {"id": None, "name": "", "arguments": ""}
                )
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] += call.get("function", {}).get("name") or ""
                slot["arguments"] += call.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    message["finish_reason"] = finish
    return message


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def spawn_proxy(
    args: list[str], env: dict[str, str], log: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`python -m proxy serve ARGS` as its own process on a free port, once healthy; terminated on exit
    unless the test killed it."""
    port = free_port()
    with log.open("ab") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", *args, "--port", str(port)],
            env={**os.environ, **env},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
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
        yield process, url
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
