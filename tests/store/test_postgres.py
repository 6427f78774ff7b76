"""What only the PostgreSQL store does: schema versions, failures as UNAVAILABLE, replicas."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import psycopg
import pytest

from compactd import cli, deadlines, errors
from compactd.store import base, postgres_schema
from compactd.store import postgres as postgres_store
from compactd.store.postgres import PostgresEventStore
from compactd.v1 import events_pb2
from tests import postgres
from tests.blackhole import BlackHoleRelay

from .builders import batch

V = postgres_schema.SCHEMA_VERSION


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    yield from postgres.database()


@pytest.fixture
def url(database: str) -> str:
    return postgres.fresh_schema(database)


@pytest.fixture
async def store(url: str) -> AsyncIterator[PostgresEventStore]:
    async with PostgresEventStore(url) as opened:
        yield opened


async def _at_version(url: str, version: int) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await postgres_schema.migrate(conn, target=version)


async def test_an_empty_database_is_created_at_the_current_schema(url: str) -> None:
    async with PostgresEventStore(url) as store:
        assert store.schema_version == postgres_schema.SCHEMA_VERSION


async def test_a_replica_refuses_an_older_schema_until_it_is_migrated(url: str) -> None:
    await _at_version(url, 1)

    with pytest.raises(errors.StartupError) as raised:
        await PostgresEventStore(url).open()

    assert raised.value.reason == "SCHEMA_TOO_OLD"
    assert (
        f"version 1, older than the version {postgres_schema.SCHEMA_VERSION}"
        in raised.value.message
    )
    assert "compactd migrate" in raised.value.message
    async with PostgresEventStore(url, migrate=True) as store:
        assert store.schema_version == postgres_schema.SCHEMA_VERSION
    async with PostgresEventStore(url) as store:  # migrated once, served by everyone after
        assert store.schema_version == postgres_schema.SCHEMA_VERSION


async def test_a_replica_refuses_a_newer_schema(url: str) -> None:
    await _at_version(url, postgres_schema.SCHEMA_VERSION)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("UPDATE compactd_schema SET version = 99")

    for migrate in (False, True):
        with pytest.raises(errors.StartupError) as raised:
            await PostgresEventStore(url, migrate=migrate).open()
        assert raised.value.reason == "SCHEMA_TOO_NEW"
        assert (
            f"version 99, newer than the version {postgres_schema.SCHEMA_VERSION}"
            in raised.value.message
        )


async def test_an_unreachable_database_refuses_to_start_without_its_password() -> None:
    store = PostgresEventStore(
        "postgresql://postgres:secret@127.0.0.1:1/none", connect_timeout_s=0.5
    )

    with pytest.raises(errors.StartupError) as raised:
        await store.open()

    assert raised.value.reason == "STORE_UNAVAILABLE"
    assert "secret" not in raised.value.message


async def test_a_database_that_goes_away_fails_unavailable_then_recovers(
    url: str, database: str
) -> None:
    async with PostgresEventStore(url, connect_timeout_s=0.5) as store:
        await store.create_session("s", None)
        await store.append("s", batch(0, 2))

        with postgres.refusing_connections(database):
            postgres.terminate_backends(database)
            with pytest.raises(errors.StoreUnavailable) as raised:
                await store.append("s", batch(2, 1))
            with pytest.raises(errors.StoreUnavailable):
                await store.get_session("s")

        assert raised.value.reason == "STORE_UNAVAILABLE"
        assert await _eventually(lambda: store.append("s", batch(2, 1))) == 3
        assert [e.seq async for e in store.read("s")] == [0, 1, 2]


async def _eventually(call: Callable[[], Awaitable[int]]) -> int:
    """``call()``'s answer once the pool has reconnected (it backs off between attempts)."""
    async with asyncio.timeout(20):
        while True:
            try:
                return await call()
            except errors.StoreUnavailable:
                await asyncio.sleep(0.1)


async def test_a_statement_past_its_timeout_fails_unavailable(url: str) -> None:
    async with PostgresEventStore(url, statement_timeout_ms=100) as store:
        await store.create_session("s", None)
        async with await psycopg.AsyncConnection.connect(url) as blocker:
            await blocker.execute("SELECT 1 FROM sessions WHERE session_id = 's' FOR UPDATE")
            with pytest.raises(errors.StoreUnavailable):
                await store.append("s", batch(0, 1))
            await blocker.rollback()
        assert await store.append("s", batch(0, 1)) == 1


async def test_replicas_racing_on_one_session_keep_its_seqs_gapless(url: str) -> None:
    replicas = [PostgresEventStore(url) for _ in range(3)]
    for replica in replicas:
        await replica.open()
    await replicas[0].create_session("s", None)

    async def writer(replica: PostgresEventStore, name: str) -> int:
        landed = 0
        while landed < 10:
            revision = (await replica.get_session("s")).revision  # type: ignore[union-attr]
            try:
                await replica.append("s", batch(revision, 2, prefix=f"{name}-{landed}-"))
            except errors.SeqConflict:
                continue
            landed += 1
        return landed

    try:
        done = await asyncio.gather(*(writer(r, f"r{i}") for i, r in enumerate(replicas)))
        seqs = [e.seq async for e in replicas[1].read("s")]
    finally:
        for replica in replicas:
            await replica.close()
    assert done == [10, 10, 10]
    assert seqs == list(range(60))


