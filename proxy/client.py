"""Clients for trainers (sync and async): sessions, groups, rewards, exported samples, padded batches.

client = TitoClient("http://proxy:8000")          # or: async with AsyncTitoClient(...) as client
sid = client.create_session(metadata={"task": "swe-17"}, group_id="prompt-3", sample_index=0)
... the harness talks to f"http://proxy:8000/sessions/{sid}/v1" ...
client.reward(sid, 1.0); client.finish(sid)
for sample in client.iter_samples(consumer="trainer-a", whole_groups=True):
    ...
batch = to_batch(samples, pad_id=0)

Both clients send the same requests (proxy/client_protocol.py) and retry 429 and 503 answers,
waiting what Retry-After says.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Sequence
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import orjson

from proxy import client_protocol as protocol
from proxy.client_protocol import Branches, Call, ExportQuery, Mode, RetryPolicy, Status, TitoError

__all__ = ["AsyncTitoClient", "ExportQuery", "RetryPolicy", "TitoClient", "TitoError", "to_batch"]


def _key(admin_key: str | None) -> str | None:
    # The admin key, when the proxy runs with one (TITO_ADMIN_KEY is read if none is given).
    return admin_key if admin_key is not None else os.environ.get("TITO_ADMIN_KEY")


class TitoClient:
    def __init__(
        self,
        base_url: str,
        *,
        admin_key: str | None = None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        retry: RetryPolicy | None = None,
    ):
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            timeout=timeout,
            transport=transport,
            headers=protocol.auth_headers(_key(admin_key)),
        )
        self.retry = retry or RetryPolicy()

    def __enter__(self) -> TitoClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: Call) -> httpx.Response:
        attempt = 1
        while True:
            response = self._http.request(call.method, call.path, params=call.params, json=call.json)
            delay = self.retry.delay(response, attempt)
            if delay is None:
                return response
            time.sleep(delay)
            attempt += 1

    def _run(self, call: Call) -> Any:
        return protocol.result_of(call, self._send(call))

    def create_session(
        self,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        group_id: str | None = None,
        sample_index: int | None = None,
        group_size: int | None = None,
    ) -> str:
        """A new session; a GRPO group's members share `group_id` (its size in `group_size`)."""
        return str(
            self._run(protocol.create_session(session_id, metadata, group_id, sample_index, group_size))
        )

    def session(self, session_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._run(protocol.session(session_id))
        return result

    def reward(
        self, session_id: str, reward: float | None = None, call_rewards: dict[int, float] | None = None
    ) -> None:
        self._run(protocol.reward(session_id, reward, call_rewards))

    def trajectory(self, session_id: str, *, branches: Branches = "final") -> dict[str, Any]:
        """One session's branches; `branches="all"` adds the abandoned ones (each row says its `branch`)."""
        result: dict[str, Any] = self._run(protocol.trajectory(session_id, branches))
        return result

    def samples(self, session_id: str, mode: Mode = "stepwise", *, branches: Branches = "final") -> list[Any]:
        """One session's export rows (active or finished), as GET /export would give them."""
        result: list[Any] = self._run(protocol.samples(session_id, mode, branches))
        return result

    def finish(self, session_id: str) -> None:
        self._run(protocol.finish(session_id))

    def set_weight_version(self, version: str) -> None:
        self._run(protocol.set_weight_version(version))

    def ack(self, consumer: str, session_ids: Sequence[str]) -> int:
        return int(self._run(protocol.ack(consumer, session_ids)))

    def iter_samples(
        self,
        mode: Mode = "merged",
        *,
        consumer: str | None = None,
        ack: bool = False,
        after: int = 0,
        branches: Branches = "final",
        status: Status = "finished",
        session_ids: Sequence[str] | None = None,
        group_ids: Sequence[str] | None = None,
        whole_groups: bool = False,
        limit: int | None = None,
        min_weight_version: str | None = None,
    ) -> Generator[dict[str, Any], None, None]:
        """Exported rows as they stream, filtered as GET /export filters them. With ack, each
        session is acked once all its rows were yielded (with whole_groups, a group's sessions
        together once its last row was). `branches="all"` adds abandoned branches
        (superseded by a retry), flagged in `branch`."""
        query = ExportQuery(
            mode=mode,
            consumer=consumer,
            after=after,
            branches=branches,
            status=status,
            session_ids=session_ids,
            group_ids=group_ids,
            whole_groups=whole_groups,
            limit=limit,
            min_weight_version=min_weight_version,
        )
        tracker = protocol.AckTracker(consumer, ack, whole_groups)
        for row in self._stream_export(query):
            if done := tracker.before(row):
                self.ack(consumer or "", done)
            yield row
        if done := tracker.at_end():
            self.ack(consumer or "", done)

    def _stream_export(self, query: ExportQuery) -> Iterator[dict[str, Any]]:
        attempt = 1
        while True:
            with self._http.stream("GET", "/export", params=query.params()) as response:
                delay = self.retry.delay(response, attempt)
                if delay is None:
                    if response.status_code >= 400:
                        response.read()
                        protocol.result_of(Call("GET", "/export"), response)
                    for line in response.iter_lines():
                        if line:
                            yield orjson.loads(line)
                    return
            time.sleep(delay)
            attempt += 1


class AsyncTitoClient:
    """TitoClient for asyncio code (a trainer's generate loop): the same calls, awaited."""

    def __init__(
        self,
        base_url: str,
        *,
        admin_key: str | None = None,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
        retry: RetryPolicy | None = None,
    ):
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=timeout,
            transport=transport,
            headers=protocol.auth_headers(_key(admin_key)),
        )
        self.retry = retry or RetryPolicy()

    async def __aenter__(self) -> AsyncTitoClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: Call) -> httpx.Response:
        attempt = 1
        while True:
            response = await self._http.request(call.method, call.path, params=call.params, json=call.json)
            delay = self.retry.delay(response, attempt)
            if delay is None:
                return response
            await asyncio.sleep(delay)
            attempt += 1

    async def _run(self, call: Call) -> Any:
        return protocol.result_of(call, await self._send(call))

    async def create_session(
        self,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        group_id: str | None = None,
        sample_index: int | None = None,
        group_size: int | None = None,
    ) -> str:
        call = protocol.create_session(session_id, metadata, group_id, sample_index, group_size)
        return str(await self._run(call))

    async def session(self, session_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._run(protocol.session(session_id))
        return result

    async def reward(
        self, session_id: str, reward: float | None = None, call_rewards: dict[int, float] | None = None
    ) -> None:
        await self._run(protocol.reward(session_id, reward, call_rewards))

    async def trajectory(self, session_id: str, *, branches: Branches = "final") -> dict[str, Any]:
        result: dict[str, Any] = await self._run(protocol.trajectory(session_id, branches))
        return result

    async def samples(
        self, session_id: str, mode: Mode = "stepwise", *, branches: Branches = "final"
    ) -> list[Any]:
        result: list[Any] = await self._run(protocol.samples(session_id, mode, branches))
        return result

    async def finish(self, session_id: str) -> None:
        await self._run(protocol.finish(session_id))

    async def set_weight_version(self, version: str) -> None:
        await self._run(protocol.set_weight_version(version))

    async def ack(self, consumer: str, session_ids: Sequence[str]) -> int:
        return int(await self._run(protocol.ack(consumer, session_ids)))

    async def iter_samples(
        self,
        mode: Mode = "merged",
        *,
        consumer: str | None = None,
        ack: bool = False,
        after: int = 0,
        branches: Branches = "final",
        status: Status = "finished",
        session_ids: Sequence[str] | None = None,
        group_ids: Sequence[str] | None = None,
        whole_groups: bool = False,
        limit: int | None = None,
        min_weight_version: str | None = None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """TitoClient.iter_samples, as an async iterator."""
        query = ExportQuery(
            mode=mode,
            consumer=consumer,
            after=after,
            branches=branches,
            status=status,
            session_ids=session_ids,
            group_ids=group_ids,
            whole_groups=whole_groups,
            limit=limit,
            min_weight_version=min_weight_version,
        )
        tracker = protocol.AckTracker(consumer, ack, whole_groups)
        async for row in self._stream_export(query):
            if done := tracker.before(row):
                await self.ack(consumer or "", done)
            yield row
        if done := tracker.at_end():
            await self.ack(consumer or "", done)

    async def _stream_export(self, query: ExportQuery) -> AsyncIterator[dict[str, Any]]:
        attempt = 1
        while True:
            async with self._http.stream("GET", "/export", params=query.params()) as response:
                delay = self.retry.delay(response, attempt)
                if delay is None:
                    if response.status_code >= 400:
                        await response.aread()
                        protocol.result_of(Call("GET", "/export"), response)
                    async for line in response.aiter_lines():
                        if line:
                            yield orjson.loads(line)
                    return
            await asyncio.sleep(delay)
            attempt += 1


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
