"""The TypeScript and Go clients' default step, timed for ``bench_steps`` from their own language.

Each client has a small driver that times its default step beside an empty unary RPC (a gRPC
health check) sent by the same process, interleaved call by call (so the reference pays the same
language's client costs): ``clients/typescript/bench/steps.ts`` (``prepareStep(session, turn)``)
and ``clients/go/internal/stepbench`` (``PrepareStep(ctx, session, turn, nil)``); each also times
the step with a progress callback (the streamed PrepareStep, the examples' call) and the bare
PrepareStepUnary RPC with the held revision (nothing held: the client's own share). This module
builds them (tsc, as ``npm test`` does; ``go build`` in GOPATH mode over Debian's Go sources, as
``clients/go/gotest`` does), starts each as a child process on the bench's session, and asks for
one measurement per session length: it writes the number of rounds to the driver's stdin and
reads back one JSON line of per-call seconds (see the drivers' own comments).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.children import ROOT

TYPESCRIPT = ROOT / "clients" / "typescript"
GO = ROOT / "clients" / "go"
GO_SOURCES = Path("/usr/share/gocode")
#: The drivers' languages, in the order the bench runs them.
LANGUAGES = ("typescript", "go")


@dataclass(frozen=True)
class DriverTimings:
    """One session length, measured by one driver: per-call seconds of each kind, in order."""

    empty: list[float]  # the empty unary RPC (health check) from the driver's process
    step: list[float]  # the client's default step (one PrepareStepUnary, held revision)
    streamed: list[float]  # the default step with a progress callback (streamed, held)
    unary: list[float]  # the client's bare PrepareStepUnary with the held revision, nothing held
    unchanged: bool  # every timed step answered only the messages appended (none here)
    reply_bytes: int  # the largest timed step's result, serialized
    revision: int  # the held request's revision
    messages: int  # the held request's message count


def _run(command: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = done.stdout[-4000:] + done.stderr[-4000:]
        raise RuntimeError(f"{' '.join(command)} failed:\n{output}")


def build_typescript() -> list[str]:
    """Compile the TypeScript client with its driver (``tsc -p .`` into ``dist/``); the command
    that runs the driver."""
    tsc = TYPESCRIPT / "node_modules" / ".bin" / "tsc"
    if not tsc.exists() or shutil.which("node") is None:
        raise RuntimeError("node and clients/typescript/node_modules are needed: run clients/setup")
    _run([str(tsc), "-p", "."], TYPESCRIPT)
    return ["node", str(TYPESCRIPT / "dist" / "bench" / "steps.js")]


def build_go(into: Path) -> list[str]:
    """Build the Go driver into ``into`` (GOPATH mode, offline: the client copied under
    ``into``); the command that runs it."""
    if shutil.which("go") is None or not (GO_SOURCES / "src/google.golang.org/grpc").is_dir():
        raise RuntimeError("Debian's golang-go and its gRPC sources are needed: run clients/setup")
    gopath = into / "gopath"
    shutil.copytree(GO, gopath / "src" / "compactd.dev" / "client")
    env = {
        **os.environ,
        "GO111MODULE": "off",
        "GOPROXY": "off",
        "GOFLAGS": "",
        "GOPATH": f"{gopath}:{GO_SOURCES}",
        "GOCACHE": os.environ.get("GOCACHE", str(Path.home() / ".cache" / "compactd-go-build")),
    }
    binary = into / "stepbench"
    _run(["go", "build", "-o", str(binary), "compactd.dev/client/internal/stepbench"], into, env)
    return [str(binary)]


class Driver:
    """One running driver, stepping ``session``'s open ``turn`` on compactd at ``address``."""

    def __init__(self, language: str, child: asyncio.subprocess.Process) -> None:
        self.language = language
        self._child = child

    async def measure(self, rounds: int) -> DriverTimings:
        """``rounds`` interleaved rounds at the session's current length (after two steps that
        make the client hold its request)."""
        stdin, stdout = self._child.stdin, self._child.stdout
        assert stdin is not None
        assert stdout is not None
        stdin.write(f"{rounds}\n".encode())
        await stdin.drain()
        line = await stdout.readline()
        if not line:
            code = await self._child.wait()
            raise RuntimeError(f"the {self.language} step driver exited: {code}")
        got = json.loads(line)
        return DriverTimings(
            got["empty"], got["step"], got["streamed"], got["unary"], got["unchanged"],
            got["replyBytes"],
            int(got["revision"]), got["messages"],
        )  # fmt: skip

    async def close(self) -> None:
        assert self._child.stdin is not None
        self._child.stdin.close()
        if await self._child.wait() != 0:
            code = self._child.returncode
            raise RuntimeError(f"the {self.language} step driver failed: exit {code}")


@asynccontextmanager
async def drivers(address: str, session: str, turn: int) -> AsyncIterator[list[Driver]]:
    """The drivers of ``LANGUAGES``, built and started for the block."""
    with tempfile.TemporaryDirectory(prefix="compactd-step-drivers-") as work:
        commands = {"typescript": build_typescript(), "go": build_go(Path(work))}
        async with AsyncExitStack() as stack:
            started = []
            for language in LANGUAGES:
                child = await asyncio.create_subprocess_exec(
                    *commands[language], address, session, str(turn),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    limit=2**24,  # a line holds every call's time
                )  # fmt: skip
                driver = Driver(language, child)
                stack.push_async_callback(driver.close)
                started.append(driver)
            yield started
