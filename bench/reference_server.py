"""A bare gRPC server doing an append's physical work, the reference for compactd's per-call cost.

It serves the same methods as compactd under the same names, through compactd's generated
messages, so one client's stubs call either: health ``Check`` (the empty call), and
``SessionService/CreateSession`` and ``SessionService/AppendEvents``. An append parses the request
(grpc's deserializer), stamps each event's seq and time, serializes it (deterministic bytes, as
compactd stores them), group-commits the rows to SQLite (WAL, ``synchronous=FULL``, one writer
thread: concurrent appends share a transaction and its fsync) and answers the seqs and the
revision once COMMIT returned. Nothing else: no authentication, quotas, limits, tracing, metrics,
session state beyond its revision, validation or status mapping.

Two modes, each the fastest honest way its kind of server does that work:

- ``aio``: a ``grpc.aio`` server; a handler queues its rows to the writer and awaits a future the
  writer resolves (one wake-up of the loop per group, as compactd's store does).
- ``sync``: a ``grpc.server`` with 64 threads; a handler queues its rows and blocks on its own
  lock until the writer releases it.

One more, an experiment rather than a reference (``bench_percall --experiment``): ``store``, the
bare aio handler appending through compactd's own ``SqliteEventStore`` (its schema, its writer
thread and group commit) instead of the minimal writer: what compactd's store costs apart from
its service and its RPC stack.

    python -m bench.reference_server --serve FOLDER --mode aio|sync|store

prints the address it listens on, then serves until its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import queue
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2

from compactd.store.sqlite import SqliteEventStore
from compactd.v1 import session_service_pb2

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SESSIONS = "compactd.v1.SessionService"
MAX_GROUP = 512  # jobs per transaction at most (compactd's store: the same bound)
THREADS = 64

Rows = list[tuple[str, int, str | None, str, bytes]]


@dataclass
class Job:
    """One append's rows; ``done(error)`` tells its caller once the group committed."""

    rows: Rows
    done: Callable[[BaseException | None], None]


