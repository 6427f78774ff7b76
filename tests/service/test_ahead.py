"""Prepare-ahead (``service.ahead``), run for real: a server on port 0 summarizing through a
loopback OpenAI-compatible provider whose summary requests a test can hold back.

With the default fixtures' policy the trigger is 5000 tokens; ``prepareAheadRatio`` 0.25 puts
the prepare-ahead point at 4000 (``floor(min(16000 * 0.25, 16000 - 1000 - 1000))``): 14 units
(~4180 tokens) cross it, 18 (~5410) cross the trigger.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from compactd.api.server import create_server
from compactd.store.candidates import Candidate
from compactd.testing.openai_server import OpenAICompatServer, RecordedRequest, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from tests import postgres
from tests.api.rpc import details
from tests.builders import assistant, in_step, replace, tool_result, turn_start, user
from tests.compaction_fixtures import (
    ABOVE,
    BELOW,
    POLICY,
    Harness,
    Run,
    opening,
    server_config,
    started,
    summary_requests,
    units,
)

AHEAD: dict[str, Any] = {**POLICY, "prepareAheadRatio": 0.25, "prepareAheadWaitMs": 60_000}
STEP = cpb.CompactionStep
BEFORE_TRIGGER, AT_TRIGGER = 14, 18


class Held:
    """A responder that holds the first ``count`` summary requests until ``release`` is set."""

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.release = threading.Event()
        self._held = 0
        self._lock = threading.Lock()

    def __call__(self, request: RecordedRequest) -> Reply | None:
        if request.header("x-compactd-purpose") != "compaction":
            return None
        with self._lock:
            hold = self._held < self.count
            self._held += 1
        if hold:
            self.release.wait(60)
        return None


@pytest.fixture
def held() -> Iterator[Held]:
    gate = Held()
    yield gate
    gate.release.set()


@pytest.fixture
def loop(held: Held) -> Iterator[OpenAICompatServer]:
    with OpenAICompatServer(responder=held) as server:
        yield server


async def candidate(h: Harness, session_id: str | None = None) -> Candidate | None:
    assert h.server is not None
    return await h.server.store.get_candidate(session_id or h.session_id)


async def until_candidate(h: Harness, *, ready: bool, session_id: str | None = None) -> Candidate:
    """Poll the store until the session holds a candidate (a ready one when ``ready``)."""
    async with asyncio.timeout(30):
        while True:
            found = await candidate(h, session_id)
            if found is not None and (found.summary is not None or not ready):
                return found
            await asyncio.sleep(0.02)


async def step_at_trigger(h: Harness) -> Run:
    """Append up to the trigger, open turn 1 and run its PrepareStep."""
    await h.append(*units(AT_TRIGGER - BEFORE_TRIGGER, BEFORE_TRIGGER))
    await h.append(turn_start(1), user("Carry on."))
    return await h.prepare(1)


async def brackets(h: Harness) -> list[cpb.BracketRecord]:
    reply = await h.compaction.ListBrackets(cpb.ListBracketsRequest(session_id=h.session_id))
    return list(reply.brackets)


async def test_a_summary_prepared_ahead_is_applied_at_the_trigger_without_a_call_in_the_step(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    held.release.set()
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        ready = await until_candidate(h, ready=True)
        assert (await h.pressure()).state == BELOW
        assert len(summary_requests(loop)) == 1

        run = await step_at_trigger(h)

        assert len(summary_requests(loop)) == 1  # the step called no model
        assert len(run.result.compactions) == 1
        assert run.result.after.state == BELOW
        (record,) = await brackets(h)
        assert record.outcome == cpb.BRACKET_OUTCOME_COMMITTED
        assert record.prepared_ahead.candidate_id == ready.candidate_id
        assert record.prepared_ahead.agent_wait_ms == 0
        assert record.prepared_ahead.HasField("ready_time")
        assert (record.range.start_seq, record.range.end_seq) == (
            ready.claim.start_seq,
            ready.claim.end_seq,
        )
        assert [s.step for s in record.steps] == [
            STEP.COMPACTION_STEP_START,
            STEP.COMPACTION_STEP_SUMMARY,
            STEP.COMPACTION_STEP_REPLACE,
            STEP.COMPACTION_STEP_END,
        ]
        assert await candidate(h) is None


async def test_appends_after_the_span_are_kept_in_order_when_it_is_applied(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    held.release.set()
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        ready = await until_candidate(h, ready=True)

        run = await step_at_trigger(h)

        (outcome,) = run.result.compactions
        nodes = (await h.surface()).nodes
        log = await h.events()
        # Everything the runtime appended after the span is on the surface, in log order, right
        # after the system head and the checkpoint: nothing lost, nothing reordered.
        appended_after = [
            e.seq for e in log
            if e.seq > ready.claim.end_seq and (e.HasField("user_message")
                                                 or e.HasField("assistant_message")
                                                 or e.HasField("tool_result"))
            and not e.user_message.source.HasField("compaction_checkpoint")
        ]  # fmt: skip
        assert [n.seq for n in nodes[2:]] == appended_after
        assert nodes[1].compaction_id == outcome.compaction_id
        assert nodes[-1].message.content[0].text.text == "Carry on."


async def test_a_replacement_inside_the_span_discards_the_candidate(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    held.release.set()
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        ready = await until_candidate(h, ready=True)
        inside = next(
            e for e in await h.events()
            if e.HasField("tool_result") and ready.claim.start_seq < e.seq < ready.claim.end_seq
        )  # fmt: skip
        await h.append_as_server(
            replace(tool_result(inside.tool_result.tool_call_id, "trimmed",
                                name=inside.tool_result.tool_name),
                    inside.seq, inside.seq, [inside.seq])
        )  # fmt: skip

        run = await step_at_trigger(h)

        ahead = [p for p in run.progress if p.step == STEP.COMPACTION_STEP_AHEAD]
        assert len(ahead) == 1
        assert "discarded" in ahead[0].detail
        assert len(summary_requests(loop)) == 2  # the step summarized itself
        (record,) = await brackets(h)
        assert record.outcome == cpb.BRACKET_OUTCOME_COMMITTED
        assert not record.HasField("prepared_ahead")


async def test_a_step_at_the_trigger_waits_for_a_candidate_in_progress_and_applies_it(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        await until_candidate(h, ready=False)
        await h.append(*units(AT_TRIGGER - BEFORE_TRIGGER, BEFORE_TRIGGER))
        await h.append(turn_start(1), user("Carry on."))

        run = Run()
        call = h.compaction.PrepareStep(cpb.PrepareStepRequest(session_id=h.session_id, turn=1))
        async for response in call:
            if response.HasField("progress"):
                run.progress.append(response.progress)
                if response.progress.step == STEP.COMPACTION_STEP_AHEAD:
                    assert "waiting up to 60000 ms" in response.progress.detail
                    held.release.set()  # the summary is done only while the step waits
            else:
                run.result = response.result

        assert len(summary_requests(loop)) == 1
        assert len(run.result.compactions) == 1
        (record,) = await brackets(h)
        assert record.prepared_ahead.agent_wait_ms > 0


async def test_a_candidate_not_ready_within_the_bounded_wait_falls_back_to_the_step_summary(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    policy = {**AHEAD, "prepareAheadWaitMs": 0}
    async with started(tmp_path, loop, policy=policy) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        await until_candidate(h, ready=False)

        run = await step_at_trigger(h)  # the held request stays held: the step summarizes

        ahead = [p.detail for p in run.progress if p.step == STEP.COMPACTION_STEP_AHEAD]
        assert len(ahead) == 1
        assert "not ready within 0 ms" in ahead[0]
        assert len(run.result.compactions) == 1
        (record,) = await brackets(h)
        assert not record.HasField("prepared_ahead")
        assert await candidate(h) is None  # the background summary was cancelled and dropped
        assert h.server is not None
        assert h.server.ahead is not None
        assert not h.server.ahead.preparing(await h.server.manager.get(h.session_id))


async def test_shutdown_during_a_background_summary_drops_the_candidate_and_writes_nothing(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        await until_candidate(h, ready=False)
        assert h.server is not None
        store, running = h.server.store, h.server
        revision = (await h.events())[-1].seq

        await running.stop(0)

        assert await store.get_candidate(h.session_id) is None
        assert running.ahead is not None
        assert not running.ahead._tasks
    held.release.set()
    async with started(tmp_path, loop, policy=AHEAD) as again:
        events = await again.events()
        assert events[revision].seq == revision
        assert not any(e.HasField("compaction_start") for e in events)


async def test_two_sessions_prepare_at_once(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    held.count = 2
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        other = Harness(h.channel, loop, h.server, session_id="s2")
        await other.create(*opening(), *units(BEFORE_TRIGGER))

        # Both summary requests are in flight together before either is answered.
        assert await asyncio.to_thread(loop.wait_for_requests, 2)
        assert len(summary_requests(loop)) == 2
        held.release.set()
        first = await until_candidate(h, ready=True)
        second = await until_candidate(h, ready=True, session_id="s2")
        assert first.candidate_id != second.candidate_id

        for harness in (h, other):
            run = await step_at_trigger(harness)
            assert len(run.result.compactions) == 1
            (record,) = await brackets(harness)
            assert record.HasField("prepared_ahead")
        assert len(summary_requests(loop)) == 2


async def test_with_the_option_off_nothing_is_prepared_and_the_step_summarizes_as_before(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    held.release.set()
    async with started(tmp_path, loop, policy=POLICY) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        assert h.server is not None
        assert h.server.ahead is not None
        assert not h.server.ahead.preparing(await h.server.manager.get(h.session_id))
        assert summary_requests(loop) == []
        assert await candidate(h) is None

        run = await step_at_trigger(h)

        assert [p.step for p in run.progress if p.step == STEP.COMPACTION_STEP_AHEAD] == []
        assert len(summary_requests(loop)) == 1
        (record,) = await brackets(h)
        assert record.outcome == cpb.BRACKET_OUTCOME_COMMITTED
        assert not record.HasField("prepared_ahead")
        assert run.result.before.state == ABOVE


def answered(input_tokens: int) -> list[Any]:
    """A step of turn 1 whose answer carries the usage of a request of ``input_tokens``."""
    message = assistant(text="Done with the checks.")
    message.assistant_message.usage.input_tokens = input_tokens
    message.assistant_message.usage.output_tokens = 40  # a little more than its text
    return in_step(1, 1, message)


@pytest.mark.parametrize("stale", [True, False])
async def test_usage_that_answered_a_request_built_before_the_apply_does_not_anchor(
    tmp_path: Path, loop: OpenAICompatServer, held: Held, stale: bool
) -> None:
    held.release.set()
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        await until_candidate(h, ready=True)
        run = await step_at_trigger(h)
        before, after = run.result.before.measured_tokens, run.result.after.measured_tokens

        # Stale: the usage of the request built before the apply (the larger surface); fresh:
        # the usage of the request the step answered (the new, smaller one).
        await h.append(*answered(before if stale else after))

        report = await h.pressure()
        anchored = report.breakdown.method == cpb.MEASUREMENT_METHOD_ANCHORED
        assert anchored is not stale
        assert report.measured_tokens < before  # never the old surface's price


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    yield from postgres.database()


@asynccontextmanager
async def replicas(
    tmp_path: Path, loop: OpenAICompatServer, url: str
) -> AsyncIterator[tuple[Harness, Harness]]:
    """Two servers on one PostgreSQL schema (a short bracket lease), a harness for each."""
    settings = server_config(tmp_path, loop, policy=AHEAD)
    settings = dataclasses.replace(settings, store=url, bracket_lease_s=1.0)
    async with AsyncExitStack() as stack:
        harnesses = []
        for _ in range(2):
            running = await create_server(settings, tracer_provider=trace.NoOpTracerProvider())
            stack.push_async_callback(running.stop, 0)
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(running.address))
            harnesses.append(Harness(channel, loop, running))
        yield harnesses[0], harnesses[1]


async def test_a_replica_that_dies_while_preparing_is_taken_over_by_another_that_applies(
    tmp_path: Path, loop: OpenAICompatServer, held: Held, database: str
) -> None:
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        assert a.server is not None
        assert b.server is not None
        await a.create(*opening(), *units(BEFORE_TRIGGER))  # A starts preparing (held)
        dying = await until_candidate(a, ready=False)
        assert dying.claim.owner == a.server.manager.instance_id

        async def frozen(*_: Any, **__: Any) -> bool:
            await asyncio.Event().wait()  # a replica that stopped: it never renews again
            return False

        a.server.store.renew_candidate = frozen  # type: ignore[method-assign]
        async with asyncio.timeout(30):
            while True:  # the lease lapses by the database's clock
                seen = await b.server.store.get_candidate(b.session_id)
                if seen is not None and seen.abandoned:
                    break
                await asyncio.sleep(0.05)

        await b.append(*units(1, BEFORE_TRIGGER))  # B's next append prepares again
        async with asyncio.timeout(30):
            while True:
                taken = await until_candidate(b, ready=True)
                if taken.candidate_id != dying.candidate_id:
                    break
        assert taken.claim.owner == b.server.manager.instance_id

        await b.append(*units(AT_TRIGGER - BEFORE_TRIGGER - 1, BEFORE_TRIGGER + 1))
        await b.append(turn_start(1), user("Carry on."))
        run = await b.prepare(1)

        assert len(run.result.compactions) == 1
        (record,) = await brackets(b)
        assert record.prepared_ahead.candidate_id == taken.candidate_id
        held.release.set()  # A's late summary finds its candidate gone: nothing is written
        assert await b.server.store.get_candidate(b.session_id) is None


async def test_watch_pressure_reports_the_candidate_in_progress(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        preparing = await until_candidate(h, ready=False)
        watch = h.compaction.WatchPressure(cpb.WatchPressureRequest(session_id=h.session_id))

        first = await anext(aiter(watch))
        watch.cancel()

        shown = first.candidate
        assert shown.candidate_id == preparing.candidate_id
        assert not shown.ready
        assert (shown.start_seq, shown.end_seq) == (
            preparing.claim.start_seq,
            preparing.claim.end_seq,
        )
        assert h.server is not None
        assert shown.owner == h.server.manager.instance_id


async def test_the_background_summary_and_the_bracket_that_applies_it_are_traced(
    tmp_path: Path,
    loop: OpenAICompatServer,
    held: Held,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    held.release.set()
    async with started(tmp_path, loop, policy=AHEAD, tracer_provider=provider) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        ready = await until_candidate(h, ready=True)
        await step_at_trigger(h)

        spans = {s.name: s for s in exporter.get_finished_spans()}
        prepared = spans["compaction.prepare_ahead"]
        assert prepared.attributes is not None
        assert prepared.attributes["compactd.candidate_id"] == ready.candidate_id
        assert prepared.parent is None  # no caller waits on it
        assert any(s.parent == prepared.context for s in exporter.get_finished_spans())
        bracket = spans["compaction.bracket"]
        assert bracket.attributes is not None
        assert bracket.attributes["compactd.prepared_ahead"] is True
        assert "compaction.summarize" not in spans  # the step called no summarizer


async def test_a_background_summary_that_fails_leaves_no_candidate_and_the_step_summarizes(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    held.release.set()
    loop.enqueue(*[Reply.server_error(500)] * 3)  # every attempt of the background summary
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        assert await asyncio.to_thread(loop.wait_for_requests, 3)
        assert h.server is not None
        assert h.server.ahead is not None
        handle = await h.server.manager.get(h.session_id)
        async with asyncio.timeout(30):
            while True:  # the background task ends after its last attempt
                if not h.server.ahead.preparing(handle):
                    break
                await asyncio.sleep(0.02)
        assert await candidate(h) is None
        assert not any(e.HasField("compaction_start") for e in await h.events())

        run = await step_at_trigger(h)

        assert len(run.result.compactions) == 1
        (record,) = await brackets(h)
        assert not record.HasField("prepared_ahead")


async def test_a_step_below_the_trigger_never_waits_for_a_candidate_in_progress(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        preparing = await until_candidate(h, ready=False)  # held until the test ends
        await h.append(turn_start(1), user("Carry on."))

        run = await h.prepare(1)  # returns while the summary is still held (the wait is 60 s)

        assert run.result.before.state == BELOW
        assert run.result.outcome == cpb.PRESSURE_OUTCOME_FITS
        assert [p for p in run.progress if p.step == STEP.COMPACTION_STEP_AHEAD] == []
        still = await candidate(h)
        assert still is not None
        assert still.candidate_id == preparing.candidate_id
        assert still.summary is None


async def test_two_replicas_at_the_trigger_apply_one_candidate_once(
    tmp_path: Path, loop: OpenAICompatServer, held: Held, database: str
) -> None:
    held.release.set()
    async with replicas(tmp_path, loop, postgres.fresh_schema(database)) as (a, b):
        await a.create(*opening(), *units(BEFORE_TRIGGER))
        ready = await until_candidate(a, ready=True)
        await a.append(*units(AT_TRIGGER - BEFORE_TRIGGER, BEFORE_TRIGGER))
        await a.append(turn_start(1), user("Carry on."))

        outcomes = await asyncio.gather(a.prepare(1), b.prepare(1), return_exceptions=True)

        for outcome in outcomes:  # a step either ran or met the live bracket, as always
            if isinstance(outcome, BaseException):
                assert isinstance(outcome, grpc.aio.AioRpcError)
                assert details(outcome).reason == "COMPACTION_BUSY"
        starts = [e for e in await a.events() if e.HasField("compaction_start")]
        assert [s.compaction_start.prepared_ahead.candidate_id for s in starts] == [
            ready.candidate_id
        ]
        assert len(summary_requests(loop)) == 1


def outcomes(reader: InMemoryMetricReader) -> dict[str, float]:
    """``compactd.ahead.candidates`` by outcome."""
    data = reader.get_metrics_data()
    found: dict[str, float] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "compactd.ahead.candidates":
                    for point in metric.data.data_points:
                        outcome = str(dict(point.attributes or {})["compactd.outcome"])
                        found[outcome] = found.get(outcome, 0) + point.value  # type: ignore[union-attr]
    return found


async def test_candidates_are_counted_by_outcome(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    held.release.set()
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    async with started(tmp_path, loop, policy=AHEAD, meter_provider=meters) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        await until_candidate(h, ready=True)
        await step_at_trigger(h)

        assert outcomes(reader) == {"started": 1, "ready": 1, "applied": 1}


async def test_a_prepared_summary_the_gate_rejects_is_the_steps_one_bracket(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    held.release.set()
    loop.enqueue(Reply(text="Nothing worth keeping happened."))  # no section, no fact: rejected
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        await until_candidate(h, ready=True)

        run = await step_at_trigger(h)

        assert len(summary_requests(loop)) == 1  # the step sent nothing: no second bracket
        (record,) = await brackets(h)
        assert record.outcome != cpb.BRACKET_OUTCOME_COMMITTED
        assert record.HasField("prepared_ahead")
        assert run.result.compactions == []
        assert any("SUMMARY_REJECTED" in warning for warning in run.result.warnings)
        assert run.result.after.state == ABOVE
        assert run.result.outcome == cpb.PRESSURE_OUTCOME_ABOVE_TRIGGER
        assert await candidate(h) is None


async def test_a_ready_candidate_waits_for_the_trigger_and_a_step_below_it_leaves_it_ready(
    tmp_path: Path, loop: OpenAICompatServer, held: Held
) -> None:
    held.release.set()
    async with started(tmp_path, loop, policy=AHEAD) as h:
        await h.create(*opening(), *units(BEFORE_TRIGGER))
        ready = await until_candidate(h, ready=True)
        await h.append(turn_start(1), user("Carry on."))

        below = await h.prepare(1)

        assert below.result.before.state == BELOW
        assert list(below.result.compactions) == []
        kept = await candidate(h)
        assert kept is not None
        assert kept.candidate_id == ready.candidate_id
        assert await brackets(h) == []
