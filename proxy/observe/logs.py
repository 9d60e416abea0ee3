"""Log setup: every record carries the request and session ids; text or one JSON object per line."""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

from proxy.observe import context

LogFormat = Literal["text", "json"]
# `ids`: the request id, then `session=ID` when the request names a session (TextFormatter).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(ids)s]: %(message)s"
# A session id from a path may be any text: one that is not printable ASCII without spaces, `"` and
# `]` is written quoted and escaped, so that it cannot end the bracket or the line.
_PLAIN = re.compile(r"^[\x21\x23-\x5c\x5e-\x7e]+$")
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


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT: `[REQUEST_ID session=SESSION_ID]` (`[-]` outside a request)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        ids = getattr(record, "request_id", "-")
        session_id = getattr(record, "session_id", None)
        if session_id:
            shown = session_id if _PLAIN.match(session_id) else orjson.dumps(session_id).decode()
            ids = f"{ids} session={shown}"
        record.ids = ids
        return super().format(record)


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
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
