"""The Python clients' default ``prepare_step`` against a real server: the request it returns is
``BuildRequest``'s at every step, across a compaction, while the server answers only what each
step added (``held_revision``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from compactd_client import AsyncCompactdClient, CompactdClient, PreparedStep
from compactd_client.v1.compaction_service_pb2 import COMPACTION_STEP_REPLACE, CompactionProgress
from compactd_client.v1.session_service_pb2 import BuildRequestResponse

from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import events_pb2
from tests.builders import assistant, in_step, tool_result, turn_start, user
from tests.compaction_fixtures import RELAXED, loopback, opening, started, units

TURN = 1
#: Steps driven: the conversation crosses the trigger (5000 tokens) a few steps in.
STEPS = 14


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


def history() -> list[events_pb2.SessionEvent]:
    """Eleven closed turns (~2,800 tokens), then the open turn the steps belong to."""
    return [*opening(), *units(11), turn_start(TURN), user("Make every check pass.")]


def model_step(i: int) -> list[events_pb2.SessionEvent]:
    """What step ``i`` logs (~250 tokens): the model's reply calling a tool, then its result."""
    reply = assistant(
        text=f"Step {i}: checking src/mod{i}.py. " + "Reasoning. " * 20,
        calls=[(f"step-{i}", "run", '{"cmd":"make check"}')],
    )
    return [*in_step(TURN, i, reply), tool_result(f"step-{i}", f"ok {i} " * 60, name="run")]


@dataclass
class Steps:
    """Each step's answer, beside what ``BuildRequest`` answered right after it."""

    answers: list[PreparedStep] = field(default_factory=list)
    built: list[BuildRequestResponse] = field(default_factory=list)

    def add(self, step: PreparedStep, built: BuildRequestResponse) -> None:
        # The request is the client's held one, extended in place by the next step: keep a copy.
        request = BuildRequestResponse()
        request.CopyFrom(step.request)
        self.answers.append(PreparedStep(request, step.result, step.progress))
        self.built.append(built)

    def check(self) -> None:
        """Every step's request is BuildRequest's; a compaction happened between held steps,
        which answered only the messages their step appended."""
        for number, (step, built) in enumerate(zip(self.answers, self.built, strict=True)):
            assert step.request == built, f"step {number + 1}"
            assert step.result.request_revision == built.revision
        compacted = [i for i, s in enumerate(self.answers) if s.result.compactions]
        assert compacted, "no step compacted: the conversation never crossed the trigger"
        assert 1 < compacted[0] < len(self.answers) - 2
        for i, step in enumerate(self.answers):
            if i == 0 or i in compacted:
                assert not step.result.request_unchanged  # nothing held, or rewritten
                assert step.result.HasField("request")
                continue
            assert step.result.request_unchanged, f"step {i + 1}"
            assert not step.result.HasField("request")
            # The last step logged a reply and a tool result: two messages, nothing older.
            appended = list(step.result.appended_messages)
            assert appended == list(self.built[i].messages[-2:])
        shorter = self.built[compacted[0]].messages
        assert len(shorter) < len(self.built[compacted[0] - 1].messages)


def drive_sync(address: str) -> Steps:
    steps = Steps()
    with CompactdClient(address) as client:
        session = client.create_session("sync").session_id
        client.append_events(session, history())
        for i in range(1, STEPS + 1):
            step = client.prepare_step(session, TURN)
            steps.add(step, client.build_request(session))
            client.append_events(session, model_step(i))
    return steps


