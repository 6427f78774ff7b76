"""Compaction never makes a session worse, run for real: a server on port 0 over a SQLite file,
summarizing through the loopback OpenAI-compatible provider, with scripted bad summaries.

Each conversation follows the step rules (turns, steps around assistant messages). The evidence
is the log (``compaction/start`` … ``compaction/end`` with the gate's report, or nothing at all),
the loopback's recorded summary requests, ``PrepareStep``'s warnings and progress, and an
injected clock for the failure memory's backoff (no sleeps).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from compactd.core.probes import SpanFacts
from compactd.providers.base import SummaryRequest, SummaryResult
from compactd.providers.openai import OpenAISummarizer
from compactd.service import screening
from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from tests.api.rpc import ErrorDetails, details
from tests.builders import assistant, in_step, replace, tool_result, turn_end, turn_start, user
from tests.compaction_fixtures import (
    ABOVE,
    BELOW,
    POLICY,
    Harness,
    body,
    loopback,
    opening,
    started,
    summary_requests,
)
from tests.test_tracing import attrs, spans_when

STEP = cpb.CompactionStep
CHECK = events_pb2.SummaryCheck
KIND = events_pb2.SummaryProbeKind
FILLER = "The parser keeps a table of tokens and their positions. " * 6


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


# ---- conversations that follow the step rules ------------------------------------------------


def request_text(i: int) -> str:
    return f"Task {i}: fix the tokenizer bug in src/parser_{i}.py and rerun its tests. " + FILLER


def work(turn: int, i: int) -> list[events_pb2.SessionEvent]:
    """One closed turn (~330 tokens): a request, a failing test run, the fix."""
    command = json.dumps({"cmd": f"pytest tests/test_parser_{i}.py"})
    return [
        turn_start(turn),
        user(request_text(i)),
        *in_step(turn, 1, assistant(text="Running the tests.", calls=[(f"c{i}", "run", command)])),
        tool_result(
            f"c{i}",
            f"FAILED tests/test_parser_{i}.py::test_tokens\nE   KeyError: 'token_{i}'\n" + FILLER,
            name="run",
            is_error=True,
        ),
        *in_step(turn, 2, assistant(text=f"Fixed src/parser_{i}.py; the tests pass. " + FILLER)),
        turn_end(turn),
    ]


def history(count: int, start: int = 0) -> list[events_pb2.SessionEvent]:
    return [event for i in range(start, start + count) for event in work(i + 1, i)]


def open_turn(turn: int, *, long: bool = False) -> list[events_pb2.SessionEvent]:
    """The turn whose next step PrepareStep prepares; a ``long`` request alone fills the retained
    budget, so the short steps that follow it leave the pressure selection's span alone."""
    text = f"Now tidy up the imports in src/app_{turn}.py please. " + (FILLER * 12 if long else "")
    return [turn_start(turn), user(text)]


def faithful(count: int = 20, *, sections: bool = True, keep: str = "all") -> str:
    """A summary of ``history(count)`` that quotes the requests and keeps paths, commands and
    errors (``keep="errors"``: only the errors); ``sections=False`` drops the headings."""
    lines: dict[str, list[str]] = {
        "Goals and Requests": [],
        "Technical Context": [],
        "Files Touched": [],
        "Errors and Resolutions": [],
        "Outstanding Work": ["(none)"],
        "Work in Progress": ["tidying imports"],
        "Immediate Next Step": ["(none)"],
        "Essential Context": ["(none)"],
    }
    for i in range(count):
        if keep == "all":
            lines["Goals and Requests"].append(f'"fix the tokenizer bug in src/parser_{i}.py"')
            lines["Technical Context"].append(f"Ran: pytest tests/test_parser_{i}.py")
            lines["Files Touched"].append(f"src/parser_{i}.py, tests/test_parser_{i}.py")
        lines["Errors and Resolutions"].append(f"KeyError: 'token_{i}' fixed")
    for title in ("Goals and Requests", "Technical Context", "Files Touched"):
        lines[title] = lines[title] or ["The user wanted several fixes; they were done."]
    return "\n".join(
        (f"## {title}\n" if sections else "") + "\n".join(f"- {line}" for line in items)
        for title, items in lines.items()
    )


