"""Recall through a live server: handles in the request give back the original events.

A session is pruned (one oversized result) and compacted (the extractive summarizer: no
provider), so its request holds a checkpoint handle and, before the checkpoint shadows it, a
prune handle. Every handle the model sees resolves to the events its replacement shadowed,
each with the SHA-256 of its stored bytes, after a restart, an eviction and through another
tenant (NOT_FOUND); pages stay within ``max_bytes`` and a query narrows them to lines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace

from compactd.api.auth import hash_token
from compactd.api.server import create_server
from compactd.core.recall import checkpoint_handle, prune_handle
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests import postgres
from tests.api.rpc import details
from tests.api.test_replicas import replicas
from tests.builders import turn_start
from tests.compaction_fixtures import Harness, opening, server_config, started, unit, units

HANDLE = re.compile(r"\[recall:([cp]\d+-[0-9a-f]{4})\]")
BIG = "".join(f"line {n}: output of the long command, needle-{n % 7}\n" for n in range(400))


def digest(event: events_pb2.SessionEvent) -> str:
    return hashlib.sha256(event.SerializeToString(deterministic=True)).hexdigest()


def handles_in(request: spb.BuildRequestResponse) -> list[str]:
    texts = (b.text.text for m in request.messages for b in m.content if b.HasField("text"))
    return [h for text in texts for h in HANDLE.findall(text)]


async def recall(h: Harness, **fields: object) -> spb.RecallResponse:
    reply: spb.RecallResponse = await h.sessions.Recall(
        spb.RecallRequest(session_id=h.session_id, **fields)
    )
    return reply


async def recall_all(h: Harness, **fields: object) -> list[spb.RecallResponse]:
    pages = [await recall(h, **fields)]
    while pages[-1].next_page_token:
        pages.append(await recall(h, page_token=pages[-1].next_page_token, **fields))
    return pages


async def pruned_and_compacted(h: Harness) -> tuple[str, str]:
    """A session with a pruned result and then a checkpoint over it (a step above pressure);
    (the prune's handle, the checkpoint's handle)."""
    await h.create(*opening(), *units(2), *unit(2, result=BIG), *units(16, start=3), turn_start(1))
    log = await h.events()
    big = next(e for e in log if e.HasField("tool_result") and BIG in _text(e))
    run = await h.prepare(1)
    assert run.result.pruned_count == 1
    assert len(run.result.compactions) == 1
    log = await h.events()
    start = next(e for e in log if e.HasField("compaction_start"))
    replacement = next(e for e in log if e.HasField("tool_result") and e.source_event_seqs)
    assert list(replacement.source_event_seqs) == [big.seq]
    assert replacement.seq in start.compaction_start.shadowed_seqs  # the pruned node
    return prune_handle(big.seq), checkpoint_handle(start.seq)


def _text(event: events_pb2.SessionEvent) -> str:
    return "".join(b.text.text for b in event.tool_result.content)


async def test_every_handle_in_the_request_recalls_the_original_events_byte_for_byte(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        pruned, checkpoint = await pruned_and_compacted(h)
        assert handles_in(await h.build()) == [checkpoint]  # the checkpoint shadowed the prune
        log = {e.seq: e for e in await h.events()}
        start = next(e for e in log.values() if e.HasField("compaction_start"))

        reply = await recall(h, handle=f"[recall:{checkpoint}]")

        assert list(reply.seqs) == list(start.compaction_start.shadowed_seqs)
        assert [e.seq for e in reply.events] == list(reply.seqs)
        assert all(e.sha256 == digest(log[e.seq]) for e in reply.events)
        # The pruned result comes back as the model saw it, naming its own handle: recall it.
        assert pruned in handles_in(
            spb.BuildRequestResponse(messages=[e.message for e in reply.events])
        )
        original = await recall(h, handle=pruned)
        [event] = original.events
        assert event.message.content[0].text.text == BIG
        assert event.sha256 == digest(log[event.seq])
        assert f"[recall:{pruned}]" in original.text
        assert "needle-3" in original.text
        assert (await h.events()) == list(log.values())  # recall wrote nothing


async def test_handles_resolve_after_a_restart_and_an_eviction(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        pruned, checkpoint = await pruned_and_compacted(h)
        before = await recalled(h, checkpoint, pruned)
        assert h.server is not None
        assert await h.server.manager.evict(h.session_id)
        assert await recalled(h, checkpoint, pruned) == before
    async with started(tmp_path, loop, kind="extractive") as again:  # the same SQLite file
        assert await recalled(again, checkpoint, pruned) == before


async def recalled(h: Harness, *handles: str) -> list[spb.RecallResponse]:
    """What each handle recalls, without the revision it was read at (a restart logs a seed)."""
    replies = [await recall(h, handle=handle) for handle in handles]
    for reply in replies:
        reply.ClearField("revision")
    return replies


async def test_pages_stay_within_max_bytes_and_together_give_every_event(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        pruned, checkpoint = await pruned_and_compacted(h)
        whole = await recall(h, handle=checkpoint)
        pages = await recall_all(h, handle=checkpoint, max_bytes=2048)

        assert len(pages) > 3
        assert all(sum(e.ByteSize() for e in p.events) <= 2048 for p in pages)
        assert [e.seq for p in pages for e in p.events if not e.offset] == list(whole.seqs)
        assert pages[0].next_page_token in pages[0].text
        # The oversized result comes in pieces whose texts join to the original.
        pieces = await recall_all(h, handle=pruned, max_bytes=1024)
        assert len(pieces) > 10
        assert all(p.events[0].truncated for p in pieces[:-1])
        assert not pieces[-1].events[0].truncated
        assert "".join(p.events[0].message.content[0].text.text for p in pieces) == BIG
        assert len({p.events[0].sha256 for p in pieces}) == 1


async def test_a_query_narrows_a_range_to_its_matching_lines(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        pruned, _ = await pruned_and_compacted(h)
        reply = await recall(h, handle=pruned, query="NEEDLE-3")

        [event] = reply.events
        assert not event.HasField("message")
        assert [line.text for line in event.lines] == [
            line for line in BIG.split("\n") if "needle-3" in line
        ]
        assert event.lines[0].line == 4  # line 3 holds needle-3, numbered from 1
        nothing = await recall(h, handle=pruned, query="no such text")
        assert list(nothing.events) == []
        assert list(nothing.seqs) == list(reply.seqs)


async def test_seqs_are_recalled_directly_and_bad_requests_are_named(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        pruned, checkpoint = await pruned_and_compacted(h)
        reply = await recall(h, seqs=[3, 1])
        assert [e.seq for e in reply.events] == [1, 3]

        bad = {
            "handle": dict(handle="not a handle"),
            "seqs": dict(seqs=[10**6]),
            "max_bytes": dict(handle=pruned, max_bytes=-1),
            "page_token": dict(
                handle=checkpoint,
                page_token=(await recall(h, handle=pruned, max_bytes=1024)).next_page_token,
            ),
        }
        for field, request in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await recall(h, **request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert details(refused.value).fields == [field]
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await recall(h, handle=checkpoint.replace("-", "-f", 1)[:-1])  # wrong check digits
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert details(unknown.value).reason == "RECALL_HANDLE_UNKNOWN"


async def test_another_tenants_handle_is_not_found(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    tokens = {"a": "token-of-tenant-a-" + "x" * 24, "b": "token-of-tenant-b-" + "y" * 24}
    settings = dataclasses.replace(
        server_config(tmp_path, loop, kind="extractive"),
        auth_tokens={tenant: hash_token(token) for tenant, token in tokens.items()},
    )
    running = await create_server(settings, tracer_provider=trace.NoOpTracerProvider())
    try:
        bearers = [_Bearer(tokens["a"]), _StreamBearer(tokens["a"])]
        async with (
            grpc.aio.insecure_channel(running.address, interceptors=bearers) as channel_a,
            grpc.aio.insecure_channel(running.address) as channel,
        ):
            as_a = Harness(channel_a, loop, running)
            pruned, checkpoint = await pruned_and_compacted(as_a)
            assert (await recall(as_a, handle=checkpoint)).events
            stub = SessionServiceStub(channel)
            for handle in (pruned, checkpoint):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Recall(
                        spb.RecallRequest(session_id=as_a.session_id, handle=handle),
                        metadata=(("authorization", f"Bearer {tokens['b']}"),),
                    )
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
                assert "token-of" not in str(refused.value.details())
    finally:
        await running.stop(0)


def _with_token(details: Any, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(("authorization", f"Bearer {token}"))
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _Bearer(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Sends one tenant's token on every unary call of a channel."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


class _StreamBearer(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Sends one tenant's token on every server-streaming call of a channel (grpc.aio files an
    interceptor under one kind only)."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    yield from postgres.database()


async def test_a_handle_resolves_on_a_second_replica(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    extractive = {"kind": "extractive", "max_attempts": 3}
    async with replicas(tmp_path, loop, database, summarizer=extractive) as (one, two):
        pruned, checkpoint = await pruned_and_compacted(one)  # through the first replica
        assert await recalled(two, checkpoint, pruned) == await recalled(one, checkpoint, pruned)
