"""Open handles: what a checkpoint re-emits, in a fixed section, whatever the summary says."""

from __future__ import annotations

from compactd.core import prompts
from compactd.core.fold import OpenSubagent, SessionFold
from compactd.core.handles import OpenHandles, open_handles
from compactd.core.validation import Origin
from compactd.providers.extractive import _checkpoint_summary
from tests.builders import (
    assistant,
    in_step,
    pin,
    subagent_end,
    subagent_start,
    system,
    tool_result,
    turn_end,
    turn_start,
    user,
)


def _fold() -> SessionFold:
    fold = SessionFold()
    fold.admit(
        [
            system("head"),
            turn_start(1),
            user("fix it"),
            *in_step(1, 1, assistant(calls=[("c1", "spawn", "{}"), ("c2", "run", "{}")])),
            tool_result("c2", "ok", name="run"),
            subagent_start("child-b", "c1", "find the failing test"),
            subagent_start("child-a", "", "read the docs"),
            subagent_start("child-z", "c9", "gone"),
            subagent_end("child-z", "done"),
            pin("plan", "1. fix"),
            pin("goal", "green build"),
            turn_end(1),
        ],
        origin=Origin.CLIENT,
    )
    return fold


def test_open_handles_are_open_subagents_unanswered_span_calls_and_pinned_keys() -> None:
    fold = _fold()
    handles = open_handles(fold, fold.surface.nodes[1:])
    assert [child for child, _ in handles.subagents] == ["child-b", "child-a"]  # oldest first
    assert handles.subagents[0][1] == OpenSubagent(7, "c1", "find the failing test")
    assert handles.calls == (("c1", "spawn"),)  # c2 has its result
    assert handles.pins == ("goal", "plan")
    assert open_handles(fold, fold.surface.nodes[1:2]).calls == ()  # not the span's call


def test_the_section_is_a_fixed_rendering_and_the_frame_carries_it_after_the_summary() -> None:
    fold = _fold()
    section = prompts.open_handles_section(open_handles(fold, fold.surface.nodes[1:]))
    assert section == (
        "## Open Handles\n"
        "- sub-agent `child-b` still running (spawned by tool call `c1`): find the failing test\n"
        "- sub-agent `child-a` still running: read the docs\n"
        "- tool call `c1` (`spawn`) has no result yet\n"
        "- pinned state in force, kept word for word: `goal`, `plan`"
    )
    framed = prompts.frame_checkpoint("## Goals and Requests\n- x", section)
    assert framed.endswith(f"- x\n\n{section}\n{prompts.SUMMARY_CLOSE_TAG}")
    assert prompts.frame_checkpoint("s", prompts.open_handles_section(OpenHandles())) == (
        prompts.frame_checkpoint("s")
    )


def test_a_prior_checkpoints_handles_are_not_folded_into_the_next_summary() -> None:
    fold = _fold()
    section = prompts.open_handles_section(open_handles(fold, fold.surface.nodes[1:]))
    framed = prompts.frame_checkpoint("## Goals and Requests\n- x", section)
    assert _checkpoint_summary(framed) == "## Goals and Requests\n- x"
