"""A process killed mid-append loses no acknowledged event and leaves no half batch."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections import defaultdict
from pathlib import Path

import compactd
from compactd.store import SqliteEventStore

from . import crash_appender

WRITERS = 4
BATCH_SIZE = 5
ACKS_BEFORE_KILL = 60
_EVENT_ID = re.compile(r"^(w\d+)-b(\d+)-(\d+)$")
# The appender runs from a plain interpreter: point it at the compactd we are testing.
_SERVER_DIR = str(Path(compactd.__file__).resolve().parents[1])


async def run_until_killed(path: Path) -> list[str]:
    """Starts the appender, reads acknowledgements, SIGKILLs it; returns every ack line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SERVER_DIR, env.get("PYTHONPATH")]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        crash_appender.__file__,
        str(path),
        str(WRITERS),
        str(BATCH_SIZE),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        while len(lines) < ACKS_BEFORE_KILL:
            line = await proc.stdout.readline()
            assert line, f"appender exited early with {await proc.wait()}"
            lines.append(line.decode())
    finally:
        proc.send_signal(signal.SIGKILL)
        # Acks printed before the kill are still in the pipe; a cut-off last line is not an ack.
        rest = (await proc.stdout.read()).decode()
        await proc.wait()
    lines.extend(line + "\n" for line in rest.split("\n")[:-1])
    assert proc.returncode == -signal.SIGKILL
    return lines


async def test_sigkill_mid_stream_keeps_every_acknowledged_batch_whole(tmp_path: Path) -> None:
    path = tmp_path / "crash.db"

    acks = await run_until_killed(path)

    async with SqliteEventStore(str(path)) as store:
        for line in acks:
            session_id, k, first, last = line.split()
            found = await store.read_seqs(session_id, range(int(first), int(last) + 1))
            assert [e.event_id for e in found] == [
                f"{session_id}-b{k}-{i}" for i in range(BATCH_SIZE)
            ], f"acknowledged batch lost: {line!r}"
        for record in await store.list_sessions():
            batches: dict[int, list[int]] = defaultdict(list)
            seqs = []
            async for event in store.read(record.session_id):
                match = _EVENT_ID.match(event.event_id)
                assert match is not None
                assert match[1] == record.session_id
                batches[int(match[2])].append(int(match[3]))
                seqs.append(event.seq)
            assert seqs == list(range(record.revision))
            assert all(parts == list(range(BATCH_SIZE)) for parts in batches.values())
            assert sorted(batches) == list(range(len(batches)))
