"""Traced production debugging: the spans of a compaction, joined to the caller's trace, exported.

The span tree is read from an in-memory exporter given to ``create_server``; the export tests
let the server build its provider from the ``OTEL_*`` variables and receive the spans in local
collectors over real OTLP/gRPC and OTLP/HTTP.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai
from opentelemetry.trace import SpanContext, SpanKind, StatusCode

from compactd import telemetry
from compactd.api.server import create_server
from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import compaction_service_pb2_grpc
from tests.builders import turn_start
from tests.compaction_fixtures import (
    MODEL,
    PROVIDER,
    Harness,
    loopback,
    opening,
    server_config,
    started,
    unit,
    units,
)

STEPS = (
    "compaction.start",
    "compaction.summarize",
    "compaction.gate",
    "compaction.summary",
    "compaction.replace",
    "compaction.end",
)
PREPARE_STEP = "/compactd.v1.CompactionService/PrepareStep"
COMPACT = "/compactd.v1.CompactionService/Compact"


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


async def spans_when(harness: Harness, exporter: InMemorySpanExporter, rpc: str) -> list[Any]:
    """Every finished span, once the server span of ``rpc`` has ended (it ends after the reply)."""
    async with asyncio.timeout(30):
        while not any(s.name == rpc for s in exporter.get_finished_spans()):
            await harness.pressure()  # any round trip lets the handler finish
    return list(exporter.get_finished_spans())


def attrs(span: ReadableSpan) -> dict[str, Any]:
    """A span's attributes (the SDK types them loosely)."""
    return dict(span.attributes or {})


def ids(span: ReadableSpan) -> SpanContext:
    """A finished span's own context."""
    context = span.context
    assert isinstance(context, SpanContext)
    return context


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    (span,) = [s for s in spans if s.name == name]
    return span


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    found = [s for s in spans if s.parent is not None and s.parent.span_id == ids(parent).span_id]
    return sorted(found, key=lambda s: s.start_time or 0)


