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
        "--store", help="event store URL: sqlite:///PATH (default sqlite:///./compactd.db)"
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
        description="Load and validate the configuration exactly as `serve` would; print the "
        "effective configuration as TOML (defaults filled in, built-in routes included) and "
        "exit 0, or print the error naming the bad key and exit 2.",
    )
    _config_option(check)
    commands.add_parser(
        "config-schema",
        help="print the JSON Schema of the configuration file",
        description="Print the JSON Schema of compactd.toml, for editors (taplo, VS Code, "
        "JetBrains): save it and point the file at it with a `#:schema` first line.",
    )
    from compactd import replay_command  # issue 14: replay

    replay_command.add_parser(commands)
    return parser


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=os.environ.get("COMPACTD_CONFIG"),
        help="TOML configuration file (also COMPACTD_CONFIG)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
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
        from compactd.api.server import components, serve
        from compactd.effective import effective_toml

        parts = components(settings)  # routes, policy, pruner, summarizer: named errors now
        ignored = config.unknown_variables()
        if args.command == "check-config":
            for name in ignored:
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
        print(f"compactd: cannot start: {err.message}", file=sys.stderr)
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
