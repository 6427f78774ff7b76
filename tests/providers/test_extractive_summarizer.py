"""ExtractiveSummarizer: deterministic facts in eight sections, within max_tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from compactd.core import gate, probes, prompts
from compactd.core.pricing import heuristic_price, utf16_length
from compactd.providers.base import SummaryError, SummaryRequest
from compactd.providers.extractive import (
    MIN_CHECKPOINT_TOKENS,
    SPAN_SHARE,
    ExtractiveSummarizer,
    _at_word,
    _clip,
    _FileGroups,
    allowed_tokens,
    counted_allowance,
    estimated_tokens,
    minimum_span_tokens,
)
from compactd.reasons import Reason
from compactd.testing.messages import assistant, developer, system, tool_result, user
from compactd.tokenizers import pricing_profile
from compactd.v1 import events_pb2
from compactd.v1.session_service_pb2 import Message

SPAN = [
    system("You are a coding agent. SECRET-SYSTEM-HEAD"),
    user("Please make `compactd serve` read its port from COMPACTD_LISTEN."),
    assistant(
        "Reading the config module.",
        calls=[("c1", "read_file", '{"path": "server/compactd/config.py"}')],
    ),
    tool_result("c1", "def load():\n    return Config()", name="read_file"),
    assistant("Running the tests.", calls=[("c2", "bash", '{"command": "pytest -q tests/"}')]),
    tool_result(
        "c2",
        "tests/test_config.py F\nE   KeyError: 'COMPACTD_LISTEN'\n1 failed in 0.2s",
        name="bash",
        is_error=True,
    ),
    developer("Never edit generated code under server/compactd/v1/."),
    user("Also keep the default 127.0.0.1:50051."),
]


def _request(messages: Sequence[Message], max_tokens: int = 2000) -> SummaryRequest:
    return SummaryRequest(
        messages=messages,
        tools=[],
        config=events_pb2.RequestConfig(),
        instruction=prompts.compaction_instruction(None),
        max_tokens=max_tokens,
    )


async def _summary(
    messages: Sequence[Message], max_tokens: int = 2000, *, span_share: float | None = None
) -> str:
    """What the summarizer extracts, bounded by ``max_tokens`` alone unless ``span_share``."""
    summarizer = ExtractiveSummarizer(span_share=span_share)
    result = await summarizer.summarize(_request(messages, max_tokens))
    return result.text


def _sections(text: str) -> dict[str, str]:
    """Section bodies by title; only unindented ``## `` lines start a section."""
    sections: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("## "):
            sections[line[3:]] = []
        elif sections:
            sections[list(sections)[-1]].append(line)
    return {title: "\n".join(lines).strip() for title, lines in sections.items()}


def _tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-16-le")) / 2 / 4)


async def test_the_summary_has_all_eight_sections_in_order() -> None:
    text = await _summary(SPAN)

    assert list(_sections(text)) == list(prompts.SUMMARY_SECTIONS)


async def test_it_keeps_requests_paths_commands_errors_and_the_last_state() -> None:
    sections = _sections(await _summary(SPAN))

    goals = sections["Goals and Requests"]
    assert "Please make `compactd serve` read its port from COMPACTD_LISTEN." in goals
    assert "Also keep the default 127.0.0.1:50051." in goals
    assert "server/compactd/config.py" in sections["Files Touched"]
    # A path only a tool printed is bulk the model read, not a file the span acted on.
    assert "tests/test_config.py" not in sections["Files Touched"]
    assert "$ pytest -q tests/" in sections["Technical Context"]
    assert "KeyError: 'COMPACTD_LISTEN'" in sections["Errors and Resolutions"]
    assert "Never edit generated code" in sections["Essential Context"]
    assert "Answer the latest user request" in sections["Immediate Next Step"]
    assert "Running the tests." in sections["Work in Progress"]


async def test_the_system_head_stays_out_of_the_summary() -> None:
    assert "SECRET-SYSTEM-HEAD" not in await _summary(SPAN)


async def test_an_empty_section_is_its_heading_alone() -> None:
    # A "(none)" line in each empty section took tokens a carried-forward fact could use.
    text = await _summary([user("hello")])
    sections = _sections(text)

    assert sections["Outstanding Work"] == ""
    assert prompts.EMPTY_SECTION not in text
    assert sections["Goals and Requests"] == "- hello"
    assert list(sections) == list(prompts.SUMMARY_SECTIONS)


async def test_the_same_span_gives_the_same_bytes() -> None:
    assert await _summary(SPAN) == await _summary(list(SPAN))