async def pressured(h: Harness, *, long: bool = False, **policy: Any) -> None:
    """A session above the trigger whose turn 21 is open."""
    await h.create(*opening(), *history(20), *open_turn(21, long=long), policy={**POLICY, **policy})


def log_bodies(log: list[events_pb2.SessionEvent]) -> list[str]:
    return [body(e) for e in log]


def ends(log: list[events_pb2.SessionEvent]) -> list[events_pb2.CompactionEnd]:
    return [e.compaction_end for e in log if e.HasField("compaction_end")]


async def rejected_compact(h: Harness) -> ErrorDetails:
    """Run Compact, which must fail with SUMMARY_REJECTED; its error details."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await h.compact()
    got = details(caught.value)
    assert got.reason == "SUMMARY_REJECTED"
    return got


def checks(report: events_pb2.SummaryGateReport) -> set[int]:
    return {failure.check for failure in report.failures}


# ---- the gate rejects, and nothing replaces history ---------------------------------------------


async def test_an_echo_summary_is_rejected_and_replaces_nothing(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=request_text(3)))
    async with started(tmp_path, loop) as h:
        await pressured(h)
        surface = await h.surface()
        run = await h.prepare(21)

        assert list(run.result.compactions) == []
        assert run.result.after.state == ABOVE
        (warning,) = run.result.warnings
        assert "SUMMARY_REJECTED" in warning
        assert "ECHO: repeats span message" in warning
        log = await h.events()
        assert log_bodies(log[-2:]) == ["compaction_start", "compaction_end"]
        (end,) = ends(log)
        assert end.error_reason == "SUMMARY_REJECTED"
        assert CHECK.SUMMARY_CHECK_ECHO in checks(end.gate)
        assert not [e for e in log if e.HasField("compaction_summary")]
        assert (await h.surface()).nodes == surface.nodes
        gate = [p for p in run.progress if p.step == STEP.COMPACTION_STEP_GATE]
        assert gate
        assert gate[0].detail.startswith("rejected: ")


async def test_a_summary_without_the_sections_is_rejected_with_the_reason(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=faithful(sections=False)))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *history(20))
        got = await rejected_compact(h)

        assert got.metadata["checks"] == "SECTIONS"
        (end,) = ends(await h.events())
        (failure,) = end.gate.failures
        assert failure.check == CHECK.SUMMARY_CHECK_SECTIONS
        assert failure.detail.startswith("missing section(s): Goals and Requests")


async def test_a_summary_that_drops_the_requests_and_paths_is_rejected_naming_them(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=faithful(keep="errors")))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *history(20))
        got = await rejected_compact(h)

        assert got.metadata["checks"] == "PROBES"
        assert "request:Task 19: fix the tokenizer bug" in got.metadata["missed_probes"]
        (end,) = ends(await h.events())
        (failure,) = end.gate.failures
        missed = {probe.kind for probe in failure.missed_probes}
        assert missed >= {KIND.SUMMARY_PROBE_KIND_REQUEST, KIND.SUMMARY_PROBE_KIND_PATH}
        assert KIND.SUMMARY_PROBE_KIND_ERROR not in missed
        assert end.gate.probes_kept < end.gate.probe_count * end.gate.min_probe_retention


async def test_a_summary_that_reduces_the_span_by_two_percent_is_rejected(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *history(20))
        loop.enqueue(Reply(text="x"))  # learn the span's and the framing's prices
        first = await rejected_compact(h)
        span = int(first.metadata["shadowed_tokens"])
        framing = int(first.metadata["checkpoint_tokens"]) - 1
        good = faithful()
        padding = 4 * (round(span * 0.98) - framing) - len(good) - 1
        loop.enqueue(Reply(text=good + "\n" + "p" * padding))
        got = await rejected_compact(h)

        assert got.metadata["checks"] == "REDUCTION"
        end = ends(await h.events())[-1]
        assert end.gate.reduction == pytest.approx(0.02, abs=0.005)
        assert end.gate.min_reduction_ratio == pytest.approx(0.1)
        assert not [e for e in await h.events() if e.HasField("compaction_summary")]


async def test_a_good_summary_is_committed_with_the_gates_report(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=faithful()))
    async with started(tmp_path, loop) as h:
        await pressured(h)
        run = await h.prepare(21)

        assert run.result.after.state == BELOW
        assert len(run.result.compactions) == 1
        assert list(run.result.warnings) == []
        (summary,) = [
            e.compaction_summary for e in await h.events() if e.HasField("compaction_summary")
        ]
        assert summary.summary == faithful()
        assert list(summary.gate.failures) == []
        assert summary.gate.probe_count > 0
        assert summary.gate.probes_kept == summary.gate.probe_count
        assert summary.gate.reduction > 0.5
        assert not summary.HasField("fallback")
        gate = [p for p in run.progress if p.step == STEP.COMPACTION_STEP_GATE]
        assert gate[0].detail.startswith("passed: kept")


async def test_the_spans_facts_are_extracted_while_the_model_writes_not_after_its_summary(
    tmp_path: Path, loop: OpenAICompatServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    extract = screening.span_facts_in_steps

    def in_steps(messages: Any, **options: Any) -> Generator[None, None, SpanFacts]:
        facts = yield from extract(messages, **options)
        order.append("facts")
        return facts

    def after_the_summary(messages: Any, **options: Any) -> SpanFacts:
        raise AssertionError("the gate extracted the span's facts after the summary came back")

    summarize = OpenAISummarizer.summarize

    async def summarized(self: OpenAISummarizer, request: SummaryRequest) -> SummaryResult:
        result = await summarize(self, request)
        order.append("summary")
        return result

    monkeypatch.setattr(screening, "span_facts_in_steps", in_steps)
    monkeypatch.setattr(screening, "span_facts", after_the_summary)
    monkeypatch.setattr(OpenAISummarizer, "summarize", summarized)
    loop.enqueue(Reply(text=faithful(), delay_before=0.5))  # the model takes its time
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *history(20))
        run = await h.compact()

        assert run.result.HasField("outcome")
        assert order == ["facts", "summary"]
        (summary,) = [
            e.compaction_summary for e in await h.events() if e.HasField("compaction_summary")
        ]
        assert summary.gate.probe_count > 0
        assert summary.gate.probes_kept == summary.gate.probe_count


async def test_with_the_gate_off_any_smaller_summary_commits(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=request_text(3)))
    async with started(tmp_path, loop) as h:
        await pressured(h, summaryGate=False)
        run = await h.prepare(21)

        assert len(run.result.compactions) == 1
        (summary,) = [
            e.compaction_summary for e in await h.events() if e.HasField("compaction_summary")
        ]
        assert not summary.HasField("gate")
        assert STEP.COMPACTION_STEP_GATE not in run.steps()


# ---- the extractive fallback ------------------------------------------------------------------


async def test_the_extractive_fallback_replaces_a_rejected_summary_when_enabled(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=request_text(3)))
    async with started(tmp_path, loop) as h:
        await pressured(h, extractiveFallback=True)
        run = await h.prepare(21)

        assert run.result.after.state == BELOW
        (outcome,) = run.result.compactions
        (summary,) = [
            e.compaction_summary for e in await h.events() if e.HasField("compaction_summary")
        ]
        assert summary.summarizer == "extractive"
        assert summary.target == events_pb2.Route(provider="compactd", model="extractive")
        assert summary.fallback.rejected_summarizer == "openai"
        assert summary.fallback.rejected_target == events_pb2.Route(provider="loop", model="m")
        assert CHECK.SUMMARY_CHECK_ECHO in checks(summary.fallback.rejected)
        assert list(summary.gate.failures) == []
        # The extractive checkpoint fits its share of the span: the most valuable probes first.
        assert summary.gate.reduction >= 0.85
        assert summary.gate.probes_kept >= 0.75 * summary.gate.probe_count
        checkpoint = (await h.events())[outcome.checkpoint_seq].user_message.content[0].text.text
        assert summary.summary in checkpoint
        gate = [p.detail for p in run.progress if p.step == STEP.COMPACTION_STEP_GATE]
        assert "the extractive fallback passed" in gate[0]


async def test_without_the_fallback_policy_no_extractive_summary_is_written(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=request_text(3)))
    async with started(tmp_path, loop) as h:
        await pressured(h)
        await h.prepare(21)

        assert not [e for e in await h.events() if e.HasField("compaction_summary")]


# ---- failure memory ---------------------------------------------------------------------------


def a_step(turn: int, step: int) -> list[events_pb2.SessionEvent]:
    """A short step of the open turn (after a long request it changes no selected span)."""
    return in_step(turn, step, assistant(text=f"Step {step} of the tidy-up."))


async def test_the_same_failing_span_is_not_sent_again_on_the_next_steps(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=request_text(3)))
    async with started(tmp_path, loop, clock=Clock()) as h:
        await pressured(h, long=True, compactionRetries=3)
        first = await h.prepare(21)
        (start,) = [e.compaction_start for e in await h.events() if e.HasField("compaction_start")]
        for step in (1, 2, 3):
            await h.append(*a_step(21, step))
            run = await h.prepare(21)

            assert len(summary_requests(loop)) == 1  # not sent again
            (warning,) = run.result.warnings
            assert warning.startswith("compaction failed (SUMMARY_REJECTED): the same span (seqs ")
            assert "failed 1 time(s) with SUMMARY_REJECTED on loop/m" in warning
            assert warning.endswith("it is sent again when it changes")
            assert STEP.COMPACTION_STEP_SKIP in run.steps()
            assert STEP.COMPACTION_STEP_START not in run.steps()
        assert f"seqs {start.range.start_seq}..{start.range.end_seq}" in warning
        assert "SUMMARY_REJECTED" in first.result.warnings[0]
        assert len(ends(await h.events())) == 1  # nothing more was written


async def test_a_retried_step_on_a_span_whose_summary_was_not_smaller_reports_summary_not_smaller(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # The reference retries the summary and fails again with SUMMARY_NOT_SMALLER; compactd holds
    # the unchanged span back (failure memory) and says the same failure, not "nothing to compact".
    loop.enqueue(Reply(text="The same words again and again. " * 3000))
    async with started(tmp_path, loop, clock=Clock()) as h:
        await pressured(h, long=True)
        first = (await h.prepare(21)).result
        await h.append(*a_step(21, 1))
        retried = (await h.prepare(21)).result

        assert len(summary_requests(loop)) == 1  # not sent again
        assert first.warnings[0].startswith("compaction failed (SUMMARY_NOT_SMALLER): ")
        (warning,) = retried.warnings
        assert warning.startswith("compaction failed (SUMMARY_NOT_SMALLER): the same span (seqs ")
        assert "failed 1 time(s) with SUMMARY_NOT_SMALLER on loop/m" in warning
        for result in (first, retried):
            assert result.outcome == cpb.PRESSURE_OUTCOME_ABOVE_TRIGGER
            assert result.outcome_detail.startswith("the bracket failed with SUMMARY_NOT_SMALLER")


async def test_a_failing_span_is_sent_again_once_it_changes(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=request_text(3)), Reply(text=request_text(3)))
    async with started(tmp_path, loop, clock=Clock()) as h:
        await pressured(h, compactionRetries=3)
        await h.prepare(21)
        await h.append(turn_end(21), *history(2, 21), *open_turn(24))  # the retained tail moves
        run = await h.prepare(24)

        assert len(summary_requests(loop)) == 2
        first, second = [
            e.compaction_start for e in await h.events() if e.HasField("compaction_start")
        ]
        assert second.range.end_seq > first.range.end_seq
        assert "SUMMARY_REJECTED" in run.result.warnings[0]


async def test_a_span_whose_summary_was_rejected_is_never_sent_to_its_target_again(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # The same request would get the same answer: however long the runtime waits, the span is
    # sent again only once it changes (a transient failure waits for its backoff instead).
    clock = Clock()
    loop.enqueue(*[Reply(text=request_text(3))] * 2)
    async with started(tmp_path, loop, clock=clock) as h:
        await pressured(h, compactionRetries=5)
        await h.prepare(21)
        for _ in range(3):
            clock.now += 10**6
            run = await h.prepare(21)
        assert len(summary_requests(loop)) == 1
        assert "failed 1 time(s)" in run.result.warnings[0]


async def test_compact_sends_a_held_span_anyway(tmp_path: Path, loop: OpenAICompatServer) -> None:
    loop.enqueue(Reply(text=request_text(3)))
    async with started(tmp_path, loop, clock=Clock()) as h:
        await pressured(h)
        await h.prepare(21)
        await h.append(turn_end(21))
        run = await h.compact()

        assert len(summary_requests(loop)) == 2
        assert run.result.outcome.compaction_id


async def test_new_history_after_a_failed_span_is_new_work_and_is_compacted(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # A failure bounds repeated work, not progress: once history arrives, the grown span is a new
    # span, sent at the next step above the trigger, with no budget to wait for.
    loop.enqueue(Reply(text=request_text(3)), Reply(text=faithful()))
    async with started(tmp_path, loop, clock=Clock()) as h:
        await pressured(h, compactionRetries=0)
        first = await h.prepare(21)
        assert first.result.warnings[0].startswith("compaction failed (SUMMARY_REJECTED)")
        assert first.result.outcome == cpb.PRESSURE_OUTCOME_ABOVE_TRIGGER
        assert "the bracket failed with SUMMARY_REJECTED" in first.result.outcome_detail
        await h.append(turn_end(21), *history(2, 21), *open_turn(24))  # a new, larger span
        later = await h.prepare(24)

        assert len(summary_requests(loop)) == 2
        assert len(later.result.compactions) == 1
        assert later.result.outcome == cpb.PRESSURE_OUTCOME_FITS


async def test_a_crossing_ends_when_pressure_drops_below_the_trigger(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=request_text(3)))
    async with started(tmp_path, loop, clock=Clock()) as h:
        await pressured(h, compactionRetries=0)
        await h.prepare(21)
        await h.append(turn_end(21))
        await h.compact()  # the runtime compacts explicitly: below the trigger, a new crossing
        await h.append(*history(14, 21), *open_turn(36))
        run = await h.prepare(36)

        assert (await h.pressure()).state == BELOW
        assert len(run.result.compactions) == 1


async def test_without_failure_memory_every_step_sends_the_span_again(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(*[Reply(text=request_text(3))] * 3)
    async with started(tmp_path, loop, clock=Clock()) as h:
        await pressured(h, failureBackoffSeconds=0)
        for _ in range(3):
            await h.prepare(21)

        assert len(summary_requests(loop)) == 3


# ---- no tiny spans ------------------------------------------------------------------------------


async def test_a_span_smaller_than_the_minimum_useful_checkpoint_is_declined_without_a_model_call(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        big = "A very long design note. " * 1200  # ~7500 tokens: over the trigger on its own
        await h.create(
            *opening(),
            turn_start(1),
            user("Hi there, please help me."),
            *in_step(1, 1, assistant(text="Sure.")),
            turn_end(1),
            turn_start(2),
            user("Read the design notes: " + big),
        )
        run = await h.prepare(2)

        (warning,) = run.result.warnings  # the step: the note alone is above the trigger
        assert warning.startswith("nothing to compact: the floor ("), warning
        assert run.result.outcome == cpb.PRESSURE_OUTCOME_ABOVE_TRIGGER
        assert summary_requests(loop) == []
        assert not [e for e in await h.events() if e.HasField("compaction_start")]
        await h.append(turn_end(2))
        compact = await h.compact()
        assert compact.result.declined_reason.startswith("the selectable span (2 node(s)")
        assert summary_requests(loop) == []


# ---- observable ---------------------------------------------------------------------------------


def counted(reader: InMemoryMetricReader, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """A counter's value by the attributes ``keys`` ("" for an attribute not set)."""
    data = reader.get_metrics_data()
    found: dict[tuple[str, ...], float] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        labels = dict(point.attributes or {})
                        key = tuple(str(labels.get(k, "")) for k in keys)
                        found[key] = found.get(key, 0) + point.value  # type: ignore[union-attr]
    return found


