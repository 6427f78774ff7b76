"""``bench.facts``: every path, command and error line of a span, and which a request shows."""

from __future__ import annotations

import json

from bench import facts as fx
from compactd.core import prompts
from compactd.v1 import session_service_pb2

Message = session_service_pb2.Message
ROLE = session_service_pb2


def user(text: str) -> Message:
    message = Message(role=ROLE.MESSAGE_ROLE_USER)
    message.content.add().text.text = text
    return message


def assistant(text: str = "", *calls: tuple[str, dict[str, object]]) -> Message:
    message = Message(role=ROLE.MESSAGE_ROLE_ASSISTANT)
    if text:
        message.content.add().text.text = text
    for number, (name, arguments) in enumerate(calls):
        call = message.content.add().tool_call
        call.id, call.name, call.arguments_json = f"c{number}", name, json.dumps(arguments)
    return message


def tool(text: str, *, is_error: bool = False) -> Message:
    message = Message(role=ROLE.MESSAGE_ROLE_TOOL, name="bash", tool_call_id="c0")
    message.content.add().text.text = text
    message.is_error = is_error
    return message


def keys(found: list[fx.Fact], kind: fx.FactKind) -> list[str]:
    return [fact.key for fact in found if fact.kind is kind]


def test_every_path_the_conversation_names_counts_by_its_last_two_segments() -> None:
    found = fx.span_facts([
        user("fix /home/u/src/app/models/user.py please, and see README.md"),
        assistant("", ("Read", {"file_path": "/home/u/src/app/views.py"})),
        assistant("", ("Bash", {"command": "cat lib/core/parser.ex | head"})),
    ])  # fmt: skip
    assert keys(found, fx.FactKind.PATH) == [
        "models/user.py", "readme.md", "app/views.py", "core/parser.ex",
    ]  # fmt: skip


def test_paths_only_in_tool_output_or_written_content_are_not_counted() -> None:
    found = fx.span_facts([
        assistant("", ("Write", {"file_path": "a/b.py", "content": "import x/y/z.py"})),
        tool("src/other/file.py:12: match"),
    ])  # fmt: skip
    assert keys(found, fx.FactKind.PATH) == ["a/b.py"]


def test_a_command_counts_by_program_and_first_argument_skipping_cd_and_redirections() -> None:
    found = fx.span_facts([
        assistant("", ("Bash", {"command": "cd /repo && pytest tests/test_x.py -q 2>&1 | tail"})),
        assistant("", ("Bash", {"command": "pytest tests/test_x.py -k name"})),  # same identity
        assistant("run it:\n```bash\nFOO=1 make build\n```"),
        user("$ git status --short"),
        assistant("", ("str_replace_editor", {"command": "view", "path": "/repo/a.py"})),
    ])  # fmt: skip
    assert keys(found, fx.FactKind.COMMAND) == [
        "pytest tests/test_x.py",
        "make build",
        "git status",
    ]


def test_error_lines_count_by_their_first_60_characters() -> None:
    long = "ValueError: " + "x" * 100
    found = fx.span_facts([
        tool(f"Traceback (most recent call last):\n  File a.py\n{long}\nok"),
        tool("E   KeyError: 'name'\nFAILED tests/test_a.py::test_b - KeyError"),
        tool("segmentation fault, no marker", is_error=True),
        tool("all good: 0 errors"),
    ])  # fmt: skip
    assert keys(found, fx.FactKind.ERROR) == [
        "traceback (most recent call last):", long.casefold()[:60], "e keyerror: 'name'",
        "failed tests/test_a.py::test_b - keyerror", "segmentation fault, no marker",
    ]  # fmt: skip


def test_a_prior_checkpoint_gives_no_facts() -> None:
    framed = prompts.frame_checkpoint("## Files and Code\n- old/path/x.py")
    assert fx.span_facts([user(framed)]) == []


def test_a_request_shows_a_fact_when_it_holds_its_identity() -> None:
    found = fx.span_facts([
        assistant("", ("Bash", {"command": "pytest tests/test_x.py -q"})),
        assistant("", ("Read", {"file_path": "/home/u/src/app/models/user.py"})),
        tool("E   KeyError: 'name'"),
    ])  # fmt: skip
    shown = "Ran: `PYTEST tests/test_x.py`\n/other/root/: models/user.py\nbash: E KeyError: 'name'"
    assert [fact.kind for fact in found] == ["command", "path", "path", "error"]
    assert fx.kept(found, shown) == [True, True, True, True]
    missed = "pytest -q tests/test_x.py, user.py, KeyError"
    assert fx.kept(found, missed) == [False, True, False, False]


def test_a_one_segment_path_is_shown_only_as_a_whole_name() -> None:
    found = fx.span_facts([user("look at setup.py")])
    assert fx.kept(found, "edited ./setup.py") == [True]
    assert fx.kept(found, "edited mysetup.py") == [False]
