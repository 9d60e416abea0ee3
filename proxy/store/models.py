"""ORM tables. The schema itself lives in migrations/; tests check that the two never drift."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Index, Integer, LargeBinary, String, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from proxy.store.packed_json import PackedJSON


def _only_set(column: str) -> dict[str, Any]:
    """A partial index's condition, on both databases: the rows whose `column` has a value."""
    condition = text(f"{column} IS NOT NULL")
    return {"sqlite_where": condition, "postgresql_where": condition}


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}  # noqa: RUF012 - SQLAlchemy's API


class SessionRow(Base):
    __tablename__ = "sessions"
    __table_args__ = (
        Index("ix_sessions_status_updated", "status", "updated_at"),
        # One session per sample index of a group; also every lookup by group. Sessions in no group
        # are not in it: an entry per session would be a page written on every new session's commit.
        Index(
            "ux_sessions_group_sample",
            "group_id",
            "sample_index",
            unique=True,
            **_only_set("group_id"),
        ),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default="active")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The date chat templates see for this session, fixed at creation so the rendered base never shifts.
    template_now: Mapped[datetime] = mapped_column(DateTime(timezone=False))
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict, server_default="{}")
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # GRPO groups: the sessions sampled for one prompt share group_id; group_size says how many
    # there will be, so export can wait for the whole group.
    group_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    sample_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    group_size: Mapped[int | None] = mapped_column(Integer, nullable=True)


class FinishedRow(Base):
    """The order in which sessions finished: its sequence number is the export cursor."""

    __tablename__ = "finished_sessions"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), unique=True)


class ExportAckRow(Base):
    """A consumer has durably taken a session's export; it is not delivered to that consumer again."""

    __tablename__ = "export_acks"

    consumer: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True)
    acked_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


# The settings row of the trainer-set weight version (POST /admin/weight_version).
WEIGHT_VERSION_KEY = "weight_version"
# The settings row of the reasoning seals' secret when TITO_REASONING_SECRET is not set.
REASONING_SECRET_KEY = "reasoning_secret"
# The trainer's pause, shared by every process on the database (proxy/shared_pause.py).
PAUSE_KEY = "pause"


class SettingRow(Base):
    """Small deployment-wide values that must survive restarts and reach every process and replica
    (the trainer-set weight version, the reasoning seals' secret)."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class SegmentRow(Base):
    """A maximal run of calls whose prompts extend each other; its first call holds a fresh render."""

    __tablename__ = "segments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class CallRow(Base):
    """One engine call. Prompt ids are stored as the tokens added to the parent's prompt + output."""

    __tablename__ = "calls"
    __table_args__ = (
        Index("ix_calls_session_history", "session_id", "history_key"),
        # Only calls that carry the value: most turns have no Idempotency-Key or retry identity, and
        # every lookup names one (an entry per call was a page written on every commit).
        Index(
            "ix_calls_session_idempotency", "session_id", "idempotency_key", **_only_set("idempotency_key")
        ),
        # Hash first: an SDK retry without a session is found by its hash alone.
        Index("ix_calls_request_hash_session", "request_hash", "session_id", **_only_set("request_hash")),
        # Ids are never reused (processes cache contexts by call id): AUTOINCREMENT on SQLite.
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    segment_id: Mapped[int] = mapped_column(ForeignKey("segments.id", ondelete="CASCADE"), index=True)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("calls.id", ondelete="CASCADE"), nullable=True)
    depth: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    history_key: Mapped[str] = mapped_column(String(64))
    prompt_len: Mapped[int] = mapped_column(Integer)
    prompt_added: Mapped[bytes] = mapped_column(LargeBinary)
    output_ids: Mapped[bytes] = mapped_column(LargeBinary)
    output_logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    finish_reason: Mapped[str] = mapped_column(String(16))
    finish_detail: Mapped[dict[str, Any]] = mapped_column(JSON)
    boundary_edits: Mapped[list[Any]] = mapped_column(JSON)
    request: Mapped[dict[str, Any]] = mapped_column(PackedJSON)  # mostly message text: long ones deflated
    response_message: Mapped[dict[str, Any]] = mapped_column(JSON)
    sampling_params: Mapped[dict[str, Any]] = mapped_column(JSON)
    weight_version: Mapped[str | None] = mapped_column(String(128), nullable=True)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    engine_meta: Mapped[dict[str, Any]] = mapped_column(JSON)
    timings: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # What a retry of this request carries: its Idempotency-Key, and a hash of its body.
    idempotency_key: Mapped[str | None] = mapped_column(String(256), nullable=True)
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The LoRA adapter the call was sampled with (None: the base weights).
    adapter: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # The MoE experts each position was routed to (proxy/engines/routed_experts.py's packing).
    routed_experts: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)


class RetryClaimRow(Base):
    """A request identity (Idempotency-Key or body hash) one process is answering right now; its
    duplicates on other processes wait for the row to go, then replay the recorded answer."""

    __tablename__ = "retry_claims"

    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    name: Mapped[str] = mapped_column(String(300), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64))
    claimed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class EngineAffinityRow(Base):
    """The engine a session's turns go to, shared by every worker process (proxy/engines/pool.py)."""

    __tablename__ = "engine_affinity"

    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    engine_id: Mapped[str] = mapped_column(String(64))
    assigned_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RegisteredEngineRow(Base):
    """An engine added (POST /admin/engines) or removed (DELETE) at run time: every worker process
    follows these rows, and they hold across restarts."""

    __tablename__ = "registered_engines"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str] = mapped_column(String(2048))
    removed: Mapped[bool] = mapped_column(Boolean)
    changed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class SegmentSummaryRow(Base):
    """What exporting one branch (a segment path ending at a leaf call) needs beyond its calls' token
    blobs, as JSON: labels, per-call lists, boundary edits and the drift report under one drift mode.
    Computed once when the session finishes; export only reads it."""

    __tablename__ = "segment_summaries"

    leaf_call_id: Mapped[int] = mapped_column(ForeignKey("calls.id", ondelete="CASCADE"), primary_key=True)
    drift_mode: Mapped[str] = mapped_column(String(32), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    summary: Mapped[bytes] = mapped_column(LargeBinary)