async def test_a_long_span_fits_max_tokens_and_keeps_first_and_latest_requests() -> None:
    span = [user(f"request number {n}: " + "detail " * 40) for n in range(200)]
    span[0] = user("FIRST: build the thing")
    span[-1] = user("LATEST: ship it")

    text = await _summary(span, max_tokens=300)

    assert _tokens(text) <= 300
    assert "FIRST: build the thing" in text
    assert "LATEST: ship it" in text
    assert list(_sections(text)) == list(prompts.SUMMARY_SECTIONS)


async def test_too_small_a_budget_for_the_skeleton_fails_clearly() -> None:
    with pytest.raises(SummaryError, match="eight sections") as caught:
        await _summary(SPAN, max_tokens=10)

    assert caught.value.reason == Reason.SUMMARIZER_MISCONFIGURED


async def test_a_prior_checkpoint_is_folded_not_nested() -> None:
    first = await _summary(SPAN)
    later = [
        user(prompts.frame_checkpoint(first)),
        user("Now document COMPACTD_LISTEN in README.md."),
        assistant("Editing.", calls=[("c3", "edit", '{"file_path": "README.md"}')]),
        tool_result("c3", "ok", name="edit"),
    ]

    text = await _summary(later)
    sections = _sections(text)

    assert prompts.SUMMARY_OPEN_TAG not in text
    assert prompts.CHECKPOINT_PREAMBLE not in text
    assert text.count("## Goals and Requests") == 1
    goals = sections["Goals and Requests"]
    assert "read its port from COMPACTD_LISTEN" in goals
    assert "Now document COMPACTD_LISTEN in README.md." in goals
    assert "server/compactd/config.py" in sections["Files Touched"]
    assert "README.md" in sections["Files Touched"]
    assert "KeyError: 'COMPACTD_LISTEN'" in sections["Errors and Resolutions"]
    # The newer state replaces the older one.
    assert "Running the tests." not in sections["Work in Progress"]
    assert "edit" in sections["Work in Progress"]


async def test_folding_a_checkpoint_alone_keeps_its_facts_once() -> None:
    first = await _summary(SPAN)

    again = await _summary([user(prompts.frame_checkpoint(first))])

    assert again == first


_texts = st.text(max_size=300)
_messages = st.one_of(
    _texts.map(user),
    _texts.map(developer),
    st.builds(
        lambda text, args: assistant(text, calls=[("c", "bash", args)]),
        _texts,
        st.text(max_size=80),
    ),
    st.builds(
        lambda text, error: tool_result("c", text, name="bash", is_error=error),
        _texts,
        st.booleans(),
    ),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_messages, max_size=25), st.integers(min_value=120, max_value=2000))
@example(  # a carriage return is a line break to the bullet: its indentation must be priced
    span=[
        user("0000"),
        user("00000000000\r\U00010000\U00010000\U00010000\U00010000"),
        developer("00000000000\r\U00010000\U00010000\U00010000\U00010000"),
        developer("\U00010000"),
        developer("00000000\x1e\U00010000"),
        assistant("0", calls=[("c", "bash", "")]),
        user("000000\U00010000\U00010000\U00010000\U00010000"),
    ],
    max_tokens=120,
)
async def test_any_span_fits_max_tokens_deterministically(
    span: list[Message], max_tokens: int
) -> None:
    first = await _summary(span, max_tokens)
    second = await _summary(span, max_tokens)

    assert first == second
    assert _tokens(first) <= max_tokens
    assert list(_sections(first)) == list(prompts.SUMMARY_SECTIONS)


@settings(max_examples=60, deadline=None)
@given(st.lists(_messages, max_size=15))
@example(  # an error line of characters outside the BMP: two code units each, kept whole
    [
        tool_result(
            "c",
            "\U00010000000000 " + "\U00010000" * 20 + "\U0001d47a" * 12,
            name="bash",
            is_error=True,
        )
    ]
)
async def test_folding_a_lone_checkpoint_reproduces_it(span: list[Message]) -> None:
    first = await _summary(span, max_tokens=100_000)

    assert await _summary([user(prompts.frame_checkpoint(first))], max_tokens=100_000) == first


_tagged_texts = st.lists(
    st.one_of(
        st.text(max_size=40),
        st.sampled_from(
            [prompts.SUMMARY_OPEN_TAG, prompts.SUMMARY_CLOSE_TAG, prompts.CHECKPOINT_PREAMBLE, "\n"]
        ),
    ),
    max_size=6,
).map("".join)


