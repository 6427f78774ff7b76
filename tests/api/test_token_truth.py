"""Token truth over a real server: every report says how exact it is, and usage calibrates.

Each conversation follows the step rules: a turn opens, each ``assistant/message`` is appended
inside a ``step/start`` ... ``step/end`` of that turn.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from compactd import config
from compactd.api.server import RunningServer, create_server
from compactd.service.calibration import HEURISTIC_ERROR_BOUND
from compactd.tokenizers import QWEN3_TOKENIZER
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2 as ev
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.builders import assistant, header, in_step, system, turn_start, user

QWEN = {"provider": "vllm", "model": "qwen3-local", "context_window": 131072,
        "tokenizer_file": QWEN3_TOKENIZER}  # fmt: skip
MISSING = {"provider": "local", "model": "lost-files", "context_window": 131072,
           "tokenizer_file": "/nonexistent/tokenizer.json"}  # fmt: skip


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RunningServer]:
    settings = config.load(
        None,
        environ={},
        overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{tmp_path / 't.db'}"},
    )
    running = await create_server(replace(settings, routes=(QWEN, MISSING)))
    try:
        yield running
    finally:
        await running.stop(0)


class Client:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.sessions = SessionServiceStub(channel)
        self.compaction = CompactionServiceStub(channel)

    async def session(self, *events: ev.SessionEvent) -> str:
        created = await self.sessions.CreateSession(pb.CreateSessionRequest())
        sid = created.session.session_id
        await self.append(sid, *events)
        return sid

    async def append(self, sid: str, *events: ev.SessionEvent) -> None:
        await self.sessions.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=events))

    async def check(self, sid: str) -> cpb.PressureReport:
        reply = await self.compaction.CheckPressure(cpb.CheckPressureRequest(session_id=sid))
        return reply.report


def answered(text: str, prompt_tokens: int, output_tokens: int = 0) -> ev.SessionEvent:
    event = assistant(text)
    event.assistant_message.usage.CopyFrom(
        ev.Usage(input_tokens=prompt_tokens, output_tokens=output_tokens)
    )
    return event


async def test_an_open_model_route_reports_exact_with_no_error(server: RunningServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        client = Client(channel)
        sid = await client.session(system("Be brief."), header("vllm", "qwen3-local"), user("hi"))
        report = await client.check(sid)
    assert report.breakdown.method == cpb.MEASUREMENT_METHOD_EXACT
    assert report.breakdown.HasField("error_bound")
    assert report.breakdown.error_bound == 0.0
    assert report.breakdown.tokenizer.startswith("hf:")
    assert not report.breakdown.warnings


async def test_an_openai_route_reports_its_tokenizer_without_a_bound(
    server: RunningServer,
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        client = Client(channel)
        sid = await client.session(header("openai", "gpt-4.1"), user("hello world"))
        report = await client.check(sid)
    assert report.breakdown.method == cpb.MEASUREMENT_METHOD_TOKENIZER
    assert report.breakdown.tokenizer == "o200k_base"
    assert not report.breakdown.HasField("error_bound")


async def test_a_route_whose_tokenizer_file_is_missing_warns_at_start_and_in_every_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = config.load(
        None,
        environ={},
        overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{tmp_path / 'w.db'}"},
    )
    with caplog.at_level(logging.WARNING, logger="compactd.service.pressure"):
        running = await create_server(replace(settings, routes=(MISSING,)))
    try:
        started = [r.getMessage() for r in caplog.records if "heuristic" in r.getMessage()]
        assert any("local/lost-files" in m and "no such file" in m for m in started)
        async with grpc.aio.insecure_channel(running.address) as channel:
            client = Client(channel)
            sid = await client.session(header("local", "lost-files"), user("hi"))
            report = await client.check(sid)
    finally:
        await running.stop(0)
    assert report.breakdown.method == cpb.MEASUREMENT_METHOD_HEURISTIC
    assert report.breakdown.error_bound == HEURISTIC_ERROR_BOUND
    assert any("no such file" in w for w in report.breakdown.warnings)


async def test_an_anchored_report_says_how_old_its_anchor_is(server: RunningServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        client = Client(channel)
        sid = await client.session(header("openai", "gpt-4o"), turn_start(1), user("hello"))
        await client.append(sid, *in_step(1, 1, answered("Hi! How can I help?", 500, 7)))
        await client.append(sid, user("Fix the test."), user("Please."))
        report = await client.check(sid)
    assert report.breakdown.method == cpb.MEASUREMENT_METHOD_ANCHORED
    assert report.breakdown.anchor_age_events == 3  # step/end and two user messages
    assert 0.0 <= report.breakdown.anchor_age_seconds < 60


async def test_usage_calibrates_an_estimated_route_within_its_bounds(
    server: RunningServer,
) -> None:
    # Anthropic publishes no tokenizer: the heuristic estimate is ESTIMATED. The provider's
    # prompt tokens here are half of compactd's count each time (so no anchor applies); after
    # three such requests the estimate is scaled by their ratio, 0.5.
    route = "anthropic/claude-sonnet-4-5"
    async with grpc.aio.insecure_channel(server.address) as channel:
        client = Client(channel)
        sid = await client.session(
            system("You are a careful agent."),
            header("anthropic", "claude-sonnet-4-5"),
            turn_start(1),
            user("Summarize the failing tests, then propose a fix for each one."),
        )
        first = await client.check(sid)
        assert first.breakdown.method == cpb.MEASUREMENT_METHOD_ESTIMATED
        assert first.breakdown.error_bound == HEURISTIC_ERROR_BOUND
        assert first.breakdown.calibration_samples == 0
        counted = []
        for step in (1, 2, 3):
            before = await client.check(sid)
            counted.append(before.breakdown.unscaled_tokens)
            reply = answered(
                f"Step {step}: looking at the next failure in detail.", counted[-1] // 2
            )
            await client.append(sid, *in_step(1, step, reply))
            await client.append(sid, user(f"Continue with failure {step + 1}."))
        report = await client.check(sid)
    assert server.pressure is not None
    stats = server.pressure.calibration_stats(
        server.pressure.route_for("anthropic", "claude-sonnet-4-5")
    )
    assert stats is not None
    assert stats.route == route
    assert stats.samples == 3
    assert stats.compactd_tokens == sum(counted)
    assert stats.provider_tokens == sum(c // 2 for c in counted)
    breakdown = report.breakdown
    assert breakdown.method == cpb.MEASUREMENT_METHOD_ESTIMATED
    assert breakdown.calibration_samples == 3
    assert breakdown.calibration_ratio == pytest.approx(stats.ratio)
    assert report.measured_tokens == round(breakdown.unscaled_tokens * stats.scale)
    assert report.measured_tokens < breakdown.unscaled_tokens
    assert breakdown.error_bound == pytest.approx(stats.residual)
    assert breakdown.error_bound < 0.05
