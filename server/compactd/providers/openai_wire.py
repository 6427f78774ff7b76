"""The OpenAI chat-completions wire format: encoding and stream decoding.

Pure functions, no I/O (provider errors are classified by ``providers.errors``). Everything that
builds or reads an OpenAI-compatible request goes through this module: the runtime's
conversation requests and compactd's summary requests are encoded by the same functions and
serialized by the same ``dumps``, so a summary request's ``messages`` are a byte-identical prefix
of the conversation's (plus the final instruction) and the provider's warm prefix cache is
reused. Works for OpenAI, DeepSeek, vLLM, llama.cpp server and other compatible
endpoints; route-specific differences are keyword flags, never guesses.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from compactd.errors import InvalidArgument
from compactd.reasons import Reason
from compactd.v1 import events_pb2, session_service_pb2

JSONObject = dict[str, Any]
Message = session_service_pb2.Message
ImageResolver = Callable[[events_pb2.ImageBlock], str | None]

_ROLE_NAMES = {
    session_service_pb2.MESSAGE_ROLE_SYSTEM: "system",
    session_service_pb2.MESSAGE_ROLE_DEVELOPER: "developer",
    session_service_pb2.MESSAGE_ROLE_USER: "user",
    session_service_pb2.MESSAGE_ROLE_ASSISTANT: "assistant",
    session_service_pb2.MESSAGE_ROLE_TOOL: "tool",
}
# Several text blocks of a string-only message are joined with a blank line.
_TEXT_JOIN = "\n\n"
_RESERVED_REQUEST_KEYS = frozenset({"model", "messages", "stream"})


class UnsupportedContent(InvalidArgument):
    """A message holds content the OpenAI wire format cannot carry for its role."""

    reason = Reason.UNSUPPORTED_CONTENT


# --- encoding -------------------------------------------------------------------------------


def dumps(obj: Any) -> bytes:
    """The one canonical JSON serialization of every request body.

    Compact separators, keys in insertion order (our encoders build them in a fixed order;
    sorting would reorder tool schemas the model reads), UTF-8 without ASCII escaping, NaN refused.
    """
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


def encode_messages(
    messages: Sequence[Message],
    *,
    include_reasoning: bool = False,
    developer_role: str = "developer",
    resolve_image: ImageResolver | None = None,
) -> list[JSONObject]:
    """Encode projected messages as chat-completions ``messages``, one dict per message.

    Each message encodes independently of its neighbours, so encoding a prefix gives a prefix.

    Args:
        messages: Projected ``compactd.v1.Message``s in order.
        include_reasoning: Send assistant reasoning back as ``reasoning_content`` (only for
            routes that want it, e.g. DeepSeek thinking with tool calls).
        developer_role: Wire role for developer messages (``system`` for routes without one).
        resolve_image: Turns an image without inline data into a URL the provider can fetch;
            None means such images are rejected.

    Raises:
        UnsupportedContent: A block the role cannot carry on this wire (an image in a system or
            assistant message, an unresolvable image reference, ...).
    """
    options = _EncodeOptions(include_reasoning, developer_role, resolve_image)
    return [_encode_message(message, options) for message in messages]


def user_text_message(text: str) -> JSONObject:
    """A plain user message, e.g. the compaction instruction appended after a replayed prefix."""
    return {"role": "user", "content": text}


def encode_tools(tools: Sequence[events_pb2.ToolDeclaration]) -> list[JSONObject]:
    """Encode tool declarations as chat-completions function tools, in order.

    Raises:
        InvalidArgument: A declaration's ``input_schema_json`` is not a JSON object.
    """
    return [_encode_tool(tool) for tool in tools]


def encode_request(
    messages: Sequence[JSONObject],
    tools: Sequence[JSONObject],
    config: events_pb2.RequestConfig,
    *,
    stream: bool,
    max_tokens: int | None = None,
    extra: Mapping[str, Any] | None = None,
    max_tokens_field: str = "max_tokens",
) -> JSONObject:
    """Assemble a chat-completions request body from already-encoded messages and tools.

    Args:
        messages: Output of ``encode_messages`` (plus any trailing message).
        tools: Output of ``encode_tools``; empty omits the ``tools`` key.
        config: Target model and sampling; ``config.extra`` entries are copied into the body.
        stream: Stream the reply as server-sent events, with a final usage chunk.
        max_tokens: Output cap; None falls back to ``config.max_output_tokens`` when set.
        extra: Further body fields (e.g. ``metadata``), applied last.
        max_tokens_field: Body key of the output cap (``max_completion_tokens`` for some routes).

    Raises:
        InvalidArgument: ``extra`` or ``config.extra`` tries to set model, messages or stream.
    """
    body: JSONObject = {"model": config.model, "messages": list(messages)}
    if tools:
        body["tools"] = list(tools)
    cap = max_tokens
    if cap is None and config.HasField("max_output_tokens"):
        cap = config.max_output_tokens
    if cap is not None:
        body[max_tokens_field] = cap
    if config.HasField("temperature"):
        body["temperature"] = config.temperature
    if config.HasField("top_p"):
        body["top_p"] = config.top_p
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    _merge_extra(body, struct_to_dict(config.extra) if config.HasField("extra") else {})
    _merge_extra(body, extra or {})
    return body


def struct_to_dict(struct: Any) -> JSONObject:
    """A ``google.protobuf.Struct`` as plain JSON, whole numbers as ints (Struct holds doubles)."""
    value = json_format.MessageToDict(struct)
    converted = _integral_floats_to_int(value)
    assert isinstance(converted, dict)
    return converted


@dataclass(frozen=True)
class _EncodeOptions:
    include_reasoning: bool
    developer_role: str
    resolve_image: ImageResolver | None


def _encode_message(message: Message, options: _EncodeOptions) -> JSONObject:
    role = _ROLE_NAMES.get(message.role)
    if role is None:
        raise InvalidArgument(f"message role {message.role} has no wire role")
    if role in ("system", "developer"):
        wire_role = options.developer_role if role == "developer" else role
        return {"role": wire_role, "content": _text_only(message, role)}
    if role == "user":
        return {"role": "user", "content": _user_content(message, options)}
    if role == "assistant":
        return _encode_assistant(message, options)
    return {
        "role": "tool",
        "tool_call_id": message.tool_call_id,
        "content": _user_content(message, options, allow_empty=True),
    }


def _text_only(message: Message, role: str) -> str:
    texts = []
    for block in message.content:
        if not block.HasField("text"):
            raise UnsupportedContent(f"a {role} message can carry only text, not {_kind(block)}")
        texts.append(block.text.text)
    return _TEXT_JOIN.join(texts)


def _user_content(
    message: Message, options: _EncodeOptions, *, allow_empty: bool = False
) -> str | list[JSONObject]:
    """A string when the message is text only, otherwise typed parts in block order."""
    blocks = list(message.content)
    if all(block.HasField("text") for block in blocks) and (blocks or allow_empty):
        return _TEXT_JOIN.join(block.text.text for block in blocks)
    parts: list[JSONObject] = []
    for block in blocks:
        if block.HasField("text"):
            parts.append({"type": "text", "text": block.text.text})
        elif block.HasField("image"):
            url = _image_url(block.image, options.resolve_image)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise UnsupportedContent(f"a user or tool message cannot carry {_kind(block)}")
    return parts


def _encode_assistant(message: Message, options: _EncodeOptions) -> JSONObject:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[JSONObject] = []
    for block in message.content:
        if block.HasField("text"):
            texts.append(block.text.text)
        elif block.HasField("reasoning"):
            reasoning.append(block.reasoning.text)
        elif block.HasField("tool_call"):
            call = block.tool_call
            function = {"name": call.name, "arguments": call.arguments_json}
            calls.append({"id": call.id, "type": "function", "function": function})
        else:
            raise UnsupportedContent(f"an assistant message cannot carry {_kind(block)}")
    content: str | None = _TEXT_JOIN.join(texts) if texts else (None if calls else "")
    encoded: JSONObject = {"role": "assistant", "content": content}
    if options.include_reasoning and reasoning:
        encoded["reasoning_content"] = _TEXT_JOIN.join(reasoning)
    if calls:
        encoded["tool_calls"] = calls
    return encoded


def _image_url(image: events_pb2.ImageBlock, resolve: ImageResolver | None) -> str:
    if image.data:
        if not image.media_type:
            raise UnsupportedContent(f"inline image {image.name or '?'!r} has no media type")
        encoded = base64.b64encode(image.data).decode("ascii")
        return f"data:{image.media_type};base64,{encoded}"
    url = resolve(image) if resolve is not None else None
    if not url:
        ref = image.attachment_id or image.path or image.name or "?"
        raise UnsupportedContent(f"image {ref!r} has no inline data and no resolvable reference")
    return url


def _encode_tool(tool: events_pb2.ToolDeclaration) -> JSONObject:
    schema: Any = {"type": "object", "properties": {}}
    if tool.input_schema_json:
        try:
            schema = json.loads(tool.input_schema_json)
        except ValueError as exc:
            raise InvalidArgument(f"tool {tool.name!r}: input schema is not JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise InvalidArgument(f"tool {tool.name!r}: input schema must be a JSON object")
    function: JSONObject = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = schema
    return {"type": "function", "function": function}


def _merge_extra(body: JSONObject, extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if key in _RESERVED_REQUEST_KEYS:
            raise InvalidArgument(f"request extra may not set {key!r}")
        body[key] = value


def _integral_floats_to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _integral_floats_to_int(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_floats_to_int(item) for item in value]
    return value


def _kind(block: events_pb2.ContentBlock) -> str:
    return block.WhichOneof("block") or "an empty block"


# --- server-sent events ---------------------------------------------------------------------

SSE_DONE = "[DONE]"


class SSEDecoder:
    """Decodes a server-sent event stream, one line at a time, into ``data`` payloads.

    Lines are given without their terminator. An event is dispatched at a blank line; several
    ``data`` lines of one event are joined with ``\\n``; comments and other fields are ignored.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, line: str) -> str | None:
        """Consume one line; returns an event's data when the line completes one."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def end(self) -> str | None:
        """At end of stream: the pending event's data, for servers that omit the last blank line."""
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