async def test_a_replica_hears_of_another_replicas_appends_but_not_its_own(url: str) -> None:
    async with PostgresEventStore(url) as a, PostgresEventStore(url) as b:
        await a.create_session("s", None)
        heard: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

        async def listen() -> None:
            async for key in a.changes():
                await heard.put(key)

        listener = asyncio.create_task(listen())
        try:
            assert await asyncio.wait_for(heard.get(), 5) == ("", "")  # connected: catch up
            await a.append("s", batch(0, 1))
            await b.append("s", batch(1, 1))
            assert await asyncio.wait_for(heard.get(), 5) == ("default", "s")
            assert heard.empty()
        finally:
            listener.cancel()


def _sync_at_version(url: str, version: int) -> None:
    asyncio.run(_at_version(url, version))


def test_serve_refuses_an_older_schema_and_migrate_brings_it_up(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _sync_at_version(url, 1)
    serve = ["serve", "--store", url, "--listen", "127.0.0.1:0"]

    assert cli.main(serve) == cli.EXIT_STARTUP
    refused = capsys.readouterr().err
    assert (
        f"schema is at version 1, older than the version {postgres_schema.SCHEMA_VERSION}"
        in refused
    )
    assert "compactd migrate" in refused

    assert cli.main(["migrate", "--store", url]) == 0
    assert capsys.readouterr().out.strip() == f"schema at version {postgres_schema.SCHEMA_VERSION}"
    assert cli.main(["migrate", "--store", url]) == 0  # idempotent


async def test_read_seqs_parses_the_events_off_the_event_loop(
    store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.create_session("s", None)
    await store.append("s", batch(0, 600))
    parsed_in: set[int] = set()
    decode = base.decode_event

    def watched(data: bytes) -> events_pb2.SessionEvent:
        parsed_in.add(threading.get_ident())
        return decode(data)

    monkeypatch.setattr(base, "decode_event", watched)
    monkeypatch.setattr(postgres_store, "SEQS_PER_READ", 256)  # three queries
    found = await store.read_seqs("s", range(600))
    # A restore reads a whole surface at once: tens of thousands of events parsed on the loop
    # would pause every other call for as long.
    assert [e.seq for e in found] == list(range(600))
    assert parsed_in
    assert threading.get_ident() not in parsed_in


# ---- a database that stops answering (audit item 4) ------------------------------------------


@contextlib.asynccontextmanager
async def behind_a_black_hole(url: str) -> AsyncIterator[tuple[BlackHoleRelay, str]]:
    target = urllib.parse.urlsplit(url)
    async with BlackHoleRelay(target.hostname or "127.0.0.1", target.port or 5432) as relay:
        yield relay, relay.url(url)


async def _timed(call: Awaitable[object]) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        await asyncio.wait_for(call, 20)  # a hang fails the test (TimeoutError) rather than it
    except BaseException as error:  # what it raised is the measurement
        return time.monotonic() - started, error
    return time.monotonic() - started, None


async def test_every_operation_on_a_database_that_stops_answering_ends_within_its_budget(
    url: str,
) -> None:
    async with behind_a_black_hole(url) as (relay, relayed):
        store = PostgresEventStore(relayed, connect_timeout_s=0.5, statement_timeout_ms=500)
        await store.open()
        await store.create_session("s", None)
        await store.append("s", batch(0, 2))
        relay.swallow()  # the host goes silent: no reset, no answer

        calls = {
            "get_session": lambda: store.get_session("s"),
            "append": lambda: store.append("s", batch(2, 1)),
            "read": lambda: _drain(store.read("s")),
            "read_seqs": lambda: store.read_seqs("s", [0]),
            "create_session": lambda: store.create_session("t", None),
            "get_lease": lambda: store.get_lease("s"),
        }
        for name, call in calls.items():
            took, error = await _timed(call())
            assert isinstance(error, errors.StoreUnavailable), (name, error)
            assert took < store.budget_s() + 0.5, (name, took)
        await asyncio.wait_for(store.close(), 30)


async def test_an_operation_ends_before_the_calls_deadline(url: str) -> None:
    async with behind_a_black_hole(url) as (relay, relayed):
        store = PostgresEventStore(relayed, connect_timeout_s=3, statement_timeout_ms=5000)
        await store.open()
        await store.create_session("s", None)
        relay.swallow()

        deadlines.bind(1.0)  # the call being served has a second left
        took, error = await _timed(store.get_session("s"))

        assert isinstance(error, errors.StoreUnavailable)
        assert 0.8 < took < 1.0  # answered before the deadline, not at the pool's 8 s
        deadlines.bind(None)
        await asyncio.wait_for(store.close(), 30)


async def _drain(events: AsyncIterator[object]) -> None:
    async for _ in events:
        pass


# ---- the append rate every replica shares (audit item 15) ------------------------------------


async def test_replicas_take_append_tokens_from_one_bucket_per_tenant(url: str) -> None:
    async with PostgresEventStore(url) as a, PostgresEventStore(url) as b:
        # A burst of 3 at 0.01 a second: no refill to speak of during the test.
        taken = [await store.take_append_token("t", 0.01, 3) for store in [a, b] * 3]
        other = await b.take_append_token("u", 0.01, 3)  # another tenant's own bucket

    assert taken[:3] == [0.0, 0.0, 0.0]
    assert all(wait is not None and 90 < wait <= 100 for wait in taken[3:])  # ~1 token / 0.01
    assert other == 0.0


async def test_concurrent_takes_never_hand_out_more_than_the_bucket_holds(url: str) -> None:
    async with PostgresEventStore(url, pool_max=8) as a, PostgresEventStore(url) as b:
        waits = await asyncio.gather(
            *(store.take_append_token("t", 0.01, 5) for store in [a, b] * 20)
        )
    assert sum(wait == 0.0 for wait in waits) == 5
