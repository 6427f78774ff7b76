"""The checkpoint framing and the compaction instruction (``compactd.core.prompts``)."""

from __future__ import annotations

from compactd.core import prompts


def test_a_checkpoint_is_preamble_blank_line_then_the_tagged_summary() -> None:
    framed = prompts.frame_checkpoint("## Goals\n- ship")

    assert framed == (
        prompts.CHECKPOINT_PREAMBLE
        + "\n\n<compacted-summary>\n## Goals\n- ship\n</compacted-summary>"
    )


def test_the_instruction_asks_for_the_eight_sections_in_order() -> None:
    instruction = prompts.compaction_instruction(None)

    positions = [instruction.index(f"## {title}\n") for title in prompts.SUMMARY_SECTIONS]
    assert positions == sorted(positions)
    assert len(prompts.SUMMARY_SECTIONS) == 8


def test_the_instruction_says_how_to_fold_a_prior_checkpoint() -> None:
    assert prompts.SUMMARY_OPEN_TAG in prompts.compaction_instruction(None)


def test_focus_text_is_appended_and_blank_focus_is_ignored() -> None:
    plain = prompts.compaction_instruction(None)

    focused = prompts.compaction_instruction("  the database migration  ")

    assert focused.startswith(plain)
    assert focused.endswith("\nthe database migration")
    assert prompts.compaction_instruction("   ") == plain
    assert prompts.compaction_instruction("") == plain


def test_the_texts_are_stable_for_prefix_caching() -> None:
    assert prompts.compaction_instruction("x") == prompts.compaction_instruction("x")
    assert prompts.frame_checkpoint("s") == prompts.frame_checkpoint("s")
