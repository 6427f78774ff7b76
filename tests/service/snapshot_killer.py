"""Writes a session and a first snapshot, then dies (``os._exit``) inside the second snapshot's
transaction, between its two statements. Run by test_residency.py. Usage:
``python snapshot_killer.py PATH``; prints ``snapshotted REVISION`` after the first snapshot.
"""

from __future__ import annotations

import asyncio
import os
import sys

from compactd.service.sessions import SessionManager
from compactd.store import sqlite as sqlite_store
from compactd.store.sqlite import SqliteEventStore
from compactd.v1 import events_pb2


def user(text: str) -> events_pb2.SessionEvent:
    event = events_pb2.SessionEvent()
    event.user_message.content.add().text.text = text
    return event


async def main(path: str) -> None:
    store = SqliteEventStore(path)
    await store.open()
    manager = SessionManager(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    await handle.append([user("one"), user("two")])
    await manager.snapshot(handle)
    print("snapshotted", handle.revision, flush=True)
    await handle.append([user("three")])
    sqlite_store._between_snapshot_steps = lambda: os._exit(9)  # the process dies mid-write
    await manager.snapshot(handle)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
