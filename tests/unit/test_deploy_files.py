"""The compose file and image wire the proxy as the README says (no Docker engine runs here)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"TITO_API_KEY": "harness-key", "TITO_ADMIN_KEY": "admin-key", "MODEL": "Qwen/Qwen3-8B"}


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def test_compose_waits_for_a_healthy_sglang_and_keeps_the_db_on_a_volume() -> None:
    services = _compose()["services"]
    sglang, proxy = services["sglang"], services["proxy"]
    # Pinned, never :latest: a new SGLang release changes tokens and limits under a running study.
    assert sglang["image"] == "${SGLANG_IMAGE:-lmsysorg/sglang:v0.5.23}"
    assert "/health" in " ".join(sglang["healthcheck"]["test"])
    assert proxy["depends_on"]["sglang"]["condition"] == "service_healthy"
    assert proxy["environment"]["TITO_ENGINE_URL"] == "http://sglang:30000"
    assert proxy["environment"]["TITO_DB"].startswith("sqlite:////data/")
    assert any(volume.startswith("proxy-data:/data") for volume in proxy["volumes"])
    assert proxy["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_requires_keys_and_exposes_sglang_to_the_trainer() -> None:
    services = _compose()["services"]
    env = services["proxy"]["environment"]
    assert env["TITO_API_KEY"].startswith("${TITO_API_KEY:?")
    assert env["TITO_ADMIN_KEY"].startswith("${TITO_ADMIN_KEY:?")
    assert "${SGLANG_PORT:-30000}:30000" in services["sglang"]["ports"]
    gpus = services["sglang"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpus["count"] == "${SGLANG_GPUS:-all}"
    # The proxy reads the snapshot SGLang downloaded: one hub cache, read-only on the proxy's side.
    assert "hf-cache:/hf-cache:ro" in services["proxy"]["volumes"]
    assert "hf-cache:/root/.cache/huggingface" in services["sglang"]["volumes"]
    assert env["HF_HOME"] == "/hf-cache"


def test_scale_profile_runs_replicas_on_postgres_behind_the_router() -> None:
    services = _compose()["services"]
    for name in ("postgres", "sglang-worker-0", "sglang-worker-1", "sglang-router", "proxy-1", "proxy-2"):
        assert services[name]["profiles"] == ["scale"], name
    router = services["sglang-router"]["command"]
    assert "http://sglang-worker-0:30000 http://sglang-worker-1:30000" in router
    # The policy that hashes the proxy's X-SMG-Routing-Key (a session's turns to one worker's cache).
    assert "--policy consistent_hashing" in router
    for name in ("proxy-1", "proxy-2"):
        env = services[name]["environment"]
        assert env["TITO_DB"].startswith("postgresql://")
        assert env["TITO_ENGINE_URL"] == "http://sglang-router:30000"
    assert services["proxy-2"]["depends_on"]["proxy-1"]["condition"] == "service_healthy"


def _docker_compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("Debian's docker-compose (validates without an engine) is not installed")
    return subprocess.run(
        [binary, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, check=False
    )


def test_compose_file_validates_with_docker_compose_when_installed() -> None:
    result = _docker_compose("config", "-q", env=KEYS)
    assert result.returncode == 0, result.stderr
    result = _docker_compose("--profile", "scale", "config", "-q", env=KEYS)
    assert result.returncode == 0, result.stderr


def test_compose_refuses_to_start_without_keys() -> None:
    result = _docker_compose("config", "-q", env={"MODEL": "Qwen/Qwen3-8B", "TITO_API_KEY": ""})
    assert result.returncode != 0
    assert "TITO_API_KEY" in result.stderr


def _launch(tmp_path: Path, **env: str) -> list[str]:
    """Runs the SGLang launcher with a stand-in python3 that prints the arguments it was given."""
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    base = {"PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run(
        ["/bin/sh", str(ROOT / "docker" / "sglang-launch.sh")],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_sglang_flags_come_from_the_environment(tmp_path: Path) -> None:
    args = _launch(
        tmp_path,
        MODEL="Qwen/Qwen3-8B",
        TP_SIZE="4",
        CONTEXT_LENGTH="32768",
        REASONING_PARSER="qwen3",
        SGLANG_EXTRA_ARGS="--enable-deterministic-inference --mem-fraction-static 0.8",
    )
    joined = " ".join(args)
    assert args[:2] == ["-m", "sglang.launch_server"]
    assert "--model-path Qwen/Qwen3-8B --served-model-name Qwen/Qwen3-8B" in joined
    assert "--host 0.0.0.0" in joined
    assert "--tp-size 4" in joined
    assert "--context-length 32768" in joined
    assert "--reasoning-parser qwen3" in joined
    assert "--tool-call-parser" not in joined
    assert args[-3:] == ["--enable-deterministic-inference", "--mem-fraction-static", "0.8"]


def test_a_model_at_a_revision_is_served_from_that_revision(tmp_path: Path) -> None:
    args = " ".join(_launch(tmp_path, MODEL="Qwen/Qwen3-8B@abc123"))
    assert "--model-path Qwen/Qwen3-8B --served-model-name Qwen/Qwen3-8B" in args
    assert "--revision abc123" in args
    assert "@" not in args


def test_sglang_launcher_needs_a_model(tmp_path: Path) -> None:
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    result = subprocess.run(
        ["/bin/sh", str(ROOT / "docker" / "sglang-launch.sh")],
        env={"PATH": f"{tmp_path}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "MODEL" in result.stderr


def test_image_migrates_then_serves() -> None:
    entrypoint = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert entrypoint.index("tito-proxy migrate") < entrypoint.index('exec tito-proxy "$@"')
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert 'CMD ["serve"]' in dockerfile
    # The proxy's own install: no local-engine extra, so no torch or CUDA in the image.
    assert 'pip install ".[postgres,parquet]"' in dockerfile
