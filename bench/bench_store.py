"""Append throughput of the event stores with 1, 8 and 64 concurrent appenders.

This measures the store alone: no service, no gRPC, no pricing. The service's own append rates
over gRPC, beside this store's group-commit rate measured in the same run, are
``bench/bench_appends.py``'s.

Each appender owns one session and appends ``--batches`` batches of ``--batch-size`` events (a
tool result of about ``--event-bytes`` bytes each). The table shows events/s next to the write
counters: with group commit, SQLite's commits fall well below its batches as appenders grow.

    python bench/bench_store.py [--synchronous FULL] [--backend sqlite|memory]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from compactd.store import EventStore, MemoryEventStore, SqliteEventStore
from compactd.v1 import events_pb2

APPENDERS = (1, 8, 64)


def make_batch(start: int, size: int, event_bytes: int) -> list[events_pb2.SessionEvent]:
    events = []
    for seq in range(start, start + size):
        event = events_pb2.SessionEvent(seq=seq, event_id=f"e{seq}")
        event.time.GetCurrentTime()
        result = event.tool_result
        result.tool_call_id, result.tool_name = f"call-{seq}", "read_file"
        result.content.add().text.text = "x" * event_bytes
        events.append(event)
    return events


async def appender(
    store: EventStore, session_id: str, batches: int, size: int, nbytes: int
) -> None:
    await store.create_session(session_id, None)
    for k in range(batches):
        await store.append(session_id, make_batch(k * size, size, nbytes))


async def run_one(store: EventStore, appenders: int, args: argparse.Namespace) -> str:
    async with store:
        # Batches per appender shrink as appenders grow, so every row writes about as much.
        batches = max(1, args.batches // appenders)
        before = store.stats
        started = time.perf_counter()
        await asyncio.gather(
            *(
                appender(store, f"s{i}", batches, args.batch_size, args.event_bytes)
                for i in range(appenders)
            )
        )
        elapsed = time.perf_counter() - started
        stats = store.stats
    commits = stats.commits - before.commits
    appended = stats.batches - before.batches
    events = stats.events - before.events
    return (
        f"{appenders:>9} {events:>8} {events / elapsed:>10.0f} {appended:>8} {commits:>8}"
        f" {appended / max(commits, 1):>14.1f} {elapsed:>8.2f}"
    )


def make_store(args: argparse.Namespace, folder: Path, appenders: int) -> EventStore:
    if args.backend == "memory":
        return MemoryEventStore()
    return SqliteEventStore(str(folder / f"bench-{appenders}.db"), synchronous=args.synchronous)


async def main(args: argparse.Namespace) -> None:
    print("the store alone (no service, no gRPC); the service's rates: bench/bench_appends.py")
    print(
        f"backend={args.backend} synchronous={args.synchronous} batch_size={args.batch_size}"
        f" event_bytes={args.event_bytes} total_batches~{args.batches}"
    )
    print(
        f"{'appenders':>9} {'events':>8} {'events/s':>10} {'batches':>8} {'commits':>8}"
        f" {'batches/commit':>14} {'seconds':>8}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-store-") as folder:
        for appenders in APPENDERS:
            store = make_store(args, Path(folder), appenders)
            print(await run_one(store, appenders, args), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "memory"], default="sqlite")
    parser.add_argument("--synchronous", choices=["NORMAL", "FULL", "EXTRA"], default="FULL")
    parser.add_argument("--batches", type=int, default=4096, help="batches per row, in total")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--event-bytes", type=int, default=1024)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
