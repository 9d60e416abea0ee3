"""Observability: request ids, structured logs, Prometheus metrics and the trajectory viewer."""
