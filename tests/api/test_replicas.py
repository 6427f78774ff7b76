"""Two replicas in one process, one PostgreSQL: any replica can take any call.

Each server here is a whole compactd (its own session cache, its own instance id) over a shared
database schema; ``tests/test_process_replicas.py`` does the same with real processes, SIGKILL
and SIGSTOP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace

from compactd.api.server import create_server
from compactd.core import fold as fold_module
from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from tests import postgres
from tests.api.rpc import details
from tests.builders import assistant, step_end, step_start, turn_end, turn_start, user
from tests.compaction_fixtures import (
    MODEL,
    PROVIDER,
    Harness,
    body,
    opening,
    server_config,
    units,
)


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    yield from postgres.database()


@asynccontextmanager
async def replicas(
    tmp_path: Path, loop: OpenAICompatServer, url: str, count: int = 2, **settings: Any
) -> AsyncIterator[list[Harness]]:
    """``count`` servers on one PostgreSQL schema, a harness (same session id) for each."""
    base = dataclasses.replace(server_config(tmp_path, loop), store=url, **settings)
    async with AsyncExitStack() as stack:
        harnesses = []
        for _ in range(count):
            running = await create_server(base, tracer_provider=trace.NoOpTracerProvider())
            stack.push_async_callback(running.stop, 0)
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(running.address))
            harnesses.append(Harness(channel, loop, running))
        yield harnesses


def seqs(events: Sequence[events_pb2.SessionEvent]) -> list[int]:
    return [e.seq for e in events]


def wire(events: Sequence[events_pb2.SessionEvent]) -> list[bytes]:
    return [e.SerializeToString(deterministic=True) for e in events]


async def test_appends_through_two_replicas_at_once_stay_gapless_and_agree(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening())
        sent = await asyncio.gather(
            *(h.append(user(f"from {i % 2}-{i}")) for i, h in enumerate([a, b] * 15))
        )

        log_a, log_b = await a.events(), await b.events()
        assert sorted(s for batch in sent for s in batch) == list(range(len(opening()), 32))
        assert seqs(log_a) == list(range(32))
        assert wire(log_a) == wire(log_b)
        assert await a.surface() == await b.surface()
        assert await a.build() == await b.build()
        assert (await a.pressure()).measured_tokens == (await b.pressure()).measured_tokens


async def test_appends_abandoned_under_contention_leave_no_unretrieved_task_exception(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    # A caller whose deadline passes mid-commit leaves the commit to finish alone; when another
    # replica's append made it a seq conflict, its failure was nobody's and asyncio logged it
    # ("Task exception was never retrieved", a traceback at ERROR). This reproduces the audit's
    # run (it failed about every other run before the fix); tests/service/test_sessions.py
    # proves the cause deterministically.
    unretrieved: list[dict[str, Any]] = []
    aio = asyncio.get_running_loop()
    previous = aio.get_exception_handler()
    aio.set_exception_handler(lambda _, context: unretrieved.append(context))
    try:
        async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
            await a.create(*opening())

            async def abandoned(h: Harness, i: int) -> None:
                request = spb.AppendEventsRequest(session_id=h.session_id, events=[user(f"{i}")])
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await h.sessions.AppendEvents(request, timeout=0.002 * (i % 7 + 1))

            for rounds in range(10):
                await asyncio.gather(
                    *(abandoned(h, rounds * 40 + i) for i, h in enumerate([a, b] * 20))
                )
            await asyncio.sleep(0.2)  # the abandoned commits finish
            gc.collect()  # asyncio reports an unretrieved exception when its task is freed
        gc.collect()
    finally:
        aio.set_exception_handler(previous)
    assert [c.get("message") for c in unretrieved] == []


async def test_three_replicas_share_one_append_rate_per_tenant(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    # Each replica used to keep its own bucket: behind three, a tenant had three times its rate.
    quotas = {"appends_per_second": 1, "append_burst": 4}
    schema = postgres.fresh_schema(database)
    async with replicas(tmp_path, loop, schema, count=3, quotas=quotas) as three:
        await three[0].create()

        async def append(h: Harness, i: int) -> str:
            try:
                await h.append(user(f"{i}"))
            except grpc.aio.AioRpcError as error:
                return details(error).reason
            return "OK"

        started = asyncio.get_running_loop().time()
        answers = await asyncio.gather(*(append(h, i) for i, h in enumerate(three * 4)))
        elapsed = asyncio.get_running_loop().time() - started

    assert set(answers) <= {"OK", "QUOTA_EXCEEDED"}
    # The burst, and what one a second refills meanwhile (a refused call is held up to 0.25 s).
    assert 4 <= answers.count("OK") <= 4 + int(elapsed) + 1


async def test_a_read_through_one_replica_shows_what_another_just_appended(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening())
        before = await a.surface()  # A has the session cached now

        await b.append(user("only B saw this"))

        after = await a.surface()
        assert after.revision == before.revision + 1
        assert len(after.nodes) == len(before.nodes) + 1


async def test_a_step_opened_through_one_replica_goes_on_through_another(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening())
        await a.append(turn_start(1))  # A caches the session with the turn open, no step yet
        await b.append(user("go"), step_start(1, 1))

        # A's cached fold has no open step: decided on it, the answer would be STEP_BRACKET.
        await a.append(assistant("done"), step_end(1, 1), turn_end(1))

        kinds = [body(e) for e in await b.events()][-6:]
        assert kinds == [
            "turn_start", "user_message", "step_start", "assistant_message", "step_end", "turn_end"
        ]  # fmt: skip


async def test_a_step_reads_the_sessions_revision_once_on_a_replica(
    tmp_path: Path, loop: OpenAICompatServer, database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening())
        await a.append(turn_start(1), user("go"))
        await b.append(step_start(1, 1))
        assert a.server is not None
        # A's follower catches up on B's append: no read of its own falls in the steps below.
        handle = await a.server.manager.get(a.session_id, fresh=False)
        for _ in range(1000):
            if handle.revision == len(opening()) + 3:
                break
            await asyncio.sleep(0.01)
        assert handle.revision == len(opening()) + 3
        store = a.server.store
        reads = 0
        get_session = store.get_session

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal reads
            reads += 1
            return await get_session(*args, **kwargs)

        monkeypatch.setattr(store, "get_session", counted)
        for route in (None, events_pb2.Route(provider=PROVIDER, model=MODEL)):
            reads = 0
            run = await a.prepare(1, route)
            assert run.result.request_revision == len(opening()) + 3  # B's step start is in it
            assert reads == 1  # one catch-up, not one per lookup of the session


async def test_expected_last_seq_holds_across_replicas(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening())
        last = (await a.events())[-1].seq
        await b.append(user("B first"))

        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await a.sessions.AppendEvents(
                spb.AppendEventsRequest(
                    session_id=a.session_id, events=[user("A, too late")], expected_last_seq=last
                )
            )
        assert details(raised.value).reason == "SEQ_CONFLICT"


async def test_a_retried_batch_through_another_replica_is_answered_not_doubled(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening())
        event = user("once")
        event.event_id = "retry-me"
        first = await a.append(event)
        again = await b.append(event)

        assert first == again
        assert [e.event_id for e in await b.events()].count("retry-me") == 1


async def test_a_late_retry_through_another_replica_is_answered_from_the_log(
    tmp_path: Path, loop: OpenAICompatServer, database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its ids are older than either replica's fold keeps: the store answers for them."""
    monkeypatch.setattr(fold_module, "RECENT_EVENT_IDS", 1)
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening())
        event = user("once")
        event.event_id = "late-retry"
        first = await a.append(event)
        later = user("later")
        later.event_id = "later"
        await a.append(later)
        again = await b.append(event)

        assert first == again
        assert [e.event_id for e in await b.events()].count("late-retry") == 1


