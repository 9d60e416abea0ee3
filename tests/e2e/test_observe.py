"""Request ids, structured logs and Prometheus metrics, on the app served by uvicorn."""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from proxy.observe.logs import JsonFormatter, install_record_ids
from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.support import chat, spawn_proxy
from tests.viewed_sessions import record_viewed_sessions

USER = [{"role": "user", "content": "hi"}]


def test_a_request_id_is_accepted_or_generated_and_returned(proxy_url: str) -> None:
    given = httpx.get(f"{proxy_url}/health", headers={"x-request-id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    made = httpx.get(f"{proxy_url}/health")
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    for bad in ("x" * 129, "has space", "tab\there"):
        replaced = httpx.get(f"{proxy_url}/health", headers={"x-request-id": bad})
        assert replaced.headers["x-request-id"] != bad
        assert re.fullmatch(r"[0-9a-f]{32}", replaced.headers["x-request-id"])


def test_error_envelopes_carry_the_request_id(proxy_url: str) -> None:
    cases = [
        httpx.post(f"{proxy_url}/v1/chat/completions", json={"model": "m"}, headers={"x-request-id": "r1"}),
        httpx.get(f"{proxy_url}/sessions/nobody", headers={"x-request-id": "r2"}),
        httpx.get(f"{proxy_url}/no/such/route", headers={"x-request-id": "r3"}),
        httpx.post(
            f"{proxy_url}/v1/chat/completions",
            json={"model": "m", "messages": USER, "logit_bias": {"1": 2}},
            headers={"x-request-id": "r4"},
        ),
    ]
    for expected, response in zip(("r1", "r2", "r3", "r4"), cases, strict=True):
        assert response.status_code >= 400
        assert response.headers["x-request-id"] == expected
        assert response.json()["error"]["request_id"] == expected


def test_log_lines_of_a_request_carry_its_ids_and_an_export_logs_one_line(
    proxy_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    for turn in range(3):
        chat(proxy_url, USER, f"s{turn}")
        httpx.post(f"{proxy_url}/sessions/s{turn}/finish").raise_for_status()
    caplog.set_level(logging.DEBUG, logger="tito_proxy")
    exported = httpx.get(f"{proxy_url}/export", headers={"x-request-id": "export-1"})
    assert exported.status_code == 200
    export_lines = [r for r in caplog.records if r.name == "tito_proxy.export" and r.levelno >= logging.INFO]
    assert len(export_lines) == 1, [r.getMessage() for r in export_lines]
    assert export_lines[0].request_id == "export-1"  # type: ignore[attr-defined]
    assert "3 sessions, 3 rows" in export_lines[0].getMessage()
    caplog.clear()
    # A trajectory logs its drift per segment (at debug): those lines name the request and session.
    httpx.get(f"{proxy_url}/sessions/s0/trajectory", headers={"x-request-id": "read-9"})
    mine = [r for r in caplog.records if r.name == "tito_proxy.export"]
    assert mine
    assert all(r.request_id == "read-9" for r in mine)  # type: ignore[attr-defined]
    assert all(r.session_id == "s0" for r in mine)  # type: ignore[attr-defined]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_with_json_logs_writes_one_object_per_line(
    engine: FakeSGLang, qwen_dir: Path, tmp_path: Path, workers: str
) -> None:
    """Also from `--workers` processes, which are fresh interpreters: their lines too are JSON with
    request ids, access lines as asked."""
    env = {"TITO_DB": f"sqlite:///{tmp_path / 'j.db'}", "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    log = tmp_path / "serve.log"
    args = ["--tokenizer", str(qwen_dir), "--log-format", "json", "--access-log", "--workers", workers]
    with spawn_proxy(args, env, log) as (_, url):
        reply = httpx.post(
            f"{url}/sessions/js/v1/chat/completions",
            json={"model": "m", "messages": USER, "max_tokens": 4},
            headers={"x-request-id": "json-1"},
        )
        assert reply.status_code == 200
        httpx.get(f"{url}/export", headers={"x-request-id": "json-2"}).raise_for_status()
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= set(entry) for entry in entries)
    turn = [e for e in entries if e.get("request_id") == "json-1"]
    assert [e for e in turn if e["logger"] == "uvicorn.access"], entries
    assert all(e["session_id"] == "js" for e in turn)
    assert [e["logger"] for e in entries if e.get("request_id") == "json-2"].count("tito_proxy.export") == 1


def test_serve_with_text_logs_names_the_request_and_its_session(
    engine: FakeSGLang, qwen_dir: Path, tmp_path: Path
) -> None:
    """The default format: `[REQUEST_ID session=SESSION_ID]`, the session named by the path or
    X-Session-Id; one that could end the bracket or the line is quoted and escaped."""
    env = {"TITO_DB": f"sqlite:///{tmp_path / 't.db'}", "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    log = tmp_path / "serve.log"
    with spawn_proxy(["--tokenizer", str(qwen_dir), "--access-log"], env, log) as (_, url):
        body = {"model": "m", "messages": USER, "max_tokens": 4}
        named = {"x-request-id": "text-1", "x-session-id": "by-header"}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=named).status_code == 200
        httpx.get(f"{url}/sessions/by-header/samples", headers={"x-request-id": "text-2"}).raise_for_status()
        httpx.get(f"{url}/sessions/a%20b%5D%0Ac", headers={"x-request-id": "text-3"})
        httpx.get(f"{url}/health", headers={"x-request-id": "text-4"})
    lines = log.read_text().splitlines()

    def access(request_id: str) -> str:
        [line] = [line for line in lines if " uvicorn.access [" + request_id in line]
        return line

    assert " uvicorn.access [text-1 session=by-header]: " in access("text-1")
    assert " uvicorn.access [text-2 session=by-header]: " in access("text-2")
    assert ' uvicorn.access [text-3 session="a b]\\nc"]: ' in access("text-3")
    assert " uvicorn.access [text-4]: " in access("text-4")


def test_serve_writes_no_access_lines_unless_asked(
    engine: FakeSGLang, qwen_dir: Path, tmp_path: Path
) -> None:
    env = {"TITO_DB": f"sqlite:///{tmp_path / 'a.db'}", "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    log = tmp_path / "serve.log"
    with spawn_proxy(["--tokenizer", str(qwen_dir), "--log-format", "json"], env, log) as (_, url):
        body = {"model": "m", "messages": USER, "max_tokens": 4}
        assert httpx.post(f"{url}/sessions/quiet/v1/chat/completions", json=body).status_code == 200
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert entries  # the start-up lines
    assert not [e for e in entries if e["logger"] == "uvicorn.access"], entries


def test_json_log_lines_are_one_object_each() -> None:
    install_record_ids()
    record = logging.getLogger("tito_proxy.test").makeRecord(
        "tito_proxy.test", logging.WARNING, __file__, 1, "hello %s", ("world",), None
    )
    line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert "\n" not in line
    assert entry["level"] == "warning"
    assert entry["logger"] == "tito_proxy.test"
    assert entry["message"] == "hello world"
    assert "time" in entry


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return found


def test_metrics_move_with_turns_errors_and_exports(start_proxy: ProxyFactory, engine: FakeSGLang) -> None:
    admin = {"Authorization": "Bearer admin-k"}
    with start_proxy(api_key="harness-k", admin_key="admin-k") as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer harness-k"}).status_code == 403
        harness = {"Authorization": "Bearer harness-k"}
        for session in ("a", "b"):
            body = {"model": "m", "messages": USER, "max_tokens": 8}
            ok = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, headers=harness)
            assert ok.status_code == 200
        edited = [*USER, {"role": "assistant", "content": "never sampled"}, {"role": "user", "content": "?"}]
        body = {"model": "m", "messages": edited, "max_tokens": 8}
        ok = httpx.post(f"{url}/sessions/b/v1/chat/completions", json=body, headers=harness)
        assert ok.status_code == 200
        engine.fault = "http500"
        failed = httpx.post(
            f"{url}/sessions/c/v1/chat/completions", json={"model": "m", "messages": USER}, headers=harness
        )
        assert failed.status_code == 502
        engine.fault = None
        httpx.post(f"{url}/sessions/a/finish", headers=admin).raise_for_status()
        exported = httpx.get(f"{url}/export", headers=admin)
        response = httpx.get(f"{url}/metrics", headers=admin)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    got = _samples(response.text)
    assert got["tito_turns_total", (("dialect", "chat"), ("status", "ok"))] == 3
    assert got["tito_turns_total", (("dialect", "chat"), ("status", "error"))] == 1
    assert got["tito_engine_errors_total", (("kind", "bad_gateway"),)] == 1
    for phase in ("render", "engine", "record", "total"):
        assert got["tito_turn_phase_seconds_count", (("phase", phase),)] == 3
    assert got["tito_prompt_tokens_total", ()] > 0
    assert got["tito_completion_tokens_total", ()] > 0
    assert got["tito_active_sessions", ()] == 1  # b; a finished, c never recorded
    assert got["tito_segments_opened_total", (("reason", "new_conversation"),)] == 2
    assert got["tito_segments_opened_total", (("reason", "history_not_matched"),)] == 1
    assert got["tito_commit_group_size_count", ()] >= 1
    assert got["tito_commit_group_size_sum", ()] == 3  # every recorded turn in some group
    assert got["tito_commit_seconds_count", ()] == got["tito_commit_group_size_count", ()]
    assert got["tito_export_rows_total", (("mode", "merged"),)] == 1
    assert got["tito_export_bytes_total", (("format", "jsonl"),)] == len(exported.content)
    assert got["tito_errors_total", (("code", "bad_gateway"), ("status", "502"))] == 1


def test_time_to_first_token_is_measured_on_streams(proxy_url: str) -> None:
    body = {"model": "m", "messages": USER, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{proxy_url}/sessions/st/v1/chat/completions", json=body) as response:
        response.read()
    got = _samples(httpx.get(f"{proxy_url}/metrics").text)
    assert got["tito_time_to_first_token_seconds_count", ()] == 1


def test_viewer_api_gives_aligned_tokens_and_clear_errors(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    record_viewed_sessions(proxy_url, engine, qwen_tokenizer)
    detail = httpx.get(f"{proxy_url}/ui/api/sessions/viewed").json()
    assert [p["branch"] for p in detail["paths"]] == ["final", "sample"]
    assert [c["segment_reason"] for c in detail["calls"]] == ["new_conversation", None, None]
    data = httpx.get(f"{proxy_url}/ui/api/sessions/viewed/tokens", params={"path": 0}).json()
    size = len(data["ids"])
    assert size == len(data["pieces"]) == len(data["mask"]) == len(data["logprobs"]) == len(data["special"])
    assert data["mask"][: data["prompt_len"]] == [0] * data["prompt_len"]
    for call in data["calls"]:
        assert data["mask"][call["start"] : call["end"]] == [1] * (call["end"] - call["start"])
    assert [e["kind"] for e in data["edits"]] == ["truncation_close_synthesized"]
    assert data["mask"][data["edits"][0]["position"]] == 0
    assert data["render"]["ids"][:size] == data["ids"]  # only the final separator differs
    assert "".join(data["pieces"]) == qwen_tokenizer.decode(data["ids"], skip_special_tokens=False)
    bad_cursor = httpx.get(f"{proxy_url}/ui/api/sessions", params={"status": "finished", "after": "x"})
    assert bad_cursor.status_code == 400
    assert httpx.get(f"{proxy_url}/ui/api/sessions/nobody").status_code == 404
    assert httpx.get(f"{proxy_url}/ui/api/sessions/viewed/tokens", params={"path": 9}).status_code == 404


def test_viewer_api_times_carry_their_zone(proxy_url: str) -> None:
    """As every other time the proxy returns; `since` with an offset means that instant."""
    assert httpx.post(f"{proxy_url}/sessions", json={"id": "zoned"}).status_code == 201
    assert httpx.post(f"{proxy_url}/sessions/zoned/finish").status_code == 200
    listed = httpx.get(f"{proxy_url}/ui/api/sessions").json()["data"]
    detail = httpx.get(f"{proxy_url}/ui/api/sessions/zoned").json()
    for found in (listed[0], detail):
        for key in ("created_at", "finished_at"):
            assert found[key].endswith("+00:00"), (key, found[key])
    created = datetime.fromisoformat(listed[0]["created_at"])
    just_before = (created - timedelta(seconds=1)).astimezone(timezone(timedelta(hours=5)))
    just_after = (created + timedelta(seconds=1)).astimezone(timezone(timedelta(hours=-5)))
    assert [s["id"] for s in _viewer_list(proxy_url, since=just_before.isoformat())] == ["zoned"]
    assert _viewer_list(proxy_url, since=just_after.isoformat()) == []
    assert [s["id"] for s in _viewer_list(proxy_url, until=just_after.isoformat())] == ["zoned"]


def _viewer_list(url: str, **query: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/ui/api/sessions", params=query)
    assert answer.status_code == 200, answer.text
    found: list[dict[str, Any]] = answer.json()["data"]
    return found


def test_viewer_groups_are_the_sessions_grpo_groups(proxy_url: str) -> None:
    """A session's group is its group_id (issue #15's first-class field); metadata.group, which the
    viewer read before groups existed, still counts for a session without one."""
    for body in (
        {"id": "s-a", "group_id": "prompt-7", "sample_index": 0},
        {"id": "s-b", "group_id": "prompt-7", "sample_index": 1},
        {"id": "s-c", "metadata": {"group": "prompt-7"}},
        {"id": "s-d", "group_id": "prompt-8", "sample_index": 0},
    ):
        assert httpx.post(f"{proxy_url}/sessions", json=body).status_code == 201
    found = _viewer_list(proxy_url, group="prompt-7")
    assert [s["id"] for s in found] == ["s-a", "s-b", "s-c"]
    assert [s["group"] for s in found] == ["prompt-7"] * 3
    assert httpx.get(f"{proxy_url}/ui/api/sessions/s-d").json()["group"] == "prompt-8"
