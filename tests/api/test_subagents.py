"""Sub-agent sessions over a real server: parents, forks, listing by parent, tenants.

A child is an ordinary session that names its parent; a fork starts with a copy of the parent's
surface at a seq; a child's compactions never change its parent by a byte; ``ListSessions``
filters by parent; another tenant's session is never a parent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace

from compactd.api.server import create_server
from compactd.core import prompts
from compactd.core.fold import SessionFold
from compactd.testing.openai_server import OpenAICompatServer
from compactd.testing.tenants import MetadataTenants, as_tenant
from compactd.v1 import session_service_pb2 as spb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import details
from tests.builders import pin, subagent_end, subagent_start
from tests.compaction_fixtures import (
    RELAXED,
    Harness,
    loopback,
    opening,
    server_config,
    started,
    units,
)


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


async def _create(h: Harness, session_id: str, parent: str, seq: int | None = None) -> spb.Session:
    request = spb.CreateSessionRequest(session_id=session_id, parent_session_id=parent)
    if seq is not None:
        request.fork_at_seq = seq
    reply: spb.CreateSessionResponse = await h.sessions.CreateSession(request)
    return reply.session


async def _state(h: Harness, session_id: str) -> tuple[bytes, ...]:
    """Everything a client reads of a session, as bytes: its log, surface and request."""
    events = [r.event async for r in h.sessions.ListEvents(spb.ListEventsRequest(
        session_id=session_id))]  # fmt: skip
    surface = await h.sessions.GetSurface(spb.GetSurfaceRequest(session_id=session_id))
    built = await h.sessions.BuildRequest(spb.BuildRequestRequest(session_id=session_id))
    return (
        b"".join(e.SerializeToString(deterministic=True) for e in events),
        surface.SerializeToString(deterministic=True),
        built.SerializeToString(deterministic=True),
    )


async def test_a_child_names_its_parent_and_lists_by_it(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening())
        made = [await _create(h, f"s1.child{i}", "s1") for i in (2, 0, 1)]
        await _create(h, "other", "")
        assert all(s.parent_session_id == "s1" and not s.HasField("fork_at_seq") for s in made)

        page = await h.sessions.ListSessions(
            spb.ListSessionsRequest(parent_session_id="s1", page_size=2)
        )
        rest = await h.sessions.ListSessions(
            spb.ListSessionsRequest(parent_session_id="s1", page_token=page.next_page_token)
        )
        everyone = await h.sessions.ListSessions(spb.ListSessionsRequest())

        listed = [s.session_id for s in [*page.sessions, *rest.sessions]]
        assert listed == ["s1.child0", "s1.child1", "s1.child2"]
        assert rest.next_page_token == ""
        assert {s.session_id for s in everyone.sessions} == {"s1", "other", *listed}
        assert [s.parent_session_id for s in everyone.sessions if s.session_id == "s1"] == [""]


async def test_a_missing_parent_or_a_bad_fork_seq_is_refused(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening())  # seqs 0, 1
        cases = [
            ("c1", "nope", None, grpc.StatusCode.NOT_FOUND, "NOT_FOUND"),
            ("c2", "", 0, grpc.StatusCode.INVALID_ARGUMENT, "FORK_SEQ_INVALID"),
            ("c3", "s1", 2, grpc.StatusCode.INVALID_ARGUMENT, "FORK_SEQ_INVALID"),
            ("c4", "s1", -1, grpc.StatusCode.INVALID_ARGUMENT, "FORK_SEQ_INVALID"),
            ("c5", "bad id!", None, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        ]
        for session_id, parent, seq, code, reason in cases:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _create(h, session_id, parent, seq)
            got = details(caught.value)
            assert (got.code, got.reason) == (code, reason), session_id
        listed = await h.sessions.ListSessions(spb.ListSessionsRequest())
        assert [s.session_id for s in listed.sessions] == ["s1"]  # nothing was created


async def test_a_fork_copies_the_parents_surface_at_the_seq(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(4))
        run = await h.compact()  # the parent's surface now holds a checkpoint
        assert run.result.outcome.checkpoint_seq
        await h.append(*units(2, start=4), pin("goal", "the parent's own goal"))
        log = await h.events()
        seq = log[-8].seq  # inside the last unit: after compactions, before the pin
        before = await _state(h, "s1")

        child = await _create(h, "s1.fork", "s1", seq)

        at_seq = SessionFold()
        at_seq.admit(log[: seq + 1], check=False)
        built = await h.sessions.BuildRequest(spb.BuildRequestRequest(session_id="s1.fork"))
        assert list(built.messages) == at_seq.messages()  # the parent's request at the seq
        assert built.config == at_seq.header.config  # type: ignore[union-attr]
        assert list(built.tools) == list(at_seq.header.tools)  # type: ignore[union-attr]
        assert list(built.pins) == []  # pins are the parent's task state
        events = [r.event async for r in h.sessions.ListEvents(
            spb.ListEventsRequest(session_id="s1.fork"))]  # fmt: skip
        fork = events[0].session_fork
        assert (fork.parent_session_id, fork.fork_at_seq) == ("s1", seq)
        assert list(fork.source_seqs) == [n.seq for n in at_seq.surface]
        assert (child.parent_session_id, child.fork_at_seq, child.revision) == (
            "s1",
            seq,
            len(events),
        )
        assert await _state(h, "s1") == before  # the parent is only read

        again = await _create(h, "s1.fork", "s1", seq)  # a retried create copies nothing more
        assert again.revision == child.revision
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _create(h, "s1.fork", "s1", seq - 1)
        assert details(caught.value).code == grpc.StatusCode.ALREADY_EXISTS


async def test_a_child_compacts_without_changing_its_parent_by_a_byte(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(5))
        before = await _state(h, "s1")
        await _create(h, "s1.sub", "s1", (await h.events())[-1].seq)
        child = dataclasses.replace(h, session_id="s1.sub")
        await child.append(*units(3, start=10))
        for _ in range(3):
            run = await child.compact()
            assert run.result.outcome.checkpoint_seq
            await child.append(*units(2, start=20 + _ * 2))
        assert await _state(h, "s1") == before


async def test_a_session_of_another_tenant_is_never_a_parent(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    settings = server_config(tmp_path, loop, policy=RELAXED)
    server = await create_server(
        settings, tenant_binding=[MetadataTenants()], tracer_provider=trace.NoOpTracerProvider()
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub: Any = SessionServiceStub(channel)
            a, b = as_tenant("a"), as_tenant("b")
            await stub.CreateSession(spb.CreateSessionRequest(session_id="p"), metadata=a)
            await stub.AppendEvents(
                spb.AppendEventsRequest(session_id="p", events=opening()), metadata=a
            )
            for seq in (None, 0):
                request = spb.CreateSessionRequest(session_id="c", parent_session_id="p")
                if seq is not None:
                    request.fork_at_seq = seq
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.CreateSession(request, metadata=b)
                assert details(caught.value).code == grpc.StatusCode.NOT_FOUND
            child = spb.CreateSessionRequest(session_id="c", parent_session_id="p", fork_at_seq=1)
            made = await stub.CreateSession(child, metadata=a)
            assert made.session.revision > 0
            theirs = await stub.ListSessions(
                spb.ListSessionsRequest(parent_session_id="p"), metadata=b
            )
            ours = await stub.ListSessions(
                spb.ListSessionsRequest(parent_session_id="p"), metadata=a
            )
            assert [s.session_id for s in theirs.sessions] == []
            assert [s.session_id for s in ours.sessions] == ["c"]
    finally:
        await server.stop(0)


async def test_open_subagent_handles_survive_ten_compactions_of_the_parent(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(3))
        await _create(h, "s1.a", "s1")
        await _create(h, "s1.b", "s1")
        await h.append(
            subagent_start("s1.a", "call-0", "audit src/mod0.py"),
            subagent_start("s1.b", "call-1", "write the changelog"),
            pin("goal", "every module green"),
        )
        a = "- sub-agent `s1.a` still running (spawned by tool call `call-0`): audit src/mod0.py"
        b = "- sub-agent `s1.b` still running (spawned by tool call `call-1`): write the changelog"
        for round in range(10):
            await h.append(*units(3, start=10 + 3 * round))
            if round == 4:
                await h.append(subagent_end("s1.b", "changelog written"))
            run = await h.compact()
            assert run.result.outcome.checkpoint_seq, round
            built = await h.build()
            [checkpoint] = [
                m.content[0].text.text
                for m in built.messages
                if m.content and prompts.SUMMARY_OPEN_TAG in m.content[0].text.text
            ]
            handles = checkpoint.split("## Open Handles\n", 1)[1]
            assert a in handles, round
            assert (b in handles) == (round < 4), round
            assert "`goal`" in handles
            assert checkpoint.count("## Open Handles") == 1


async def test_a_checkpoint_with_open_handles_is_measured_as_committed(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # The gate prices a checkpoint without its Open Handles section (what it judges is the
    # summary); the commit's envelope_after must still be the envelope the session then has.
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(3))
        await _create(h, "s1.a", "s1")
        await h.append(subagent_start("s1.a", "call-0", "audit src/mod0.py"), *units(6, start=10))
        run = await h.compact()
        assert run.result.outcome.checkpoint_seq
        summary = next(e for e in await h.events() if e.HasField("compaction_summary"))
        after = summary.compaction_summary.tokens.envelope_after
        assert after == (await h.pressure()).measured_tokens
