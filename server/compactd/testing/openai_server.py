"""``OpenAICompatServer``: a real OpenAI-compatible chat-completions server on loopback.

A first-class fake for tests, examples and benchmarks: it speaks ``POST /v1/chat/completions``
over real HTTP (streamed as server-sent events with a final usage chunk, or as one JSON body),
records every request byte for byte, and answers from a script of ``Reply`` values: text,
reasoning, tool calls, image output, provider-like HTTP errors, delays. Without a script it answers
with deterministic text derived from the request (a short eight-section summary for requests
marked ``X-Compactd-Purpose: compaction``, keeping the facts the quality gate probes), so an
agent loop runs unscripted.

Usage figures follow the 4-characters-per-token heuristic, and a simulated prefix cache reports
how much of each prompt (tools, then messages) repeats an earlier prompt of the same model, so
tests can see the summary request reuse the conversation's prefix.

Built on the standard library (``http.server.ThreadingHTTPServer`` in a background thread).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import json
import logging
import math
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from compactd.core.probes import ProbeKind, is_checkpoint, select_probes, span_facts
from compactd.core.prompts import (
    EMPTY_SECTION,
    SUMMARY_CLOSE_TAG,
    SUMMARY_OPEN_TAG,
    SUMMARY_SECTIONS,
)
from compactd.v1 import events_pb2, session_service_pb2

_log = logging.getLogger(__name__)

JSONObject = dict[str, Any]
_COMPLETIONS_PATHS = ("/v1/chat/completions", "/chat/completions")
_PURPOSE_HEADER = "x-compactd-purpose"
# A 1x1 transparent PNG, the body of scripted image output.
_PNG_1X1 = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
    )
).decode("ascii")


@dataclass(frozen=True)
class ScriptedToolCall:
    """A tool call the scripted model makes."""

    name: str
    arguments: str = "{}"
    id: str = ""


@dataclass(frozen=True)
class Reply:
    """One scripted answer.

    Attributes:
        text: Assistant text; None answers with the default text derived from the request.
        reasoning: Reasoning text, sent as ``reasoning_content`` before the text.
        tool_calls: Tool calls, sent after the text.
        image: Also return image output (``delta.images``), which summaries must refuse.
        finish_reason: Stop reason; default ``tool_calls`` when there are calls, else ``stop``.
        status: HTTP status; 400 and above answers ``error`` as a JSON body.
        error: The ``error`` object of an HTTP error body; ``{authorization}`` in its message is
            replaced by the request's ``Authorization`` header and ``{api_key}`` by its bearer
            token, as a provider echoing them would.
        body: An HTTP error's whole JSON body, sent as is instead of ``{"error": error}`` (for
            providers whose errors have another shape: see ``testing.provider_errors``).
        headers: Extra response headers (e.g. ``Retry-After``).
        delay_before: Seconds to wait before answering.
        delay_between: Seconds to wait between stream chunks.
        chunk_chars: Characters per streamed content chunk.
        usage: Replace the computed usage object.
        stream_error: An ``error`` object sent inside a 200 stream after the text.
        cut_stream: End the stream after the text, without stop reason or ``[DONE]``.
        echo_key: Append the request's bearer token to the text (a careless provider echoing
            the key in its answer).
    """

    text: str | None = None
    reasoning: str = ""
    tool_calls: tuple[ScriptedToolCall, ...] = ()
    image: bool = False
    finish_reason: str | None = None
    status: int = 200
    error: Mapping[str, Any] | None = None
    body: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    delay_before: float = 0.0
    delay_between: float = 0.0
    chunk_chars: int = 16
    usage: Mapping[str, Any] | None = None
    stream_error: Mapping[str, Any] | None = None
    cut_stream: bool = False
    echo_key: bool = False

    @classmethod
    def http_error(
        cls,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        **error_fields: Any,
    ) -> Reply:
        """An HTTP error with an OpenAI-style ``{"error": {...}}`` body."""
        error = {"message": message, "type": type, "param": None, "code": code, **error_fields}
        return cls(status=status, error=error, headers=dict(headers or {}))

    @classmethod
    def rate_limited(cls, retry_after: float = 0.0) -> Reply:
        """A 429 with ``Retry-After`` (seconds)."""
        return cls.http_error(
            429,
            "Rate limit reached for requests. Please try again later.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": f"{retry_after:g}"},
        )

    @classmethod
    def server_error(cls, status: int = 500) -> Reply:
        """A provider-side failure (5xx)."""
        return cls.http_error(
            status, "The server had an error while processing your request.", type="server_error"
        )

    @classmethod
    def context_length_exceeded(cls, window: int = 65536, requested: int = 70000) -> Reply:
        """A 400 worded like OpenAI/DeepSeek/vLLM when the prompt exceeds the window."""
        message = (
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{requested} tokens. Please reduce the length of the messages or completion."
        )
        return cls.http_error(400, message, code="context_length_exceeded")

    @classmethod
    def too_many_images(cls, limit: int, offload_images: int = 0) -> Reply:
        """A 413 refusing the request's image count (optionally stating how many to drop)."""
        fields: dict[str, Any] = {"offload_images": offload_images} if offload_images else {}
        return cls.http_error(
            413,
            f"Too many images: at most {limit} images per request.",
            code="too_many_images",
            **fields,
        )


