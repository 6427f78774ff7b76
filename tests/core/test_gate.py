"""The summary quality gate: sections in order, no echo, a minimum reduction, kept probes."""

from __future__ import annotations

import sys
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core import prompts
from compactd.core.gate import (
    FOLDS_TO_ASCII,
    MARK_CHARACTERS,
    GateCheck,
    GateSettings,
    echoed_message,
    examine,
    folded_holds,
    judge,
    minimum_useful_span,
    section_problem,
)
from compactd.core.probes import Message, Probe, ProbeKind, message_text
from compactd.core.projection import project
from compactd.testing.messages import assistant, text_block, user
from tests import builders

SPAN = [user("Please fix the bug in lib/app/mod.py now."), assistant("Done: lib/app/mod.py fixed.")]
PROBES = (Probe(ProbeKind.REQUEST, "Please fix the bug in lib/app/mod.py now."),)
PROBES += (Probe(ProbeKind.PATH, "lib/app/mod.py"),)
SETTINGS = GateSettings(min_reduction_ratio=0.1, min_probe_retention=0.5)


def summary(**sections: str) -> str:
    """The eight sections in order; keyword arguments fill them by their first word."""
    blocks = []
    for title in prompts.SUMMARY_SECTIONS:
        body = sections.get(title.split()[0].lower(), prompts.EMPTY_SECTION)
        blocks.append(f"## {title}\n- {body}")
    return "\n\n".join(blocks)


GOOD = summary(goals='"fix the bug in lib/app/mod.py now"', files="lib/app/mod.py")


def checks_of(text: str, *, checkpoint: int = 100, span: int = 1000) -> list[GateCheck]:
    verdict = judge(
        text, SPAN, PROBES, checkpoint_tokens=checkpoint, span_tokens=span, settings=SETTINGS
    )
    return [failure.check for failure in verdict.failures]


def test_a_faithful_summary_passes_every_check() -> None:
    verdict = judge(GOOD, SPAN, PROBES, checkpoint_tokens=100, span_tokens=1000, settings=SETTINGS)

    assert verdict.passed
    assert verdict.describe() == ""
    assert verdict.retention.ratio == 1.0
    assert verdict.reduction == pytest.approx(0.9)


def test_a_missing_section_fails_naming_it() -> None:
    text = GOOD.replace("## Files Touched\n", "")

    assert section_problem(text) == "missing section(s): Files Touched"
    assert checks_of(text) == [GateCheck.SECTIONS]


def test_sections_out_of_order_fail() -> None:
    first, second, *rest = GOOD.split("\n\n")

    problem = section_problem("\n\n".join([second, first, *rest]))

    assert problem is not None
    assert problem.startswith("sections out of order: Technical Context, Goals and Requests")


@pytest.mark.parametrize(
    "heading", ["# Files Touched", "### 3. Files Touched:", "**Files Touched**", "Files touched"]
)
def test_heading_levels_numbering_bold_and_colons_are_tolerated(heading: str) -> None:
    assert section_problem(GOOD.replace("## Files Touched", heading)) is None


def test_an_echo_of_a_span_message_fails() -> None:
    assert echoed_message("  please FIX the bug in lib/app/mod.py now. ", SPAN) == 0
    assert GateCheck.ECHO in checks_of(SPAN[1].content[0].text.text)
    assert echoed_message(GOOD, SPAN) is None


def test_a_copy_of_a_prior_checkpoint_is_an_echo() -> None:
    prior = user(prompts.frame_checkpoint(GOOD))

    assert echoed_message(GOOD, [prior, *SPAN]) == 0


@pytest.mark.parametrize(("checkpoint", "passes"), [(899, True), (901, False), (980, False)])
def test_the_checkpoint_must_reduce_the_span_by_the_minimum_ratio(
    checkpoint: int, passes: bool
) -> None:
    assert (checks_of(GOOD, checkpoint=checkpoint) == []) is passes


def test_a_checkpoint_not_smaller_at_all_fails_the_reduction_even_at_ratio_zero() -> None:
    verdict = judge(
        GOOD,
        SPAN,
        PROBES,
        checkpoint_tokens=1000,
        span_tokens=1000,
        settings=GateSettings(min_reduction_ratio=0.0),
    )

    assert [f.check for f in verdict.failures] == [GateCheck.REDUCTION]
    assert not verdict.smaller


def test_too_few_kept_probes_fail_listing_the_missed_ones() -> None:
    text = summary(files="lib/other.py")
    verdict = judge(text, SPAN, PROBES, checkpoint_tokens=10, span_tokens=1000, settings=SETTINGS)

    (failure,) = verdict.failures
    assert failure.check is GateCheck.PROBES
    assert failure.missed == PROBES
    assert failure.detail.startswith("keeps 0 of 2 probes (0%); at least 50% are required")
    assert "request 'Please fix the bug in lib/app/mod.py now.'" in failure.detail


def test_every_failed_check_is_reported_at_once() -> None:
    span = [*SPAN, assistant("All done.")]
    verdict = judge(
        "all done.", span, PROBES, checkpoint_tokens=990, span_tokens=1000, settings=SETTINGS
    )

    assert [failure.check for failure in verdict.failures] == [
        GateCheck.SECTIONS,
        GateCheck.ECHO,
        GateCheck.REDUCTION,
        GateCheck.PROBES,
    ]


def test_the_minimum_useful_span_prices_the_skeleton_and_the_reduction() -> None:
    assert minimum_useful_span(90, 0.1) == 100
    assert minimum_useful_span(90, 0.0) == 91
    assert minimum_useful_span(90, None) == 91