@dataclass
class Log:
    """The sessions' revisions (the one piece of state an append needs) and the writer."""

    path: Path
    revisions: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the sync server's threads
    jobs: queue.SimpleQueue[Job | None] = field(default_factory=queue.SimpleQueue)

    def start(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS events (session_id TEXT NOT NULL, seq INTEGER NOT NULL,"
            " event_id TEXT, type TEXT NOT NULL, data BLOB NOT NULL,"
            " PRIMARY KEY (session_id, seq))"
        )
        threading.Thread(target=self._write, args=(conn,), daemon=True).start()

    def rows(self, request: session_service_pb2.AppendEventsRequest) -> tuple[Rows, list[int]]:
        """The request's rows, stamped with the next seqs of its session."""
        events = request.events
        with self.lock:
            first = self.revisions.get(request.session_id, 0)
            self.revisions[request.session_id] = first + len(events)
        now = _now()
        rows: Rows = []
        for offset, event in enumerate(events):
            event.seq = first + offset
            event.time.CopyFrom(now)
            data = event.SerializeToString(deterministic=True)
            kind = event.WhichOneof("body") or ""
            rows.append((request.session_id, event.seq, event.event_id or None, kind, data))
        return rows, [first + i for i in range(len(events))]

    def _write(self, conn: sqlite3.Connection) -> None:
        while (job := self.jobs.get()) is not None:
            group = [job]
            with contextlib.suppress(queue.Empty):
                while len(group) < MAX_GROUP and (job := self.jobs.get_nowait()) is not None:
                    group.append(job)
            error: BaseException | None = None
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany(
                    "INSERT INTO events VALUES (?, ?, ?, ?, ?)", [r for j in group for r in j.rows]
                )
                conn.execute("COMMIT")
            except sqlite3.Error as failed:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                error = failed
            for each in group:
                each.done(error)


def _now() -> Timestamp:
    """The time now, as compactd stamps it (microseconds, without a trip through datetime)."""
    now = Timestamp()
    now.FromMicroseconds(time.time_ns() // 1000)
    return now


def _created(request: session_service_pb2.CreateSessionRequest, log: Log) -> Any:
    with log.lock:
        log.revisions.setdefault(request.session_id, 0)
    return session_service_pb2.CreateSessionResponse()


SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


# ---- aio ---------------------------------------------------------------------------------------


def aio_handlers(log: Log) -> list[grpc.GenericRpcHandler[Any, Any]]:
    async def check(request: Any, context: Any) -> Any:
        return SERVING

    async def create(request: Any, context: Any) -> Any:
        return _created(request, log)

    async def append(request: session_service_pb2.AppendEventsRequest, context: Any) -> Any:
        rows, seqs = log.rows(request)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settled, done, error)

        log.jobs.put(Job(rows, settle))
        await done
        return session_service_pb2.AppendEventsResponse(seqs=seqs, revision=seqs[-1] + 1)

    return _handlers(check, create, append)


def _settled(future: asyncio.Future[None], error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


# ---- the experiment: compactd's store under the bare handler ---------------------------------


def store_handlers(store: SqliteEventStore, log: Log) -> list[grpc.GenericRpcHandler[Any, Any]]:
    async def check(request: Any, context: Any) -> Any:
        return SERVING

    async def create(request: Any, context: Any) -> Any:
        await store.create_session(request.session_id, None)
        return _created(request, log)

    async def append(request: session_service_pb2.AppendEventsRequest, context: Any) -> Any:
        events = request.events
        first = log.revisions.get(request.session_id, 0)
        log.revisions[request.session_id] = first + len(events)
        now = _now()
        for offset, event in enumerate(events):
            event.seq = first + offset
            event.time.CopyFrom(now)
        await store.append(request.session_id, events)  # serialized on its writer thread
        seqs = [first + i for i in range(len(events))]
        return session_service_pb2.AppendEventsResponse(seqs=seqs, revision=seqs[-1] + 1)

    return _handlers(check, create, append)


# ---- sync --------------------------------------------------------------------------------------


def sync_handlers(log: Log) -> list[grpc.GenericRpcHandler[Any, Any]]:
    def check(request: Any, context: Any) -> Any:
        return SERVING

    def create(request: Any, context: Any) -> Any:
        return _created(request, log)

    def append(request: session_service_pb2.AppendEventsRequest, context: Any) -> Any:
        rows, seqs = log.rows(request)
        waiting = threading.Lock()
        waiting.acquire()
        failure: list[BaseException] = []

        def settle(error: BaseException | None) -> None:
            if error is not None:
                failure.append(error)
            waiting.release()

        log.jobs.put(Job(rows, settle))
        waiting.acquire()
        if failure:
            raise failure[0]
        return session_service_pb2.AppendEventsResponse(seqs=seqs, revision=seqs[-1] + 1)

    return _handlers(check, create, append)


def _handlers(check: Any, create: Any, append: Any) -> list[grpc.GenericRpcHandler[Any, Any]]:
    unary = grpc.unary_unary_rpc_method_handler
    health = {
        "Check": unary(
            check,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
    }
    sessions = {
        "CreateSession": unary(
            create,
            request_deserializer=session_service_pb2.CreateSessionRequest.FromString,
            response_serializer=session_service_pb2.CreateSessionResponse.SerializeToString,
        ),
        "AppendEvents": unary(
            append,
            request_deserializer=session_service_pb2.AppendEventsRequest.FromString,
            response_serializer=session_service_pb2.AppendEventsResponse.SerializeToString,
        ),
    }
    return [
        grpc.method_handlers_generic_handler("grpc.health.v1.Health", health),
        grpc.method_handlers_generic_handler(SESSIONS, sessions),
    ]


# ---- serving -----------------------------------------------------------------------------------


async def serve_aio(log: Log, mode: str) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    store = None
    if mode == "store":
        store = SqliteEventStore(str(log.path.with_suffix(".store.db")))
        await store.open()
        server.add_generic_rpc_handlers(store_handlers(store, log))
    else:
        server.add_generic_rpc_handlers(aio_handlers(log))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"127.0.0.1:{port}", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.stop(0)
    if store is not None:
        await store.close()


def serve_sync(log: Log) -> None:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=THREADS),
        options=[("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=None,
    )
    server.add_generic_rpc_handlers(sync_handlers(log))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"127.0.0.1:{port}", flush=True)
    sys.stdin.read()
    server.stop(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mode", choices=("aio", "sync", "store"), required=True)
    parser.add_argument("--serve", required=True, help="the folder its SQLite file goes in")
    args = parser.parse_args(argv)
    log = Log(Path(args.serve) / f"reference-{args.mode}.db")
    sys.setswitchinterval(0.0002)  # as compactd's server settles its interpreter
    if args.mode == "sync":
        log.start()
        serve_sync(log)
    else:
        if args.mode == "aio":
            log.start()
        asyncio.run(serve_aio(log, args.mode))


if __name__ == "__main__":
    main()
