"""Tool pairing: balanced cuts, indivisible call units, and results without a call."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core.pairing import (
    CorruptPairing,
    balanced_cuts,
    is_balanced_cut,
    open_calls_after,
)
from compactd.core.surface import SurfaceNode, open_calls_of
from tests.builders import SessionEvent, assistant, system, tool_result, user


def naive_balanced(events: list[SessionEvent], cut: int) -> bool:
    """The definition: every call before ``cut`` has a result after it and before ``cut``."""
    for position, event in enumerate(events[:cut]):
        if event.WhichOneof("body") != "assistant_message":
            continue
        for block in event.assistant_message.content:
            if not block.HasField("tool_call"):
                continue
            answered = any(
                later.WhichOneof("body") == "tool_result"
                and later.tool_result.tool_call_id == block.tool_call.id
                for later in events[position + 1 : cut]
            )
            if not answered:
                return False
    return True


def test_cut_before_everything_and_at_the_end_of_a_closed_exchange_is_balanced() -> None:
    events = [user("a"), assistant(calls=[("c1", "t", "{}")]), tool_result("c1", "r")]
    assert balanced_cuts(events) == [True, True, False, True]
    assert balanced_cuts([]) == [True]


def test_cut_between_a_call_and_its_result_is_unbalanced() -> None:
    events = [assistant(calls=[("c1", "t", "{}")]), user("interjection"), tool_result("c1", "r")]
    assert balanced_cuts(events) == [True, False, False, True]
    assert open_calls_after(events[:2]) == {"c1"}


def test_parallel_calls_stay_open_until_every_result() -> None:
    events = [
        assistant(calls=[("c1", "t", "{}"), ("c2", "t", "{}")]),
        tool_result("c2", "r2"),
        tool_result("c1", "r1"),
    ]
    assert balanced_cuts(events) == [True, False, False, True]
    assert open_calls_after(events[:2]) == {"c1"}


def test_a_call_unit_closes_at_its_first_result() -> None:
    events = [assistant(calls=[("c1", "t", "{}")]), tool_result("c1", "a"), tool_result("c1", "b")]
    assert balanced_cuts(events) == [True, False, True, True]


def test_assistant_text_without_calls_opens_nothing() -> None:
    assert balanced_cuts([system("s"), assistant("hello"), user("u")]) == [True] * 4


def test_is_balanced_cut_agrees_with_balanced_cuts_at_every_index() -> None:
    events = [
        user("a"),
        assistant(calls=[("c1", "t", "{}")]),
        tool_result("c1", "r"),
        assistant(calls=[("c2", "t", "{}")]),
        user("b"),
        tool_result("c2", "r"),
    ]
    assert [is_balanced_cut(events, i) for i in range(len(events) + 1)] == balanced_cuts(events)


@pytest.mark.parametrize(
    "events",
    [
        [tool_result("c1", "r")],
        [tool_result("c1", "r"), assistant(calls=[("c1", "t", "{}")])],
        [assistant(calls=[("c1", "t", "{}")]), tool_result("c2", "r")],
    ],
    ids=["no_call", "call_after_result", "other_call"],
)
def test_result_with_no_earlier_call_is_corrupt_input(events: list[SessionEvent]) -> None:
    with pytest.raises(CorruptPairing, match="no earlier node made") as caught:
        balanced_cuts(events)
    assert caught.value.reason == "TOOL_RESULT_WITHOUT_CALL"
    with pytest.raises(CorruptPairing):
        open_calls_after(events)


# --- properties -------------------------------------------------------------------------------

CALL_IDS = ["c0", "c1", "c2", "c3"]


@st.composite
def paired_sequences(draw: st.DrawFn) -> list[SessionEvent]:
    """Well-formed sequences: every result names a call some earlier node made."""
    events: list[SessionEvent] = []
    made: list[str] = []
    for _ in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["user", "assistant", "result"] if made else ["user", "call"]))
        if kind == "user":
            events.append(user("u"))
        elif kind in ("assistant", "call"):
            ids = draw(st.lists(st.sampled_from(CALL_IDS), max_size=3, unique=True))
            events.append(assistant("a", calls=[(i, "t", "{}") for i in ids]))
            made.extend(ids)
        else:
            events.append(tool_result(draw(st.sampled_from(made)), "r"))
    return events


@settings(max_examples=200, deadline=None)
@given(paired_sequences())
def test_balanced_cuts_agree_with_the_naive_definition(events: list[SessionEvent]) -> None:
    expected = [naive_balanced(events, cut) for cut in range(len(events) + 1)]
    assert balanced_cuts(events) == expected


@settings(max_examples=100, deadline=None)
@given(paired_sequences(), st.data())
def test_an_orphan_result_anywhere_is_corrupt_input(
    events: list[SessionEvent], data: st.DataObject
) -> None:
    at = data.draw(st.integers(0, len(events)))
    orphan = tool_result("never-called", "r")
    with pytest.raises(CorruptPairing):
        balanced_cuts([*events[:at], orphan, *events[at:]])


@settings(max_examples=200, deadline=None)
@given(paired_sequences(), st.data())
def test_the_open_calls_of_surface_nodes_are_those_of_their_events(
    events: list[SessionEvent], data: st.DataObject
) -> None:
    if data.draw(st.booleans()):  # sometimes an orphan result: both must refuse it
        at = data.draw(st.integers(0, len(events)))
        events = [*events[:at], tool_result(data.draw(st.sampled_from(["c9", ""])), "r"),
                  *events[at:]]  # fmt: skip
    nodes = [SurfaceNode(seq, event) for seq, event in enumerate(events)]
    try:
        expected: set[str] | type[CorruptPairing] = open_calls_after(events)
    except CorruptPairing:
        expected = CorruptPairing
    try:
        found: set[str] | type[CorruptPairing] = open_calls_of(nodes)
    except CorruptPairing:
        found = CorruptPairing
    assert found == expected