async def test_pruning_that_relieves_pressure_is_traced_as_a_bracket_that_never_opened(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    async with started(tmp_path, loop, tracer_provider=provider) as h:
        await h.create(*opening(), *units(2), *unit(2, result="y" * 40_000), turn_start(1))
        run = await h.prepare(1)
        spans = await spans_when(h, exporter, PREPARE_STEP)

    assert run.result.pruned_count == 1
    assert list(run.result.compactions) == []
    bracket = one(spans, "compaction.bracket")
    assert [s.name for s in children(spans, one(spans, PREPARE_STEP))] == ["compaction.bracket"]
    assert [s.name for s in children(spans, bracket)] == ["compaction.prune"]
    assert attrs(bracket)["compactd.relieved_by"] == "pruning"
    assert "compactd.compaction_id" not in attrs(bracket)


async def test_a_prepare_step_traces_pruning_and_one_bracket_with_every_step(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    async with started(tmp_path, loop, tracer_provider=provider) as h:
        await h.create(*opening(), *unit(0, result="z" * 40_000), *units(18, 1), turn_start(1))
        run = await h.prepare(1)
        spans = await spans_when(h, exporter, PREPARE_STEP)

    (outcome,) = run.result.compactions
    server = one(spans, PREPARE_STEP)
    bracket = one(spans, "compaction.bracket")
    prune = one(spans, "compaction.prune")
    assert [s.name for s in children(spans, server)] == ["compaction.bracket"]
    assert [s.name for s in children(spans, bracket)] == ["compaction.prune", *STEPS]
    assert {ids(s).trace_id for s in spans if s.name.startswith("compaction.")} == {
        ids(server).trace_id
    }

    assert attrs(prune)["compactd.session_id"] == h.session_id
    assert attrs(prune)["compactd.pruned_count"] == 1
    assert len(attrs(prune)["compactd.shadowed_seqs"]) == 1

    attributes = attrs(bracket)
    assert attributes["compactd.session_id"] == h.session_id
    assert attributes["compactd.compaction_id"] == outcome.compaction_id
    assert attributes["compactd.trigger"] == "COMPACTION_TRIGGER_PRESSURE"
    assert attributes["compactd.range.start_position"] == outcome.range.start_position
    assert attributes["compactd.range.end_position"] == outcome.range.end_position
    assert attributes["compactd.range.start_seq"] == outcome.range.start_seq
    assert attributes["compactd.range.end_seq"] == outcome.range.end_seq
    assert attributes["compactd.shadowed_count"] == outcome.items_condensed
    assert attributes["compactd.tokens_before"] > 0
    assert attributes["compactd.tokens_freed"] == outcome.tokens_freed

    # Pruning precedes compaction/start: its span has no compaction id, the bracket's steps do.
    by_name = {s.name: s for s in children(spans, bracket) if s is not prune}
    for span in by_name.values():
        assert attrs(span)["compactd.compaction_id"] == outcome.compaction_id
        assert span.status.status_code != StatusCode.ERROR
    summary = attrs(by_name["compaction.summary"])
    assert summary["compactd.tokens_after"] < summary["compactd.tokens_before"]
    assert summary["compactd.shadowed_count"] == outcome.items_condensed
    assert attrs(by_name["compaction.replace"])["compactd.seq"] == outcome.checkpoint_seq

    (chat,) = children(spans, by_name["compaction.summarize"])
    assert chat.name == f"chat {MODEL}"
    assert chat.kind == SpanKind.CLIENT
    assert attrs(chat)[genai.GEN_AI_USAGE_INPUT_TOKENS] > 0


async def test_the_summary_call_is_a_genai_client_span_whose_request_carries_traceparent(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    async with started(tmp_path, loop, tracer_provider=provider) as h:
        await h.create(*opening(), *units(4))
        await h.compact()
        spans = await spans_when(h, exporter, COMPACT)
        (summary,) = [e for e in await h.events() if e.HasField("compaction_summary")]

    chat = one(spans, f"chat {MODEL}")
    assert chat.kind == SpanKind.CLIENT
    assert chat.parent is not None
    assert chat.parent.span_id == ids(one(spans, "compaction.summarize")).span_id
    usage = summary.compaction_summary.usage
    host, port = loop.base_url.split("//")[1].split("/")[0].split(":")
    expected = {
        genai.GEN_AI_OPERATION_NAME: "chat",
        genai.GEN_AI_PROVIDER_NAME: PROVIDER,
        genai.GEN_AI_REQUEST_MODEL: MODEL,
        genai.GEN_AI_REQUEST_MAX_TOKENS: 1000,
        genai.GEN_AI_RESPONSE_MODEL: MODEL,
        genai.GEN_AI_RESPONSE_FINISH_REASONS: ("stop",),
        genai.GEN_AI_USAGE_OUTPUT_TOKENS: usage.output_tokens,
        genai.GEN_AI_USAGE_INPUT_TOKENS: usage.input_tokens
        + usage.cache_read_tokens
        + usage.cache_write_tokens,
        "server.address": host,
        "server.port": int(port),
    }
    assert {key: attrs(chat).get(key) for key in expected} == expected
    assert str(attrs(chat)[genai.GEN_AI_RESPONSE_ID]).startswith("chatcmpl-loopback-")
    assert "gen_ai.operation.name" not in attrs(one(spans, "compaction.summarize"))

    # httpx's client span is the chat span's child, and its context is what the provider got.
    (http,) = children(spans, chat)
    assert http.kind == SpanKind.CLIENT
    assert attrs(http)["http.method"] == "POST"  # the older names, as the instrumentation emits
    (request,) = [r for r in loop.requests if r.header("x-compactd-purpose") == "compaction"]
    traceparent = request.header("traceparent")
    context = ids(http)
    flags = int(context.trace_flags)
    assert traceparent == f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"
    assert ids(http).trace_id == ids(one(spans, COMPACT)).trace_id


async def test_the_extractive_summarizer_is_not_reported_as_a_model_call(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    async with started(tmp_path, loop, tracer_provider=provider, kind="extractive") as h:
        await h.create(*opening(), *units(4))
        await h.compact()
        spans = await spans_when(h, exporter, COMPACT)
    summarize = one(spans, "compaction.summarize")
    assert attrs(summarize)["compactd.summarizer"] == "extractive"
    assert children(spans, summarize) == []
    assert not [s for s in spans if s.kind == SpanKind.CLIENT]
    assert not [s for s in spans if any(k.startswith("gen_ai.") for k in attrs(s))]


async def test_usage_on_the_summarize_span_matches_the_logged_summary(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    async with started(tmp_path, loop, tracer_provider=provider) as h:
        await h.create(*opening(), *units(4))
        await h.compact()
        spans = await spans_when(h, exporter, COMPACT)
        (summary,) = [e for e in await h.events() if e.HasField("compaction_summary")]
    usage = summary.compaction_summary.usage
    attributes = attrs(one(spans, f"chat {MODEL}"))
    assert attributes[genai.GEN_AI_USAGE_OUTPUT_TOKENS] == usage.output_tokens
    assert attributes[genai.GEN_AI_USAGE_INPUT_TOKENS] == (
        usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
    )


async def test_a_failed_summary_is_recorded_as_an_error_on_its_spans(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    loop.enqueue(Reply.server_error(503))
    options = {"summarizer": {"max_attempts": 1}}
    async with started(tmp_path, loop, tracer_provider=provider, **options) as h:
        await h.create(*opening(), *units(4))
        with pytest.raises(grpc.aio.AioRpcError):
            await h.compact()
        spans = await spans_when(h, exporter, COMPACT)

    summarize = one(spans, "compaction.summarize")
    assert summarize.status.status_code == StatusCode.ERROR
    assert [e.name for e in summarize.events] == ["exception"]
    chat = one(spans, f"chat {MODEL}")
    assert chat.status.status_code == StatusCode.ERROR
    assert attrs(chat)["error.type"] == "PROVIDER_UNAVAILABLE"
    bracket = one(spans, "compaction.bracket")
    assert bracket.status.status_code == StatusCode.ERROR
    assert "exception" in [e.name for e in bracket.events]
    end = one(spans, "compaction.end")
    assert "processing your request" in attrs(end)["compactd.error"]
    assert [s.name for s in children(spans, bracket)] == [
        "compaction.start",
        "compaction.summarize",
        "compaction.end",
    ]
    server = one(spans, COMPACT)
    # A provider outage is transient: the caller gets UNAVAILABLE, carried on the server span.
    assert attrs(server)["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]


async def test_the_grpc_server_span_joins_the_callers_trace(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    trace_id, parent_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    traceparent = f"00-{trace_id:032x}-{parent_id:016x}-01"
    async with started(tmp_path, loop, tracer_provider=provider) as h:
        await h.create(*opening(), *units(4))
        stub: Any = compaction_service_pb2_grpc.CompactionServiceStub(h.channel)
        request = cpb.CompactRequest(session_id=h.session_id)
        async for _ in stub.Compact(request, metadata=(("traceparent", traceparent),)):
            pass
        spans = await spans_when(h, exporter, COMPACT)

    server = one(spans, COMPACT)
    assert ids(server).trace_id == trace_id
    assert server.parent is not None
    assert server.parent.span_id == parent_id
    assert server.parent.is_remote
    assert attrs(server)["rpc.system"] == "grpc"
    assert ids(one(spans, "compaction.bracket")).trace_id == trace_id


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every request."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.received = threading.Event()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        self.received.set()
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def grpc_collector() -> Iterator[tuple[_Collector, int]]:
    # A thread-pool server: the exporter flushes synchronously at shutdown, from the event loop.
    receiver = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(None)


@pytest.fixture
def http_collector() -> Iterator[tuple[_Collector, int]]:
    """An OTLP/HTTP receiver: ``POST /v1/traces`` with a protobuf ExportTraceServiceRequest."""
    receiver = _Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            assert self.path == "/v1/traces"
            assert self.headers["Content-Type"] == "application/x-protobuf"
            receiver.Export(trace_service_pb2.ExportTraceServiceRequest.FromString(body), None)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield receiver, server.server_address[1]
    server.shutdown()
    server.server_close()


def exported(receiver: _Collector) -> tuple[set[str], set[str]]:
    """Span names and service names of everything ``receiver`` got."""
    names: set[str] = set()
    services: set[str] = set()
    for request in receiver.requests:
        for resource_spans in request.resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    services.add(attribute.value.string_value)
            for scope in resource_spans.scope_spans:
                names.update(span.name for span in scope.spans)
    return names, services


async def compact_through_an_owned_provider(tmp_path: Path, loop: OpenAICompatServer) -> None:
    """A server building its providers from OTEL_*, one Compact, then a stop that flushes."""
    running = await create_server(server_config(tmp_path, loop))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            harness = Harness(channel, loop, running)
            await harness.create(*opening(), *units(4))
            await harness.compact()
    finally:
        await running.stop(0)  # shuts the providers down, flushing every span


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
async def test_spans_are_exported_over_the_otlp_protocol_the_environment_selects(
    tmp_path: Path,
    loop: OpenAICompatServer,
    grpc_collector: tuple[_Collector, int],
    http_collector: tuple[_Collector, int],
    monkeypatch: pytest.MonkeyPatch,
    protocol: str,
) -> None:
    receiver, port = grpc_collector if protocol == "grpc" else http_collector
    other = http_collector[0] if protocol == "grpc" else grpc_collector[0]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "compactd-under-test")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")  # these collectors receive traces only
    assert telemetry.export_target("traces").startswith(
        "otlp_proto_grpc" if protocol == "grpc" else "otlp_proto_http"
    )
    await compact_through_an_owned_provider(tmp_path, loop)

    assert receiver.received.is_set()
    assert other.requests == []
    names, services = exported(receiver)
    assert services == {"compactd-under-test"}
    assert {"compaction.bracket", *STEPS, COMPACT, f"chat {MODEL}", "POST"} <= names


async def test_nothing_is_exported_without_an_otel_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_TRACES_EXPORTER"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert telemetry.exporter_names("traces") == []
    assert telemetry.export_target("traces") == "off"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert telemetry.exporter_names("traces") == ["console"]
