"""Request builders and stream splitters shared by the sync and the asyncio client."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import struct_pb2

from compactd_client.v1.compaction_service_pb2 import (
    CheckPressureRequest,
    CompactionProgress,
    CompactRequest,
    CompactResponse,
    CompactResult,
    PrepareStepRequest,
    PrepareStepResponse,
    PrepareStepResult,
    PrepareStepUnaryRequest,
    ProviderError,
    RecoverFromErrorRequest,
    RecoverFromErrorResponse,
    RecoverFromErrorResult,
    SwitchModelRequest,
    SwitchModelResponse,
    SwitchModelResult,
    WatchPressureRequest,
)
from compactd_client.v1.events_pb2 import Route, SessionEvent
from compactd_client.v1.session_service_pb2 import (
    AppendEventsRequest,
    CreateSessionRequest,
)


class Unset(enum.Enum):
    """Marks a ``timeout`` argument left to the client's default."""

    UNSET = enum.auto()


UNSET = Unset.UNSET

#: A per-call deadline in seconds, None for no deadline, or UNSET for the client's default.
Timeout = float | None | Unset


def resolve_timeout(timeout: Timeout, default: float | None) -> float | None:
    """Returns the deadline to pass to grpc."""
    return default if isinstance(timeout, Unset) else timeout


def create_session(
    session_id: str,
    compaction_policy: Mapping[str, Any] | None,
    parent_session_id: str = "",
    fork_at_seq: int | None = None,
) -> CreateSessionRequest:
    request = CreateSessionRequest(session_id=session_id, parent_session_id=parent_session_id)
    if fork_at_seq is not None:
        request.fork_at_seq = fork_at_seq
    if compaction_policy is not None:
        policy = struct_pb2.Struct()
        policy.update(compaction_policy)
        request.compaction_policy.CopyFrom(policy)
    return request


def append_events(
    session_id: str, events: Iterable[SessionEvent], expected_last_seq: int | None
) -> AppendEventsRequest:
    request = AppendEventsRequest(session_id=session_id, events=list(events))
    if expected_last_seq is not None:
        request.expected_last_seq = expected_last_seq
    return request


def check_pressure(session_id: str, destination: Route | None) -> CheckPressureRequest:
    return CheckPressureRequest(session_id=session_id, destination=destination)


def watch_pressure(session_id: str, destination: Route | None) -> WatchPressureRequest:
    return WatchPressureRequest(session_id=session_id, destination=destination)


def prepare_step(
    session_id: str,
    turn: int,
    intended_route: Route | None,
    held_revision: int | None,
    held_incarnation: str = "",
) -> PrepareStepRequest:
    request = PrepareStepRequest(session_id=session_id, turn=turn, intended_route=intended_route)
    if held_revision is not None:
        request.held_revision = held_revision
    request.held_incarnation = held_incarnation
    return request


def prepare_step_unary(
    session_id: str,
    turn: int,
    intended_route: Route | None,
    held_revision: int | None,
    held_incarnation: str = "",
) -> PrepareStepUnaryRequest:
    request = PrepareStepUnaryRequest(
        session_id=session_id, turn=turn, intended_route=intended_route
    )
    if held_revision is not None:
        request.held_revision = held_revision
    request.held_incarnation = held_incarnation
    return request


def compact(session_id: str, focus: str) -> CompactRequest:
    return CompactRequest(session_id=session_id, focus=focus)


def recover_from_error(
    session_id: str, turn: int, error: ProviderError, retries_so_far: int
) -> RecoverFromErrorRequest:
    return RecoverFromErrorRequest(
        session_id=session_id, turn=turn, error=error, retries_so_far=retries_so_far
    )


def switch_model(session_id: str, destination: Route, turn: int | None) -> SwitchModelRequest:
    request = SwitchModelRequest(session_id=session_id, destination=destination)
    if turn is not None:
        request.turn = turn
    return request


# Each compaction stream message is a oneof `update` of a progress or the final result.


def split_prepare_step(m: PrepareStepResponse) -> CompactionProgress | PrepareStepResult | None:
    kind = m.WhichOneof("update")
    return m.progress if kind == "progress" else m.result if kind == "result" else None


def split_compact(m: CompactResponse) -> CompactionProgress | CompactResult | None:
    kind = m.WhichOneof("update")
    return m.progress if kind == "progress" else m.result if kind == "result" else None


def split_recover(
    m: RecoverFromErrorResponse,
) -> CompactionProgress | RecoverFromErrorResult | None:
    kind = m.WhichOneof("update")
    return m.progress if kind == "progress" else m.result if kind == "result" else None


def split_switch(m: SwitchModelResponse) -> CompactionProgress | SwitchModelResult | None:
    kind = m.WhichOneof("update")
    return m.progress if kind == "progress" else m.result if kind == "result" else None
