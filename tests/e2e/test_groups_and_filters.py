"""GRPO groups (set at creation or by header on the first turn), whole-group export, the export
filters, the per-session samples endpoint, and Parquet rows with the JSONL rows' structure."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from proxy.client import AsyncTitoClient, TitoClient
from tests.fakes.sglang import FakeSGLang
from tests.support import token_id

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _export(url: str, **params: Any) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/export", params=params, timeout=60)
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.content.splitlines() if line]


def _chat(url: str, session: str | None, headers: dict[str, str] | None = None) -> httpx.Response:
    path = f"/sessions/{session}/v1/chat/completions" if session else "/v1/chat/completions"
    return httpx.post(f"{url}{path}", json=CHAT, headers=headers or {}, timeout=60)


def test_a_group_is_set_at_creation_or_by_the_first_turns_headers(proxy_url: str, engine: FakeSGLang) -> None:
    with TitoClient(proxy_url) as client:
        sid = client.create_session("g-0", group_id="p1", sample_index=0, group_size=3)
        info = client.session(sid)
        assert (info["group_id"], info["sample_index"], info["group_size"]) == ("p1", 0, 3)
    first = _chat(proxy_url, "g-1", {"X-Tito-Group-Id": "p1", "X-Tito-Sample-Index": "1"})
    assert first.status_code == 200, first.text
    assert _chat(proxy_url, "g-1", {"X-Tito-Group-Id": "p1"}).status_code == 200  # repeating it is fine
    assert _chat(proxy_url, "g-1").status_code == 200  # so is leaving it out
    headerless = _chat(proxy_url, None, {"X-Tito-Group-Id": "p1", "X-Tito-Sample-Index": "2"})
    assert headerless.status_code == 200, headerless.text
    new_id = headerless.headers["x-session-id"]
    info = httpx.get(f"{proxy_url}/sessions/{new_id}").json()
    assert (info["group_id"], info["sample_index"], info["group_size"]) == ("p1", 2, None)
    assert httpx.get(f"{proxy_url}/sessions/g-1").json()["sample_index"] == 1
    # A session with calls cannot change group; a taken index, another size or a full group is a 409.
    moved = _chat(proxy_url, "g-1", {"X-Tito-Group-Id": "other"})
    assert moved.status_code == 409
    assert moved.json()["error"]["type"] == "conflict_error"
    assert _chat(proxy_url, "g-9", {"X-Tito-Group-Id": "p1", "X-Tito-Sample-Index": "0"}).status_code == 409
    body: dict[str, Any]
    for body in (
        {"group_id": "p1", "sample_index": 1},
        {"group_id": "p1", "group_size": 4},
        {"group_id": "p1"},  # the group of 3 is full
    ):
        assert httpx.post(f"{proxy_url}/sessions", json=body).status_code == 409, body
    for body in (
        {"sample_index": 0},
        {"group_id": "p2", "sample_index": 2, "group_size": 2},
        {"group_id": "bad id"},
        {"group_id": "p2", "sample_index": -1},
    ):
        bad = httpx.post(f"{proxy_url}/sessions", json=body)
        assert bad.status_code == 400, (body, bad.text)
    assert _chat(proxy_url, "g-8", {"X-Tito-Group-Id": "p3", "X-Tito-Sample-Index": "x"}).status_code == 400
    assert _chat(proxy_url, "g-8", {"X-Tito-Sample-Index": "0"}).status_code == 400
    # Headers on a request that runs no turn (an SDK's default headers) create nothing.
    listed = httpx.get(f"{proxy_url}/sessions/quiet/v1/models", headers={"X-Tito-Group-Id": "p9"})
    assert listed.status_code == 200
    assert httpx.get(f"{proxy_url}/sessions/quiet").status_code == 404
    # A session created empty takes the group of its first turn's headers.
    httpx.post(f"{proxy_url}/sessions", json={"id": "empty"})
    assert _chat(proxy_url, "empty", {"X-Tito-Group-Id": "p4", "X-Tito-Group-Size": "1"}).status_code == 200
    assert httpx.get(f"{proxy_url}/sessions/empty").json()["group_size"] == 1
    for sid in ("g-1", new_id, "empty"):
        httpx.post(f"{proxy_url}/sessions/{sid}/finish")
    rows = _export(proxy_url) + _export(proxy_url, mode="stepwise")
    assert {(r["session_id"], r["group_id"], r["sample_index"]) for r in rows} == {
        ("g-1", "p1", 1),
        (new_id, "p1", 2),
        ("empty", "p4", None),
    }


def test_whole_groups_are_delivered_once_all_their_sessions_finished(
    proxy_url: str, engine: FakeSGLang
) -> None:
    with TitoClient(proxy_url) as client:
        for index in range(3):
            client.create_session(f"a{index}", group_id="A", sample_index=index, group_size=3)
            _chat(proxy_url, f"a{index}")
        for index in range(2):  # no size given: whole when every session of the group finished
            client.create_session(f"b{index}", group_id="B", sample_index=index)
            _chat(proxy_url, f"b{index}")
        client.create_session("loose")
        _chat(proxy_url, "loose")
        for sid in ("a2", "a0", "b1", "loose"):
            client.finish(sid)
        assert _export(proxy_url, whole_groups="true") == []
        client.finish("a1")  # A is whole; B still has b0 running
        rows = _export(proxy_url, whole_groups="true")
        assert [r["session_id"] for r in rows] == ["a0", "a1", "a2"]
        assert len({r["cursor"] for r in rows}) == 1  # the cursor at which the group became whole
        assert _export(proxy_url, whole_groups="true", after=rows[0]["cursor"]) == []
        client.finish("b0")
        assert [r["session_id"] for r in _export(proxy_url, whole_groups="true", limit=1)] == [
            "a0",
            "a1",
            "a2",
        ]
        groups = [r["group_id"] for r in client.iter_samples(whole_groups=True, consumer="t", ack=True)]
        assert groups == ["A", "A", "A", "B", "B"]
        assert list(client.iter_samples(whole_groups=True, consumer="t")) == []
        only_b = _export(proxy_url, whole_groups="true", group_ids="B", mode="stepwise")
        assert [r["session_id"] for r in only_b] == ["b0", "b1"]
    refused = httpx.get(f"{proxy_url}/export", params={"whole_groups": "true", "status": "active"})
    assert refused.status_code == 400


def test_a_consumer_gets_a_group_whole_until_it_has_acked_all_of_it(
    proxy_url: str, engine: FakeSGLang
) -> None:
    """A consumer that stopped in the middle of a group, or acked part of it by session ids, gets
    the group whole again (GRPO normalizes over the group: its rest alone would pass for it); a
    group acked whole is not delivered again."""
    with TitoClient(proxy_url) as client:
        for group in ("G", "H"):
            for index in range(3):
                client.create_session(f"{group}{index}", group_id=group, sample_index=index, group_size=3)
                _chat(proxy_url, f"{group}{index}")
                client.finish(f"{group}{index}")
        reading = client.iter_samples(whole_groups=True, consumer="c", ack=True)
        first = [next(reading)["session_id"] for _ in range(2)]
        reading.close()  # the consumer stops (crashes) with G half read: nothing of G is acked
        assert first == ["G0", "G1"]
        client.ack("c", ["H1"])  # part of a group acked by hand
        rows = [
            (r["group_id"], r["session_id"]) for r in client.iter_samples(whole_groups=True, consumer="c")
        ]
        assert rows == [("G", "G0"), ("G", "G1"), ("G", "G2"), ("H", "H0"), ("H", "H1"), ("H", "H2")]
        delivered = [r["session_id"] for r in client.iter_samples(whole_groups=True, consumer="c", ack=True)]
        assert delivered == ["G0", "G1", "G2", "H0", "H1", "H2"]
        assert list(client.iter_samples(whole_groups=True, consumer="c")) == []


def test_export_filters(proxy_url: str, engine: FakeSGLang, tmp_path: Path) -> None:
    with TitoClient(proxy_url) as client:
        for sid, version in (("v9", "9"), ("v10", "10"), ("v2", "2"), ("open", "10")):
            engine.weight_version = version
            client.create_session(sid, group_id=f"G{sid}")
            assert _chat(proxy_url, sid).status_code == 200
        for sid in ("v9", "v10", "v2"):
            client.finish(sid)

        def ids(**params: Any) -> list[str]:
            return [r["session_id"] for r in _export(proxy_url, **params)]

        assert ids() == ["v9", "v10", "v2"]
        assert ids(min_weight_version="9") == ["v9", "v10"]  # 10 is newer than 9: not string order
        assert ids(min_weight_version="10") == ["v10"]
        assert ids(session_ids="v2,v9") == ["v9", "v2"]
        assert ids(session_ids=["v2", "v10"]) == ["v10", "v2"]
        assert ids(group_ids="Gv10") == ["v10"]
        assert ids(limit=2) == ["v9", "v10"]
        assert ids(limit=1, min_weight_version="10") == ["v10"]
        assert ids(status="active") == ["open"]
        assert ids(status="all") == ["v9", "v10", "v2", "open"]
        assert [r["cursor"] for r in _export(proxy_url, status="active")] == [None]
        assert [r["session_id"] for r in client.iter_samples(min_weight_version="10", status="all")] == [
            "v10",
            "open",
        ]
        [row] = _export(proxy_url, session_ids="v10")
        assert (row["weight_version_min"], row["weight_version_max"]) == ("10", "10")
    out = tmp_path / "rows.jsonl"
    command = [sys.executable, "-m", "proxy", "export", "--url", proxy_url, "--out", str(out)]
    command += ["--status", "all", "--min-weight-version", "10", "--group-ids", "Gv10,Gopen,Gv9"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert [orjson.loads(line)["session_id"] for line in out.read_bytes().splitlines()] == ["v10", "open"]
    # An empty list matches no session, as on the route: it never widens the export (nor its acks).
    for empty in ("--session-ids", "--group-ids"):
        emptied = [*command[:8], "--status", "all", empty, "", "--consumer", "c", "--ack"]
        result = subprocess.run(emptied, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        assert out.read_bytes() == b"", empty
        assert "acked" not in result.stdout
    for params in ({"limit": 0}, {"session_ids": "bad id"}, {"status": "gone"}, {"min_weight_version": ""}):
        assert httpx.get(f"{proxy_url}/export", params=params).status_code == 400, params
    misspelled = httpx.get(f"{proxy_url}/export", params={"min_version": "10"})
    assert misspelled.status_code == 400
    assert misspelled.json()["error"]["code"] == "unsupported_parameter"


def test_weight_version_bounds_compare_numbers_as_numbers(proxy_url: str, engine: FakeSGLang) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for version in ("9", "10"):
        engine.weight_version = version
        answer = httpx.post(
            f"{proxy_url}/sessions/w/v1/chat/completions", json={**CHAT, "messages": messages}, timeout=60
        )
        messages = [*messages, answer.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    httpx.post(f"{proxy_url}/sessions/w/finish")
    [row] = _export(proxy_url)
    assert (row["weight_version_min"], row["weight_version_max"]) == ("9", "10")


def test_one_sessions_samples_step_wise_or_merged(proxy_url: str, engine: FakeSGLang) -> None:
    assert _chat(proxy_url, "one").status_code == 200
    steps = httpx.get(f"{proxy_url}/sessions/one/samples").json()
    assert steps["mode"] == "stepwise"
    [step] = steps["samples"]
    assert (step["cursor"], step["step"], step["is_last_step"]) == (None, 0, True)
    httpx.post(f"{proxy_url}/sessions/one/finish")
    with TitoClient(proxy_url) as client:
        [merged] = client.samples("one", "merged")
        assert merged == _export(proxy_url)[0]
        assert client.samples("one") == _export(proxy_url, mode="stepwise")
    assert httpx.get(f"{proxy_url}/sessions/nobody/samples").status_code == 404
    assert httpx.get(f"{proxy_url}/sessions/one/samples", params={"mode": "x"}).status_code == 400


def _parquet_rows(url: str, **params: Any) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/export", params={**params, "format": "parquet"}, timeout=60)
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = pq.read_table(io.BytesIO(response.content)).to_pylist()
    return rows


def test_parquet_rows_have_the_jsonl_rows_structure(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    cut = qwen_tokenizer.encode("a long answer that goes on", add_special_tokens=False).ids
    engine.push(cut)  # no close: cut by max_tokens, then continued (a synthesized close)
    with TitoClient(proxy_url) as client:
        client.create_session("p", metadata={"task": "t1", "tags": ["x"], "spec": {"k": 1}}, group_id="g")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
        answer = httpx.post(
            f"{proxy_url}/sessions/p/v1/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 3},
            timeout=60,
        ).json()
        assert answer["choices"][0]["finish_reason"] == "length"
        engine.push([*qwen_tokenizer.encode("done", add_special_tokens=False).ids, im_end])
        messages += [answer["choices"][0]["message"], {"role": "user", "content": "go on"}]
        httpx.post(f"{proxy_url}/sessions/p/v1/chat/completions", json={"model": "m", "messages": messages})
        client.reward("p", 0.5)
        client.finish("p")
    for mode in ("merged", "stepwise"):
        jsonl_rows = _export(proxy_url, mode=mode)
        parquet_rows = _parquet_rows(proxy_url, mode=mode)
        for got, expected in zip(parquet_rows, jsonl_rows, strict=True):
            assert {k: v for k, v in got.items() if v != expected.get(k)} == {}
        assert parquet_rows == jsonl_rows
    [row] = _export(proxy_url)
    assert [e["kind"] for e in row["boundary_edits"]] == ["truncation_close_synthesized"]
    assert row["drift"]["mode"] == "strict"


def test_parquet_metadata_of_different_shapes(proxy_url: str, engine: FakeSGLang) -> None:
    metas: list[dict[str, Any]] = [
        {"task": "t1", "n": 1},
        {"task": "t2", "n": 2.5, "extra": {"a": [1, 2]}},
        {"n": "three"},
        {},
    ]
    with TitoClient(proxy_url) as client:
        for index, meta in enumerate(metas):
            client.create_session(f"m{index}", metadata=meta)
            client.finish(f"m{index}")
    got = [r["metadata"] for r in _parquet_rows(proxy_url, status="finished", mode="stepwise")]
    assert got == []  # sessions without calls have no step rows
    response = httpx.get(f"{proxy_url}/export", params={"format": "parquet"}, timeout=60)
    table = pq.read_table(io.BytesIO(response.content))
    assert table.schema.field("metadata").type.num_fields == 3
    metadata = table.schema.field("metadata").type
    assert str(metadata.field("extra").type) == "struct<a: list<element: int64>>"
    assert str(metadata.field("n").type) == "string"  # 1, 2.5 and "three": JSON text


def test_the_async_client_drives_sessions_of_a_group(proxy_url: str, engine: FakeSGLang) -> None:
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
        async with AsyncTitoClient(proxy_url) as client:
            ids = [await client.create_session(group_id="A", sample_index=k, group_size=2) for k in range(2)]
            async with httpx.AsyncClient(base_url=proxy_url, timeout=60) as http:
                answers = await asyncio.gather(
                    *(http.post(f"/sessions/{sid}/v1/chat/completions", json=CHAT) for sid in ids)
                )
            assert [a.status_code for a in answers] == [200, 200]
            steps = await client.samples(ids[0])
            for k, sid in enumerate(ids):
                await client.reward(sid, float(k))
                await client.finish(sid)
            rows = [r async for r in client.iter_samples(whole_groups=True, consumer="c", ack=True)]
            assert [r async for r in client.iter_samples(consumer="c")] == []
            return rows, steps, await client.session(ids[1])

    rows, steps, info = asyncio.run(run())
    assert [(r["sample_index"], r["reward"]) for r in rows] == [(0, 0.0), (1, 1.0)]
    assert [s["is_last_step"] for s in steps] == [True]
    assert (info["status"], info["group_id"]) == ("finished", "A")


def test_group_headers_on_text_completions_and_active_rows_in_parquet(
    proxy_url: str, engine: FakeSGLang
) -> None:
    headers = {"X-Tito-Group-Id": "T", "X-Tito-Sample-Index": "3"}
    body = {"model": "m", "prompt": "once upon", "max_tokens": 4}
    answer = httpx.post(f"{proxy_url}/sessions/text/v1/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    [row] = _parquet_rows(proxy_url, status="active")
    assert (row["session_id"], row["group_id"], row["sample_index"], row["cursor"]) == ("text", "T", 3, None)
    assert row["drift"]["skipped"]  # text completions have no messages to render
