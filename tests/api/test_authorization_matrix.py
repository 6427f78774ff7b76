"""The authorization matrix: every RPC, as every kind of caller, over mutual TLS with tokens.

The server requires client certificates (mutual TLS) and knows two bearer tokens (tenants ``a``
and ``b``) and one client identity (``spiffe://example.org/agent-a``, tenant ``a``). Tenant A owns
a session full of secrets. Each RPC of both services, health (Check, Watch) and reflection (v1,
v1alpha) is called as:

- ``none``: a client certificate that maps to no tenant, and no token;
- ``bad-token``: that certificate and a token the server does not know;
- ``tenant-a`` / ``tenant-b``: that certificate and A's / B's token;
- ``mtls-a``: the certificate that names A's identity, no token.

Every answer's status is asserted, and no byte of A's secrets may appear in anything a caller
other than A receives: messages, status details, trailing metadata. Before each call A's session
is made afresh, so every call sees the same state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from compactd import config
from compactd.api.auth import hash_token
from compactd.api.server import RunningServer, create_server
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.test_rpc_statuses import CASES, declared_rpcs
from tests.builders import header, system, turn_start, user
from tests.certs import Authority

Code = grpc.StatusCode
SID = "statuses"  # the id test_rpc_statuses' expectations were measured on
SECRET = "A-SECRET-c0ffee"
TOKENS = {"a": "token-of-tenant-a-" + "x" * 24, "b": "token-of-tenant-b-" + "y" * 24}
A_IDENTITY = "spiffe://example.org/agent-a"
OPENAI = events_pb2.Route(provider="openai", model="gpt-4o")
OVERFLOW = cpb.ProviderError(kind=cpb.PROVIDER_ERROR_KIND_CONTEXT_WINDOW_EXCEEDED)
CALLERS = ("none", "bad-token", "tenant-a", "tenant-b", "mtls-a")
OWNERS = ("tenant-a", "mtls-a")


@dataclass
class Stubs:
    """One caller's stubs, all on one channel."""

    channel: grpc.aio.Channel
    sessions: SessionServiceStub
    compaction: CompactionServiceStub


Call = Callable[[Stubs], Awaitable[list[Message]]]


async def _collect(stream: Any, *, first_only: bool = False) -> list[Message]:
    replies: list[Message] = []
    while (reply := await asyncio.wait_for(stream.read(), 30)) is not grpc.aio.EOF:
        replies.append(reply)
        if first_only:
            stream.cancel()
            break
    return replies


async def _unary(reply: Awaitable[Message]) -> list[Message]:
    return [await reply]


def _policy() -> struct_pb2.Struct:
    policy = struct_pb2.Struct()
    policy.update({"thresholdRatio": 0.61})
    return policy


# RPC -> its call with A's session id (a caller other than A sends the same request).
RPCS: dict[str, Call] = {
    "SessionService.CreateSession": lambda s: _unary(
        s.sessions.CreateSession(spb.CreateSessionRequest(session_id=SID))
    ),
    "SessionService.AppendEvents": lambda s: _unary(
        s.sessions.AppendEvents(spb.AppendEventsRequest(session_id=SID, events=[user("more")]))
    ),
    "SessionService.ListEvents": lambda s: _collect(
        s.sessions.ListEvents(spb.ListEventsRequest(session_id=SID, follow=True)),
        first_only=True,
    ),
    "SessionService.GetSurface": lambda s: _unary(
        s.sessions.GetSurface(spb.GetSurfaceRequest(session_id=SID, detail=True))
    ),
    "SessionService.BuildRequest": lambda s: _unary(
        s.sessions.BuildRequest(spb.BuildRequestRequest(session_id=SID))
    ),
    "SessionService.ListSessions": lambda s: _unary(
        s.sessions.ListSessions(spb.ListSessionsRequest())
    ),
    "SessionService.DeleteSession": lambda s: _unary(
        s.sessions.DeleteSession(spb.DeleteSessionRequest(session_id=SID))
    ),
    "SessionService.Recall": lambda s: _unary(
        s.sessions.Recall(spb.RecallRequest(session_id=SID, seqs=[0, 1, 2]))
    ),
    "CompactionService.RevertCompaction": lambda s: _unary(
        s.compaction.RevertCompaction(
            cpb.RevertCompactionRequest(session_id=SID, compaction_id="never-compacted")
        )
    ),
    "CompactionService.CheckPressure": lambda s: _unary(
        s.compaction.CheckPressure(cpb.CheckPressureRequest(session_id=SID))
    ),
    "CompactionService.WatchPressure": lambda s: _collect(
        s.compaction.WatchPressure(cpb.WatchPressureRequest(session_id=SID)), first_only=True
    ),
    "CompactionService.PrepareStep": lambda s: _collect(
        s.compaction.PrepareStep(cpb.PrepareStepRequest(session_id=SID, turn=1))
    ),
    "CompactionService.PrepareStepUnary": lambda s: _unary(
        s.compaction.PrepareStepUnary(cpb.PrepareStepUnaryRequest(session_id=SID, turn=1))
    ),
    "CompactionService.Compact": lambda s: _collect(
        s.compaction.Compact(cpb.CompactRequest(session_id=SID))
    ),
    "CompactionService.RecoverFromError": lambda s: _collect(
        s.compaction.RecoverFromError(
            cpb.RecoverFromErrorRequest(session_id=SID, turn=1, error=OVERFLOW)
        )
    ),
    "CompactionService.SwitchModel": lambda s: _collect(
        s.compaction.SwitchModel(cpb.SwitchModelRequest(session_id=SID, destination=OPENAI))
    ),
    "CompactionService.ClassifyProviderError": lambda s: _unary(
        s.compaction.ClassifyProviderError(
            cpb.ClassifyProviderErrorRequest(
                raw=cpb.RawProviderError(http_status=429, body=b'{"error":{"message":"slow"}}')
            )
        )
    ),
    "CompactionService.PlanCompaction": lambda s: _unary(
        s.compaction.PlanCompaction(cpb.PlanCompactionRequest(session_id=SID))
    ),
    "CompactionService.ListBrackets": lambda s: _unary(
        s.compaction.ListBrackets(cpb.ListBracketsRequest(session_id=SID))
    ),
}


