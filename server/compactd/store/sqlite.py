"""The SQLite :class:`EventStore`: one file, WAL, one writer thread with group commit.

Writes: a single thread owns the only write connection. ``create_session`` and ``append`` hand
it a job and await a future. The thread takes everything queued, runs it in ONE transaction
(when a job fails its own checks, the group runs again with each job inside its own SAVEPOINT,
so that job is undone alone) and commits once, so concurrent appends share one fsync. Futures
resolve only after COMMIT returns: nothing is acknowledged that is not on disk. A database
failure fails the whole group, and the rollback leaves none of it.

Reads: a small pool of read-only connections used through ``asyncio.to_thread``; WAL lets them
run beside the writer and each sees only committed transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar

from google.protobuf.message import DecodeError

from compactd import errors
from compactd.reasons import Reason
from compactd.store import base
from compactd.store.base import DEFAULT_TENANT_ID, SessionKey
from compactd.store.candidates import ProcessCandidates
from compactd.store.leases import Lease, LeaseOp, ProcessLeases
from compactd.store.owner import OwnerLock
from compactd.v1 import events_pb2

T = TypeVar("T")

SCHEMA_VERSION = 3
SYNCHRONOUS_LEVELS = ("NORMAL", "FULL", "EXTRA")

# Version 2 keys sessions by (tenant, session_id) and records when each last changed; version 3
# adds a child session's parent (sub-agents) and the parent seq a fork copied.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    tenant         TEXT NOT NULL,
    session_id     TEXT NOT NULL,
    create_time_us INTEGER NOT NULL,
    policy_json    TEXT,
    revision       INTEGER NOT NULL DEFAULT 0,
    update_time_us INTEGER NOT NULL,
    parent_id      TEXT,
    fork_at_seq    INTEGER,
    PRIMARY KEY (tenant, session_id)
);
CREATE INDEX IF NOT EXISTS sessions_parent
    ON sessions (tenant, parent_id, session_id) WHERE parent_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS events (
    tenant     TEXT NOT NULL,
    session_id TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    event_id   TEXT,
    type       TEXT NOT NULL,
    data       BLOB NOT NULL,
    PRIMARY KEY (tenant, session_id, seq),
    FOREIGN KEY (tenant, session_id) REFERENCES sessions (tenant, session_id)
);
CREATE UNIQUE INDEX IF NOT EXISTS events_event_id
    ON events (tenant, session_id, event_id) WHERE event_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS snapshots (
    tenant     TEXT NOT NULL,
    session_id TEXT NOT NULL,
    revision   INTEGER NOT NULL,
    data       BLOB NOT NULL,
    PRIMARY KEY (tenant, session_id),
    FOREIGN KEY (tenant, session_id) REFERENCES sessions (tenant, session_id)
);
"""

# Version 1 (no tenants) to 2: the old tables are renamed aside, copied under the default
# tenant, then dropped, all inside the migration's transaction.
_FROM_V1 = """
ALTER TABLE events RENAME TO events_v1;
ALTER TABLE sessions RENAME TO sessions_v1;
DROP INDEX IF EXISTS events_event_id;
{schema};
INSERT INTO sessions (tenant, session_id, create_time_us, policy_json, revision, update_time_us)
    SELECT :tenant, session_id, create_time_us, policy_json, revision, create_time_us
    FROM sessions_v1;
INSERT INTO events (tenant, session_id, seq, event_id, type, data)
    SELECT :tenant, session_id, seq, event_id, type, data FROM events_v1;
DROP TABLE events_v1;
DROP TABLE sessions_v1
"""

# Version 2 to 3: the parent columns (the index comes with the schema script that follows).
_FROM_V2 = """
ALTER TABLE sessions ADD COLUMN parent_id TEXT;
ALTER TABLE sessions ADD COLUMN fork_at_seq INTEGER
"""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SAVEPOINT = "job"
# Jobs committed together at most; bounds one transaction's size under a flood of appends.
_MAX_GROUP = 512
# Bound parameters per IN (...) query, well under SQLite's variable limit.
_IN_CHUNK = 500
_SESSION_COLUMNS = (
    "session_id, create_time_us, policy_json, revision, tenant, update_time_us, parent_id,"
    " fork_at_seq"
)