async def test_a_request_quoting_the_closing_tag_survives_a_second_fold() -> None:
    request = "Why does </compacted-summary> end my prompt early?"
    first = await _summary([user(request)], max_tokens=100_000)

    again = await _summary([user(prompts.frame_checkpoint(first))], max_tokens=100_000)

    assert request in again
    assert again == first


async def test_a_user_message_that_only_mentions_the_tags_is_a_request() -> None:
    request = f"Explain {prompts.SUMMARY_OPEN_TAG}x{prompts.SUMMARY_CLOSE_TAG} to me."

    sections = _sections(await _summary([user(request)]))

    assert request in sections["Goals and Requests"]


@settings(max_examples=100, deadline=None)
@given(st.lists(_tagged_texts.map(user), min_size=1, max_size=4))
async def test_no_request_is_lost_when_a_checkpoint_folds_again(span: list[Message]) -> None:
    """Requests quoting the checkpoint's own tags and preamble survive every later fold."""
    first = await _summary(span, max_tokens=100_000)
    again = await _summary([user(prompts.frame_checkpoint(first))], max_tokens=100_000)

    assert again == first
    for message in span:
        text = message.content[0].text.text if message.content else ""
        if len(text) > 700:
            continue  # requests are quoted up to 800 code units, then clipped by design
        for line in text.splitlines():  # a bullet renders each line of a request on its own
            assert line.strip() in again


# ---- dense files, the span share, facts that survive folding (issue 14) -----------------------

ROOT = "/home/dev/projects/shop-service"


def _reading(index: int, path: str) -> list[Message]:
    """One step that reads ``path`` and a bulky result (about 700 heuristic tokens)."""
    call = (f"r{index}", "read_file", f'{{"path": "{path}"}}')
    return [
        assistant(f"Reading {path}.", calls=[call]),
        tool_result(f"r{index}", f"contents of {path}\n" + "line of code\n" * 230, name="read"),
    ]


def _long_span(
    paths: Sequence[str], request: str = "Find why checkout totals are off."
) -> list[Message]:
    span = [user(request)]
    for index, path in enumerate(paths):
        span += _reading(index, path)
    return span


async def test_paths_of_a_project_share_their_directory_lines() -> None:
    paths = [f"{ROOT}/src/cart/total.py", f"{ROOT}/src/cart/tax.py", f"{ROOT}/tests/test_cart.py"]
    files = _sections(await _summary(_long_span(paths)))["Files Touched"]

    # The directory the paths take the fewest characters under is written once (here the
    # project's root: one line beats a line for src/ and another for tests/); each path keeps
    # at least its last two segments on the line.
    # (Most recent first, as a later fold reads them back.)
    assert files.splitlines() == [
        f"- {ROOT}/: tests/test_cart.py, src/cart/tax.py, src/cart/total.py",
    ]


async def test_a_long_span_summary_stays_within_its_share_and_keeps_the_probes() -> None:
    paths = [f"{ROOT}/src/module_{i}/file_{i}.py" for i in range(12)]
    span = _long_span(paths)
    text = await _summary(span, max_tokens=20_000)

    span_tokens = sum(heuristic_price(m) for m in span)
    assert _tokens(prompts.frame_checkpoint(text)) <= 0.15 * span_tokens
    kept = probes.retention(probes.select_probes(probes.span_facts(span)), text)
    assert kept.ratio == 1.0


async def test_a_prior_checkpoints_paths_survive_the_next_fold() -> None:
    first_paths = [f"{ROOT}/src/cart/total.py", f"{ROOT}/src/cart/tax.py"]
    first = _long_span(first_paths)
    checkpoint = await _summary(first, max_tokens=20_000)
    later = [user(prompts.frame_checkpoint(checkpoint)), *_long_span(
        [f"{ROOT}/src/pay/card.py", f"{ROOT}/src/pay/refund.py"], "Now check refunds too."
    )]  # fmt: skip
    again = await _summary(later, max_tokens=20_000)

    earlier = probes.select_probes(probes.span_facts(first))
    assert probes.retention(earlier, again).ratio == 1.0


def test_a_grouped_files_line_reads_back_as_its_paths() -> None:
    line = f"{ROOT}/: src/cart/total.py, tests/test_cart.py"
    assert _FileGroups.paths_of(line) == [f"{ROOT}/src/cart/total.py", f"{ROOT}/tests/test_cart.py"]
    assert _FileGroups.paths_of("Edited the cart module: totals") == [
        "Edited the cart module: totals"
    ]