async def test_every_step_of_the_blocking_client_is_build_request_across_a_compaction(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        steps = await asyncio.to_thread(drive_sync, h.address)
    steps.check()


async def test_every_step_of_the_asyncio_client_is_build_request_across_a_compaction(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    steps = Steps()
    async with started(tmp_path, loop) as h, AsyncCompactdClient(h.address) as client:
        session = (await client.create_session("async")).session_id
        await client.append_events(session, history())
        for i in range(1, STEPS + 1):
            step = await client.prepare_step(session, TURN)
            steps.add(step, await client.build_request(session))
            await client.append_events(session, model_step(i))
    steps.check()
    assert all(not s.progress for s in steps.answers)  # one unary call per step


async def test_a_streamed_step_reports_progress_and_returns_the_same_requests(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    steps, seen = Steps(), list[CompactionProgress]()
    async with started(tmp_path, loop) as h, AsyncCompactdClient(h.address) as client:
        session = (await client.create_session("streamed")).session_id
        await client.append_events(session, history())
        for i in range(1, STEPS + 1):
            step = await client.prepare_step(session, TURN, on_progress=seen.append)
            steps.add(step, await client.build_request(session))
            await client.append_events(session, model_step(i))
    steps.check()
    assert COMPACTION_STEP_REPLACE in [p.step for p in seen]
    assert [p for s in steps.answers for p in s.progress] == seen


async def test_a_held_step_answer_does_not_grow_with_the_session(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    """Below pressure, each step's answer carries its own two messages, whatever came before:
    its size stays flat while the full request grows step by step."""
    answers, built = [], []
    async with (
        started(tmp_path, loop, policy=RELAXED) as h,
        AsyncCompactdClient(h.address) as client,
    ):
        session = (await client.create_session("flat")).session_id
        await client.append_events(session, history())
        for i in range(1, STEPS + 1):
            await client.append_events(session, model_step(i))
            answers.append((await client.prepare_step(session, TURN)).result)
            built.append(await client.build_request(session))
    held = answers[1:]
    for answer, request in zip(held, built[1:], strict=True):
        assert answer.request_unchanged
        assert list(answer.appended_messages) == list(request.messages[-2:])
    # Beyond its two messages, a reply is the pressure reports: a few varints' width apart.
    envelopes = [a.ByteSize() - sum(m.ByteSize() for m in a.appended_messages) for a in held]
    assert max(envelopes) - min(envelopes) < 16, envelopes
    assert 10 * max(a.ByteSize() for a in held) < built[-1].ByteSize()  # not the request


async def test_a_deleted_session_drops_its_held_request(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h, AsyncCompactdClient(h.address) as client:
        await client.create_session("gone")
        await client.append_events("gone", [*history(), *model_step(1)])
        await client.prepare_step("gone", TURN)
        await client.delete_session("gone")
        # The same id again, a shorter log: a held request would name a revision beyond it.
        await client.create_session("gone")
        await client.append_events("gone", history())
        step = await client.prepare_step("gone", TURN)
        assert not step.result.request_unchanged
        assert step.request == await client.build_request("gone")


async def test_a_session_another_client_created_again_is_stepped_whole_async(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with (
        started(tmp_path, loop) as h,
        AsyncCompactdClient(h.address) as client,
        AsyncCompactdClient(h.address) as other,
    ):
        await client.create_session("again")
        await client.append_events("again", history())
        held = (await client.prepare_step("again", TURN)).request.revision
        # Another process deletes the id and creates it again, its log past the held revision:
        # the held revision names a point of the new log too, the incarnation tells them apart.
        await other.delete_session("again")
        await other.create_session("again")
        await other.append_events("again", [*history(), *model_step(1)])
        assert (await other.build_request("again")).revision > held
        step = await client.prepare_step("again", TURN)
        assert not step.result.request_unchanged
        assert step.request == await client.build_request("again")


async def test_a_session_another_client_created_again_is_stepped_whole(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await asyncio.to_thread(_step_across_a_re_creation, h.address)


def _step_across_a_re_creation(address: str) -> None:
    with CompactdClient(address) as client, CompactdClient(address) as other:
        client.create_session("again")
        client.append_events("again", history())
        client.prepare_step("again", TURN)
        other.delete_session("again")
        other.create_session("again")
        other.append_events("again", [*history(), *model_step(1)])
        step = client.prepare_step("again", TURN, on_progress=lambda _: None)  # the stream too
        assert not step.result.request_unchanged
        assert step.request == client.build_request("again")
