"""The events of the five-step compaction bracket, built purely from their inputs.

1. ``compaction/start`` (takes the log-recorded lock), 2. the summary is written and the span
revalidated (``selection.drift``), 3. ``compaction/summary`` (log-only accounting), 4. the
checkpoint ``user/message`` REPLACE of the span, 5. ``compaction/end`` (releases the lock, last).
A failed summary request passes through ``compaction/summary-error`` inside the bracket. Who
appends these, and when, is the bracket runner's business; nothing here does I/O.
"""

from __future__ import annotations

from compactd.core import prompts
from compactd.core.events import SessionEvent
from compactd.core.recall import checkpoint_handle, with_recall_handles
from compactd.core.selection import Selection
from compactd.v1 import events_pb2


def surface_range(selection: Selection) -> events_pb2.SurfaceRange:
    """The selected span as the log records it."""
    return events_pb2.SurfaceRange(
        start_position=selection.start_position,
        end_position=selection.end_position,
        start_seq=selection.start_seq,
        end_seq=selection.end_seq,
    )


def start_event(
    compaction_id: str,
    trigger: events_pb2.CompactionTrigger.ValueType,
    selection: Selection,
    turn: int | None,
) -> SessionEvent:
    """Step 1: ``compaction/start``; ``turn`` is the owning open turn, None for on-demand."""
    start = events_pb2.CompactionStart(
        compaction_id=compaction_id,
        trigger=trigger,
        range=surface_range(selection),
        shadowed_seqs=selection.shadowed_seqs,
    )
    if turn is not None:
        start.turn = turn
    return SessionEvent(compaction_start=start)


def summary_error_event(
    compaction_id: str, error: str, reason: str, *, attempt: int, retrying: bool
) -> SessionEvent:
    """``compaction/summary-error``: summary attempt ``attempt`` (from 1) failed."""
    body = events_pb2.CompactionSummaryError(
        compaction_id=compaction_id, error=error, reason=reason, attempt=attempt, retrying=retrying
    )
    return SessionEvent(compaction_summary_error=body)


def summary_event(
    compaction_id: str,
    summary: str,
    selection: Selection,
    tokens: events_pb2.TokenMeasurement,
    *,
    target: events_pb2.Route | None = None,
    usage: events_pb2.Usage | None = None,
    summarizer: str = "",
    gate: events_pb2.SummaryGateReport | None = None,
    fallback: events_pb2.SummaryFallback | None = None,
    rung: events_pb2.CompactionRung.ValueType = events_pb2.COMPACTION_RUNG_SUMMARY,
) -> SessionEvent:
    """Step 3: ``compaction/summary`` with the raw summary and its accounting (log-only).

    Args:
        compaction_id: The bracket id.
        summary: The raw summary text, before framing.
        selection: The replaced span (range and shadowed seqs are copied from it).
        tokens: Envelope before/after (route price) and span/checkpoint prices (heuristic and
            route).
        target: The route that wrote the summary; None for a summarizer with no model.
        usage: The provider's usage of the summary call(s), when reported.
        summarizer: The summarizer's name (``openai``, ``extractive``, ...).
        gate: The quality gate's report on this summary, when the gate ran.
        fallback: The rejected summary this one replaced (extractive fallback), if any.
        rung: The rung of the ladder that wrote the summary.
    """
    body = events_pb2.CompactionSummary(
        compaction_id=compaction_id,
        summary=summary,
        range=surface_range(selection),
        shadowed_seqs=selection.shadowed_seqs,
        tokens=tokens,
        summarizer=summarizer,
        rung=rung,
    )
    if target is not None:
        body.target.CopyFrom(target)
    if usage is not None:
        body.usage.CopyFrom(usage)
    if gate is not None:
        body.gate.CopyFrom(gate)
    if fallback is not None:
        body.fallback.CopyFrom(fallback)
    return SessionEvent(compaction_summary=body)


def checkpoint_text(summary: str, start_seq: int, open_handles: str = "") -> str:
    """The checkpoint's text: the framed summary with its open handles
    (``prompts.frame_checkpoint``), then the recall handle of what it replaces
    (``core.recall``), named by the bracket's start seq."""
    framed = prompts.frame_checkpoint(summary, open_handles)
    return with_recall_handles(framed, [checkpoint_handle(start_seq)])


def checkpoint_message(compaction_id: str, framed_text: str) -> SessionEvent:
    """The checkpoint ``user/message`` body alone (an APPEND), e.g. to price it before step 4."""
    event = SessionEvent()
    message = event.user_message
    message.content.add().text.text = framed_text
    message.source.compaction_checkpoint.compaction_id = compaction_id
    return event


def checkpoint_event(
    compaction_id: str, framed_text: str, selection: Selection, start_seq: int, summary_seq: int
) -> SessionEvent:
    """Step 4: the checkpoint REPLACE of the selected span, the commit's only surface change.

    Args:
        compaction_id: The bracket id (the checkpoint's source).
        framed_text: The preamble, tagged summary and recall handles (``checkpoint_text``).
        selection: The span; its end seqs are the REPLACE endpoints.
        start_seq: Seq of this bracket's ``compaction/start``.
        summary_seq: Seq of this bracket's ``compaction/summary``.

    Returns:
        The event, citing ``[start_seq, summary_seq, *shadowed seqs]`` in that order.
    """
    event = checkpoint_message(compaction_id, framed_text)
    event.surface_op.kind = events_pb2.SURFACE_OP_KIND_REPLACE
    event.surface_op.start_seq = selection.start_seq
    event.surface_op.end_seq = selection.end_seq
    event.source_event_seqs.extend([start_seq, summary_seq, *selection.shadowed_seqs])
    return event


def end_event(
    compaction_id: str,
    error: str = "",
    reason: str = "",
    *,
    gate: events_pb2.SummaryGateReport | None = None,
    rung: events_pb2.CompactionRung.ValueType = events_pb2.COMPACTION_RUNG_UNSPECIFIED,
) -> SessionEvent:
    """Step 5: ``compaction/end``; ``error`` and ``reason`` when the bracket failed or declined,
    ``gate`` with the failed checks when the quality gate rejected the summary, ``rung`` the
    ladder's rung that wrote a committed checkpoint."""
    body = events_pb2.CompactionEnd(
        compaction_id=compaction_id, error=error, error_reason=reason, rung=rung
    )
    if gate is not None:
        body.gate.CopyFrom(gate)
    return SessionEvent(compaction_end=body)


def shrinks(checkpoint_price: int, shadowed_price: int) -> bool:
    """Whether a checkpoint is strictly smaller (route price) than the span it would replace."""
    return checkpoint_price < shadowed_price