@dataclass(frozen=True)
class RecordedRequest:
    """One request the server received."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes

    @property
    def json(self) -> JSONObject:
        """The parsed body (``{}`` when it is not a JSON object)."""
        try:
            value = json.loads(self.body)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def header(self, name: str) -> str | None:
        """A request header by case-insensitive name."""
        return self.headers.get(name.lower())


class OpenAICompatServer:
    """An OpenAI-compatible server on ``127.0.0.1`` (an ephemeral port).

    Use as a context manager, or call ``start()`` and ``stop()``. Thread-safe: the script and the
    recordings may be used from any thread while requests are served.
    """

    def __init__(
        self,
        *,
        usage_style: str = "openai",
        prefix_cache: bool = True,
        cache_block_chars: int = 4,
        responder: Callable[[RecordedRequest], Reply | None] | None = None,
    ) -> None:
        """Create a stopped server.

        Args:
            usage_style: ``openai`` (``prompt_tokens_details.cached_tokens``) or ``deepseek``
                (``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens``).
            prefix_cache: Report cache hits for prompt prefixes seen before.
            cache_block_chars: Cache granularity in characters of the serialized prompt.
            responder: Chooses the reply to a request when the script is empty (called from a
                handler thread); None from it, or no responder, answers with the default.
        """
        if usage_style not in ("openai", "deepseek"):
            raise ValueError(f"usage_style must be 'openai' or 'deepseek', not {usage_style!r}")
        self._usage_style = usage_style
        self._prefix_cache = prefix_cache
        self._cache_block = max(1, cache_block_chars)
        self._responder = responder
        self._lock = threading.Lock()
        self._received = threading.Condition(self._lock)
        self._script: collections.deque[Reply] = collections.deque()
        self._requests: list[RecordedRequest] = []
        self._prompts: collections.deque[tuple[str, str]] = collections.deque(maxlen=64)
        self._connections: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> OpenAICompatServer:
        """Bind ``127.0.0.1:0`` and serve in a background thread. Returns self."""
        if self._httpd is not None:
            raise RuntimeError("the server is already running")
        self._stopping.clear()
        httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        httpd.app = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="openai-compat-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, cut open connections (waking scripted delays) and join every thread."""
        httpd, thread = self._httpd, self._thread
        if httpd is None or thread is None:
            return
        self._stopping.set()
        httpd.shutdown()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            _shutdown_socket(connection)
        httpd.server_close()
        thread.join()
        self._httpd = self._thread = None

    def __enter__(self) -> OpenAICompatServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound port."""
        if self._httpd is None:
            raise RuntimeError("the server is not running")
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        """The endpoint root clients use, e.g. ``http://127.0.0.1:41234/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    # --- script and recordings ------------------------------------------------------------

    def enqueue(self, *replies: Reply) -> None:
        """Answer the next requests with ``replies``, in order, then fall back to the default."""
        with self._lock:
            self._script.extend(replies)

    @property
    def pending(self) -> int:
        """Scripted replies not used yet."""
        with self._lock:
            return len(self._script)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, oldest first (a copy)."""
        with self._lock:
            return list(self._requests)

    def wait_for_requests(self, count: int, timeout: float = 30.0) -> bool:
        """Block until ``count`` requests have arrived; False if ``timeout`` seconds pass first."""
        with self._received:
            return self._received.wait_for(lambda: len(self._requests) >= count, timeout)

    def clear(self) -> None:
        """Forget recorded requests, the script and the prefix cache."""
        with self._lock:
            self._requests.clear()
            self._script.clear()
            self._prompts.clear()

    # --- request handling (called from handler threads) -----------------------------------

    def _record(self, request: RecordedRequest) -> tuple[int, Reply]:
        with self._lock:
            self._requests.append(request)
            self._received.notify_all()
            scripted = self._script.popleft() if self._script else None
            number = len(self._requests)
        if scripted is None and self._responder is not None:
            scripted = self._responder(request)
        return number, scripted or Reply()

    def _cached_chars(self, model: str, prompt: str) -> int:
        """Characters of ``prompt`` that repeat an earlier prompt of ``model``; then remember it."""
        with self._lock:
            best = max(
                (_common_prefix(prompt, seen) for name, seen in self._prompts if name == model),
                default=0,
            )
            self._prompts.append((model, prompt))
        return best if self._prefix_cache else 0

    def _wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; False when the server is stopping."""
        return not (seconds > 0 and self._stopping.wait(seconds))

    def _track(self, connection: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def usage(self, body: Mapping[str, Any], reply_text: str, reasoning: str) -> JSONObject:
        """The usage object for a request and its answer (4 characters per token)."""
        prompt = _prompt_text(body)
        model = str(body.get("model", ""))
        cached_chars = self._cached_chars(model, prompt)
        prompt_tokens = _tokens(prompt)
        if cached_chars < len(prompt):
            cached_chars -= cached_chars % self._cache_block
        cached = prompt_tokens if cached_chars == len(prompt) else cached_chars // 4
        reasoning_tokens = _tokens(reasoning)
        completion = _tokens(reply_text) + reasoning_tokens
        usage: JSONObject = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        if self._usage_style == "deepseek":
            usage["prompt_cache_hit_tokens"] = cached
            usage["prompt_cache_miss_tokens"] = prompt_tokens - cached
        else:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage


def default_reply_text(body: Mapping[str, Any], *, compaction: bool) -> str:
    """The deterministic answer to an unscripted request.

    A compaction request (purpose header) gets a diligent summary in the eight sections: the facts
    the quality gate probes (``core.probes``: requests quoted, paths, commands, error strings, each
    clipped to 100 characters), the bullets of any prior checkpoint it folds, and the latest user
    message as the work in progress. Any other request gets one line naming what it received.
    """
    messages = [m for m in body.get("messages", []) if isinstance(m, Mapping)]
    users = [_message_text(m) for m in messages if m.get("role") == "user"]
    if compaction:
        # The final user message is the instruction, not part of the conversation.
        return _summary_of(messages[:-1], users[:-1])
    last_user = _clip(users[-1]) if users else "(no user message)"
    return f"Loopback reply to {len(messages)} messages; last user message: {last_user}"


def _summary_of(messages: Sequence[Mapping[str, Any]], users: Sequence[str]) -> str:
    requests = [text for text in users if not is_checkpoint(text)]
    sections: dict[str, list[str]] = {title: [] for title in SUMMARY_SECTIONS}
    for text in users:
        if is_checkpoint(text):
            _fold_prior(text, sections)
    if requests:
        sections[SUMMARY_SECTIONS[5]] = [_clip(requests[-1])]
    where = {
        ProbeKind.REQUEST: (SUMMARY_SECTIONS[0], '"{}"'),
        ProbeKind.COMMAND: (SUMMARY_SECTIONS[1], "Ran: {}"),
        ProbeKind.PATH: (SUMMARY_SECTIONS[2], "{}"),
        ProbeKind.ERROR: (SUMMARY_SECTIONS[3], "{}"),
    }
    for probe in select_probes(span_facts(_as_messages(messages))):
        title, form = where[probe.kind]
        line = form.format(_clip(probe.text, 100))
        if line not in sections[title]:
            sections[title].append(line)
    return "\n".join(
        f"## {title}\n" + "\n".join(f"- {line}" for line in lines or [EMPTY_SECTION])
        for title, lines in sections.items()
    )


def _fold_prior(checkpoint: str, sections: dict[str, list[str]]) -> None:
    """Merge a prior checkpoint's bullets into ``sections`` (what a model folding it keeps)."""
    inner = checkpoint.partition(SUMMARY_OPEN_TAG)[2].rpartition(SUMMARY_CLOSE_TAG)[0]
    title = ""
    for line in inner.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
        elif line.startswith("- ") and title in sections:
            bullet = line[2:].strip()
            if bullet != EMPTY_SECTION and bullet not in sections[title]:
                sections[title].append(bullet)


_ROLES = {
    "system": session_service_pb2.MESSAGE_ROLE_SYSTEM,
    "developer": session_service_pb2.MESSAGE_ROLE_DEVELOPER,
    "user": session_service_pb2.MESSAGE_ROLE_USER,
    "assistant": session_service_pb2.MESSAGE_ROLE_ASSISTANT,
    "tool": session_service_pb2.MESSAGE_ROLE_TOOL,
}


def _as_messages(messages: Sequence[Mapping[str, Any]]) -> list[session_service_pb2.Message]:
    """Chat-completions messages as compactd messages (text and tool calls), for the probes."""
    converted = []
    for message in messages:
        role = _ROLES.get(str(message.get("role")), session_service_pb2.MESSAGE_ROLE_USER)
        blocks = [events_pb2.ContentBlock(text=events_pb2.TextBlock(text=_message_text(message)))]
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, Mapping) else {}
            blocks.append(
                events_pb2.ContentBlock(
                    tool_call=events_pb2.ToolCallBlock(
                        id=str(call.get("id", "")),
                        name=str(function.get("name", "")),
                        arguments_json=str(function.get("arguments", "")),
                    )
                )
            )
        converted.append(
            session_service_pb2.Message(
                role=role,
                content=blocks,
                tool_call_id=str(message.get("tool_call_id", "")),
                name=str(message.get("name", "")),
            )
        )
    return converted


