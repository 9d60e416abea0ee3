"""64 sessions run while the vLLM stand-in goes through two weight updates (the trainer pauses with
abort, updates, resumes) and one restart: no harness sees a failure, every recorded token and logprob
is one the engine sampled, and every per-token version span names the version that sampled it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import uvicorn
from tokenizers import Tokenizer

from proxy.app import create_app
from proxy.config import Settings
from tests.fakes.sglang import ScriptedOutput
from tests.fakes.vllm import FakeVLLM
from tests.support import assemble_stream, free_port, serve, stream_events, token_id

SESSIONS = 64


class _Engine:
    """The stand-in on a fixed port, so that it can be restarted where the proxy expects it."""

    def __init__(self, app: Any, port: int) -> None:
        self.app, self.port = app, port
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        assert self.server is not None
        assert self.thread is not None
        self.server.should_exit = self.server.force_exit = True  # like a crash: streams are cut
        self.thread.join(timeout=30)


@contextmanager
def _engine(fake: FakeVLLM) -> Iterator[_Engine]:
    engine = _Engine(fake.app(), free_port())
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def _conversation(url: str, index: int, trainer_done: threading.Event) -> int:
    """Turns until the trainer's syncs are over (two at least), streamed every other turn; how many."""
    session = f"s{index}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"question {index}"}]
    turn = 0
    while turn < 2 or not trainer_done.is_set():
        body = {"model": "m", "messages": messages, "max_tokens": 64}
        if (index + turn) % 2 == 0:
            events, _ = stream_events(url, {**body, "stream": True}, session)
            message = assemble_stream(events)
            assert message["finish_reason"] == "stop", message
            content = message["content"]
        else:
            response = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            content = response.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"more {turn}"}]
        turn += 1
    httpx.post(f"{url}/sessions/{session}/finish", timeout=120)
    return turn


def _trainer(url: str, fake: FakeVLLM, engine: _Engine, done: threading.Event) -> None:
    """Two weight updates and a restart, then the sessions may end (after turns under the last
    version): however fast the turns run, they run through all of it."""
    _syncs(url, fake, engine)
    time.sleep(0.3)
    done.set()


def _syncs(url: str, fake: FakeVLLM, engine: _Engine) -> None:
    for version in ("v1", "v2"):
        time.sleep(0.6)
        httpx.post(f"{url}/admin/pause", json={"abort_in_flight": True}, timeout=30)
        fake.weight_version = version  # the weight update, while generation is paused
        time.sleep(0.2)
        httpx.post(f"{url}/admin/resume", timeout=30)
        if version == "v1":
            time.sleep(0.6)
            engine.stop()  # the engine restarts with the same weights
            time.sleep(0.3)
            engine.start()


def _expected_spans(row: dict[str, Any], fake: FakeVLLM, requests: list[list[int]]) -> list[dict[str, Any]]:
    """Check the row's tokens against what the stand-in sampled, attempt by attempt; the spans that
    follow from it."""
    prompt, response = row["prompt_ids"], row["response_ids"]
    stream = prompt + response
    starts = sorted(
        {
            len(r) - len(prompt)
            for r in requests
            if len(prompt) <= len(r) <= len(stream) and r == stream[: len(r)]
        }
    )
    assert starts[0] == 0
    spans: list[dict[str, Any]] = []
    for start, end in zip(starts, [*starts[1:], len(response)], strict=True):
        piece = response[start:end]
        drawn = [s for s in fake.sampled if s["prompt"] == stream[: len(prompt) + start]]
        match = next(s for s in drawn if s["ids"][: len(piece)] == piece)
        if end == len(response):
            assert match["ids"] == piece  # the last attempt finished
        np.testing.assert_allclose(
            row["rollout_logprobs"][start:end], np.float32(match["logprobs"][: len(piece)]), rtol=1e-6
        )
        if spans and spans[-1]["version"] == match["version"]:
            spans[-1]["end"] = end
        elif piece:
            spans.append({"version": match["version"], "start": start, "end": end})
    return spans


def test_sessions_see_no_failure_through_two_weight_updates_and_a_restart(
    qwen_dir: Path, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    fake = FakeVLLM(tokenizer=qwen_tokenizer, eos_ids=(im_end,), vocab_size=qwen_tokenizer.get_vocab_size())
    # Dev mode, as RL trainers run vLLM for its weight routes: /weight_info names the version.
    fake.weight_version, fake.chunk_delay_s, fake.dev_mode = "v0", 0.03, True
    words = [*qwen_tokenizer.encode(" a b c d e f g h i j k l", add_special_tokens=False).ids, im_end]
    draws = itertools.count()

    def reply() -> ScriptedOutput:
        n = next(draws)  # every draw its own logprobs, so a token cannot pass for another draw's
        return ScriptedOutput(words, [-(n * 100 + i + 1) / 1e4 for i in range(len(words))])

    fake._default_output = reply  # type: ignore[method-assign]
    with _engine(fake) as engine:
        settings = Settings(
            engine="vllm",
            engine_url=f"http://127.0.0.1:{engine.port}",
            tokenizer=qwen_dir,
            db=f"sqlite:///{tmp_path / 'load.db'}",
            engine_timeout_s=10,
            engine_restart_wait_s=60,
        )
        with serve(create_app(settings)) as url:
            done = threading.Event()
            trainer = threading.Thread(target=_trainer, args=(url, fake, engine, done))
            trainer.start()
            with ThreadPoolExecutor(SESSIONS) as pool:
                futures = [pool.submit(_conversation, url, i, done) for i in range(SESSIONS)]
                failures = [f.exception() for f in futures]
            trainer.join()
            turns = sum(f.result() for f, failure in zip(futures, failures, strict=True) if failure is None)
            state = httpx.get(f"{url}/admin/state").json()
            export = httpx.get(f"{url}/export", params={"mode": "stepwise"}, timeout=120)
    assert [(i, repr(f)) for i, f in enumerate(failures) if f is not None] == []
    rows = [orjson.loads(line) for line in export.content.splitlines() if line]
    assert len(rows) == turns
    assert state["resumed_generations"] > 0, "no generation was aborted: the test proves nothing"
    requests = [FakeVLLM.prompt_of(r) for r in fake.requests]
    versions_seen = set()
    for row in rows:
        expected = _expected_spans(row, fake, requests)
        assert row["weight_version_spans"] == expected, row["session_id"]
        versions_seen |= {s["version"] for s in expected}
    assert versions_seen == {"v0", "v1", "v2"}
