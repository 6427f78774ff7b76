"""RevertCompaction through a live server: a bracket undone gives back the request it replaced.

The revert puts the checkpoint's shadowed nodes back as copies (REPLACE of the checkpoint, then
INSERTs), in one batch recorded as a bracket with trigger REVERT; the log only grows. A later
bracket that covers the checkpoint blocks it until that one is reverted first; a surface that
would not fit, an open turn and an unknown id are refused with their reasons.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
from compactd_client import AsyncCompactdClient, FailedPreconditionError
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from compactd.api.server import create_server
from compactd.core.meter import recount
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from tests.api.rpc import details
from tests.builders import turn_start
from tests.compaction_fixtures import (
    MODEL,
    PROVIDER,
    Harness,
    opening,
    server_config,
    started,
    units,
)


async def revert(h: Harness, compaction_id: str) -> cpb.RevertCompactionResponse:
    reply: cpb.RevertCompactionResponse = await h.compaction.RevertCompaction(
        cpb.RevertCompactionRequest(session_id=h.session_id, compaction_id=compaction_id)
    )
    return reply


async def compacted(h: Harness) -> str:
    run = await h.compact()
    assert run.result.HasField("outcome"), run.result.declined_reason
    return str(run.result.outcome.compaction_id)


def messages(build: spb.BuildRequestResponse) -> list[spb.Message]:
    return list(build.messages)


async def test_revert_after_a_bracket_gives_back_the_surface_and_request_before_it(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(18))
        before, surface_before = await h.build(), await h.surface()
        log_before = await h.events()
        compaction_id = await compacted(h)
        assert messages(await h.build()) != messages(before)

        reply = await revert(h, compaction_id)

        after = await h.build()
        assert messages(after) == messages(before)
        assert list(after.tools) == list(before.tools)
        assert [n.type for n in (await h.surface()).nodes] == [n.type for n in surface_before.nodes]
        log = await h.events()
        assert log[: len(log_before)] == log_before  # append-only
        restored = {e.seq: e for e in log if e.seq in reply.restored_seqs}
        assert [list(restored[s].source_event_seqs)[-1] for s in reply.restored_seqs] == list(
            reply.original_seqs
        )
        assert list(reply.original_seqs) == [
            n.seq for n in surface_before.nodes[1 : len(reply.original_seqs) + 1]
        ]
        # The meter follows the INSERTs: its figure is a recount's.
        assert h.server is not None
        assert h.server.pressure is not None
        route = h.server.pressure.routes.resolve(PROVIDER, MODEL)
        handle = await h.server.manager.get(h.session_id)
        measured = handle.context.meter.measure(handle.fold, route, anchored=False)
        assert measured.total == recount(handle.fold, route).total
        assert (await h.pressure()).measured_tokens == (
            await _pressure_of(h, before)
        ).measured_tokens
        # Recorded as a bracket with trigger REVERT.
        brackets = await h.compaction.ListBrackets(cpb.ListBracketsRequest(session_id=h.session_id))
        last = brackets.brackets[-1]
        assert last.trigger == events_pb2.COMPACTION_TRIGGER_REVERT
        assert last.compaction_id == reply.revert_compaction_id
        assert last.outcome == cpb.BRACKET_OUTCOME_COMMITTED
        assert last.checkpoint_seq == reply.restored_seqs[0]
        reverted = next(b for b in brackets.brackets if b.compaction_id == compaction_id)
        assert reverted.outcome == cpb.BRACKET_OUTCOME_COMMITTED


async def _pressure_of(h: Harness, build: spb.BuildRequestResponse) -> cpb.PressureReport:
    """The pressure of a fresh session holding ``build``'s conversation (the same units)."""
    twin = Harness(h.channel, h.loop, h.server, session_id=h.session_id + "-twin")
    await twin.create(*opening(), *units(18))
    assert messages(await twin.build()) == messages(build)
    return await twin.pressure()


async def test_a_later_bracket_over_the_checkpoint_must_be_reverted_first(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(18))
        before = await h.build()
        first = await compacted(h)
        await h.append(*units(14, start=18))
        middle = await h.build()
        second = await compacted(h)
        start = next(
            e
            for e in await h.events()
            if e.HasField("compaction_start") and e.compaction_start.compaction_id == second
        )
        surface = {n.seq: n for n in (await h.surface()).nodes}
        assert all(seq not in surface for seq in start.compaction_start.shadowed_seqs)

        with pytest.raises(grpc.aio.AioRpcError) as blocked:
            await revert(h, first)
        assert blocked.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert details(blocked.value).reason == "REVERT_BLOCKED"
        assert details(blocked.value).metadata["covering_compaction_id"] == second

        await revert(h, second)
        assert messages(await h.build()) == messages(middle)
        await revert(h, first)
        assert messages(await h.build())[: len(before.messages)] == messages(before)

        with pytest.raises(grpc.aio.AioRpcError) as again:
            await revert(h, first)
        assert details(again.value).reason == "REVERT_BLOCKED"


async def test_unknown_ids_open_turns_and_a_full_surface_are_refused(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(18))
        compaction_id = await compacted(h)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await revert(h, "no-such-bracket")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert details(unknown.value).reason == "COMPACTION_UNKNOWN"
        with pytest.raises(grpc.aio.AioRpcError) as nameless:
            await revert(h, "")
        assert nameless.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        await h.append(turn_start(1))
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await revert(h, compaction_id)
        assert details(busy.value).reason == "COMPACTION_BUSY"
        surface_bytes = len((await h.surface()).SerializeToString())

    # The same log under a limit the compacted surface fits and the restored one would not.
    limit = surface_bytes + 4096
    settings = dataclasses.replace(
        server_config(tmp_path, loop, kind="extractive"),
        max_surface_bytes=limit, max_event_bytes=limit, max_block_bytes=limit,
    )  # fmt: skip
    running = await create_server(settings, tracer_provider=trace.NoOpTracerProvider())
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            again = Harness(channel, loop, running)
            await again.append(events_pb2.SessionEvent(turn_end=events_pb2.TurnEnd(turn=1)))
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await revert(again, compaction_id)
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert details(full.value).reason == "SURFACE_FULL"
    finally:
        await running.stop(0)


async def test_a_revert_is_traced(tmp_path: Path, loop: OpenAICompatServer) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with started(tmp_path, loop, kind="extractive", tracer_provider=provider) as h:
        await h.create(*opening(), *units(18))
        compaction_id = await compacted(h)
        reply = await revert(h, compaction_id)
    [span] = [s for s in exporter.get_finished_spans() if s.name == "compaction.revert"]
    assert span.attributes is not None
    assert span.attributes["compactd.compaction_id"] == compaction_id
    assert span.attributes["compactd.revert.restored"] == len(reply.restored_seqs)


async def test_the_python_client_reverts_and_reads_the_reasons(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(18))
        before = await h.build()
        compaction_id = await compacted(h)
        async with AsyncCompactdClient(h.address) as client:
            reply = await client.revert_compaction(h.session_id, compaction_id)
            assert reply.checkpoint_seq > 0
            rebuilt = await client.build_request(h.session_id)
            assert [m.SerializeToString() for m in rebuilt.messages] == [
                m.SerializeToString() for m in before.messages
            ]
            with pytest.raises(FailedPreconditionError) as blocked:
                await client.revert_compaction(h.session_id, compaction_id)
            assert blocked.value.reason == "REVERT_BLOCKED"
