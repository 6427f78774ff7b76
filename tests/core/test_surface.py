"""The surface fold: APPEND, REPLACE by current positions, and every replacement rule."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from compactd.core.fold import SessionFold
from compactd.core.pairing import CorruptPairing
from compactd.core.surface import Surface
from compactd.core.validation import Origin
from compactd.errors import InvalidArgument, ReplacementRejected
from compactd.reasons import Reason
from compactd.v1 import events_pb2
from tests.builders import (
    SessionEvent,
    assistant,
    compaction_end,
    compaction_start,
    developer,
    end_seed,
    header,
    image_block,
    offload,
    replace,
    system,
    tool_result,
    turn_start,
    user,
)


def folded(*events: SessionEvent) -> SessionFold:
    """A fold that admitted ``events`` (checked) as one batch."""
    fold = SessionFold()
    fold.admit(events)
    return fold


def seqs(fold: SessionFold) -> list[int]:
    """Surface node seqs in position order."""
    return [node.seq for node in fold.surface]


def rejected(fold: SessionFold, event: SessionEvent, rule: str) -> ReplacementRejected:
    """Admit ``event``, expect a ``ReplacementRejected`` naming ``rule``, and no state change."""
    before = (fold.revision, seqs(fold), fold.surface.replacements)
    with pytest.raises(ReplacementRejected, match=rule) as caught:
        fold.admit([event])
    assert (fold.revision, seqs(fold), fold.surface.replacements) == before
    assert caught.value.reason == "REPLACEMENT_REJECTED"
    return caught.value


def field_of(error: ReplacementRejected) -> str:
    """The single field a rejection of a one-event batch points at, inside ``events[0]``."""
    (violation,) = error.violations
    assert violation.field.startswith("events[0].")
    return violation.field.removeprefix("events[0].")


# Surface layout used by several tests: seqs 0..4, then seq 5 replaces positions 1..2.
#   positions: 0      1      2      3
#   seqs:      0      5      3      4
def replaced_middle() -> SessionFold:
    fold = folded(system("s"), user("a"), assistant("b"), user("c"), assistant("d"))
    fold.admit([replace(user("sum"), start=1, end=2, sources=[1, 2])])
    return fold


# --- APPEND and log-only events ---------------------------------------------------------------


def test_append_adds_a_node_at_the_end() -> None:
    fold = folded(system("s"), user("a"))
    batch = fold.admit([assistant("b")])
    assert seqs(fold) == [0, 1, 2]
    assert [n.type for n in fold.surface] == ["system/message", "user/message", "assistant/message"]
    (change,) = batch.surface_changes
    assert (change.position, change.node.seq, change.shadowed) == (2, 2, ())


def test_a_node_reads_back_the_admitted_event_and_its_calls() -> None:
    fold = folded(user("a"), assistant("b", calls=[("c1", "f", "{}"), ("c2", "g", "{}")]))
    fold.admit([tool_result("c1", "out")])
    call, result = fold.surface[1], fold.surface[2]
    assert call.event.assistant_message.content[0].text.text == "b"
    assert (call.calls, call.answers) == (("c1", "c2"), "")
    assert (result.calls, result.answers) == ((), "c1")
    assert result.event.seq == 2


def test_changing_a_read_event_changes_no_node() -> None:
    fold = folded(user("a"))
    read = fold.surface[0].event
    read.user_message.content[0].text.text = "changed"
    assert fold.surface[0].event.user_message.content[0].text.text == "a"


def test_explicit_append_op_appends_like_an_absent_op() -> None:
    event = user("a")
    event.surface_op.kind = events_pb2.SURFACE_OP_KIND_APPEND
    fold = folded(user("first"), event)
    assert seqs(fold) == [0, 1]


@pytest.mark.parametrize(
    "log_only",
    [
        turn_start(1),
        header("p", "m"),
        compaction_start("k"),
        end_seed(),
        SessionEvent(step_start=events_pb2.StepStart(turn=1, step=1)),
        SessionEvent(tool_call=events_pb2.ToolCall(tool_call_id="c", name="t")),
        SessionEvent(llm_retry=events_pb2.LlmRetry(attempt=2)),
    ],
    ids=lambda e: e.WhichOneof("body"),
)
def test_log_only_events_never_become_nodes(log_only: SessionEvent) -> None:
    fold = folded(user("a"), log_only, user("b"))
    assert seqs(fold) == [0, 2]
    assert fold.surface.position_of(1) is None
    assert fold.revision == 3


def test_bracket_and_offload_events_never_become_nodes() -> None:
    fold = folded(
        user("a", blocks=[image_block("x.png")]),
        compaction_start("k"),
        compaction_end("k"),
        offload({0: [0]}),
    )
    assert seqs(fold) == [0]


# --- REPLACE by current surface positions -----------------------------------------------------


def test_replace_puts_the_new_node_at_the_span_position() -> None:
    fold = folded(system("s"), user("a"), assistant("b"), user("c"), assistant("d"))
    batch = fold.admit([replace(user("sum"), start=1, end=2, sources=[1, 2])])
    assert seqs(fold) == [0, 5, 3, 4]
    assert fold.surface.position_of(5) == 1
    assert [fold.surface.position_of(s) for s in (1, 2)] == [None, None]
    assert [fold.surface.position_of(s) for s in (3, 4)] == [2, 3]
    (change,) = batch.surface_changes
    assert change.position == 1
    assert [n.seq for n in change.shadowed] == [1, 2]
    assert fold.surface.replacements == 1


def test_replace_of_a_single_node_keeps_later_positions() -> None:
    fold = folded(user("a"), user("b"), user("c"))
    fold.admit([replace(user("b2"), start=1, end=1, sources=[1])])
    assert seqs(fold) == [0, 3, 2]


def test_replace_whose_start_has_a_higher_seq_than_its_end_uses_positions() -> None:
    fold = replaced_middle()  # seq 5 sits at position 1, before seq 3 at position 2
    fold.admit([replace(user("sum2"), start=5, end=3, sources=[5, 3])])
    assert seqs(fold) == [0, 6, 4]


def test_replace_range_is_a_span_of_positions_not_a_seq_interval() -> None:
    fold = replaced_middle()
    # Positions 1..3 hold seqs 5, 3, 4: seq 3 is inside although the interval 4..5 excludes it.
    batch = fold.admit([replace(user("sum2"), start=5, end=4, sources=[3, 4, 5])])
    assert [n.seq for n in batch.surface_changes[0].shadowed] == [5, 3, 4]
    assert seqs(fold) == [0, 6]


def test_replace_range_does_not_shadow_seqs_outside_the_span_inside_the_interval() -> None:
    fold = folded(user("a"), user("b"), user("c"), user("d"))
    fold.admit([replace(user("sum"), start=1, end=2, sources=[1, 2])])  # seqs 0, 4, 3
    # Seq interval 0..4 would include seq 3, but positions 0..1 hold only seqs 0 and 4.
    fold.admit([replace(user("sum2"), start=0, end=4, sources=[0, 4])])
    assert seqs(fold) == [5, 3]


def test_surface_undo_restores_nodes_and_positions() -> None:
    surface = Surface()
    events = [user("a"), user("b"), user("c")]
    for seq, event in enumerate(events):
        surface.apply(event, seq)
    nodes = list(surface.nodes)
    change = surface.apply(replace(user("s"), start=0, end=1, sources=[0, 1]), 3)
    surface.undo(change)
    assert list(surface.nodes) == nodes
    assert [surface.position_of(s) for s in range(4)] == [0, 1, 2, None]
    assert surface.replacements == 0


# --- replacement rules: endpoints -------------------------------------------------------------


def test_replace_endpoint_that_was_shadowed_is_rejected() -> None:
    fold = replaced_middle()
    error = rejected(
        fold,
        replace(user("x"), start=1, end=3, sources=[1, 3]),
        "start_seq 1 is not a current surface node",
    )
    assert field_of(error) == "surface_op.start_seq"


def test_replace_endpoint_naming_a_log_only_event_is_rejected() -> None:
    fold = folded(user("a"), turn_start(1), user("b"))
    error = rejected(
        fold,
        replace(user("x"), start=0, end=1, sources=[0, 1]),
        "end_seq 1 is not a current surface node",
    )
    assert field_of(error) == "surface_op.end_seq"


@pytest.mark.parametrize("end", [2, 9])
def test_replace_endpoint_that_is_not_an_earlier_event_is_rejected(end: int) -> None:
    fold = folded(user("a"), user("b"))  # the replacement gets seq 2
    error = rejected(
        fold,
        replace(user("x"), start=0, end=end, sources=[0, 1]),
        f"end_seq {end} is not an earlier event",
    )
    assert field_of(error) == "surface_op.end_seq"


def test_replace_whose_start_is_after_its_end_by_position_is_rejected() -> None:
    fold = replaced_middle()  # seq 3 at position 2 comes after seq 5 at position 1
    error = rejected(
        fold,
        replace(user("x"), start=3, end=5, sources=[3, 5]),
        "start_seq 3 is at position 2, after end_seq 5 at position 1",
    )
    assert field_of(error) == "surface_op"


# --- replacement rules: source_event_seqs -----------------------------------------------------


def test_replace_without_sources_is_rejected() -> None:
    fold = folded(user("a"), user("b"))
    error = rejected(
        fold, replace(user("x"), start=0, end=0, sources=[]), "must cite its source_event_seqs"
    )
    assert field_of(error) == "source_event_seqs"


def test_replace_with_duplicate_sources_is_rejected() -> None:
    fold = folded(user("a"), user("b"))
    error = rejected(
        fold, replace(user("x"), start=0, end=1, sources=[0, 1, 0]), "must not repeat a seq"
    )
    assert field_of(error) == "source_event_seqs"


@pytest.mark.parametrize("bad_source", [2, 3, -1])
def test_replace_citing_a_source_that_is_not_earlier_is_rejected(bad_source: int) -> None:
    fold = folded(user("a"), user("b"))
    error = rejected(
        fold,
        replace(user("x"), start=0, end=1, sources=[0, 1, bad_source]),
        "must all be earlier than seq 2",
    )
    assert field_of(error) == "source_event_seqs"


def test_append_citing_a_later_source_is_rejected() -> None:
    fold = folded(user("a"))
    event = user("b")
    event.source_event_seqs.append(1)
    rejected(fold, event, "must all be earlier than seq 1")


def test_append_may_cite_earlier_sources() -> None:
    event = user("b")
    event.source_event_seqs.append(0)
    assert seqs(folded(user("a"), event)) == [0, 1]


def test_replace_that_does_not_cite_every_shadowed_node_is_rejected() -> None:
    fold = folded(user("a"), user("b"), user("c"))
    error = rejected(
        fold,
        replace(user("x"), start=0, end=2, sources=[0, 2]),
        r"must cite every shadowed node; missing \[1\]",
    )
    assert field_of(error) == "source_event_seqs"


def test_replace_may_cite_more_than_the_shadowed_nodes() -> None:
    fold = folded(compaction_start("k"), user("a"), user("b"))
    fold.admit([replace(user("sum"), start=1, end=2, sources=[0, 1, 2])])
    assert seqs(fold) == [3]


# --- replacement rules: tool/result rewrite ---------------------------------------------------


def tool_exchange() -> SessionFold:
    """seqs: 0 user, 1 assistant calling c1, 2 its result, 3 user."""
    return folded(
        user("go"),
        assistant(calls=[("c1", "grep", "{}")]),
        tool_result("c1", "long output", name="grep"),
        user("next"),
    )


def test_tool_result_replacement_may_change_its_content() -> None:
    fold = tool_exchange()
    pruned = replace(tool_result("c1", "[pruned]", name="grep"), start=2, end=2, sources=[2])
    fold.admit([pruned])
    assert seqs(fold) == [0, 1, 4, 3]
    assert fold.surface[2].event.tool_result.content[0].text.text == "[pruned]"


@pytest.mark.parametrize(
    "changed",
    [
        tool_result("c2", "[pruned]", name="grep"),
        tool_result("c1", "[pruned]", name="find"),
        tool_result("c1", "[pruned]", name="grep", is_error=True),
    ],
    ids=["call_id", "tool_name", "is_error"],
)
def test_tool_result_replacement_that_changes_more_than_content_is_rejected(
    changed: SessionEvent,
) -> None:
    fold = folded(
        user("go"),
        assistant(calls=[("c1", "grep", "{}"), ("c2", "grep", "{}")]),
        tool_result("c1", "long output", name="grep"),
        tool_result("c2", "other", name="grep"),
    )
    error = rejected(
        fold,
        replace(changed, start=2, end=2, sources=[2]),
        "rewrites exactly one current tool/result and may change only its content",
    )
    assert field_of(error) == "tool_result"


def test_tool_result_replacement_of_two_nodes_is_rejected() -> None:
    fold = tool_exchange()
    rejected(
        fold,
        replace(tool_result("c1", "x", name="grep"), start=2, end=3, sources=[2, 3]),
        "a tool/result replacement rewrites exactly one current tool/result",
    )


def test_tool_result_replacement_of_a_message_is_rejected() -> None:
    fold = tool_exchange()
    rejected(
        fold,
        replace(tool_result("c1", "x", name="grep"), start=3, end=3, sources=[3]),
        "a tool/result replacement rewrites exactly one current tool/result",
    )


# --- replacement rules: the system head -------------------------------------------------------


def test_span_including_the_system_head_and_more_is_rejected() -> None:
    fold = folded(system("s"), user("a"), user("b"))
    error = rejected(
        fold,
        replace(user("x"), start=0, end=1, sources=[0, 1]),
        "span including the system/message at position 0 must be exactly that node",
    )
    assert field_of(error) == "surface_op"


def test_system_head_replaced_by_a_non_system_message_is_rejected() -> None:
    fold = folded(system("s"), user("a"))
    error = rejected(
        fold,
        replace(user("x"), start=0, end=0, sources=[0]),
        "must be exactly that node, replaced by a system/message",
    )
    assert field_of(error) == "body"


def test_system_head_may_be_replaced_by_a_system_message() -> None:
    fold = folded(system("s"), user("a"))
    fold.admit([replace(system("s2"), start=0, end=0, sources=[0])])
    assert seqs(fold) == [2, 1]
    assert fold.surface[0].event.system_message.text == "s2"


def test_later_system_message_is_ordinary_history() -> None:
    fold = folded(system("s"), user("a"), system("update"), user("b"))
    fold.admit([replace(user("sum"), start=1, end=3, sources=[1, 2, 3])])
    assert seqs(fold) == [0, 4]


def test_a_later_system_message_may_be_replaced_by_another_kind() -> None:
    fold = folded(system("s"), user("a"), system("update"))
    fold.admit([replace(developer("d"), start=2, end=2, sources=[2])])
    assert seqs(fold) == [0, 1, 3]


def test_span_from_position_zero_is_free_when_the_head_is_not_a_system_message() -> None:
    fold = folded(user("a"), user("b"), system("late"))
    fold.admit([replace(user("sum"), start=0, end=2, sources=[0, 1, 2])])
    assert seqs(fold) == [3]


# --- replacement rules: balanced cuts ---------------------------------------------------------


def test_span_that_starts_between_a_call_and_its_result_is_rejected() -> None:
    fold = tool_exchange()
    error = rejected(
        fold,
        replace(user("x"), start=2, end=3, sources=[2, 3]),
        "must begin and end at balanced tool-call cuts",
    )
    assert field_of(error) == "surface_op"


def test_span_that_ends_between_a_call_and_its_result_is_rejected() -> None:
    fold = tool_exchange()
    rejected(
        fold,
        replace(user("x"), start=0, end=1, sources=[0, 1]),
        "must begin and end at balanced tool-call cuts",
    )


def test_span_that_holds_a_whole_call_unit_is_accepted() -> None:
    fold = tool_exchange()
    fold.admit([replace(user("sum"), start=1, end=2, sources=[1, 2])])
    assert seqs(fold) == [0, 4, 3]


def test_span_that_would_leave_a_later_result_without_its_call_is_rejected() -> None:
    # A call may have several results; the end cut closes at the first one.
    fold = folded(
        user("go"),
        assistant(calls=[("c1", "t", "{}")]),
        tool_result("c1", "first"),
        tool_result("c1", "second"),
    )
    rejected(
        fold,
        replace(user("x"), start=1, end=2, sources=[1, 2]),
        "must begin and end at balanced tool-call cuts",
    )
    fold.admit([replace(user("sum"), start=1, end=3, sources=[1, 2, 3])])
    assert seqs(fold) == [0, 4]


def test_span_may_shadow_a_call_that_another_current_node_also_makes() -> None:
    fold = folded(
        assistant(calls=[("c1", "t", "{}")]),
        tool_result("c1", "first"),
        assistant(calls=[("c1", "t", "{}")]),
        tool_result("c1", "again"),
    )
    fold.admit([replace(user("sum"), start=0, end=1, sources=[0, 1])])
    assert seqs(fold) == [4, 2, 3]


# --- tool pairing on append -------------------------------------------------------------------


def test_result_with_no_earlier_call_is_corrupt_input() -> None:
    fold = folded(user("a"))
    with pytest.raises(CorruptPairing, match="'c9'") as caught:
        fold.admit([tool_result("c9", "x")])
    assert caught.value.reason == "TOOL_RESULT_WITHOUT_CALL"
    assert caught.value.violations[0].field == "events[0].tool_result.tool_call_id"
    assert fold.revision == 1


def test_result_whose_call_was_shadowed_is_corrupt_input() -> None:
    fold = tool_exchange()
    fold.admit([replace(user("sum"), start=1, end=2, sources=[1, 2])])
    with pytest.raises(CorruptPairing):
        fold.admit([tool_result("c1", "late")])


def test_result_in_the_same_batch_as_its_call_is_paired() -> None:
    fold = folded(assistant(calls=[("c1", "t", "{}")]), tool_result("c1", "x"))
    assert seqs(fold) == [0, 1]


# --- what a resident node costs the cyclic collector -------------------------------------------


def test_a_node_is_not_tracked_by_the_cyclic_collector() -> None:
    fold = folded(user("a"), assistant("b", calls=[("c1", "f", "{}")]), tool_result("c1", "out"))
    assert [gc.is_tracked(node) for node in fold.surface] == [False, False, False]


def test_an_untracked_node_is_freed_with_its_fold() -> None:
    tracing = tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        fold = folded(*[user("x" * 10_000) for _ in range(100)])
        held = tracemalloc.get_traced_memory()[0] - start
        del fold
        left = tracemalloc.get_traced_memory()[0] - start
    finally:
        if not tracing:
            tracemalloc.stop()
    assert held > 100 * 10_000  # the nodes hold their events' bytes
    assert left < held / 10  # refcounting frees them: untracked is not leaked


def _insert(event: SessionEvent, after: int, sources: list[int]) -> SessionEvent:
    copy = SessionEvent()
    copy.CopyFrom(event)
    copy.surface_op.kind = events_pb2.SURFACE_OP_KIND_INSERT
    copy.surface_op.start_seq = after
    copy.surface_op.end_seq = after
    copy.source_event_seqs[:] = sources
    return copy


def test_insert_puts_the_new_node_right_after_the_named_one() -> None:
    fold = folded(user("a"), user("b"), user("c"))
    fold.admit([_insert(user("a copy"), 0, [0])])
    assert seqs(fold) == [0, 3, 1, 2]
    fold.admit([_insert(user("again"), 3, [0])])
    assert seqs(fold) == [0, 3, 4, 1, 2]


def test_an_insert_names_one_current_node_and_cites_its_source() -> None:
    fold = folded(user("a"), user("b"))
    wide = _insert(user("x"), 0, [0])
    wide.surface_op.end_seq = 1
    rejected(fold, wide, "an INSERT names one node")
    rejected(fold, _insert(user("x"), 0, []), "must cite its source_event_seqs")
    fold.admit([replace(user("sum"), start=0, end=0, sources=[0])])
    rejected(fold, _insert(user("x"), 0, [0]), "is not a current surface node")


def test_a_client_may_not_insert() -> None:
    fold = folded(user("a"))
    with pytest.raises(InvalidArgument) as refused:
        fold.admit([_insert(user("x"), 0, [0])], origin=Origin.CLIENT)
    assert refused.value.reason == Reason.SERVER_ONLY_EVENT
