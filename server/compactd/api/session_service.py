"""``compactd.v1.SessionService``: the log, the surface and request reconstruction."""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2

from compactd.api.replies import Serialized, after_a_turn
from compactd.api.status import handle_errors
from compactd.core.validation import Origin, non_finite_paths
from compactd.errors import FieldViolation, InvalidArgument
from compactd.reasons import Reason
from compactd.service.forking import checked_parent, fork_into
from compactd.service.inspection import InspectionService
from compactd.service.policy_message import field_path, policy_of, settings_of
from compactd.service.recall import recall
from compactd.service.requests import (
    declared_tools,
    request_reply_in_steps,
    surface_reply_in_steps,
)
from compactd.service.sessions import Lineage, SessionHandle, SessionManager
from compactd.speed import in_steps
from compactd.store.base import SessionRecord
from compactd.v1 import session_service_pb2 as pb
from compactd.v1 import session_service_pb2_grpc

Context = grpc.aio.ServicerContext[Any, Any]
_SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class SessionServicer(session_service_pb2_grpc.SessionServiceServicer):
    """Thin adapter from the wire to ``SessionManager``."""

    def __init__(
        self,
        manager: SessionManager,
        *,
        max_batch_events: int,
        inspection: InspectionService,
        after_append: Callable[[SessionHandle], None] | None = None,
    ) -> None:
        self._after_append = after_append  # prepare-ahead (``AheadService.after_append``)
        self._manager = manager
        self._max_batch_events = max_batch_events
        self._inspection = inspection  # GetSurface's detail

    @handle_errors
    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Context
    ) -> pb.CreateSessionResponse:
        session_id = request.session_id or uuid.uuid4().hex
        if not _SESSION_ID.match(session_id):
            raise InvalidArgument(
                "session_id must be 1-128 characters of [A-Za-z0-9._:-]",
                violations=[FieldViolation("session_id", "1-128 of [A-Za-z0-9._:-]")],
            )
        policy = _requested_policy(request)
        if policy is not None:
            typed = request.HasField("policy")
            # Errors name the field in the form the caller sent.
            self._manager.validate_policy(policy, field=field_path if typed else None)
        lineage = _lineage(request)
        parent = await checked_parent(self._manager, lineage)
        record = await self._manager.create(session_id, policy, lineage=lineage)
        revision = record.revision
        if parent is not None and lineage.fork_at_seq is not None and revision == 0:
            revision = await fork_into(self._manager, record, parent, lineage.fork_at_seq)
        return pb.CreateSessionResponse(session=_session(record, revision))

    @handle_errors
    async def AppendEvents(
        self, request: pb.AppendEventsRequest, context: Context
    ) -> pb.AppendEventsResponse:
        require_session_id(request.session_id)
        # The append catches up (a shared store's fold), so a resident handle is the one.
        handle = self._manager.in_memory(request.session_id) or await self._manager.get(
            request.session_id, fresh=False
        )
        expected = request.expected_last_seq if request.HasField("expected_last_seq") else None
        result = await handle.append(
            request.events,
            expected_last_seq=expected,
            max_events=self._max_batch_events,
            origin=Origin.CLIENT,
        )
        if self._after_append is not None:
            self._after_append(handle)
        return pb.AppendEventsResponse(seqs=result.seqs, revision=result.revision)

    @handle_errors
    async def ListEvents(
        self, request: pb.ListEventsRequest, context: Context
    ) -> AsyncIterator[pb.ListEventsResponse]:
        if request.from_seq < 0:
            raise InvalidArgument(
                "from_seq must be >= 0", violations=[FieldViolation("from_seq", "must be >= 0")]
            )
        handle = await self._handle(request.session_id)
        next_seq = request.from_seq
        end = handle.revision
        async for event in handle.read(next_seq, end):
            yield pb.ListEventsResponse(event=event)
            next_seq = event.seq + 1
        if not request.follow:
            return
        async for revision in handle.revisions():
            if revision <= next_seq:
                continue
            async for event in handle.read(next_seq, revision):
                yield pb.ListEventsResponse(event=event)
                next_seq = event.seq + 1

    @handle_errors
    async def GetSurface(  # type: ignore[override]  # grpc sends Serialized as it is (replies)
        self, request: pb.GetSurfaceRequest, context: Context
    ) -> Serialized:
        handle = await self._handle(request.session_id)
        if request.detail:
            route = request.route if request.HasField("route") else None
            return await after_a_turn(await self._inspection.surface(handle, route))
        # Under the lock: never show a batch that is admitted but not yet durable. In steps: a
        # large surface's reply never holds the loop for long (``service.requests``).
        async with handle.lock:
            return await after_a_turn(await in_steps(surface_reply_in_steps(handle.fold)))

    @handle_errors
    async def BuildRequest(  # type: ignore[override]  # grpc sends Serialized as it is
        self, request: pb.BuildRequestRequest, context: Context
    ) -> Serialized:
        handle = await self._handle(request.session_id)
        async with handle.lock:
            reply = request_reply_in_steps(handle.fold, declared_tools(handle), handle.incarnation)
            return await after_a_turn(await in_steps(reply))

    @handle_errors
    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Context
    ) -> pb.ListSessionsResponse:
        if request.page_size < 0:
            raise InvalidArgument(
                "page_size must be >= 0", violations=[FieldViolation("page_size", "must be >= 0")]
            )
        size = min(request.page_size or _DEFAULT_PAGE, _MAX_PAGE)
        after = _after(request.page_token)
        parent = request.parent_session_id or None
        records = await self._manager.list(after=after, limit=size + 1, parent=parent)
        page = records[:size]
        more = len(records) > size
        return pb.ListSessionsResponse(
            sessions=[_session(record, record.revision) for record in page],
            next_page_token=_page_token(page[-1].session_id) if more else "",
        )

    @handle_errors
    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: Context
    ) -> pb.DeleteSessionResponse:
        require_session_id(request.session_id)
        await self._manager.delete(request.session_id)
        return pb.DeleteSessionResponse()

    @handle_errors
    async def Recall(self, request: pb.RecallRequest, context: Context) -> pb.RecallResponse:
        handle = await self._handle(request.session_id)
        return await recall(handle, request)

    async def _handle(self, session_id: str, *, fresh: bool = True) -> SessionHandle:
        require_session_id(session_id)
        return await self._manager.get(session_id, fresh=fresh)


