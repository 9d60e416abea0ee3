"""The real Codex CLI and Claude Code, unmodified, run a two-step task (a shell tool call, then a
final answer) through the proxy against an engine scripted to sample Qwen3's tool-call tokens; the
task is recorded as one exact segment (I1-I6)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response
from tokenizers import Tokenizer

from proxy.store.packed_json import unpack_json
from tests import agent_clis
from tests.conftest import ProxyFactory
from tests.e2e.test_responses import call_text
from tests.fakes.sglang import FakeSGLang, ScriptedOutput
from tests.invariants import assert_invariants
from tests.support import segments, serve, token_id

TASK = "Create the file out.txt holding the word tito, then say done."
FINAL = "The file is written. done"


class TaskEngine(FakeSGLang):
    """Samples the task's tool calls one per turn, each once the previous one's result is in, then
    the final answer; anything else the CLI asks (titles, side questions) gets a short text."""

    calls: list[str]
    outputs: list[tuple[dict[str, Any], ScriptedOutput]]

    async def generate(self, request: Request) -> Response:
        body = await request.json()  # cached: the parent reads it again
        text = self.tokenizer.decode(body.get("input_ids") or [], skip_special_tokens=False)
        last_user = text.rsplit("<|im_start|>user", 1)[-1]
        im_end = token_id(self.tokenizer, "<|im_end|>")
        done = text.rsplit(TASK, 1)[-1].count("<tool_response>")
        if _side_request(last_user):
            reply = '{"title": "Write out.txt"}'
        elif TASK not in text:
            reply = "ok"
        elif done < len(self.calls):
            reply = "<think>\nI will call a tool.\n</think>\n\n" + self.calls[done]
        else:
            reply = "<think>\nThe tool ran.\n</think>\n\n" + FINAL
        scripted = self.push([*self.tokenizer.encode(reply).ids, im_end])
        self.outputs.append((body, scripted))
        return await super().generate(request)


def _side_request(last_user: str) -> bool:
    # With its default features Claude Code asks the model for a session title, quoting the task.
    return f"<session>\n{TASK}" in last_user


@pytest.fixture
def engine(qwen_tokenizer: Tokenizer) -> Iterator[FakeSGLang]:
    fake = TaskEngine(
        tokenizer=qwen_tokenizer,
        eos_ids=(token_id(qwen_tokenizer, "<|im_end|>"), token_id(qwen_tokenizer, "<|endoftext|>")),
        vocab_size=qwen_tokenizer.get_vocab_size(with_added_tokens=True),
        context_length=131072,
    )
    fake.outputs = []
    fake.calls = []
    with serve(fake.app()) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


def _binary(name: str) -> Path:
    try:
        return agent_clis.installed(name)
    except RuntimeError as exc:
        pytest.skip(f"{name} CLI unavailable: {exc}")


def _task_segment(url: str, session: str, engine: TaskEngine) -> None:
    """The task's calls (one per tool call, then the answer) form one segment, exact token for
    token; a side request (a title) is a segment of its own."""
    found = segments(url, session)
    side = [
        _side_request(engine.tokenizer.decode(body["input_ids"], skip_special_tokens=False))
        for body, _ in engine.outputs
    ]
    task_calls = [call for call, is_side in zip(engine.outputs, side, strict=True) if not is_side]
    steps = len(engine.calls) + 1
    assert len(task_calls) == steps, [engine.tokenizer.decode(o.ids) for _, o in engine.outputs]
    assert sorted(s["num_calls"] for s in found) == [1] * sum(side) + [steps]
    [segment] = [s for s in found if s["num_calls"] == steps]
    assert_invariants(segment, [b for b, _ in task_calls], [o for _, o in task_calls])


def _recorded_tool_types(db: Path, dialect: str) -> set[str]:
    """The tool types the CLI sent, from the record; every call carries its dialect."""
    with sqlite3.connect(db) as connection:
        rows = [unpack_json(row[0]) for row in connection.execute("select request from calls")]
    assert {row["dialect"] for row in rows} == {dialect}
    return {str(tool.get("type")) for row in rows for tool in row["body"].get("tools") or []}


def _run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        command,
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.mark.parametrize("defaults", [False, True], ids=["outside-traffic-off", "default-features"])
def test_codex_cli_runs_a_tool_task_as_one_segment(
    start_proxy: ProxyFactory, engine: TaskEngine, tmp_path: Path, defaults: bool
) -> None:
    codex = _binary("codex")
    engine.calls = [call_text("exec_command", {"cmd": "printf tito > out.txt"})]
    work = tmp_path / "work"
    work.mkdir()
    with start_proxy() as url:
        home = agent_clis.codex_home(tmp_path, f"{url}/sessions/codex/v1", defaults=defaults)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            "CODEX_HOME": str(home),
            "TITO_TEST_KEY": "k",
        }
        done = _run(
            [str(codex), "exec", "--strict-config", "--json", "--skip-git-repo-check", "-C", str(work), TASK],
            env,
            work,
        )
        assert (work / "out.txt").read_text() == "tito", done.stdout[-4000:]
        assert FINAL in done.stdout
        _task_segment(url, "codex", engine)
    kinds = _recorded_tool_types(tmp_path / "proxy.db", "responses")
    # With its default features Codex also sends tool types that are not functions.
    assert kinds == ({"function", "namespace", "web_search"} if defaults else {"function"})


@pytest.mark.parametrize("defaults", [False, True], ids=["outside-traffic-off", "default-features"])
def test_claude_code_runs_a_tool_task_as_one_segment(
    start_proxy: ProxyFactory, engine: TaskEngine, tmp_path: Path, defaults: bool
) -> None:
    claude = _binary("claude")
    engine.calls = [call_text("Bash", {"command": "printf tito > out.txt", "description": "Write the file"})]
    work = tmp_path / "work"
    work.mkdir()
    with start_proxy() as url:
        env = agent_clis.claude_env(tmp_path, f"{url}/sessions/claude", defaults=defaults)
        done = _run(
            [
                str(claude),
                "-p",
                TASK,
                "--dangerously-skip-permissions",
                "--model",
                "m",
                "--output-format",
                "stream-json",
                "--verbose",
            ],
            env,
            work,
        )
        assert (work / "out.txt").read_text() == "tito", done.stdout[-4000:]
        results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert results[-1].get("result") == FINAL, done.stdout[-4000:]
        _task_segment(url, "claude", engine)
    _recorded_tool_types(tmp_path / "proxy.db", "anthropic")


@pytest.mark.parametrize("defaults", [False, True], ids=["outside-traffic-off", "default-features"])
def test_claude_code_loads_a_deferred_tool_with_its_tool_search(
    start_proxy: ProxyFactory, engine: TaskEngine, tmp_path: Path, defaults: bool
) -> None:
    """Claude Code declares most of its tools deferred (`defer_loading`) and loads one with its
    ToolSearch tool, whose result holds `tool_reference` blocks: the loaded tool's definition enters
    the prompt there, and the search, the call and the answer are one segment (a refused reference
    would make Claude Code declare every tool in full instead, which opens a new segment)."""
    claude = _binary("claude")
    engine.calls = [
        call_text("ToolSearch", {"query": "select:CronList", "max_results": 5}),
        call_text("CronList", {}),
    ]
    work = tmp_path / "work"
    work.mkdir()
    with start_proxy() as url:
        env = agent_clis.claude_env(tmp_path, f"{url}/sessions/claude", defaults=defaults)
        done = _run(
            [str(claude), "-p", TASK, "--dangerously-skip-permissions", "--model", "m"],
            env,
            work,
        )
        assert FINAL in done.stdout
        _task_segment(url, "claude", engine)
    prompts = [
        engine.tokenizer.decode(body["input_ids"], skip_special_tokens=False)
        for body, _ in engine.outputs
        if not _side_request(engine.tokenizer.decode(body["input_ids"], skip_special_tokens=False))
    ]
    assert '"name": "CronList"' not in prompts[0]
    loaded = prompts[1].rsplit("<tool_response>", 1)[-1]
    assert loaded.startswith('\n<functions>\n<function>{"description": ')
    assert '"name": "CronList"' in loaded
