"""Prepare-ahead's decisions: the span digest, the span now, what a step at the trigger does."""

from __future__ import annotations

import pytest

from compactd.core.ahead import (
    CandidateView,
    StepChoice,
    span_digest,
    span_now,
    step_choice,
    worth_preparing,
)
from compactd.core.events import SessionEvent
from compactd.core.fold import SessionFold
from tests.builders import (
    assistant,
    image_block,
    offload,
    replace,
    system,
    tool_result,
    user,
)


def fold_of(*events: SessionEvent) -> SessionFold:
    fold = SessionFold()
    fold.admit(list(events))
    return fold


def conversation() -> SessionFold:
    """seq 0 system, 1 user (with an image), 2 call, 3 its result, 4 answer, 5 user."""
    return fold_of(
        system("sys"),
        user("look at this", blocks=[image_block("i.png")]),
        assistant("reading", calls=[("c1", "read", "{}")]),
        tool_result("c1", "file contents", name="read"),
        assistant("done"),
        user("next"),
    )


def view_of(fold: SessionFold, start: int, end: int, *, ready: bool = True) -> CandidateView:
    """A candidate of the span ``start``..``end`` (seqs) bound to the fold as it is now."""
    nodes = [n for n in fold.surface.nodes if start <= n.seq <= end]
    return CandidateView(start, end, span_digest(fold, nodes), ready, abandoned=False)


def test_the_span_is_found_again_after_appends_past_it() -> None:
    fold = conversation()
    view = view_of(fold, 1, 4)

    fold.admit([assistant("more"), user("and more")])

    selection = span_now(fold, view)
    assert selection is not None
    assert (selection.start_position, selection.end_position) == (1, 4)
    assert selection.shadowed_seqs == (1, 2, 3, 4)
    assert step_choice(fold, view) is StepChoice.APPLY


def test_a_replacement_inside_the_span_changes_it() -> None:
    fold = conversation()
    view = view_of(fold, 1, 4)

    fold.admit([replace(tool_result("c1", "trimmed", name="read"), 3, 3, [3])])

    assert span_now(fold, view) is None
    assert step_choice(fold, view) is StepChoice.DISCARD


def test_an_offload_inside_the_span_changes_its_digest() -> None:
    fold = conversation()
    view = view_of(fold, 1, 4)

    fold.admit([offload({1: [0]})])

    assert span_now(fold, view) is None


def test_a_change_after_the_span_leaves_it_alone() -> None:
    fold = conversation()
    view = view_of(fold, 1, 4)
    fold.admit([assistant("x", calls=[("c2", "read", "{}")]), tool_result("c2", "y", name="read")])

    fold.admit([replace(tool_result("c2", "z", name="read"), 7, 7, [7])])

    assert span_now(fold, view) is not None


def test_a_span_cut_between_a_call_and_its_result_is_never_applied() -> None:
    fold = conversation()
    view = view_of(fold, 1, 2)  # ends on the call whose result follows

    assert span_now(fold, view) is None


@pytest.mark.parametrize(
    ("ready", "abandoned", "choice"),
    [
        (True, False, StepChoice.APPLY),
        (False, False, StepChoice.WAIT),
        (False, True, StepChoice.DISCARD),
    ],
)
def test_what_a_step_at_the_trigger_does_with_a_candidate(
    ready: bool, abandoned: bool, choice: StepChoice
) -> None:
    fold = conversation()
    view = view_of(fold, 1, 4, ready=ready)
    view = CandidateView(view.start_seq, view.end_seq, view.digest, ready, abandoned)

    assert step_choice(fold, view) is choice


def test_without_a_candidate_the_step_summarizes_itself() -> None:
    assert step_choice(conversation(), None) is StepChoice.SUMMARIZE


@pytest.mark.parametrize(
    ("measured", "ahead", "trigger", "worth"),
    [
        (3999, 4000, 5000, False),
        (4000, 4000, 5000, True),
        (4999, 4000, 5000, True),
        (5000, 4000, 5000, False),  # at the trigger the step itself compacts
        (4500, 0, 5000, False),  # off
    ],
)
def test_a_candidate_starts_between_the_prepare_ahead_point_and_the_trigger(
    measured: int, ahead: int, trigger: int, worth: bool
) -> None:
    assert worth_preparing(measured, ahead, trigger) is worth
