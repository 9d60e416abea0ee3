"""Log setup: every record carries the request and session ids; text or one JSON object per line."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

from proxy.observe import context

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
_base_factory = logging.getLogRecordFactory()


def _record_with_ids(*args: Any, **kwargs: Any) -> logging.LogRecord:
    record = _base_factory(*args, **kwargs)
    record.request_id = context.request_id.get() or "-"
    record.session_id = context.session_id.get()
    return record


def install_record_ids() -> None:
    """Every log record gets `request_id` and `session_id` (idempotent; a record factory rather than
    a handler filter, so that records reach every handler, pytest's too, with the ids)."""
    if logging.getLogRecordFactory() is not _record_with_ids:
        logging.setLogRecordFactory(_record_with_ids)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, session_id (when known)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "-")
        if request_id != "-":
            entry["request_id"] = request_id
        session_id = getattr(record, "session_id", None)
        if session_id:
            entry["session_id"] = session_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def configure(level: str, log_format: LogFormat) -> None:
    """The root handler for `tito-proxy serve`; uvicorn's loggers propagate to it."""
    install_record_ids()
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