class SqliteEventStore(base.EventStore):
    """Keeps session logs in one SQLite database file.

    Args:
        path: The database file (created if missing). Must be a real file: the writer and the
            readers use separate connections.
        synchronous: ``PRAGMA synchronous`` for the writer: ``FULL`` (default) syncs the WAL on
            every commit; ``NORMAL`` may lose the last commits on power loss (never on a process
            crash); ``EXTRA`` adds directory syncs that matter only outside WAL mode.
        busy_timeout_ms: How long a connection waits for another process's lock.
        read_chunk: Events fetched per round trip while streaming a read.
        clock: Source of session creation times.

    One process owns a database file at a time: ``open`` takes an exclusive lock on
    ``<path>.lock`` (``store.owner``) and ``close`` releases it.

    Raises:
        ConfigError: for an unknown ``synchronous`` level.
    """

    def __init__(
        self,
        path: str,
        *,
        synchronous: str = "FULL",
        busy_timeout_ms: int = 5000,
        read_chunk: int = 256,
        clock: base.Clock = base.utc_now,
    ) -> None:
        if synchronous.upper() not in SYNCHRONOUS_LEVELS:
            raise errors.ConfigError(
                f"synchronous must be one of {', '.join(SYNCHRONOUS_LEVELS)}, got {synchronous!r}"
            )
        self._path = path
        self._synchronous = synchronous.upper()
        self._busy_timeout_ms = busy_timeout_ms
        self._read_chunk = read_chunk
        self._clock = clock
        self._writer: _Writer | None = None
        self._readers = _ReadPool(path, busy_timeout_ms)
        self._writer_pragmas: dict[str, str | int] = {}
        self._lifecycle = asyncio.Lock()  # serializes open() and close()
        self._owner = OwnerLock(path)
        self._last_stats = base.StoreStats()  # what a closed store still reports
        # One owner per file: bracket leases need not outlive the process (``store.leases``).
        self._leases = ProcessLeases(clock)
        self._candidate_table = ProcessCandidates(clock)

    @property
    def path(self) -> str:
        """The database file."""
        return self._path

    @property
    def stats(self) -> base.StoreStats:
        writer = self._writer
        return self._last_stats if writer is None else writer.stats

    @property
    def writer_pragmas(self) -> dict[str, str | int]:
        """The write connection's settings as SQLite reports them after ``open()``.

        Keys: ``journal_mode``, ``synchronous`` (a name), ``foreign_keys``, ``busy_timeout``.
        """
        return dict(self._writer_pragmas)

    async def open(self) -> None:
        """Take ownership of the file and open it.

        Raises:
            ConfigError: The database's folder does not exist.
            StartupError: Another process owns the file (``STORE_LOCKED``), or it cannot be
                opened or used (``STORE_UNAVAILABLE``: a read-only file system, no WAL), or it
                was written by a newer compactd (``SCHEMA_TOO_NEW``).
        """
        async with self._lifecycle:
            if self._writer is not None:
                return
            await asyncio.to_thread(self._take_ownership)
            try:
                conn, self._writer_pragmas = await asyncio.to_thread(self._connect_writer)
            except (sqlite3.Error, errors.Unavailable) as error:  # a read-only file, no WAL
                self._owner.release()
                raise errors.StartupError(
                    f"cannot open the store sqlite:///{self._path}: {error}",
                    reason=Reason.STORE_CORRUPT
                    if is_corruption(error)
                    else Reason.STORE_UNAVAILABLE,
                ) from None
            except BaseException:
                self._owner.release()
                raise
            self._readers.reopen()
            self._writer = _Writer(conn, self._last_stats)

    async def close(self) -> None:
        async with self._lifecycle:
            # Unset first: calls arriving from now on fail fast instead of queueing.
            writer, self._writer = self._writer, None
            if writer is None:
                return
            await asyncio.to_thread(writer.stop)
            self._last_stats = writer.stats
            self._readers.close()
            self._owner.release()

    async def create_session(
        self,
        session_id: str,
        policy_json: str | None,
        *,
        tenant: str = DEFAULT_TENANT_ID,
        parent: str = "",
        fork_at_seq: int | None = None,
    ) -> base.SessionRecord:
        now = self._clock()
        record = base.SessionRecord(
            session_id, now, policy_json, 0, tenant, now, parent, fork_at_seq
        )
        await self._write(functools.partial(_insert_session, record), events=None)
        return record

    async def get_session(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> base.SessionRecord | None:
        return await self._read(functools.partial(_select_session, SessionKey(tenant, session_id)))

    async def list_sessions(
        self,
        *,
        after: str = "",
        limit: int = 100,
        tenant: str = DEFAULT_TENANT_ID,
        parent: str | None = None,
    ) -> list[base.SessionRecord]:
        base.check_limit(limit)
        op = functools.partial(_select_sessions, tenant, after, limit, parent)
        return await self._read(op)

    async def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID) -> bool:
        op = functools.partial(_delete_session, SessionKey(tenant, session_id))
        deleted = await self._write(op, events=None)
        self._leases.forget((tenant, session_id))
        self._candidates.forget((tenant, session_id))
        return deleted

    async def append(
        self,
        session_id: str,
        events: Sequence[events_pb2.SessionEvent],
        *,
        tenant: str = DEFAULT_TENANT_ID,
        lease: LeaseOp | None = None,
        rows: Sequence[base.EventRow] | None = None,
    ) -> int:
        op = self._insert(SessionKey(tenant, session_id), events, rows)
        # The session service serializes a session's appends, and this process is the store's
        # only writer: applying the lease before the write and undoing it on failure is atomic.
        undo = self._leases.apply((tenant, session_id), lease)
        try:
            return await self._write(op, events=len(events))
        except Exception:  # a cancelled caller does not retract the batch (nor its lease)
            undo()
            raise

    def commit(
        self,
        session_id: str,
        events: Sequence[events_pb2.SessionEvent],
        *,
        tenant: str = DEFAULT_TENANT_ID,
        lease: LeaseOp | None = None,
        rows: Sequence[base.EventRow] | None = None,
    ) -> base.Outcome[int]:
        # The writer settles the outcome itself: no task runs ``append`` for it.
        op = self._insert(SessionKey(tenant, session_id), events, rows)
        undo = self._leases.apply((tenant, session_id), lease)
        outcome: base.Outcome[int] = base.Outcome()
        try:
            self._submit(op, outcome, events=len(events))
        except Exception:
            undo()
            raise
        if lease is not None:  # a runtime's batch holds none: no callback per append
            outcome.add_done_callback(functools.partial(_undo_if_failed, undo))
        return outcome

    def _insert(
        self,
        key: SessionKey,
        events: Sequence[events_pb2.SessionEvent],
        rows: Sequence[base.EventRow] | None,
    ) -> Callable[[sqlite3.Connection], int]:
        self._check_open()
        if rows is None:  # serialized on the writer thread; the caller leaves the events be
            return functools.partial(_encode_and_insert, key, list(events), self._clock())
        return functools.partial(_insert_events, key, list(rows), self._clock())

    async def get_lease(self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID) -> Lease | None:
        self._check_open()
        return self._leases.get((tenant, session_id))

    async def renew_lease(
        self,
        session_id: str,
        owner: str,
        token: str,
        ttl_s: float,
        *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:
        self._check_open()
        return self._leases.renew((tenant, session_id), owner, token, ttl_s)

    async def read(
        self,
        session_id: str,
        from_seq: int = 0,
        to_seq: int | None = None,
        *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> AsyncIterator[events_pb2.SessionEvent]:
        base.check_read_range(from_seq, to_seq)
        key = SessionKey(tenant, session_id)
        revision = await self._read(functools.partial(_require_revision, key))
        end = revision if to_seq is None else min(to_seq, revision)
        for start in range(from_seq, end, self._read_chunk):
            stop = min(start + self._read_chunk, end)
            chunk = await self._read(functools.partial(_select_range, key, start, stop))
            for event in chunk:
                yield event

    async def read_seqs(
        self, session_id: str, seqs: Sequence[int], *, tenant: str = DEFAULT_TENANT_ID
    ) -> list[events_pb2.SessionEvent]:
        wanted = sorted({s for s in seqs if s >= 0})
        return await self._read(
            functools.partial(_select_seqs, SessionKey(tenant, session_id), wanted)
        )

    async def read_stored(
        self, session_id: str, seqs: Sequence[int], *, tenant: str = DEFAULT_TENANT_ID
    ) -> dict[int, bytes]:
        wanted = sorted({s for s in seqs if s >= 0})
        return await self._read(
            functools.partial(_select_stored, SessionKey(tenant, session_id), wanted)
        )

    async def find_event_ids(
        self, session_id: str, event_ids: Sequence[str], *, tenant: str = DEFAULT_TENANT_ID
    ) -> dict[str, int]:
        wanted = sorted({i for i in event_ids if i})
        key = SessionKey(tenant, session_id)
        return await self._read(functools.partial(_select_event_ids, key, wanted))

    async def usage(
        self, *, tenant: str | None = None, session_id: str | None = None
    ) -> dict[str, base.StoreUsage]:
        return await self._read(functools.partial(_select_usage, tenant, session_id))

    async def put_snapshot(
        self, session_id: str, revision: int, data: bytes, *, tenant: str = DEFAULT_TENANT_ID
    ) -> None:
        # One job of the writer, inside one committed transaction, so a crash leaves the old row
        # or the new one (``_replace_snapshot``).
        op = functools.partial(_replace_snapshot, SessionKey(tenant, session_id), revision, data)
        await self._write(op, events=None)

    async def get_snapshot(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> tuple[int, bytes] | None:
        return await self._read(functools.partial(_select_snapshot, SessionKey(tenant, session_id)))

    def _take_ownership(self) -> None:
        folder = os.path.dirname(os.path.abspath(self._path))
        if not os.path.isdir(folder):
            raise errors.ConfigError(
                f"store: the folder {folder} of sqlite:///{self._path} does not exist; "
                "create it or choose another --store",
                metadata={"field": "store"},
            )
        self._owner.acquire()

    def _connect_writer(self) -> tuple[sqlite3.Connection, dict[str, str | int]]:
        """Opens the write connection, sets its pragmas and schema; returns it and the pragmas
        as SQLite reports them."""
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        try:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise errors.Unavailable(f"{self._path}: cannot use WAL (journal_mode={mode})")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            _migrate(conn, self._path)
            return conn, _read_pragmas(conn)
        except BaseException:
            conn.close()
            raise

    def _check_open(self) -> None:
        if self._writer is None:
            raise base.store_closed()

    async def _write(self, op: Callable[[sqlite3.Connection], T], *, events: int | None) -> T:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._submit(op, future, events=events)
        return await future

    def _submit(
        self,
        op: Callable[[sqlite3.Connection], T],
        future: asyncio.Future[T],
        *,
        events: int | None,
    ) -> None:
        writer = self._writer
        if writer is None:
            raise base.store_closed()
        writer.submit(_Job(op, future.get_loop(), future, events))

    async def _read(self, query: Callable[[sqlite3.Connection], T]) -> T:
        self._check_open()
        try:
            return await asyncio.to_thread(self._readers.run, query)
        except (sqlite3.Error, DecodeError) as exc:
            raise _store_failed("read", exc) from None


def _undo_if_failed(undo: Callable[[], None], outcome: asyncio.Future[int]) -> None:
    if outcome.exception() is not None:
        undo()


# --- the writer ---------------------------------------------------------------------------------


@dataclass
class _Job(Generic[T]):
    """One write: ``op`` runs on the writer connection inside the group's transaction."""

    op: Callable[[sqlite3.Connection], T]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]
    events: int | None  # None: not an append batch
    queued: float = field(default_factory=time.perf_counter)  # when the caller submitted it


#: A job's future and what settles it: (future, value, error).
_Settled = tuple[asyncio.Future[Any], Any, BaseException | None]


def _settle(jobs: list[_Job[Any]], outcomes: list[_Outcome]) -> None:
    """Resolves the jobs' futures from the writer thread: one wake-up of each caller's loop per
    group, not one per job (each ``call_soon_threadsafe`` writes to the loop's self-pipe)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Settled]] = {}
    for job, outcome in zip(jobs, outcomes, strict=True):
        by_loop.setdefault(job.loop, []).append((job.future, outcome.value, outcome.error))
    for loop, settled in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody to tell
            loop.call_soon_threadsafe(_resolve_all, settled)


def _resolve_all(settled: list[_Settled]) -> None:
    for future, value, error in settled:
        if future.done():  # the caller was cancelled
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


@dataclass(frozen=True)
class _Outcome:
    value: Any = None
    error: BaseException | None = None


class _Writer:
    """The thread that owns the write connection and commits queued jobs in groups."""

    def __init__(self, conn: sqlite3.Connection, stats: base.StoreStats) -> None:
        self._conn = conn
        # A C queue: putting a job and waking the thread cost less than a Condition's Python.
        # ``None`` (queued once by ``stop``) ends the thread after the jobs before it.
        self._queue: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._submitting = threading.Lock()  # no job queued after the end marker
        self._closing = False
        self._drained = False  # the end marker was taken
        self._stats_lock = threading.Lock()
        self._stats = stats
        self._thread = threading.Thread(target=self._run, name="compactd-sqlite-writer")
        self._thread.daemon = True  # a process that never closes the store still exits
        self._thread.start()

    @property
    def stats(self) -> base.StoreStats:
        with self._stats_lock:
            return self._stats

    def submit(self, job: _Job[Any]) -> None:
        """Queues a job. Raises ``Unavailable`` once ``stop`` has begun."""
        with self._submitting:
            if self._closing:
                raise base.store_closed()
            self._queue.put(job)

    def stop(self) -> None:
        """Commits every queued job, then ends the thread and closes the connection."""
        with self._submitting:
            if not self._closing:
                self._closing = True
                self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        try:
            while group := self._next_group():
                try:
                    self._commit(group)
                except Exception as exc:  # a bug; callers must not wait forever
                    failed = _Outcome(error=errors.Internal(f"event store writer failed: {exc!r}"))
                    _settle(group, [failed] * len(group))
        finally:
            self._conn.close()

    def _next_group(self) -> list[_Job[Any]]:
        """Waits for work; returns up to ``_MAX_GROUP`` queued jobs, or [] once drained and
        closing."""
        if self._drained:
            return []
        group: list[_Job[Any]] = []
        job = self._queue.get()
        while job is not None:
            group.append(job)
            if len(group) >= _MAX_GROUP:
                return group
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return group
        self._drained = True
        return group

    def _commit(self, group: list[_Job[Any]]) -> None:
        started = time.perf_counter()
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            outcomes = self._apply_all(group)
            self._conn.execute("COMMIT")
        except Exception as exc:
            self._abandon(group, exc)
            return
        self._count(group, outcomes, started, time.perf_counter())
        _settle(group, outcomes)

    def _apply_all(self, group: list[_Job[Any]]) -> list[_Outcome]:
        """Runs the group's jobs, first without a savepoint each (two statements a job fewer):
        when none fails, as nearly always, that is all. When one raises (its own refusal, its
        ``ROLLBACK TO`` finding no savepoint, or the database), the transaction is rolled back
        and the group run again with a savepoint per job (``_apply``), so that job fails alone.
        The jobs are pure functions of the connection: running one twice writes it once."""
        values: list[Any] = []
        try:
            for job in group:
                values.append(job.op(self._conn))
        except Exception:
            self._conn.execute("ROLLBACK")
            self._conn.execute("BEGIN IMMEDIATE")
            return [self._apply(job) for job in group]
        return [_Outcome(value=value) for value in values]

    def _apply(self, job: _Job[Any]) -> _Outcome:
        """Runs one job in its own savepoint; its own refusal undoes it alone.

        A ``sqlite3.Error`` propagates: the database itself failed, so the group fails.
        """
        self._conn.execute(f"SAVEPOINT {_SAVEPOINT}")
        try:
            value = job.op(self._conn)
        except sqlite3.Error as exc:
            if not is_corruption(exc):
                raise
            # Damaged pages of this job's session: it fails alone, the others commit.
            self._conn.execute(f"ROLLBACK TO {_SAVEPOINT}")
            self._conn.execute(f"RELEASE {_SAVEPOINT}")
            return _Outcome(error=_store_failed("write", exc))
        except Exception as exc:  # a domain refusal (or a bug): this job alone fails
            self._conn.execute(f"ROLLBACK TO {_SAVEPOINT}")
            self._conn.execute(f"RELEASE {_SAVEPOINT}")
            return _Outcome(error=exc)
        self._conn.execute(f"RELEASE {_SAVEPOINT}")
        return _Outcome(value=value)

    def _abandon(self, group: list[_Job[Any]], exc: Exception) -> None:
        """Rolls the group back and fails every job in it: none was acknowledged."""
        if self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
        batches = sum(job.events is not None for job in group)
        with self._stats_lock:
            self._stats = self._stats.plus(batches=batches, failed_batches=batches)
        # A fresh error each: one raised in many tasks would tangle tracebacks.
        _settle(group, [_Outcome(error=_write_failed(exc)) for _ in group])

    def _count(
        self, group: list[_Job[Any]], outcomes: list[_Outcome], started: float, committed: float
    ) -> None:
        batches = [(j, o) for j, o in zip(group, outcomes, strict=True) if j.events is not None]
        with self._stats_lock:
            self._stats = self._stats.plus(
                commits=1,
                batches=len(batches),
                failed_batches=sum(o.error is not None for _, o in batches),
                events=sum(j.events or 0 for j, o in batches if o.error is None),
                commit_seconds=committed - started,
                queued_seconds=sum(started - job.queued for job in group),
            )


def _write_failed(exc: Exception) -> errors.CompactdError:
    if isinstance(exc, sqlite3.Error):
        return _store_failed("write", exc)
    return errors.Internal(f"event store write failed: {exc!r}")


# SQLITE_CORRUPT and SQLITE_NOTADB (primary codes: the low byte of an extended one).
_CORRUPTION_CODES = frozenset({11, 26})


def is_corruption(exc: BaseException) -> bool:
    """Whether ``exc`` says the database file is damaged (not merely busy or unreachable)."""
    if isinstance(exc, DecodeError):
        return True  # a stored event that no longer parses
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _CORRUPTION_CODES
    return "malformed" in str(exc) or "not a database" in str(exc)


def _store_failed(action: str, exc: Exception) -> errors.CompactdError:
    """The domain error for a failed ``action``: ``STORE_CORRUPT`` (DATA_LOSS) when the file is
    damaged, ``STORE_UNAVAILABLE`` otherwise; never an internal error with a traceback."""
    if is_corruption(exc):
        return errors.StoreCorrupt(
            f"event store {action} failed: the database file is damaged ({exc}); "
            "restore it from a backup"
        )
    return errors.StoreUnavailable(f"event store {action} failed: {exc}")


# --- write operations (run on the writer thread, inside the group's transaction) ----------------


_WHERE_KEY = "tenant = ? AND session_id = ?"


def _insert_session(record: base.SessionRecord, conn: sqlite3.Connection) -> None:
    try:
        conn.execute(
            "INSERT INTO sessions (tenant, session_id, create_time_us, policy_json, revision,"
            " update_time_us, parent_id, fork_at_seq) VALUES (?, ?, ?, ?, 0, ?, ?, ?)",
            (
                record.tenant,
                record.session_id,
                _to_us(record.create_time),
                record.policy_json,
                _to_us(record.last_active),
                record.parent_session_id or None,
                record.fork_at_seq,
            ),
        )
    except sqlite3.IntegrityError:
        raise base.session_exists(record.session_id) from None


def _delete_session(key: SessionKey, conn: sqlite3.Connection) -> bool:
    conn.execute(f"DELETE FROM snapshots WHERE {_WHERE_KEY}", key)
    conn.execute(f"DELETE FROM events WHERE {_WHERE_KEY}", key)
    return conn.execute(f"DELETE FROM sessions WHERE {_WHERE_KEY}", key).rowcount > 0


def _encode_and_insert(
    key: SessionKey, events: list[events_pb2.SessionEvent], now: datetime, conn: sqlite3.Connection
) -> int:
    return _insert_events(key, base.encode_batch(events), now, conn)


def _insert_events(
    key: SessionKey, rows: list[base.EventRow], now: datetime, conn: sqlite3.Connection
) -> int:
    session_id = key.session_id
    revision = _require_revision(key, conn)
    if not rows:
        return revision
    if rows[0].seq != revision:
        raise base.seq_conflict(session_id, rows[0].seq, revision)
    try:
        conn.executemany(
            "INSERT INTO events (tenant, session_id, seq, event_id, type, data)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            [(*key, r.seq, r.event_id, r.type, r.data) for r in rows],
        )
    except sqlite3.IntegrityError as exc:
        # The unique index refused an id. Undo this batch's own rows before asking which ids
        # were taken, so they are not mistaken for earlier ones.
        conn.execute(f"ROLLBACK TO {_SAVEPOINT}")
        ids = [r.event_id for r in rows if r.event_id is not None]
        taken = _select_event_ids(key, ids, conn)
        if not taken:  # the primary key refused a seq: the revision column lies
            raise errors.Internal(
                f"session {session_id!r}: seqs from {revision} already exist"
            ) from exc
        raise base.duplicate_event_ids(session_id, list(taken)) from None
    new_revision = revision + len(rows)
    conn.execute(
        f"UPDATE sessions SET revision = ?, update_time_us = ? WHERE {_WHERE_KEY}",
        (new_revision, _to_us(now), *key),
    )
    return new_revision


# --- read queries (run on a pooled read connection, inside one read transaction) ----------------


# A test hook: called between the two statements of a snapshot write, to prove a write that dies
# there leaves the old snapshot whole.
_between_snapshot_steps: Callable[[], None] = lambda: None  # noqa: E731


def _replace_snapshot(
    key: SessionKey, revision: int, data: bytes, conn: sqlite3.Connection
) -> None:
    _require_revision(key, conn)
    conn.execute(f"DELETE FROM snapshots WHERE {_WHERE_KEY}", key)
    _between_snapshot_steps()
    conn.execute(
        "INSERT INTO snapshots (tenant, session_id, revision, data) VALUES (?, ?, ?, ?)",
        (*key, revision, data),
    )


def _select_snapshot(key: SessionKey, conn: sqlite3.Connection) -> tuple[int, bytes] | None:
    row = conn.execute(f"SELECT revision, data FROM snapshots WHERE {_WHERE_KEY}", key).fetchone()
    return None if row is None else (int(row[0]), bytes(row[1]))


def _require_revision(key: SessionKey, conn: sqlite3.Connection) -> int:
    row = conn.execute(f"SELECT revision FROM sessions WHERE {_WHERE_KEY}", key).fetchone()
    if row is None:
        raise base.session_not_found(key.session_id)
    return int(row[0])


def _select_session(key: SessionKey, conn: sqlite3.Connection) -> base.SessionRecord | None:
    row = conn.execute(
        f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE {_WHERE_KEY}", key
    ).fetchone()
    return None if row is None else _session_record(row)


def _select_sessions(
    tenant: str, after: str, limit: int, parent: str | None, conn: sqlite3.Connection
) -> list[base.SessionRecord]:
    if parent is None:
        rows = conn.execute(
            f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE tenant = ? AND session_id > ?"
            " ORDER BY session_id LIMIT ?",
            (tenant, after, limit),
        ).fetchall()
    else:
        rows = conn.execute(
            f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE tenant = ? AND parent_id = ?"
            " AND session_id > ? ORDER BY session_id LIMIT ?",
            (tenant, parent, after, limit),
        ).fetchall()
    return [_session_record(row) for row in rows]


def _select_usage(
    tenant: str | None, session_id: str | None, conn: sqlite3.Connection
) -> dict[str, base.StoreUsage]:
    # One scan in C (length() of a blob needs no decoding): of everything at start, of one
    # session's rows (its primary key's prefix) before it is deleted.
    clauses = [("tenant = ?", tenant), ("session_id = ?", session_id)]
    kept = [(clause, value) for clause, value in clauses if value is not None]
    where = ("WHERE " + " AND ".join(clause for clause, _ in kept)) if kept else ""
    args = tuple(value for _, value in kept)
    sessions = conn.execute(
        f"SELECT tenant, count(*) FROM sessions {where} GROUP BY tenant", args
    ).fetchall()
    sizes = dict(
        conn.execute(
            f"SELECT tenant, coalesce(sum(length(data)), 0) FROM events {where} GROUP BY tenant",
            args,
        ).fetchall()
    )
    return {
        str(owner): base.StoreUsage(int(count), int(sizes.get(owner, 0)))
        for owner, count in sessions
    }


def _select_range(
    key: SessionKey, start: int, stop: int, conn: sqlite3.Connection
) -> list[events_pb2.SessionEvent]:
    rows = conn.execute(
        f"SELECT data FROM events WHERE {_WHERE_KEY} AND seq >= ? AND seq < ? ORDER BY seq",
        (*key, start, stop),
    ).fetchall()
    return [base.decode_event(row[0]) for row in rows]


def _select_seqs(
    key: SessionKey, seqs: list[int], conn: sqlite3.Connection
) -> list[events_pb2.SessionEvent]:
    _require_revision(key, conn)
    found: list[events_pb2.SessionEvent] = []
    for chunk in _chunks(seqs):
        rows = conn.execute(
            f"SELECT data FROM events WHERE {_WHERE_KEY} AND seq IN ({_marks(chunk)}) ORDER BY seq",
            (*key, *chunk),
        ).fetchall()
        found.extend(base.decode_event(row[0]) for row in rows)
    return found


def _select_stored(key: SessionKey, seqs: list[int], conn: sqlite3.Connection) -> dict[int, bytes]:
    """The rows' bytes at ``seqs`` (ascending): each run of consecutive seqs read as one range
    of the primary key (a restore's surface is mostly such runs), not an ``IN`` list."""
    _require_revision(key, conn)
    found: dict[int, bytes] = {}
    for first, last in _runs(seqs):
        rows = conn.execute(
            f"SELECT seq, data FROM events WHERE {_WHERE_KEY} AND seq >= ? AND seq <= ?",
            (*key, first, last),
        )
        found.update(rows)
    return found


def _runs(seqs: list[int]) -> list[tuple[int, int]]:
    """``seqs`` (ascending, distinct) as runs of consecutive seqs: (first, last) each."""
    runs: list[tuple[int, int]] = []
    for seq in seqs:
        if runs and runs[-1][1] == seq - 1:
            runs[-1] = (runs[-1][0], seq)
        else:
            runs.append((seq, seq))
    return runs


def _select_event_ids(
    key: SessionKey, event_ids: list[str], conn: sqlite3.Connection
) -> dict[str, int]:
    _require_revision(key, conn)
    found: dict[str, int] = {}
    for chunk in _chunks(event_ids):
        rows = conn.execute(
            "SELECT event_id, seq FROM events"
            f" WHERE {_WHERE_KEY} AND event_id IN ({_marks(chunk)})",
            (*key, *chunk),
        ).fetchall()
        found.update((str(row[0]), int(row[1])) for row in rows)
    return found


class _ReadPool:
    """A few reusable read-only connections; each serves one thread at a time."""

    _MAX_IDLE = 4

    def __init__(self, path: str, busy_timeout_ms: int) -> None:
        self._path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def run(self, query: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``query`` in one read transaction, so all its statements see one snapshot."""
        with self._connection() as conn:
            conn.execute("BEGIN")
            try:
                return query(conn)
            finally:
                conn.execute("COMMIT")

    def reopen(self) -> None:
        with self._lock:
            self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        finally:
            with self._lock:
                keep = not self._closed and len(self._idle) < self._MAX_IDLE
                if keep:
                    self._idle.append(conn)
            if not keep:
                conn.close()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
        conn.execute("PRAGMA query_only = ON")
        return conn


# --- helpers ------------------------------------------------------------------------------------


def _migrate(conn: sqlite3.Connection, path: str) -> None:
    """Creates the schema in a fresh file, upgrades an older one (version 1's sessions go to the
    default tenant); refuses a file written by a newer version."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise errors.StartupError(
            f"{path}: schema version {version} is newer than this server's ({SCHEMA_VERSION})",
            reason=Reason.SCHEMA_TOO_NEW,
        )
    conn.execute("BEGIN IMMEDIATE")
    try:
        if version == 1:
            _run_script(conn, _FROM_V1.format(schema=_SCHEMA.strip().rstrip(";")))
        elif version == 2:
            _run_script(conn, _FROM_V2)
        _run_script(conn, _SCHEMA)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _run_script(conn: sqlite3.Connection, script: str) -> None:
    # executescript() would COMMIT first; run statement by statement inside our transaction.
    for statement in script.split(";"):
        if statement.strip():
            named = {"tenant": DEFAULT_TENANT_ID} if ":tenant" in statement else {}
            conn.execute(statement, named)


def _read_pragmas(conn: sqlite3.Connection) -> dict[str, str | int]:
    sync_names = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}

    def value(name: str) -> Any:
        return conn.execute(f"PRAGMA {name}").fetchone()[0]

    return {
        "journal_mode": str(value("journal_mode")).lower(),
        "synchronous": sync_names.get(int(value("synchronous")), "?"),
        "foreign_keys": int(value("foreign_keys")),
        "busy_timeout": int(value("busy_timeout")),
    }


def _session_record(row: tuple[Any, ...]) -> base.SessionRecord:
    session_id, create_time_us, policy_json, revision, tenant, update_time_us, parent, fork = row
    return base.SessionRecord(
        str(session_id),
        _from_us(create_time_us),
        policy_json,
        int(revision),
        str(tenant),
        _from_us(update_time_us),
        str(parent or ""),
        None if fork is None else int(fork),
    )


def _to_us(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(microseconds=1)


def _from_us(micros: int) -> datetime:
    return _EPOCH + timedelta(microseconds=micros)


def _chunks(items: Sequence[T]) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), _IN_CHUNK):
        yield items[start : start + _IN_CHUNK]


def _marks(items: Sequence[object]) -> str:
    return ", ".join("?" * len(items))
