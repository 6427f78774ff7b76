"""The request a step sends: the client's held requests (``prepare_step``) and ``step_request``."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from fake_compactd import FakeCompactd, abort_rich

from compactd_client import CompactdClient, CompactionBusyError, HeldRequests, step_request
from compactd_client._requests import prepare_step
from compactd_client.v1.compaction_service_pb2 import (
    COMPACTION_STEP_PRUNE,
    CompactionProgress,
    PrepareStepRequest,
    PrepareStepResponse,
    PrepareStepResult,
    PrepareStepUnaryRequest,
    PrepareStepUnaryResponse,
)
from compactd_client.v1.events_pb2 import ContentBlock, RequestConfig, TextBlock
from compactd_client.v1.session_service_pb2 import (
    BuildRequestRequest,
    BuildRequestResponse,
    DeleteSessionResponse,
    Message,
)


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
    assert prepare_step("s", 1, None, 0, "7").held_incarnation == "7"


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


class Log:
    """A scripted session on the fake server, answering steps by the held-revision contract:
    the full request without ``held_revision`` (or once ``rewrite`` is set, or when
    ``held_incarnation`` is not the session's), else the messages appended since."""

    def __init__(self) -> None:
        self.messages = [message("a")]
        self.rewrite = False
        self.incarnation = "1"
        self.sent: list[int | None] = []
        self.sent_incarnations: list[str] = []

    def result(self, request: PrepareStepRequest | PrepareStepUnaryRequest) -> PrepareStepResult:
        self.sent.append(request.held_revision if request.HasField("held_revision") else None)
        self.sent_incarnations.append(request.held_incarnation)
        revision = len(self.messages)  # one message per revision, enough for the client
        other = request.held_incarnation not in ("", self.incarnation)
        if not request.HasField("held_revision") or self.rewrite or other:
            self.rewrite = False
            full = BuildRequestResponse(
                revision=revision, messages=self.messages, config=CONFIG,
                incarnation=self.incarnation,
            )  # fmt: skip
            return PrepareStepResult(request=full, request_revision=revision)
        appended = self.messages[request.held_revision :]
        return PrepareStepResult(
            request_unchanged=True, appended_messages=appended, request_revision=revision
        )

    def unary(self, request: Any, context: grpc.ServicerContext) -> PrepareStepUnaryResponse:
        return PrepareStepUnaryResponse(result=self.result(request))

    def stream(self, request: Any, context: grpc.ServicerContext) -> Any:
        yield PrepareStepResponse(progress=CompactionProgress(step=COMPACTION_STEP_PRUNE))
        yield PrepareStepResponse(result=self.result(request))


CONFIG = RequestConfig(provider="p", model="m")


def test_each_step_sends_the_held_revision_and_answers_the_full_request(
    fake: FakeCompactd,
) -> None:
    log = Log()
    fake.on("PrepareStepUnary", log.unary)
    with CompactdClient(fake.target) as client:
        first = client.prepare_step("s", 1)
        log.messages += [message("b"), message("c")]
        second = client.prepare_step("s", 1)
        log.rewrite, log.messages = True, [message("summary")]
        third = client.prepare_step("s", 1)
        log.messages.append(message("d"))
        fourth = client.prepare_step("s", 1)
    assert log.sent == [None, 1, 3, 1]
    assert second.request is first.request  # the held request, extended in place
    assert list(second.request.messages) == [message("a"), message("b"), message("c")]
    assert (second.request.revision, second.request.config) == (3, CONFIG)
    assert second.result.request_unchanged
    assert list(fourth.request.messages) == [message("summary"), message("d")]
    assert fourth.request is third.request
    assert fake.calls["PrepareStep"] == 0  # no progress asked: one unary call per step


def test_each_step_sends_the_held_incarnation_and_a_session_created_again_answers_whole(
    fake: FakeCompactd,
) -> None:
    log = Log()
    fake.on("PrepareStepUnary", log.unary)
    with CompactdClient(fake.target) as client:
        client.prepare_step("s", 1)
        log.messages.append(message("b"))
        client.prepare_step("s", 1)
        # Another process deletes the session and creates it again, as long as the held one.
        log.incarnation, log.messages = "2", [message("x"), message("y")]
        again = client.prepare_step("s", 1)
    assert log.sent == [None, 1, 2]
    assert log.sent_incarnations == ["", "1", "1"]
    assert not again.result.request_unchanged
    assert list(again.request.messages) == [message("x"), message("y")]
    assert again.request.incarnation == "2"


def test_a_step_with_on_progress_is_streamed_and_held_alike(fake: FakeCompactd) -> None:
    log = Log()
    fake.on("PrepareStep", log.stream)
    seen: list[CompactionProgress] = []
    with CompactdClient(fake.target) as client:
        client.prepare_step("s", 1, on_progress=seen.append)
        log.messages.append(message("b"))
        step = client.prepare_step("s", 1, on_progress=seen.append)
    assert log.sent == [None, 1]
    assert list(step.request.messages) == [message("a"), message("b")]
    assert step.progress == (CompactionProgress(step=COMPACTION_STEP_PRUNE),)
    assert len(seen) == 2
    assert fake.calls["PrepareStepUnary"] == 0


def test_held_requests_are_bounded_and_dropped_with_their_session(fake: FakeCompactd) -> None:
    log = Log()
    fake.on("PrepareStepUnary", log.unary)
    fake.on("DeleteSession", lambda request, context: DeleteSessionResponse())
    with CompactdClient(fake.target, held_sessions=1) as client:
        for session in ("s1", "s2", "s1", "s1"):  # s2 pushes s1 out of one slot
            client.prepare_step(session, 1)
        client.delete_session("s1")
        client.prepare_step("s1", 1)
        client.forget_held_request("s1")
        client.prepare_step("s1", 1)
    assert log.sent == [None, None, None, 1, None, None]
    with CompactdClient(fake.target, held_sessions=0) as client:
        client.prepare_step("s", 1)
        client.prepare_step("s", 1)
    assert log.sent[-2:] == [None, None]
    with pytest.raises(ValueError, match="capacity"):
        HeldRequests(-1)


def test_an_answer_to_a_request_no_longer_held_is_rebuilt(fake: FakeCompactd) -> None:
    """A concurrent step moved the held request on (here: dropped it) while this step ran:
    the appended messages no longer apply, so the client asks BuildRequest."""
    log = Log()
    with CompactdClient(fake.target) as client:

        def concurrent(request: Any, context: grpc.ServicerContext) -> PrepareStepUnaryResponse:
            client.forget_held_request("s")
            return log.unary(request, context)

        def build(request: BuildRequestRequest, context: grpc.ServicerContext) -> Any:
            return BuildRequestResponse(revision=len(log.messages), messages=log.messages)

        fake.on("PrepareStepUnary", log.unary)
        fake.on("BuildRequest", build)
        client.prepare_step("s", 1)
        log.messages.append(message("b"))
        fake.on("PrepareStepUnary", concurrent)
        step = client.prepare_step("s", 1)
        assert step.result.request_unchanged
        assert list(step.request.messages) == [message("a"), message("b")]
        fake.on("PrepareStepUnary", log.unary)
        assert client.prepare_step("s", 1).request is step.request  # the rebuilt one is held
    assert log.sent == [None, 1, 2]


def test_held_requests_apply_appended_messages_only_at_the_revision_sent() -> None:
    held = HeldRequests()
    held.hold("s", BuildRequestResponse(revision=3, messages=[message("a")]))
    unchanged = PrepareStepResult(
        request_unchanged=True, appended_messages=[message("b")], request_revision=4
    )
    assert held.update("s", 2, unchanged) is None
    assert held.update("s", None, unchanged) is None
    assert held.update("other", 3, unchanged) is None
    request = held.update("s", 3, unchanged)
    assert request is not None
    assert (request.revision, list(request.messages)) == (4, [message("a"), message("b")])
    assert held.revision("s") == 4
    assert held.update("s", 4, PrepareStepResult(request_revision=4)) is None  # no request
    assert held.revision("s") == 4


def test_held_requests_apply_appended_messages_only_to_the_incarnation_sent() -> None:
    held = HeldRequests()
    assert held.held("s") is None
    held.hold("s", BuildRequestResponse(revision=3, messages=[message("a")], incarnation="2"))
    assert held.held("s") == (3, "2")
    unchanged = PrepareStepResult(
        request_unchanged=True, appended_messages=[message("b")], request_revision=4
    )
    assert held.update("s", 3, unchanged, "1") is None  # the session was created again
    request = held.update("s", 3, unchanged, "2")
    assert request is not None
    assert held.held("s") == (4, "2")
