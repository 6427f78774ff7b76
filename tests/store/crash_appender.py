"""Appends batches to a SQLite store forever (bounded), printing each acknowledged batch.

Run by test_crash.py, which SIGKILLs it mid-stream. Usage:
``python crash_appender.py PATH WRITERS BATCH_SIZE``. Each writer task owns session ``w{n}`` and
appends batches ``k = 0, 1, ...`` of BATCH_SIZE events with ids ``w{n}-b{k}-{i}``; after each
acknowledged append it prints ``w{n} k first_seq last_seq`` and flushes.
"""

from __future__ import annotations

import asyncio
import sys

from compactd.store import SqliteEventStore
from compactd.v1 import events_pb2

MAX_BATCHES = 100_000  # a safety bound: the test kills the process long before


def batch_events(session_id: str, k: int, size: int) -> list[events_pb2.SessionEvent]:
    events = []
    for i in range(size):
        event = events_pb2.SessionEvent(seq=k * size + i, event_id=f"{session_id}-b{k}-{i}")
        event.user_message.content.add().text.text = f"{session_id} batch {k} event {i} " * 20
        events.append(event)
    return events


async def writer(store: SqliteEventStore, session_id: str, size: int) -> None:
    await store.create_session(session_id, None)
    for k in range(MAX_BATCHES):
        events = batch_events(session_id, k, size)
        await store.append(session_id, events)
        print(session_id, k, events[0].seq, events[-1].seq, flush=True)


async def main(path: str, writers: int, size: int) -> None:
    async with SqliteEventStore(path) as store:
        await asyncio.gather(*(writer(store, f"w{n}", size) for n in range(writers)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
