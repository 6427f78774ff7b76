"""Pinned state over a real server: never compacted, rendered the same in every request, priced.

Replayed transcripts (``testdata/transcripts``) are appended a slice at a time with pins planted
between slices, and the session is compacted after each slice: after every compaction, the
rebuilt request still holds exactly one pinned-state message, right after the system head, whose
bytes are the rendering of the pins in force (a pure function of them), and no compaction ever
shadowed a pin.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from compactd_client import openai
from opentelemetry import trace

from compactd.api.server import create_server
from compactd.core.pins import pins_message, render_pins
from compactd.replay import Transcript, read_transcripts
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import events_pb2
from tests.api.rpc import details
from tests.builders import pin, subagent_start, user
from tests.compaction_fixtures import (
    MODEL,
    PROVIDER,
    Harness,
    loopback,
    opening,
    server_config,
    started,
    units,
)

ROOT = Path(__file__).resolve().parents[2]
TRANSCRIPTS = [
    t
    for name in ("coding.jsonl", "openai.jsonl")
    for t in read_transcripts(ROOT / "testdata" / "transcripts" / name)
    if len(t.messages) >= 24
]
#: Manual compaction only (nothing is ever above this trigger), a small verbatim tail.
POLICY: dict[str, Any] = {
    "thresholdRatio": 0.875,
    "headroomTokens": 1000,
    "maxTokens": 1000,
    "retainTokens": 300,
}
#: The same without the quality gate: the replays test the pins, not the summaries.
UNGATED: dict[str, Any] = {**POLICY, "summaryGate": False}


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


def _server_events(events: Sequence[Any]) -> list[events_pb2.SessionEvent]:
    """The client converter's events as the server's message type."""
    return [events_pb2.SessionEvent.FromString(e.SerializeToString()) for e in events]


def _slices(messages: list[dict[str, Any]], count: int) -> list[list[dict[str, Any]]]:
    """``messages`` cut into at most ``count`` slices, each cut before a user or assistant message
    that no tool result of an earlier call still has to follow."""
    cuts = [
        i
        for i in range(1, len(messages))
        if messages[i].get("role") in ("user", "assistant")
        and not messages[i - 1].get("tool_calls")
        and messages[i - 1].get("role") != "system"
    ]
    chosen = sorted(set(cuts[:: max(1, len(cuts) // count)][1:count])) if cuts else []
    bounds = [0, *chosen, len(messages)]
    return [messages[a:b] for a, b in itertools.pairwise(bounds) if b > a]


async def _check_request(h: Harness, pins: dict[str, str]) -> None:
    """The rebuilt request holds the pins in force once, right after the head, as rendered."""
    built = await h.build()
    pinned = [i for i, m in enumerate(built.messages) if m.pinned_state]
    if not pins:
        assert pinned == []
        return
    head = 1 if built.messages[0].role == 1 and not built.messages[0].pinned_state else 0
    assert pinned == [head]
    assert built.messages[head] == pins_message(pins)
    assert built.messages[head].content[0].text.text == render_pins(pins)
    assert {p.key: p.text for p in built.pins} == pins


async def _compact(h: Harness) -> int:
    """Compact; 1 when a checkpoint was committed, 0 when the slice was too small to shrink
    (``SUMMARY_NOT_SMALLER``: the log keeps it as it was)."""
    try:
        run = await h.compact()
    except grpc.aio.AioRpcError as error:
        reason = details(error).reason
    else:
        return 1 if run.result.outcome.checkpoint_seq else 0
    if reason != "SUMMARY_NOT_SMALLER":
        raise AssertionError(f"Compact failed: {reason}")
    return 0


async def _replay_with_pins(h: Harness, transcript: Transcript, seed: int) -> int:
    """Append ``transcript`` in slices with pins planted, compacting after each; the number of
    committed checkpoints."""
    rng = random.Random(seed)
    pins: dict[str, str] = {}
    compactions = 0
    slices = _slices(transcript.messages, rng.randint(1, 10))
    for index, messages in enumerate(slices):
        route = {"provider": PROVIDER, "model": MODEL} if index == 0 else {}
        tools = transcript.tools if index == 0 else None
        events = openai.events_from_messages(messages, tools=tools, first_turn=1 + 100 * index,
                                             **route)  # fmt: skip
        await h.append(*_server_events(events))
        key = rng.choice(["goal", "plan", "constraint/1", "correction"])
        if key in pins and rng.random() < 0.3:
            await h.append(pin(key, clear=True))
            del pins[key]
        else:
            pins[key] = f"{key} #{index}: " + rng.choice(["keep it short", "use ripgrep", "中文 ✓"])
            await h.append(pin(key, pins[key]))
        await _check_request(h, pins)
        compactions += await _compact(h)
        await _check_request(h, pins)
    return compactions


@pytest.mark.parametrize("seed", range(len(TRANSCRIPTS)))
async def test_pins_survive_every_compaction_of_a_replayed_transcript(
    tmp_path: Path, loop: OpenAICompatServer, seed: int
) -> None:
    async with started(tmp_path, loop, policy=UNGATED, kind="extractive") as h:
        await h.create()
        compactions = await _replay_with_pins(h, TRANSCRIPTS[seed], seed)
        assert compactions >= 1, compactions
        events = await h.events()
        pin_seqs = {e.seq for e in events if e.HasField("state_pin")}
        shadowed = {s for e in events if e.HasField("compaction_start")
                    for s in e.compaction_start.shadowed_seqs}  # fmt: skip
        assert pin_seqs
        assert not pin_seqs & shadowed
        surface = await h.surface()
        assert all(node.type != "state/pin" for node in surface.nodes)


async def test_pins_are_priced_in_the_envelope(tmp_path: Path, loop: OpenAICompatServer) -> None:
    async with started(tmp_path, loop, policy=POLICY) as h:
        await h.create(*opening(), *units(2))
        before = await h.pressure()
        await h.append(pin("goal", "Ship the parser. " * 50))
        after = await h.pressure()
        assert after.breakdown.pins_tokens > 0
        assert after.measured_tokens == before.measured_tokens + after.breakdown.pins_tokens


async def test_a_pin_set_over_the_window_is_refused(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=POLICY) as h:
        await h.create(*opening(), user("hi"))
        await h.append(pin("goal", "a small goal"))
        huge = "word " * 20_000  # ~25k tokens: more than the route's 16k window
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.append(pin("plan", huge))
        got = details(caught.value)
        assert (got.code, got.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "PINS_OVER_WINDOW")
        assert int(got.metadata["pins_tokens"]) > int(got.metadata["context_window"]) == 16_000
        built = await h.build()  # nothing of the refused batch was kept
        assert {p.key for p in built.pins} == {"goal"}
        assert built.revision == len(await h.events())


async def test_clearing_a_pin_removes_it_from_the_request(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=POLICY) as h:
        await h.create(*opening(), user("hi"), pin("goal", "g"), pin("plan", "p"))
        await _check_request(h, {"goal": "g", "plan": "p"})
        await h.append(pin("goal", clear=True))
        await _check_request(h, {"plan": "p"})
        await h.append(pin("plan", clear=True))
        await _check_request(h, {})
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.append(pin("plan", clear=True))
        assert details(caught.value).code == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_summary_request_carries_the_pins_and_is_told_they_are_kept(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=POLICY) as h:
        await h.create(*opening(), *units(4), pin("goal", "Keep every module green."))
        run = await h.compact()
        assert run.result.outcome.checkpoint_seq
        [request] = [r.json for r in loop.requests if r.header("x-compactd-purpose")]
        messages = request["messages"]
        assert messages[0]["content"] == "You are a careful coding agent."
        pinned = render_pins({"goal": "Keep every module green."})
        assert messages[1] == {"role": "system", "content": pinned}
        assert "<pinned-state>" in messages[-1]["content"]  # the instruction's rule
        built = await h.build()
        assert built.messages[1].pinned_state


async def test_pins_and_open_subagents_survive_a_restart_from_a_snapshot(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    settings = dataclasses.replace(
        server_config(tmp_path, loop, policy=POLICY), snapshot_interval_events=5
    )

    async def serve() -> Any:
        return await create_server(settings, tracer_provider=trace.NoOpTracerProvider())

    first = await serve()
    try:
        async with grpc.aio.insecure_channel(first.address) as channel:
            h = Harness(channel, loop, first)
            await h.create(*opening(), *units(4), pin("goal", "ship it"))
            await h.append(subagent_start("s1.sub", "call-1", "audit"), *units(2, start=4))
            await h.compact()
            before = await h.build()
    finally:
        await first.stop(0)
    with sqlite3.connect(tmp_path / "compactd.db") as db:
        assert db.execute("SELECT count(*) FROM snapshots").fetchone()[0] == 1
    again = await serve()
    try:
        async with grpc.aio.insecure_channel(again.address) as channel:
            h = Harness(channel, loop, again)
            restored = await h.build()
            assert list(restored.messages) == list(before.messages)
            assert list(restored.pins) == list(before.pins)
            await h.append(*units(3, start=10))
            run = await h.compact()
            assert run.result.outcome.checkpoint_seq
            checkpoint = (await h.build()).messages[2].content[0].text.text
            assert "sub-agent `s1.sub` still running" in checkpoint
            with pytest.raises(grpc.aio.AioRpcError):  # the restored fold knows it is open
                await h.append(subagent_start("s1.sub"))
    finally:
        await again.stop(0)
