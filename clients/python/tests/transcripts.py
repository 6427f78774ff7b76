"""The shared agent transcripts of the repository's test data, and the step rules of a log.

``testdata/transcripts/`` (see its SOURCES.md) holds real conversations as OpenAI chat messages
and as Anthropic messages; the converters' round trips run over every one of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compactd_client.events import event_type
from compactd_client.v1.events_pb2 import SessionEvent

TESTDATA = Path(__file__).resolve().parents[3] / "testdata" / "transcripts"


def conversations(name: str) -> list[dict[str, Any]]:
    """Every ``{"source", "messages"}`` record of ``testdata/transcripts/<name>.jsonl``."""
    with (TESTDATA / f"{name}.jsonl").open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def step_rule_violations(events: list[SessionEvent]) -> list[str]:
    """Where ``events`` break the step rules (empty when the log is valid).

    An ``assistant/message`` only inside an open step of an open turn; ``step/start`` needs its
    turn open and no other step open; ``step/end`` matches the open step; ``turn/end`` closes an
    open turn with no step open; a ``tool/result`` answers a call made by an earlier step.
    """
    problems: list[str] = []
    turn: int | None = None
    step: tuple[int, int] | None = None
    calls: set[str] = set()
    for index, event in enumerate(events):
        kind = event_type(event)
        if kind == "turn/start":
            if turn is not None:
                problems.append(f"{index}: turn/start while turn {turn} is open")
            turn = event.turn_start.turn
        elif kind == "turn/end":
            if turn != event.turn_end.turn or step is not None:
                problems.append(f"{index}: turn/end of a turn that is not open or has a step open")
            turn = None
        elif kind == "step/start":
            if turn != event.step_start.turn or step is not None:
                problems.append(f"{index}: step/start outside its open turn or inside a step")
            step = (event.step_start.turn, event.step_start.step)
        elif kind == "step/end":
            if step != (event.step_end.turn, event.step_end.step):
                problems.append(f"{index}: step/end does not match the open step")
            step = None
        elif kind == "assistant/message":
            if step is None:
                problems.append(f"{index}: assistant/message outside a step")
            calls.update(b.tool_call.id for b in event.assistant_message.content
                         if b.HasField("tool_call"))  # fmt: skip
        elif kind == "tool/result" and event.tool_result.tool_call_id not in calls:
            problems.append(f"{index}: tool/result without an earlier call")
    return problems
