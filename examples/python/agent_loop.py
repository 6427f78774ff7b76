"""An agent loop on compactd, in Python: PrepareStep before every model call.

For each turn of the script: open the turn, then step until the model answers without tool
calls. Each step asks compactd to prepare it (PrepareStep prunes and compacts when the request
is above pressure, streaming each bracket step; the client holds the request and compactd
answers only what the step added), sends the request compactd rebuilt to the
model (an OpenAI-compatible endpoint), logs the reply with its usage, runs the tools (scripted:
the recorded outputs) and logs their results. Prints pressure per step, every compaction, and
the final surface.

Run through ``examples/run``, which starts compactd and the scripted loopback model and sets:
COMPACTD_ADDRESS, COMPACTD_PROVIDER, COMPACTD_MODEL, COMPACTD_AGENT_BASE_URL,
COMPACTD_EXAMPLE_SCRIPT.
"""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

from compactd_client import CompactdClient, openai
from compactd_client.events import (
    event_type,
    request_header,
    step_end,
    step_start,
    system_message,
    tool_declaration,
    tool_result,
    turn_end,
    turn_start,
    user_message,
)
from compactd_client.v1 import compaction_service_pb2 as cpb
from compactd_client.v1 import session_service_pb2


def complete(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POSTs one chat completion and returns the JSON answer."""
    request = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, Any] = json.load(response)
    return answer


def pressure_line(label: str, report: cpb.PressureReport) -> str:
    state = cpb.PressureState.Name(report.state).removeprefix("PRESSURE_STATE_")
    method = cpb.MeasurementMethod.Name(report.breakdown.method).removeprefix("MEASUREMENT_METHOD_")
    return f"{label} pressure {report.measured_tokens}/{report.trigger_tokens} {state} ({method})"


def progress_line(progress: cpb.CompactionProgress) -> str:
    name = cpb.CompactionStep.Name(progress.step).removeprefix("COMPACTION_STEP_").lower()
    return f"    {name:9} seq={progress.seq} {progress.detail}".rstrip()


class Agent:
    """One scripted agent run against compactd: a session, its turns and steps, the totals."""

    def __init__(self, client: CompactdClient, script: dict[str, Any]) -> None:
        self.client = client
        self.script = script
        self.provider = os.environ["COMPACTD_PROVIDER"]
        self.model = os.environ["COMPACTD_MODEL"]
        self.base_url = os.environ["COMPACTD_AGENT_BASE_URL"]
        self.session_id = ""
        self.steps = self.compactions = self.prunes = 0

    def open_session(self) -> None:
        """Creates the session and logs the system prompt and the request header."""
        tools = [
            tool_declaration(t["name"], t["description"], t["input_schema"])
            for t in self.script["tools"]
        ]
        self.session_id = self.client.create_session().session_id
        print(f"session {self.session_id}: {self.script['source']}")
        header = request_header(self.provider, self.model, tools=tools)
        self.client.append_events(self.session_id, [system_message(self.script["system"]), header])

    def run_turn(self, turn: int, user_text: str) -> None:
        """Opens the turn, steps until the model stops calling tools, closes the turn."""
        self.client.append_events(self.session_id, [turn_start(turn), user_message(user_text)])
        step = 1
        while self.step(turn, step):
            step += 1
        self.client.append_events(self.session_id, [turn_end(turn, "completed")])

    def step(self, turn: int, step: int) -> bool:
        """One model call: prepare, send, log the reply and tool results. True if tools ran."""
        self.steps += 1
        request = self.prepare(turn, step)
        # compactd rebuilt the request; the converter makes it a chat-completions body.
        answer = complete(self.base_url, openai.request_body(request, stream=False))
        choice = answer["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        events = [step_start(turn, step), openai.assistant_event(answer, provider=self.provider)]
        for call in calls:  # the scripted tools: the recorded outputs
            output = self.script["tool_results"].get(call["id"], "(no output recorded)")
            name = call["function"]["name"]
            events.append(tool_result(call["id"], output, tool_name=name))
        events.append(step_end(turn, step))
        self.client.append_events(self.session_id, events)
        return bool(calls)

    def prepare(self, turn: int, step: int) -> session_service_pb2.BuildRequestResponse:
        """PrepareStep: prints pressure and what compactd did; returns the request to send."""
        updates: list[str] = []
        # The client holds the session's last request and sends its revision: compactd answers
        # only what this step added (or the full request after a compaction).
        prepared = self.client.prepare_step(
            self.session_id, turn, on_progress=lambda p: updates.append(progress_line(p))
        )
        result = prepared.result
        self.prunes += result.pruned_count
        self.compactions += len(result.compactions)
        line = pressure_line(f"turn {turn} step {step:2}", result.before)
        if result.pruned_count or result.compactions:
            line += f" -> {result.after.measured_tokens} after {result.pruned_count} pruned,"
            line += f" {len(result.compactions)} compacted"
        print(line, *updates, sep="\n")
        for outcome in result.compactions:
            print(f"    compaction {outcome.compaction_id}: {outcome.items_condensed} items"
                  f" condensed, ~{outcome.tokens_freed} tokens freed")  # fmt: skip
        for warning in result.warnings:
            print(f"    warning: {warning}")
        return prepared.request

    def report(self) -> None:
        """Prints the totals, the final pressure and the final surface."""
        final = self.client.check_pressure(self.session_id)
        surface = self.client.get_surface(self.session_id)
        print(f"\n{self.steps} steps, {self.compactions} compactions,"
              f" {self.prunes} tool results pruned")  # fmt: skip
        print(pressure_line("final", final))
        print(f"surface at revision {surface.revision}: {len(surface.nodes)} nodes")
        for node in surface.nodes:
            chars = sum(len(b.text.text) for b in node.message.content if b.HasField("text"))
            mark = f" checkpoint {node.compaction_id}" if node.compaction_id else ""
            print(f"  {node.position:3} seq {node.seq:4} {node.type:18} {chars:6} chars{mark}")
        log = [event_type(e) for e in self.client.list_events(self.session_id)]
        print(f"log: {len(log)} events, {log.count('compaction/start')} brackets")


def main() -> None:
    with open(os.environ["COMPACTD_EXAMPLE_SCRIPT"], encoding="utf-8") as f:
        script = json.load(f)
    with CompactdClient(os.environ["COMPACTD_ADDRESS"]) as client:
        agent = Agent(client, script)
        agent.open_session()
        for number, turn in enumerate(script["turns"], start=1):
            agent.run_turn(number, turn["user"])
        agent.report()


if __name__ == "__main__":
    main()