def require_session_id(session_id: str) -> None:
    """Reject a request that names no session (every RPC of both services needs one)."""
    if not session_id:
        raise InvalidArgument(
            "session_id is required", violations=[FieldViolation("session_id", "required")]
        )


def _lineage(request: pb.CreateSessionRequest) -> Lineage:
    """The requested parent and fork seq (a parent id of the form session ids take)."""
    parent = request.parent_session_id
    if parent and not _SESSION_ID.match(parent):
        raise InvalidArgument(
            "parent_session_id must be 1-128 characters of [A-Za-z0-9._:-]",
            violations=[FieldViolation("parent_session_id", "1-128 of [A-Za-z0-9._:-]")],
        )
    seq = request.fork_at_seq if request.HasField("fork_at_seq") else None
    return Lineage(parent, seq)


def _requested_policy(request: pb.CreateSessionRequest) -> dict[str, object] | None:
    """The request's policy settings, from whichever form it sent (both: INVALID_ARGUMENT)."""
    typed, legacy = request.HasField("policy"), request.HasField("compaction_policy")
    if typed and legacy:
        raise InvalidArgument(
            "set policy or the deprecated compaction_policy, not both",
            violations=[FieldViolation("policy", "set either policy or compaction_policy")],
            reason=Reason.POLICY_INVALID,
        )
    if typed:
        return settings_of(request.policy)
    if legacy:
        return _policy(request.compaction_policy)
    return None


_DEFAULT_PAGE, _MAX_PAGE = 100, 1000
_TOKEN_PREFIX = "after:"


def _page_token(last_id: str) -> str:
    """An opaque token for the page after ``last_id`` (scoped by the listing: the caller's
    tenant, so another tenant's token lists only its own sessions)."""
    return base64.urlsafe_b64encode((_TOKEN_PREFIX + last_id).encode()).decode()


def _after(page_token: str) -> str:
    """The id a page token resumes after ("" for no token); INVALID_ARGUMENT for a bad one."""
    if not page_token:
        return ""
    try:
        text = base64.urlsafe_b64decode(page_token.encode("ascii")).decode()
    except (ValueError, UnicodeError):
        text = ""
    # A token names the last session id of a page: anything else was not issued here.
    if not text.startswith(_TOKEN_PREFIX) or not _SESSION_ID.match(text[len(_TOKEN_PREFIX) :]):
        raise InvalidArgument(
            "page_token is not a token this server issued",
            violations=[FieldViolation("page_token", "not issued by ListSessions")],
        )
    return text[len(_TOKEN_PREFIX) :]


def _policy(struct: struct_pb2.Struct) -> dict[str, object]:
    """A session policy as plain JSON; a NaN or infinite number is POLICY_INVALID, named."""
    bad = sorted(non_finite_paths(struct, "compaction_policy"))
    if bad:
        raise InvalidArgument(
            f"{bad[0]}: numbers in a policy must be finite",
            violations=[FieldViolation(path, "must be a finite number") for path in bad],
            reason=Reason.POLICY_INVALID,
        )
    policy: dict[str, object] = json_format.MessageToDict(struct)
    return policy


def _session(record: SessionRecord, revision: int) -> pb.Session:
    session = pb.Session(
        session_id=record.session_id,
        revision=revision,
        parent_session_id=record.parent_session_id,
        fork_at_seq=record.fork_at_seq,
    )
    session.create_time.FromDatetime(record.create_time)
    if record.policy_json:
        policy = struct_pb2.Struct()
        json_format.Parse(record.policy_json, policy)
        session.compaction_policy.CopyFrom(policy)
        session.policy.CopyFrom(policy_of(json.loads(record.policy_json)))
    return session
