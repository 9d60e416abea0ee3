"""What answers are called: one id form for plain, streamed and replayed answers, the recorded call
ids in a header, time zones on every timestamp, and the served model's name and start time."""

from __future__ import annotations

import re
import time
from datetime import datetime

import httpx

from tests.support import chat, stream_events

USER = [{"role": "user", "content": "hi"}]
CHAT_ID = re.compile(r"^chatcmpl-[0-9a-f]{32}$")
TEXT_ID = re.compile(r"^cmpl-[0-9a-f]{32}$")


def test_plain_streamed_and_replayed_answers_share_one_id_form(proxy_url: str) -> None:
    plain = chat(proxy_url, USER, "ids")
    events, _ = stream_events(proxy_url, {"model": "m", "messages": USER, "stream": True}, "ids")
    assert CHAT_ID.match(plain["id"]), plain["id"]
    assert {event["id"] for event in events} == {events[0]["id"]}
    assert CHAT_ID.match(events[0]["id"]), events[0]["id"]
    assert events[0]["id"] != plain["id"]
    # A retry is answered from the record under the id its first answer had, plain or streamed.
    body = {"model": "m", "messages": [{"role": "user", "content": "again"}], "max_tokens": 8}
    address = f"{proxy_url}/sessions/ids/v1/chat/completions"
    key = {"Idempotency-Key": "k-1"}
    first = httpx.post(address, json=body, headers=key, timeout=30)
    replay = httpx.post(address, json=body, headers=key, timeout=30)
    assert replay.headers["X-Tito-Replayed"] == "true"
    assert replay.json()["id"] == first.json()["id"]
    streamed = {**body, "stream": True}
    original, _ = stream_events(proxy_url, streamed, "ids", headers={"Idempotency-Key": "k-2"})
    replayed, _ = stream_events(proxy_url, streamed, "ids", headers={"Idempotency-Key": "k-2"})
    assert {event["id"] for event in replayed} == {original[0]["id"]}
    text = httpx.post(
        f"{proxy_url}/sessions/ids/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4}
    )
    assert TEXT_ID.match(text.json()["id"]), text.json()["id"]


def test_plain_answers_name_their_recorded_calls(proxy_url: str) -> None:
    response = httpx.post(
        f"{proxy_url}/sessions/calls/v1/chat/completions",
        json={"model": "m", "messages": USER, "n": 2, "max_tokens": 8},
        timeout=30,
    )
    named = [int(call) for call in response.headers["X-Tito-Call-Ids"].split(",")]
    recorded = httpx.get(f"{proxy_url}/sessions/calls/trajectory").json()["segments"]
    assert sorted(named) == sorted(call for segment in recorded for call in segment["call_ids"])


def test_timestamps_carry_their_zone_and_models_a_start_time(proxy_url: str) -> None:
    before = int(time.time())
    chat(proxy_url, USER, "times")
    httpx.post(f"{proxy_url}/sessions/times/finish").raise_for_status()
    session = httpx.get(f"{proxy_url}/sessions/times").json()
    for field in ("created_at", "updated_at", "finished_at"):
        moment = datetime.fromisoformat(session[field])
        assert moment.utcoffset() is not None, (field, session[field])
        assert abs(moment.timestamp() - before) < 300
    listed = httpx.get(f"{proxy_url}/sessions").json()["data"]
    assert all(datetime.fromisoformat(s["created_at"]).utcoffset() is not None for s in listed)
    [model] = httpx.get(f"{proxy_url}/v1/models").json()["data"]
    assert 0 < model["created"] <= int(time.time())
    assert model["id"]
