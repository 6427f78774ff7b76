"""Shared fixtures: a real in-process server on a free port, over a real SQLite file."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import settings
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from compactd import config
from compactd.api.server import RunningServer, create_server
from compactd.v1 import compaction_service_pb2_grpc, session_service_pb2_grpc

# Property tests are bounded by example counts, never by wall time: these machines are noisy.
settings.register_profile("compactd", deadline=None)
settings.load_profile("compactd")


@pytest.fixture(autouse=True)
def _root_log_handlers() -> Iterator[None]:
    """Each test starts and ends with the root logger's handlers as they were: a command that
    configures logging (``compactd serve``) binds a handler to that test's captured stderr,
    which is closed once the test ends."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def server_config(tmp_path: Path) -> config.ServerConfig:
    """A configuration binding port 0 with a fresh SQLite file."""
    return config.load(
        None,
        environ={},
        overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{tmp_path / 'compactd.db'}"},
    )


@pytest.fixture
async def server(server_config: config.ServerConfig) -> AsyncIterator[RunningServer]:
    """A started server, stopped after the test."""
    running = await create_server(server_config)
    try:
        yield running
    finally:
        await running.stop(0)


@pytest.fixture
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to the server."""
    async with grpc.aio.insecure_channel(server.address) as chan:
        yield chan


@pytest.fixture
def sessions(channel: grpc.aio.Channel) -> session_service_pb2_grpc.SessionServiceStub:
    """A SessionService stub."""
    return session_service_pb2_grpc.SessionServiceStub(channel)


@pytest.fixture
def compaction(channel: grpc.aio.Channel) -> compaction_service_pb2_grpc.CompactionServiceStub:
    """A CompactionService stub."""
    return compaction_service_pb2_grpc.CompactionServiceStub(channel)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    """Finished spans, in memory."""
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    """A tracer provider exporting to ``exporter`` (give it to ``create_server``)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()
