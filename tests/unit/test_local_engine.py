"""The built-in CPU engine on a tiny random-weight model built offline."""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path

import pytest

from proxy.demo_model import build_demo_model
from proxy.engines.base import SamplingParams
from proxy.engines.local import LocalEngine

pytest.importorskip("torch")


pytestmark = pytest.mark.slow

# Far more tokens than a test waits for (the tiny model samples some 20 per second here): a run of
# this length only ends within a test by being cancelled.
ENDLESS = 10_000


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo"), hidden_size=32)


def test_seeded_sampling_is_reproducible_and_logprobs_are_aligned(demo_model: Path) -> None:
    engine = LocalEngine(demo_model)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=7)
    first = asyncio.run(engine.generate([151644, 872, 198, 6023, 151645], params))
    again = asyncio.run(engine.generate([151644, 872, 198, 6023, 151645], params))
    assert first.output_ids == again.output_ids
    assert len(first.output_ids) == len(first.logprobs) <= 6
    assert all(lp <= 0.0 and math.isfinite(lp) for lp in first.logprobs)


def test_padding_ids_past_the_tokenizer_are_never_sampled(demo_model: Path, tmp_path: Path) -> None:
    """The demo model pads its 151,669 ids to 151,680 rows. Rows made to win every argmax (a pair
    +u/-u far longer than any other row: one of them scores highest for any hidden state) must
    still never be sampled, nor counted in a logprob."""
    import shutil
    from typing import cast

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(demo_model), dtype=torch.float32)
    weight = cast(torch.Tensor, model.get_input_embeddings().weight)  # tied to the output layer
    known = 151_669
    with torch.no_grad():
        direction = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0))
        scale = 1e4 * float(weight[:known].norm(dim=1).max()) / float(direction.norm())
        weight[known] = direction * scale
        weight[known + 1] = -direction * scale
    padded = tmp_path / "padded"
    model.save_pretrained(str(padded))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(demo_model / name, padded / name)
    engine = LocalEngine(padded)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=4, temperature=temperature, seed=3, top_logprobs=3)
        result = asyncio.run(engine.generate([151644, 872, 198, 6023, 151645], params))
        assert result.output_ids
        assert max(result.output_ids) < known, result.output_ids
        assert all(t < known for step in result.top_logprobs or [] for t, _ in step)


def test_a_tiny_temperature_samples_greedily_and_64_bit_seeds_are_all_honoured(demo_model: Path) -> None:
    engine = LocalEngine(demo_model)
    prompt = [151644, 872, 198, 6023, 151645]
    greedy = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0.0)))
    for tiny in (1e-7, 1e-38, 5e-324):  # logits / 1e-38 overflow float32
        tiny_run = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=tiny)))
        assert (tiny_run.output_ids, tiny_run.logprobs) == (greedy.output_ids, greedy.logprobs)
    # Seeds that agree in their low 32 bits (torch's CPU generator would keep only those) differ.
    runs = [
        asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed)))
        for seed in (1, 2**32 + 1, 5 * 2**32 + 1, -1, 2**63 - 1)
    ]
    assert len({tuple(run.output_ids) for run in runs}) == len(runs)


def test_greedy_stops_at_a_stop_token(demo_model: Path) -> None:
    engine = LocalEngine(demo_model)
    probe = asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0)))
    stop_at = probe.output_ids[1]
    result = asyncio.run(
        engine.generate(
            [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=(stop_at,))
        )
    )
    assert result.output_ids[-1] == stop_at
    assert result.finish.kind == "stop"
    assert result.finish.matched_token == stop_at


def test_proxy_serves_the_local_engine_end_to_end(demo_model: Path, tmp_path: Path) -> None:
    import httpx

    from proxy.app import create_app
    from proxy.config import Settings
    from tests.support import serve

    settings = Settings(engine="local", model=demo_model, db=f"sqlite:///{tmp_path / 'local.db'}")
    with serve(create_app(settings)) as url:
        messages = [{"role": "user", "content": "hello"}]
        first = httpx.post(
            f"{url}/sessions/l/v1/chat/completions",
            json={"model": "demo", "messages": messages, "max_tokens": 5, "seed": 1},
            timeout=60,
        )
        assert first.status_code == 200, first.text
        messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "again"}]
        second = httpx.post(
            f"{url}/sessions/l/v1/chat/completions",
            json={"model": "demo", "messages": messages, "max_tokens": 5},
            timeout=60,
        )
        assert second.status_code == 200, second.text
        [segment] = httpx.get(f"{url}/sessions/l/trajectory").json()["segments"]
    assert segment["num_calls"] == 2
    assert (
        sum(segment["loss_mask"])
        == first.json()["usage"]["completion_tokens"] + second.json()["usage"]["completion_tokens"]
    )
    assert len(segment["prompt_ids"]) + len(segment["response_ids"]) == (
        second.json()["usage"]["prompt_tokens"] + second.json()["usage"]["completion_tokens"]
    )


