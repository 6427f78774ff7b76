"""Anthropic messages ⇄ events: real transcripts round-trip, logs follow the step rules."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transcripts import conversations, step_rule_violations

from compactd_client import anthropic
from compactd_client.events import event_type
from compactd_client.v1 import events_pb2, session_service_pb2

ANTHROPIC = conversations("anthropic")


@pytest.mark.parametrize("record", ANTHROPIC, ids=[r["source"][-30:] for r in ANTHROPIC])
def test_importing_then_rendering_a_transcript_gives_its_messages(record: dict[str, Any]) -> None:
    events = anthropic.events_from_messages(record["messages"], model="claude")
    assert step_rule_violations(events) == []
    assert anthropic.messages_from_events(events) == {"messages": record["messages"]}


def test_the_transcripts_cover_thinking_tool_use_and_errors() -> None:
    blocks = [
        b
        for r in ANTHROPIC
        for m in r["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
    ]
    kinds = {b["type"] for b in blocks}
    assert {"text", "thinking", "tool_use", "tool_result"} <= kinds
    assert any(b.get("is_error") for b in blocks)
    assert all(b["signature"] for b in blocks if b["type"] == "thinking")


def test_tool_results_and_text_of_one_user_message_render_back_together() -> None:
    messages = [
        {"role": "user", "content": "Read it."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "text", "is_error": True},
                {"type": "text", "text": "Go on."},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Done."},
            ],
        },
    ]
    tools = [{"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}]
    events = anthropic.events_from_messages(messages, system="Be brief.", tools=tools, model="c")
    assert [event_type(e) for e in events] == [
        "system/message",
        "request/header",
        "turn/start",
        "user/message",
        "step/start",
        "assistant/message",
        "step/end",
        "tool/result",
        "turn/end",
        "turn/start",
        "user/message",
        "step/start",
        "assistant/message",
        "step/end",
        "turn/end",
    ]
    assert events[7].tool_result.is_error
    assert anthropic.tools(events[1].request_header.tools) == tools
    assert anthropic.messages_from_events(events) == {"system": "Be brief.", "messages": messages}


def test_a_system_message_between_a_call_and_its_result_renders_after_the_tool_result() -> None:
    """Anthropic requires the tool_result blocks first in the user message after a tool_use."""
    messages = [
        {"role": "user", "content": "Read it."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
    ]
    events = anthropic.events_from_messages(messages, close_turn=False)
    note = events_pb2.SessionEvent(system_message=events_pb2.SystemMessage(text="Be careful."))
    at = [event_type(e) for e in events].index("tool/result")
    events.insert(at, note)
    rendered = anthropic.messages_from_events(events)["messages"]
    assert rendered[-1] == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "x"},
            {"type": "text", "text": "Be careful."},
        ],
    }


def test_a_request_body_needs_max_tokens_and_carries_the_system_text() -> None:
    text = events_pb2.ContentBlock(text=events_pb2.TextBlock(text="hi"))
    request = session_service_pb2.BuildRequestResponse(
        messages=[
            session_service_pb2.Message(
                role=session_service_pb2.MESSAGE_ROLE_SYSTEM, content=[text]
            ),
            session_service_pb2.Message(role=session_service_pb2.MESSAGE_ROLE_USER, content=[text]),
        ],
        config=events_pb2.RequestConfig(model="claude"),
    )
    with pytest.raises(ValueError, match="max_tokens"):
        anthropic.request_body(request)
    assert anthropic.request_body(request, max_tokens=100) == {
        "model": "claude",
        "max_tokens": 100,
        "system": "hi",
        "messages": [{"role": "user", "content": "hi"}],
    }


def test_a_reply_becomes_an_assistant_event_with_its_usage() -> None:
    reply = {
        "model": "claude-x",
        "stop_reason": "end_turn",
        "content": [{"type": "text", "text": "ok"}],
        "usage": {
            "input_tokens": 10,
            "output_tokens": 2,
            "cache_read_input_tokens": 90,
            "cache_creation_input_tokens": 5,
        },
    }
    message = anthropic.assistant_event(reply).assistant_message
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_tokens, usage.cache_write_tokens) == (10, 90, 5)
    assert (message.provider, message.model, message.stop_reason) == (
        "anthropic",
        "claude-x",
        "end_turn",
    )


def test_unknown_blocks_are_named() -> None:
    document = {"role": "user", "content": [{"type": "document", "source": {}}]}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: block type 'document'"):
        anthropic.events_from_messages([document])


_text = st.text(min_size=1, max_size=30)


@st.composite
def _conversation(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    pending: list[str] = []
    for number in range(draw(st.integers(0, 6))):
        results = [
            {"type": "tool_result", "tool_use_id": i, "content": draw(_text)} for i in pending
        ]
        extra: list[dict[str, Any]] = []
        if draw(st.booleans()) or not results:
            extra = [{"type": "text", "text": draw(_text)}]
            if draw(st.booleans()):
                data = base64.b64encode(draw(st.binary(min_size=1, max_size=9))).decode()
                extra.append(
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": data},
                    }
                )
        content = results + extra
        messages.append(
            {
                "role": "user",
                "content": content[0]["text"]
                if len(content) == 1 and content[0]["type"] == "text"
                else content,
            }
        )
        ids = [f"t{number}-{k}" for k in range(draw(st.integers(0, 2)))]
        blocks: list[dict[str, Any]] = []
        if draw(st.booleans()):
            blocks.append({"type": "thinking", "thinking": draw(_text), "signature": "s"})
        blocks.append({"type": "text", "text": draw(_text)})
        blocks += [
            {
                "type": "tool_use",
                "id": i,
                "name": "f",
                "input": json.loads(
                    json.dumps(draw(st.dictionaries(_text, st.integers(), max_size=2)))
                ),
            }
            for i in ids
        ]
        messages.append({"role": "assistant", "content": blocks})
        pending = ids
    return messages


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_conversation())
def test_any_conversation_round_trips_into_a_valid_log(messages: list[dict[str, Any]]) -> None:
    events = anthropic.events_from_messages(messages)
    assert step_rule_violations(events) == []
    assert anthropic.messages_from_events(events) == {"messages": messages}


def test_pins_join_the_system_text_and_are_dropped_on_import() -> None:
    from test_openai import _pinned_request

    body = anthropic.request_body(_pinned_request(), max_tokens=64)
    assert body["system"].startswith("be brief\n\n<pinned-state>")
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    events = anthropic.events_from_messages(body["messages"], system=body["system"])
    assert events[0].system_message.text == "be brief"
    only_pins = anthropic.events_from_messages(
        body["messages"], system=body["system"].split("\n\n", 1)[1]
    )
    assert not any(e.HasField("system_message") for e in only_pins)
