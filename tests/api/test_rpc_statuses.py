"""Every RPC of both services answers a real status through a real server (never UNKNOWN).

The server is the conftest's: ``create_server`` with its OpenTelemetry interceptor, on a real
SQLite file. Each RPC is called twice, with a request it must refuse and with one it must serve
(or refuse for a stated reason); the table must name every RPC the contract declares.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from tests.builders import header, system, turn_start, user

Code = grpc.StatusCode
Call = Callable[[Any, Any, str], Awaitable[None]]
SID = "statuses"
OPENAI = events_pb2.Route(provider="openai", model="gpt-4o")
OVERFLOW = cpb.ProviderError(kind=cpb.PROVIDER_ERROR_KIND_CONTEXT_WINDOW_EXCEEDED)


async def drain(stream: Any, *, first_only: bool = False) -> None:
    async for _ in stream:
        if first_only:
            stream.cancel()
            return


async def create(sessions: Any, compaction: Any, sid: str) -> None:
    await sessions.CreateSession(spb.CreateSessionRequest(session_id=sid))


async def append(sessions: Any, compaction: Any, sid: str) -> None:
    request = spb.AppendEventsRequest(session_id=sid, events=[user("more")])
    await sessions.AppendEvents(request)


async def list_events(sessions: Any, compaction: Any, sid: str) -> None:
    await drain(sessions.ListEvents(spb.ListEventsRequest(session_id=sid)))


async def get_surface(sessions: Any, compaction: Any, sid: str) -> None:
    await sessions.GetSurface(spb.GetSurfaceRequest(session_id=sid))


async def build_request(sessions: Any, compaction: Any, sid: str) -> None:
    await sessions.BuildRequest(spb.BuildRequestRequest(session_id=sid))


async def list_sessions(sessions: Any, compaction: Any, sid: str) -> None:
    token = "" if sid == SID else "forged"
    await sessions.ListSessions(spb.ListSessionsRequest(page_token=token))


async def delete_session(sessions: Any, compaction: Any, sid: str) -> None:
    await sessions.DeleteSession(spb.DeleteSessionRequest(session_id=sid))


async def recall(sessions: Any, compaction: Any, sid: str) -> None:
    await sessions.Recall(spb.RecallRequest(session_id=sid, seqs=[0]))


async def revert_compaction(sessions: Any, compaction: Any, sid: str) -> None:
    request = cpb.RevertCompactionRequest(session_id=sid, compaction_id="never-compacted")
    await compaction.RevertCompaction(request)


async def check_pressure(sessions: Any, compaction: Any, sid: str) -> None:
    await compaction.CheckPressure(cpb.CheckPressureRequest(session_id=sid))


async def watch_pressure(sessions: Any, compaction: Any, sid: str) -> None:
    await drain(compaction.WatchPressure(cpb.WatchPressureRequest(session_id=sid)), first_only=True)


async def prepare_step(sessions: Any, compaction: Any, sid: str) -> None:
    await drain(compaction.PrepareStep(cpb.PrepareStepRequest(session_id=sid, turn=1)))


async def prepare_step_unary(sessions: Any, compaction: Any, sid: str) -> None:
    await compaction.PrepareStepUnary(cpb.PrepareStepUnaryRequest(session_id=sid, turn=1))


async def compact(sessions: Any, compaction: Any, sid: str) -> None:
    await drain(compaction.Compact(cpb.CompactRequest(session_id=sid)))


async def recover_from_error(sessions: Any, compaction: Any, sid: str) -> None:
    request = cpb.RecoverFromErrorRequest(session_id=sid, turn=1, error=OVERFLOW)
    await drain(compaction.RecoverFromError(request))


async def switch_model(sessions: Any, compaction: Any, sid: str) -> None:
    request = cpb.SwitchModelRequest(session_id=sid, destination=OPENAI)
    await drain(compaction.SwitchModel(request))


async def classify_provider_error(sessions: Any, compaction: Any, sid: str) -> None:
    body = b'{"error":{"message":"slow down","code":"rate_limit_exceeded"}}' if sid else b""
    raw = cpb.RawProviderError(http_status=429 if sid else 0, body=body)
    await compaction.ClassifyProviderError(cpb.ClassifyProviderErrorRequest(raw=raw))


async def plan_compaction(sessions: Any, compaction: Any, sid: str) -> None:
    await compaction.PlanCompaction(cpb.PlanCompactionRequest(session_id=sid))


async def list_brackets(sessions: Any, compaction: Any, sid: str) -> None:
    await compaction.ListBrackets(cpb.ListBracketsRequest(session_id=sid))


# RPC -> (its call; another request: "nope" names a session that does not exist, "" leaves the
# request empty; that request's code; the code for the live session below: a system prompt, a
# routed header, an open turn).
CASES: dict[str, tuple[Call, str, Code, Code]] = {
    "SessionService.CreateSession": (create, "", Code.OK, Code.OK),  # a retry: idempotent
    "SessionService.AppendEvents": (append, "nope", Code.NOT_FOUND, Code.OK),
    "SessionService.ListEvents": (list_events, "nope", Code.NOT_FOUND, Code.OK),
    "SessionService.GetSurface": (get_surface, "nope", Code.NOT_FOUND, Code.OK),
    "SessionService.BuildRequest": (build_request, "nope", Code.NOT_FOUND, Code.OK),
    "SessionService.ListSessions": (list_sessions, "", Code.INVALID_ARGUMENT, Code.OK),
    "SessionService.DeleteSession": (delete_session, "nope", Code.NOT_FOUND, Code.OK),
    "SessionService.Recall": (recall, "nope", Code.NOT_FOUND, Code.OK),
    "CompactionService.CheckPressure": (check_pressure, "nope", Code.NOT_FOUND, Code.OK),
    "CompactionService.WatchPressure": (watch_pressure, "nope", Code.NOT_FOUND, Code.OK),
    "CompactionService.PrepareStep": (prepare_step, "nope", Code.NOT_FOUND, Code.OK),
    "CompactionService.PrepareStepUnary": (
        prepare_step_unary,
        "nope",
        Code.NOT_FOUND,
        Code.OK,
    ),
    "CompactionService.Compact": (compact, "nope", Code.NOT_FOUND, Code.ABORTED),  # turn open
    "CompactionService.RecoverFromError": (recover_from_error, "nope", Code.NOT_FOUND, Code.OK),
    "CompactionService.SwitchModel": (switch_model, "nope", Code.NOT_FOUND, Code.OK),
    "CompactionService.ClassifyProviderError": (
        classify_provider_error,
        "",
        Code.INVALID_ARGUMENT,
        Code.OK,
    ),
    "CompactionService.PlanCompaction": (plan_compaction, "nope", Code.NOT_FOUND, Code.OK),
    "CompactionService.ListBrackets": (list_brackets, "nope", Code.NOT_FOUND, Code.OK),
    "CompactionService.RevertCompaction": (
        revert_compaction,
        "nope",
        Code.NOT_FOUND,
        Code.ABORTED,  # turn open: COMPACTION_BUSY, as Compact
    ),
}


def declared_rpcs() -> set[str]:
    files = (spb.DESCRIPTOR, cpb.DESCRIPTOR)
    return {
        f"{service.name}.{method.name}"
        for file in files
        for service in file.services_by_name.values()
        for method in service.methods
    }


def test_the_table_names_every_declared_rpc() -> None:
    assert set(CASES) == declared_rpcs()


async def status_of(call: Call, sessions: Any, compaction: Any, sid: str) -> Code:
    try:
        await call(sessions, compaction, sid)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return Code.OK


@pytest.mark.parametrize("rpc", sorted(CASES))
async def test_every_rpc_answers_a_real_status(rpc: str, sessions: Any, compaction: Any) -> None:
    call, other, other_code, live = CASES[rpc]
    await sessions.CreateSession(spb.CreateSessionRequest(session_id=SID))
    opening = [system("Be brief."), header("openai", "gpt-4o-mini"), turn_start(1), user("Hi")]
    await sessions.AppendEvents(spb.AppendEventsRequest(session_id=SID, events=opening))

    answered = await status_of(call, sessions, compaction, other)
    served = await status_of(call, sessions, compaction, SID)

    assert Code.UNKNOWN not in (answered, served)
    assert (answered, served) == (other_code, live)


async def test_an_empty_session_id_is_invalid_argument_everywhere_it_is_required(
    sessions: Any, compaction: Any
) -> None:
    for rpc, (call, *_) in sorted(CASES.items()):
        if rpc.endswith(("CreateSession", "ClassifyProviderError")):
            continue
        assert await status_of(call, sessions, compaction, "") == Code.INVALID_ARGUMENT, rpc
