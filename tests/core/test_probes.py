"""Probes: the exact facts of a span (requests, paths, commands, errors) and whether a summary
kept them."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core import probes, prompts
from compactd.core.probes import (
    Probe,
    ProbeKind,
    ProbeLimits,
    SpanFacts,
    call_facts,
    error_lines,
    paths_in,
    retention,
    select_probes,
    span_facts,
)
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.testing.messages import assistant, system, tool_result, user

REQUEST, PATH, COMMAND, ERROR = (
    ProbeKind.REQUEST,
    ProbeKind.PATH,
    ProbeKind.COMMAND,
    ProbeKind.ERROR,
)

SPAN = [
    system("You are a coding agent working on /etc/agent/rules.md."),
    user("Please make compactd serve read its port from COMPACTD_LISTEN, see server/config.py."),
    assistant(
        "Reading the config module.",
        calls=[("c1", "read_file", '{"path": "server/compactd/config.py"}')],
    ),
    tool_result("c1", "def load():\n    return Config()  # see docs/config.md", name="read_file"),
    assistant(
        "Running the tests.",
        calls=[("c2", "bash", '{"command": "cd server && pytest -q tests/ 2>&1 | tail -5"}')],
    ),
    tool_result(
        "c2",
        "tests/test_config.py F\nE   KeyError: 'COMPACTD_LISTEN'\n1 failed in 0.2s",
        name="bash",
        is_error=True,
    ),
    user("Also keep the default 127.0.0.1:50051 when the variable is unset."),
]


def probes_of(messages: list) -> tuple[Probe, ...]:  # type: ignore[type-arg]
    return select_probes(span_facts(messages))


# ---- extraction --------------------------------------------------------------------------------


def test_paths_are_slashed_tokens_then_bare_file_names_each_once() -> None:
    text = "Edit src/app/main.py and ./run.sh, then config.toml; src/app/main.py again."

    assert paths_in(text) == ["src/app/main.py", "./run.sh", "config.toml"]


@pytest.mark.parametrize(
    "text",
    ["see https://example.com/a/b", "and/or TCP/IP", "The end. Done.", "version 1.2 of it"],
)
def test_urls_prose_slashes_and_sentence_dots_are_not_paths(text: str) -> None:
    assert paths_in(text) == []


@pytest.mark.parametrize(
    "text",
    ["<h1>Title</h1>", "<div class='x'><p>a</p></div>", "<td>1</td></tr></table>", "</h1>"],
)
def test_html_closing_tags_are_not_paths(text: str) -> None:
    assert paths_in(text) == []


def test_paths_beside_markup_still_count() -> None:
    text = '<a href="/docs/index.html">docs</a> <code>/etc/hosts</code> <p>src/app.py</p>'

    assert paths_in(text) == ["/docs/index.html", "/etc/hosts", "src/app.py"]


def test_a_call_names_its_commands_and_the_paths_it_acts_on_not_those_in_written_content() -> None:
    found = call_facts(
        '{"file_path": "lib/a.ex", "content": "see lib/b.ex", "command": "mix test test/c.exs"}'
    )

    assert found.commands == ("mix test test/c.exs",)
    assert found.named_paths == ("lib/a.ex", "test/c.exs")
    assert set(found.paths) == {"lib/a.ex", "lib/b.ex", "test/c.exs"}


def test_arguments_that_are_not_json_still_yield_their_paths() -> None:
    assert call_facts("open src/x.py").paths == ("src/x.py",)


def test_error_lines_are_the_last_matching_lines_or_a_silent_failures_first_line() -> None:
    traceback = "Traceback (most recent call last):\n  File x\nValueError: bad\nexit 1 failed"

    assert error_lines(traceback, is_error=False) == [
        "Traceback (most recent call last):",
        "ValueError: bad",
        "exit 1 failed",
    ]
    assert error_lines("nothing to see\nhere", is_error=True) == ["nothing to see"]
    assert error_lines("all good", is_error=False) == []


def test_the_system_head_and_prior_checkpoints_give_no_facts() -> None:
    checkpoint = user(prompts.frame_checkpoint("## Goals and Requests\n- edit old/file.py"))
    facts = span_facts([system("Rules in /etc/rules.md"), checkpoint, user("Fix it now please")])

    assert list(facts.requests) == ["Fix it now please"]
    assert facts.paths == {}


def test_a_repeated_request_counts_once_at_its_latest_position() -> None:
    facts = span_facts(
        [user("run the suite again"), user("fix the bug"), user("run the suite again")]
    )

    assert list(facts.requests) == ["fix the bug", "run the suite again"]


# ---- probe selection ---------------------------------------------------------------------------


def test_the_probes_of_a_span_are_its_requests_paths_commands_and_stated_errors() -> None:
    probes = probes_of(SPAN)

    assert [p for p in probes if p.kind is REQUEST] == [
        Probe(REQUEST, SPAN[1].content[0].text.text),
        Probe(REQUEST, SPAN[6].content[0].text.text),
    ]
    assert {p.text for p in probes if p.kind is PATH} == {
        "server/config.py",
        "server/compactd/config.py",
    }
    assert [p.text for p in probes if p.kind is COMMAND] == [
        "cd server && pytest -q tests/ 2>&1 | tail -5"
    ]
    assert [p for p in probes if p.kind is ERROR] == [
        Probe(ERROR, "KeyError: 'COMPACTD_LISTEN'", origin="E   KeyError: 'COMPACTD_LISTEN'")
    ]


def test_paths_in_tool_output_and_lines_merely_mentioning_errors_are_not_probed() -> None:
    probes = probes_of(
        [
            user("Look at the styles please"),
            assistant(calls=[("c", "read", '{"path": "a.css"}')]),
            tool_result("c", ".badge-error { color: red }\nimported from lib/theme/base.css"),
        ]
    )

    assert {p.text for p in probes if p.kind is PATH} == {"a.css"}
    assert [p for p in probes if p.kind is ERROR] == []


def test_short_requests_and_injected_markup_are_not_probed() -> None:
    probes = probes_of([user("continue"), user("<system-reminder>lint failed</system-reminder>")])

    assert probes == ()


def test_the_first_and_latest_requests_come_first_then_the_newest_up_to_the_limit() -> None:
    requests = [user(f"request number {i} with enough words") for i in range(10)]

    probes = select_probes(span_facts(requests), ProbeLimits(requests=4))

    assert [p.text.split()[2] for p in probes] == ["0", "9", "8", "7"]


def test_the_most_mentioned_paths_and_most_used_commands_are_probed_first() -> None:
    calls = [
        assistant(calls=[(f"c{i}", "bash", f'{{"command": "mix test {i}"}}')]) for i in range(3)
    ]
    span = [
        user("Work on lib/a.ex and lib/b.ex"),
        user("Mostly lib/b.ex, it matters most"),
        assistant(calls=[("g", "bash", '{"command": "git status"}')]),
        *calls,
    ]

    probes = select_probes(span_facts(span), ProbeLimits(paths=1, commands=2))

    assert [p.text for p in probes if p.kind is PATH] == ["lib/b.ex"]
    assert [p.text for p in probes if p.kind is COMMAND] == ["mix test 2", "git status"]


# ---- retention ---------------------------------------------------------------------------------


def test_a_quote_of_six_words_keeps_a_request_and_a_paraphrase_does_not() -> None:
    probe = Probe(REQUEST, "Please make compactd serve read its port from COMPACTD_LISTEN.")

    assert retention([probe], '- User: "make compactd serve read its port" from env').ratio == 1
    assert retention([probe], "- The user wants the port configurable by env").ratio == 0


def test_a_path_is_kept_by_its_last_two_segments_and_a_bare_name_by_a_whole_word() -> None:
    deep = Probe(PATH, "/home/u/src/lib/app/mod.py")
    bare = Probe(PATH, "./cmd")

    assert retention([deep], "- `lib/app/mod.py`: rewritten").kept == (True,)
    assert retention([deep], "- mod.py was rewritten").kept == (False,)
    assert retention([bare], "- built bin/cmd").kept == (True,)
    assert retention([bare], "- the command ran").kept == (False,)


def test_a_command_is_kept_by_its_program_and_subcommand() -> None:
    probe = Probe(COMMAND, "cd /repo && mix test test/x_test.exs 2>&1 | tail -20")

    assert retention([probe], "- Ran `mix test` until green").ratio == 1
    assert retention([probe], "- Ran the tests").ratio == 0


def test_retention_reports_the_missed_probes_in_order_and_is_full_without_probes() -> None:
    probes = [Probe(PATH, "a/b.py"), Probe(ERROR, "KeyError: 'x' in load"), Probe(PATH, "c/d.py")]

    kept = retention(probes, "- edited c/d.py")

    assert kept.missed == (probes[0], probes[1])
    assert kept.ratio == pytest.approx(1 / 3)
    assert retention([], "anything").ratio == 1.0


def test_case_and_markdown_quoting_do_not_matter() -> None:
    probe = Probe(ERROR, "KeyError: 'COMPACTD_LISTEN'")

    assert retention([probe], "**keyerror: `compactd_listen`** raised").ratio == 1


# ---- the extractive summary keeps the probes ----------------------------------------------------

_WORDS = st.sampled_from(["fix", "the", "parser", "in", "lib/app/mod.py", "now", "run", "tests"])
_TEXT = st.lists(_WORDS, min_size=1, max_size=12).map(" ".join)
_MESSAGE = st.one_of(
    _TEXT.map(user),
    _TEXT.map(lambda text: assistant(text)),
    st.tuples(_TEXT, st.sampled_from(["mix test", "git status", "pytest -q x/y.py"])).map(
        lambda pair: assistant(pair[0], calls=[("c", "bash", f'{{"command": "{pair[1]}"}}')])
    ),
    _TEXT.map(lambda text: tool_result("c", "ValueError: " + text, is_error=True)),
)


@settings(max_examples=150)
@given(st.lists(_MESSAGE, min_size=1, max_size=30))
def test_an_extractive_summary_with_room_keeps_every_probe(span: list) -> None:  # type: ignore[type-arg]
    summary = ExtractiveSummarizer(span_share=None).summary_text(span, 20_000)

    assert retention(probes_of(span), summary).missed == ()


# --- property: the one-scan path finder finds what scanning every run finds -----------------

_EVERY_RUN = re.compile(r"[\w:/.~@+-]+")


def reference_paths_in(text: str) -> list[str]:
    """``paths_in`` as a walk over every maximal run of path characters (the slow reference)."""
    slashed: dict[str, None] = {}
    bare: dict[str, None] = {}
    for run in _EVERY_RUN.findall(text):
        if "/" in run:
            for match in probes._PATH_TOKEN.finditer(run):
                token = match.group(0).rstrip(".,:;")
                if probes._looks_like_path(token):
                    slashed[token] = None
        if "." in run.rstrip(".,:;"):
            bare.update(dict.fromkeys(m.group(0) for m in probes._BARE_FILE.finditer(run)))
    return [*slashed, *(name for name in bare if name not in slashed)]


PATHY = st.text(alphabet="ab._/-~:@+ \n,;é1", max_size=60)


@settings(max_examples=500)
@given(st.lists(st.one_of(PATHY, st.sampled_from(["src/a.py", "./x", "~/y.md", "a.b.c"])),
                max_size=8).map(" ".join))  # fmt: skip
def test_paths_in_finds_what_a_walk_over_every_run_finds(text: str) -> None:
    assert probes.paths_in(text) == reference_paths_in(text)


RUNNY = st.text(alphabet="ab._/-~:@+<> \n\t\r\x0b\xa0,;é1", max_size=80)


@settings(max_examples=500)
@given(st.lists(st.one_of(RUNNY, st.sampled_from(["</h1>", "src/a.py", "e.g.", "x/"])),
                max_size=8).map("".join))  # fmt: skip
def test_the_hit_led_run_scan_finds_exactly_the_runs_one_scan_of_the_text_finds(
    text: str,
) -> None:
    found = [(m.start(), m.group(0)) for m in probes._path_runs(text)]
    assert found == [(m.start(), m.group(0)) for m in probes._RUN.finditer(text)]


def test_call_facts_without_every_path_names_the_same_paths_and_commands() -> None:
    arguments = '{"path": "src/a.py", "content": "see lib/b.py", "command": "cat docs/c.md"}'
    full, probed = call_facts(arguments), call_facts(arguments, every_path=False)
    assert probed.named_paths == full.named_paths == ("src/a.py", "docs/c.md")
    assert probed.commands == full.commands
    assert "lib/b.py" in full.paths
    assert probed.paths == ("src/a.py",)


def test_a_bulk_extraction_gives_the_probes_a_plain_one_gives() -> None:
    span = [
        user("Fix src/app/main.py: `pytest -q` fails with KeyError in lib/conf.py\n$ make test"),
        assistant("Reading src/app/main.py and docs/notes.md first.",
                  calls=[("c1", "write", '{"path": "out/a.py", "content": "see lib/b.py"}')]),
        tool_result("c1", "Traceback (most recent call last):\nKeyError: 'x'", is_error=True),
    ]  # fmt: skip
    plain, bulk = span_facts(span), span_facts(span, bulk=True)
    assert select_probes(bulk) == select_probes(plain)
    assert (bulk.requests, bulk.paths, bulk.commands, bulk.errors) == (
        plain.requests, plain.paths, plain.commands, plain.errors,
    )  # fmt: skip


def reference_probes(facts: SpanFacts) -> tuple[Probe, ...]:
    """``select_probes``' requests and paths as its docstring orders them: every fact filtered
    first, then ordered (the first and latest request, the rest newest first; paths by mentions)."""
    requests = [request for request in facts.requests if probes._is_request(request)]
    ordered = [*requests[:1], *requests[-1:], *reversed(requests[1:-1])]
    paths = [path for path in facts.paths if probes._is_file_path(path)]
    by_mentions = sorted(paths, key=lambda path: -facts.paths[path])
    limits = ProbeLimits()
    return (
        *probes._distinct(ProbeKind.REQUEST, ordered, limits.requests),
        *probes._distinct(ProbeKind.PATH, by_mentions, limits.paths),
    )


_REQUEST = st.sampled_from(
    ["yes", "<reminder> keep going now", "fix the parser now", "Fix  the parser now",
     "add a test for it please", "ok then do it"]
)  # fmt: skip
_PATH = st.sampled_from(
    ["/dev/null", "src/a.py", "src/A.py", "lib/b/c.rs", "Makefile", "x.md", "docs/", "a/b/"]
)


@given(st.lists(_REQUEST, max_size=12), st.dictionaries(_PATH, st.integers(1, 4)))
def test_requests_and_paths_are_probed_as_if_every_one_was_checked_first(
    requests: list[str], paths: dict[str, int]
) -> None:
    facts = SpanFacts(requests=dict.fromkeys(requests), paths=paths)
    chosen = [p for p in select_probes(facts) if p.kind in (ProbeKind.REQUEST, ProbeKind.PATH)]
    assert tuple(chosen) == reference_probes(facts)
