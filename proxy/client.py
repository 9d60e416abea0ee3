"""A small client for trainers: sessions, rewards, exported samples, and padded batches.

client = TitoClient("http://proxy:8000")
sid = client.create_session(metadata={"task": "swe-17"})
... the harness talks to f"http://proxy:8000/sessions/{sid}/v1" ...
client.reward(sid, 1.0); client.finish(sid)
for sample in client.iter_samples(consumer="trainer-a", ack=True):
    ...
batch = to_batch(samples, pad_id=0)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import httpx
import numpy as np
import numpy.typing as npt
import orjson


class TitoError(RuntimeError):
    """The proxy answered with an error envelope."""


class TitoClient:
    def __init__(
        self,
        base_url: str,
        *,
        admin_key: str | None = None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ):
        # The admin key, when the proxy runs with one (TITO_ADMIN_KEY is read if none is given).
        key = admin_key if admin_key is not None else os.environ.get("TITO_ADMIN_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, transport=transport, headers=headers
        )

    def __enter__(self) -> TitoClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _json(self, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise TitoError(f"HTTP {response.status_code}: {message}")
        return response.json() if response.content else None

    def create_session(self, session_id: str | None = None, metadata: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"metadata": metadata or {}}
        if session_id is not None:
            body["id"] = session_id
        return str(self._json(self._http.post("/sessions", json=body))["id"])

    def session(self, session_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json(self._http.get(f"/sessions/{session_id}"))
        return result

    def reward(
        self, session_id: str, reward: float | None = None, call_rewards: dict[int, float] | None = None
    ) -> None:
        body: dict[str, Any] = {"reward": reward}
        if call_rewards:
            body["call_rewards"] = {str(k): v for k, v in call_rewards.items()}
        self._json(self._http.post(f"/sessions/{session_id}/reward", json=body))

    def trajectory(self, session_id: str, *, branches: Literal["final", "all"] = "final") -> dict[str, Any]:
        """One session's branches; `branches="all"` adds the abandoned ones (each row says its `branch`)."""
        result: dict[str, Any] = self._json(
            self._http.get(f"/sessions/{session_id}/trajectory", params={"branches": branches})
        )
        return result

    def finish(self, session_id: str) -> None:
        self._json(self._http.post(f"/sessions/{session_id}/finish"))

    def set_weight_version(self, version: str) -> None:
        self._json(self._http.post("/admin/weight_version", json={"weight_version": version}))

    def ack(self, consumer: str, session_ids: Sequence[str]) -> int:
        return int(
            self._json(
                self._http.post("/export/ack", json={"consumer": consumer, "session_ids": list(session_ids)})
            )["acked"]
        )

    def iter_samples(
        self,
        mode: str = "merged",
        *,
        consumer: str | None = None,
        ack: bool = False,
        after: int = 0,
        branches: Literal["final", "all"] = "final",
    ) -> Iterator[dict[str, Any]]:
        """Exported rows as they stream. With ack, each session is acked once all its rows were yielded.
        `branches="all"` adds abandoned branches (superseded by a retry), flagged in `branch`."""
        params: dict[str, Any] = {"mode": mode, "format": "jsonl", "after": after, "branches": branches}
        if consumer is not None:
            params["consumer"] = consumer
        if ack and consumer is None:
            raise ValueError("ack needs a consumer name")
        pending: str | None = None
        with self._http.stream("GET", "/export", params=params) as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            for line in response.iter_lines():
                if not line:
                    continue
                row: dict[str, Any] = orjson.loads(line)
                if ack and pending is not None and row["session_id"] != pending:
                    self.ack(consumer or "", [pending])
                pending = row["session_id"]
                yield row
        if ack and pending is not None:
            self.ack(consumer or "", [pending])


def to_batch(
    samples: Sequence[dict[str, Any]], *, pad_id: int = 0, max_length: int | None = None
) -> dict[str, npt.NDArray[Any]]:
    """Right-padded arrays: input_ids, attention_mask, loss_mask (0 on the prompt), logprobs."""
    sequences = [s["prompt_ids"] + s["response_ids"] for s in samples]
    width = max((len(s) for s in sequences), default=0)
    if max_length is not None:
        if width > max_length:
            raise ValueError(f"a sample has {width} tokens, more than max_length={max_length}")
        width = max_length
    count = len(samples)
    input_ids = np.full((count, width), pad_id, dtype=np.int64)
    attention = np.zeros((count, width), dtype=np.int8)
    loss = np.zeros((count, width), dtype=np.int8)
    logprobs = np.zeros((count, width), dtype=np.float32)
    for row, (sample, sequence) in enumerate(zip(samples, sequences, strict=True)):
        start = len(sample["prompt_ids"])
        input_ids[row, : len(sequence)] = sequence
        attention[row, : len(sequence)] = 1
        loss[row, start : len(sequence)] = sample["loss_mask"]
        logprobs[row, start : len(sequence)] = sample["rollout_logprobs"]
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss, "logprobs": logprobs}
