"""The compose file and image wire the proxy as the README says (no Docker engine runs here)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_waits_for_a_healthy_sglang_and_keeps_the_db_on_a_volume() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    sglang, proxy = compose["services"]["sglang"], compose["services"]["proxy"]
    assert sglang["image"].startswith("lmsysorg/sglang")
    assert "--host 0.0.0.0" in sglang["command"]
    assert "/health" in " ".join(sglang["healthcheck"]["test"])
    assert proxy["depends_on"]["sglang"]["condition"] == "service_healthy"
    assert proxy["environment"]["TITO_ENGINE_URL"] == "http://sglang:30000"
    assert proxy["environment"]["TITO_DB"].startswith("sqlite:////data/")
    assert any(volume.startswith("proxy-data:/data") for volume in proxy["volumes"])
    assert proxy["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_file_validates_with_docker_compose_when_installed() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("Debian's docker-compose (validates without an engine) is not installed")
    env = {**os.environ, "MODEL_NAME": "some-model"}
    result = subprocess.run(
        [binary, "config", "-q"], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_image_migrates_then_serves() -> None:
    entrypoint = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert entrypoint.index("tito-proxy migrate") < entrypoint.index('exec tito-proxy "$@"')
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert 'CMD ["serve"]' in dockerfile
    # The proxy's own install: no local-engine extra, so no torch or CUDA in the image.
    assert 'pip install ".[postgres,parquet]"' in dockerfile
