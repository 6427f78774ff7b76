"""A hostile client against a real server: every RPC of both services, health and reflection.

Requests come from the messages' own descriptors (every field, boundary integers, NaN and
infinities, unicode edge cases, deep JSON and Struct nesting), from a runtime that appends
plausible but wrong conversations, and as raw bytes that may not parse. Every answer must be a
precise status (never UNKNOWN or INTERNAL), no traceback may reach the log, a refused append
must leave the log as it was, and after a restart the log must fold to the surface and request
the live server showed. Bounded by example counts (about a minute in CI); ``FUZZ_SCALE=10``
multiplies them for a deeper run by hand.

The server runs on its own event loop thread; hypothesis drives it from the test's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory, struct_pb2, timestamp_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactd import config
from compactd.api.server import RunningServer, create_server
from compactd.v1 import compaction_service_pb2, session_service_pb2
from tests.builders import (
    SessionEvent,
    assistant,
    compaction_start,
    developer,
    end_seed,
    header,
    image_block,
    offload,
    replace,
    step_end,
    step_start,
    system,
    tool,
    tool_result,
    turn_end,
    turn_start,
    user,
)

T = TypeVar("T")
FD = pb_descriptor.FieldDescriptor
POOL = ("fz-0", "fz-1", "fz-2")
ROUTE = {"provider": "fz", "model": "w32k", "context_window": 32_000, "max_output_tokens": 1000}
POLICY = {"thresholdRatio": 0.5, "headroomTokens": 1000, "retainTokens": 800, "maxTokens": 600}
FORBIDDEN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
APPEND = "/compactd.v1.SessionService/AppendEvents"
DELETE = "/compactd.v1.SessionService/DeleteSession"
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))


# ---- the methods --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One RPC: its path, request type and shape."""

    path: str
    request: pb_descriptor.Descriptor
    server_streaming: bool
    client_streaming: bool


def _methods() -> list[Method]:
    files = (
        session_service_pb2.DESCRIPTOR,
        compaction_service_pb2.DESCRIPTOR,
        health_pb2.DESCRIPTOR,
        reflection_pb2.DESCRIPTOR,
    )
    methods = [
        Method(
            f"/{service.full_name}/{m.name}", m.input_type, m.server_streaming, m.client_streaming
        )
        for file in files
        for service in file.services_by_name.values()
        for m in service.methods
    ]
    # Reflection v1 is v1alpha's protocol under another name (``api.reflection_v1``).
    v1alpha = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].methods[0]
    v1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    return [*methods, Method(v1, v1alpha.input_type, True, True)]


METHODS = _methods()
BY_PATH = {m.path: m for m in METHODS}


# ---- values -------------------------------------------------------------------------------------

EDGE_STRINGS = [
    "",
    "\x00",
    "\ufeff",
    "\u202e\u2066abc",
    "e\u0301\u0301\u0301",
    "😀🏳️‍🌈",
    "\uffff\U0010ffff",
    "\u2028\u2029\r\n",
    "</compacted-summary>",
    "<compacted-summary>\n## Goals\n</compacted-summary>",
    "[" * 70 + "]" * 70,
    '{"a":' * 80 + "1" + "}" * 80,
    "[" * 5000,
    "sk-proj-FUZZ0123456789abcdef",
    "../../etc/passwd",
    "%s%n%x",
    "a" * 5000,
]
strings = st.one_of(
    st.sampled_from(EDGE_STRINGS),
    st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40),
)
session_ids = st.one_of(st.sampled_from(POOL), strings)
INT32 = [0, 1, -1, 2**31 - 1, -(2**31)]
INT64 = [0, 1, -1, 2**63 - 1, -(2**63), 2**53 + 1, 10**12, 10**12 + 1, 1000, 1001]
floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324]),
    st.floats(allow_nan=True, allow_infinity=True),
)
json_values = st.recursive(
    st.none() | st.booleans() | floats | strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
    max_leaves=8,
)


def _deep(depth: int) -> dict[str, Any]:
    value: Any = 1.0
    for _ in range(depth):
        value = {"k": value}
    return value  # type: ignore[no-any-return]


