"""``step_request``: the request a step sends, from a PrepareStep result and the held request."""

from __future__ import annotations

import pytest

from compactd_client import step_request
from compactd_client._requests import prepare_step
from compactd_client.v1.compaction_service_pb2 import PrepareStepResult
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
