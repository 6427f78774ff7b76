"""The compaction engine, run for real: a server on port 0 over a SQLite file, summarizing through
a loopback OpenAI-compatible provider (streamed, with usage, errors and slow replies).

Each test reads the log and the loopback's recorded requests, the two places a compaction leaves
evidence: pruning before summarizing, the bracket's five events in order, the summary request as
a byte prefix of the conversation's, summarizer failures closing the bracket, the shrink check,
and convergence retries.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from compactd.core import prompts
from compactd.core.pruner import PRUNE_MARKER
from compactd.core.recall import (
    checkpoint_handle,
    prune_handle,
    recall_section,
    without_recall_handles,
)
from compactd.providers import openai_wire
from compactd.providers.base import SummaryError
from compactd.service.bracket import SummaryFailure
from compactd.service.sessions import SessionHandle
from compactd.testing.openai_server import OpenAICompatServer, Reply, ScriptedToolCall
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from tests.api.rpc import details
from tests.builders import (
    assistant,
    exchange,
    header,
    in_step,
    system,
    tool_result,
    turn_end,
    turn_start,
    user,
)
from tests.compaction_fixtures import (
    ABOVE,
    BELOW,
    MODEL,
    POLICY,
    PROVIDER,
    RELAXED,
    TOOLS,
    body,
    loopback,
    opening,
    started,
    summary_requests,
    unit,
    units,
)

REPLACE = events_pb2.SURFACE_OP_KIND_REPLACE
STEP = cpb.CompactionStep
#: A middle unit no pruner can shrink: after the first bracket keeps it, pressure stays above.
HUGE = exchange(900, "Explain the whole design.", assistant(text="Design notes, part one. " * 800))
#: For tests of the wire, not of the quality gate: their scripted summaries are fragments.
UNGATED = {**POLICY, "summaryGate": False}


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


def bodies(events: list[events_pb2.SessionEvent]) -> list[str]:
    return [body(e) for e in events]


def of_type(events: list[events_pb2.SessionEvent], name: str) -> list[events_pb2.SessionEvent]:
    return [e for e in events if body(e) == name]


def raw_messages(raw: bytes) -> bytes:
    """The bytes of a request body's ``messages`` array, exactly as sent."""
    text = raw.decode("utf-8")
    start = text.index('"messages":') + len('"messages":')
    _, end = json.JSONDecoder().raw_decode(text, start)
    return text[start:end].encode("utf-8")


# ---- pressure and pruning ----------------------------------------------------------------------


async def test_below_pressure_prepare_step_never_prunes_and_appends_nothing(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(3), *unit(3, result="y" * 20_000), turn_start(1))
        before = await h.events()
        run = await h.prepare(1)
        assert run.progress == []
        assert run.result.before.state == BELOW
        assert run.result.after == run.result.before
        assert run.result.pruned_count == 0
        assert list(run.result.compactions) == []
        assert await h.events() == before
        assert loop.requests == []


async def test_pruning_runs_first_and_alone_can_avoid_the_summary(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(2), *unit(2, result="y" * 40_000), turn_start(1))
        original = of_type(await h.events(), "tool_result")[-1]
        run = await h.prepare(1)

        result = run.result
        assert (result.before.state, result.after.state) == (ABOVE, BELOW)
        assert result.pruned_count == 1
        assert list(result.compactions) == []
        assert run.steps() == [STEP.COMPACTION_STEP_PRUNE, STEP.COMPACTION_STEP_MEASURE]
        log = await h.events()
        assert not of_type(log, "compaction_start")
        assert bodies(log[-2:]) == ["compaction_prune", "tool_result"]
        prune, pruned = log[-2:]
        assert prune.compaction_prune.shadowed_seq == original.seq
        assert pruned.surface_op.kind == REPLACE
        assert list(pruned.source_event_seqs) == [original.seq]
        text = pruned.tool_result.content[0].text.text
        handle = f"[recall:{prune_handle(original.seq)}]\n\n"
        assert text == "y" * 4096 + PRUNE_MARKER + handle + "y" * 1024
        assert run.progress[0].seq == pruned.seq
        assert summary_requests(loop) == []

        again = await h.prepare(1)  # below now: the pruned result is left alone
        assert again.result.pruned_count == 0
        assert len(await h.events()) == len(log)


