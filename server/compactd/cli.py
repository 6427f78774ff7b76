"""The ``compactd`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence

from compactd import __version__, config, logs
from compactd.errors import ConfigError, StartupError

#: Exit codes: a bad setting (the message names it), and a start refused by the environment
#: (the port is in use, another process owns the store).
EXIT_CONFIG = 2
EXIT_STARTUP = 3

log = logging.getLogger("compactd.config")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (every command and option documented in ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="compactd",
        description="compactd keeps long-running LLM agent conversations working near the "
        "context limit: an append-only session log, the model-visible surface, token pressure "
        "and auditable compaction, over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"compactd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the gRPC service",
        description="Run the gRPC service until SIGTERM/SIGINT, then shut down gracefully. "
        "Every setting can also come from the environment (COMPACTD_LISTEN, COMPACTD_STORE, "
        "COMPACTD_SUMMARIZER__KIND, ...) or the TOML file; flags win over the environment, "
        "which wins over the file. Unknown COMPACTD_* variables are warned about and ignored. "
        "Exits 2 on a bad setting, 3 when the address is in use or another compactd owns the "
        "store.",
    )
    _config_option(serve)
    serve.add_argument("--listen", help="HOST:PORT to bind (default 127.0.0.1:50051)")
    serve.add_argument(
        "--store",
        help="event store URL: sqlite:///PATH, postgresql://... or memory:// "
        "(default sqlite:///./compactd.db)",
    )
    serve.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    serve.add_argument("--log-format", choices=("json", "text"), help="log format (default json)")
    serve.add_argument(
        "--metrics-listen", help="HOST:PORT of a Prometheus /metrics endpoint (default: none)"
    )
    serve.add_argument(
        "--migrate",
        action="store_const",
        const=True,
        dest="store_migrate",
        help="apply pending PostgreSQL schema migrations before serving",
    )
    migrate = commands.add_parser(
        "migrate",
        help="bring the store's schema up to this version",
        description="Apply every pending schema migration to the store (PostgreSQL: under an "
        "advisory lock, so replicas may run it together), print the version reached and exit "
        "0. A replica refuses to serve a schema older or newer than its own; run this (or "
        "`serve --migrate`) before starting upgraded replicas. Exits 3 when the database "
        "cannot be reached or was migrated by a newer compactd.",
    )
    _config_option(migrate)
    migrate.add_argument("--store", help="event store URL (postgresql://... or sqlite:///PATH)")
    check = commands.add_parser(
        "check-config",
        help="validate the configuration and print it as TOML",
        description="Load and validate the configuration exactly as `serve` would (the TLS, "
        "tokens and JWKS files read; nothing bound, the store not opened); print the effective "
        "configuration as TOML (defaults filled in, built-in routes included) and exit 0, or "
        "print the error naming the bad key and exit 2.",
    )
    _config_option(check)
    commands.add_parser(
        "config-schema",
        help="print the JSON Schema of the configuration file",
        description="Print the JSON Schema of compactd.toml, for editors (taplo, VS Code, "
        "JetBrains): save it and point the file at it with a `#:schema` first line.",
    )
    _inspect_command(commands)
    from compactd import replay_command  # issue 14: replay

    replay_command.add_parser(commands)
    return parser


def _inspect_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from compactd.inspect import MODES

    inspect = commands.add_parser(
        "inspect",
        help="show a session of a running service: log, surface, brackets, pressure, plan",
        description="Show one session of a running compactd: the log beside the surface (seq, "
        "position, type, price, shadowed-by), each bracket as one row, the current pressure, "
        "the plan of the next compaction (nothing is appended; `--mode switch --to "
        "PROVIDER/MODEL` plans a switch to that route) and the rebuilt request. Exits 2 on a "
        "bad option, 1 when the service refuses (an unknown session, say).",
    )
    inspect.add_argument("session", metavar="SESSION", help="the session id")
    inspect.add_argument(
        "--address",
        default=os.environ.get("COMPACTD_ADDRESS", "127.0.0.1:50051"),
        help="HOST:PORT of the service (also COMPACTD_ADDRESS; default 127.0.0.1:50051)",
    )
    inspect.add_argument(
        "--token",
        default=os.environ.get("COMPACTD_TOKEN", ""),
        help="bearer token of a service with auth_tokens (also COMPACTD_TOKEN)",
    )
    inspect.add_argument(
        "--tls-ca", metavar="FILE", help="CA certificate (PEM) to verify a TLS listener with"
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead")
    inspect.add_argument(
        "--follow", action="store_true", help="then stream new events and pressure (Ctrl-C stops)"
    )
    inspect.add_argument(
        "--mode", choices=MODES, default="auto", help="the compaction to plan (default auto)"
    )
    inspect.add_argument(
        "--to",
        metavar="PROVIDER/MODEL",
        help="the route to plan for: the destination of --mode switch (required there); with "
        "auto, the step's intended route (another than the logged one plans the switch)",
    )


def _inspect(args: argparse.Namespace) -> int:
    from compactd import inspect

    try:
        to = _destination(args.mode, args.to)
        tls_ca = _read_tls_ca(args.tls_ca)
    except ConfigError as error:
        print(f"compactd inspect: {error.message}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return asyncio.run(
            inspect.run(
                args.address, args.session, as_json=args.json, follow=args.follow,
                mode=args.mode, to=to, token=args.token, tls_ca=tls_ca, out=sys.stdout,
            )
        )  # fmt: skip
    except KeyboardInterrupt:
        return 0


def _destination(mode: str, to: str | None) -> tuple[str, str] | None:
    """``--to`` as (provider, model); a switch must name it, manual and overflow ignore it.

    Raises:
        ConfigError: ``--mode switch`` without ``--to``, ``--to`` with a mode that plans for
            the logged route, or a ``--to`` that is not PROVIDER/MODEL.
    """
    if to is None:
        if mode == "switch":
            raise ConfigError("--mode switch needs --to PROVIDER/MODEL, the route to switch to")
        return None
    if mode not in ("auto", "switch"):
        raise ConfigError(f"--to: --mode {mode} plans for the logged route; drop --to")
    from compactd.routes import parse_route  # only here: the catalog takes a while to import

    return parse_route(to, option="--to")


def _read_tls_ca(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise ConfigError(f"--tls-ca: {error.strerror}: {path}") from None


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=os.environ.get("COMPACTD_CONFIG"),
        help="TOML configuration file (also COMPACTD_CONFIG)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "replay":
        from compactd import replay_command

        return replay_command.run(args)
    if args.command == "config-schema":
        print(json.dumps(config.json_schema(), indent=2))
        return 0
    flags = ("listen", "store", "log_level", "log_format", "metrics_listen", "store_migrate")
    overrides = {key: getattr(args, key, None) for key in flags}
    try:
        settings = config.load(args.config, overrides=overrides)
        if args.command == "migrate":  # needs the store only: no provider keys, no routes
            print(asyncio.run(_migrate(settings)))
            return 0
        from compactd.api.server import serve, validate
        from compactd.effective import effective_toml

        parts = validate(settings)  # what serve checks before it listens: named errors now
        ignored = config.unknown_variables()
        if args.command == "check-config":
            for name in ignored:  # a warning as serve logs one, and a comment in the TOML
                print(f"compactd: warning: ignored: {name} is not a compactd setting",
                      file=sys.stderr)  # fmt: skip
                print(f"# ignored: {name} is not a compactd setting")
            print(effective_toml(settings, routes=list(parts.routes), summarizer=parts.summarizer,
                                 pruner=parts.pruner), end="")  # fmt: skip
            return 0

        logs.configure(settings.log_level, settings.log_format)
        for name in ignored:
            log.warning("ignored: %s is not a compactd setting", name, extra={"variable": name})
        asyncio.run(serve(settings))
    except ConfigError as err:
        print(f"compactd: configuration error: {err.message}", file=sys.stderr)
        return EXIT_CONFIG
    except StartupError as err:
        print(f"compactd: cannot start: {err.message} ({err.reason})", file=sys.stderr)
        return EXIT_STARTUP
    return 0


async def _migrate(settings: config.ServerConfig) -> str:
    """Open the store with migrations on, then close it; says the version reached."""
    import dataclasses

    from compactd.store.factory import store_for

    store = store_for(dataclasses.replace(settings, store_migrate=True))
    await store.open()
    try:
        version = getattr(store, "schema_version", None)
    finally:
        await store.close()
    return f"schema at version {version}" if version else "the store is up to date"


if __name__ == "__main__":
    sys.exit(main())