async def test_follow_and_watch_on_one_replica_see_appends_through_another(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening())
        start = len(opening())
        follow = a.sessions.ListEvents(
            spb.ListEventsRequest(session_id=a.session_id, from_seq=start, follow=True)
        )
        watch = a.compaction.WatchPressure(cpb.WatchPressureRequest(session_id=a.session_id))
        first_report = await asyncio.wait_for(watch.read(), 10)

        for i in range(5):
            await b.append(user(f"through B {i}"))

        followed = [(await asyncio.wait_for(follow.read(), 10)).event.seq for _ in range(5)]
        revisions = [first_report.report.revision]
        while revisions[-1] < start + 5:
            revisions.append((await asyncio.wait_for(watch.read(), 10)).report.revision)
        follow.cancel()
        watch.cancel()
        assert followed == list(range(start, start + 5))  # none missed, none twice, in order
        assert revisions == sorted(set(revisions))


async def test_compacts_through_two_replicas_at_once_let_exactly_one_proceed(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    loop.enqueue(Reply(delay_before=1.0))  # the summary is slow, so the calls overlap
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening(), *units(6))
        await b.events()  # B has it cached too
        outcomes = await asyncio.gather(a.compact(), b.compact(), return_exceptions=True)

        refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        assert len(refused) == 1
        assert details(refused[0]).reason == "COMPACTION_BUSY"
        log = [body(e) for e in await b.events()]
        assert log.count("compaction_start") == log.count("compaction_end") == 1
        assert log.count("compaction_summary") == 1


