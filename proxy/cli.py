"""The `tito-proxy` command: serve, migrate, check-template, demo-model."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the proxy (flags override TITO_* environment variables)")
    serve.add_argument("--engine", choices=["sglang", "local"], help="inference engine (default sglang)")
    serve.add_argument("--engine-url", help="SGLang base URL (default http://127.0.0.1:30000)")
    serve.add_argument(
        "--engine-timeout-s", type=float, help="seconds to wait for one engine call (default 600)"
    )
    serve.add_argument(
        "--model", type=Path, help="local model dir (local engine); its tokenizer is the default"
    )
    serve.add_argument("--tokenizer", type=Path, help="local Hugging Face tokenizer dir with a chat template")
    serve.add_argument("--served-model-name", help="model name reported by /v1/models")
    serve.add_argument("--context-length", type=int, help="override the engine's context length")
    serve.add_argument("--db", help="SQLAlchemy URL (default sqlite:///tito-proxy.db)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--history-mode",
        choices=["exact", "template"],
        help="exact: continue with the sampled tokens (default); template: a fresh render wins",
    )
    serve.add_argument(
        "--tool-parser",
        choices=[
            "auto",
            "hermes",
            "qwen3_coder",
            "glm45",
            "llama3_json",
            "deepseek_v3",
            "mistral",
            "gpt_oss",
        ],
        help="output format of tool calls (default: detected from the chat template)",
    )
    serve.add_argument(
        "--drift-report", choices=["strict", "ignore_strippable", "disable"], help="default strict"
    )


def _settings_from(args: argparse.Namespace) -> Any:
    from proxy.config import Settings

    fields = (
        "engine",
        "engine_url",
        "engine_timeout_s",
        "model",
        "tokenizer",
        "served_model_name",
        "context_length",
        "db",
        "host",
        "port",
        "log_level",
        "history_mode",
        "drift_report",
        "tool_parser",
    )
    given = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    return Settings(**given)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = _settings_from(args)
    except ValidationError as exc:
        for error in exc.errors():
            print(f"tito-proxy serve: {error['msg']}", file=sys.stderr)
        return 2
    import uvicorn

    from proxy.app import create_app

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from proxy.config import Settings
    from proxy.store.database import upgrade_blocking

    url = args.db or Settings.model_fields["db"].get_default()
    if args.db is None:
        import os

        url = os.environ.get("TITO_DB", url)
    upgrade_blocking(url)
    return 0


def _check_template(args: argparse.Namespace) -> int:
    import json

    from proxy.chat.renderer import Renderer
    from proxy.chat.tokenizer import load_tokenizer_files
    from proxy.errors import ProxyError

    try:
        renderer = Renderer(load_tokenizer_files(args.tokenizer))
    except ProxyError as exc:
        print(f"tito-proxy check-template: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(renderer.verdict.as_json(), indent=2))
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from proxy.demo_model import build_demo_model

    target = build_demo_model(args.directory, seed=args.seed)
    print(f"wrote a DUMMY random-weight model (real Qwen3 tokenizer) to {target}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tito-proxy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    migrate = sub.add_parser("migrate", help="apply the database migrations and exit (serve does it too)")
    migrate.add_argument("--db", help="SQLAlchemy URL (default: TITO_DB, else sqlite:///tito-proxy.db)")
    check = sub.add_parser("check-template", help="run the chat-template self-test and print its verdict")
    check.add_argument("--tokenizer", type=Path, required=True)
    demo = sub.add_parser("demo-model", help="build a tiny random-weight Qwen3 model offline (needs [local])")
    demo.add_argument("directory", type=Path)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "migrate":
        return _migrate(args)
    if args.command == "check-template":
        return _check_template(args)
    return _demo_model(args)


if __name__ == "__main__":
    raise SystemExit(main())
