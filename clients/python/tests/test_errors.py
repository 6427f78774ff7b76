"""Failed calls surface as typed exceptions carrying the ErrorInfo reason and metadata."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from fake_compactd import FakeCompactd, abort_rich

from compactd_client import (
    AsyncCompactdClient,
    CompactdClient,
    CompactdError,
    CompactionBusyError,
    NotFoundError,
    SeqConflictError,
)
from compactd_client.errors import (
    AbortedError,
    CapacityUnknownError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    error_class,
)
from compactd_client.events import user_message


@pytest.mark.parametrize(
    ("code", "reason", "expected"),
    [
        (grpc.StatusCode.ABORTED, "SEQ_CONFLICT", SeqConflictError),
        (grpc.StatusCode.ABORTED, "COMPACTION_BUSY", CompactionBusyError),
        (grpc.StatusCode.ABORTED, "SOMETHING_NEW", AbortedError),
        (grpc.StatusCode.FAILED_PRECONDITION, "CAPACITY_UNKNOWN", CapacityUnknownError),
        (grpc.StatusCode.FAILED_PRECONDITION, "NO_OPEN_TURN", FailedPreconditionError),
        (grpc.StatusCode.NOT_FOUND, "NOT_FOUND", NotFoundError),
        (grpc.StatusCode.UNKNOWN, "", InternalError),
        (grpc.StatusCode.OUT_OF_RANGE, "", CompactdError),
    ],
)
def test_error_class_prefers_the_reason_then_the_code(
    code: grpc.StatusCode, reason: str, expected: type[CompactdError]
) -> None:
    assert error_class(code, reason) is expected


def test_a_reason_under_an_unexpected_code_maps_by_code() -> None:
    # SEQ_CONFLICT is an ABORTED reason; under INTERNAL it must not claim to be a conflict.
    assert error_class(grpc.StatusCode.INTERNAL, "SEQ_CONFLICT") is InternalError


def _conflict(request: Any, context: grpc.ServicerContext) -> None:
    abort_rich(
        context,
        grpc.StatusCode.ABORTED,
        "expected_last_seq 3 but the log ends at 5",
        reason="SEQ_CONFLICT",
        metadata={"expected_last_seq": "3", "last_seq": "5"},
    )


def test_sync_append_conflict_raises_seq_conflict_with_metadata(fake: FakeCompactd) -> None:
    fake.on("AppendEvents", _conflict)
    with CompactdClient(fake.target) as client, pytest.raises(SeqConflictError) as caught:
        client.append_events("s1", [user_message("hi")], expected_last_seq=3)
    err = caught.value
    assert err.code == grpc.StatusCode.ABORTED
    assert err.reason == "SEQ_CONFLICT"
    assert err.domain == "compactd.dev"
    assert err.metadata == {"expected_last_seq": "3", "last_seq": "5"}
    assert err.message == "expected_last_seq 3 but the log ends at 5"
    assert isinstance(err.__cause__, grpc.RpcError)


async def test_async_append_conflict_raises_seq_conflict_with_metadata(
    fake: FakeCompactd,
) -> None:
    fake.on("AppendEvents", _conflict)
    async with AsyncCompactdClient(fake.target) as client:
        with pytest.raises(SeqConflictError) as caught:
            await client.append_events("s1", [user_message("hi")], expected_last_seq=3)
    assert caught.value.reason == "SEQ_CONFLICT"
    assert caught.value.metadata["last_seq"] == "5"


def test_bad_request_violations_are_carried(fake: FakeCompactd) -> None:
    def reject(request: Any, context: grpc.ServicerContext) -> None:
        abort_rich(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            "malformed event",
            reason="INVALID_ARGUMENT",
            violations=(("events[0].seq", "must be unset"),),
        )

    fake.on("AppendEvents", reject)
    with CompactdClient(fake.target) as client, pytest.raises(InvalidArgumentError) as caught:
        client.append_events("s1", [user_message("hi")])
    (violation,) = caught.value.violations
    assert (violation.field, violation.description) == ("events[0].seq", "must be unset")


def test_a_status_without_details_maps_by_code_and_names_it(fake: FakeCompactd) -> None:
    fake.on("GetSurface", lambda r, c: c.abort(grpc.StatusCode.NOT_FOUND, "no such session"))
    with CompactdClient(fake.target) as client, pytest.raises(NotFoundError) as caught:
        client.get_surface("missing")
    assert caught.value.reason == "NOT_FOUND"
    assert caught.value.metadata == {}


async def test_busy_compaction_stream_raises_compaction_busy(fake: FakeCompactd) -> None:
    def busy(request: Any, context: grpc.ServicerContext) -> None:
        abort_rich(context, grpc.StatusCode.ABORTED, "turn 4 is open", reason="COMPACTION_BUSY")

    fake.on("Compact", busy)
    async with AsyncCompactdClient(fake.target) as client:
        with pytest.raises(CompactionBusyError) as caught:
            await client.compact("s1").result()
    assert str(caught.value) == "ABORTED (COMPACTION_BUSY): turn 4 is open"