async def test_rejected_skipped_and_committed_brackets_are_counted(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    loop.enqueue(Reply(text=request_text(3)))
    async with started(tmp_path, loop, clock=Clock(), meter_provider=meters) as h:
        await pressured(h, long=True, compactionRetries=3)
        await h.prepare(21)  # rejected
        await h.append(*a_step(21, 1))
        await h.prepare(21)  # held back
        await h.append(turn_end(21))
        await h.compact()  # committed

    outcomes = ("compactd.outcome", "compactd.reason")
    assert counted(reader, "compactd.compactions", *outcomes) == {
        ("failed", "SUMMARY_REJECTED"): 1,
        ("skipped", "KNOWN_FAILURE"): 1,
        ("committed", ""): 1,
    }
    assert counted(reader, "compactd.summary.gate", "compactd.outcome") == {
        ("rejected",): 1,
        ("passed",): 1,
    }
    meters.shutdown()


async def test_a_rejected_bracket_traces_its_failed_checks_and_missed_probes(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    loop.enqueue(Reply(text=faithful(keep="errors")))
    async with started(tmp_path, loop, tracer_provider=provider) as h:
        await pressured(h)
        await h.prepare(21)
        spans = await spans_when(h, exporter, "/compactd.v1.CompactionService/PrepareStep")

    (gate,) = [s for s in spans if s.name == "compaction.gate"]
    found = attrs(gate)
    assert found["compactd.gate.passed"] is False
    assert list(found["compactd.gate.failed_checks"]) == ["PROBES"]
    assert found["compactd.gate.probes_kept"] < found["compactd.gate.probes"]
    assert any(m.startswith("request: Task ") for m in found["compactd.gate.missed_probes"])
    (end,) = [s for s in spans if s.name == "compaction.end"]
    assert "PROBES: keeps" in attrs(end)["compactd.error"]
    provider.shutdown()


async def test_a_held_back_bracket_is_traced(tmp_path: Path, loop: OpenAICompatServer) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    loop.enqueue(Reply(text=request_text(3)))
    async with started(tmp_path, loop, tracer_provider=provider, clock=Clock()) as h:
        await pressured(h, long=True, compactionRetries=1)
        await h.prepare(21)  # rejected: one bracket of two
        await h.prepare(21)  # the same span: held back
        await spans_when(h, exporter, "/compactd.v1.CompactionService/PrepareStep")
        spans = list(exporter.get_finished_spans())

    codes = [attrs(s).get("compactd.decline_code") for s in spans if s.name == "compaction.bracket"]
    assert codes.count("KNOWN_FAILURE") == 1
    assert not [s for s in spans if s.name == "compaction.skip"]  # no crossing budget any more
    provider.shutdown()


async def test_a_span_that_drifts_while_the_summary_is_written_fails_as_drift_not_in_the_gate(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text=faithful(), delay_before=0.5))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *history(20))
        result = next(e for e in await h.events() if e.HasField("tool_result"))
        compact = asyncio.create_task(h.compact())
        assert await asyncio.to_thread(loop.wait_for_requests, 1)
        shorter = tool_result(result.tool_result.tool_call_id, "trimmed", name="run", is_error=True)
        await h.append(replace(shorter, result.seq, result.seq, [result.seq]))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await compact

        assert details(caught.value).reason == "SPAN_DRIFT"
        assert ends(await h.events())[-1].error_reason == "SPAN_DRIFT"
