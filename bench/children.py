"""Benchmarked servers in a child process of their own, as in production: the client that times
the calls runs in the bench's process and shares neither the servers' event loop nor their GIL.

A bench module serves with ``--serve [ARGS]``: it starts its servers, prints one line per thing
the bench needs (an address, a metrics URL), then serves until its stdin closes
(``until_stdin_closes``). The bench's side starts it with ``served``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@asynccontextmanager
async def served(module: str, lines: int, *args: str) -> AsyncIterator[list[str]]:
    """Run ``python -m module --serve *args`` for the block: the first ``lines`` lines it
    prints; closing its stdin at the end stops it."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, "--serve", *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert child.stdout is not None
    assert child.stdin is not None
    try:
        printed = [(await child.stdout.readline()).decode().strip() for _ in range(lines)]
        if not all(printed):
            raise RuntimeError(f"{module}'s servers did not start: exit {await child.wait()}")
        yield printed
    finally:
        child.stdin.close()
        await child.wait()


async def until_stdin_closes() -> None:
    """Serve (the child's side) until the bench closes this process's stdin."""
    await asyncio.to_thread(sys.stdin.read)


def identity(data: bytes) -> bytes:
    """A method's (de)serializer for raw bytes."""
    return data
