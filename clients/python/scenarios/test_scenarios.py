"""The cross-language scenario list, run by the Python client against a running compactd.

Every client (Python, TypeScript, Go) runs the same list against the one server that
``clients/run-scenarios`` starts: create (idempotent), append, rebuild request, pressure check, a
watch receiving updates, a compaction with its streamed steps, a busy error with its reason, a
SEQ_CONFLICT, held steps across a compaction, a held step of a session another client created
again, the recall tool answered. The server comes from
``COMPACTD_ADDRESS``; the routed model from ``COMPACTD_PROVIDER`` / ``COMPACTD_MODEL`` (a route
with a declared window).
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import Iterator

import grpc
import pytest

from compactd_client import (
    AlreadyExistsError,
    AsyncCompactdClient,
    CompactdClient,
    CompactionBusyError,
    SeqConflictError,
)
from compactd_client.events import (
    assistant_message,
    event_type,
    request_header,
    step_end,
    step_start,
    system_message,
    tool_call_block,
    tool_result,
    turn_end,
    turn_start,
    user_message,
)
from compactd_client.v1 import compaction_service_pb2 as cpb
from compactd_client.v1 import events_pb2
from compactd_client.v1 import session_service_pb2 as spb

ADDRESS = os.environ.get("COMPACTD_ADDRESS", "")
PROVIDER = os.environ.get("COMPACTD_PROVIDER", "loopback")
MODEL = os.environ.get("COMPACTD_MODEL", "agent-12k")

pytestmark = pytest.mark.skipif(not ADDRESS, reason="COMPACTD_ADDRESS is not set")

_BRACKET = [
    cpb.COMPACTION_STEP_START,
    cpb.COMPACTION_STEP_SUMMARIZE,
    cpb.COMPACTION_STEP_SUMMARY,
    cpb.COMPACTION_STEP_REPLACE,
    cpb.COMPACTION_STEP_END,
]


@pytest.fixture
def client() -> Iterator[CompactdClient]:
    with CompactdClient(ADDRESS, timeout=30) as c:
        yield c


def new_session(client: CompactdClient) -> str:
    session_id = f"py-{uuid.uuid4().hex[:12]}"
    assert client.create_session(session_id).session_id == session_id
    return session_id


def seed(client: CompactdClient, session_id: str, turns: int = 3) -> int:
    """Appends a system prompt, a header and ``turns`` closed turns with large tool output;
    returns the revision."""
    events = [system_message("You are a careful coding agent."), request_header(PROVIDER, MODEL)]
    for turn in range(1, turns + 1):
        call_id = f"call-{turn}"
        listing = "\n".join(f"src/module_{turn}_{i}.py: def handler_{i}(): ..." for i in range(90))
        events += [
            turn_start(turn),
            user_message(f"Turn {turn}: find where the handlers are defined."),
            step_start(turn, 1),
            assistant_message(tool_calls=[tool_call_block(call_id, "grep", {"pattern": "def "})]),
            step_end(turn, 1),
            tool_result(call_id, listing, tool_name="grep"),
            step_start(turn, 2),
            assistant_message(f"Turn {turn}: the handlers live in src/module_{turn}_*.py."),
            step_end(turn, 2),
            turn_end(turn),
        ]
    return client.append_events(session_id, events).revision


def test_create(client: CompactdClient) -> None:
    session_id = new_session(client)
    assert client.create_session(session_id).session_id == session_id  # a retry: idempotent
    with pytest.raises(AlreadyExistsError) as caught:
        client.create_session(session_id, compaction_policy={"thresholdRatio": 0.5})
    assert caught.value.code == grpc.StatusCode.ALREADY_EXISTS
    chosen = client.create_session()
    assert chosen.session_id
    assert chosen.revision == 0


def test_append(client: CompactdClient) -> None:
    session_id = new_session(client)
    response = client.append_events(
        session_id,
        [system_message("Be terse."), turn_start(1), user_message("hello")],
        expected_last_seq=-1,
    )
    assert list(response.seqs) == [0, 1, 2]
    assert response.revision == 3
    types = [event_type(e) for e in client.list_events(session_id)]
    assert types == ["system/message", "turn/start", "user/message"]


def test_rebuild_request(client: CompactdClient) -> None:
    session_id = new_session(client)
    revision = seed(client, session_id, turns=1)
    request = client.build_request(session_id)
    assert request.revision == revision
    assert [m.role for m in request.messages] == [
        spb.MESSAGE_ROLE_SYSTEM,
        spb.MESSAGE_ROLE_USER,
        spb.MESSAGE_ROLE_ASSISTANT,
        spb.MESSAGE_ROLE_TOOL,
        spb.MESSAGE_ROLE_ASSISTANT,
    ]
    assert (request.config.provider, request.config.model) == (PROVIDER, MODEL)
    assert request.header_seq == 1
    assert request.messages[3].tool_call_id == "call-1"


def test_pressure_check(client: CompactdClient) -> None:
    session_id = new_session(client)
    revision = seed(client, session_id, turns=1)
    report = client.check_pressure(session_id)
    assert report.revision == revision
    assert (report.route.provider, report.route.model) == (PROVIDER, MODEL)
    assert report.context_window > 0
    assert 0 < report.measured_tokens < report.trigger_tokens
    assert report.state == cpb.PRESSURE_STATE_BELOW


async def test_watch(client: CompactdClient) -> None:
    session_id = new_session(client)
    revision = seed(client, session_id, turns=1)
    async with (
        AsyncCompactdClient(ADDRESS) as aclient,
        asyncio.timeout(60),
        aclient.watch_pressure(session_id) as watch,
    ):
        first = await anext(watch)
        assert first.revision == revision
        await aclient.append_events(session_id, [turn_start(2), user_message("more")])
        async for report in watch:
            if report.revision >= revision + 2:
                break
        assert report.revision == revision + 2
        assert report.measured_tokens > first.measured_tokens


def test_compaction_streams_its_steps(client: CompactdClient) -> None:
    session_id = new_session(client)
    seed(client, session_id, turns=3)
    stream = client.compact(session_id, focus="keep the file names")
    steps = [p.step for p in stream]
    result = stream.result()
    bracket = [s for s in steps if s in _BRACKET]
    assert bracket == _BRACKET, steps
    outcome = result.outcome
    assert outcome.compaction_id
    assert outcome.items_condensed > 0
    surface = client.get_surface(session_id)
    checkpoints = [n for n in surface.nodes if n.compaction_id == outcome.compaction_id]
    assert [n.seq for n in checkpoints] == [outcome.checkpoint_seq]
    assert checkpoints[0].type == "user/message"
    types = [event_type(e) for e in client.list_events(session_id)]
    assert types.count("compaction/start") == types.count("compaction/end") == 1


def test_recall_tool(client: CompactdClient) -> None:
    session_id = f"py-{uuid.uuid4().hex[:12]}"
    client.create_session(session_id, compaction_policy={"recallTool": True})
    seed(client, session_id, turns=3)
    client.compact(session_id).result()
    request = client.build_request(session_id)
    assert request.tools[-1].name == "recall"
    texts = "\n".join(b.text.text for m in request.messages for b in m.content)
    handle = re.search(r"\[recall:(c\d+-[0-9a-f]{4})\]", texts)
    assert handle is not None, "the checkpoint names its recall handle"
    call = tool_call_block("r1", "recall", {"handle": handle.group(1)})
    step = [turn_start(9), user_message("What did turn 1 find, exactly?"), step_start(9, 1)]
    client.append_events(session_id, [*step, assistant_message(tool_calls=[call]), step_end(9, 1)])

    result = client.answer_recall(session_id, call)
    client.append_events(session_id, [result, turn_end(9)])

    answered = result.tool_result
    assert (answered.tool_call_id, answered.is_error) == ("r1", False)
    assert "src/module_1_0.py" in answered.content[0].text.text
    last = client.build_request(session_id).messages[-1]
    assert (last.tool_call_id, last.content[0].text.text) == ("r1", answered.content[0].text.text)
    unknown = client.answer_recall(
        session_id, {"id": "r2", "name": "recall", "input": {"handle": "c1-0000"}}
    )
    assert unknown.tool_result.is_error


def test_busy_error_carries_its_reason(client: CompactdClient) -> None:
    session_id = new_session(client)
    seed(client, session_id, turns=2)
    client.append_events(session_id, [turn_start(3), user_message("still working")])
    with pytest.raises(CompactionBusyError) as caught:
        client.compact(session_id).result()
    assert caught.value.code == grpc.StatusCode.ABORTED
    assert caught.value.reason == "COMPACTION_BUSY"


def test_seq_conflict(client: CompactdClient) -> None:
    session_id = new_session(client)
    revision = seed(client, session_id, turns=1)
    with pytest.raises(SeqConflictError) as caught:
        client.append_events(session_id, [user_message("stale")], expected_last_seq=revision - 2)
    assert caught.value.code == grpc.StatusCode.ABORTED
    assert caught.value.reason == "SEQ_CONFLICT"
    after = client.append_events(session_id, [turn_start(9)], expected_last_seq=revision - 1)
    assert list(after.seqs) == [revision]


def work_step(turn: int, step: int) -> list[events_pb2.SessionEvent]:
    """What one step of an open turn logs (~390 tokens): a reply calling a tool, its result."""
    call_id = f"fix-{step}"
    output = "\n".join(f"src/module_{step}_{i}.py: fixed handler_{i}" for i in range(40))
    return [
        step_start(turn, step),
        assistant_message(
            f"Fixing batch {step}.", tool_calls=[tool_call_block(call_id, "edit", {"batch": step})]
        ),
        step_end(turn, step),
        tool_result(call_id, output, tool_name="edit"),
    ]


def test_held_steps_across_a_compaction(client: CompactdClient) -> None:
    """The default step holds the request: every step's is BuildRequest's, while the server
    answers only the messages each step added, except the step that compacts. Even steps
    stream (a progress callback, as the examples step), odd ones are one unary call: both
    extend the same held request."""
    session_id = new_session(client)
    seed(client, session_id, turns=8)  # ~8,000 tokens: five steps below the trigger (9,830)
    client.append_events(session_id, [turn_start(9), user_message("Now fix every handler.")])
    answers: list[cpb.PrepareStepResult] = []
    for step in range(1, 10):
        seen: list[cpb.CompactionProgress] = []
        prepared = client.prepare_step(
            session_id, 9, on_progress=seen.append if step % 2 == 0 else None
        )
        built = client.build_request(session_id)
        assert prepared.request == built, f"step {step}"
        assert list(prepared.progress) == seen
        answers.append(prepared.result)
        if prepared.result.request_unchanged:
            assert list(prepared.result.appended_messages) == list(built.messages[-2:])
        client.append_events(session_id, work_step(9, step))
    compacted = [i for i, a in enumerate(answers) if a.compactions]
    assert compacted, "no step compacted"
    assert 1 < compacted[0] < len(answers) - 1
    full = [i for i, a in enumerate(answers) if not a.request_unchanged]
    assert full == [0, *compacted]  # the first step held nothing; a compaction rewrites


def test_a_held_step_of_a_session_created_again_answers_the_new_request(
    client: CompactdClient,
) -> None:
    """Another client deletes the session and creates it again under the same id, its log past
    the held revision: the step answers the new session's full request, never the held one
    extended with the new session's messages (the held incarnation tells them apart)."""
    session_id = new_session(client)
    seed(client, session_id, turns=1)
    client.append_events(session_id, [turn_start(2), user_message("Fix the first handler.")])
    held = client.prepare_step(session_id, 2).request.revision
    with CompactdClient(ADDRESS, timeout=30) as other:
        other.delete_session(session_id)
        other.create_session(session_id)
        seed(other, session_id, turns=2)
        other.append_events(session_id, [turn_start(3), user_message("Fix the second handler.")])
        assert other.build_request(session_id).revision > held
    prepared = client.prepare_step(session_id, 3)
    assert not prepared.result.request_unchanged
    assert prepared.request == client.build_request(session_id)