async def _reflect(stubs: Stubs, path: str) -> list[Message]:
    call: Any = stubs.channel.stream_stream(
        path,
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply: Message = await asyncio.wait_for(call.read(), 30)
    call.cancel()
    return [reply]


OPEN: dict[str, Call] = {
    "Health.Check": lambda s: _unary(
        health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest())
    ),
    "Health.Watch": lambda s: _collect(
        health_pb2_grpc.HealthStub(s.channel).Watch(health_pb2.HealthCheckRequest()),
        first_only=True,
    ),
    "ServerReflection.v1alpha": lambda s: _reflect(
        s, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    ),
    "ServerReflection.v1": lambda s: _reflect(
        s, "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    ),
}
assert reflection_pb2_grpc  # the v1alpha stubs' module: its messages serve both versions


def expected(rpc: str, caller: str) -> Code:
    """The status ``caller`` must get from ``rpc`` on A's session."""
    if rpc in OPEN:
        return Code.OK
    if caller in ("none", "bad-token"):
        return Code.UNAUTHENTICATED
    if caller in OWNERS and rpc.endswith("CreateSession"):
        return Code.ALREADY_EXISTS  # A's session has a policy; this create names none
    if caller in OWNERS:
        return CASES[rpc][3]  # what the owner gets with authentication off
    if rpc.endswith(("CreateSession", "ListSessions", "ClassifyProviderError")):
        return Code.OK  # B's own id space, B's own list, no session at all
    return Code.NOT_FOUND


@dataclass
class Answer:
    """What one call returned: its code and every byte the caller received."""

    code: Code
    received: bytes


async def _answer(call: Call, stubs: Stubs) -> Answer:
    try:
        replies = await call(stubs)
    except grpc.aio.AioRpcError as error:
        trailing = b"".join(
            v if isinstance(v, bytes) else str(v).encode()
            for _, v in (error.trailing_metadata() or ())
        )
        return Answer(error.code(), (error.details() or "").encode() + trailing)
    return Answer(Code.OK, b"".join(r.SerializeToString() for r in replies))


# ---- the server and its callers ------------------------------------------------------------


@dataclass
class Matrix:
    server: RunningServer
    callers: dict[str, Stubs]


@pytest.fixture
async def matrix(server_config: config.ServerConfig, tmp_path: Path) -> AsyncIterator[Matrix]:
    ca = Authority(tmp_path / "ca")
    issued = ca.server()
    settings = replace(
        server_config,
        tls_cert_file=str(issued.cert_file),
        tls_key_file=str(issued.key_file),
        tls_client_ca_file=str(ca.cert_file),
        auth_tokens={tenant: hash_token(token) for tenant, token in TOKENS.items()},
        auth_identities={A_IDENTITY: "a"},
    )
    running = await create_server(settings)
    stranger = ca.client("stranger", spiffe_id="spiffe://example.org/nobody")
    agent_a = ca.client("agent-a", spiffe_id=A_IDENTITY)
    tls = {
        "stranger": grpc.ssl_channel_credentials(ca.cert, stranger.key, stranger.cert),
        "agent-a": grpc.ssl_channel_credentials(ca.cert, agent_a.key, agent_a.cert),
    }
    plans = {
        "none": tls["stranger"],
        "bad-token": _with_token(tls["stranger"], "not-a-token-we-issued"),
        "tenant-a": _with_token(tls["stranger"], TOKENS["a"]),
        "tenant-b": _with_token(tls["stranger"], TOKENS["b"]),
        "mtls-a": tls["agent-a"],
    }
    channels = {
        name: grpc.aio.secure_channel(f"localhost:{running.port}", creds)
        for name, creds in plans.items()
    }
    try:
        yield Matrix(
            running,
            {
                name: Stubs(ch, SessionServiceStub(ch), CompactionServiceStub(ch))
                for name, ch in channels.items()
            },
        )
    finally:
        for channel in channels.values():
            await channel.close()
        await running.stop(0)


def _with_token(tls: grpc.ChannelCredentials, token: str) -> grpc.ChannelCredentials:
    return grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(token))


