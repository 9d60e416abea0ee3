"""The real agent CLIs (Codex CLI, Claude Code) installed from npm into a cached prefix, and the
configuration that runs each offline against a local proxy (../shared/docs/agent-clis.md)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

# The versions the tests pin; both packages ship their native binaries.
PACKAGES = {"codex": "@openai/codex@0.169.0", "claude": "@anthropic-ai/claude-code@2.1.331"}
# An exact version in these variables replaces the pin, to run the tests against a newer CLI
# (with TITO_AGENT_CLIS_DIR pointing at a prefix of its own, so the pinned install stays cached).
VERSION_VARIABLES = {"codex": "TITO_CODEX_VERSION", "claude": "TITO_CLAUDE_CODE_VERSION"}


def package(name: str) -> str:
    """The npm package spec to install: the pin, or the version its variable names."""
    pinned = PACKAGES[name]
    version = os.environ.get(VERSION_VARIABLES[name])
    return f"{pinned.rsplit('@', 1)[0]}@{version}" if version else pinned


def cli_prefix() -> Path:
    found = os.environ.get("TITO_AGENT_CLIS_DIR")
    return Path(found) if found else Path.home() / ".cache" / "tito-proxy" / "agent-clis"


def installed(name: str) -> Path:
    """The CLI's binary, installed with npm on first use; raises RuntimeError with the reason when
    npm is missing or the install fails."""
    prefix = cli_prefix() / name
    prefix.mkdir(parents=True, exist_ok=True)
    # Test processes running in parallel (pytest-xdist) install into one prefix: one at a time.
    with (prefix.parent / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _install(name, prefix)


def _installed_version(prefix: Path, package_name: str) -> str | None:
    try:
        manifest = json.loads((prefix / "node_modules" / package_name / "package.json").read_text())
    except (OSError, ValueError):
        return None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    return version if isinstance(version, str) else None


def _install(name: str, prefix: Path) -> Path:
    spec = package(name)
    package_name, version = spec.rsplit("@", 1)
    binary = prefix / "node_modules" / ".bin" / name
    marker = prefix / f".installed-{version}"  # the install of that version finished
    # The package's own manifest too: a checkout whose code predates the stale-marker removal below
    # may have installed another version into the same prefix.
    if binary.exists() and marker.exists() and _installed_version(prefix, package_name) == version:
        return binary
    # The install replaces whatever version the prefix held: its marker must not claim it still does.
    for stale in prefix.glob(".installed-*"):
        stale.unlink()
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise RuntimeError("npm and node are not installed (apt-get install nodejs npm)")
    done = subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", spec],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0 or not binary.exists():
        raise RuntimeError(f"npm install {spec} failed: {done.stderr[-2000:]}")
    marker.touch()
    return binary


_OUTSIDE_TRAFFIC_OFF = """web_search = "disabled"

[analytics]
enabled = false

[features]
plugins = false
apps = false
goals = false
multi_agent = false
image_generation = false
remote_plugin = false
"""


def codex_home(root: Path, base_url: str, *, defaults: bool = False) -> Path:
    """A CODEX_HOME whose config points Codex at the proxy over the Responses wire; outside traffic off
    unless `defaults` (then Codex also sends namespace and web_search tools)."""
    home = root / "codex-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f"""model = "m"
model_provider = "tito"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
{"" if defaults else _OUTSIDE_TRAFFIC_OFF}
[model_providers.tito]
name = "tito"
base_url = "{base_url}"
env_key = "TITO_TEST_KEY"
wire_api = "responses"
"""
    )
    return home


def claude_env(root: Path, base_url: str, *, defaults: bool = False) -> dict[str, str]:
    """Claude Code's environment: the proxy as its API, a fresh home; outside traffic off unless
    `defaults`."""
    home = root / "claude-home"
    home.mkdir(parents=True, exist_ok=True)
    quiet = {
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    return {
        **({} if defaults else quiet),
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "unused",
        "IS_SANDBOX": "1",  # --dangerously-skip-permissions refuses root otherwise
    }
