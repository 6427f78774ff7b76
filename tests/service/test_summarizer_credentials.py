"""Summarizer credentials end to end: a key from the environment or from a file named by the
route is sent to the provider, and when the provider echoes it (in an error body, in its answer)
no byte of it reaches the log lines, the exported spans, a gRPC status (message or details), the
event log or a read of the session. A real server, a real loopback provider.

The key has no well-known shape (no ``sk-`` prefix), so only the literal redaction of the keys
the routes name can remove it.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from compactd.api.server import create_server
from compactd.core import prompts
from compactd.logs import JsonFormatter
from compactd.providers.base import SummaryError, SummaryRequest
from compactd.providers.openai import OpenAISummarizer, RetryPolicy
from compactd.reasons import Reason
from compactd.redaction import REDACTED, Redactor, for_routes
from compactd.routes import RouteCatalog
from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.builders import user
from tests.compaction_fixtures import POLICY, loopback, opening, route_table, server_config, units

KEY = "ck-test-5b0d8e1f2a93c4d7e6"
ROTATED = "ck-test-rotated-9a8b7c6d5e"
KEY_VARIABLE = "COMPACTD_TEST_SUMMARY_KEY"


def summary_request() -> SummaryRequest:
    return SummaryRequest(
        messages=[
            spb.Message(role=spb.MESSAGE_ROLE_USER, content=user("Fix it").user_message.content)
        ],
        tools=[],
        config=events_pb2.RequestConfig(provider="loopback", model="loop-1"),
        instruction=prompts.compaction_instruction(None),
        max_tokens=256,
    )


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


# ---- the key's sources --------------------------------------------------------------------------


async def test_a_key_file_is_read_at_each_call_so_rotating_it_needs_no_restart(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    key_file = tmp_path / "summary.key"
    key_file.write_text(f"{KEY}\n")
    summarizer = OpenAISummarizer(base_url=loop.base_url, api_key_file=str(key_file))
    await summarizer.summarize(summary_request())
    key_file.write_text(ROTATED)
    await summarizer.summarize(summary_request())
    sent = [request.header("authorization") for request in loop.requests]
    assert sent == [f"Bearer {KEY}", f"Bearer {ROTATED}"]


@pytest.mark.parametrize("content", [None, "", "  \n"])
async def test_a_missing_or_empty_key_file_is_misconfigured_and_named(
    tmp_path: Path, loop: OpenAICompatServer, content: str | None
) -> None:
    key_file = tmp_path / "summary.key"
    if content is not None:
        key_file.write_text(content)
    summarizer = OpenAISummarizer(
        base_url=loop.base_url, api_key_file=str(key_file), retry=RetryPolicy(max_attempts=1)
    )
    with pytest.raises(SummaryError) as caught:
        await summarizer.summarize(summary_request())
    assert caught.value.reason == Reason.SUMMARIZER_MISCONFIGURED
    assert str(key_file) in caught.value.message
    assert loop.requests == []


def test_a_route_takes_its_key_from_a_variable_or_a_file_not_both() -> None:
    keyed = RouteCatalog.from_config(
        [{"provider": "openai", "model": "gpt-4o", "api_key_file": "/run/secrets/openai"}]
    ).get("openai", "gpt-4o")
    assert keyed is not None
    assert (keyed.api_key_env, keyed.api_key_file) == ("", "/run/secrets/openai")
    with pytest.raises(Exception, match=r"routes\[0\]\.api_key_file: set api_key_env or"):
        RouteCatalog.from_config(
            [{"provider": "p", "model": "m", "api_key_env": "K", "api_key_file": "/k"}]
        )


def test_the_redactor_follows_a_rotated_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "summary.key"
    key_file.write_text(KEY)
    redact = Redactor(files=[str(key_file)])
    assert redact(f"echo {KEY}") == f"echo {REDACTED}"
    key_file.write_text(ROTATED + "-longer")  # another size: read again
    assert redact(f"echo {ROTATED}-longer") == f"echo {REDACTED}"
    key_file.unlink()
    assert redact("nothing to hide") == "nothing to hide"


def test_literal_redaction_removes_the_keys_and_leaves_key_like_text() -> None:
    redact = for_routes(
        RouteCatalog.from_config([{"provider": "p", "model": "m", "api_key_env": "K"}]),
        environ={"K": KEY},
    )
    text = f"ran `deploy --token=abc12345` with {KEY}"
    assert redact.literals(text) == f"ran `deploy --token=abc12345` with {REDACTED}"


# ---- end to end ---------------------------------------------------------------------------------


def _everything_traced(exporter: InMemorySpanExporter) -> str:
    parts = []
    for span in exporter.get_finished_spans():
        parts += [span.name, str(dict(span.attributes or {})), str(span.status.description)]
        parts += [f"{e.name} {dict(e.attributes or {})}" for e in span.events]
    return "\n".join(parts)


def _status_bytes(error: grpc.aio.AioRpcError) -> str:
    """Everything a client receives with a failed call: code, message, trailing metadata."""
    trailing = [f"{k}={v!r}" for k, v in error.trailing_metadata() or ()]
    return "\n".join([str(error.code()), error.details() or "", *trailing])


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """The server's log as the production handler would write it (JSON lines, DEBUG up)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.mark.parametrize("source", ["api_key_env", "api_key_file"])
async def test_a_key_the_provider_echoes_never_leaves_the_provider_call(
    tmp_path: Path,
    loop: OpenAICompatServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    log_lines: io.StringIO,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
) -> None:
    key_file = tmp_path / "summary.key"
    if source == "api_key_env":
        monkeypatch.setenv(KEY_VARIABLE, KEY)
        keyed = {"api_key_env": KEY_VARIABLE}
    else:
        key_file.write_text(KEY)
        keyed = {"api_key_file": str(key_file)}
    loop.enqueue(
        Reply.http_error(401, "Incorrect API key {api_key} (header {authorization})"),
        Reply(echo_key=True),
    )
    settings = dataclasses.replace(
        server_config(tmp_path, loop, summarizer={"max_attempts": 1}),
        routes=(route_table(loop, **keyed),),
        compaction=dict(POLICY),
    )
    running = await create_server(settings, tracer_provider=provider)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            found = await _echoed_twice(channel)
    finally:
        await running.stop(0)

    assert [r.header("authorization") for r in loop.requests] == [f"Bearer {KEY}"] * 2
    assert REDACTED in found["status"]  # the error was returned, with the key cut out
    assert REDACTED in found["summary"]  # the echoing answer was stored, with the key cut out
    found["spans"] = _everything_traced(exporter)
    found["logs"] = log_lines.getvalue()
    assert "Incorrect API key" in found["logs"] or "Incorrect API key" in found["spans"]
    for place, text in found.items():
        assert KEY not in text, f"the key reached the {place}"


