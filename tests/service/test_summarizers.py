"""The default summarizer never sends a conversation to an endpoint the configuration does not name.

The built-in routes carry public endpoints (api.deepseek.com, api.openai.com); a session routed to
one of them must not have its history sent there unless the service configuration names that
route. Every test runs a real server; the named loopback route proves a named endpoint is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from compactd import config
from compactd.api.server import components, create_server
from compactd.errors import ConfigError
from compactd.providers.chunking import ChunkingSummarizer
from compactd.routes import Route, RouteCatalog
from compactd.service.summarizers import SummarizerRegistry, SummarizerSettings, named_routes
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import events_pb2
from tests.api.rpc import details
from tests.builders import header, system
from tests.compaction_fixtures import Harness, body, loopback, started, summary_requests, units

BUILTIN = ("deepseek", "deepseek-chat")  # a built-in route with a public base_url


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


def deepseek_session() -> list[events_pb2.SessionEvent]:
    return [system("You are terse."), header(*BUILTIN), *units(4)]


def of_type(events: list[events_pb2.SessionEvent], name: str) -> list[events_pb2.SessionEvent]:
    return [event for event in events if body(event) == name]


async def test_auto_writes_an_unnamed_builtin_routes_summary_extractively(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="auto") as h:
        await h.create(*deepseek_session())
        await h.compact()
        (summary,) = of_type(await h.events(), "compaction_summary")
    assert summary.compaction_summary.summarizer == "extractive"
    assert (
        summary.compaction_summary.target.provider,
        summary.compaction_summary.target.model,
    ) == (BUILTIN)
    assert summary_requests(loop) == []


async def test_openai_refuses_an_unnamed_builtin_endpoint_and_writes_nothing(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="openai") as h:
        await h.create(*deepseek_session())
        before = await h.events()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.compact()
        got = details(caught.value)
        assert (got.code, got.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "SUMMARIZER_MISCONFIGURED",
        )
        assert "api.deepseek.com" in got.message
        assert "[[routes]]" in got.message
        assert await h.events() == before


async def test_a_builtin_route_named_in_routes_uses_the_configured_endpoint(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    named = {"provider": BUILTIN[0], "model": BUILTIN[1], "base_url": loop.base_url,
             "api_key_env": ""}  # fmt: skip
    async with started(tmp_path, loop, kind="auto", routes=[named]) as h:
        await h.create(*deepseek_session())
        await h.compact()
        (summary,) = of_type(await h.events(), "compaction_summary")
    assert summary.compaction_summary.summarizer == "openai"
    (request,) = summary_requests(loop)
    assert request["model"] == BUILTIN[1]


async def test_with_no_summarizer_configured_every_summary_is_extractive(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    settings = config.load(
        None,
        environ={},
        overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{tmp_path / 'c.db'}"},
    )
    running = await create_server(settings)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            h = Harness(channel, loop, running)
            await h.create(system("You are terse."), *units(4))  # no header routes a model
            run = await h.compact()
            (summary,) = of_type(await h.events(), "compaction_summary")
    finally:
        await running.stop(0)
    assert run.result.outcome.items_condensed > 0
    assert summary.compaction_summary.summarizer == "extractive"


def test_a_route_named_as_the_default_target_may_be_sent_to() -> None:
    settings = dataclasses.replace(
        config.load(None, environ={}), summarizer={"provider": "openai", "model": "gpt-4o"}
    )
    parts = components(settings)
    named = named_routes(settings.routes, parts.summarizer, parts.policy)
    registry = SummarizerRegistry(parts.routes, parts.summarizer, named=named)
    assert registry.model_endpoints == {"openai/gpt-4o": "https://api.openai.com/v1"}
    unnamed = RouteCatalog().get(*BUILTIN)
    assert unnamed is not None
    assert not registry.may_send(unnamed)


def test_the_summarization_pair_of_a_model_policy_names_its_route() -> None:
    policy = {"modelPolicies": [{"provider": "a", "model": "b", "summarizationProvider": "openai",
                                 "summarizationModel": "gpt-4.1"}]}  # fmt: skip
    parts = components(dataclasses.replace(config.load(None, environ={}), compaction=policy))
    named = named_routes((), SummarizerSettings(), parts.policy)
    assert ("openai", "gpt-4.1") in named


def test_chunk_concurrency_bounds_the_chunking_summarizer_of_a_windowed_route() -> None:
    route = Route("local", "small", base_url="http://127.0.0.1:9/v1", context_window=8192)
    settings = SummarizerSettings.from_mapping({"kind": "openai", "chunk_concurrency": 2})
    registry = SummarizerRegistry(
        RouteCatalog([route]), settings, named=frozenset({("local", "small")})
    )

    summarizer = registry.for_route(route)

    assert isinstance(summarizer, ChunkingSummarizer)
    assert summarizer.concurrency == 2
    assert SummarizerSettings().chunk_concurrency == 4  # the default


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4"])
def test_a_chunk_concurrency_below_one_or_not_an_integer_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"summarizer\.chunk_concurrency"):
        SummarizerSettings.from_mapping({"chunk_concurrency": value})