def test_local_engine_streams_its_turn(demo_model: Path, tmp_path: Path) -> None:
    import json

    import httpx

    from proxy.app import create_app
    from proxy.config import Settings
    from tests.support import serve

    settings = Settings(engine="local", model=demo_model, db=f"sqlite:///{tmp_path / 'stream.db'}")
    body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "seed": 3}
    with serve(create_app(settings)) as url:
        plain = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        text = ""
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
    # Same seed, same tokens: the streamed text is the plain answer.
    assert text == plain["choices"][0]["message"]["content"]
    assert text


def _prompt() -> list[int]:
    return [151644, 872, 198, 6023, 151645]


async def _next_generation_is_served(engine: LocalEngine) -> None:
    """The lock is free again: a two-token request finishes in seconds, not after the long run."""
    quick = SamplingParams(max_new_tokens=2, temperature=0.0)
    result = await asyncio.wait_for(engine.generate(_prompt(), quick), timeout=30)
    assert len(result.output_ids) == 2


def test_a_cancelled_request_stops_sampling_and_frees_the_lock(demo_model: Path) -> None:
    engine = LocalEngine(demo_model)

    async def scenario() -> None:
        endless = SamplingParams(max_new_tokens=ENDLESS, temperature=0.0)
        running = asyncio.create_task(engine.generate(_prompt(), endless))
        await asyncio.sleep(0.5)
        running.cancel()  # what a server does to the request of a client that left, or at shutdown
        with pytest.raises(asyncio.CancelledError):
            await running
        await _next_generation_is_served(engine)

    asyncio.run(scenario())


def test_abort_stops_a_stream_between_tokens_and_keeps_what_was_sampled(demo_model: Path) -> None:
    engine = LocalEngine(demo_model)

    async def scenario() -> None:
        endless = SamplingParams(max_new_tokens=ENDLESS, temperature=0.0)
        chunks = await engine.stream(_prompt(), endless, "req-1")
        sampled: list[int] = []
        finish = None
        async for chunk in chunks:
            sampled += chunk.output_ids
            assert len(chunk.output_ids) == len(chunk.logprobs)
            if len(sampled) == 2:
                await engine.abort("req-1")
            if chunk.finish is not None:
                finish = chunk.finish
        assert finish is not None
        assert finish.kind == "abort"
        assert 2 <= len(sampled) < 50
        await _next_generation_is_served(engine)

    asyncio.run(scenario())


def test_a_stream_streams_token_by_token(demo_model: Path) -> None:
    engine = LocalEngine(demo_model)

    async def scenario() -> list[list[int]]:
        chunks = await engine.stream(_prompt(), SamplingParams(max_new_tokens=4, temperature=0.0), "r")
        return [chunk.output_ids async for chunk in chunks]

    pieces = asyncio.run(scenario())
    assert [len(p) for p in pieces[:-1]] == [1] * (len(pieces) - 1)
    assert pieces[-1] == []  # the last chunk carries the finish reason only
    plain = asyncio.run(engine.generate(_prompt(), SamplingParams(max_new_tokens=4, temperature=0.0)))
    assert [t for p in pieces for t in p] == plain.output_ids


def test_a_request_without_max_tokens_gets_the_configured_bound(demo_model: Path, tmp_path: Path) -> None:
    import httpx

    from proxy.app import create_app
    from proxy.config import Settings
    from tests.support import serve

    settings = Settings(
        engine="local", model=demo_model, db=f"sqlite:///{tmp_path / 'b.db'}", local_max_new_tokens=3
    )
    body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "temperature": 0}
    with serve(create_app(settings)) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 3


def test_sigterm_ends_the_server_promptly_while_the_local_engine_samples(
    demo_model: Path, tmp_path: Path
) -> None:
    import signal
    import threading
    import time

    import httpx

    from tests.support import spawn_proxy

    args = ["--engine", "local", "--model", str(demo_model), "--db", f"sqlite:///{tmp_path / 's.db'}"]
    args += ["--local-max-new-tokens", str(ENDLESS), "--shutdown-grace-s", "1"]
    with spawn_proxy(args, {}, tmp_path / "proxy.log") as (process, url):
        body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "temperature": 0}

        def endless_turn() -> None:  # a plain turn: nothing but cancellation can end it early
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)

        threading.Thread(target=endless_turn, daemon=True).start()
        time.sleep(2.0)  # sampling by now
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        assert time.monotonic() - started < 15, (tmp_path / "proxy.log").read_text()
