"""Error statuses always reach the client: texts a request echoes are clipped to fit trailing
metadata (an oversized status would arrive as RESOURCE_EXHAUSTED instead)."""

from __future__ import annotations

import grpc
import pytest

from compactd import errors
from compactd.api.status import MAX_VIOLATIONS, clip, to_status
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import details
from tests.builders import user

CLIENT_METADATA_LIMIT = 8 * 1024  # grpc's default soft limit on received metadata


def _metadata_bytes(status: grpc.Status) -> int:
    """Trailing metadata on the wire: binary values base64, grpc-message percent-encoded."""
    wire = sum(
        len(key) + (len(value) * 4 // 3 + 4 if key.endswith("-bin") else len(value))
        for key, value in status.trailing_metadata
    )
    return wire + 3 * len(status.details.encode("utf-8"))


@pytest.mark.parametrize("text", ["x" * 5000, "日本語" * 2000, "😀" * 3000])
def test_an_error_echoing_a_huge_request_field_fits_the_metadata_limit(text: str) -> None:
    error = errors.InvalidArgument(
        f"session {text!r} is odd",
        violations=[errors.FieldViolation(f"events[{i}].{text}", text) for i in range(50)],
        metadata={text: text, **{f"k{i}": text for i in range(20)}},
    )
    status = to_status(error)
    assert _metadata_bytes(status) < CLIENT_METADATA_LIMIT


def test_clip_keeps_whole_characters() -> None:
    assert clip("abc", 10) == "abc"
    clipped = clip("日本語" * 10, 10)
    assert clipped.endswith("…")
    assert len(clipped.encode("utf-8")) <= 10


async def test_a_not_found_for_a_huge_session_id_arrives_as_not_found(
    sessions: SessionServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await sessions.GetSurface(pb.GetSurfaceRequest(session_id="s" * 20_000))
    assert details(caught.value).code == grpc.StatusCode.NOT_FOUND


async def test_a_batch_with_many_violations_says_how_many_are_not_shown(
    sessions: SessionServiceStub,
) -> None:
    await sessions.CreateSession(pb.CreateSessionRequest(session_id="s1"))
    bad = []
    for _ in range(40):
        event = user("x")
        event.seq = 9
        bad.append(event)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await sessions.AppendEvents(pb.AppendEventsRequest(session_id="s1", events=bad))
    got = details(caught.value)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(got.fields) == MAX_VIOLATIONS
    assert "32 more violation(s) not shown" in got.message
