"""``step_request``: the request a step sends, from a PrepareStep result and the held request."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from fake_compactd import FakeCompactd, abort_rich

from compactd_client import CompactdClient, CompactionBusyError, step_request
from compactd_client._requests import prepare_step
from compactd_client.v1.compaction_service_pb2 import (
    PrepareStepResult,
    PrepareStepUnaryRequest,
    PrepareStepUnaryResponse,
)
from compactd_client.v1.events_pb2 import ContentBlock, RequestConfig, TextBlock
from compactd_client.v1.session_service_pb2 import BuildRequestResponse, Message


def message(text: str) -> Message:
    return Message(role=2, content=[ContentBlock(text=TextBlock(text=text))])


HELD = BuildRequestResponse(
    revision=7, messages=[message("a")], config=RequestConfig(provider="p", model="m")
)


def test_an_unchanged_request_is_the_held_one_with_the_appended_messages() -> None:
    result = PrepareStepResult(
        request_unchanged=True, appended_messages=[message("b")], request_revision=9
    )
    request = step_request(HELD, result)
    assert list(request.messages) == [message("a"), message("b")]
    assert request.config == HELD.config
    assert request.revision == 9
    assert list(HELD.messages) == [message("a")]  # the held request is left as it was


def test_a_full_request_replaces_the_held_one() -> None:
    full = BuildRequestResponse(revision=9, messages=[message("summary")])
    assert step_request(HELD, PrepareStepResult(request=full, request_revision=9)) == full


def test_an_omitted_request_needs_the_held_one() -> None:
    with pytest.raises(ValueError, match="held_revision"):
        step_request(None, PrepareStepResult(request_unchanged=True))


def test_prepare_step_sends_the_held_revision_only_when_given() -> None:
    assert not prepare_step("s", 1, None, None).HasField("held_revision")
    assert prepare_step("s", 1, None, 0).held_revision == 0


def test_the_unary_step_sends_the_held_revision_and_returns_the_result(
    fake: FakeCompactd,
) -> None:
    seen: list[PrepareStepUnaryRequest] = []

    def answer(request: Any, context: grpc.ServicerContext) -> PrepareStepUnaryResponse:
        seen.append(request)
        if request.session_id == "busy":
            abort_rich(context, grpc.StatusCode.ABORTED, "live", reason="COMPACTION_BUSY")
        return PrepareStepUnaryResponse(result=PrepareStepResult(request_revision=9))

    fake.on("PrepareStepUnary", answer)
    with CompactdClient(fake.target) as client:
        assert client.prepare_step_unary("s", 3, held_revision=7).request_revision == 9
        with pytest.raises(CompactionBusyError):
            client.prepare_step_unary("busy", 3)
    assert [(r.session_id, r.turn, r.held_revision) for r in seen] == [
        ("s", 3, 7),
        ("busy", 3, 0),
    ]
    assert not seen[1].HasField("held_revision")
