"""Compaction streams yield their steps then a result; watches stream until cancelled."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fake_compactd import FakeCompactd, abort_rich

from compactd_client import AsyncCompactdClient, CompactdClient, CompactionBusyError
from compactd_client.errors import IncompleteStreamError
from compactd_client.v1.compaction_service_pb2 import (
    COMPACTION_STEP_END,
    COMPACTION_STEP_REPLACE,
    COMPACTION_STEP_START,
    COMPACTION_STEP_SUMMARIZE,
    COMPACTION_STEP_SUMMARY,
    CompactionOutcome,
    CompactionProgress,
    CompactResponse,
    CompactResult,
    PressureReport,
    WatchPressureResponse,
)

_STEPS = [
    COMPACTION_STEP_START,
    COMPACTION_STEP_SUMMARIZE,
    COMPACTION_STEP_SUMMARY,
    COMPACTION_STEP_REPLACE,
    COMPACTION_STEP_END,
]


def _bracket(request: Any, context: grpc.ServicerContext) -> Iterator[CompactResponse]:
    for seq, step in enumerate(_STEPS, start=10):
        yield CompactResponse(progress=CompactionProgress(step=step, compaction_id="c1", seq=seq))
    outcome = CompactionOutcome(compaction_id="c1", items_condensed=6, checkpoint_seq=13)
    yield CompactResponse(result=CompactResult(outcome=outcome))


def test_sync_compaction_yields_each_step_then_the_result(fake: FakeCompactd) -> None:
    fake.on("Compact", _bracket)
    with CompactdClient(fake.target) as client:
        stream = client.compact("s1", focus="keep the file names")
        steps = [p.step for p in stream]
        result = stream.result()
    assert steps == _STEPS
    assert result.outcome.items_condensed == 6
    assert [p.seq for p in stream.progress] == [10, 11, 12, 13, 14]


async def test_async_result_drains_a_partly_read_stream(fake: FakeCompactd) -> None:
    fake.on("Compact", _bracket)
    async with AsyncCompactdClient(fake.target) as client:
        stream = client.compact("s1")
        first = await anext(stream)
        result = await stream.result()
    assert first.step == COMPACTION_STEP_START
    assert result.outcome.checkpoint_seq == 13
    assert len(stream.progress) == len(_STEPS)


def test_a_stream_without_result_is_incomplete(fake: FakeCompactd) -> None:
    fake.on("Compact", lambda r, c: iter([CompactResponse(progress=CompactionProgress())]))
    with CompactdClient(fake.target) as client, pytest.raises(IncompleteStreamError):
        client.compact("s1").result()


def test_an_error_after_some_steps_is_typed(fake: FakeCompactd) -> None:
    def fail_midway(request: Any, context: grpc.ServicerContext) -> Iterator[CompactResponse]:
        yield CompactResponse(progress=CompactionProgress(step=COMPACTION_STEP_START))
        abort_rich(context, grpc.StatusCode.ABORTED, "bracket live", reason="COMPACTION_BUSY")

    fake.on("Compact", fail_midway)
    with CompactdClient(fake.target) as client:
        stream = client.compact("s1")
        assert next(stream).step == COMPACTION_STEP_START
        with pytest.raises(CompactionBusyError):
            next(stream)


def _endless_watch(
    stop: threading.Event,
) -> Any:
    def watch(request: Any, context: grpc.ServicerContext) -> Iterator[WatchPressureResponse]:
        revision = 0
        while context.is_active() and not stop.is_set():
            revision += 1
            yield WatchPressureResponse(report=PressureReport(revision=revision))

    return watch


def test_sync_watch_stops_when_cancelled(fake: FakeCompactd) -> None:
    stop = threading.Event()
    fake.on("WatchPressure", _endless_watch(stop))
    try:
        with CompactdClient(fake.target) as client:
            revisions = []
            with client.watch_pressure("s1") as watch:
                for report in watch:
                    revisions.append(report.revision)
                    if len(revisions) == 3:
                        watch.cancel()
            assert revisions == [1, 2, 3]
    finally:
        stop.set()


async def test_async_watch_stops_when_cancelled(fake: FakeCompactd) -> None:
    stop = threading.Event()
    fake.on("WatchPressure", _endless_watch(stop))
    try:
        async with AsyncCompactdClient(fake.target) as client:
            revisions = []
            async with client.watch_pressure("s1") as watch:
                async for report in watch:
                    revisions.append(report.revision)
                    if len(revisions) == 3:
                        watch.cancel()
            assert revisions == [1, 2, 3]
    finally:
        stop.set()