# ---- the checkpoint's share of its span ----------------------------------------------------------


def _work(steps: int, *, seed: int = 0) -> list[Message]:
    """A session of ``steps`` tool round trips, each naming a file, a command and an error."""
    messages = [system("You are a coding agent."), user("Fix the failing build of the parser.")]
    for n in range(steps):
        path = f"/home/dev/src/project/pkg{(n + seed) % 7}/module_{n + 100 * seed}.py"
        command = f"pytest -q tests/test_module_{n}.py -k case_{seed}"
        messages += [
            assistant(f"Checking {path}.", calls=[(f"r{n}", "read", f'{{"path": "{path}"}}')]),
            tool_result(f"r{n}", f"def f_{n}():\n" + "    x = compute(x)\n" * 12, name="read"),
            assistant("Running it.", calls=[(f"b{n}", "bash", f'{{"command": "{command}"}}')]),
            tool_result(
                f"b{n}", f"E   ValueError: case {n} broke\n1 failed in 0.{n}s", name="bash"
            ),
        ]
    return messages


def _span_tokens(messages: Sequence[Message]) -> int:
    return sum(heuristic_price(m) for m in messages[1:])


@settings(max_examples=40, deadline=None)
@given(steps=st.integers(min_value=1, max_value=60), seed=st.integers(0, 6))
async def test_a_checkpoint_never_takes_more_than_its_share_of_the_span(
    steps: int, seed: int
) -> None:
    messages = _work(steps, seed=seed)
    span = _span_tokens(messages)
    summary = ExtractiveSummarizer().summary_text(messages, 100_000)

    checkpoint = estimated_tokens(prompts.frame_checkpoint(summary))
    assert checkpoint <= allowed_tokens(span) + 1
    assert checkpoint < span
    if span >= MIN_CHECKPOINT_TOKENS / SPAN_SHARE:
        assert checkpoint <= 0.15 * span


async def test_a_span_too_small_for_the_share_gets_at_most_half_of_it() -> None:
    # The 512-token span of agent-aa84377 got a 554-token summary before (SUMMARY_NOT_SMALLER).
    messages = _work(3)
    span = _span_tokens(messages)
    assert 300 < span < MIN_CHECKPOINT_TOKENS / SPAN_SHARE

    summary = await _summary(messages, 800, span_share=SPAN_SHARE)

    assert estimated_tokens(prompts.frame_checkpoint(summary)) <= max(span / 2, 150)
    assert "Fix the failing build of the parser." in summary


async def test_a_tight_share_keeps_the_gates_probes_before_other_facts() -> None:
    messages = _work(40)
    found = probes.select_probes(probes.span_facts(messages[1:]))

    summary = ExtractiveSummarizer().summary_text(messages, 100_000)
    everything = ExtractiveSummarizer(span_share=None).summary_text(messages, 100_000)

    assert estimated_tokens(prompts.frame_checkpoint(everything)) > allowed_tokens(
        _span_tokens(messages)
    )  # the share is what limits this summary
    assert probes.retention(found, summary).ratio >= 0.9


def test_a_fold_keeps_the_older_spans_paths_beside_the_new_spans_probes() -> None:
    summarizer = ExtractiveSummarizer()
    first = _work(20, seed=1)
    # The older span's newest paths: a fold lists the facts most recent first, the prior's after
    # the span's own, so a budget drops the older span's oldest paths first.
    named = list(reversed(probes.span_facts(first[1:]).paths))
    paths = [probes.Probe(probes.ProbeKind.PATH, path) for path in named[:8]]
    summary = summarizer.summary_text(first, 100_000)
    folded = [first[0], user(prompts.frame_checkpoint(summary)), *_work(20, seed=2)[1:]]
    summary = summarizer.summary_text(folded, 100_000)
    own = probes.select_probes(probes.span_facts(folded[1:]))

    assert estimated_tokens(prompts.frame_checkpoint(summary)) <= allowed_tokens(
        _span_tokens(folded)
    )
    assert len(paths) == 8
    assert probes.retention(paths, summary).ratio >= 0.75
    assert probes.retention(own, summary).ratio == 1.0