async def test_a_bracket_whose_owner_stops_renewing_is_taken_over_and_its_owner_fenced(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    url = postgres.fresh_schema(database)
    loop.enqueue(Reply(delay_before=2.0))  # A's summary: it outlives A's lease
    async with replicas(tmp_path, loop, url, bracket_lease_s=0.3) as (a, b):
        await a.create(*opening(), *units(6))
        assert a.server is not None
        stalled = asyncio.create_task(a.compact())
        handle = await a.server.manager.get(a.session_id)
        await a.wait_for_log(lambda log: "compaction_start" in map(body, log))
        handle.leases.close()  # as if A froze: its lease is no longer renewed
        await asyncio.sleep(0.5)

        taken = await b.compact()  # B finds A's lease expired, ends its lifecycle, compacts

        assert taken.result.outcome.compaction_id
        with pytest.raises(grpc.aio.AioRpcError) as fenced:
            await stalled
        assert (details(fenced.value).code, details(fenced.value).reason) == (
            grpc.StatusCode.ABORTED,
            "LEASE_LOST",
        )
        log = await b.events()
        kinds = [body(e) for e in log]
        seed = kinds.index("session_end_seed")
        assert kinds.count("compaction_start") == 2
        assert kinds.count("compaction_summary") == 1  # A's summary never landed
        assert kinds[seed + 1 :].count("compaction_end") == 1  # B's bracket, closed
        assert log[seed].session_end_seed.reason == "lease-expired"
        await b.append(turn_start(1))  # the session goes on


async def test_a_database_outage_answers_unavailable_then_every_replica_recovers(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    url = postgres.fresh_schema(database)
    async with replicas(tmp_path, loop, url, postgres_connect_timeout_s=0.5) as (a, b):
        await a.create(*opening())
        await b.events()

        with postgres.refusing_connections(database):
            postgres.terminate_backends(database)
            for h in (a, b):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await h.append(user("while the database is away"))
                got = details(raised.value)
                assert (got.code, got.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")

        for h in (a, b):
            for _ in range(100):  # the pools reconnect with a backoff of their own
                try:
                    await h.append(user("back"))
                    break
                except grpc.aio.AioRpcError as error:
                    if details(error).reason != "STORE_UNAVAILABLE":
                        raise
                await asyncio.sleep(0.1)
        log = await a.events()
        assert [body(e) for e in log[-2:]] == ["user_message", "user_message"]
        assert [e.seq for e in log] == list(range(len(log)))


async def test_a_bracket_longer_than_its_lease_keeps_it_by_renewing(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    loop.enqueue(Reply(delay_before=1.5))  # five leases long
    async with replicas(tmp_path, loop, postgres.fresh_schema(database), bracket_lease_s=0.3) as (
        a,
        b,
    ):
        await a.create(*opening(), *units(6))
        running = asyncio.create_task(a.compact())
        await a.wait_for_log(lambda log: "compaction_start" in map(body, log))
        refusals = []
        for _ in range(4):  # B keeps trying while A's summary is written: A's lease holds
            await asyncio.sleep(0.25)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await b.compact()
            refusals.append(details(raised.value).reason)

        done = await running

        assert refusals == ["COMPACTION_BUSY"] * 4
        assert done.result.outcome.compaction_id
        kinds = [body(e) for e in await b.events()]
        assert "session_end_seed" not in kinds
        assert kinds.count("compaction_end") == 1


async def test_a_session_deleted_through_one_replica_is_gone_from_the_other(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening())
        follow = a.sessions.ListEvents(
            spb.ListEventsRequest(session_id=a.session_id, from_seq=len(opening()), follow=True)
        )
        await a.surface()  # A has it cached

        await b.sessions.DeleteSession(spb.DeleteSessionRequest(session_id=b.session_id))

        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(follow.read(), 10)
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await a.surface()
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        await b.create(user("a new session under the old id"))
        assert [body(e) for e in await a.events()] == ["user_message"]