async def test_pruning_runs_before_the_bracket_when_it_is_not_enough(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *unit(0, result="z" * 40_000), *units(18, 1), turn_start(1))
        run = await h.prepare(1)
        assert run.result.pruned_count == 1
        assert len(run.result.compactions) == 1
        assert run.steps()[:3] == [
            STEP.COMPACTION_STEP_PRUNE,
            STEP.COMPACTION_STEP_MEASURE,
            STEP.COMPACTION_STEP_START,
        ]
        log = bodies(await h.events())
        assert log.index("compaction_prune") < log.index("compaction_start")


# ---- the bracket in the log --------------------------------------------------------------------


async def test_the_bracket_is_logged_in_order_and_streamed_step_by_step(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(18), turn_start(1))
        surface_before = await h.surface()
        run = await h.prepare(1)

        assert run.result.after.state == BELOW
        (outcome,) = run.result.compactions
        log = await h.events()
        start, summary, checkpoint, end = log[-4:]
        assert bodies(log[-4:]) == [
            "compaction_start",
            "compaction_summary",
            "user_message",
            "compaction_end",
        ]
        cid = outcome.compaction_id
        assert start.compaction_start.compaction_id == cid
        assert start.compaction_start.trigger == events_pb2.COMPACTION_TRIGGER_PRESSURE
        assert start.compaction_start.turn == 1
        shadowed = list(start.compaction_start.shadowed_seqs)
        first, last = outcome.range.start_position, outcome.range.end_position
        assert shadowed == [n.seq for n in surface_before.nodes[first : last + 1]]
        assert first == 1  # the system head is never shadowed
        assert outcome.items_condensed == len(shadowed)

        assert summary.compaction_summary.compaction_id == cid
        assert list(summary.compaction_summary.shadowed_seqs) == shadowed
        tokens = summary.compaction_summary.tokens
        assert tokens.envelope_after < tokens.envelope_before
        assert tokens.checkpoint_route_tokens < tokens.shadowed_route_tokens
        assert summary.compaction_summary.target == events_pb2.Route(provider=PROVIDER, model=MODEL)
        assert summary.compaction_summary.summarizer == "openai"
        assert summary.compaction_summary.usage.output_tokens > 0

        message = checkpoint.user_message
        assert message.source.compaction_checkpoint.compaction_id == cid
        assert checkpoint.surface_op.kind == REPLACE
        assert (checkpoint.surface_op.start_seq, checkpoint.surface_op.end_seq) == (
            shadowed[0],
            shadowed[-1],
        )
        assert list(checkpoint.source_event_seqs) == [start.seq, summary.seq, *shadowed]
        raw = summary.compaction_summary.summary
        assert message.content[0].text.text == (
            f"{prompts.CHECKPOINT_PREAMBLE}\n\n<compacted-summary>\n{raw}\n</compacted-summary>"
            f"\n\n{recall_section([checkpoint_handle(start.seq)])}"
        )
        assert end.compaction_end.compaction_id == cid
        assert end.compaction_end.error == ""

        assert run.steps() == [
            STEP.COMPACTION_STEP_START,
            STEP.COMPACTION_STEP_SUMMARIZE,
            STEP.COMPACTION_STEP_GATE,
            STEP.COMPACTION_STEP_SUMMARY,
            STEP.COMPACTION_STEP_REPLACE,
            STEP.COMPACTION_STEP_END,
            STEP.COMPACTION_STEP_MEASURE,
        ]
        streamed = [(p.step, p.seq) for p in run.progress if p.seq >= 0]
        assert streamed == [
            (STEP.COMPACTION_STEP_START, start.seq),
            (STEP.COMPACTION_STEP_SUMMARY, summary.seq),
            (STEP.COMPACTION_STEP_REPLACE, checkpoint.seq),
            (STEP.COMPACTION_STEP_END, end.seq),
        ]
        assert {p.compaction_id for p in run.progress[:5]} == {cid}

        after = await h.surface()
        assert [n.seq for n in after.nodes[:2]] == [surface_before.nodes[0].seq, checkpoint.seq]
        assert after.nodes[1].compaction_id == cid
        sent = [m.content[0].text.text for m in run.result.request.messages if m.content]
        assert sum(prompts.SUMMARY_OPEN_TAG in text for text in sent) == 1


