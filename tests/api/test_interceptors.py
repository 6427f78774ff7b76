"""The interceptor chain over real servers: every handler shape traced, undecodable bytes and too
many streams answered with a precise status, and no traceback in the log."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from compactd import config
from compactd.api import interceptors
from compactd.api.server import RunningServer, create_server
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2 as ev
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import details

#: A string field (tag 1, length 2) holding bytes that are not UTF-8.
BAD_UTF8 = b"\x0a\x02\xff\xfe"
HEALTH = "/grpc.health.v1.Health/"


@pytest.fixture
async def traced(
    server_config: config.ServerConfig, provider: TracerProvider
) -> AsyncIterator[RunningServer]:
    running = await create_server(server_config, tracer_provider=provider)
    try:
        yield running
    finally:
        await running.stop(0)


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Log records carrying a traceback (an unexpected exception) or saying one was raised."""
    return [r for r in caplog.records if r.exc_info or r.exc_text or "Unexpected" in r.getMessage()]


# ---- health, as Kubernetes and client-side health checking call it ---------------------------


async def test_health_watch_streams_serving_then_not_serving_on_shutdown(
    traced: RunningServer, exporter: InMemorySpanExporter
) -> None:
    async with grpc.aio.insecure_channel(traced.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        first = await asyncio.wait_for(watch.read(), 10)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        await traced.health.enter_graceful_shutdown()
        second = await asyncio.wait_for(watch.read(), 10)
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    for _ in range(500):  # the server span ends once the handler saw the cancel
        spans = [s for s in exporter.get_finished_spans() if s.name.endswith("Watch")]
        if spans:
            break
        await asyncio.sleep(0.02)
    assert [s.name for s in spans] == [f"{HEALTH}Watch"]
    assert spans[0].status.status_code is not StatusCode.ERROR


async def test_each_call_of_a_method_is_traced_in_its_own_callers_trace(
    traced: RunningServer, exporter: InMemorySpanExporter
) -> None:
    # The traced handler is built once per method: no call may inherit another call's context.
    parents = [(0x0AF7651916CD43DD8448EB211C80319C + i, 0xB7AD6B7169203331 + i) for i in range(3)]
    async with grpc.aio.insecure_channel(traced.address) as channel:
        stub = SessionServiceStub(channel)
        await stub.CreateSession(pb.CreateSessionRequest(session_id="t"))
        request = pb.AppendEventsRequest(
            session_id="t", events=[ev.SessionEvent(user_message=ev.UserMessage(content=[]))]
        )
        for trace_id, parent_id in parents:
            metadata = (("traceparent", f"00-{trace_id:032x}-{parent_id:016x}-01"),)
            await stub.AppendEvents(request, metadata=metadata)
        await stub.AppendEvents(request)  # no caller's trace: a trace of its own
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    for _ in range(500):  # a server span ends just after its reply
        spans = [s for s in exporter.get_finished_spans() if s.name.endswith("AppendEvents")]
        if len(spans) == len(parents) + 1:
            break
        await asyncio.sleep(0.02)
    assert [s.name for s in spans] == ["/compactd.v1.SessionService/AppendEvents"] * 4
    assert [(s.context.trace_id, s.parent.span_id) for s in spans[:3] if s.parent] == parents
    assert spans[3].parent is None
    assert spans[3].context.trace_id not in {trace_id for trace_id, _ in parents}
    checks = [s for s in exporter.get_finished_spans() if s.name == f"{HEALTH}Check"]
    assert [s.attributes["rpc.method"] for s in checks if s.attributes] == ["Check"]


async def test_health_watch_of_an_unknown_service_says_service_unknown(
    server: RunningServer,
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="no.such.Service")
        )
        reply = await asyncio.wait_for(watch.read(), 10)
        watch.cancel()
    assert reply.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


async def test_a_kubernetes_grpc_probe_check_answers_serving(server: RunningServer) -> None:
    # kubelet's gRPC probe (and grpc_health_probe) send Check with the configured service name,
    # empty by default, over a fresh connection per probe.
    for service in ("", "compactd.v1.SessionService"):
        async with grpc.aio.insecure_channel(server.address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_health_list_answers_every_service_without_a_traceback(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest())
    assert {name: s.status for name, s in reply.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING,
        "compactd.v1.SessionService": health_pb2.HealthCheckResponse.SERVING,
        "compactd.v1.CompactionService": health_pb2.HealthCheckResponse.SERVING,
    }
    assert tracebacks(caplog) == []


async def test_client_side_health_checking_routes_calls_to_a_serving_server(
    server: RunningServer,
) -> None:
    # gRPC client-side health checking: the channel watches grpc.health.v1.Health/Watch for
    # each subchannel and sends calls only while it reports SERVING.
    service_config = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": "compactd.v1.SessionService"},
    }
    options = [("grpc.service_config", json.dumps(service_config))]
    async with grpc.aio.insecure_channel(server.address, options=options) as channel:
        reply = await SessionServiceStub(channel).CreateSession(
            pb.CreateSessionRequest(session_id="health-routed"), timeout=10
        )
    assert reply.session.session_id == "health-routed"


