"""Bracket history: every compaction bracket of a log, folded from its events.

Each ``compaction/start`` opens a record; ``compaction/summary-error``, ``compaction/summary``,
the checkpoint ``user/message`` and ``compaction/end`` with the same compaction id add its
steps (a revert's REPLACE of the checkpoint it reverts is its commit). A bracket whose end was
logged is COMMITTED (a checkpoint cites it) or FAILED. One without an end is judged by the
end-seed rule of ``core.lock``, folded over the same events: LIVE when it started after the
newest ``session/end-seed`` (it holds this lifecycle's lock), STALE before it (crash evidence
that no longer blocks).
"""

from __future__ import annotations

from collections.abc import Iterable

from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.core.lock import LockState, stale_brackets
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2


def bracket_history(events: Iterable[SessionEvent]) -> cpb.ListBracketsResponse:
    """The brackets and standalone prunes of a log (``events`` in seq order, seqs set)."""
    history = cpb.ListBracketsResponse(last_end_seed=-1)
    records: dict[str, cpb.BracketRecord] = {}
    lock = LockState()
    for event in events:
        history.revision = event.seq + 1
        lock.apply(event, event.seq)
        _fold(event, records, history)
    history.last_end_seed = lock.last_end_seed
    stale = {bracket.compaction_id for bracket in stale_brackets(lock)}
    for record in records.values():
        if record.end_seq < 0:
            unmatched = record.compaction_id in stale
            record.outcome = cpb.BRACKET_OUTCOME_STALE if unmatched else cpb.BRACKET_OUTCOME_LIVE
    history.brackets.extend(sorted(records.values(), key=lambda r: r.start_seq))
    return history


def _fold(
    event: SessionEvent, records: dict[str, cpb.BracketRecord], history: cpb.ListBracketsResponse
) -> None:
    kind = ev.body_name(event)
    if kind == "compaction_start":
        records[event.compaction_start.compaction_id] = _opened(event)
    elif kind == "compaction_prune":
        _pruned(event, records, history)
    elif kind == "compaction_summary_error":
        _summary_error(event, records)
    elif kind == "compaction_summary":
        _summary(event, records)
    elif kind == "compaction_end":
        _ended(event, records)
    elif kind == "user_message" and ev.checkpoint_compaction_id(event) in records:
        record = records[ev.checkpoint_compaction_id(event)]
        if record.checkpoint_seq < 0:  # not a copy a later revert restored
            record.checkpoint_seq = event.seq
            record.steps.append(_step(cpb.COMPACTION_STEP_REPLACE, event, "checkpoint"))
    if ev.is_replace(event):
        _reverted(event, records)


def _reverted(event: SessionEvent, records: dict[str, cpb.BracketRecord]) -> None:
    """A revert bracket's REPLACE of the checkpoint it reverts: its commit (``checkpoint_seq``
    is then the first restored node)."""
    for record in records.values():
        reverting = record.trigger == events_pb2.COMPACTION_TRIGGER_REVERT and record.end_seq < 0
        if reverting and record.range.start_seq in event.source_event_seqs:
            record.checkpoint_seq = event.seq
            detail = f"checkpoint {record.range.start_seq} reverted"
            record.steps.append(_step(cpb.COMPACTION_STEP_REPLACE, event, detail))
            return


def _opened(event: SessionEvent) -> cpb.BracketRecord:
    start = event.compaction_start
    record = cpb.BracketRecord(
        compaction_id=start.compaction_id,
        trigger=start.trigger,
        range=start.range,
        shadowed_count=len(start.shadowed_seqs),
        start_seq=event.seq,
        end_seq=-1,
        checkpoint_seq=-1,
        start_time=event.time,
    )
    if start.HasField("turn"):
        record.turn = start.turn
    if start.HasField("prepared_ahead"):  # its summary was written before the trigger
        record.prepared_ahead.CopyFrom(start.prepared_ahead)
    record.steps.append(_step(cpb.COMPACTION_STEP_START, event, ""))
    return record


def _pruned(
    event: SessionEvent, records: dict[str, cpb.BracketRecord], history: cpb.ListBracketsResponse
) -> None:
    prune = event.compaction_prune
    detail = (
        f"pruned tool/result {prune.shadowed_seq}: {prune.original_code_points} -> "
        f"{prune.retained_code_points} code points"
    )
    step = _step(cpb.COMPACTION_STEP_PRUNE, event, detail)
    record = records.get(prune.compaction_id) if prune.compaction_id else None
    (record.steps if record is not None else history.prunes).append(step)


def _summary_error(event: SessionEvent, records: dict[str, cpb.BracketRecord]) -> None:
    error = event.compaction_summary_error
    record = records.get(error.compaction_id)
    if record is None:
        return
    record.summary_errors += 1
    retry = " (retrying)" if error.retrying else ""
    detail = f"attempt {error.attempt} failed ({error.reason}): {error.error}{retry}"
    record.steps.append(_step(cpb.COMPACTION_STEP_SUMMARIZE, event, detail))


def _summary(event: SessionEvent, records: dict[str, cpb.BracketRecord]) -> None:
    summary = event.compaction_summary
    record = records.get(summary.compaction_id)
    if record is None:
        return
    record.tokens.CopyFrom(summary.tokens)
    record.summary_target.CopyFrom(summary.target)
    record.summarizer = summary.summarizer
    record.rung = summary.rung
    record.usage.CopyFrom(summary.usage)
    if summary.HasField("gate"):
        record.gate.CopyFrom(summary.gate)
    detail = f"{summary.summarizer}: {len(summary.summary)} chars"
    record.steps.append(_step(cpb.COMPACTION_STEP_SUMMARY, event, detail))


def _ended(event: SessionEvent, records: dict[str, cpb.BracketRecord]) -> None:
    end = event.compaction_end
    record = records.get(end.compaction_id)
    if record is None:
        return
    record.end_seq = event.seq
    record.end_time.CopyFrom(event.time)
    start, stop = record.start_time, event.time
    seconds = (stop.seconds - start.seconds) + (stop.nanos - start.nanos) / 1e9
    record.duration_seconds = max(0.0, seconds)
    record.error, record.error_reason = end.error, end.error_reason
    if end.HasField("gate"):
        record.gate.CopyFrom(end.gate)
    committed = record.checkpoint_seq >= 0 and not end.error_reason
    record.outcome = cpb.BRACKET_OUTCOME_COMMITTED if committed else cpb.BRACKET_OUTCOME_FAILED
    detail = f"{end.error_reason}: {end.error}" if end.error_reason else "closed"
    record.steps.append(_step(cpb.COMPACTION_STEP_END, event, detail))


def _step(step: cpb.CompactionStep.ValueType, event: SessionEvent, detail: str) -> cpb.BracketStep:
    return cpb.BracketStep(step=step, seq=event.seq, time=event.time, detail=detail)