async def test_the_summary_request_replays_the_conversation_bytes_as_a_prefix(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        conversation = [
            system("You are a careful coding agent. Ünïcode stays as is: 日本語."),
            header(PROVIDER, MODEL, tools=TOOLS),
            *exchange(
                1,
                "Fix the failing test in src/app.py",
                assistant(
                    text="Looking.",
                    reasoning="The test imports app.",
                    calls=[("c1", "run", '{"cmd":"pytest -x"}')],
                ),
                tool_result(
                    "c1",
                    "FAILED tests/test_app.py::test_x - KeyError: 'k'",
                    name="run",
                    is_error=True,
                ),
                assistant(text="The key is missing; adding it."),
            ),
            *units(2),
        ]
        await h.create(*conversation)
        built = await h.build()
        messages = openai_wire.encode_messages(built.messages, include_reasoning=True)
        sent = openai_wire.dumps(
            openai_wire.encode_request(
                messages, openai_wire.encode_tools(built.tools), built.config, stream=True
            )
        )
        async with httpx.AsyncClient() as client:  # the runtime's own step
            reply = await client.post(f"{loop.base_url}/chat/completions", content=sent)
            assert reply.status_code == 200

        run = await h.compact()
        assert run.result.outcome.compaction_id

        conversation_request, summary_request = loop.requests
        assert conversation_request.body == sent
        assert summary_request.header("x-compactd-purpose") == "compaction"
        instruction = openai_wire.dumps(
            openai_wire.user_text_message(prompts.compaction_instruction())
        )
        summary_messages = raw_messages(summary_request.body)
        assert summary_messages.endswith(b"," + instruction + b"]")
        replayed = summary_messages[: -len(instruction) - 1]  # "[" + the span's messages + ","
        assert raw_messages(conversation_request.body).startswith(replayed)
        span = run.result.outcome.items_condensed
        assert len(json.loads(summary_messages)) == 1 + span + 1  # system head, span, instruction
        assert summary_request.json["tools"] == conversation_request.json["tools"]
        assert summary_request.json["model"] == MODEL
        assert summary_request.json["stream"] is True

        summary = of_type(await h.events(), "compaction_summary")[0].compaction_summary
        assert summary.usage.cache_read_tokens > 0  # the provider saw the warm prefix


# ---- what the summarizer returns ---------------------------------------------------------------


async def test_reasoning_and_tool_calls_in_the_summary_reply_are_dropped(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    text = "## Goals and Requests\n- keep src/mod0.py passing"
    loop.enqueue(
        Reply(
            text=text,
            reasoning="SECRET chain of thought",
            tool_calls=(ScriptedToolCall("run", '{"cmd":"rm -rf /"}'),),
        )
    )
    async with started(tmp_path, loop, policy=UNGATED) as h:
        await h.create(*opening(), *units(4))
        await h.compact()
        log = await h.events()
        (summary,) = of_type(log, "compaction_summary")
        assert summary.compaction_summary.summary == text
        checkpoint = log[-2].user_message.content
        assert len(checkpoint) == 1
        assert without_recall_handles(checkpoint[0].text.text) == prompts.frame_checkpoint(text)
        assert "SECRET" not in str(log[-4:])
        assert "rm -rf" not in str(log[-4:])


async def test_image_output_closes_the_bracket_with_unsupported_content(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text="a summary", image=True))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(4))
        surface = await h.surface()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.compact()
        assert details(caught.value).reason == "UNSUPPORTED_CONTENT"
        log = await h.events()
        assert bodies(log[-3:]) == [
            "compaction_start",
            "compaction_summary_error",
            "compaction_end",
        ]
        error = log[-2].compaction_summary_error
        assert (error.reason, error.attempt, error.retrying) == ("UNSUPPORTED_CONTENT", 1, False)
        assert log[-1].compaction_end.error_reason == "UNSUPPORTED_CONTENT"
        assert "image" in log[-1].compaction_end.error
        assert (await h.surface()).nodes == surface.nodes


async def test_a_rate_limited_summary_is_retried_and_commits(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply.rate_limited(retry_after=0))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(4))
        run = await h.compact()
        assert run.result.outcome.compaction_id
        assert len(summary_requests(loop)) == 2
        log = await h.events()
        assert not of_type(log, "compaction_summary_error")
        assert log[-1].compaction_end.error == ""


