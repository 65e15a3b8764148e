"""`python -m sandbox serve [--host H] [--port P] [--token T] [--config FILE] [options]`.

Values come from, in increasing precedence: the defaults in `ServerSettings`/`PoolSettings`/`Limits`,
the YAML `--config` file (same keys, `pool:` and `pool.limits:` nested), the `SANDBOX_TOKEN`
environment variable, and the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pydantic
import yaml

from sandbox.app import ServerSettings, create_app
from sandbox.isolation import detect_isolation

# flag -> (section path, key) in ServerSettings
FLAGS = {
    "host": ((), "host"),
    "port": ((), "port"),
    "token": ((), "token"),
    "max_running": ((), "max_running"),
    "max_waiting": ((), "max_waiting"),
    "max_sessions": ((), "max_sessions"),
    "session_idle_s": ((), "session_idle_s"),
    "pool_size": (("pool",), "pool_size"),
    "max_kernels": (("pool",), "max_kernels"),
    "isolation": (("pool",), "isolation"),
    "default_timeout_s": (("pool",), "default_timeout_s"),
    "max_timeout_s": (("pool",), "max_timeout_s"),
    "output_limit_chars": (("pool",), "output_limit_chars"),
    "memory_mb": (("pool", "limits"), "memory_mb"),
    "processes": (("pool", "limits"), "processes"),
    "file_size_mb": (("pool", "limits"), "file_size_mb"),
    "open_files": (("pool", "limits"), "open_files"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sandbox", description="Python execution sandbox service")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--config", type=Path, help="YAML file with ServerSettings keys")
    serve.add_argument("--host", help="bind address (default 127.0.0.1; others need a token)")
    serve.add_argument("--port", type=int, help="port (default 8765)")
    serve.add_argument("--token", help="access token (default: $SANDBOX_TOKEN)")
    serve.add_argument("--require-isolation", action="store_true", help="refuse to start without namespaces")
    serve.add_argument("--isolation", choices=["auto", "namespaces", "process"])
    for name in FLAGS:
        if name in {"host", "port", "token", "isolation"}:
            continue
        serve.add_argument(f"--{name.replace('_', '-')}", type=float if name.endswith("_s") else int)
    return parser


def load_settings(args: argparse.Namespace) -> ServerSettings:
    data: dict = {}
    if args.config:
        try:
            data = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise SystemExit(f"sandbox: cannot read config {args.config}: {exc}") from None
        if not isinstance(data, dict):
            raise SystemExit(f"sandbox: {args.config}: the top level must be a mapping")
    if os.environ.get("SANDBOX_TOKEN") and args.token is None:
        data["token"] = os.environ["SANDBOX_TOKEN"]
    for name, (path, key) in FLAGS.items():
        value = getattr(args, name, None)
        if value is not None:
            node = data
            for part in path:
                node = node.setdefault(part, {})
            node[key] = value
    if args.require_isolation:
        data["require_isolation"] = True
    try:
        return pydantic.TypeAdapter(ServerSettings).validate_python(data)
    except pydantic.ValidationError as exc:
        where = f" in {args.config}" if args.config else ""
        lines = [f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()]
        raise SystemExit(f"sandbox: invalid settings{where}:\n  " + "\n  ".join(lines)) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = load_settings(args)
    if settings.require_isolation:
        if settings.pool.isolation == "process":
            raise SystemExit("sandbox: --require-isolation contradicts --isolation process")
        try:
            detect_isolation("namespaces")
        except RuntimeError as exc:
            raise SystemExit(f"sandbox: --require-isolation: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    shown = dataclasses.replace(settings, token="***" if settings.token else "")
    logging.getLogger("sandbox").info("starting with %s", shown)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
