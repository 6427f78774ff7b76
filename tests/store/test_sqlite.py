"""What only the SQLite store promises: its pragmas, group commit, reopening, its schema."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from compactd import errors
from compactd.store import SqliteEventStore
from compactd.store.sqlite import SCHEMA_VERSION

from .builders import batch, user_event, wire


@contextlib.contextmanager
def write_lock_held(path: Path) -> Iterator[None]:
    """Holds the database's write lock from another connection, so the store's writer thread
    waits in BEGIN and every job submitted meanwhile queues up for the next group."""
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
        other.execute("ROLLBACK")
    finally:
        other.close()


async def test_open_sets_wal_full_sync_foreign_keys_and_busy_timeout(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    async with SqliteEventStore(str(path), busy_timeout_ms=1234) as store:
        pragmas = store.writer_pragmas

    assert pragmas == {
        "journal_mode": "wal",
        "synchronous": "FULL",
        "foreign_keys": 1,
        "busy_timeout": 1234,
    }
    with contextlib.closing(sqlite3.connect(path)) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("level", ["NORMAL", "extra", "Full"])
async def test_synchronous_level_is_configurable(tmp_path: Path, level: str) -> None:
    async with SqliteEventStore(str(tmp_path / "e.db"), synchronous=level) as store:
        assert store.writer_pragmas["synchronous"] == level.upper()


@pytest.mark.parametrize("level", ["OFF", "fast", ""])
def test_unknown_synchronous_level_raises_config_error(tmp_path: Path, level: str) -> None:
    with pytest.raises(errors.ConfigError):
        SqliteEventStore(str(tmp_path / "e.db"), synchronous=level)


async def test_concurrent_appends_share_commits(tmp_path: Path) -> None:
    path = tmp_path / "e.db"
    async with SqliteEventStore(str(path)) as store:
        for i in range(64):
            await store.create_session(f"s{i}", None)
        before = store.stats

        with write_lock_held(path):
            tasks = [asyncio.create_task(store.append(f"s{i}", batch(0, 2))) for i in range(64)]
            await asyncio.sleep(0)  # every task runs to its first await: all are queued
        assert await asyncio.gather(*tasks) == [2] * 64

        commits = store.stats.commits - before.commits
        batches = store.stats.batches - before.batches
    assert batches == 64
    assert commits <= 2  # the writer held at most one job when it blocked; the rest shared one


async def test_a_batch_failing_its_checks_fails_alone_in_a_shared_commit(tmp_path: Path) -> None:
    path = tmp_path / "e.db"
    async with SqliteEventStore(str(path)) as store:
        for session_id in ["ok1", "race", "dup", "ok2"]:
            await store.create_session(session_id, None)
        await store.append("dup", [user_event(0, "taken")])
        before = store.stats

        appends = [
            ("ok1", batch(0, 3, "ok1-")),
            ("race", batch(0, 2, "first-")),
            ("race", batch(0, 2, "second-")),  # conflicts with the batch before it
            ("dup", [user_event(1, "fresh"), user_event(2, "taken")]),
            ("missing", batch(0, 1)),
            ("ok2", batch(0, 4, "ok2-")),
        ]
        with write_lock_held(path):
            tasks = [asyncio.create_task(store.append(s, events)) for s, events in appends]
            await asyncio.sleep(0)
        results = await asyncio.gather(*tasks, return_exceptions=True)

        assert results[0] == 3
        assert results[1] == 2
        assert isinstance(results[2], errors.SeqConflict)
        assert isinstance(results[3], errors.InvalidArgument)
        assert isinstance(results[4], errors.NotFound)
        assert results[5] == 4
        assert store.stats.commits - before.commits <= 2
        assert store.stats.failed_batches - before.failed_batches == 3
        assert [e.event_id async for e in store.read("race")] == ["first-0", "first-1"]
        assert [e.event_id async for e in store.read("dup")] == ["taken"]
        assert len([e async for e in store.read("ok2")]) == 4


async def test_reopening_the_file_reads_everything_back(tmp_path: Path) -> None:
    path = str(tmp_path / "e.db")
    async with SqliteEventStore(path) as store:
        created = await store.create_session("a", '{"retainRatio": 0.3}')
        await store.create_session("b", None)
        await store.append("a", batch(0, 40, "a-"))
        await store.append("a", batch(40, 2, "a-"))
        await store.append("b", batch(0, 1))

    async with SqliteEventStore(path) as reopened:
        record = await reopened.get_session("a")
        assert record is not None
        assert (record.create_time, record.policy_json) == (
            created.create_time,
            '{"retainRatio": 0.3}',
        )
        assert (record.revision, record.tenant) == (42, "default")
        assert [r.session_id for r in await reopened.list_sessions()] == ["a", "b"]
        assert wire([e async for e in reopened.read("a")]) == wire(batch(0, 42, "a-"))
        assert await reopened.find_event_ids("a", ["a-41"]) == {"a-41": 41}
        assert await reopened.append("a", batch(42, 1)) == 43


async def test_appends_from_other_event_loops_queued_in_one_group_are_each_answered(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e.db"
    async with SqliteEventStore(str(path)) as store:
        for i in range(8):
            await store.create_session(f"s{i}", None)

        def on_another_loop(i: int) -> int:
            return asyncio.run(store.append(f"s{i}", batch(0, 2)))

        with write_lock_held(path):  # every append queues behind the held lock: one group
            here = [asyncio.create_task(store.append(f"s{i}", batch(0, 2))) for i in range(4)]
            there = [
                asyncio.create_task(asyncio.to_thread(on_another_loop, i)) for i in range(4, 8)
            ]
            await asyncio.sleep(0.3)
        assert await asyncio.gather(*here, *there) == [2] * 8
        assert [r.revision for r in await store.list_sessions()] == [2] * 8


async def test_close_commits_appends_already_queued(tmp_path: Path) -> None:
    path = str(tmp_path / "e.db")
    store = SqliteEventStore(path)
    await store.open()
    for i in range(20):
        await store.create_session(f"s{i}", None)

    tasks = [asyncio.create_task(store.append(f"s{i}", batch(0, 3))) for i in range(20)]
    await asyncio.sleep(0)  # all queued
    await store.close()

    assert await asyncio.gather(*tasks) == [3] * 20
    async with SqliteEventStore(path) as reopened:
        assert all(r.revision == 3 for r in await reopened.list_sessions())


async def test_events_carry_their_spec_type_and_event_id_columns(tmp_path: Path) -> None:
    path = tmp_path / "e.db"
    async with SqliteEventStore(str(path)) as store:
        await store.create_session("s", None)
        events = [user_event(0, "u"), user_event(1)]
        events[1].ClearField("user_message")
        events[1].compaction_summary_error.compaction_id = "k"
        await store.append("s", events)

    with contextlib.closing(sqlite3.connect(path)) as raw:
        rows = raw.execute("SELECT seq, event_id, type FROM events ORDER BY seq").fetchall()
    assert rows == [(0, "u", "user/message"), (1, None, "compaction/summary-error")]


async def test_the_unique_index_refuses_a_duplicate_id_written_behind_the_store(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e.db"
    async with SqliteEventStore(str(path)) as store:
        await store.create_session("s", None)
        await store.append("s", [user_event(0, "x")])

    with contextlib.closing(sqlite3.connect(path)) as raw, pytest.raises(sqlite3.IntegrityError):
        raw.execute(
            "INSERT INTO events (session_id, seq, event_id, type, data) VALUES (?, ?, ?, ?, ?)",
            ("s", 1, "x", "user/message", b""),
        )


async def test_a_file_from_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "e.db"
    with contextlib.closing(sqlite3.connect(path)) as raw:
        raw.execute("PRAGMA user_version = 99")

    with pytest.raises(errors.StartupError) as raised:  # exit 3 at start, no traceback
        await SqliteEventStore(str(path)).open()
    assert raised.value.reason == "SCHEMA_TOO_NEW"


async def test_stats_survive_close(tmp_path: Path) -> None:
    store = SqliteEventStore(str(tmp_path / "e.db"))
    async with store:
        await store.create_session("s", None)
        await store.append("s", batch(0, 5))

    assert (store.stats.batches, store.stats.events) == (1, 5)


async def test_a_database_failure_fails_the_whole_group_and_the_store_recovers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e.db"
    async with SqliteEventStore(str(path), busy_timeout_ms=20) as store:
        await store.create_session("s", None)

        with write_lock_held(path):  # held past the busy timeout: the writer's BEGIN fails
            results = await asyncio.gather(
                store.append("s", batch(0, 2)),
                store.append("s", batch(0, 2)),
                return_exceptions=True,
            )

        assert all(isinstance(r, errors.Unavailable) for r in results)
        assert [e async for e in store.read("s")] == []
        assert await store.append("s", batch(0, 2)) == 2
        assert store.stats.failed_batches == 2


_SCHEMA_V1 = """
CREATE TABLE sessions (
    session_id     TEXT PRIMARY KEY,
    create_time_us INTEGER NOT NULL,
    policy_json    TEXT,
    revision       INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE events (
    session_id TEXT NOT NULL REFERENCES sessions (session_id),
    seq        INTEGER NOT NULL,
    event_id   TEXT,
    type       TEXT NOT NULL,
    data       BLOB NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE UNIQUE INDEX events_event_id ON events (session_id, event_id) WHERE event_id IS NOT NULL;
PRAGMA user_version = 1;
"""


def _old_database(path: Path) -> list[bytes]:
    """A database as the version-1 schema (before tenants) wrote it; returns its log's bytes."""
    events = batch(0, 3, "old-")
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA_V1)
    conn.execute("INSERT INTO sessions VALUES ('legacy', 1700000000000000, '{\"x\": 1}', 3)")
    conn.executemany(
        "INSERT INTO events VALUES ('legacy', ?, ?, 'user/message', ?)",
        [(e.seq, e.event_id, e.SerializeToString(deterministic=True)) for e in events],
    )
    conn.commit()
    conn.close()
    return wire(events)


async def test_a_version_1_database_migrates_its_sessions_to_the_default_tenant(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    log = _old_database(path)

    async with SqliteEventStore(str(path)) as store:
        record = await store.get_session("legacy")
        assert record is not None
        assert (record.tenant, record.revision, record.policy_json) == ("default", 3, '{"x": 1}')
        assert record.last_active == record.create_time
        assert wire([e async for e in store.read("legacy")]) == log
        assert await store.find_event_ids("legacy", ["old-2"]) == {"old-2": 2}
        assert await store.get_session("legacy", tenant="other") is None
        assert await store.append("legacy", batch(3, 1, "old-")) == 4

    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"sessions", "events", "snapshots"}  # snapshots: issue 11
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    conn.close()


async def test_a_version_2_database_gains_the_parent_columns(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    async with SqliteEventStore(str(path)) as store:
        await store.create_session("kept", '{"x": 1}')
        await store.append("kept", batch(0, 2))
    conn = sqlite3.connect(path)  # back to version 2: its sessions table had no parent columns
    conn.executescript(
        "DROP INDEX sessions_parent; ALTER TABLE sessions DROP COLUMN parent_id;"
        " ALTER TABLE sessions DROP COLUMN fork_at_seq; PRAGMA user_version = 2;"
    )
    conn.close()

    async with SqliteEventStore(str(path)) as store:
        record = await store.get_session("kept")
        assert record is not None
        assert (record.revision, record.parent_session_id, record.fork_at_seq) == (2, "", None)
        await store.create_session("kept.child", None, parent="kept", fork_at_seq=1)
        assert [r.session_id for r in await store.list_sessions(parent="kept")] == ["kept.child"]
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    conn.close()


async def test_a_stored_event_that_no_longer_parses_is_store_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "e.db"
    async with SqliteEventStore(str(path)) as store:
        await store.create_session("s", None)
        await store.append("s", batch(0, 2))
    with contextlib.closing(sqlite3.connect(path)) as raw, raw:
        raw.execute("UPDATE events SET data = x'ffffffff' WHERE seq = 1")

    async with SqliteEventStore(str(path)) as store:
        with pytest.raises(errors.StoreCorrupt) as caught:
            _ = [event async for event in store.read("s")]
        assert caught.value.reason == "STORE_CORRUPT"
