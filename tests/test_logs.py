"""Logs: JSON or text lines that carry the trace, span, session and compaction ids.

A summary attempt that fails once and is retried logs a warning from inside the bracket; through a
real server with a recording tracer, that line must name the RPC's trace, the current span, the
request's session and the bracket's compaction.
"""

from __future__ import annotations

import contextvars
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from compactd import logs
from compactd.testing.openai_server import OpenAICompatServer, Reply
from tests.compaction_fixtures import loopback, opening, started, units


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """compactd's log records as JSON lines, through the production formatter and filter."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    handler.addFilter(logs.CorrelationFilter())
    logger = logging.getLogger("compactd")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(previous)


async def test_a_log_line_inside_a_bracket_carries_trace_span_session_and_compaction_ids(
    tmp_path: Path, loop: OpenAICompatServer, json_lines: io.StringIO
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    loop.enqueue(Reply.server_error(503))  # the first attempt fails, the retry succeeds
    async with started(tmp_path, loop, tracer_provider=provider) as h:
        await h.create(*opening(), *units(4))
        run = await h.compact()
    provider.shutdown()

    entries = [json.loads(line) for line in json_lines.getvalue().splitlines()]
    (retry,) = [e for e in entries if e["message"].startswith("summary attempt 1 failed")]
    assert retry["session_id"] == h.session_id
    assert retry["compaction_id"] == run.result.outcome.compaction_id
    spans = {format(s.context.span_id, "016x"): s for s in exporter.get_finished_spans()}
    span = spans[retry["span_id"]]
    assert format(span.context.trace_id, "032x") == retry["trace_id"]
    assert span.name == "chat m"  # the model call the retry belongs to
    assert retry["reason"] == "PROVIDER_UNAVAILABLE"  # extra fields are kept


def test_text_lines_carry_the_ids_as_key_value_pairs() -> None:
    record = logging.LogRecord("compactd.x", logging.INFO, __file__, 1, "hello", (), None)

    def log_in_a_bound_context() -> str:
        logs.bind(session_id="s-9", compaction_id="c-1")
        assert logs.CorrelationFilter().filter(record)
        return logs.TextFormatter().format(record)

    line = contextvars.copy_context().run(log_in_a_bound_context)
    assert line.endswith("compactd.x: hello session_id=s-9 compaction_id=c-1")
    assert "trace_id" not in line  # no current span: no ids to invent
