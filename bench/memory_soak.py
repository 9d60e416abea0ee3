"""Resident memory of the served proxy over a few thousand varied requests: many sessions, tool round
trips, streams, retries, large bodies and bad ones. `python -m bench.memory_soak [--requests N]`
prints the proxy's RSS before, after, and after the load stops."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.harness import TOOLS, rss_mib, running_stack, tool_result


def _request(rng: random.Random, n: int) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The n-th request of the soak: a path, a JSON body and headers."""
    session = f"soak-{n % 1500}"  # sessions come back, so some turns continue a recorded one
    path = f"/sessions/{session}/v1/chat/completions"
    user = {"role": "user", "content": f"task {n}: " + "describe the repository " * rng.randint(1, 40)}
    body: dict[str, Any] = {"model": "m", "messages": [user], "tools": TOOLS, "max_tokens": 64}
    kind = n % 20
    if kind in (1, 2, 3):  # a tool round trip echoing a call
        call = {"id": f"call_{n}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
        body["messages"] = [
            user,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": tool_result(rng.randint(10, 400))},
        ]
    elif kind == 4:
        body["stream"] = True
    elif kind == 5:
        return path, body, {"Idempotency-Key": f"key-{n % 50}"}
    elif kind == 6:
        return path, body, {"x-stainless-retry-count": "1"}
    elif kind == 7:  # bad: unknown parameter, deep JSON, invalid role
        body[rng.choice(["logit_bias", "metadata", "messages"])] = (
            {"1": 2} if rng.random() < 0.3 else _deep(200) if rng.random() < 0.5 else [{"role": "x"}]
        )
    elif kind == 8 and n % 100 == 8:  # a multi-MB message, far past the context
        user["content"] = " ".join(f"w{i}" for i in range(rng.randint(200_000, 600_000)))
    elif kind == 9 and n % 100 == 9:  # a large tool result that fits
        user["content"] = tool_result(rng.randint(2_000, 8_000))
    return path, body, {}


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def _send(client: httpx.Client, url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    if body.get("stream"):
        with client.stream("POST", url + path, json=body, headers=headers) as response:
            for _ in response.iter_bytes():
                pass
            return response.status_code
    return client.post(url + path, content=json.dumps(body), headers=headers).status_code


def soak(requests: int, workers: int, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work, running_stack(Path(work)) as stack:
        rng = random.Random(seed)
        planned = [_request(rng, n) for n in range(requests)]
        headers = {"content-type": "application/json"}
        statuses: dict[int, int] = {}
        with httpx.Client(timeout=300, headers=headers) as client:
            _send(client, stack.proxy_url, *planned[0])  # warm: first render, first commit
            before = rss_mib(stack.proxy_pid)
            started = time.perf_counter()
            with ThreadPoolExecutor(workers) as pool:
                for status in pool.map(lambda r: _send(client, stack.proxy_url, *r), planned):
                    statuses[status] = statuses.get(status, 0) + 1
            elapsed = time.perf_counter() - started
            after = rss_mib(stack.proxy_pid)
            time.sleep(5)
            idle = rss_mib(stack.proxy_pid)
        return {
            "requests": requests,
            "seconds": round(elapsed, 1),
            "statuses": dict(sorted(statuses.items())),
            "rss_mib_before": before,
            "rss_mib_after": after,
            "rss_mib_idle": idle,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(soak(args.requests, args.workers, args.seed), indent=2))


if __name__ == "__main__":
    main()