async def _delete_if_there(stubs: Stubs) -> None:
    code = Code.OK
    try:
        await stubs.sessions.DeleteSession(spb.DeleteSessionRequest(session_id=SID))
    except grpc.aio.AioRpcError as error:
        code = error.code()
    assert code in (Code.OK, Code.NOT_FOUND)


async def _seed(owner: Stubs) -> int:
    """A's session, made afresh: a secret system prompt, policy and message; an open turn."""
    await _delete_if_there(owner)
    await owner.sessions.CreateSession(
        spb.CreateSessionRequest(session_id=SID, compaction_policy=_policy())
    )
    opening = [
        system(f"Be brief. {SECRET}"),
        header("openai", "gpt-4o-mini"),
        turn_start(1),
        user(f"Hi, my key is {SECRET}"),
    ]
    reply = await owner.sessions.AppendEvents(
        spb.AppendEventsRequest(session_id=SID, events=opening)
    )
    return reply.revision


async def _b_cleanup(b: Stubs) -> None:
    """Remove what B made under the same id, so the next caller meets only A's session."""
    await _delete_if_there(b)


def test_the_matrix_names_every_declared_rpc() -> None:
    assert set(RPCS) == declared_rpcs() == set(CASES)


@pytest.mark.parametrize("rpc", [*sorted(RPCS), *sorted(OPEN)])
async def test_every_caller_gets_its_status_and_no_byte_of_a_reaches_another(
    rpc: str, matrix: Matrix
) -> None:
    call = RPCS.get(rpc) or OPEN[rpc]
    owner = matrix.callers["tenant-a"]
    got: dict[str, Code] = {}
    for caller in CALLERS:
        revision = await _seed(owner)
        answer = await _answer(call, matrix.callers[caller])
        got[caller] = answer.code
        if caller not in OWNERS:
            assert SECRET.encode() not in answer.received, (rpc, caller)
            surface = await owner.sessions.GetSurface(spb.GetSurfaceRequest(session_id=SID))
            assert surface.revision == revision, (rpc, caller)  # nothing written to A's log
        await _b_cleanup(matrix.callers["tenant-b"])

    assert got == {caller: expected(rpc, caller) for caller in CALLERS}
    assert Code.PERMISSION_DENIED not in got.values()  # existence is never revealed


async def test_a_refused_call_says_nothing_about_what_was_wrong(matrix: Matrix) -> None:
    refusals = set()
    for caller in ("none", "bad-token"):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await matrix.callers[caller].sessions.GetSurface(spb.GetSurfaceRequest(session_id=SID))
        refusals.add((caught.value.code(), caught.value.details()))
    assert refusals == {(Code.UNAUTHENTICATED, "missing or invalid credentials")}


async def test_tenant_b_lists_only_its_own_sessions_and_its_page_tokens_stay_its_own(
    matrix: Matrix,
) -> None:
    a, b = matrix.callers["tenant-a"], matrix.callers["tenant-b"]
    for sid in ("a-1", "a-2", "a-3"):
        await a.sessions.CreateSession(spb.CreateSessionRequest(session_id=sid))
    await b.sessions.CreateSession(spb.CreateSessionRequest(session_id="b-1"))

    page = await a.sessions.ListSessions(spb.ListSessionsRequest(page_size=1))
    from_b = await b.sessions.ListSessions(spb.ListSessionsRequest(page_token=page.next_page_token))
    mine = await b.sessions.ListSessions(spb.ListSessionsRequest())

    assert [s.session_id for s in page.sessions] == ["a-1"]
    assert [s.session_id for s in mine.sessions] == ["b-1"]
    assert [s.session_id for s in from_b.sessions] == ["b-1"]  # A's token lists B's own


async def test_the_same_id_is_two_sessions_for_two_tenants(matrix: Matrix) -> None:
    a, b = matrix.callers["tenant-a"], matrix.callers["mtls-a"]
    other = matrix.callers["tenant-b"]
    await _seed(a)
    created = await other.sessions.CreateSession(spb.CreateSessionRequest(session_id=SID))
    await other.sessions.AppendEvents(
        spb.AppendEventsRequest(session_id=SID, events=[user("B's own words")])
    )

    assert created.session.revision == 0
    assert not created.session.HasField("compaction_policy")
    a_surface = await b.sessions.GetSurface(spb.GetSurfaceRequest(session_id=SID))
    b_surface = await other.sessions.GetSurface(spb.GetSurfaceRequest(session_id=SID))
    assert SECRET.encode() in a_surface.SerializeToString()
    assert SECRET.encode() not in b_surface.SerializeToString()
    assert b"B's own words" not in a_surface.SerializeToString()
