"""Test plumbing: serving an ASGI app with uvicorn on a free loopback port, in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from tokenizers import Tokenizer


def token_id(tokenizer: Tokenizer, text: str) -> int:
    """The id of a token that must exist in this vocabulary."""
    found = tokenizer.token_to_id(text)
    assert found is not None, f"{text!r} is not a token"
    return int(found)


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run `app` under uvicorn (lifespan included) and yield its base URL; stop it on exit."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
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
