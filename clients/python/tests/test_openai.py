"""OpenAI chat messages ⇄ events: real transcripts round-trip, logs follow the step rules."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transcripts import conversations, step_rule_violations

from compactd_client import openai
from compactd_client.events import event_type
from compactd_client.v1 import events_pb2, session_service_pb2

OPENAI = conversations("openai")


@pytest.mark.parametrize("record", OPENAI, ids=[r["source"][-40:] for r in OPENAI])
def test_importing_then_rendering_a_transcript_gives_its_messages(record: dict[str, Any]) -> None:
    events = openai.events_from_messages(record["messages"], provider="p", model="m")
    assert step_rule_violations(events) == []
    assert openai.messages_from_events(events) == record["messages"]


def test_the_transcripts_cover_tool_calls_images_and_empty_content() -> None:
    messages = [m for r in OPENAI for m in r["messages"]]
    assert sum(len(m.get("tool_calls") or []) for m in messages) > 50
    assert any(
        m["role"] == "assistant" and m["content"] == "" and m.get("tool_calls") for m in messages
    )
    assert any(isinstance(m["content"], list) for m in messages)  # the image_url message


def test_turns_and_steps_bracket_each_reply() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List files."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "assistant", "content": "One file."},
        {"role": "user", "content": "Thanks."},
    ]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    events = openai.events_from_messages(messages, tools=tools, provider="openai", model="gpt-4o")
    assert [event_type(e) for e in events] == [
        "system/message",
        "request/header",
        "turn/start",
        "user/message",
        "step/start",
        "assistant/message",
        "step/end",
        "tool/result",
        "step/start",
        "assistant/message",
        "step/end",
        "turn/end",
        "turn/start",
        "user/message",
        "turn/end",
    ]
    assert events[7].tool_result.tool_name == "ls"
    assert openai.tools(events[1].request_header.tools) == tools
    assert openai.messages_from_events(events) == messages
    open_ended = openai.events_from_messages(messages, close_turn=False, first_turn=7)
    assert event_type(open_ended[-1]) == "user/message"
    assert open_ended[1].turn_start.turn == 7


def test_reasoning_goes_back_only_when_asked() -> None:
    reply = {"role": "assistant", "content": "4", "reasoning_content": "2+2"}
    events = openai.events_from_messages([{"role": "user", "content": "2+2?"}, reply])
    assert openai.messages_from_events(events, include_reasoning=True)[1] == reply
    assert "reasoning_content" not in openai.messages_from_events(events)[1]


def test_a_request_body_carries_config_tools_and_messages() -> None:
    request = session_service_pb2.BuildRequestResponse(
        messages=[
            session_service_pb2.Message(
                role=session_service_pb2.MESSAGE_ROLE_USER,
                content=[events_pb2.ContentBlock(text=events_pb2.TextBlock(text="hi"))],
            )
        ],
        config=events_pb2.RequestConfig(model="gpt-4o", max_output_tokens=256, temperature=0.5),
        tools=[events_pb2.ToolDeclaration(name="ls", input_schema_json='{"type":"object"}')],
    )
    assert openai.request_body(request, stream=False) == {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
        ],
        "max_tokens": 256,
        "temperature": 0.5,
        "stream": False,
    }


def test_a_completion_becomes_an_assistant_event_with_its_usage() -> None:
    completion = {
        "model": "gpt-4o-2024-08-06",
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c9",
                            "type": "function",
                            "function": {"name": "ls", "arguments": '{"p":1}'},
                        }
                    ],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
    }
    message = openai.assistant_event(completion, provider="openai").assistant_message
    assert (message.model, message.stop_reason, message.provider) == (
        "gpt-4o-2024-08-06",
        "tool_calls",
        "openai",
    )
    assert (message.usage.input_tokens, message.usage.cache_read_tokens) == (36, 64)
    assert message.content[0].tool_call.arguments_json == '{"p":1}'


def test_unknown_roles_and_parts_are_named() -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]: role 'function'"):
        openai.events_from_messages([{"role": "function", "content": "x"}])
    audio = {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: part type 'input_audio'"):
        openai.events_from_messages([audio])


# ---- property: any conversation in the mapped shape round-trips into a valid log ---------------

_text = st.text(max_size=30)
_ids = st.text("abcdef0123456789", min_size=1, max_size=8)


@st.composite
def _conversation(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_text)})
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["user", "image", "assistant", "calls", "developer"]))
        if kind == "user":
            messages.append({"role": "user", "content": draw(_text)})
        elif kind == "image":
            data = base64.b64encode(draw(st.binary(min_size=1, max_size=20))).decode()
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": draw(_text)},
                        {
                            "type": "image_url",
                            "image_url": {"url": f"data:image/png;base64,{data}"},
                        },
                    ],
                }
            )
        elif kind == "developer":
            messages.append({"role": "developer", "content": draw(_text)})
        elif kind == "assistant":
            messages.append({"role": "assistant", "content": draw(_text)})
        else:
            ids = draw(st.lists(_ids, min_size=1, max_size=3, unique=True))
            args = json.dumps(draw(st.dictionaries(_text, st.integers(), max_size=2)))
            messages.append(
                {
                    "role": "assistant",
                    "content": draw(st.sampled_from([None, "", "ok"])),
                    "tool_calls": [
                        {"id": i, "type": "function", "function": {"name": "f", "arguments": args}}
                        for i in ids
                    ],
                }
            )
            messages += [{"role": "tool", "tool_call_id": i, "content": draw(_text)} for i in ids]
    return messages


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_conversation())
def test_any_conversation_round_trips_into_a_valid_log(messages: list[dict[str, Any]]) -> None:
    events = openai.events_from_messages(messages, provider="p", model="m")
    assert step_rule_violations(events) == []
    assert openai.messages_from_events(events) == messages


def _pinned_request() -> session_service_pb2.BuildRequestResponse:
    def text(role: int, value: str, *, pinned: bool = False) -> session_service_pb2.Message:
        block = events_pb2.ContentBlock(text=events_pb2.TextBlock(text=value))
        return session_service_pb2.Message(role=role, content=[block], pinned_state=pinned)

    pins = "<pinned-state>\nkept\n\n[goal]\nship it\n</pinned-state>"
    return session_service_pb2.BuildRequestResponse(
        messages=[
            text(session_service_pb2.MESSAGE_ROLE_SYSTEM, "be brief"),
            text(session_service_pb2.MESSAGE_ROLE_SYSTEM, pins, pinned=True),
            text(session_service_pb2.MESSAGE_ROLE_USER, "hi"),
        ],
        config=events_pb2.RequestConfig(model="gpt-4o"),
        pins=[events_pb2.StatePin(key="goal", text="ship it")],
    )


def test_pins_render_after_the_head_and_never_come_back_as_conversation_messages() -> None:
    body = openai.request_body(_pinned_request())
    assert [m["role"] for m in body["messages"]] == ["system", "system", "user"]
    assert body["messages"][1]["content"].startswith("<pinned-state>")
    events = openai.events_from_messages(body["messages"])
    assert [m["content"] for m in openai.messages_from_events(events)] == ["be brief", "hi"]
    assert not any(e.HasField("state_pin") for e in events)