def structs() -> st.SearchStrategy[struct_pb2.Struct]:
    """Structs of JSON-like values (NaN and infinities included), some nested very deep."""

    def build(values: dict[str, Any]) -> struct_pb2.Struct:
        struct = struct_pb2.Struct()
        struct.update(values)
        return struct

    policies = st.fixed_dictionaries(
        {},
        optional={
            "thresholdRatio": floats,
            "headroomTokens": st.sampled_from(INT64).map(float) | floats,
            "retainRatio": floats,
            "retainTokens": floats,
            "maxTokens": floats,
            "compactionRetries": floats,
            "auto": st.booleans() | strings,
            "summarizationProvider": strings,
            "summarizationModel": strings,
            "modelPolicies": st.lists(
                st.fixed_dictionaries({"provider": strings, "model": strings}), max_size=2
            ),
            "unknownKey": json_values,
        },
    )
    deep = st.sampled_from([30, 49, 51, 120]).map(_deep)
    return st.one_of(policies, st.dictionaries(strings, json_values, max_size=4), deep).map(build)


def _scalar(field_descriptor: FD) -> st.SearchStrategy[Any]:
    kind = field_descriptor.type
    if field_descriptor.name == "session_id":
        return session_ids
    if kind in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return st.sampled_from(INT32) | st.integers(-(2**31), 2**31 - 1)
    if kind in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return st.sampled_from(INT64) | st.integers(-(2**63), 2**63 - 1)
    if kind in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if kind in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if kind in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return floats if kind == FD.TYPE_DOUBLE else st.floats(width=32)
    if kind == FD.TYPE_BOOL:
        return st.booleans()
    if kind == FD.TYPE_STRING:
        return strings
    if kind == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FD.TYPE_ENUM:
        return st.integers(-3, 20)  # unknown values too: proto3 enums are open
    raise AssertionError(f"no strategy for {field_descriptor.full_name}")


def messages(descriptor: pb_descriptor.Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Any message of ``descriptor``'s type: each field maybe set, from its own strategy."""
    if descriptor.full_name == "google.protobuf.Struct":
        return structs()
    if descriptor.full_name == "google.protobuf.Timestamp":
        return st.builds(
            timestamp_pb2.Timestamp,
            seconds=st.sampled_from(INT64) | st.integers(-(2**40), 2**40),
            nanos=st.sampled_from(INT32),
        )
    cls = message_factory.GetMessageClass(descriptor)
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for f in descriptor.fields:
        if f.type == FD.TYPE_MESSAGE:
            if depth >= 3 or f.message_type.GetOptions().map_entry:
                continue
            value = messages(f.message_type, depth + 1)
        else:
            value = _scalar(f)
        optional[f.name] = st.lists(value, max_size=3) if _repeated(f) else value
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: _build(cls, values))


def _repeated(f: FD) -> bool:
    return bool(f.is_repeated)


def _build(cls: type[Any], values: dict[str, Any]) -> Any:
    message = cls()
    for name, value in values.items():
        f = message.DESCRIPTOR.fields_by_name[name]
        if _repeated(f):
            target = getattr(message, name)
            if f.type == FD.TYPE_MESSAGE:
                for item in value:
                    target.add().CopyFrom(item)
            else:
                target.extend(value)
        elif f.type == FD.TYPE_MESSAGE:
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


# ---- a runtime that appends plausible but wrong conversations -----------------------------------

turns = st.sampled_from([1, 2, 3, 0, -1, 2**63 - 1])
steps = st.sampled_from([1, 2, 0, 2**63 - 1])
call_ids = st.sampled_from(["c0", "c1", "c2", ""])
seqs = st.integers(-2, 40) | st.sampled_from(INT64)


def _with_usage(event: SessionEvent, values: list[int]) -> SessionEvent:
    usage = event.assistant_message.usage
    for name, value in zip(
        ("input_tokens", "output_tokens", "cache_read_tokens"), values, strict=False
    ):
        setattr(usage, name, value)
    return event


def _header(provider: str, model: str, schema: str, output: int | None, temperature: float) -> Any:
    event = header(provider, model, tools=[tool("run", schema)])
    if output is not None:
        event.request_header.config.max_output_tokens = output
    event.request_header.config.temperature = temperature
    return event


