"""Facts survive repeated compaction: each extractive checkpoint carries the previous one's.

Through a live server with extractive summaries on an 8k window: the first units of a session
name a file, run a command and print an error; dozens of later units add history with facts of
their own. After three compactions (the first span summarized, then folded into the next
checkpoint twice) the request still shows the early path, command and error line, beside the
newer ones, listed most recent first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compactd.v1 import events_pb2
from tests.builders import assistant, header, in_step, system, tool_result, turn_end, turn_start
from tests.builders import user as user_message
from tests.compaction_fixtures import PROVIDER, TOOLS, UNIT_TURNS, Harness, loopback, started

SMALL = "small"
WINDOW, MAX_OUTPUT = 8192, 512
POLICY: dict[str, Any] = {  # as ``compactd replay --window 8192`` sets it
    "thresholdRatio": 0.8,
    "headroomTokens": 512,
    "maxTokens": 819,
    "minReductionRatio": 0.85,  # each checkpoint at most 15% of its span
}


def _unit(i: int, *, path: str, command: str, error: str) -> list[events_pb2.SessionEvent]:
    """A closed turn that names ``path``, runs ``command`` and prints ``error`` among a few
    hundred tokens of output."""
    turn = UNIT_TURNS + i
    arguments = json.dumps({"cmd": command})
    call = assistant(text=f"Checking part {i}.", calls=[(f"call-{i}", "run", arguments)])
    output = f"{error}\n" + f"line {i} of the run's output\n" * 250
    return [
        turn_start(turn),
        user_message(f"Part {i}: look at {path} and tell me what breaks. " + "Context. " * 30),
        *in_step(turn, 1, call),
        tool_result(f"call-{i}", output, name="run", is_error=True),
        *in_step(turn, 2, assistant(text=f"Part {i} is checked. " + "Detail. " * 30)),
        turn_end(turn),
    ]


def _facts(i: int) -> dict[str, str]:
    return {
        "path": f"lib/area{i}/module_{i}.py",
        "command": f"pytest tests/test_area{i}.py -q",
        "error": f"E   AssertionError: the total of area {i} was {i} where {i + 1} was expected",
    }


async def _steps_until(h: Harness, compactions: int) -> None:
    """Steps of one unit each until ``compactions`` brackets committed."""
    committed, i = 0, 0
    while committed < compactions:
        assert i < 200, "no compaction"
        await h.append(*_unit(i, **_facts(i)), turn_start(i + 1))
        committed += len((await h.prepare(i + 1)).result.compactions)
        i += 1


def _units_in(events: list[events_pb2.SessionEvent], seqs: set[int]) -> list[int]:
    """The units whose request is inside ``seqs`` (a span's shadowed seqs)."""
    texts = [b.text.text for e in events if e.seq in seqs and e.HasField("user_message")
             for b in e.user_message.content]  # fmt: skip
    return [int(t.split(":", 1)[0].removeprefix("Part ")) for t in texts if t.startswith("Part ")]


async def test_the_first_spans_facts_survive_three_compactions_newest_first(
    tmp_path: Path,
) -> None:
    route = {"provider": PROVIDER, "model": SMALL, "context_window": WINDOW,
             "max_output_tokens": MAX_OUTPUT}  # fmt: skip
    with loopback() as loop:
        async with started(tmp_path, loop, kind="extractive", routes=[route], policy=POLICY) as h:
            await h.create(system("You are a careful coding agent."),
                           header(PROVIDER, SMALL, tools=TOOLS))  # fmt: skip
            await _steps_until(h, 3)
            request = await h.build()
            events = await h.events()

    summaries = [e.compaction_summary for e in events if e.HasField("compaction_summary")]
    assert len(summaries) == 3
    assert {s.summarizer for s in summaries} == {"extractive"}
    first_units = _units_in(events, set(summaries[0].shadowed_seqs))
    third_units = _units_in(events, set(summaries[2].shadowed_seqs))
    shown = "\n".join(b.text.text for m in request.messages for b in m.content if b.text.text)
    # The request right after the third compaction still shows facts of every kind that only
    # the first span held (its messages are two checkpoints away): the second checkpoint carried
    # them, and the third carried them again.
    assert not set(first_units) & set(third_units)
    # (Unit 0's request, the session's first, is quoted in every checkpoint: not counted.)
    for kind in ("path", "command", "error"):
        held = [_facts(i)[kind] for i in first_units if i]
        if kind == "path":
            held += [f"tests/test_area{i}.py" for i in first_units if i]
        assert any(_identity(fact) in shown for fact in held), kind
    # Most recent first: the third span's own facts are listed before the first span's.
    third = summaries[2].summary
    for kind in ("command", "error"):
        carried = [f for i in first_units if (f := _identity(_facts(i)[kind])) in third]
        own = [f for i in third_units if (f := _identity(_facts(i)[kind])) in third]
        assert carried
        assert own
        assert max(map(third.index, own)) < min(map(third.index, carried))


def _identity(fact: str) -> str:
    """What a request must show of a fact (``bench.facts``): a command's program and argument,
    an error line's first 60 characters."""
    return fact.removesuffix(" -q")[:60]