def test_a_folded_checkpoint_lists_each_fact_once_newest_first() -> None:
    summarizer = ExtractiveSummarizer(span_share=None)  # room for everything: the order shows
    first = [system("head"), user("Fix the parser."),
             assistant("", calls=[("c1", "bash", '{"command": "cd app && pytest tests/a.py -q"}')]),
             tool_result("c1", "E   KeyError: 'old'", name="bash", is_error=True)]  # fmt: skip
    summary = summarizer.summary_text(first, 100_000)
    folded = [first[0], user(prompts.frame_checkpoint(summary)),
              assistant("", calls=[("c2", "bash", '{"command": "pytest tests/a.py -x"}')]),
              tool_result("c2", "E   KeyError: 'new'", name="bash", is_error=True),
              assistant("", calls=[("c3", "bash", '{"command": "make build"}')])]  # fmt: skip
    sections = _sections(summarizer.summary_text(folded, 100_000))

    assert sections["Technical Context"].splitlines()[:2] == [
        "- $ make build", "- $ pytest tests/a.py -x",
    ]  # fmt: skip
    assert sections["Errors and Resolutions"].splitlines() == [
        "- E   KeyError: 'new'", "- E   KeyError: 'old'",
    ]  # fmt: skip
    assert "Fix the parser." in sections["Goals and Requests"]


def test_non_ascii_and_punctuation_are_estimated_above_the_heuristic() -> None:
    rare = "᤬㨉ᓺ㜽ᭅᜓ᧟ᙠ" * 10
    path = "/a/b-c/d_e/f.g/h:i/j" * 10

    assert estimated_tokens(rare) >= 2 * len(rare)
    assert estimated_tokens(path) > len(path) / 4
    prose = "plain words in a long sentence, ok"
    assert len(prose) / 4 <= estimated_tokens(prose) <= len(prose) / 3


# Text of every width: ASCII, accents, CJK, astral characters (two UTF-16 code units each).
_MIXED = st.text(st.sampled_from("ab c.\né中\U0001f600\U00010348"), max_size=40)


@given(_MIXED)
def test_the_estimate_of_a_mixed_text_is_its_ascii_part_plus_two_per_other_character(
    text: str,
) -> None:
    assume(not text.isascii())
    kept = "".join(c for c in text if c.isascii())

    assert estimated_tokens(text) == estimated_tokens(kept) + 2 * (len(text) - len(kept))


@given(_MIXED, st.integers(min_value=1, max_value=50))
def test_a_clip_keeps_the_whole_characters_that_fit_in_its_code_units(
    text: str, max_units: int
) -> None:
    clipped = _clip(text, max_units)

    if utf16_length(text) <= max_units:
        assert clipped == text
        return
    room = max(0, max_units - 1)  # the ellipsis is one code unit
    cut, used = 0, 0  # the longest prefix of whole characters within ``room`` units
    while cut < len(text) and used + (2 if ord(text[cut]) > 0xFFFF else 1) <= room:
        used += 2 if ord(text[cut]) > 0xFFFF else 1
        cut += 1
    assert clipped == _at_word(text[:cut], room)
    assert utf16_length(clipped) <= max_units


def test_a_high_reduction_ratio_asks_for_a_span_the_minimum_checkpoint_fits() -> None:
    assert minimum_span_tokens(None) == 0
    assert minimum_span_tokens(0.1) == 0
    assert minimum_span_tokens(0.85) == math.ceil(MIN_CHECKPOINT_TOKENS / (0.15 * 0.9)) == 1852


# ---- the route's count, the room and the older facts ---------------------------------------------

_O200K = pricing_profile("o200k_base")


def _counted(summary: str) -> int:
    """A route's count of the checkpoint ``summary`` becomes (o200k_base, framed)."""
    return _O200K.count(prompts.frame_checkpoint(summary))


def _route_span(messages: Sequence[Message]) -> int:
    return sum(_O200K.count(m.content[0].text.text) + 8 for m in messages[1:])


def _counted_request(
    messages: Sequence[Message], *, span_tokens: int, max_tokens: int = 2000, room: int = 0
) -> SummaryRequest:
    return replace(
        _request(messages, max_tokens), span_tokens=span_tokens, checkpoint_tokens=_counted,
        room_tokens=room,
    )  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(steps=st.integers(min_value=20, max_value=60), seed=st.integers(0, 6))
async def test_a_counted_checkpoint_fills_its_share_of_the_span_and_no_more(
    steps: int, seed: int
) -> None:
    # With the route's count the checkpoint takes 15% of its span as the route counts it: the
    # estimate errs high, and fitting it alone left a fifth of that room unused.
    messages = _work(steps, seed=seed)
    span = _route_span(messages)
    summarizer = ExtractiveSummarizer()

    counted = await summarizer.summarize(_counted_request(messages, span_tokens=span))
    estimated = summarizer.summary_text(messages, 2000, span_tokens=span)

    assert _counted(counted.text) <= counted_allowance(span) <= 0.15 * span
    assert _counted(counted.text) >= 0.14 * span
    assert _counted(counted.text) > _counted(estimated)


