"""The event builders produce complete, typed events with the spec's type strings."""

from __future__ import annotations

import json

import pytest

from compactd_client.events import (
    assistant_message,
    event_type,
    request_header,
    tool_call_block,
    tool_declaration,
    tool_result,
    turn_start,
    user_message,
)
from compactd_client.v1 import events_pb2


def test_every_event_body_has_a_type_string() -> None:
    body = events_pb2.SessionEvent.DESCRIPTOR.oneofs_by_name["body"]
    for field in body.fields:
        event = events_pb2.SessionEvent()
        getattr(event, field.name).SetInParent()
        assert "/" in event_type(event)


def test_an_event_without_body_has_no_type() -> None:
    with pytest.raises(ValueError, match="no body"):
        event_type(events_pb2.SessionEvent())


def test_assistant_blocks_are_reasoning_then_text_then_calls() -> None:
    usage = events_pb2.Usage(input_tokens=10, output_tokens=3)
    event = assistant_message(
        "Looking.",
        reasoning="I should list files.",
        tool_calls=[tool_call_block("c1", "ls", {"path": "."})],
        usage=usage,
        event_id="a-1",
    )
    kinds = [b.WhichOneof("block") for b in event.assistant_message.content]
    assert kinds == ["reasoning", "text", "tool_call"]
    assert json.loads(event.assistant_message.content[2].tool_call.arguments_json) == {"path": "."}
    assert event.assistant_message.usage.input_tokens == 10
    assert (event.event_id, event.seq) == ("a-1", 0)


def test_text_content_becomes_one_text_block() -> None:
    assert [b.text.text for b in user_message("hi").user_message.content] == ["hi"]
    result = tool_result("c1", "out", tool_name="ls", is_error=True).tool_result
    assert (result.tool_call_id, result.tool_name, result.is_error) == ("c1", "ls", True)


def test_request_header_sets_optional_settings_only_when_given() -> None:
    bare = request_header("loopback", "m").request_header
    assert not bare.config.HasField("max_output_tokens")
    assert bare.reason == events_pb2.HEADER_REASON_INITIAL
    tools = [tool_declaration("ls", "List files.", {"type": "object"})]
    full = request_header("loopback", "m", tools=tools, max_output_tokens=512).request_header
    assert full.config.max_output_tokens == 512
    assert json.loads(full.tools[0].input_schema_json) == {"type": "object"}
    assert event_type(turn_start(1)) == "turn/start"


def test_pins_and_subagents_have_typed_builders() -> None:
    from compactd_client.events import clear_pin, event_type, pin, subagent_end, subagent_start
    from compactd_client.v1 import events_pb2 as pb

    assert pin("goal", "ship", event_id="p1") == pb.SessionEvent(
        event_id="p1", state_pin=pb.StatePin(key="goal", text="ship")
    )
    assert clear_pin("goal").state_pin == pb.StatePin(key="goal", clear=True)
    start = subagent_start("child", tool_call_id="c1", task="find it")
    assert start.subagent_start == pb.SubagentStart(
        child_session_id="child", tool_call_id="c1", task="find it"
    )
    end = subagent_end("child", "found", status=pb.SUBAGENT_STATUS_FAILED)
    assert (end.subagent_end.status, end.subagent_end.result) == (
        pb.SUBAGENT_STATUS_FAILED,
        "found",
    )
    assert [event_type(e) for e in (pin("g", "t"), start, end)] == [
        "state/pin",
        "subagent/start",
        "subagent/end",
    ]
