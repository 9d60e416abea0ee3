"""FastAPI's own OpenTelemetry instrumentation: on where a provider is configured as the app is built."""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI

# OpenTelemetry's stand-ins until a provider is set: nothing would receive what FastAPI records.
_UNCONFIGURED = frozenset({"ProxyTracerProvider", "_ProxyMeterProvider", "ProxyLoggerProvider"})
OFF = {"tracing": False, "metrics": False, "logs": False}


def fastapi_telemetry() -> dict[str, Any]:
    """FastAPI's `telemetry=` argument: FastAPI's defaults when a tracer, meter or logger provider is
    configured (opentelemetry-instrument, an SDK set up before the app), else off. Left on with none,
    FastAPI asks OpenTelemetry for one on every request (~40 µs a turn, mostly environment lookups).
    Empty where FastAPI has no such option (before 0.16x)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    from opentelemetry import _logs, metrics, trace

    providers = (trace.get_tracer_provider(), metrics.get_meter_provider(), _logs.get_logger_provider())
    if any(type(provider).__name__ not in _UNCONFIGURED for provider in providers):
        return {}
    return {"telemetry": OFF}
