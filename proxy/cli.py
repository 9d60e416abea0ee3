"""The `tito-proxy` command: serve, migrate, check-template, export, demo-model."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr, ValidationError

from proxy.chat.parsing import PARSER_NAMES

if TYPE_CHECKING:
    from proxy.config import Settings


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the proxy (flags override TITO_* environment variables)")
    serve.add_argument(
        "--engine", choices=["sglang", "vllm", "local"], help="inference engine (default sglang)"
    )
    serve.add_argument(
        "--engine-url",
        action="append",
        help="SGLang or vLLM base URL (default http://127.0.0.1:30000); repeat it, or separate URLs by "
        "commas, for several engines of one model; also TITO_ENGINE_URL",
    )
    serve.add_argument(
        "--engine-health-interval-s", type=float, help="seconds between engine health checks (default 5)"
    )
    serve.add_argument("--engine-api-key", help="vLLM's --api-key; also TITO_ENGINE_API_KEY")
    serve.add_argument(
        "--vllm-logprobs-mode",
        choices=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"],
        help="the --logprobs-mode vLLM runs with, where its /server_info cannot tell",
    )
    serve.add_argument(
        "--engine-timeout-s",
        type=float,
        help="seconds the engine may stay silent before or within its answer (default 600)",
    )
    serve.add_argument(
        "--model", type=Path, help="local model dir (local engine); its tokenizer is the default"
    )
    serve.add_argument(
        "--local-max-new-tokens",
        type=int,
        help="local engine: tokens sampled for a request without max_tokens (default 512)",
    )
    serve.add_argument(
        "--tokenizer",
        type=Path,
        help="Hugging Face tokenizer dir with a chat template, or a model id (org/name[@revision]) "
        "already in the local Hugging Face cache (never downloaded)",
    )
    serve.add_argument("--served-model-name", help="model name reported by /v1/models")
    serve.add_argument("--model-aliases", help="more names of the served model, comma-separated")
    serve.add_argument(
        "--strict-model-names",
        action="store_const",
        const=True,
        help="a model that is neither served, an alias nor a LoRA adapter is a 404 (default: base model)",
    )
    serve.add_argument(
        "--record-routed-experts",
        action="store_const",
        const=True,
        help="record the MoE experts each token was routed to (SGLang --enable-return-routed-experts)",
    )
    serve.add_argument(
        "--routed-experts-shape", help="LAYERS,TOP_K of the MoE model when its config.json is not found"
    )
    serve.add_argument("--context-length", type=int, help="override the engine's context length")
    serve.add_argument("--db", help="SQLAlchemy URL (default sqlite:///tito-proxy.db)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="text (default) or json: one object per line with request_id; also TITO_LOG_FORMAT",
    )
    serve.add_argument(
        "--access-log",
        action="store_const",
        const=True,
        help="log a line per request, at info (default off); also TITO_ACCESS_LOG",
    )
    serve.add_argument(
        "--history-mode",
        choices=["exact", "template"],
        help="exact: continue with the sampled tokens (default); template: a fresh render wins",
    )
    serve.add_argument(
        "--session-idle-timeout-s", type=float, help="finish sessions idle this long (default 3600)"
    )
    serve.add_argument(
        "--shutdown-grace-s",
        type=float,
        help="on SIGTERM, seconds turns in flight get to finish before they are cancelled (default 5)",
    )
    serve.add_argument(
        "--stream-keepalive-s", type=float, help="keepalive comment interval on silent streams (default 15)"
    )
    serve.add_argument(
        "--tool-parser",
        choices=["auto", *PARSER_NAMES],
        help="output format of tool calls (default: detected from the chat template)",
    )
    serve.add_argument("--api-key", help="key harnesses must send (Bearer) for /v1; also TITO_API_KEY")
    serve.add_argument(
        "--admin-key", help="key for sessions, trajectories, export and /admin; also TITO_ADMIN_KEY"
    )
    serve.add_argument(
        "--drift-report", choices=["strict", "ignore_strippable", "disable"], help="default strict"
    )
    serve.add_argument(
        "--workers",
        type=int,
        help="processes serving the port, sharing only the database (default 1); also TITO_WORKERS",
    )
    serve.add_argument(
        "--allow-unauthenticated",
        action="store_const",
        const=True,
        help="bind beyond loopback without both keys (refused otherwise); also TITO_ALLOW_UNAUTHENTICATED",
    )
    serve.add_argument(
        "--pause-mode", choices=["wait", "reject"], help="new turns while paused: wait (default) or 429"
    )
    serve.add_argument(
        "--pause-max-wait-s", type=float, help="longest wait at a pause, then 429 (default 300)"
    )
    serve.add_argument("--retry-after-s", type=float, help="Retry-After of 429 and 503 answers (default 5)")
    serve.add_argument(
        "--engine-restart-wait-s",
        type=float,
        help="continue generations lost to an engine restart back within this long (default 0: off)",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, help="larger request bodies are a 413 (default 33554432, 32 MiB)"
    )
    serve.add_argument(
        "--fast-bpe-after-tokens",
        type=int,
        help="tokens encoded before tiktoken is proven exact for the tokenizer (default 100000; 0: at "
        "start-up, -1: never)",
    )


def _settings_from(args: argparse.Namespace) -> Any:
    from proxy.config import Settings

    fields = (
        "engine",
        "engine_url",
        "engine_health_interval_s",
        "engine_timeout_s",
        "engine_api_key",
        "vllm_logprobs_mode",
        "model",
        "local_max_new_tokens",
        "tokenizer",
        "served_model_name",
        "model_aliases",
        "strict_model_names",
        "record_routed_experts",
        "routed_experts_shape",
        "context_length",
        "db",
        "host",
        "port",
        "log_level",
        "log_format",
        "access_log",
        "history_mode",
        "drift_report",
        "tool_parser",
        "session_idle_timeout_s",
        "shutdown_grace_s",
        "stream_keepalive_s",
        "api_key",
        "admin_key",
        "allow_unauthenticated",
        "pause_mode",
        "pause_max_wait_s",
        "retry_after_s",
        "engine_restart_wait_s",
        "max_body_bytes",
        "fast_bpe_after_tokens",
        "workers",
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

    from proxy.api.one_send import OneSendHttpToolsProtocol
    from proxy.app import create_app
    from proxy.observe.logs import configure

    configure(settings.log_level, settings.log_format)
    common: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        # uvicorn's own loggers (access lines included) go through the root handler, in its format.
        "log_config": None,
        # Off unless asked: a line per turn costs more CPU than the turn's whole HTTP handling.
        "access_log": settings.access_log,
        # Turns in flight may finish; then they are cancelled (the local engine stops between tokens).
        "timeout_graceful_shutdown": settings.shutdown_grace_s,
        # A response's head and body in one socket write (proxy/api/one_send.py).
        "http": OneSendHttpToolsProtocol,
    }
    if settings.workers == 1:
        uvicorn.run(create_app(settings), **common)
        return 0
    from proxy.store.database import upgrade_blocking

    # Migrated once here, so that the workers' start-ups find the schema at head and change nothing.
    upgrade_blocking(settings.db)
    # Workers are fresh processes: they build their settings from TITO_* as this process resolved them.
    os.environ.update(worker_environment(settings))
    uvicorn.run("proxy.app:app_from_env", factory=True, workers=settings.workers, **common)
    return 0


def worker_environment(settings: Settings) -> dict[str, str]:
    """The TITO_* variables of `--workers` processes: these settings. Without a configured reasoning
    secret they all read the one kept in the database (see app._stored_secret), as replicas do."""
    return settings_environment(settings)


def settings_environment(settings: Settings) -> dict[str, str]:
    """TITO_* variables that give a worker process these very settings."""
    env = {}
    for name in settings.model_fields_set:
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        env[f"TITO_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


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

    from proxy.chat.call_format import choose_parser
    from proxy.chat.renderer import Renderer
    from proxy.chat.tokenizer import load_tokenizer_files
    from proxy.errors import ProxyError

    try:
        renderer = Renderer(load_tokenizer_files(args.tokenizer))
    except ProxyError as exc:
        print(f"tito-proxy check-template: {exc.message}", file=sys.stderr)
        return 2
    _, report = choose_parser(renderer, args.tool_parser)
    print(json.dumps({**renderer.verdict.as_json(), "tool_parser": report.as_json()}, indent=2))
    if report.warning:
        print(f"tito-proxy check-template: warning: tool calls: {report.warning}", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    """Stream GET /export into a file with a progress bar; with --ack, ack what was written."""
    import httpx

    from proxy.client_protocol import ExportQuery

    params = ExportQuery(
        mode=args.mode,
        consumer=args.consumer or None,
        after=args.after,
        branches=args.branches,
        status=args.status,
        # An empty list is a filter that matches nothing, as on the route: never a wider export.
        session_ids=args.session_ids.split(",") if args.session_ids is not None else None,
        group_ids=args.group_ids.split(",") if args.group_ids is not None else None,
        whole_groups=args.whole_groups,
        limit=args.limit,
        min_weight_version=args.min_weight_version,
    ).params(args.format)
    written = 0
    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    with httpx.stream(
        "GET", f"{args.url.rstrip('/')}/export", params=params, timeout=None, headers=headers
    ) as response:
        if response.status_code != 200:
            response.read()
            print(f"tito-proxy export: HTTP {response.status_code}: {response.text}", file=sys.stderr)
            return 1
        with args.out.open("wb") as sink, _progress(args.out.name) as bar:
            for chunk in response.iter_bytes():
                sink.write(chunk)
                written += len(chunk)
                bar(len(chunk))
        # The file is on disk before anything is acked: a crash here re-delivers, never loses.
        import os

        with args.out.open("rb") as sink:
            os.fsync(sink.fileno())
    session_ids = _exported_sessions(args.out, args.format)
    print(f"wrote {written} bytes, {len(session_ids)} sessions to {args.out}")
    if args.ack and session_ids:
        acked = httpx.post(
            f"{args.url.rstrip('/')}/export/ack",
            json={"consumer": args.consumer, "session_ids": session_ids},
            timeout=60,
            headers=headers,
        )
        acked.raise_for_status()
        print(f"acked {acked.json()['acked']} sessions for consumer {args.consumer!r}")
    return 0


def _exported_sessions(path: Path, fmt: str) -> list[str]:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        column = pq.read_table(path, columns=["session_id"]).column("session_id").to_pylist()
        return list(dict.fromkeys(column))
    import orjson

    with path.open("rb") as lines:
        return list(dict.fromkeys(orjson.loads(line)["session_id"] for line in lines if line.strip()))


def _progress(label: str) -> Any:
    """A byte-counting progress bar on stderr."""
    from contextlib import contextmanager

    from tqdm import tqdm

    @contextmanager
    def bar() -> Any:
        with tqdm(unit="B", unit_scale=True, desc=label, file=sys.stderr) as progress:
            yield progress.update

    return bar()


def _show(args: argparse.Namespace) -> int:
    """Print one path of a session with the viewer's colouring."""
    import httpx

    from proxy.observe.terminal import pick_path, render

    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    base = f"{args.url.rstrip('/')}/ui/api/sessions/{args.session_id}"
    with httpx.Client(headers=headers, timeout=120) as client:
        detail = client.get(base)
        if detail.status_code != 200:
            print(f"tito-proxy show: HTTP {detail.status_code}: {detail.text}", file=sys.stderr)
            return 1
        try:
            path = pick_path(detail.json(), args.segment)
        except LookupError as exc:
            print(f"tito-proxy show: {exc}", file=sys.stderr)
            return 1
        tokens = client.get(f"{base}/tokens", params={"path": path})
        tokens.raise_for_status()
    sys.stdout.write(render(tokens.json()))
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
    export = sub.add_parser("export", help="download finished trajectories to JSONL or Parquet")
    export.add_argument("--url", default="http://127.0.0.1:8000", help="the proxy's base URL")
    export.add_argument("--mode", choices=["merged", "stepwise"], default="merged")
    export.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--after", type=int, default=0, help="export cursor to start after")
    export.add_argument(
        "--branches",
        choices=["final", "all"],
        default="final",
        help="all: also branches a retry superseded (abandoned), flagged in the branch column",
    )
    export.add_argument("--status", choices=["finished", "active", "all"], default="finished")
    export.add_argument("--session-ids", help="only these sessions (comma-separated)")
    export.add_argument("--group-ids", help="only these groups (comma-separated)")
    export.add_argument(
        "--whole-groups", action="store_true", help="only groups whose sessions all finished, group by group"
    )
    export.add_argument("--limit", type=int, help="at most this many sessions (groups with --whole-groups)")
    export.add_argument(
        "--min-weight-version", help="leave out sessions with a call sampled by older weights"
    )
    export.add_argument("--consumer", help="deliver only sessions this consumer has not acked")
    export.add_argument("--ack", action="store_true", help="ack the written sessions (needs --consumer)")
    export.add_argument(
        "--admin-key", default=os.environ.get("TITO_ADMIN_KEY"), help="the proxy's admin key (TITO_ADMIN_KEY)"
    )
    show = sub.add_parser(
        "show", help="print a session's segment in the terminal, coloured by mask and logprob"
    )
    show.add_argument("session_id")
    show.add_argument("--url", default="http://127.0.0.1:8000", help="the proxy's base URL")
    show.add_argument("--segment", type=int, help="segment id (default: the session's first)")
    show.add_argument(
        "--admin-key", default=os.environ.get("TITO_ADMIN_KEY"), help="the proxy's admin key (TITO_ADMIN_KEY)"
    )
    check = sub.add_parser("check-template", help="run the chat-template self-test and print its verdict")
    check.add_argument("--tokenizer", type=Path, required=True)
    check.add_argument(
        "--tool-parser",
        choices=["auto", *PARSER_NAMES],
        default="auto",
        help="the tool parser to check against the template (default: detected from it)",
    )
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
    if args.command == "export" and args.ack and not args.consumer:
        parser.error("--ack needs --consumer")
    if args.command in ("show", "export"):
        return _as_client(args)
    return _demo_model(args)


def _as_client(args: argparse.Namespace) -> int:
    """`show` or `export` against a running proxy: a proxy out of reach, a bad URL or an output
    file that cannot be written is a one-line error, not a traceback."""
    import httpx

    try:
        return _show(args) if args.command == "show" else _export(args)
    except httpx.InvalidURL as exc:
        print(f"tito-proxy {args.command}: bad --url {args.url!r}: {exc}", file=sys.stderr)
    except httpx.UnsupportedProtocol:
        print(f"tito-proxy {args.command}: --url {args.url!r} is not an http(s) URL", file=sys.stderr)
    except httpx.HTTPError as exc:
        print(f"tito-proxy {args.command}: cannot reach the proxy at {args.url}: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"tito-proxy {args.command}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
