"""``compactd inspect`` against a live server: the text view, ``--json`` and ``--follow``."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from compactd import inspect
from compactd.api.auth import hash_token
from compactd.api.server import create_server
from compactd.cli import main
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from tests.builders import compaction_start, turn_start, user
from tests.compaction_fixtures import (
    PROVIDER,
    Harness,
    loopback,
    opening,
    route_table,
    server_config,
    started,
    unit,
    units,
)

BIG = "line of build output\n" * 600  # pruned when pressure qualifies


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    """The loopback provider the server's routes point at."""
    with loopback() as server:
        yield server


async def _session(h: Harness) -> int:
    """A compacted session above the trigger again, with an open turn; the checkpoint's seq."""
    await h.create(*opening(), *units(18))
    run = await h.compact()
    await h.append(*unit(30, result=BIG), *units(14, 31), turn_start(1))
    return int(run.result.outcome.checkpoint_seq)


async def _cli(address: str, *args: str) -> tuple[int, str]:
    """Run the real command line in its own process, as a user would."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "compactd.cli", "inspect", *args, "--address", address,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_inspect_shows_log_surface_brackets_pressure_plan_and_request_in_80_columns(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        checkpoint = await _session(h)
        code, out = await _cli(h.address, h.session_id)
    assert code == 0, out
    lines = out.splitlines()
    assert all(len(line) <= inspect.WIDTH for line in lines)
    for title in ("log and surface", "brackets", "plan (auto)", "request ("):
        assert any(line.startswith(f"== {title}") for line in lines), title
    assert any("ABOVE" in line for line in lines if line.startswith("pressure:"))
    shadowed = [line for line in lines if f"seq {checkpoint}" in line]
    assert len(shadowed) > 10  # the log's shadowed nodes name the checkpoint that replaced them
    assert any(" manual   committed" in line for line in lines)  # the bracket, one row
    assert any(line.startswith("prune seq ") for line in lines)  # the plan prunes the big result
    assert any(line.startswith("span: positions ") for line in lines)
    assert any(line.startswith("system    ") for line in lines)  # the rebuilt request


async def test_inspect_json_holds_every_part_as_the_rpcs_answer_it(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await _session(h)
        await h.append_as_server(compaction_start("orphan"))
        code, out = await _cli(h.address, h.session_id, "--json", "--mode", "manual")
        events = await h.events()
    assert code == 0, out
    got = json.loads(out)
    assert got["session_id"] == h.session_id
    assert len(got["events"]) == len(events) == got["revision"]
    outcomes = [b["outcome"] for b in got["brackets"]["brackets"]]
    assert outcomes == ["BRACKET_OUTCOME_COMMITTED", "BRACKET_OUTCOME_LIVE"]
    assert got["plan"]["mode"] == "PLAN_MODE_MANUAL"
    assert got["plan"]["blocked_code"] == "COMPACTION_BUSY"
    assert got["pressure"]["state"] == "PRESSURE_STATE_ABOVE"
    assert got["surface"]["detail"]["replacement_generation"] == "1"
    assert got["request"]["messages"]


async def test_inspect_plans_the_switch_to_the_route_given_with_to(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    small = {**route_table(loop), "model": "small", "context_window": 8000}
    async with started(tmp_path, loop, kind="extractive", routes=[small]) as h:
        await h.create(*opening(), *units(12))
        to = f"{PROVIDER}/small"
        code, out = await _cli(h.address, h.session_id, "--json", "--mode", "switch", "--to", to)
    assert code == 0, out
    plan = json.loads(out)["plan"]
    assert plan["mode"] == "PLAN_MODE_SWITCH"
    assert plan["route"] == {"provider": PROVIDER, "model": "small"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--mode", "switch"], "--mode switch needs --to PROVIDER/MODEL"),
        (["--mode", "switch", "--to", "small"], "--to: expected PROVIDER/MODEL, got 'small'"),
        (["--mode", "manual", "--to", "p/m"], "--to: --mode manual plans for the logged route"),
    ],
)
def test_inspect_refuses_a_plan_route_it_cannot_send_in_one_line_exiting_2(
    capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    # Refused before any call: nothing listens on port 1.
    assert main(["inspect", "s1", "--address", "127.0.0.1:1", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compactd inspect: ")
    assert message in err
    assert err.count("\n") == 1


async def test_inspect_of_an_unknown_session_says_not_found_and_exits_1(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        code, out = await _cli(h.address, "nope")
    assert code == 1
    assert "NOT_FOUND" in out


class _Output(io.StringIO):
    """Captured output that says when ``marker`` was printed."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.printed = asyncio.Event()

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.marker in self.getvalue():
            self.printed.set()
        return written


async def test_inspect_follow_streams_new_events_and_pressure(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(2))
        out = _Output("== request")

        def seen(lines: list[str]) -> bool:
            return any("user/message" in line for line in lines) and any(
                line.startswith("~ pressure ") for line in lines
            )

        followed = asyncio.ensure_future(
            inspect.run(h.address, h.session_id, follow=True, out=out, until=seen)
        )
        async with asyncio.timeout(30):
            await out.printed.wait()  # the snapshot is out: what comes now is followed
            (seq,) = await h.append(user("one more thing"))
            assert await followed == 0
    lines = out.getvalue().splitlines()
    assert any(line.startswith(f"+ {seq:>6} user/message") for line in lines)
    assert sum(line.startswith("~ pressure ") for line in lines) >= 1


async def test_inspect_sends_its_token_to_a_service_that_requires_one(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    token = "inspect-token-0123456789"
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(2))
    settings = server_config(tmp_path, loop, kind="extractive")
    settings = replace(settings, auth_tokens={"default": hash_token(token)})
    running = await create_server(settings)
    try:
        refused, out = await _cli(running.address, "s1")
        assert (refused, "UNAUTHENTICATED" in out) == (1, True)
        code, out = await _cli(running.address, "s1", "--token", token)
        assert code == 0, out
        assert "== brackets" in out
    finally:
        await running.stop(0)


def test_a_bracket_prepared_ahead_is_marked_with_the_steps_wait() -> None:
    record = cpb.BracketRecord(
        compaction_id="ab12cd34ef", summarizer="openai", end_seq=40,
        outcome=cpb.BRACKET_OUTCOME_COMMITTED, duration_seconds=0.01,
        prepared_ahead=events_pb2.PreparedAhead(candidate_id="c1", agent_wait_ms=7),
    )  # fmt: skip
    plain = cpb.BracketRecord(compaction_id="ffee0011", summarizer="openai", end_seq=9)

    rows = inspect._bracket_rows(cpb.ListBracketsResponse(brackets=[record, plain]))

    assert rows[1].endswith("openai ahead 7ms")
    assert len(rows[1]) <= inspect.WIDTH
    assert "ahead" not in rows[2]
