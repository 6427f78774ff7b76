"""The blocking client.

Example::

    with CompactdClient("127.0.0.1:50051") as client:
        session = client.create_session()
        client.append_events(session.session_id, [user_message("hi")])
        with client.watch_pressure(session.session_id) as watch:
            for report in watch:
                print(report.measured_tokens, report.trigger_tokens)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc

from compactd_client import _requests as rq
from compactd_client import recall as recall_tool
from compactd_client._requests import UNSET, Timeout, resolve_timeout
from compactd_client.config import DEFAULT_RETRY, RetryPolicy, auth_metadata, channel_options
from compactd_client.errors import CompactdError, from_rpc_error
from compactd_client.steps import DEFAULT_HELD_SESSIONS, HeldRequests, PreparedStep
from compactd_client.streams import CompactionStream, ServerStream
from compactd_client.v1.compaction_service_pb2 import (
    CompactionProgress,
    CompactResult,
    ListBracketsRequest,
    ListBracketsResponse,
    PlanCompactionRequest,
    PlanCompactionResponse,
    PlanMode,
    PrepareStepResult,
    PressureReport,
    ProviderError,
    RecoverFromErrorResult,
    RevertCompactionRequest,
    RevertCompactionResponse,
    SwitchModelResult,
)
from compactd_client.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd_client.v1.events_pb2 import Route, SessionEvent
from compactd_client.v1.session_service_pb2 import (
    AppendEventsResponse,
    BuildRequestRequest,
    BuildRequestResponse,
    DeleteSessionRequest,
    GetSurfaceRequest,
    GetSurfaceResponse,
    ListEventsRequest,
    ListSessionsRequest,
    ListSessionsResponse,
    RecallRequest,
    RecallResponse,
    Session,
)
from compactd_client.v1.session_service_pb2_grpc import SessionServiceStub

__all__ = ["CompactdClient"]

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class CompactdClient:
    """A blocking client for both compactd services over one channel.

    Every method raises a :class:`compactd_client.errors.CompactdError` subclass on failure.
    Each takes ``timeout``: seconds, None for no deadline, or unset for the client default
    (``timeout`` for unary calls, ``stream_timeout`` for streaming ones).

    Args:
        target: ``host:port`` of the server.
        credentials: TLS credentials (``grpc.ssl_channel_credentials``, with a client key and
            certificate for mutual TLS); None for a plaintext channel.
        token: A bearer token naming the caller's tenant, sent as ``authorization: Bearer``
            with every call; use it over TLS (or on loopback): it is a password.
        timeout: Default deadline of unary calls, in seconds (None: no deadline).
        stream_timeout: Default deadline of streaming calls (None: no deadline, the default,
            since watches stay open and summaries take a model call).
        retry: Retry policy for the idempotent RPCs (gRPC service config); None disables it.
        metadata: Metadata sent with every call (e.g. ``("authorization", "Bearer ...")``).
        options: Extra channel options.
        held_sessions: Most sessions whose last request ``prepare_step`` holds (the least
            recently stepped is dropped first; ``delete_session``, ``forget_held_request`` and
            ``close`` drop them too). 0 holds none: every step then answers the full request.
    """

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        timeout: float | None = 30.0,
        stream_timeout: float | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, str | int]] = (),
        held_sessions: int = DEFAULT_HELD_SESSIONS,
    ) -> None:
        opts = channel_options(retry, options)
        if credentials is None:
            channel = grpc.insecure_channel(target, options=opts)
        else:
            channel = grpc.secure_channel(target, credentials, options=opts)
        self._channel = channel
        self._timeout = timeout
        self._stream_timeout = stream_timeout
        self._metadata = auth_metadata(token, metadata)
        self._sessions = SessionServiceStub(channel)
        self._compaction = CompactionServiceStub(channel)
        self._held = HeldRequests(held_sessions)

    def close(self) -> None:
        """Closes the channel, cancelling calls still in flight; drops the held requests."""
        self._held.clear()
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _unary(
        self,
        method: grpc.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
        timeout: Timeout,
    ) -> _Resp:
        try:
            return method(
                request,
                timeout=resolve_timeout(timeout, self._timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err

    def _stream(
        self,
        method: grpc.UnaryStreamMultiCallable[_Req, _Resp],
        request: _Req,
        timeout: Timeout,
    ) -> grpc.CallIterator[_Resp]:
        return method(
            request,
            timeout=resolve_timeout(timeout, self._stream_timeout),
            metadata=self._metadata,
        )

    # SessionService

    def create_session(
        self,
        session_id: str = "",
        *,
        compaction_policy: Mapping[str, Any] | None = None,
        parent_session_id: str = "",
        fork_at_seq: int | None = None,
        timeout: Timeout = UNSET,
    ) -> Session:
        """Creates an empty session, or a sub-agent's child session.

        Args:
            session_id: 1-128 characters of ``[A-Za-z0-9._:-]``; empty lets the server choose.
            compaction_policy: Per-session policy overrides with the spec's keys
                (``thresholdRatio``, ``modelPolicies``...).
            parent_session_id: Make the session a child of this session (of the same tenant).
            fork_at_seq: With a parent: start the child with a copy of the parent's surface as
                it stood right after this seq.
            timeout: Deadline in seconds.

        Raises:
            AlreadyExistsError: the id is taken (with another policy or parent).
            InvalidArgumentError: a malformed id or policy, or a fork seq outside the parent's
                log (reason ``FORK_SEQ_INVALID``).
            NotFoundError: the parent does not exist.
        """
        request = rq.create_session(session_id, compaction_policy, parent_session_id, fork_at_seq)
        response = self._unary(self._sessions.CreateSession, request, timeout)
        return response.session

    def append_events(
        self,
        session_id: str,
        events: Iterable[SessionEvent],
        *,
        expected_last_seq: int | None = None,
        timeout: Timeout = UNSET,
    ) -> AppendEventsResponse:
        """Appends events atomically; returns their seqs and the new revision.

        Args:
            session_id: The session.
            events: Events built with :mod:`compactd_client.events` (seq unset).
            expected_last_seq: Optimistic concurrency: the last seq the caller has seen
                (-1 for an empty log); None skips the check.
            timeout: Deadline in seconds.

        Raises:
            SeqConflictError: ``expected_last_seq`` does not match the log.
            InvalidArgumentError: a malformed event (``violations`` name the fields).
            NotFoundError: no such session.
        """
        request = rq.append_events(session_id, events, expected_last_seq)
        return self._unary(self._sessions.AppendEvents, request, timeout)

    def list_events(
        self,
        session_id: str,
        *,
        from_seq: int = 0,
        follow: bool = False,
        timeout: Timeout = UNSET,
    ) -> ServerStream[SessionEvent]:
        """Streams the log from ``from_seq``; with ``follow``, keeps streaming new events."""
        request = ListEventsRequest(session_id=session_id, from_seq=from_seq, follow=follow)
        call = self._stream(self._sessions.ListEvents, request, timeout)
        return ServerStream(call, lambda m: m.event)

    def list_sessions(
        self,
        *,
        page_size: int = 0,
        page_token: str = "",
        parent_session_id: str = "",
        timeout: Timeout = UNSET,
    ) -> ListSessionsResponse:
        """One page of the caller's tenant's sessions, in id order (``next_page_token``: "" at
        the end); with ``parent_session_id``, that session's children only."""
        request = ListSessionsRequest(
            page_size=page_size, page_token=page_token, parent_session_id=parent_session_id
        )
        return self._unary(self._sessions.ListSessions, request, timeout)

    def delete_session(self, session_id: str, *, timeout: Timeout = UNSET) -> None:
        """Deletes the session and its log, durably.

        Raises:
            NotFoundError: no such session (of the caller's tenant).
        """
        self._held.forget(session_id)
        request = DeleteSessionRequest(session_id=session_id)
        self._unary(self._sessions.DeleteSession, request, timeout)

    def get_surface(self, session_id: str, *, timeout: Timeout = UNSET) -> GetSurfaceResponse:
        """Returns the current surface (nodes in position order, with projected messages)."""
        request = GetSurfaceRequest(session_id=session_id)
        return self._unary(self._sessions.GetSurface, request, timeout)

    def build_request(self, session_id: str, *, timeout: Timeout = UNSET) -> BuildRequestResponse:
        """Returns the reconstructed model request (messages, config, tools)."""
        request = BuildRequestRequest(session_id=session_id)
        return self._unary(self._sessions.BuildRequest, request, timeout)

    def recall(
        self,
        session_id: str,
        handle: str = "",
        *,
        seqs: Sequence[int] = (),
        query: str = "",
        max_bytes: int = 0,
        page_token: str = "",
        timeout: Timeout = UNSET,
    ) -> RecallResponse:
        """Returns one page of the original events behind a recall handle (or ``seqs``).

        Raises:
            NotFoundError: no such session (of the caller's tenant), or the handle names
                nothing in it (reason ``RECALL_HANDLE_UNKNOWN``).
            InvalidArgumentError: a malformed handle, seqs outside the log, a bad page token.
        """
        request = RecallRequest(
            session_id=session_id, handle=handle, seqs=seqs, query=query,
            max_bytes=max_bytes, page_token=page_token,
        )  # fmt: skip
        return self._unary(self._sessions.Recall, request, timeout)

    def answer_recall(
        self,
        session_id: str,
        tool_call: recall_tool.ToolCallLike,
        *,
        max_bytes: int = recall_tool.DEFAULT_TOOL_MAX_BYTES,
        timeout: Timeout = UNSET,
    ) -> SessionEvent:
        """Answers the model's call of the recall tool: the ``tool/result`` event to append
        and send back (the recalled page as text; an error result the model can read for an
        unknown handle or unusable arguments).

        ``tool_call``: compactd's ``ToolCallBlock``, an OpenAI ``tool_calls`` item or an
        Anthropic ``tool_use`` block.

        Raises:
            NotFoundError: no such session (of the caller's tenant).
        """
        request = recall_tool.recall_request(session_id, tool_call, max_bytes)
        if isinstance(request, SessionEvent):
            return request
        try:
            response = self._unary(self._sessions.Recall, request, timeout)
        except CompactdError as error:
            return recall_tool.error_answer(tool_call, error)
        return recall_tool.answer(tool_call, response)

    # CompactionService

    def revert_compaction(
        self, session_id: str, compaction_id: str, *, timeout: Timeout = UNSET
    ) -> RevertCompactionResponse:
        """Reverts a committed compaction: its checkpoint's shadowed nodes come back in place.

        Raises:
            NotFoundError: no such session, or no such compaction (``COMPACTION_UNKNOWN``).
            FailedPreconditionError: ``REVERT_BLOCKED``: a later bracket covers the checkpoint
                (revert that one first), or it was reverted already.
            CompactionBusyError: a turn is open or a bracket is live.
        """
        request = RevertCompactionRequest(session_id=session_id, compaction_id=compaction_id)
        return self._unary(self._compaction.RevertCompaction, request, timeout)

    def check_pressure(
        self, session_id: str, *, destination: Route | None = None, timeout: Timeout = UNSET
    ) -> PressureReport:
        """Measures the request envelope against the route's pressure policy.

        Raises:
            CapacityUnknownError: the route declares no context window.
            FailedPreconditionError: no route is known, or the policy does not fit the window.
        """
        request = rq.check_pressure(session_id, destination)
        response = self._unary(self._compaction.CheckPressure, request, timeout)
        return response.report

    def plan_compaction(
        self,
        session_id: str,
        *,
        mode: PlanMode.ValueType = PlanMode.PLAN_MODE_AUTO,
        route: Route | None = None,
        timeout: Timeout = UNSET,
    ) -> PlanCompactionResponse:
        """What a compaction would do now (the resolved policy, prunes, span or decline), with
        nothing appended.

        Raises:
            NotFoundError: no such session.
            InvalidArgumentError: ``PLAN_MODE_SWITCH`` without a ``route``.
        """
        request = PlanCompactionRequest(session_id=session_id, route=route, mode=mode)
        return self._unary(self._compaction.PlanCompaction, request, timeout)

    def list_brackets(self, session_id: str, *, timeout: Timeout = UNSET) -> ListBracketsResponse:
        """Every compaction bracket of the session, its steps, outcome, span and tokens."""
        request = ListBracketsRequest(session_id=session_id)
        return self._unary(self._compaction.ListBrackets, request, timeout)

    def watch_pressure(
        self, session_id: str, *, destination: Route | None = None, timeout: Timeout = UNSET
    ) -> ServerStream[PressureReport]:
        """Streams a report now and one per new log revision, until cancelled."""
        request = rq.watch_pressure(session_id, destination)
        call = self._stream(self._compaction.WatchPressure, request, timeout)
        return ServerStream(call, lambda m: m.report)

    def prepare_step(
        self,
        session_id: str,
        turn: int,
        *,
        intended_route: Route | None = None,
        on_progress: Callable[[CompactionProgress], object] | None = None,
        timeout: Timeout = UNSET,
    ) -> PreparedStep:
        """The pre-step check (prunes and compacts when above pressure) and the request to send.

        The client holds the last request of the session (see ``held_sessions``) and sends its
        revision as ``held_revision``: while compactd changed nothing it shows, the server
        answers only the messages appended since, which the client appends to the held request.
        A step that compacted, pruned or switched routes answers the full request, which the
        client then holds instead. So a step costs what it adds, never the session's length.

        Args:
            session_id: The session.
            turn: The open turn the step belongs to.
            intended_route: The route the step will use; None uses the logged one.
            on_progress: Called with each ``CompactionProgress`` as it arrives: the step is then
                streamed (``PrepareStep``); without it the step is one unary call
                (``PrepareStepUnary``, no progress), the cheaper one.
            timeout: Deadline in seconds; unset uses ``stream_timeout`` (a compaction may run
                inside the call).

        Returns:
            The request to send (``request``, the client's held one: the session's next step
            extends it in place) and the server's result (``result``).

        Raises:
            CompactionBusyError: a bracket is live.
            FailedPreconditionError: ``turn`` is not open (reason ``NO_OPEN_TURN``).
            NotFoundError: no such session.
        """
        held = self._held.held(session_id)
        sent, incarnation = (None, "") if held is None else held
        progress: tuple[CompactionProgress, ...] = ()
        if on_progress is None:
            result = self.prepare_step_unary(
                session_id, turn, intended_route=intended_route, held_revision=sent,
                held_incarnation=incarnation,
                timeout=timeout,
            )  # fmt: skip
        else:
            stream = self.prepare_step_stream(
                session_id, turn, intended_route=intended_route, held_revision=sent,
                held_incarnation=incarnation,
                timeout=timeout,
            )  # fmt: skip
            with stream:
                for update in stream:
                    on_progress(update)
                result = stream.result()
            progress = tuple(stream.progress)
        request = self._held.update(session_id, sent, result, incarnation)
        if request is None:  # the held request moved on meanwhile (a concurrent step)
            request = self.build_request(session_id, timeout=timeout)
            self._held.hold(session_id, request)
        return PreparedStep(request, result, progress)

    def prepare_step_stream(
        self,
        session_id: str,
        turn: int,
        *,
        intended_route: Route | None = None,
        held_revision: int | None = None,
        held_incarnation: str = "",
        timeout: Timeout = UNSET,
    ) -> CompactionStream[PrepareStepResult]:
        """The ``PrepareStep`` stream as the server sends it: iterate for the progress,
        ``result()`` for the result. Nothing is held: without ``held_revision`` the result
        carries the full request; with it, ``steps.step_request`` gives the request to send.
        ``held_incarnation``: the held request's ``incarnation``, sent with ``held_revision`` so
        a session deleted and created again meanwhile answers the full request. Raises as
        ``prepare_step``."""
        request = rq.prepare_step(session_id, turn, intended_route, held_revision, held_incarnation)
        call = self._stream(self._compaction.PrepareStep, request, timeout)
        return CompactionStream(call, rq.split_prepare_step)

    def forget_held_request(self, session_id: str) -> None:
        """Drops the request the client holds for the session (a runtime done with it); the
        session's next ``prepare_step`` answers the full request."""
        self._held.forget(session_id)

    def prepare_step_unary(
        self,
        session_id: str,
        turn: int,
        *,
        intended_route: Route | None = None,
        held_revision: int | None = None,
        held_incarnation: str = "",
        timeout: Timeout = UNSET,
    ) -> PrepareStepResult:
        """``PrepareStepUnary`` as the server answers it: the result of ``prepare_step_stream``, no
        step updates, nothing held.

        Cheaper than the stream for a runtime that shows no compaction progress (most steps
        are below pressure). A compaction it runs happens inside the call, so its default
        deadline is the client's ``stream_timeout``. Raises as ``prepare_step``."""
        request = rq.prepare_step_unary(
            session_id, turn, intended_route, held_revision, held_incarnation
        )
        deadline = resolve_timeout(timeout, self._stream_timeout)
        response = self._unary(self._compaction.PrepareStepUnary, request, deadline)
        return response.result

    def compact(
        self, session_id: str, *, focus: str = "", timeout: Timeout = UNSET
    ) -> CompactionStream[CompactResult]:
        """On-demand compaction, even below pressure. Raises ``CompactionBusyError`` while a
        turn is open or a bracket is live."""
        request = rq.compact(session_id, focus)
        call = self._stream(self._compaction.Compact, request, timeout)
        return CompactionStream(call, rq.split_compact)

    def recover_from_error(
        self,
        session_id: str,
        turn: int,
        error: ProviderError,
        *,
        retries_so_far: int = 0,
        timeout: Timeout = UNSET,
    ) -> CompactionStream[RecoverFromErrorResult]:
        """Recovery after a provider error; the result says whether to retry, with what."""
        request = rq.recover_from_error(session_id, turn, error, retries_so_far)
        call = self._stream(self._compaction.RecoverFromError, request, timeout)
        return CompactionStream(call, rq.split_recover)

    def switch_model(
        self,
        session_id: str,
        destination: Route,
        *,
        turn: int | None = None,
        timeout: Timeout = UNSET,
    ) -> CompactionStream[SwitchModelResult]:
        """Compacts history until it fits the destination route's policy."""
        request = rq.switch_model(session_id, destination, turn)
        call = self._stream(self._compaction.SwitchModel, request, timeout)
        return CompactionStream(call, rq.split_switch)
