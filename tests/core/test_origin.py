"""Who may write what: server-only events and the step brackets a runtime's batch must keep.

A client batch (``Origin.CLIENT``, what ``AppendEvents`` admits) may not carry the bracket, lock,
lifecycle or offload events, nor a checkpoint; compactd's own appends (``Origin.SERVER``) may.
Inside a client batch an ``assistant/message`` APPEND needs an open step of an open turn.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core.fold import SessionFold
from compactd.core.validation import Origin, check_batch
from compactd.errors import InvalidArgument
from compactd.reasons import Reason
from compactd.v1 import events_pb2
from tests.builders import (
    SessionEvent,
    assistant,
    checkpoint,
    compaction_end,
    compaction_start,
    end_seed,
    image_block,
    in_step,
    offload,
    replace,
    step_end,
    step_start,
    tool_result,
    turn_end,
    turn_start,
    user,
)

CLIENT, SERVER = Origin.CLIENT, Origin.SERVER


def _prune() -> SessionEvent:
    return SessionEvent(compaction_prune=events_pb2.CompactionPrune(compaction_id="k"))


def _summary() -> SessionEvent:
    return SessionEvent(compaction_summary=events_pb2.CompactionSummary(compaction_id="k"))


def _summary_error() -> SessionEvent:
    body = events_pb2.CompactionSummaryError(compaction_id="k")
    return SessionEvent(compaction_summary_error=body)


SERVER_ONLY = [
    (compaction_start("k"), "compaction_start"),
    (_prune(), "compaction_prune"),
    (_summary(), "compaction_summary"),
    (_summary_error(), "compaction_summary_error"),
    (compaction_end("k"), "compaction_end"),
    (end_seed(), "session_end_seed"),
    (offload({0: [0]}), "image_offload"),
    (checkpoint("k", "a summary"), "user_message.source.compaction_checkpoint"),
]


@pytest.mark.parametrize(("event", "field"), SERVER_ONLY, ids=[f for _, f in SERVER_ONLY])
def test_a_client_batch_carrying_a_server_only_event_is_refused_naming_the_field(
    event: SessionEvent, field: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_batch([user("fine"), event], max_events=10, origin=CLIENT)
    assert caught.value.reason == Reason.SERVER_ONLY_EVENT
    assert [v.field for v in caught.value.violations] == [f"events[1].{field}"]


def test_a_checkpoint_replacement_from_a_client_is_refused() -> None:
    fold = SessionFold()
    fold.admit([user("a"), user("b")], origin=CLIENT)
    forged = replace(checkpoint("k", "summary"), start=0, end=1, sources=[0, 1])
    with pytest.raises(InvalidArgument) as caught:
        fold.admit([forged], origin=CLIENT)
    assert caught.value.reason == Reason.SERVER_ONLY_EVENT
    assert fold.revision == 2


def test_the_fold_refuses_server_only_events_from_a_client_even_without_check_batch() -> None:
    fold = SessionFold()
    with pytest.raises(InvalidArgument) as caught:
        fold.admit([user("a"), compaction_start("k")], origin=CLIENT)
    assert caught.value.reason == Reason.SERVER_ONLY_EVENT
    assert caught.value.violations[0].field == "events[1].compaction_start"
    assert (fold.revision, fold.lock.open_starts) == (0, {})


@pytest.mark.parametrize(("event", "field"), SERVER_ONLY[:-1], ids=[f for _, f in SERVER_ONLY[:-1]])
def test_server_only_events_are_the_servers_to_write(event: SessionEvent, field: str) -> None:
    del field
    check_batch([event], max_events=10, origin=SERVER)


def test_every_server_only_event_of_a_batch_is_named() -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_batch([compaction_start("k"), user("a"), end_seed()], max_events=10, origin=CLIENT)
    assert [v.field for v in caught.value.violations] == [
        "events[0].compaction_start",
        "events[2].session_end_seed",
    ]


def test_an_append_citing_sources_is_refused() -> None:
    cited = user("b")
    cited.source_event_seqs.append(0)
    with pytest.raises(InvalidArgument) as caught:
        check_batch([user("a"), cited], max_events=10, origin=CLIENT)
    (violation,) = caught.value.violations
    assert violation.field == "events[1].source_event_seqs"
    assert "only a REPLACE" in violation.description


# ---- step brackets -------------------------------------------------------------------------


def client_fold(*events: SessionEvent) -> SessionFold:
    fold = SessionFold()
    if events:
        fold.admit(list(events), origin=CLIENT)
    return fold


def step_error(fold: SessionFold, *events: SessionEvent) -> InvalidArgument:
    before = fold.revision
    with pytest.raises(InvalidArgument) as caught:
        fold.admit(list(events), origin=CLIENT)
    assert caught.value.reason == Reason.STEP_BRACKET
    assert fold.revision == before
    return caught.value


def test_an_assistant_message_inside_an_open_step_of_an_open_turn_is_accepted() -> None:
    fold = client_fold(
        turn_start(1),
        user("list the files"),
        *in_step(1, 1, assistant(calls=[("c1", "ls", "{}")])),
        tool_result("c1", "a b"),
        *in_step(1, 2, assistant("a and b")),
        turn_end(1),
    )
    assert [n.type for n in fold.surface] == [
        "user/message",
        "assistant/message",
        "tool/result",
        "assistant/message",
    ]
    assert fold.open_step is None


def test_an_assistant_message_outside_any_step_is_refused() -> None:
    error = step_error(client_fold(turn_start(1)), assistant("hi"))
    assert error.violations[0].field == "events[0].assistant_message"
    assert "inside an open step" in error.message


def test_a_step_of_a_turn_never_opened_is_accepted_as_the_reference_does() -> None:
    # The reference's own test logs open steps without a turn/start.
    fold = client_fold(
        user("hi"), *in_step(1, 1, assistant("hello")), *in_step(1, 2, assistant("again"))
    )
    assert [n.type for n in fold.surface] == ["user/message", *["assistant/message"] * 2]
    assert fold.open_step is None
    assert not fold.open_turns


def test_an_assistant_message_of_a_turn_never_opened_still_needs_its_step() -> None:
    error = step_error(client_fold(user("hi")), assistant("hello"))
    assert error.violations[0].field == "events[0].assistant_message"


def test_overlapping_steps_are_refused() -> None:
    fold = client_fold(turn_start(1), step_start(1, 1))
    error = step_error(fold, step_start(1, 2))
    assert "step 1 of turn 1 is still open" in error.message


@pytest.mark.parametrize(
    "opened", [[], [step_start(1, 1)]], ids=["no-open-step", "another-step-open"]
)
def test_an_unmatched_step_end_is_refused(opened: list[SessionEvent]) -> None:
    fold = client_fold(turn_start(1), *opened)
    error = step_error(fold, step_end(1, 2))
    assert error.violations[0].field == "events[0].step_end"


def test_a_turn_ends_only_after_its_open_step() -> None:
    fold = client_fold(turn_start(1), step_start(1, 1))
    step_error(fold, turn_end(1))
    fold.admit([step_end(1, 1), turn_end(1)], origin=CLIENT)
    assert (fold.open_turns, fold.open_step) == (set(), None)


def test_a_rejected_batch_leaves_the_open_step_as_it_was() -> None:
    fold = client_fold(turn_start(1))
    step_error(fold, step_start(1, 1), assistant("a"), step_end(1, 1), assistant("b"))
    assert fold.open_step is None


def test_an_assistant_replacement_needs_no_step() -> None:
    fold = client_fold(turn_start(1), *in_step(1, 1, assistant("draft")), turn_end(1))
    fold.admit([replace(assistant("final"), start=2, end=2, sources=[2])], origin=CLIENT)
    assert fold.surface[0].event.assistant_message.content[0].text.text == "final"


def test_compactds_own_appends_and_restores_skip_the_step_rules() -> None:
    fold = SessionFold()
    log = fold.admit([assistant("trusted"), turn_start(1), step_start(1, 1)]).events  # SERVER
    restored = SessionFold()
    restored.admit(log, check=False)  # a log written before the rules still restores
    assert restored.open_step == fold.open_step == (1, 1)


_OPS = st.lists(
    st.sampled_from(
        ["turn_start", "turn_end", "step_start", "step_end", "assistant", "user", "result"]
    ),
    max_size=30,
)


@settings(max_examples=150)
@given(_OPS, st.data())
def test_a_client_fold_accepts_exactly_what_the_step_model_allows(
    ops: list[str], data: st.DataObject
) -> None:
    """A naive model of the brackets decides each event; the fold must agree and, when it
    refuses, stay as it was."""
    fold = SessionFold()
    turns: set[int] = set()
    open_step: tuple[int, int] | None = None
    calls: list[str] = []
    for n, op in enumerate(ops):
        turn = data.draw(st.integers(1, 3))
        step = data.draw(st.integers(1, 2))
        if op == "turn_start":
            event, ok = turn_start(turn), turn not in turns
        elif op == "turn_end":
            event, ok = turn_end(turn), open_step is None or open_step[0] != turn
        elif op == "step_start":
            event, ok = step_start(turn, step), open_step is None
        elif op == "step_end":
            event, ok = step_end(turn, step), open_step == (turn, step)
        elif op == "assistant":
            event = assistant(calls=[(f"c{n}", "t", "{}")])
            ok = open_step is not None
        elif op == "user":
            event, ok = user(f"u{n}", blocks=[image_block("x")]), True
        else:
            if not calls:
                continue
            event, ok = tool_result(data.draw(st.sampled_from(calls)), "out"), True
        before = fold.revision
        if ok:
            fold.admit([event], origin=CLIENT)
        else:
            with pytest.raises(InvalidArgument):
                fold.admit([event], origin=CLIENT)
            assert fold.revision == before
            continue
        if op == "turn_start":
            turns.add(turn)
        elif op == "turn_end":
            turns.discard(turn)
        elif op == "step_start":
            open_step = (turn, step)
        elif op == "step_end":
            open_step = None
        elif op == "assistant":
            calls.append(f"c{n}")
        assert (fold.open_turns, fold.open_step) == (turns, open_step)