class _HTTPServer(ThreadingHTTPServer):
    app: OpenAICompatServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (timeout, cancellation) is normal for this server.
        _log.debug("loopback connection from %s ended with an error", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.server.app._track(self.connection, add=True)

    def finish(self) -> None:
        self.server.app._track(self.connection, add=False)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("loopback %s", format % args)

    def do_GET(self) -> None:
        self._send_json(404, {"error": {"message": f"no route for GET {self.path}"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path not in _COMPLETIONS_PATHS:
            self._send_json(404, {"error": {"message": f"no route for POST {self.path}"}})
            return
        headers = {name.lower(): value for name, value in self.headers.items()}
        app = self.server.app
        number, reply = app._record(RecordedRequest("POST", self.path, headers, raw))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._send_json(
                400,
                {
                    "error": {
                        "message": "the body is not a JSON object",
                        "type": "invalid_request_error",
                    }
                },
            )
            return
        try:
            self._answer(number, reply, body, headers)
        except OSError:
            # The client went away (its timeout, a cancellation) or the server is stopping.
            self.close_connection = True

    def _answer(
        self, number: int, reply: Reply, body: JSONObject, headers: Mapping[str, str]
    ) -> None:
        app = self.server.app
        if not app._wait(reply.delay_before):
            self.close_connection = True
            return
        if reply.status >= 400:
            fields = dict(reply.error or {})
            if isinstance(fields.get("message"), str):  # a careless provider echoes credentials
                authorization = headers.get("authorization", "")
                message = fields["message"].replace("{authorization}", authorization)
                fields["message"] = message.replace("{api_key}", _bearer(headers))
            error: Any = {"error": fields}
            self._send_json(reply.status, error, reply.headers, raw=reply.body)
            return
        compaction = headers.get(_PURPOSE_HEADER) == "compaction"
        answer = _Answer.build(number, reply, body, compaction)
        if reply.echo_key:
            answer = dataclasses.replace(
                answer, text=f"{answer.text}\n(sent with {_bearer(headers)})"
            )
        usage = (
            dict(reply.usage)
            if reply.usage is not None
            else app.usage(body, answer.text + answer.arguments, reply.reasoning)
        )
        if body.get("stream"):
            self._stream(answer, reply, body, usage)
        else:
            self._send_json(200, answer.response(usage), reply.headers)

    def _stream(self, answer: _Answer, reply: Reply, body: JSONObject, usage: JSONObject) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        for event in answer.events(include_usage, usage):
            self._write_chunk(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())
            if not self.server.app._wait(reply.delay_between):
                self.close_connection = True
                return
        if not reply.cut_stream and reply.stream_error is None:
            self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send_json(
        self,
        status: int,
        obj: Any,
        headers: Mapping[str, str] | None = None,
        *,
        raw: str | None = None,
    ) -> None:
        data = (raw if raw is not None else json.dumps(obj, ensure_ascii=False)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()


@dataclass(frozen=True)
class _Answer:
    """The content of one successful answer, rendered as stream events or one response."""

    id: str
    model: str
    text: str
    reasoning: str
    calls: tuple[ScriptedToolCall, ...]
    image: bool
    finish_reason: str
    chunk_chars: int
    stream_error: Mapping[str, Any] | None
    cut_stream: bool

    @property
    def arguments(self) -> str:
        return "".join(call.name + call.arguments for call in self.calls)

    @classmethod
    def build(cls, number: int, reply: Reply, body: JSONObject, compaction: bool) -> _Answer:
        text = (
            reply.text
            if reply.text is not None
            else default_reply_text(body, compaction=compaction)
        )
        calls = tuple(
            ScriptedToolCall(call.name, call.arguments, call.id or f"call_{number}_{index}")
            for index, call in enumerate(reply.tool_calls)
        )
        finish = reply.finish_reason or ("tool_calls" if calls else "stop")
        return cls(
            f"chatcmpl-loopback-{number}",
            str(body.get("model", "")),
            text,
            reply.reasoning,
            calls,
            reply.image,
            finish,
            max(1, reply.chunk_chars),
            reply.stream_error,
            reply.cut_stream,
        )

    def _chunk(self, delta: JSONObject, finish: str | None = None) -> JSONObject:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self.model,
            "choices": [choice],
        }

    def events(self, include_usage: bool, usage: JSONObject) -> Iterator[JSONObject]:
        """The stream's ``data`` objects, in order (without ``[DONE]``)."""
        yield self._chunk({"role": "assistant", "content": ""})
        for piece in _pieces(self.reasoning, self.chunk_chars):
            yield self._chunk({"reasoning_content": piece})
        for piece in _pieces(self.text, self.chunk_chars):
            yield self._chunk({"content": piece})
        if self.image:
            yield self._chunk({"images": [_image_part()]})
        yield from self._call_events()
        if self.stream_error is not None:
            yield {"error": dict(self.stream_error)}
            return
        if self.cut_stream:
            return
        yield self._chunk({}, self.finish_reason)
        if include_usage:
            yield {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": 0,
                "model": self.model,
                "choices": [],
                "usage": usage,
            }

    def _call_events(self) -> Iterator[JSONObject]:
        for index, call in enumerate(self.calls):
            head = {
                "index": index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            yield self._chunk({"tool_calls": [head]})
            for piece in _pieces(call.arguments, self.chunk_chars):
                yield self._chunk(
                    {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                )

    def response(self, usage: JSONObject) -> JSONObject:
        """The whole non-streamed ``chat.completion`` object."""
        message: JSONObject = {"role": "assistant", "content": self.text}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.calls
            ]
        if self.image:
            message["images"] = [_image_part()]
        choice = {"index": 0, "message": message, "finish_reason": self.finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": 0,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }


def _bearer(headers: Mapping[str, str]) -> str:
    """The bearer token of a request's ``Authorization`` header (empty without one)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else ""


def _image_part() -> JSONObject:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_PNG_1X1}"}}


def _pieces(text: str, size: int) -> Iterator[str]:
    for start in range(0, len(text), size):
        yield text[start : start + size]


def _prompt_text(body: Mapping[str, Any]) -> str:
    """What a provider would tokenize: tool declarations first, then the messages."""
    tools = json.dumps(body.get("tools", []), ensure_ascii=False, separators=(",", ":"))
    messages = json.dumps(body.get("messages", []), ensure_ascii=False, separators=(",", ":"))
    return tools + messages


def _tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-16-le")) / 2 / 4)


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix, by binary search over C-level slice comparisons."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return " ".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""


def _clip(text: str, limit: int = 120) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _shutdown_socket(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
