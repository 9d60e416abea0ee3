"""tito-proxy: an OpenAI-compatible proxy that records the exact tokens an engine sampled."""

__version__ = "0.1.0"