async def test_a_server_error_that_never_recovers_closes_the_bracket_with_its_text(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply.server_error(500), Reply.server_error(500))
    async with started(tmp_path, loop, summarizer={"max_attempts": 2}) as h:
        await h.create(*opening(), *units(4))
        surface = await h.surface()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.compact()
        assert details(caught.value).code == grpc.StatusCode.UNAVAILABLE
        assert len(summary_requests(loop)) == 2
        log = await h.events()
        assert bodies(log[-3:]) == [
            "compaction_start",
            "compaction_summary_error",
            "compaction_end",
        ]
        error, end = log[-2].compaction_summary_error, log[-1].compaction_end
        assert "processing your request" in error.error
        assert "gave up after 2 attempts" in error.error
        assert error.error in end.error
        assert end.error_reason == error.reason != ""
        assert (await h.surface()).nodes == surface.nodes


async def test_a_slow_streamed_summary_still_commits(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(
        Reply(
            text="## Goals and Requests\n- slow " + "word " * 40,
            delay_before=0.2,
            delay_between=0.01,
            chunk_chars=8,
        )
    )
    async with started(tmp_path, loop, policy=UNGATED) as h:
        await h.create(*opening(), *units(4))
        run = await h.compact()
        assert run.result.outcome.compaction_id
        (summary,) = of_type(await h.events(), "compaction_summary")
        assert summary.compaction_summary.summary.endswith("word")


async def test_a_summary_slower_than_the_timeout_fails_with_timeout(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(delay_before=30))
    options: dict[str, Any] = {"max_attempts": 1, "timeout_s": 0.3}
    async with started(tmp_path, loop, summarizer=options) as h:
        await h.create(*opening(), *units(4))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.compact()
        assert details(caught.value).reason == "TIMEOUT"
        assert (await h.events())[-1].compaction_end.error_reason == "TIMEOUT"


async def test_a_summary_not_smaller_than_its_span_is_rejected_and_nothing_replaced(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(text="A summary that rambles on. " * 400))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(2))
        surface = await h.surface()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.compact()
        got = details(caught.value)
        assert got.reason == "SUMMARY_NOT_SMALLER"
        assert int(got.metadata["checkpoint_tokens"]) >= int(got.metadata["shadowed_tokens"])
        log = await h.events()
        assert bodies(log[-2:]) == ["compaction_start", "compaction_end"]
        assert log[-1].compaction_end.error_reason == "SUMMARY_NOT_SMALLER"
        assert not of_type(log, "compaction_summary")
        assert (await h.surface()).nodes == surface.nodes


# ---- one bracket a step, the outcome typed ------------------------------------------------------


async def test_a_step_runs_one_bracket_and_keeps_the_retained_tail_verbatim(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy={**POLICY, "compactionRetries": 1}) as h:
        await h.create(*opening(), *units(10), *HUGE, *units(1, 10), turn_start(1))
        before = await h.surface()
        run = await h.prepare(1)

        result = run.result
        (outcome,) = result.compactions  # one bracket; the retained tail is new work's later
        assert (result.before.state, result.after.state) == (ABOVE, ABOVE)
        assert len(summary_requests(loop)) == 1
        after = await h.surface()
        kept = before.nodes[outcome.range.end_position + 1 :]
        assert [n.seq for n in after.nodes[2:]] == [n.seq for n in kept]  # the tail, verbatim
        huge = next(n for n in kept if "Design notes" in str(n.message))
        assert huge.seq in [n.seq for n in after.nodes]
        tail_tokens = sum(
            len(block.text.text) for n in kept for block in n.message.content if block.text.text
        )
        assert tail_tokens // 4 >= result.after.retained_budget


async def test_pressure_left_above_the_trigger_is_a_typed_outcome_with_the_figures(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy={**POLICY, "compactionRetries": 0}) as h:
        await h.create(*opening(), *units(10), *HUGE, *units(1, 10), turn_start(1))
        result = (await h.prepare(1)).result
        assert len(result.compactions) == 1
        assert result.after.state == ABOVE
        assert result.outcome == cpb.PRESSURE_OUTCOME_ABOVE_TRIGGER
        assert f"measured {result.after.measured_tokens}" in result.outcome_detail
        assert f"trigger {result.after.trigger_tokens}" in result.outcome_detail
        assert 0 < result.floor_tokens < result.after.measured_tokens
        assert result.warnings == []  # the outcome says it; no free text needed


