"""The built-in CPU engine on a tiny random-weight model built offline."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from proxy.demo_model import build_demo_model
from proxy.engines.base import SamplingParams
from proxy.engines.local import LocalEngine


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