async def _echoed_twice(channel: grpc.aio.Channel) -> dict[str, str]:
    """A compaction the provider fails (echoing the key), then one it answers (echoing it)."""
    sessions, compaction = SessionServiceStub(channel), CompactionServiceStub(channel)
    await sessions.CreateSession(spb.CreateSessionRequest(session_id="s"))
    events = [*opening(), *units(4)]
    await sessions.AppendEvents(spb.AppendEventsRequest(session_id="s", events=events))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in compaction.Compact(cpb.CompactRequest(session_id="s")):
            pass
    # The failure memory holds the same span back: a new unit changes it.
    more = units(1, start=4)
    await sessions.AppendEvents(spb.AppendEventsRequest(session_id="s", events=more))
    async for _ in compaction.Compact(cpb.CompactRequest(session_id="s")):
        pass
    log = [r.event async for r in sessions.ListEvents(spb.ListEventsRequest(session_id="s"))]
    surface = await sessions.GetSurface(spb.GetSurfaceRequest(session_id="s"))
    built = await sessions.BuildRequest(spb.BuildRequestRequest(session_id="s"))
    summaries = [e.compaction_summary.summary for e in log if e.HasField("compaction_summary")]
    return {
        "status": _status_bytes(caught.value),
        "event log": "\n".join(str(event) for event in log),
        "summary": "\n".join(summaries) or str(surface),
        "surface": str(surface) + str(built),
    }
