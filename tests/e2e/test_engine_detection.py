"""At start the engine URL must speak the configured engine's protocol: a URL that speaks another one,
or none, is a start-up error naming what was found, never a healthy proxy that fails every turn."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import Tokenizer

from proxy.engines.detect import identify
from tests.conftest import ProxyFactory
from tests.e2e.test_vllm import start_error, vllm  # noqa: F401  (the vLLM stand-in fixture)
from tests.fakes.sglang import FakeSGLang
from tests.fakes.vllm import FakeVLLM
from tests.support import free_port, serve, token_id


def _url(fake: Any) -> str:
    url: str = fake.url
    return url


def test_an_sglang_url_configured_as_vllm_stops_the_start(engine: FakeSGLang, qwen_dir: Path) -> None:
    message = start_error(engine="vllm", engine_url=_url(engine), tokenizer=qwen_dir)
    assert "speaks sglang, not vllm" in message
    assert "--engine sglang" in message


def test_a_vllm_url_configured_as_sglang_stops_the_start(vllm: FakeVLLM, qwen_dir: Path) -> None:  # noqa: F811
    message = start_error(engine="sglang", engine_url=_url(vllm), tokenizer=qwen_dir)
    assert "speaks vllm, not sglang" in message
    assert "owned_by 'vllm'" in message


@pytest.mark.parametrize("scale_out", [True, False])
def test_vllm_is_told_with_or_without_its_generate_route(vllm: FakeVLLM, scale_out: bool) -> None:  # noqa: F811
    import asyncio

    vllm.scale_out = scale_out
    assert asyncio.run(identify(_url(vllm))).kind == "vllm"
    assert asyncio.run(identify(_url(vllm))).evidence[0] == "/v1/models owned_by 'vllm'"


def test_a_url_that_speaks_neither_stops_the_start(qwen_dir: Path) -> None:
    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "gpt", "owned_by": "openai"}]})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    other = Starlette(routes=[Route("/v1/models", models), Route("/health", health)])
    with serve(other) as url:
        message = start_error(engine="sglang", engine_url=url, tokenizer=qwen_dir)
    assert "speaks neither SGLang's nor vLLM's protocol" in message
    assert "GET /v1/models: HTTP 200" in message


@contextmanager
def _serve_on(app: Any, port: int) -> Iterator[None]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_an_engine_that_comes_up_later_is_checked_when_it_answers(
    start_proxy: ProxyFactory,
    vllm: FakeVLLM,  # noqa: F811
) -> None:
    port = free_port()
    with start_proxy(engine_url=f"http://127.0.0.1:{port}", context_length=4096) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        down = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert down.json()["error"]["code"] == "engine_unavailable"
        with _serve_on(vllm.app(), port):  # a vLLM where SGLang was configured
            wrong = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
            assert wrong.status_code == 503
            assert wrong.json()["error"]["code"] == "engine_mismatch"
            assert "speaks vllm" in wrong.json()["error"]["message"]
            assert httpx.get(f"{url}/health").status_code == 503
    assert vllm.requests == []


def test_an_engine_down_at_start_gives_its_model_and_context_once_it_answers(
    start_proxy: ProxyFactory, qwen_tokenizer: Tokenizer
) -> None:
    """Before, a proxy started ahead of its engine never asked again: it served under the tokenizer's
    name, refused the engine's own with --strict-model-names, and let a max_tokens past the context
    be cut short by the engine instead of refused."""
    late = FakeSGLang(
        tokenizer=qwen_tokenizer,
        eos_ids=(token_id(qwen_tokenizer, "<|im_end|>"),),
        vocab_size=qwen_tokenizer.get_vocab_size(with_added_tokens=True),
        model_name="late-model",
        context_length=64,
    )
    port = free_port()
    with start_proxy(engine_url=f"http://127.0.0.1:{port}", strict_model_names=True) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] is None
        with _serve_on(late.app(), port):
            # A turn before the background asks: it asks first.
            body = {"model": "late-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}
            refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "context_length_exceeded"
            fits = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=30)
            assert fits.status_code == 200, fits.text
            [card] = httpx.get(f"{url}/v1/models").json()["data"]
            assert (card["id"], card["max_model_len"]) == ("late-model", 64)
    assert len(late.requests) == 1


def test_serve_exits_with_the_reason(engine: FakeSGLang, qwen_dir: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "proxy", "serve", "--engine", "vllm", "--engine-url", _url(engine)]
    command += [
        "--tokenizer",
        str(qwen_dir),
        "--db",
        f"sqlite:///{tmp_path / 'p.db'}",
        "--port",
        str(free_port()),
    ]
    done = subprocess.run(command, capture_output=True, timeout=120, check=False)
    assert done.returncode != 0
    assert b"tito-proxy cannot start: the engine URL" in done.stderr
    assert b"speaks sglang, not vllm" in done.stderr
