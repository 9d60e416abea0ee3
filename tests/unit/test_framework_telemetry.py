"""FastAPI's own OpenTelemetry instrumentation is off unless a provider is configured."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from opentelemetry import trace

from proxy.observe.framework_telemetry import OFF, fastapi_telemetry


def test_without_a_provider_requests_never_ask_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fastapi_telemetry() == {"telemetry": OFF}
    app = FastAPI(**fastapi_telemetry())

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    asked = []
    real = trace.get_tracer_provider

    def counted() -> Any:
        asked.append(1)
        return real()

    monkeypatch.setattr(trace, "get_tracer_provider", counted)
    with TestClient(app) as client:
        for _ in range(3):
            assert client.get("/ping").json() == {"pong": "yes"}
    assert asked == []


def test_a_configured_provider_keeps_fastapis_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    class SdkTracerProvider(trace.TracerProvider):
        def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
            return trace.NoOpTracer()

    monkeypatch.setattr(trace, "get_tracer_provider", SdkTracerProvider)
    assert fastapi_telemetry() == {}
