"""Bracket history folded from a log: steps, outcomes, the end-seed rule for unmatched starts."""

from __future__ import annotations

from compactd.core.history import bracket_history
from compactd.reasons import Reason
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from tests.builders import (
    SessionEvent,
    checkpoint,
    compaction_end,
    compaction_start,
    end_seed,
    user,
)


def logged(*events: SessionEvent) -> list[SessionEvent]:
    """``events`` with seqs, as the store returns them."""
    for seq, event in enumerate(events):
        event.seq = seq
    return list(events)


def summary(compaction_id: str) -> SessionEvent:
    body = events_pb2.CompactionSummary(
        compaction_id=compaction_id,
        summary="s",
        summarizer="extractive",
        tokens=events_pb2.TokenMeasurement(envelope_before=900, envelope_after=300),
    )
    return SessionEvent(compaction_summary=body)


def summary_error(compaction_id: str) -> SessionEvent:
    body = events_pb2.CompactionSummaryError(
        compaction_id=compaction_id, error="boom", reason=Reason.TIMEOUT, attempt=1
    )
    return SessionEvent(compaction_summary_error=body)


def failed_end(compaction_id: str) -> SessionEvent:
    end = compaction_end(compaction_id, "rejected")
    end.compaction_end.error_reason = "SUMMARY_REJECTED"
    return end


def test_each_bracket_has_its_steps_and_outcome_in_start_order() -> None:
    history = bracket_history(
        logged(
            user("hi"),
            compaction_start("ok"), summary_error("ok"), summary("ok"), checkpoint("ok", "c"),
            compaction_end("ok"),
            compaction_start("bad"), failed_end("bad"),
        )
    )  # fmt: skip
    ok, bad = history.brackets
    assert ok.outcome == cpb.BRACKET_OUTCOME_COMMITTED
    assert [s.step for s in ok.steps] == [
        cpb.COMPACTION_STEP_START, cpb.COMPACTION_STEP_SUMMARIZE, cpb.COMPACTION_STEP_SUMMARY,
        cpb.COMPACTION_STEP_REPLACE, cpb.COMPACTION_STEP_END,
    ]  # fmt: skip
    assert (ok.start_seq, ok.checkpoint_seq, ok.end_seq, ok.summary_errors) == (1, 4, 5, 1)
    assert (ok.tokens.envelope_before, ok.tokens.envelope_after) == (900, 300)
    assert ok.summarizer == "extractive"
    assert bad.outcome == cpb.BRACKET_OUTCOME_FAILED
    assert (bad.error_reason, bad.checkpoint_seq) == ("SUMMARY_REJECTED", -1)
    assert history.revision == 8
    assert history.last_end_seed == -1


def test_unmatched_starts_are_stale_before_the_newest_end_seed_and_live_after_it() -> None:
    history = bracket_history(
        logged(
            compaction_start("crashed"), end_seed(), compaction_start("older-crash"), end_seed(),
            compaction_start("running"),
        )
    )  # fmt: skip
    outcomes = {b.compaction_id: b.outcome for b in history.brackets}
    assert outcomes == {
        "crashed": cpb.BRACKET_OUTCOME_STALE,
        "older-crash": cpb.BRACKET_OUTCOME_STALE,
        "running": cpb.BRACKET_OUTCOME_LIVE,
    }
    assert history.last_end_seed == 3


def test_prunes_outside_brackets_are_listed_apart() -> None:
    prune = SessionEvent(
        compaction_prune=events_pb2.CompactionPrune(
            shadowed_seq=0, original_code_points=9000, retained_code_points=5120
        )
    )
    history = bracket_history(logged(user("x"), prune))
    assert not history.brackets
    (step,) = history.prunes
    assert (step.step, step.seq) == (cpb.COMPACTION_STEP_PRUNE, 1)
    assert "9000 -> 5120" in step.detail