def reference_echo(summary: str, span: list[Message]) -> int | None:
    """``echoed_message`` without its shortcuts: fold everything, compare."""
    needle = " ".join(summary.split()).casefold()
    if not needle:
        return None
    for index, message in enumerate(span):
        if needle in " ".join(message_text(message).split()).casefold():
            return index
    return None


ECHO_TEXT = st.text(alphabet="aAbBßSs ﬁ\n\t.", max_size=24)
#: ASCII, characters that casefold to ASCII, and non-ASCII ones that do not (or to themselves).
HOLD_TEXT = st.text(alphabet="aAbBsSkKiIfl. éÉ中😀ßẞ\u017f\u212aİﬁﬆŉ", max_size=30)


def test_the_characters_folding_to_ascii_are_all_listed() -> None:
    found = {
        chr(code)
        for code in range(0x80, sys.maxunicode + 1)
        if not 0xD800 <= code < 0xE000 and any(c.isascii() for c in chr(code).casefold())
    }
    assert found == set(FOLDS_TO_ASCII)


@settings(max_examples=600)
@given(HOLD_TEXT, HOLD_TEXT, st.data())
def test_folded_holds_is_a_search_of_the_casefolded_text(
    text: str, other: str, data: st.DataObject
) -> None:
    folded = text.casefold()
    start = data.draw(st.integers(0, len(folded)))
    inside = folded[start : data.draw(st.integers(start, len(folded)))]
    for word in (inside, other.casefold()):
        assert folded_holds(text, word) == (word in folded)


@settings(max_examples=400)
@given(ECHO_TEXT, st.lists(ECHO_TEXT, max_size=4))
def test_the_echo_check_finds_what_folding_every_message_finds(
    summary: str, texts: list[str]
) -> None:
    span = [user(text) for text in texts]
    assert echoed_message(summary, span) == reference_echo(summary, span)


def test_a_mark_character_casefolds_from_itself_alone() -> None:
    marks = set(MARK_CHARACTERS)
    for code in range(sys.maxunicode + 1):
        if 0xD800 <= code < 0xE000:
            continue
        folded = chr(code).casefold()
        assert folded, chr(code)  # no character folds away
        if marks & set(folded):
            assert folded == chr(code), hex(code)


#: Mark runs ("2025-03-31", "-->", "1.2.0"), letters that fold, whitespace, non-ASCII.
MARKED_TEXT = st.text(alphabet="aAß ﬁ\n\t.:-/0129é中", max_size=40)


@settings(max_examples=600)
@given(MARKED_TEXT, st.lists(st.lists(MARKED_TEXT, min_size=1, max_size=3), max_size=4), st.data())
def test_the_echo_check_of_marked_texts_finds_what_folding_every_message_finds(
    summary: str, blocks: list[list[str]], data: st.DataObject
) -> None:
    span = [user(texts[0], *(text_block(t) for t in texts[1:])) for texts in blocks]
    if span and data.draw(st.booleans()):  # the summary is part of one message, re-spaced
        text = message_text(span[data.draw(st.integers(0, len(span) - 1))])
        start = data.draw(st.integers(0, len(text)))
        summary = text[start : data.draw(st.integers(start, len(text)))].upper()
    assert echoed_message(summary, span) == reference_echo(summary, span)


def _event_of(kind: str, texts: list[str]) -> builders.SessionEvent:
    blocks = [builders.text_block(text) for text in texts]
    if kind == "system":
        return builders.system(texts[0])
    if kind == "tool":
        return builders.tool_result("c1", blocks=blocks, name="run")
    if kind == "assistant":
        event = builders.assistant(texts[0])
        event.assistant_message.content.extend(blocks[1:])
        return event
    return builders.user(blocks=blocks)


SPAN_EVENTS = st.lists(
    st.builds(
        _event_of,
        st.sampled_from(["system", "user", "assistant", "tool"]),
        st.lists(MARKED_TEXT, min_size=1, max_size=3),
    ),
    max_size=4,
)


@settings(max_examples=600)
@given(MARKED_TEXT, SPAN_EVENTS, st.data())
def test_the_echo_check_reading_the_events_bytes_finds_what_folding_every_message_finds(
    summary: str, events: list[builders.SessionEvent], data: st.DataObject
) -> None:
    pairs = [(m, e.SerializeToString()) for e in events if (m := project(e)) is not None]
    span = [message for message, _ in pairs]
    if span and data.draw(st.booleans()):  # the summary is part of one message, re-spaced
        text = message_text(span[data.draw(st.integers(0, len(span) - 1))])
        start = data.draw(st.integers(0, len(text)))
        summary = text[start : data.draw(st.integers(start, len(text)))].upper()
    expected = reference_echo(summary, span)
    assert echoed_message(summary, span, [serialized for _, serialized in pairs]) == expected
    assert echoed_message(summary, span) == expected


@pytest.mark.parametrize(
    "text", [GOOD, "  please FIX the bug in lib/app/mod.py now. ", "## Goals\n- x", ""]
)
def test_judging_what_examine_found_is_judging_the_summary(text: str) -> None:
    judged = partial(
        judge, text, SPAN, PROBES, checkpoint_tokens=100, span_tokens=1000, settings=SETTINGS
    )
    assert judged(findings=examine(text, SPAN, PROBES)) == judged()


def test_a_probe_the_pins_hold_is_kept_without_the_summary_repeating_it() -> None:
    probes = [
        Probe(ProbeKind.REQUEST, "Make the parser accept trailing commas in every list"),
        Probe(ProbeKind.PATH, "src/parser/lists.py"),
    ]
    summary = "## Files Touched\n- src/parser/lists.py"
    pins = "[goal]\nMake the parser accept trailing commas in every list, then release."

    alone = examine(summary, [], probes)
    pinned = examine(summary, [], probes, pinned=pins)

    assert alone.retention.kept == (False, True)
    assert pinned.retention.kept == (True, True)