async def test_a_later_compaction_folds_the_first_checkpoint(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(18), turn_start(1))
        first = (await h.prepare(1)).result.compactions[0]
        checkpoint = (await h.events())[first.checkpoint_seq].user_message.content[0].text.text
        await h.append(*units(18, 18), turn_start(2))
        second = (await h.prepare(2)).result.compactions[0]

        assert second.range.start_position == 1
        assert first.checkpoint_seq in (await h.events())[second.checkpoint_seq].source_event_seqs
        messages = summary_requests(loop)[1]["messages"]
        assert messages[1] == {"role": "user", "content": checkpoint}


# ---- summarizers and targets ---------------------------------------------------------------------


async def test_the_extractive_summarizer_compacts_without_a_model(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(18), turn_start(1))
        run = await h.prepare(1)
        assert run.result.after.state == BELOW
        (summary,) = of_type(await h.events(), "compaction_summary")
        assert summary.compaction_summary.summarizer == "extractive"
        assert "src/mod0.py" in summary.compaction_summary.summary
        assert loop.requests == []


def _paths_unit(i: int) -> list[events_pb2.SessionEvent]:
    """A closed turn whose request names 30 files of its own: more facts than 15% of a span
    holds, so a checkpoint fills its share."""
    named = " ".join(f"pkg{i}/area{j}/module_{i}_{j}.py" for j in range(30))
    return [
        turn_start(1000 + i),
        user(f"Step {i}: review {named} and report."),
        *in_step(1000 + i, 1, assistant(text=f"Reviewed step {i}; every module passes.")),
        turn_end(1000 + i),
    ]


