"""Pinned state and open sub-agents in the fold: rendering, placement, rules, snapshots."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core import snapshot
from compactd.core.fold import SessionFold
from compactd.core.pins import PINS_OPEN_TAG, pins_message, render_pins
from compactd.core.validation import Origin, check_batch
from compactd.errors import InvalidArgument
from compactd.v1 import session_service_pb2
from tests.builders import (
    SessionEvent,
    checkpoint,
    pin,
    replace,
    subagent_end,
    subagent_start,
    system,
    user,
)

SYSTEM = session_service_pb2.MESSAGE_ROLE_SYSTEM


def folded(*events: SessionEvent) -> SessionFold:
    fold = SessionFold()
    fold.admit(events, origin=Origin.CLIENT)
    return fold


def test_the_pins_in_force_render_in_key_order_whatever_order_they_came_in() -> None:
    one = folded(pin("plan", "1. a"), pin("goal", "g"), pin("plan", "2. b"))
    other = folded(pin("goal", "old"), pin("plan", "2. b"), pin("goal", "g"))
    assert one.pin_texts() == other.pin_texts() == {"goal": "g", "plan": "2. b"}
    assert one.pins_message() == other.pins_message()
    text = render_pins({"goal": "g", "plan": "2. b"})
    assert text.startswith(PINS_OPEN_TAG)
    assert text.index("[goal]\ng") < text.index("[plan]\n2. b")


def test_the_pins_message_comes_right_after_the_system_head() -> None:
    fold = folded(system("be brief"), user("hi"), pin("goal", "ship it"))
    messages = fold.messages()
    assert [m.role for m in messages[:2]] == [SYSTEM, SYSTEM]
    assert messages[0].content[0].text.text == "be brief"
    assert not messages[0].pinned_state
    assert messages[1].pinned_state
    assert "ship it" in messages[1].content[0].text.text
    assert messages[2].content[0].text.text == "hi"


def test_without_a_head_that_projects_the_pins_come_first() -> None:
    for events in ([user("hi")], [system(""), user("hi")]):
        fold = folded(*events, pin("goal", "ship it"))
        assert fold.messages()[0].pinned_state


def test_a_checkpoint_replacing_the_history_leaves_the_pins_as_they_were() -> None:
    fold = folded(system("head"), user("a"), user("b"), pin("goal", "ship it"))
    before = fold.messages()[1]
    fold.admit([replace(checkpoint("k1", "summary"), 1, 2, [1, 2])])
    assert fold.messages()[1] == before
    assert fold.messages()[2].content[0].text.text == "summary"


def test_clear_removes_a_key_and_clearing_a_key_not_in_force_is_refused() -> None:
    fold = folded(pin("goal", "g"), pin("goal", clear=True))
    assert fold.pins == {}
    assert fold.pins_message() is None
    with pytest.raises(InvalidArgument, match="no pin 'goal'"):
        fold.admit([pin("goal", clear=True)], origin=Origin.CLIENT)


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (pin("", "text"), "state_pin.key"),
        (pin("has space", "text"), "state_pin.key"),
        (pin("k" * 65, "text"), "state_pin.key"),
        (pin("goal", "  "), "state_pin.text"),
        (pin("goal", "text", clear=True), "state_pin.text"),
        (subagent_start(""), "subagent_start.child_session_id"),
        (subagent_start("c", task="two\nlines"), "subagent_start.task"),
    ],
)
def test_a_malformed_pin_or_subagent_event_names_its_field(event: SessionEvent, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_batch([event], max_events=10, origin=Origin.CLIENT)
    assert [v.field for v in caught.value.violations] == [f"events[0].{field}"]


def test_a_rolled_back_batch_restores_the_pins_and_their_bytes() -> None:
    fold = folded(pin("goal", "g"))
    before = (dict(fold.pins), fold.pins_seq, fold.surface_bytes)
    batch = fold.admit([pin("goal", "changed"), pin("plan", "longer"), pin("goal", clear=True)])
    assert fold.surface_bytes != before[2]
    fold.rollback(batch)
    assert (fold.pins, fold.pins_seq, fold.surface_bytes) == before


def test_a_pin_change_is_a_rewrite_of_the_request() -> None:
    fold = folded(system("head"), user("a"))
    revision = fold.revision
    assert fold.appended_since(revision) == []
    fold.admit([pin("goal", "g")])
    assert fold.appended_since(revision) is None


def test_subagents_open_and_end_once() -> None:
    fold = folded(subagent_start("child-1", "call-1", "find the bug"))
    assert fold.open_subagents == {"child-1": (0, "call-1", "find the bug")}
    with pytest.raises(InvalidArgument, match="already open"):
        fold.admit([subagent_start("child-1")], origin=Origin.CLIENT)
    fold.admit([subagent_end("child-1", "found it")], origin=Origin.CLIENT)
    assert fold.open_subagents == {}
    with pytest.raises(InvalidArgument, match="no sub-agent"):
        fold.admit([subagent_end("child-1")], origin=Origin.CLIENT)


def _snapshot_round_trip(fold: SessionFold, events: list[SessionEvent]) -> SessionFold:
    taken = snapshot.capture(fold, "i1", {}, None)
    decoded = snapshot.decode(snapshot.encode(taken))
    return snapshot.rebuild(decoded, {e.seq: e for e in events})


def test_a_snapshot_keeps_the_pins_and_open_subagents() -> None:
    fold = SessionFold()
    batch = fold.admit(
        [system("head"), pin("goal", "g"), pin("plan", "p"), subagent_start("c1"), user("x")]
    )
    rebuilt = _snapshot_round_trip(fold, batch.events)
    assert rebuilt.pins == fold.pins
    assert rebuilt.pins_seq == fold.pins_seq
    assert rebuilt.open_subagents == {"c1": (3, "", "")}
    assert rebuilt.messages() == fold.messages()
    assert rebuilt.surface_bytes == fold.surface_bytes


def test_a_version_2_snapshot_still_restores_with_no_pins() -> None:
    fold = SessionFold()
    batch = fold.admit([system("head"), user("x")])
    document = json.loads(snapshot.encode(snapshot.capture(fold, "i1", {}, None)))
    for key in ("pins", "pins_seq", "open_subagents"):
        del document[key]
    document["v"] = 2
    decoded = snapshot.decode(json.dumps(document).encode())
    rebuilt = snapshot.rebuild(decoded, {e.seq: e for e in batch.events})
    assert rebuilt.pins == {}
    assert rebuilt.messages() == fold.messages()


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_the_pins_message_is_always_the_rendering_of_the_pins_in_force(
    data: st.DataObject,
) -> None:
    """Whatever appends, pins, clears and checkpoints came before, the request holds exactly one
    pinned-state message, right after the head, whose bytes are ``pins_message`` of the pins in
    force; and no surface node is ever a pin."""
    fold = folded(system("head"))
    expected: dict[str, str] = {}
    for _ in range(data.draw(st.integers(1, 25))):
        action = data.draw(st.sampled_from(["user", "pin", "clear", "checkpoint"]))
        if action == "user":
            fold.admit([user(data.draw(st.text(min_size=1, max_size=20)))])
        elif action == "pin":
            key = data.draw(st.sampled_from(["goal", "plan", "fix/1"]))
            expected[key] = "p:" + data.draw(st.text(max_size=30))
            fold.admit([pin(key, expected[key])])
        elif action == "clear" and expected:
            key = data.draw(st.sampled_from(sorted(expected)))
            del expected[key]
            fold.admit([pin(key, clear=True)])
        elif action == "checkpoint" and len(fold.surface) > 2:
            nodes = fold.surface.nodes
            i = data.draw(st.integers(1, len(nodes) - 1))
            j = data.draw(st.integers(i, len(nodes) - 1))
            seqs = [n.seq for n in nodes[i : j + 1]]
            fold.admit([replace(checkpoint(f"k{fold.revision}", "s"), seqs[0], seqs[-1], seqs)])
        messages = fold.messages()
        pinned = [i for i, m in enumerate(messages) if m.pinned_state]
        assert pinned == ([1] if expected else [])
        if expected:
            assert messages[1] == pins_message(expected)
        assert all(node.type != "state/pin" for node in fold.surface)
