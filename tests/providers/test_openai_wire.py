"""The OpenAI wire format: encoding, canonical bytes, stream decoding."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from compactd.errors import InvalidArgument
from compactd.providers.openai_wire import (
    Completion,
    SSEDecoder,
    UnsupportedContent,
    dumps,
    encode_messages,
    encode_request,
    encode_tools,
    parse_usage,
    user_text_message,
)
from compactd.reasons import Reason
from compactd.testing.messages import (
    assistant,
    developer,
    image_block,
    system,
    tool,
    tool_result,
    user,
)
from compactd.v1 import events_pb2, session_service_pb2

# --- encoding --------------------------------------------------------------------------------


def test_each_role_encodes_to_its_chat_completions_shape() -> None:
    messages = [
        system("You are terse."),
        developer("Prefer pathlib."),
        user("List files"),
        assistant("Listing.", calls=[("call_1", "bash", '{"command": "ls"}')]),
        tool_result("call_1", "a.py\nb.py", name="bash"),
    ]

    assert encode_messages(messages) == [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": "Prefer pathlib."},
        {"role": "user", "content": "List files"},
        {
            "role": "assistant",
            "content": "Listing.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
    ]


def test_tool_call_arguments_are_sent_exactly_as_logged() -> None:
    odd = '{ "b":1,  "a" : "é\\u00e9" }'
    [encoded] = encode_messages([assistant(calls=[("c", "f", odd)])])

    assert encoded["tool_calls"][0]["function"]["arguments"] == odd
    assert encoded["content"] is None


def test_reasoning_is_not_sent_unless_the_route_wants_it() -> None:
    message = assistant("Answer.", reasoning="Because.")

    [plain] = encode_messages([message])
    [with_reasoning] = encode_messages([message], include_reasoning=True)

    assert "reasoning_content" not in plain
    assert with_reasoning["reasoning_content"] == "Because."
    assert with_reasoning["content"] == "Answer."


def test_developer_messages_can_use_the_system_role() -> None:
    [encoded] = encode_messages([developer("Be brief.")], developer_role="system")

    assert encoded == {"role": "system", "content": "Be brief."}


def test_inline_images_become_data_urls_in_typed_parts() -> None:
    [encoded] = encode_messages([user("What is this?", image_block(b"\x89PNG", "image/png"))])

    assert encoded["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw=="}},
    ]


def test_image_references_use_the_resolver_or_are_rejected() -> None:
    reference = events_pb2.ContentBlock(
        image=events_pb2.ImageBlock(attachment_id="att-7", media_type="image/jpeg")
    )
    message = user("see", reference)

    [encoded] = encode_messages(
        [message], resolve_image=lambda img: f"https://x/{img.attachment_id}"
    )
    assert encoded["content"][1]["image_url"]["url"] == "https://x/att-7"
    with pytest.raises(UnsupportedContent, match="att-7"):
        encode_messages([message])


def test_content_a_role_cannot_carry_is_rejected_with_unsupported_content() -> None:
    picture = image_block(b"x")
    bad_assistant = session_service_pb2.Message(
        role=session_service_pb2.MESSAGE_ROLE_ASSISTANT, content=[picture]
    )

    with pytest.raises(UnsupportedContent) as caught:
        encode_messages([bad_assistant])
    assert caught.value.reason == Reason.UNSUPPORTED_CONTENT


def test_tools_keep_their_schema_key_order() -> None:
    schema = '{"type":"object","properties":{"z":{"type":"string"},"a":{"type":"integer"}}}'

    [encoded] = encode_tools([tool("grep", schema, "Search files")])

    assert encoded == {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "Search files",
            "parameters": json.loads(schema),
        },
    }
    assert list(encoded["function"]["parameters"]["properties"]) == ["z", "a"]


def test_a_tool_schema_that_is_not_a_json_object_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="grep"):
        encode_tools([tool("grep", "[1, 2]")])


def test_request_carries_target_cap_sampling_stream_options_and_extra() -> None:
    extra = struct_pb2.Struct()
    extra.update({"seed": 7, "thinking": {"type": "disabled"}})
    config = events_pb2.RequestConfig(
        provider="deepseek", model="deepseek-chat", temperature=0.5, extra=extra
    )

    body = encode_request(
        [user_text_message("hi")],
        [],
        config,
        stream=True,
        max_tokens=128,
        extra={"metadata": {"purpose": "compaction"}},
    )

    assert body == {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 128,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": 7,
        "thinking": {"type": "disabled"},
        "metadata": {"purpose": "compaction"},
    }


def test_request_falls_back_to_the_configured_output_cap() -> None:
    config = events_pb2.RequestConfig(model="m", max_output_tokens=99)

    body = encode_request([], [], config, stream=False, max_tokens_field="max_completion_tokens")

    assert body["max_completion_tokens"] == 99
    assert "stream_options" not in body


def test_extra_fields_cannot_replace_model_or_messages() -> None:
    config = events_pb2.RequestConfig(model="m")

    with pytest.raises(InvalidArgument, match="messages"):
        encode_request([], [], config, stream=False, extra={"messages": []})


def test_dumps_is_compact_utf8_in_insertion_order() -> None:
    assert dumps({"b": "é", "a": [1, None]}) == '{"b":"é","a":[1,null]}'.encode()


_texts = st.text(max_size=40)
_messages = st.one_of(
    _texts.map(system),
    _texts.map(developer),
    _texts.map(user),
    st.builds(
        lambda text, name, args: assistant(text, calls=[("id-" + name, name, args)]),
        _texts,
        st.text(min_size=1, max_size=8),
        _texts,
    ),
    st.builds(lambda call_id, text: tool_result(call_id, text), st.text(max_size=8), _texts),
)


@given(st.lists(_messages, max_size=8), st.lists(_messages, max_size=8))
def test_encoding_a_prefix_gives_a_byte_identical_prefix(
    prefix: list[session_service_pb2.Message], rest: list[session_service_pb2.Message]
) -> None:
    whole = encode_messages(prefix + rest)
    head = encode_messages(prefix)

    assert whole[: len(head)] == head
    assert [dumps(m) for m in whole[: len(head)]] == [dumps(m) for m in head]
    if head:
        assert dumps(whole).startswith(dumps(head)[:-1])


# --- server-sent events ----------------------------------------------------------------------


def _decode(lines: list[str]) -> list[str]:
    decoder = SSEDecoder()
    events = [data for line in lines if (data := decoder.feed_line(line)) is not None]
    tail = decoder.end()
    return [*events, tail] if tail is not None else events


def test_sse_joins_data_lines_and_skips_comments_and_other_fields() -> None:
    lines = [": keep-alive", "event: message", 'data: {"a":', "data:1}", "", "data: [DONE]", ""]

    assert _decode(lines) == ['{"a":\n1}', "[DONE]"]


def test_sse_dispatches_a_final_event_without_a_blank_line() -> None:
    assert _decode(["data: last"]) == ["last"]


@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\r\n"), max_size=20)))
def test_sse_returns_each_payload_sent_as_one_data_line(payloads: list[str]) -> None:
    lines = [line for payload in payloads for line in (f"data: {payload}", "")]

    assert _decode(lines) == [p for p in payloads]


def _delta(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"delta": delta}]}


def test_stream_chunks_accumulate_text_reasoning_and_tool_calls() -> None:
    completion = Completion()
    first_call = {"index": 0, "id": "c", "function": {"name": "f", "arguments": '{"a'}}
    rest_of_call = {"index": 0, "function": {"arguments": '":1}'}}
    chunks: list[dict[str, Any]] = [
        {"model": "m", **_delta(role="assistant", content="")},
        _delta(reasoning_content="Think"),
        _delta(content="Hel"),
        _delta(content="lo"),
        _delta(tool_calls=[first_call]),
        _delta(tool_calls=[rest_of_call]),
        {"choices": [{"delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    ]
    for chunk in chunks:
        completion.add_chunk(chunk)

    assert completion.text == "Hello"
    assert completion.reasoning == "Think"
    assert completion.tool_calls == {0: {"id": "c", "name": "f", "arguments": '{"a":1}'}}
    assert completion.finish_reason == "stop"
    assert completion.usage == {"prompt_tokens": 3, "completion_tokens": 2}
    assert completion.model == "m"


def test_image_output_is_flagged_as_unsupported() -> None:
    completion = Completion()
    completion.add_chunk({"choices": [{"delta": {"images": [{"type": "image_url"}]}}]})
    completion.add_response({"choices": [{"message": {"content": [{"type": "output_image"}]}}]})

    assert completion.unsupported_output == ["images", "output_image"]


# --- usage -----------------------------------------------------------------------------------


def test_openai_usage_separates_cached_input() -> None:
    usage = parse_usage(
        {
            "prompt_tokens": 1000,
            "completion_tokens": 50,
            "prompt_tokens_details": {"cached_tokens": 800},
            "completion_tokens_details": {"reasoning_tokens": 20},
        }
    )

    assert usage == events_pb2.Usage(
        input_tokens=200, output_tokens=50, cache_read_tokens=800, reasoning_tokens=20
    )


def test_deepseek_usage_reads_cache_hit_and_miss() -> None:
    usage = parse_usage(
        {
            "prompt_tokens": 1000,
            "completion_tokens": 5,
            "prompt_cache_hit_tokens": 960,
            "prompt_cache_miss_tokens": 40,
        }
    )

    assert (usage.input_tokens, usage.cache_read_tokens, usage.output_tokens) == (40, 960, 5)
