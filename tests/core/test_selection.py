"""Range selection: whole balanced units, the system head kept, a priced recent tail retained."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core import events as ev
from compactd.core.bracket import checkpoint_event, end_event, start_event, summary_event
from compactd.core.events import SessionEvent
from compactd.core.fold import SessionFold
from compactd.core.pairing import balanced_cuts
from compactd.core.selection import (
    DeclineCode,
    Declined,
    Revalidation,
    Selection,
    SelectionMode,
    SurfaceSnapshot,
    drift,
    head_length,
    open_calls,
    revalidation_for,
    select_range,
    still_valid,
    surface_snapshot,
    unit_boundaries,
)
from compactd.core.surface import SurfaceNode
from compactd.errors import ReplacementRejected
from compactd.v1 import events_pb2
from tests.builders import (
    assistant,
    checkpoint,
    image_block,
    offload,
    replace,
    system,
    tool_result,
    turn_start,
    user,
)

PRESSURE = SelectionMode.PRESSURE
MAXIMAL = SelectionMode.MAXIMAL


def ten(node: SurfaceNode) -> int:
    """Every node costs 10 tokens."""
    return 10


def text_price(node: SurfaceNode) -> int:
    """A node costs 1 token plus its serialized size: deterministic and content-dependent."""
    return 1 + node.event.ByteSize() // 8


def fold_of(*events: SessionEvent) -> SessionFold:
    fold = SessionFold()
    fold.admit(list(events))
    return fold


def select(
    fold: SessionFold, mode: SelectionMode = MAXIMAL, budget: int = 0
) -> Selection | Declined:
    return select_range(fold, ten, mode=mode, retained_budget=budget)


def selected(fold: SessionFold, mode: SelectionMode = MAXIMAL, budget: int = 0) -> Selection:
    result = select(fold, mode, budget)
    assert isinstance(result, Selection), result
    return result


def commit(fold: SessionFold, selection: Selection, compaction_id: str) -> None:
    """Run the bracket's log steps for ``selection`` through the fold's own checks."""
    start_seq = fold.revision
    fold.admit([start_event(compaction_id, events_pb2.COMPACTION_TRIGGER_PRESSURE, selection, 0)])
    summary_seq = fold.revision
    tokens = events_pb2.TokenMeasurement(shadowed_tokens=selection.shadowed_price)
    fold.admit([summary_event(compaction_id, "summary", selection, tokens)])
    framed = f"checkpoint {compaction_id}"
    replacement = checkpoint_event(compaction_id, framed, selection, start_seq, summary_seq)
    fold.admit([replacement, end_event(compaction_id)])


def test_system_head_is_never_selected() -> None:
    fold = fold_of(system("sys"), user("a"), assistant("b"), user("c"), assistant("d"))
    selection = selected(fold)
    assert (selection.start_position, selection.start_seq) == (1, 1)


def test_surface_without_a_system_head_is_selected_from_position_zero() -> None:
    fold = fold_of(user("a"), assistant("b"), user("c"))
    assert selected(fold).start_position == 0


def test_system_messages_right_after_the_head_are_never_selected() -> None:
    # The reference's range "starts at the first surface node that is not a system/message".
    fold = fold_of(
        system("sys"), system("Answer in English."), user("a"), assistant("b"), user("c")
    )
    assert selected(fold).shadowed_seqs == (2, 3)
    assert head_length(fold.surface.nodes) == 2


def test_a_system_message_first_after_a_non_system_head_is_ordinary_history() -> None:
    fold = fold_of(user("a"), system("new rules"), assistant("b"), user("c"))
    assert selected(fold).shadowed_seqs == (0, 1, 2)


def test_a_later_system_message_is_ordinary_history() -> None:
    fold = fold_of(system("sys"), user("a"), system("new rules"), assistant("b"), user("c"))
    assert selected(fold).shadowed_seqs == (1, 2, 3)


def test_maximal_selects_everything_but_the_last_unit() -> None:
    fold = fold_of(
        system("sys"),
        user("a"),
        assistant("b"),
        assistant("calling", calls=[("c1", "read", "{}"), ("c2", "read", "{}")]),
        tool_result("c2", "two"),
        tool_result("c1", "one"),
    )
    assert selected(fold).shadowed_seqs == (1, 2)


def test_pressure_keeps_at_least_the_retained_budget() -> None:
    fold = fold_of(system("sys"), *(user(f"m{i}") for i in range(8)))  # nine nodes of 10 tokens
    selection = selected(fold, PRESSURE, budget=25)  # 25 tokens begin inside the third newest
    assert selection.shadowed_seqs == (1, 2, 3, 4, 5)
    assert selection.shadowed_price == 50


def test_pressure_moves_the_cut_back_to_the_unit_boundary() -> None:
    fold = fold_of(
        system("sys"),
        user("a"),
        assistant("go", calls=[("c1", "read", "{}")]),
        tool_result("c1", "r1"),
        tool_result("c1", "r1 again"),  # a second result stays in the call's unit
        user("b"),
    )
    # The newest 20 tokens begin at the second result: the whole unit is kept.
    assert selected(fold, PRESSURE, budget=20).shadowed_seqs == (1,)


def test_turn_boundaries_do_not_protect_old_steps() -> None:
    steps = [assistant(f"s{i}", calls=[(f"c{i}", "run", "{}")]) for i in range(3)]
    results = [tool_result(f"c{i}", "ok") for i in range(3)]
    fold = fold_of(
        system("sys"),
        turn_start(1),
        user("go"),
        *(e for p in zip(steps, results, strict=True) for e in p),
    )
    assert selected(fold).shadowed_seqs == (2, 3, 4, 5, 6)


def test_open_tail_declines() -> None:
    fold = fold_of(
        system("sys"),
        user("a"),
        assistant("b"),
        user("c"),
        assistant("x", calls=[("c9", "run", "{}")]),
    )
    result = select(fold)
    assert isinstance(result, Declined)
    assert result.code is DeclineCode.OPEN_TAIL
    assert "c9" in result.reason


def test_a_single_unit_after_the_head_declines() -> None:
    fold = fold_of(
        system("sys"),
        user("only"),
    )
    result = select(fold)
    assert isinstance(result, Declined)
    assert result.code is DeclineCode.NOTHING_SELECTABLE


def test_an_empty_history_declines() -> None:
    for fold in (fold_of(), fold_of(system("sys"))):
        result = select(fold)
        assert isinstance(result, Declined)
        assert result.code is DeclineCode.NOTHING_SELECTABLE


def test_a_budget_covering_all_history_declines() -> None:
    fold = fold_of(system("sys"), user("a"), assistant("b"), user("c"))
    result = select(fold, PRESSURE, budget=30)
    assert isinstance(result, Declined)
    assert result.code is DeclineCode.NOTHING_SELECTABLE


def test_a_lone_previous_checkpoint_is_not_selected_again() -> None:
    fold = fold_of(system("sys"), checkpoint("k0", "old summary"), user("now"))
    result = select(fold)
    assert isinstance(result, Declined)
    assert "checkpoint" in result.reason


def test_a_previous_checkpoint_with_newer_history_is_selected() -> None:
    fold = fold_of(system("sys"), user("a"), assistant("b"), user("c"), assistant("d"), user("e"))
    commit(fold, selected(fold), "k1")
    fold.admit([assistant("f"), user("g")])
    second = selected(fold)
    assert second.count == 3  # the checkpoint, "e" and "f"; "g" is the last unit
    assert fold.surface[second.start_position].event.user_message.source.HasField(
        "compaction_checkpoint"
    )
    commit(fold, second, "k2")
    assert [n.type for n in fold.surface] == ["system/message", "user/message", "user/message"]


def test_shadowed_price_is_the_route_price_of_the_span() -> None:
    fold = fold_of(system("sys"), user("a" * 80), assistant("b" * 16), user("c"))
    selection = select_range(fold, text_price, mode=MAXIMAL)
    assert isinstance(selection, Selection)
    assert selection.shadowed_price == sum(text_price(fold.surface[p]) for p in (1, 2))


def test_automatic_revalidation_rejects_any_surface_change() -> None:
    fold = fold_of(system("sys"), user("a"), assistant("b"), user("c"))
    selection, snapshot = selected(fold), surface_snapshot(fold)
    assert still_valid(fold, selection, snapshot, Revalidation.WHOLE_SURFACE)
    fold.admit([user("appended meanwhile")])
    assert not still_valid(fold, selection, snapshot, Revalidation.WHOLE_SURFACE)
    assert still_valid(fold, selection, snapshot, Revalidation.SELECTED_SPAN)


def test_an_image_offload_is_not_surface_drift() -> None:
    fold = fold_of(
        system("sys"), user("a", blocks=[image_block("i.png")]), assistant("b"), user("c")
    )
    selection, snapshot = selected(fold), surface_snapshot(fold)
    fold.admit([offload({1: [0]})])
    assert still_valid(fold, selection, snapshot, Revalidation.WHOLE_SURFACE)


def test_manual_revalidation_rejects_a_change_inside_the_span() -> None:
    fold = fold_of(
        system("sys"),
        assistant("go", calls=[("c1", "read", "{}")]),
        tool_result("c1", "long"),
        user("c"),
    )
    selection, snapshot = selected(fold), surface_snapshot(fold)
    fold.admit([replace(tool_result("c1", "short"), 2, 2, [2])])
    assert not still_valid(fold, selection, snapshot, Revalidation.SELECTED_SPAN)


def test_manual_revalidation_rejects_a_span_merged_by_another_replacement() -> None:
    fold = fold_of(system("sys"), user("a"), user("b"), assistant("c"), user("d"))
    selection = select_range(fold, ten, mode=PRESSURE, retained_budget=10)
    assert isinstance(selection, Selection)
    assert selection.shadowed_seqs == (1, 2, 3)
    snapshot = surface_snapshot(fold)
    fold.admit([replace(user("merged"), 1, 2, [1, 2])])
    assert not still_valid(fold, selection, snapshot, Revalidation.SELECTED_SPAN)


def test_only_manual_compaction_revalidates_just_its_span() -> None:
    assert revalidation_for(events_pb2.COMPACTION_TRIGGER_MANUAL) is Revalidation.SELECTED_SPAN
    for trigger in (
        events_pb2.COMPACTION_TRIGGER_PRESSURE,
        events_pb2.COMPACTION_TRIGGER_OVERFLOW,
        events_pb2.COMPACTION_TRIGGER_MODEL_SWITCH,
    ):
        assert revalidation_for(trigger) is Revalidation.WHOLE_SURFACE


# --- property: every selection over a random conversation is balanced and commits ------------

WORDS = st.text(alphabet="abcdef ", min_size=1, max_size=30)


@st.composite
def conversations(draw: st.DrawFn, *, reused_ids: bool = False) -> list[SessionEvent]:
    """Users, systems, assistants with 0-3 calls, results in any order (some repeated); with
    ``reused_ids``, some assistants make a call id an earlier call used."""
    events: list[SessionEvent] = [system("sys")] if draw(st.booleans()) else []
    pending: list[str] = []
    answered: list[str] = []
    for index in range(draw(st.integers(0, 40))):
        kind = draw(st.sampled_from(["user", "system", "assistant", "result", "result", "again"]))
        if kind == "assistant":
            calls = [(f"c{index}.{k}", "tool", "{}") for k in range(draw(st.integers(0, 3)))]
            if reused_ids and answered and draw(st.integers(0, 4)) == 0:
                calls.append((draw(st.sampled_from(answered)), "tool", "{}"))
            events.append(assistant(draw(WORDS), calls=calls))
            pending.extend(call for call, _, _ in calls)
        elif kind == "result" and pending:
            call = pending.pop(draw(st.integers(0, len(pending) - 1)))
            events.append(tool_result(call, draw(WORDS)))
            answered.append(call)
        elif kind == "again" and answered:
            events.append(tool_result(draw(st.sampled_from(answered)), draw(WORDS)))
        elif kind == "system":
            events.append(system(draw(WORDS)))
        else:
            events.append(user(draw(WORDS)))
    if draw(st.booleans()):  # usually close the tail, in a random order
        for call in draw(st.permutations(pending)):
            events.append(tool_result(call, draw(WORDS)))
    return events


def assert_well_cut(nodes: Sequence[SurfaceNode], selection: Selection) -> None:
    cuts = balanced_cuts([n.event for n in nodes])
    assert cuts[selection.start_position]
    assert cuts[selection.end_position + 1]
    assert selection.start_position == head_length(nodes)
    assert selection.end_position + 1 < len(nodes)  # the last unit stays
    assert selection.shadowed_seqs == tuple(
        n.seq for n in nodes[selection.start_position : selection.end_position + 1]
    )


@settings(deadline=None, max_examples=300)
@given(conversations(), st.sampled_from(list(SelectionMode)), st.integers(0, 200), st.data())
def test_every_selection_is_balanced_and_its_checkpoint_folds(
    events: list[SessionEvent], mode: SelectionMode, budget: int, data: st.DataObject
) -> None:
    fold = fold_of(*events)
    for round_ in range(3):  # later rounds fold the previous checkpoint in
        nodes = list(fold.surface)
        result = select_range(fold, text_price, mode=mode, retained_budget=budget)
        if isinstance(result, Declined):
            if not unit_boundaries(nodes)[-1]:
                assert result.code is DeclineCode.OPEN_TAIL
            return
        assert_well_cut(nodes, result)
        # Valid as selected, by the span check itself (a snapshot it cannot take as unchanged).
        assert drift(fold, result, SurfaceSnapshot(-1), Revalidation.SELECTED_SPAN) is None
        if mode is SelectionMode.PRESSURE:
            tail = nodes[result.end_position + 1 :]
            assert sum(text_price(n) for n in tail) >= budget
        commit(fold, result, f"k{round_}")
        assert fold.surface[result.start_position].seq == fold.revision - 2
        if data.draw(st.booleans()):
            fold.admit([user(data.draw(WORDS))])


def test_a_span_below_the_minimum_useful_checkpoint_is_declined_with_its_figures() -> None:
    fold = fold_of(system("s"), user("a"), assistant(text="b"), user("c"))

    declined = select_range(fold, ten, mode=MAXIMAL, min_span_tokens=21)
    assert isinstance(declined, Declined)
    assert declined.code is DeclineCode.SPAN_TOO_SMALL
    assert declined.reason == (
        "the selectable span (2 node(s), 20 tokens) is smaller than the minimum useful "
        "checkpoint (21 tokens)"
    )
    assert isinstance(select_range(fold, ten, mode=MAXIMAL, min_span_tokens=20), Selection)


# --- property: the tail-only selection chooses exactly what a whole-surface walk chooses -------


def reference_select(
    fold: SessionFold, price: Callable[[SurfaceNode], int], mode: SelectionMode, budget: int
) -> tuple[int, int] | str:
    """The selection rules as a walk over the whole surface: ``(start, end)`` positions of the
    span (end exclusive), or the decline code."""
    nodes = list(fold.surface)
    first_call: dict[str, int] = {}
    last_result: dict[str, int | None] = {}
    for position, node in enumerate(nodes):
        for call in ev.tool_call_ids(node.event):
            first_call.setdefault(call, position)
            last_result.setdefault(call, None)
        if node.event.HasField("tool_result"):
            call = node.event.tool_result.tool_call_id
            if call in first_call:
                last_result[call] = position
    if any(last is None for last in last_result.values()):
        return DeclineCode.OPEN_TAIL
    bounds = [
        not any(first_call[c] < cut <= (last or 0) for c, last in last_result.items())
        for cut in range(len(nodes) + 1)
    ]
    start = 0
    while start < len(nodes) and nodes[start].type == ev.SYSTEM_MESSAGE:
        start += 1  # the system head and the system/messages right after it
    limit = max((cut for cut in range(len(nodes)) if bounds[cut]), default=0)
    if mode is SelectionMode.PRESSURE:
        tail_start, kept = -1, 0
        for position in range(len(nodes), -1, -1):
            if kept >= budget:
                tail_start = position
                break
            kept += price(nodes[position - 1]) if position else 0
        limit = min(limit, tail_start)
    end = max((cut for cut in range(start, limit + 1) if bounds[cut]), default=start)
    if end <= start or (end - start == 1 and ev.checkpoint_compaction_id(nodes[start].event)):
        return DeclineCode.NOTHING_SELECTABLE
    return start, end


@settings(deadline=None, max_examples=300)
@given(
    conversations(reused_ids=True),
    st.sampled_from(list(SelectionMode)),
    st.integers(0, 200),
    st.data(),
)
def test_selection_from_the_tail_matches_a_whole_surface_walk(
    events: list[SessionEvent], mode: SelectionMode, budget: int, data: st.DataObject
) -> None:
    fold = fold_of(*events)
    for round_ in range(4):  # later rounds select over checkpoints and new nodes
        expected = reference_select(fold, text_price, mode, budget)
        result = select_range(fold, text_price, mode=mode, retained_budget=budget)
        if isinstance(result, Declined):
            assert result.code == expected
            return
        assert (result.start_position, result.end_position + 1) == expected
        nodes = list(fold.surface)[result.start_position : result.end_position + 1]
        assert result.shadowed_price == sum(text_price(n) for n in nodes)
        try:
            commit(fold, result, f"k{round_}")
        except ReplacementRejected:  # a reused call id: the surface's pairing check is stricter
            assert any(isinstance(ids, tuple) for ids in fold.surface._makers.values())
            return
        for _ in range(data.draw(st.integers(0, 3))):
            fold.admit([user(data.draw(WORDS))])


@settings(deadline=None, max_examples=200)
@given(conversations(reused_ids=True), st.data())
def test_the_surface_keeps_its_unanswered_calls_through_replacements_and_undo(
    events: list[SessionEvent], data: st.DataObject
) -> None:
    fold = fold_of(*events)
    assert fold.surface.unanswered_calls() == open_calls(list(fold.surface))
    result = select_range(fold, ten, mode=MAXIMAL)
    if isinstance(result, Selection):
        snapshot = surface_snapshot(fold)
        try:
            batch = fold.admit([replace(user("x"), result.start_seq, result.end_seq,
                                        result.shadowed_seqs)])  # fmt: skip
        except ReplacementRejected:  # a reused call id (see the test above)
            return
        assert fold.surface.unanswered_calls() == open_calls(list(fold.surface))
        if data.draw(st.booleans()):
            fold.rollback(batch)
            assert fold.surface.unanswered_calls() == open_calls(list(fold.surface))
        assert not still_valid(fold, result, snapshot, Revalidation.WHOLE_SURFACE)