# ---- any handler shape -------------------------------------------------------------------------


async def _written(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    for part in (b"a", b"b"):
        await context.write(request + part)


async def _yielded(request: bytes, context: Any) -> AsyncIterator[bytes]:
    for part in (b"a", b"b"):
        yield request + part


async def _refused(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "later")


@pytest.mark.parametrize(
    ("behavior", "expected"),
    [
        (_written, [b"xa", b"xb"]),
        (_yielded, [b"xa", b"xb"]),
        (_refused, grpc.StatusCode.UNIMPLEMENTED),
    ],
    ids=["writes-through-the-context", "async-generator", "aborts"],
)
async def test_every_streaming_handler_shape_runs_under_the_chain(
    behavior: Any, expected: Any, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    server = grpc.aio.server(
        interceptors=interceptors.chain(provider, max_streams=8, max_streams_per_session=8)
    )
    handler = grpc.unary_stream_rpc_method_handler(behavior)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("test.Shapes", {"Stream": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/test.Shapes/Stream")(b"x")
            if isinstance(expected, grpc.StatusCode):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    [r async for r in call]
                assert caught.value.code() == expected
            else:
                assert [r async for r in call] == expected
    finally:
        await server.stop(0)
    assert [s.name for s in exporter.get_finished_spans()] == ["/test.Shapes/Stream"]


@pytest.mark.parametrize("method", ["RecoverFromError", "SwitchModel"])
async def test_compaction_streams_never_answer_unknown(server: RunningServer, method: str) -> None:
    request: Any = (
        cpb.RecoverFromErrorRequest(session_id="none")
        if method == "RecoverFromError"
        else cpb.SwitchModelRequest(
            session_id="none", destination=ev.Route(provider="p", model="m")
        )
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = getattr(CompactionServiceStub(channel), method)(request)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in call]
    assert caught.value.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


# ---- undecodable requests ------------------------------------------------------------------------


UNARY = [
    "/compactd.v1.SessionService/CreateSession",
    "/compactd.v1.SessionService/AppendEvents",
    "/compactd.v1.SessionService/GetSurface",
    "/compactd.v1.SessionService/BuildRequest",
    "/compactd.v1.CompactionService/CheckPressure",
    f"{HEALTH}Check",
]
STREAMING = [
    "/compactd.v1.SessionService/ListEvents",
    "/compactd.v1.CompactionService/WatchPressure",
    "/compactd.v1.CompactionService/PrepareStep",
    "/compactd.v1.CompactionService/Compact",
    "/compactd.v1.CompactionService/RecoverFromError",
    "/compactd.v1.CompactionService/SwitchModel",
    f"{HEALTH}Watch",
]


async def _raw_call(channel: grpc.aio.Channel, method: str, raw: bytes) -> list[bytes]:
    """Call ``method`` with ``raw`` request bytes (identity serializers); its raw replies."""
    if method in UNARY:
        return [await channel.unary_unary(method)(raw)]
    return [reply async for reply in channel.unary_stream(method)(raw)]


@pytest.mark.parametrize("method", UNARY + STREAMING)
async def test_undecodable_bytes_are_invalid_argument_without_a_traceback(
    server: RunningServer, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _raw_call(channel, method, BAD_UTF8)
    got = details(caught.value)
    assert (got.code, got.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "UNDECODABLE_REQUEST")
    assert "bad UTF-8" in got.message
    assert tracebacks(caplog) == []


async def test_an_undecodable_message_in_a_request_stream_is_invalid_argument(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = channel.stream_stream(method)()
        await call.write(good)
        first = reflection_pb2.ServerReflectionResponse.FromString(await call.read())
        assert first.list_services_response.service
        await call.write(b"\x1a\x02\xff\xfe")  # file_containing_symbol: not UTF-8
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
    assert details(caught.value).reason == "UNDECODABLE_REQUEST"
    assert tracebacks(caplog) == []
    async with grpc.aio.insecure_channel(server.address) as channel:  # reflection still works
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        again = stub.ServerReflectionInfo()
        await again.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        assert (await again.read()).list_services_response.service
        await again.done_writing()


# ---- stream limits -------------------------------------------------------------------------------


@pytest.fixture
async def limited(server_config: config.ServerConfig) -> AsyncIterator[RunningServer]:
    settings = dataclasses.replace(server_config, max_streams=3, max_streams_per_session=2)
    running = await create_server(settings)
    try:
        yield running
    finally:
        await running.stop(0)


async def _following(channel: grpc.aio.Channel, session_id: str) -> Any:
    """A ListEvents call following ``session_id``, once its first event arrived."""
    call = SessionServiceStub(channel).ListEvents(
        pb.ListEventsRequest(session_id=session_id, follow=True)
    )
    await asyncio.wait_for(call.read(), 10)
    return call


async def _refused_stream(channel: grpc.aio.Channel, session_id: str) -> dict[str, str]:
    call = SessionServiceStub(channel).ListEvents(
        pb.ListEventsRequest(session_id=session_id, follow=True)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(call.read(), 10)
    got = details(caught.value)
    assert (got.code, got.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS")
    return got.metadata


async def _session(channel: grpc.aio.Channel, session_id: str) -> None:
    stub = SessionServiceStub(channel)
    await stub.CreateSession(pb.CreateSessionRequest(session_id=session_id))
    user = ev.SessionEvent(user_message=ev.UserMessage(content=[]))
    await stub.AppendEvents(pb.AppendEventsRequest(session_id=session_id, events=[user]))


async def test_streams_per_session_are_limited_and_freed_when_one_ends(
    limited: RunningServer,
) -> None:
    async with grpc.aio.insecure_channel(limited.address) as channel:
        await _session(channel, "a")
        first, second = [await _following(channel, "a") for _ in range(2)]
        metadata = await _refused_stream(channel, "a")
        assert metadata == {"scope": "session", "limit": "2", "session_id": "a"}
        first.cancel()
        async with asyncio.timeout(10):
            while True:  # the cancelled stream's handler ends shortly after
                try:
                    third = await _following(channel, "a")
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
        for call in (second, third):
            call.cancel()


async def test_a_step_stream_counts_towards_its_session_only_while_it_runs(
    limited: RunningServer,
) -> None:
    async with grpc.aio.insecure_channel(limited.address) as channel:
        await _session(channel, "a")
        compaction = CompactionServiceStub(channel)

        async def step() -> Any:
            call = compaction.PrepareStep(cpb.PrepareStepRequest(session_id="a", turn=1))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            return details(caught.value)

        for _ in range(4):  # more than either limit: each step ends and frees its place
            assert (await step()).reason == "NO_OPEN_TURN"
        calls = [await _following(channel, "a") for _ in range(2)]
        refused = await step()
        assert refused.reason == "TOO_MANY_STREAMS"
        assert refused.metadata == {"scope": "session", "limit": "2", "session_id": "a"}
        for call in calls:
            call.cancel()


async def test_streams_per_process_are_limited(limited: RunningServer) -> None:
    async with grpc.aio.insecure_channel(limited.address) as channel:
        for name in ("a", "b"):
            await _session(channel, name)
        calls = [await _following(channel, name) for name in ("a", "a", "b")]
        metadata = await _refused_stream(channel, "b")
        assert metadata == {"scope": "process", "limit": "3"}
        health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(health.read(), 10)
        assert details(caught.value).reason == "TOO_MANY_STREAMS"
        reply = await SessionServiceStub(channel).GetSurface(pb.GetSurfaceRequest(session_id="a"))
        assert reply.revision == 1  # unary calls are never limited
        for call in calls:
            call.cancel()


# ---- composed resolution ----------------------------------------------------------------------


class _Counting(interceptors.Interceptor):
    """Counts the calls it resolves; wraps nothing."""

    def __init__(self, per_method: bool) -> None:
        self.resolves_per_method = per_method
        self.resolved = 0

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.resolved += 1
        return await continuation(details)


async def test_neighbours_that_resolve_per_method_are_resolved_once_per_handler_under_them() -> (
    None
):
    first, binding, inner, innermost = (_Counting(p) for p in (True, False, True, True))
    chain = interceptors.composed([first, binding, inner, innermost])
    assert chain[:2] == [first, binding]  # a lone one stays itself
    assert len(chain) == 3
    servicer = [grpc.unary_unary_rpc_method_handler(lambda request, context: None)]

    async def resolve(index: int, details: Any) -> Any:
        if index == len(chain):
            return servicer[0]
        return await chain[index].intercept_service(lambda d: resolve(index + 1, d), details)

    call = dataclasses.make_dataclass("Details", ["method"])("/compactd.v1.SessionService/X")
    handlers = [await resolve(0, call) for _ in range(3)]
    assert handlers == [servicer[0]] * 3
    assert (first.resolved, binding.resolved, inner.resolved, innermost.resolved) == (3, 3, 1, 1)
    servicer[0] = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
    assert await resolve(0, call) is servicer[0]  # a new handler under them: resolved afresh
    assert (inner.resolved, innermost.resolved) == (2, 2)


async def test_a_check_that_passes_lets_the_call_on_and_one_that_must_wait_is_awaited_first() -> (
    None
):
    seen: list[object] = []

    async def handler(request: str, context: Any) -> str:
        seen.append(request)
        return request.upper()

    async def wait() -> None:
        seen.append("waited")

    def check(request: str, context: Any) -> Any:
        return wait() if request == "slow" else None

    call = interceptors.checked(handler, check)
    assert [await call("fast", None), await call("slow", None)] == ["FAST", "SLOW"]
    assert seen == ["fast", "waited", "slow"]
    # A plain function's result is awaited only when it is awaitable, as before.
    doubled = interceptors.checked(lambda request, context: request * 2, check)
    assert await doubled("ab", None) == "abab"


async def test_checks_stacked_by_two_interceptors_run_outermost_first_in_one_layer() -> None:
    seen: list[str] = []

    async def handler(request: str, context: Any) -> str:
        seen.append("handler")
        return request

    async def refuse() -> None:
        seen.append("refused")
        raise PermissionError("refused")

    async def wait() -> None:
        seen.append("outer waited")

    def inner(request: str, context: Any) -> Any:
        seen.append("inner")
        return refuse() if request == "bad" else None

    def outer(request: str, context: Any) -> Any:
        seen.append("outer")
        return wait() if request == "slow" else None

    call = interceptors.checked(interceptors.checked(handler, inner), outer)
    assert await call("slow", None) == "slow"
    assert seen == ["outer", "outer waited", "inner", "handler"]
    seen.clear()
    with pytest.raises(PermissionError):
        await call("bad", None)
    assert seen == ["outer", "inner", "refused"]  # the handler never ran
    assert inspect.getclosurevars(call).nonlocals["awaited"] is handler  # no layer between


#: A method of the test's own, behind the chain: answers the trace and span ids its handler runs
#: in (16 + 8 bytes; zeros outside any trace).
TRACE_ECHO = "/test.v1.Echo/Trace"


def _trace_echo() -> grpc.GenericRpcHandler[Any, Any]:
    async def echo(request: bytes, context: Any) -> bytes:
        span = trace.get_current_span().get_span_context()
        return span.trace_id.to_bytes(16, "big") + span.span_id.to_bytes(8, "big")

    handler = grpc.unary_unary_rpc_method_handler(echo)
    return grpc.method_handlers_generic_handler("test.v1.Echo", {"Trace": handler})


async def test_without_an_exporter_a_call_still_runs_in_its_caller_s_trace(
    server_config: config.ServerConfig,
) -> None:
    running = await create_server(
        server_config, tracer_provider=trace.NoOpTracerProvider(), extra_handlers=[_trace_echo()]
    )
    trace_id, parent_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    traceparent = f"00-{trace_id:032x}-{parent_id:016x}-01"
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            echo = channel.unary_unary(TRACE_ECHO)
            joined = await echo(b"", metadata=(("traceparent", traceparent),))
            alone = await echo(b"")
            again = await echo(b"", metadata=(("traceparent", traceparent),))
    finally:
        await running.stop(0)
    assert joined == again == trace_id.to_bytes(16, "big") + parent_id.to_bytes(8, "big")
    assert alone == bytes(24)  # no caller's trace: none leaks in from an earlier call


def test_over_a_no_op_tracer_provider_the_chain_opens_no_server_spans() -> None:
    noop = interceptors.chain(trace.NoOpTracerProvider(), max_streams=1, max_streams_per_session=1)
    sdk = interceptors.chain(TracerProvider(), max_streams=1, max_streams_per_session=1)
    assert isinstance(_parts(noop)[0], interceptors.CallerContext)
    assert isinstance(_parts(sdk)[0], interceptors.Tracing)


def _parts(chain: list[interceptors.Interceptor]) -> list[interceptors.Interceptor]:
    (composed,) = chain
    assert isinstance(composed, interceptors.Composed)
    return composed.parts