runtime_events = st.one_of(
    st.builds(user, strings),
    st.builds(lambda t: user(t, blocks=[image_block("fz.png", path="/fz.png")]), strings),
    st.builds(turn_start, turns),
    st.builds(turn_end, turns),
    st.builds(step_start, turns, steps),
    st.builds(step_end, turns, steps),
    st.builds(
        lambda text, call, args: assistant(text, calls=[(call, "run", args)] if call else []),
        strings,
        call_ids,
        strings,
    ),
    st.builds(
        _with_usage, st.builds(assistant, strings), st.lists(st.sampled_from(INT64), max_size=3)
    ),
    st.builds(tool_result, call_ids, strings),
    st.builds(system, strings),
    st.builds(developer, strings),
    st.builds(
        _header,
        st.sampled_from(["fz", ""]) | strings,
        st.sampled_from(["w32k"]) | strings,
        st.sampled_from([*EDGE_STRINGS[10:13], "{}", '{"type":"object"}']),
        st.none() | st.sampled_from(INT64),
        floats,
    ),
    st.builds(
        lambda event, start, end, sources: replace(event, start, end, sources),
        st.one_of(st.builds(user, strings), st.builds(tool_result, call_ids, strings)),
        seqs,
        seqs,
        st.lists(seqs, max_size=4),
    ),
    st.sampled_from([compaction_start("fz-forged"), end_seed(), offload({0: [0]})]),
)


def _append_request(session_id: str, events: list[SessionEvent], expected: int | None) -> Any:
    request = session_service_pb2.AppendEventsRequest(session_id=session_id, events=events)
    if expected is not None:
        request.expected_last_seq = expected
    return request


runtime_appends = st.builds(
    _append_request,
    st.sampled_from(POOL),
    st.lists(runtime_events, min_size=1, max_size=6),
    st.none() | st.sampled_from([-1, 0, 5, 2**63 - 1]),
)


# ---- calls --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One fuzzed call: a method and the raw request bytes it sends (several when streaming in)."""

    method: Method
    requests: tuple[bytes, ...]
    append_to: str = ""  # the pool session an AppendEvents names, if any


def _typed(method: Method) -> st.SearchStrategy[Call]:
    strategy = messages(method.request)
    if method.path == APPEND:
        strategy = runtime_appends | strategy
    count = st.integers(1, 3) if method.client_streaming else st.just(1)

    def call(items: list[Any]) -> Call:
        named = getattr(items[0], "session_id", "") if method.path == APPEND else ""
        target = named if named in POOL else ""
        return Call(method, tuple(m.SerializeToString() for m in items), target)

    return count.flatmap(lambda n: st.lists(strategy, min_size=n, max_size=n)).map(call)


typed_calls = st.one_of([_typed(m) for m in METHODS])

#: Bytes that do not parse: invalid UTF-8 in field 1, a truncated varint, a bad wire type, a
#: length past the end, a group tag, and nesting past the parser's depth.
BROKEN = [
    b"\x0a\x02\xff\xfe",
    b"\x10\xff\xff\xff",
    b"\x0f",
    b"\x0a\x7f" + b"x" * 3,
    b"\x0b\x0c",
    b"\x12" + b"\x92\x01" * 120,
]
raw_calls = st.builds(
    lambda method, raw: Call(method, (raw,)),
    st.sampled_from(METHODS),
    st.sampled_from(BROKEN) | st.binary(max_size=80),
)


# ---- the server, on its own loop -----------------------------------------------------------------


