"""The bracket's events: start, summary, the checkpoint REPLACE and end, folded in order."""

from __future__ import annotations

from compactd.core.bracket import (
    checkpoint_event,
    checkpoint_message,
    end_event,
    shrinks,
    start_event,
    summary_error_event,
    summary_event,
)
from compactd.core.events import checkpoint_compaction_id, event_type
from compactd.core.fold import SessionFold
from compactd.core.lock import live_bracket
from compactd.core.prompts import frame_checkpoint
from compactd.core.selection import Selection, SelectionMode, select_range
from compactd.core.surface import SurfaceNode
from compactd.v1 import events_pb2
from tests.builders import assistant, system, tool_result, user

PRESSURE = events_pb2.COMPACTION_TRIGGER_PRESSURE


def ten(node: SurfaceNode) -> int:
    return 10


def conversation() -> tuple[SessionFold, Selection]:
    """sys, a, call c1, its result, b, c: the maximal span is seqs 1..4."""
    fold = SessionFold()
    fold.admit(
        [
            system("sys"),
            user("a"),
            assistant("go", calls=[("c1", "read", "{}")]),
            tool_result("c1", "file"),
            user("b"),
            assistant("c"),
        ]
    )
    selection = select_range(fold, ten, mode=SelectionMode.MAXIMAL)
    assert isinstance(selection, Selection)
    assert selection.shadowed_seqs == (1, 2, 3, 4)
    return fold, selection


def test_start_records_the_range_the_trigger_and_the_owning_turn() -> None:
    _, selection = conversation()
    start = start_event("k1", PRESSURE, selection, turn=3).compaction_start
    assert (start.compaction_id, start.trigger, start.turn) == ("k1", PRESSURE, 3)
    assert (start.range.start_position, start.range.end_position) == (1, 4)
    assert (start.range.start_seq, start.range.end_seq) == (1, 4)
    assert list(start.shadowed_seqs) == [1, 2, 3, 4]


def test_on_demand_start_has_no_turn() -> None:
    _, selection = conversation()
    manual = events_pb2.COMPACTION_TRIGGER_MANUAL
    assert not start_event("k1", manual, selection, None).compaction_start.HasField("turn")


def test_summary_records_the_raw_text_and_its_accounting() -> None:
    _, selection = conversation()
    tokens = events_pb2.TokenMeasurement(envelope_before=900, envelope_after=300)
    route = events_pb2.Route(provider="deepseek", model="deepseek-chat")
    usage = events_pb2.Usage(input_tokens=800, output_tokens=60)
    body = summary_event(
        "k1", "raw", selection, tokens, target=route, usage=usage, summarizer="openai"
    ).compaction_summary
    assert (body.summary, body.summarizer, body.target.model) == ("raw", "openai", "deepseek-chat")
    assert (body.tokens.envelope_before, body.tokens.envelope_after) == (900, 300)
    assert body.usage.output_tokens == 60
    assert list(body.shadowed_seqs) == [1, 2, 3, 4]
    assert body.range.end_position == 4


def test_summary_without_a_model_has_no_target_or_usage() -> None:
    _, selection = conversation()
    tokens = events_pb2.TokenMeasurement()
    body = summary_event("k1", "raw", selection, tokens, summarizer="extractive")
    assert not body.compaction_summary.HasField("target")
    assert not body.compaction_summary.HasField("usage")


def test_checkpoint_cites_start_summary_and_every_shadowed_seq_in_order() -> None:
    _, selection = conversation()
    event = checkpoint_event("k1", frame_checkpoint("raw"), selection, 6, 7)
    assert event.surface_op.kind == events_pb2.SURFACE_OP_KIND_REPLACE
    assert (event.surface_op.start_seq, event.surface_op.end_seq) == (1, 4)
    assert list(event.source_event_seqs) == [6, 7, 1, 2, 3, 4]
    assert checkpoint_compaction_id(event) == "k1"
    assert event.user_message.content[0].text.text == frame_checkpoint("raw")


def test_checkpoint_message_alone_is_an_append_to_price() -> None:
    event = checkpoint_message("k1", "text")
    assert not event.HasField("surface_op")
    assert checkpoint_compaction_id(event) == "k1"


def test_end_carries_the_error_when_the_bracket_failed() -> None:
    body = end_event("k1", error="summary did not shrink", reason="NO_SHRINK").compaction_end
    assert (body.compaction_id, body.error, body.error_reason) == (
        "k1",
        "summary did not shrink",
        "NO_SHRINK",
    )
    assert end_event("k1").compaction_end.error == ""


def test_summary_error_records_the_attempt() -> None:
    body = summary_error_event(
        "k1", "too many images", "IMAGE_OFFLOAD_REQUIRED", attempt=1, retrying=True
    ).compaction_summary_error
    assert (body.reason, body.attempt, body.retrying) == ("IMAGE_OFFLOAD_REQUIRED", 1, True)


def test_the_five_steps_fold_and_release_the_lock() -> None:
    fold, selection = conversation()
    start_seq = fold.revision
    fold.admit([start_event("k1", PRESSURE, selection, turn=1)])
    assert live_bracket(fold.lock) is not None
    fold.admit([summary_error_event("k1", "timeout", "UNAVAILABLE", attempt=1, retrying=True)])
    summary_seq = fold.revision
    tokens = events_pb2.TokenMeasurement(shadowed_route_tokens=selection.shadowed_price)
    fold.admit([summary_event("k1", "raw", selection, tokens, summarizer="extractive")])
    checkpoint = checkpoint_event("k1", frame_checkpoint("raw"), selection, start_seq, summary_seq)
    batch = fold.admit([checkpoint, end_event("k1")])
    assert [event_type(e) for e in batch.events] == ["user/message", "compaction/end"]
    assert live_bracket(fold.lock) is None
    assert [n.seq for n in fold.surface] == [0, batch.first_seq, 5]
    assert fold.messages()[1].content[0].text.text == frame_checkpoint("raw")


def test_a_checkpoint_shrinks_only_when_strictly_smaller() -> None:
    assert shrinks(99, 100)
    assert not shrinks(100, 100)
    assert not shrinks(101, 100)
