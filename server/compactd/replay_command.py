"""The ``compactd replay`` command: arguments, the embedded or target server, the outputs.

Replay drives compactd through its Python client (``compactd_client``, the ``client`` extra:
``compactd[client]``), which a server-only install (the Docker image) lacks: it is imported when
the command runs, never by ``compactd serve``, and its absence is an error naming the extra.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compactd.errors import ConfigError

if TYPE_CHECKING:
    from compactd import replay as rp

DEFAULT_ROUTE = "openai/gpt-4o"


def add_parser(commands: Any) -> None:
    """Add the ``replay`` subcommand to ``commands`` (an argparse subparsers object)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "replay",
        help="play recorded conversations through compactd and report what it did",
        description='Play recorded conversations (JSONL, one {"messages": [...]} chat '
        "transcript a line) through compactd as an agent runtime would: typed events, turns "
        "and steps, PrepareStep before every model step, the rebuilt request encoded as what "
        "would be sent (the recorded reply stands in for the model). Against --target, or by "
        "default an embedded server on a temporary store with extractive summaries (or the "
        "summarizer --config names). Prints a table (progress on stderr) and writes one "
        "self-contained HTML report.",
    )
    parser.add_argument("transcripts", type=Path, help="JSONL file of chat transcripts")
    parser.add_argument("--target", help="HOST:PORT of a running compactd (default: embedded)")
    parser.add_argument(
        "--window", type=int,
        help="the embedded route's context window in tokens (small: compacts often)",
    )  # fmt: skip
    parser.add_argument(
        "--route", default=DEFAULT_ROUTE,
        help="PROVIDER/MODEL the sessions are routed to (default openai/gpt-4o)",
    )  # fmt: skip
    parser.add_argument(
        "--config", help="TOML configuration of the embedded server (routes, summarizer)"
    )
    parser.add_argument("--match", default="", help="only conversations whose source has this")
    parser.add_argument("--limit", type=int, help="at most this many conversations")
    parser.add_argument(
        "--html", type=Path, default=Path("replay-report.html"),
        help="where the HTML report goes (default replay-report.html)",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--prepare-ahead", type=float, metavar="RATIO",
        help="set the sessions' policy prepareAheadRatio to RATIO (0 < RATIO < thresholdRatio): "
        "compactd prepares each summary once the envelope passes RATIO x W and applies it at a "
        "step boundary; with --think the agent-visible wait shows the difference",
    )  # fmt: skip
    parser.add_argument(
        "--think", type=float, default=0.0, metavar="SECONDS",
        help="seconds the agent's model takes after each PrepareStep (default 0); then the "
        "agent-visible wait compaction added is printed",
    )  # fmt: skip
    # Issue 14: a --target behind TLS, mutual TLS or bearer tokens (issue 10's listener).
    secure = parser.add_argument_group("a --target with TLS or authentication")
    secure.add_argument(
        "--tls", action="store_true", help="connect with TLS, trusting the system's roots"
    )
    secure.add_argument("--tls-ca", type=Path, help="PEM roots to trust (implies --tls)")
    secure.add_argument("--tls-cert", type=Path, help="client certificate, PEM (mutual TLS)")
    secure.add_argument("--tls-key", type=Path, help="the client certificate's key, PEM")
    secure.add_argument(
        "--token-file", type=Path,
        help="file holding the bearer token (default: the COMPACTD_TOKEN variable)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run ``compactd replay``; returns the exit code (2: bad arguments or input)."""
    try:
        from compactd_client.errors import CompactdError

        from compactd import replay as rp
        from compactd import replay_report as report
        from compactd.routes import parse_route
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] != "compactd_client":
            raise
        print("compactd replay: needs the Python client (compactd-client): pip install "
              "'compactd[client]' (from a checkout: pip install ./clients/python)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        route = parse_route(args.route, option="--route")
        transcripts = rp.read_transcripts(args.transcripts, match=args.match, limit=args.limit)
        if not transcripts:
            raise ConfigError(f"{args.transcripts}: no conversation matches")
        if args.target and (args.window is not None or args.config):
            raise ConfigError(
                "--window and --config configure the embedded server; a running server's "
                "routes and summarizer are its own configuration"
            )
        args.credentials, args.token = _security(args)
        if args.think < 0:
            raise ConfigError(f"--think: expected seconds >= 0, got {args.think:g}")
        window = rp.window_policy(args.window) if args.window is not None else None
        args.policy = rp.prepare_ahead_policy(window, args.prepare_ahead)
        _check_writable(args.html)  # now, not after a replay that may take minutes
        replays, where = asyncio.run(_replay(args, route, transcripts))
    except ConfigError as err:
        print(f"compactd replay: {err.message}", file=sys.stderr)
        return 2
    except CompactdError as err:  # a --target that refuses the call (credentials, TLS, down)
        print(f"compactd replay: {args.target or 'the embedded server'}: {err}", file=sys.stderr)
        return 1
    print(report.table(replays))
    print()
    print(report.bracket_table(replays))
    if args.think or args.prepare_ahead is not None:
        print()
        print(report.wait_line(replays))
    for number, result in enumerate(replays, 1):
        for warning in result.warnings:  # a route without a window, a bracket that failed, ...
            print(f"warning ({number}): {warning}", file=sys.stderr)
    conversations = report.counted(len(replays), "conversation")
    settings = f"{conversations} of {args.transcripts}, route {args.route}, {where}"
    try:
        args.html.write_text(
            report.render_html(replays, title="compactd replay", settings=settings),
            encoding="utf-8",
        )
    except OSError as err:  # the folder went away or filled up during the replay
        print(f"compactd replay: {_unwritable(args.html, err).message}", file=sys.stderr)
        return 2
    print(f"report: {args.html}")
    return 0


def _check_writable(path: Path) -> None:
    """Open ``path`` for appending (which changes no content), removing it again if it is new.

    Raises:
        ConfigError: It cannot be written (a missing folder, a directory, no permission).
    """
    existed = path.exists()
    try:
        with path.open("a", encoding="utf-8"):
            pass
        if not existed:
            path.unlink()
    except OSError as err:
        raise _unwritable(path, err) from None


def _unwritable(path: Path, err: OSError) -> ConfigError:
    return ConfigError(f"--html: cannot write {path}: {err.strerror}")


def _security(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The client's TLS credentials (None: plaintext) and bearer token for ``--target``.

    Raises:
        ConfigError: A security option without ``--target``, half a client key pair, or a file
            that cannot be read.
    """
    tls = bool(args.tls or args.tls_ca or args.tls_cert or args.tls_key)
    token_file = args.token_file
    if not args.target:
        if tls or token_file:
            raise ConfigError("--tls, --tls-* and --token-file apply to a --target server")
        return None, None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together (a client certificate and key)")
    token = os.environ.get("COMPACTD_TOKEN") or None
    try:
        if token_file:
            token = token_file.read_text(encoding="utf-8").strip()
        if not tls:
            return None, token
        import grpc

        root = args.tls_ca.read_bytes() if args.tls_ca else None
        key = args.tls_key.read_bytes() if args.tls_key else None
        chain = args.tls_cert.read_bytes() if args.tls_cert else None
    except OSError as err:
        raise ConfigError(f"{err.filename}: {err.strerror}") from err
    return grpc.ssl_channel_credentials(root, key, chain), token


async def _replay(
    args: argparse.Namespace, route: tuple[str, str], transcripts: list[rp.Transcript]
) -> tuple[list[rp.SessionReplay], str]:
    from compactd import replay as rp
    from compactd import replay_report as report

    steps = sum(1 for t in transcripts for m in t.messages if m.get("role") == "assistant")
    bar = None if args.no_progress else report.ProgressBar(sys.stderr, steps, len(transcripts))
    on_step = bar.step if bar is not None else None
    policy, think = args.policy, args.think
    try:
        if args.target:
            results = await rp.replay_all(
                args.target, transcripts, route=route, policy=policy, on_step=on_step,
                credentials=args.credentials, token=args.token, think=think,
            )  # fmt: skip
            return results, f"server {args.target}"
        async with rp.temporary_store() as folder:
            config = rp.embedded_config(args.config, folder, route=route, window=args.window)
            async with rp.embedded_server(config) as address:
                results = await rp.replay_all(
                    address, transcripts, route=route, policy=policy, on_step=on_step,
                    think=think,
                )  # fmt: skip
        window = f"window {args.window:,}" if args.window else "the route's window"
        summarizer = config.summarizer.get("kind", "extractive")
        return results, f"embedded server ({window}, {summarizer} summaries)"
    finally:
        if bar is not None:
            bar.close()