async def test_max_tokens_caps_a_models_output_not_a_checkpoint_that_takes_its_share() -> None:
    # maxTokens bounds a model's generation (the spec: the summary call's output cap); the
    # extractive checkpoint is bounded by its share of the span, and by the room the window
    # leaves when the request is over it.
    messages = _work(60)
    span = _route_span(messages)
    summarizer = ExtractiveSummarizer()

    free = await summarizer.summarize(_counted_request(messages, span_tokens=span, max_tokens=64))
    roomed = await summarizer.summarize(
        _counted_request(messages, span_tokens=span, max_tokens=64, room=300)
    )

    assert _counted(free.text) > 0.14 * span > 300
    assert estimated_tokens(roomed.text) <= 300
    with pytest.raises(SummaryError, match="the room=10"):
        await summarizer.summarize(_counted_request(messages, span_tokens=span, room=10))


async def test_a_checkpoint_cut_to_the_room_takes_its_share_however_small_the_span() -> None:
    # A span too small for 15% to hold MIN_CHECKPOINT_TOKENS gets that many when the quality
    # gate judges the checkpoint's probes; one cut to fit the window (a room) takes 15%.
    messages = _work(7)
    span = _route_span(messages)
    assert 120 < span * 0.15 < MIN_CHECKPOINT_TOKENS  # room for the eight sections, not for 250
    summarizer = ExtractiveSummarizer()

    gated = await summarizer.summarize(_counted_request(messages, span_tokens=span))
    cut = await summarizer.summarize(_counted_request(messages, span_tokens=span, room=5000))

    assert _counted(gated.text) > 0.15 * span
    assert _counted(cut.text) <= counted_allowance(span, strict=True) <= 0.15 * span


async def test_a_room_checkpoint_too_small_for_eight_headings_leaves_the_empty_ones_out() -> None:
    # 15% of a 445-token span cannot hold the eight empty sections framed (84 tokens): a
    # checkpoint cut to fit the window writes only the sections it has facts for, and stays
    # within its share; one the gate judges keeps all eight.
    messages = _work(3)
    span = _route_span(messages)
    assert _counted(prompts.summary_skeleton().replace("- (none)", "")) > 0.15 * span
    summarizer = ExtractiveSummarizer()

    cut = await summarizer.summarize(_counted_request(messages, span_tokens=span, room=5000))
    gated = await summarizer.summarize(_counted_request(messages, span_tokens=span))

    assert _counted(cut.text) <= counted_allowance(span, strict=True) <= 0.15 * span
    assert cut.text.startswith(f"## {prompts.SUMMARY_SECTIONS[0]}\n- Fix the failing build")
    assert "## Essential Context" not in cut.text
    assert gate.section_problem(cut.text) is not None
    assert gate.section_problem(gated.text) is None
    # A later checkpoint folds the lean one forward (a missing section reads as an empty one)
    # and writes all eight sections again.
    later = [messages[0], user(prompts.frame_checkpoint(cut.text)), *_work(4, seed=3)[1:]]
    folded = summarizer.summary_text(later, 2000)
    assert gate.section_problem(folded) is None
    assert "Fix the failing build" in folded


def test_older_facts_that_do_not_all_fit_keep_only_what_identifies_them() -> None:
    # A fold whose older paths and commands do not all fit whole writes each by its identity (a
    # path's last two segments, a command's program and first argument): more of them fit.
    summarizer = ExtractiveSummarizer()
    first = _work(30, seed=1)
    older = summarizer.summary_text(first, 100_000)
    folded = [first[0], user(prompts.frame_checkpoint(older)), *_work(30, seed=2)[1:]]
    span = _route_span(folded)
    paths = [p for p in dict.fromkeys(probes.span_facts(first[1:]).paths) if p.startswith("/")]

    summary = summarizer.summary_text(folded, 2000, span_tokens=span, checkpoint_tokens=_counted)

    whole = [p for p in paths if p in summary]
    tails = [p for p in paths if "/".join(p.split("/")[-2:]) in summary]
    assert whole == []  # the older span's paths by their last two segments only
    assert len(paths) == 30
    assert len(tails) >= 10  # the older span keeps a share of the room