@dataclass
class Completion:
    """What one chat completion returned, accumulated from stream chunks or a whole response.

    Attributes:
        text: Concatenated text content.
        reasoning: Concatenated reasoning content (never part of a summary).
        tool_calls: Tool calls by stream index: ``{"id", "name", "arguments"}``.
        unsupported_output: Output kinds the wire carried that text cannot hold (e.g. ``images``).
        usage: The raw usage object, when reported.
        finish_reason: The last stop reason reported.
        model: The model the provider reported.
        id: The completion's id (``chatcmpl-...``), when the provider sends one.
        error: An error object sent inside a 200 stream, if any.
    """

    text: str = ""
    reasoning: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    unsupported_output: list[str] = field(default_factory=list)
    usage: JSONObject | None = None
    finish_reason: str = ""
    model: str = ""
    id: str = ""
    error: JSONObject | None = None
    _text_parts: list[str] = field(default_factory=list, repr=False)
    _reasoning_parts: list[str] = field(default_factory=list, repr=False)

    def add_chunk(self, chunk: Mapping[str, Any]) -> None:
        """Fold one ``chat.completion.chunk`` (or an error object) into the completion."""
        self._add_envelope(chunk)
        for choice in _choices(chunk):
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                self._add_part(delta)
            self._add_finish(choice)
        self._sync()

    def add_response(self, response: Mapping[str, Any]) -> None:
        """Fold a whole non-streamed ``chat.completion`` response."""
        self._add_envelope(response)
        for choice in _choices(response):
            message = choice.get("message")
            if isinstance(message, Mapping):
                self._add_part(message)
            self._add_finish(choice)
        self._sync()

    def _add_envelope(self, obj: Mapping[str, Any]) -> None:
        if isinstance(obj.get("model"), str) and obj["model"]:
            self.model = obj["model"]
        if isinstance(obj.get("id"), str) and obj["id"]:
            self.id = obj["id"]
        if isinstance(obj.get("usage"), Mapping):
            self.usage = dict(obj["usage"])
        error = obj.get("error")
        if error:
            self.error = dict(error) if isinstance(error, Mapping) else {"message": str(error)}

    def _add_part(self, part: Mapping[str, Any]) -> None:
        content = part.get("content")
        if isinstance(content, str):
            self._text_parts.append(content)
        elif isinstance(content, list):
            self._add_content_parts(content)
        for key in ("reasoning_content", "reasoning"):
            if isinstance(part.get(key), str):
                self._reasoning_parts.append(part[key])
        for key in ("images", "image", "audio"):
            if part.get(key):
                self._mark_unsupported(key)
        calls = part.get("tool_calls")
        if isinstance(calls, list):
            for position, call in enumerate(calls):
                if isinstance(call, Mapping):
                    self._add_tool_call(position, call)

    def _add_content_parts(self, parts: list[Any]) -> None:
        for part in parts:
            if not isinstance(part, Mapping):
                continue
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                self._text_parts.append(part["text"])
            else:
                self._mark_unsupported(str(part.get("type", "unknown")))

    def _add_tool_call(self, position: int, call: Mapping[str, Any]) -> None:
        index = call.get("index", position)
        slot = self.tool_calls.setdefault(int(index), {"id": "", "name": "", "arguments": ""})
        if call.get("id"):
            slot["id"] = str(call["id"])
        function = call.get("function")
        if isinstance(function, Mapping):
            if function.get("name"):
                slot["name"] += str(function["name"])
            if isinstance(function.get("arguments"), str):
                slot["arguments"] += function["arguments"]

    def _add_finish(self, choice: Mapping[str, Any]) -> None:
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self.finish_reason = reason

    def _mark_unsupported(self, kind: str) -> None:
        if kind not in self.unsupported_output:
            self.unsupported_output.append(kind)

    def _sync(self) -> None:
        self.text = "".join(self._text_parts)
        self.reasoning = "".join(self._reasoning_parts)