class Background:
    """An event loop on a thread of its own; ``run`` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@dataclass
class Fuzzer:
    """A running server, a channel to it and what the calls saw."""

    settings: config.ServerConfig
    running: RunningServer | None = None
    channel: grpc.aio.Channel | None = None
    codes: dict[str, set[grpc.StatusCode]] = field(default_factory=dict)

    async def start(self, *, create_pool: bool) -> None:
        self.running = await create_server(self.settings)
        limit = self.settings.max_message_bytes  # a client must accept what reads may send
        self.channel = grpc.aio.insecure_channel(
            self.running.address, options=[("grpc.max_receive_message_length", limit)]
        )
        if create_pool:
            for session_id in POOL:
                await self._seed(session_id)

    async def stop(self) -> None:
        assert self.channel is not None
        assert self.running is not None
        await self.channel.close()
        await self.running.stop(0)

    async def _seed(self, session_id: str) -> None:
        policy = struct_pb2.Struct()
        policy.update(POLICY)
        create = session_service_pb2.CreateSessionRequest(
            session_id=session_id, compaction_policy=policy
        )
        await self._unary("/compactd.v1.SessionService/CreateSession", create.SerializeToString())
        events = [system("You are a careful agent."), header("fz", "w32k", tools=[tool("run")])]
        for i in range(6):
            turn = 100 + i
            events += [
                turn_start(turn),
                user(f"request {i}: " + "words " * 60),
                step_start(turn, 1),
                assistant(f"working on {i}", calls=[(f"call-{i}", "run", '{"cmd":"ls"}')]),
                step_end(turn, 1),
                tool_result(f"call-{i}", "output " * 80),
                turn_end(turn),
            ]
        request = session_service_pb2.AppendEventsRequest(session_id=session_id, events=events)
        await self._unary(APPEND, request.SerializeToString())

    async def _unary(self, path: str, raw: bytes) -> bytes:
        assert self.channel is not None
        reply: bytes = await self.channel.unary_unary(path)(raw, timeout=30)
        return reply

    async def revision(self, session_id: str) -> int:
        assert self.running is not None
        return (await self.running.manager.get(session_id)).revision

    async def check(self, call: Call) -> None:
        """Make the call; assert a precise status and, for an append, all or nothing."""
        before = await self.revision(call.append_to) if call.append_to else 0
        code, replies = await self._call(call)
        self.codes.setdefault(call.method.path, set()).add(code)
        assert code not in FORBIDDEN, f"{call.method.path} answered {code}"
        if call.append_to:
            after = await self.revision(call.append_to)
            if code == grpc.StatusCode.OK:
                reply = session_service_pb2.AppendEventsResponse.FromString(replies[0])
                assert after == reply.revision
                appended = list(reply.seqs) == list(range(before, after))
                replayed = after == before and all(seq < before for seq in reply.seqs)
                assert appended or replayed, "an append wrote other seqs than it answered"
            else:
                assert after == before, "a refused append changed the log"
        if call.method.path == DELETE and code == grpc.StatusCode.OK:
            await self._reseed_if_pooled(call.requests[0])

    async def _reseed_if_pooled(self, raw: bytes) -> None:
        """A deleted pool session is made again: the later calls and the restart need it."""
        deleted = session_service_pb2.DeleteSessionRequest.FromString(raw).session_id
        if deleted in POOL:
            await self._seed(deleted)

    async def _call(self, call: Call) -> tuple[grpc.StatusCode, list[bytes]]:
        assert self.channel is not None
        method = call.method
        try:
            if not method.server_streaming:
                return grpc.StatusCode.OK, [await self._unary(method.path, call.requests[0])]
            if method.client_streaming:
                stream: Any = self.channel.stream_stream(method.path)(iter(call.requests))
            else:
                stream = self.channel.unary_stream(method.path)(call.requests[0], timeout=60)
            return grpc.StatusCode.OK, await _read_some(stream)
        except grpc.aio.AioRpcError as error:
            return error.code(), []

    async def snapshot(self) -> dict[str, tuple[Any, ...]]:
        """What reads show of each pool session: surface nodes and the rebuilt request."""
        out = {}
        for session_id in POOL:
            get = session_service_pb2.GetSurfaceRequest(session_id=session_id)
            surface = session_service_pb2.GetSurfaceResponse.FromString(
                await self._unary("/compactd.v1.SessionService/GetSurface", get.SerializeToString())
            )
            build = session_service_pb2.BuildRequestRequest(session_id=session_id)
            request = session_service_pb2.BuildRequestResponse.FromString(
                await self._unary(
                    "/compactd.v1.SessionService/BuildRequest", build.SerializeToString()
                )
            )
            out[session_id] = (
                [n.SerializeToString(deterministic=True) for n in surface.nodes],
                [m.SerializeToString(deterministic=True) for m in request.messages],
                request.config.SerializeToString(deterministic=True),
                [t.SerializeToString(deterministic=True) for t in request.tools],
                request.header_seq,
            )
        return out


async def _read_some(stream: Any, most: int = 6) -> list[bytes]:
    """Up to ``most`` replies of a stream; a stream that goes quiet (a watch) is cancelled."""
    replies: list[bytes] = []
    try:
        for _ in range(most):
            reply = await asyncio.wait_for(stream.read(), timeout=1.0)
            if reply is grpc.aio.EOF:
                return replies
            replies.append(reply)
    except TimeoutError:
        pass
    stream.cancel()
    return replies


def _tracebacks(records: list[logging.LogRecord]) -> list[str]:
    return [
        r.getMessage()
        for r in records
        if r.exc_info
        or r.exc_text
        or "Traceback" in r.getMessage()
        or "Unexpected" in r.getMessage()
    ]


@pytest.fixture
def fuzz_config(tmp_path: Path) -> config.ServerConfig:
    base = config.load(
        None,
        environ={},
        overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{tmp_path / 'fuzz.db'}"},
    )
    return dataclasses.replace(
        base, routes=(ROUTE,), summarizer={"kind": "extractive"}, max_streams_per_session=8
    )


FUZZ = settings(
    max_examples=400,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    deadline=None,
)


def _fuzz(
    fuzz_config: config.ServerConfig,
    caplog: pytest.LogCaptureFixture,
    calls: st.SearchStrategy[Call],
    examples: int,
) -> Fuzzer:
    caplog.set_level(logging.WARNING)
    fuzzer = Fuzzer(fuzz_config)
    with Background() as loop:
        loop.run(fuzzer.start(create_pool=True))
        try:

            @settings(FUZZ, max_examples=int(examples * SCALE))
            @given(calls)
            def one(call: Call) -> None:
                loop.run(fuzzer.check(call))

            one()
            live = loop.run(fuzzer.snapshot())
        finally:
            loop.run(fuzzer.stop())
        restarted = Fuzzer(fuzz_config)
        loop.run(restarted.start(create_pool=False))
        try:
            assert loop.run(restarted.snapshot()) == live  # the log folds to the live state
        finally:
            loop.run(restarted.stop())
    assert _tracebacks(caplog.records) == []
    if SCALE != 1:
        print({path: sorted(code.name for code in codes) for path, codes in fuzzer.codes.items()})
    return fuzzer


def test_fuzzed_messages_over_every_rpc_answer_precise_statuses(
    fuzz_config: config.ServerConfig, caplog: pytest.LogCaptureFixture
) -> None:
    fuzzer = _fuzz(fuzz_config, caplog, typed_calls, examples=400)
    assert set(fuzzer.codes) == set(BY_PATH)  # every RPC was driven


def test_a_hostile_runtime_appending_conversations_never_breaks_the_log(
    fuzz_config: config.ServerConfig, caplog: pytest.LogCaptureFixture
) -> None:
    appends = _typed(BY_PATH[APPEND])
    fuzzer = _fuzz(fuzz_config, caplog, appends, examples=300)
    assert grpc.StatusCode.OK in fuzzer.codes[APPEND]
    assert grpc.StatusCode.INVALID_ARGUMENT in fuzzer.codes[APPEND]


def test_raw_bytes_over_every_rpc_answer_precise_statuses(
    fuzz_config: config.ServerConfig, caplog: pytest.LogCaptureFixture
) -> None:
    _fuzz(fuzz_config, caplog, raw_calls, examples=250)


def test_the_fuzzer_covers_every_rpc_of_every_service() -> None:
    services = {m.path.split("/")[1] for m in METHODS}
    assert services == {
        "compactd.v1.SessionService",
        "compactd.v1.CompactionService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
    compaction = compaction_service_pb2.DESCRIPTOR.services_by_name["CompactionService"]
    assert {m.name for m in compaction.methods} <= {p.split("/")[2] for p in BY_PATH}
