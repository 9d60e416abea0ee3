"""The response of an export: its chunks streamed, the last one sent with the end of the body."""

from __future__ import annotations

from fastapi.responses import StreamingResponse
from starlette.types import Send


class ExportStream(StreamingResponse):
    """A streaming response that holds each chunk until the next one is made, so the last goes out
    with the end of the chunked body: uvicorn writes every message to the socket at once, and on
    loopback a write costs about what encoding a Parquet column does (the end alone was one more
    write per export). A chunk is held for one page at most."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        held: bytes | memoryview = b""
        async for chunk in self.body_iterator:
            if not chunk:
                continue
            if held:
                await send({"type": "http.response.body", "body": held, "more_body": True})
            held = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
        await send({"type": "http.response.body", "body": held, "more_body": False})
