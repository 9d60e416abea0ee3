"""Tokenizer locations: a directory, or a hub id read offline from the local Hugging Face cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.chat.tokenizer import load_tokenizer_files
from proxy.config import Settings, is_loopback
from proxy.model_source import ModelSourceError, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, qwen_dir: Path, model_id: str = "Qwen/Qwen3-8B") -> Path:
    """A hub cache laid out as huggingface_hub writes it: refs/main names the snapshot's commit."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(qwen_dir, repo / "snapshots" / COMMIT)
    return root


def test_a_directory_is_used_as_is(qwen_dir: Path) -> None:
    source = resolve(qwen_dir)
    assert source.directory == qwen_dir
    assert source.name == qwen_dir.name


def test_a_hub_id_reads_the_snapshot_the_engine_downloaded(
    tmp_path: Path, qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _hub_cache(tmp_path / "hub", qwen_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    source = resolve("Qwen/Qwen3-8B")
    assert source.directory == cache / "models--Qwen--Qwen3-8B" / "snapshots" / COMMIT
    assert source.name == "Qwen/Qwen3-8B"
    assert load_tokenizer_files(source.directory).vocab_size > 150_000
    assert resolve(f"Qwen/Qwen3-8B@{COMMIT}").directory == source.directory
    # HF_HOME is honoured the way huggingface_hub honours it (HF_HOME/hub).
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve("Qwen/Qwen3-8B").directory == source.directory


def test_settings_name_a_hub_model_by_its_id(
    tmp_path: Path, qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_cache(tmp_path, qwen_dir)))
    settings = Settings(tokenizer=Path("Qwen/Qwen3-8B"))
    assert settings.model_name == "Qwen/Qwen3-8B"
    assert settings.tokenizer_dir.name == COMMIT


@pytest.mark.parametrize(
    ("reference", "needle"),
    [
        ("Qwen/Qwen3-8B", "not in the Hugging Face cache"),
        ("Qwen/Qwen3-8B@v2", "not in the Hugging Face cache"),
        ("/no/such/dir", "not a Hugging Face model id"),
        ("a/b/c", "not a Hugging Face model id"),
    ],
)
def test_an_unknown_model_is_a_clear_error(
    tmp_path: Path, reference: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelSourceError, match=needle):
        resolve(reference)


def test_a_revision_without_a_snapshot_is_named(
    tmp_path: Path, qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_cache(tmp_path, qwen_dir)))
    with pytest.raises(ModelSourceError, match="revision 'v2' has no snapshot"):
        resolve("Qwen/Qwen3-8B@v2")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True), ("0.0.0.0", False),
     ("::", False), ("10.0.0.5", False), ("proxy.internal", False)],
)  # fmt: skip
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_binding_beyond_loopback_needs_both_keys(qwen_dir: Path) -> None:
    with pytest.raises(ValidationError, match="--api-key"):
        Settings(tokenizer=qwen_dir, host="0.0.0.0")
    with pytest.raises(ValidationError, match="--admin-key"):
        Settings(tokenizer=qwen_dir, host="0.0.0.0", api_key="harness")
    assert Settings(tokenizer=qwen_dir, host="0.0.0.0", api_key="harness", admin_key="admin").host
    assert Settings(tokenizer=qwen_dir, host="0.0.0.0", allow_unauthenticated=True).host
    assert Settings(tokenizer=qwen_dir, host="127.0.0.1").host
