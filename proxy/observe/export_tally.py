"""What one export request delivered: counted into the metrics and logged as one line at its end."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from proxy.observe.metrics import Metrics

log = logging.getLogger("tito_proxy.export")


@dataclass
class ExportTally:
    metrics: Metrics
    mode: str
    format: str
    sessions: set[str] = field(default_factory=set)
    rows: int = 0
    size: int = 0  # bytes sent
    drift: Counter[str] = field(default_factory=Counter)

    async def rows_of(
        self, pages: AsyncIterator[list[dict[str, Any]]]
    ) -> AsyncIterator[list[dict[str, Any]]]:
        async for rows in pages:
            self.rows += len(rows)
            self.sessions.update(row["session_id"] for row in rows)
            for row in rows:
                self.drift.update((row.get("drift") or {}).get("counts", {}))
            self.metrics.export_rows.labels(self.mode).inc(len(rows))
            self.metrics.exported_drift(rows)
            yield rows

    async def bytes_of(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                self.size += len(chunk)
                yield chunk
        finally:
            self.metrics.export_bytes.labels(self.format).inc(self.size)
            log.info(
                "export mode=%s format=%s: %d sessions, %d rows, %d bytes, drift %s",
                self.mode,
                self.format,
                len(self.sessions),
                self.rows,
                self.size,
                dict(sorted(self.drift.items())),
            )