def _choices(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return []
    # One completion per request: only the first choice counts.
    return [choice for choice in choices[:1] if isinstance(choice, Mapping)]


def parse_usage(usage: Mapping[str, Any]) -> events_pb2.Usage:
    """Map a chat-completions usage object to ``compactd.v1.Usage``.

    ``input_tokens`` counts uncached input only: OpenAI's ``prompt_tokens`` includes
    ``prompt_tokens_details.cached_tokens`` (reported as cache reads); DeepSeek reports
    ``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens`` directly.
    """
    prompt = _int(usage.get("prompt_tokens"))
    details = _mapping(usage.get("prompt_tokens_details"))
    cache_read = _int(details.get("cached_tokens"))
    cache_write = _int(details.get("cache_write_tokens"))
    if "prompt_cache_hit_tokens" in usage:
        cache_read = _int(usage.get("prompt_cache_hit_tokens"))
    if "prompt_cache_miss_tokens" in usage:
        uncached = _int(usage.get("prompt_cache_miss_tokens"))
    else:
        uncached = max(0, prompt - cache_read - cache_write)
    completion_details = _mapping(usage.get("completion_tokens_details"))
    return events_pb2.Usage(
        input_tokens=uncached,
        output_tokens=_int(usage.get("completion_tokens")),
        cache_read_tokens=cache_read,
        cache_write_tokens=cache_write,
        reasoning_tokens=_int(completion_details.get("reasoning_tokens")),
    )


def add_usage(
    total: events_pb2.Usage | None, more: events_pb2.Usage | None
) -> events_pb2.Usage | None:
    """The field-wise sum of two usages; None only when both are None."""
    if total is None or more is None:
        return more if total is None else total
    return events_pb2.Usage(
        input_tokens=total.input_tokens + more.input_tokens,
        output_tokens=total.output_tokens + more.output_tokens,
        cache_read_tokens=total.cache_read_tokens + more.cache_read_tokens,
        cache_write_tokens=total.cache_write_tokens + more.cache_write_tokens,
        reasoning_tokens=total.reasoning_tokens + more.reasoning_tokens,
    )


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