async def test_the_extractive_checkpoint_fills_its_share_of_the_span_as_the_route_counts_it(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # The bracket hands the extractive summarizer the route's count of the checkpoint: it
    # takes 15% of its span as the route counts it (the quality gate's measure), not what an
    # estimate that errs high would leave, and the model's output cap (maxTokens, 64 here)
    # does not bound it.
    policy = {**POLICY, "minReductionRatio": 0.85, "maxTokens": 64}
    async with started(tmp_path, loop, kind="extractive", policy=policy) as h:
        opened = [e for i in range(24) for e in _paths_unit(i)]
        await h.create(*opening(), *opened, turn_start(1))
        await h.prepare(1)
        summaries = of_type(await h.events(), "compaction_summary")

    assert summaries
    for summary in summaries:
        tokens = summary.compaction_summary.tokens
        share = tokens.checkpoint_route_tokens / tokens.shadowed_route_tokens
        assert 0.14 <= share <= 0.15, share
        assert tokens.checkpoint_route_tokens > 64


async def test_the_configured_summarization_pair_writes_the_summary(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    small = {
        "provider": PROVIDER,
        "model": "small",
        "context_window": 32_000,
        "base_url": loop.base_url,
    }
    policy = {**POLICY, "summarizationProvider": PROVIDER, "summarizationModel": "small"}
    async with started(tmp_path, loop, policy=policy, routes=[small]) as h:
        await h.create(*opening(), *units(4))
        await h.compact()
        (request,) = summary_requests(loop)
        assert request["model"] == "small"
        (summary,) = of_type(await h.events(), "compaction_summary")
        assert summary.compaction_summary.target.model == "small"


async def test_no_summary_target_fails_clearly_and_writes_nothing(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(system("You are terse."), *units(4))  # no header routes a model
        before = await h.events()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.compact()
        got = details(caught.value)
        assert (got.code, got.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "SUMMARY_TARGET_UNKNOWN",
        )
        assert "summarizationProvider" in got.message
        assert await h.events() == before


async def test_the_extractive_summarizer_needs_no_target(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(system("You are terse."), *units(4))  # no header routes a model
        run = await h.compact()
        (summary,) = of_type(await h.events(), "compaction_summary")
    assert run.result.outcome.items_condensed > 0
    target = summary.compaction_summary.target
    assert (target.provider, target.model) == ("compactd", "extractive")
    assert summary.compaction_summary.summarizer == "extractive"
    assert summary_requests(loop) == []


async def test_a_span_larger_than_the_summarizer_window_is_summarized_in_chunks_and_merged(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    small = {
        "provider": PROVIDER,
        "model": "small",
        "context_window": 2500,
        "base_url": loop.base_url,
    }
    policy = {**POLICY, "summarizationProvider": PROVIDER, "summarizationModel": "small"}
    async with started(tmp_path, loop, policy=policy, routes=[small]) as h:
        await h.create(*opening(), *units(8))
        run = await h.compact()
        assert run.result.outcome.compaction_id

        requests = summary_requests(loop)
        assert len(requests) >= 3  # at least two chunks, then the merge
        *chunks, merge = requests  # the chunks run concurrently, in any order; the merge last
        headed = [c for c in chunks if c["messages"][0]["role"] == "system"]
        assert len(headed) == 1  # the first chunk keeps the head
        rest = [c for c in chunks if c is not headed[0]]
        assert all(m["role"] != "system" for c in rest for m in c["messages"])
        framed = [m["content"] for m in merge["messages"][:-1]]
        assert len(framed) == len(chunks)
        assert all(prompts.SUMMARY_OPEN_TAG in text for text in framed)
        (summary,) = of_type(await h.events(), "compaction_summary")
        assert summary.compaction_summary.usage.output_tokens > 0


class OffloadSpanImages:
    """A recovery that offloads every input image inside the failed summary's span."""

    def __init__(self) -> None:
        self.failures: list[SummaryFailure] = []

    def wants(self, error: SummaryError) -> bool:
        return error.reason == "IMAGE_OFFLOAD_REQUIRED"

    async def recover(self, handle: SessionHandle, failure: SummaryFailure) -> bool:
        self.failures.append(failure)
        targets = []
        for seq in failure.selection.shadowed_seqs:
            position = handle.fold.surface.position_of(seq)
            assert position is not None
            node = handle.fold.surface[position].event
            if node.HasField("user_message"):
                images = [b for b in node.user_message.content if b.HasField("image")]
                if images:
                    indexes = list(range(len(images)))
                    targets.append(events_pb2.ImageOffloadTarget(seq=seq, image_indexes=indexes))
        if not targets:
            return False
        offload = events_pb2.SessionEvent(image_offload=events_pb2.ImageOffload(targets=targets))
        await handle.append([offload])
        return True


def _with_image(text: str) -> events_pb2.SessionEvent:
    event = user(text)
    image = events_pb2.ImageBlock(
        media_type="image/png", name="plot.png", path="/att/plot.png", data=b"\x89PNG fake"
    )
    event.user_message.content.append(events_pb2.ContentBlock(image=image))
    return event


async def test_a_recovery_records_its_change_and_the_summary_is_retried_in_the_same_bracket(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    recovery = OffloadSpanImages()
    loop.enqueue(Reply.too_many_images(limit=0, offload_images=1))
    async with started(tmp_path, loop, recoveries=[recovery]) as h:
        await h.create(*opening(), _with_image("Look at this plot."), *units(4))
        run = await h.compact()
        log = await h.events()
    assert run.result.outcome.items_condensed > 0
    bracket_log = [body(e) for e in log if body(e).startswith(("compaction", "image"))]
    assert bracket_log == [
        "compaction_start",
        "compaction_summary_error",
        "image_offload",
        "compaction_summary",
        "compaction_end",
    ]
    (error,) = [e.compaction_summary_error for e in log if e.HasField("compaction_summary_error")]
    assert (error.reason, error.attempt, error.retrying) == ("IMAGE_OFFLOAD_REQUIRED", 1, True)
    first, second = summary_requests(loop)
    assert "image_url" in json.dumps(first["messages"])
    assert "image_url" not in json.dumps(second["messages"])  # re-derived with the offload
    assert "[image offloaded: plot.png" in json.dumps(second["messages"])
    assert [f.attempt for f in recovery.failures] == [1]


async def test_an_image_budget_error_without_a_count_closes_the_bracket(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # No count and no stated limit: the always-on image offload recovery cannot choose.
    loop.enqueue(Reply.http_error(413, "Request Entity Too Large"))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), _with_image("Look at this plot."), *units(4))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.compact()
        log = await h.events()
    assert details(caught.value).reason == "IMAGE_OFFLOAD_REQUIRED"
    (error,) = [e.compaction_summary_error for e in log if e.HasField("compaction_summary_error")]
    assert error.retrying is False
    assert body(log[-1]) == "compaction_end"
    assert log[-1].compaction_end.error_reason == "IMAGE_OFFLOAD_REQUIRED"
