"""A provider that echoes credentials in its errors: nothing compactd logs, stores in the log,
traces or returns to the caller holds them (a real server, a real loopback provider)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from compactd.redaction import REDACTED
from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from tests.api.rpc import details
from tests.compaction_fixtures import POLICY, PROVIDER, loopback, opening, started, units

KEY = "sk-loop-0123456789abcdefSECRET"
KEY_VARIABLE = "COMPACTD_TEST_LOOP_KEY"
PASSWORD = "pw-in-the-url-4242"


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


def _span_text(exporter: InMemorySpanExporter) -> str:
    parts = []
    for span in exporter.get_finished_spans():
        parts += [span.name, str(dict(span.attributes or {})), str(span.status.description)]
        parts += [f"{e.name} {dict(e.attributes or {})}" for e in span.events]
    return "\n".join(parts)


def _summary_route(**overrides: Any) -> dict[str, Any]:
    return {"provider": PROVIDER, "model": "keyed", "context_window": 32_000, **overrides}


POLICY_KEYED = {**POLICY, "summarizationProvider": PROVIDER, "summarizationModel": "keyed"}


async def _failed_compact(h: Any) -> tuple[Any, list[Any]]:
    await h.create(*opening(), *units(4))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await h.compact()
    return details(caught.value), await h.events()


def _stored_errors(log: list[Any]) -> list[str]:
    return [e.compaction_end.error for e in log if e.HasField("compaction_end")] + [
        e.compaction_summary_error.error for e in log if e.HasField("compaction_summary_error")
    ]


async def test_a_key_the_provider_echoes_is_never_logged_stored_traced_or_returned(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    caplog.set_level(logging.DEBUG)
    loop.enqueue(Reply.http_error(401, "Incorrect API key provided: {authorization}."))
    route = _summary_route(base_url=loop.base_url, api_key_env=KEY_VARIABLE)
    async with started(
        tmp_path, loop, policy=POLICY_KEYED, routes=[route], tracer_provider=provider
    ) as h:
        returned, log = await _failed_compact(h)

    assert loop.requests[0].header("authorization") == f"Bearer {KEY}"  # the key was sent
    assert returned.reason == "UNAUTHENTICATED"
    stored = _stored_errors(log)
    assert len(stored) == 2
    assert all("Incorrect API key provided" in text and REDACTED in text for text in stored)
    for place in [returned.message, *stored, _span_text(exporter), caplog.text]:
        assert KEY not in place


async def test_credentials_in_a_routes_base_url_are_never_logged_stored_or_returned(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with socket.socket() as probe:  # a port nobody listens on: the summary cannot connect
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    route = _summary_route(base_url=f"http://alice:{PASSWORD}@127.0.0.1:{closed}/v1")
    async with started(
        tmp_path,
        loop,
        policy=POLICY_KEYED,
        routes=[route],
        tracer_provider=provider,
        summarizer={"max_attempts": 1},
    ) as h:
        returned, log = await _failed_compact(h)

    assert (returned.code, returned.reason) == (grpc.StatusCode.UNAVAILABLE, "PROVIDER_UNAVAILABLE")
    stored = _stored_errors(log)
    assert all("cannot reach the summary provider" in text for text in stored)
    for place in [returned.message, *stored, _span_text(exporter), caplog.text]:
        assert PASSWORD not in place
        assert "alice:" not in place


async def test_a_classified_provider_error_returns_no_credentials(
    tmp_path: Path, loop: OpenAICompatServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VARIABLE, "configured-key-value-77")
    route = _summary_route(base_url=loop.base_url, api_key_env=KEY_VARIABLE)
    body = (
        '{"error":{"message":"Incorrect API key provided: sk-proj-EchoedKey0123456789; '
        'sent configured-key-value-77","code":"invalid_api_key"}}'
    )
    raw = cpb.RawProviderError(http_status=401, body=body.encode())
    async with started(tmp_path, loop, routes=[route]) as h:
        reply = await h.compaction.ClassifyProviderError(cpb.ClassifyProviderErrorRequest(raw=raw))
    classification = reply.classification
    assert classification.reason == "UNAUTHENTICATED"
    for text in (classification.message, classification.error.message):
        assert "Incorrect API key provided" in text
        assert "EchoedKey0123456789" not in text
        assert "configured-key-value-77" not in text
