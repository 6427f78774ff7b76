"""RecoverFromError(CONTEXT_WINDOW_EXCEEDED) over a real server, as a runtime's step meets it.

The runtime's request goes to the loopback provider, which answers with a real provider's
overflow body; the runtime hands the raw response (or its own classification) to the service,
which prunes, compacts the whole head and says whether to retry. Each test reads the result, the
log and the loopback's recorded requests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest

from compactd.core.meter import heuristic_price
from compactd.testing import provider_errors as pe
from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from tests.api.rpc import details
from tests.builders import (
    assistant,
    header,
    in_step,
    pin,
    system,
    tool,
    tool_result,
    turn_start,
    user,
)
from tests.compaction_fixtures import (
    PROVIDER,
    RELAXED,
    TOOLS,
    WINDOW,
    body,
    opening,
    started,
    summary_requests,
)
from tests.runtime import (
    OVERFLOW_RULES,
    bulky_turn,
    closed_turns,
    of_type,
    overflow_error,
    raw_error,
    recover,
    send,
)

CONTEXT = cpb.PROVIDER_ERROR_KIND_CONTEXT_WINDOW_EXCEEDED
DECLINE = cpb.RecoveryDecline
REPLACE = events_pb2.SURFACE_OP_KIND_REPLACE


def failing_step(turn: int) -> list[events_pb2.SessionEvent]:
    """An open turn whose first step's request is about to fail."""
    return [turn_start(turn), user("Now fix the failing module and rerun the checks.")]


@pytest.mark.parametrize(("provider", "rule"), OVERFLOW_RULES)
async def test_an_overflow_compacts_the_whole_head_below_any_threshold_and_authorizes_a_retry(
    tmp_path: Path, loop: OpenAICompatServer, provider: str, rule: str
) -> None:
    loop.enqueue(pe.overflow(provider, window=16000, prompt_tokens=17250))
    async with started(tmp_path, loop, policy=RELAXED) as h:  # far below the trigger
        await h.create(*opening(), *closed_turns(6), *failing_step(7))
        before = await h.build()
        refused = await send(loop, before)
        assert refused.status_code == 400

        run = await recover(h, 7, raw_error(refused))

        result = run.result
        assert (result.retry, result.kind, result.decline) == (True, CONTEXT, 0)
        assert (result.classification.rule, result.classification.context_window) == (rule, 16000)
        (outcome,) = result.compactions
        assert outcome.items_condensed == 24  # every exchange: all but the last unit
        log = await h.events()
        (start,) = of_type(log, "compaction_start")
        assert start.compaction_start.trigger == events_pb2.COMPACTION_TRIGGER_OVERFLOW
        assert start.compaction_start.turn == 7
        assert result.request == await h.build()
        assert len(result.request.messages) == 3  # system, checkpoint, the failing step's user
        assert (await send(loop, result.request)).status_code == 200  # the retry goes through
        assert len(summary_requests(loop)) == 1


async def test_an_overflow_the_runtime_classified_recovers_the_same_way(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *closed_turns(3), *failing_step(4))

        result = (await recover(h, 4, overflow_error())).result

        assert result.retry
        assert not result.HasField("classification")
        assert result.kind == CONTEXT


async def test_an_indivisible_unit_keeps_the_error_with_its_figures_and_writes_nothing(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    huge = user("Summarize this whole report: " + "The quarterly figures grew. " * 450)
    loop.enqueue(pe.overflow("llama.cpp", window=2048, prompt_tokens=3270))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), turn_start(1), huge)
        before = await h.events()
        refused = await send(loop, await h.build())

        result = (await recover(h, 1, raw_error(refused))).result

        assert (result.retry, result.decline) == (False, DECLINE.RECOVERY_DECLINE_INDIVISIBLE_UNIT)
        figures = result.figures
        assert (figures.context_window, figures.window_source) == (WINDOW, "route")  # declared
        assert figures.prompt_tokens == 3270
        assert figures.unit_tokens == heuristic_price(huge)
        assert figures.unit_range.start_seq == figures.unit_range.end_seq == before[-1].seq
        assert "one indivisible unit" in result.reason
        assert str(figures.unit_tokens) in result.reason
        assert await h.events() == before
        assert summary_requests(loop) == []


async def test_an_open_tool_call_or_a_lone_checkpoint_leaves_nothing_to_reduce(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *closed_turns(3), *failing_step(4))
        assert (await recover(h, 4, overflow_error())).result.retry
        before = await h.events()

        again = (await recover(h, 4, overflow_error())).result  # the next step overflows too

        assert (again.retry, again.decline) == (False, DECLINE.RECOVERY_DECLINE_NOTHING_SELECTABLE)
        assert "previous checkpoint" in again.reason
        assert await h.events() == before

        await h.append(*in_step(4, 1, assistant(calls=[("open-1", "run", "{}")])))
        waiting = (await recover(h, 4, overflow_error())).result
        assert (waiting.retry, waiting.decline) == (False, DECLINE.RECOVERY_DECLINE_OPEN_TAIL)
        assert "open-1" in waiting.reason


@pytest.mark.parametrize(
    ("policy", "retries_so_far", "allowed"),
    [
        ({}, 0, True),
        ({}, 1, False),
        ({"maxOverflowRetries": 2}, 1, True),
        ({"maxOverflowRetries": 2}, 2, False),
        ({"maxOverflowRetries": 0}, 0, False),
    ],
    ids=["first", "default-limit", "raised-limit", "raised-limit-reached", "zero-disables"],
)
async def test_at_most_max_overflow_retries_recoveries_per_step(
    tmp_path: Path,
    loop: OpenAICompatServer,
    policy: dict[str, int],
    retries_so_far: int,
    allowed: bool,
) -> None:
    async with started(tmp_path, loop, policy={**RELAXED, **policy}) as h:
        await h.create(*opening(), *closed_turns(3), *failing_step(4))
        before = await h.events()

        result = (await recover(h, 4, overflow_error(), retries_so_far)).result

        assert result.retry is allowed
        if not allowed:
            assert result.decline == DECLINE.RECOVERY_DECLINE_RETRIES_EXHAUSTED
            assert f"maxOverflowRetries={policy.get('maxOverflowRetries', 1)}" in result.reason
            assert await h.events() == before
            assert summary_requests(loop) == []


async def test_auto_off_disables_overflow_recovery(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy={**RELAXED, "auto": False}) as h:
        await h.create(*opening(), *closed_turns(3), *failing_step(4))

        result = (await recover(h, 4, overflow_error())).result

        assert (result.retry, result.decline) == (False, DECLINE.RECOVERY_DECLINE_AUTO_DISABLED)


CODEX_PROMPT = "You are Codex, a coding agent running in a sandboxed terminal. " * 275  # ~4.4k


async def test_an_envelope_only_overflow_is_reported_with_its_figures(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    """A 4.4k-token system prompt against llama-server's 2048-token window: no compaction helps."""
    nocap = {"provider": "llama", "model": "smollm2", "base_url": loop.base_url}
    tools = [tool(f"tool{i}", '{"type":"object"}', "A tool.") for i in range(3)]
    loop.enqueue(pe.overflow("llama.cpp", window=2048, prompt_tokens=4690))
    async with started(tmp_path, loop, routes=[nocap]) as h:
        await h.create(
            system(CODEX_PROMPT), header("llama", "smollm2", tools=tools), *failing_step(1)
        )
        before = await h.events()
        refused = await send(loop, await h.build())

        result = (await recover(h, 1, raw_error(refused))).result

        assert (result.retry, result.decline) == (False, DECLINE.RECOVERY_DECLINE_ENVELOPE_ONLY)
        figures = result.figures
        assert (figures.context_window, figures.window_source) == (2048, "provider")
        assert figures.system_tokens == heuristic_price(system(CODEX_PROMPT)) > 4000
        assert figures.tools_tokens > 0
        assert figures.envelope_tokens == figures.system_tokens + figures.tools_tokens
        assert f"system {figures.system_tokens}" in result.reason
        assert await h.events() == before


async def test_an_envelope_over_a_declared_window_is_reported_without_provider_figures(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    small = {"provider": PROVIDER, "model": "small", "context_window": 4096, "base_url": "x"}
    async with started(tmp_path, loop, routes=[small]) as h:
        await h.create(system(CODEX_PROMPT), header(PROVIDER, "small"), *failing_step(1))

        result = (await recover(h, 1, overflow_error())).result

        assert result.decline == DECLINE.RECOVERY_DECLINE_ENVELOPE_ONLY
        assert (result.figures.context_window, result.figures.window_source) == (4096, "route")


async def test_pins_count_in_the_envelope_no_compaction_reduces(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    small = {"provider": PROVIDER, "model": "small", "context_window": 4096, "base_url": "x"}
    goal = "Keep the public API stable. " * 450  # ~3.2k tokens: the pins alone fit the window
    async with started(tmp_path, loop, routes=[small]) as h:
        await h.create(system("Be brief. " * 400), header(PROVIDER, "small"), pin("goal", goal))
        await h.append(pin("plan", "1. test 2. fix " * 50), *failing_step(1))

        result = (await recover(h, 1, overflow_error())).result

        assert result.decline == DECLINE.RECOVERY_DECLINE_ENVELOPE_ONLY
        figures = result.figures
        assert 3000 < figures.pins_tokens < 4096 < figures.envelope_tokens
        assert figures.envelope_tokens == (
            figures.system_tokens + figures.tools_tokens + figures.config_tokens
            + figures.pins_tokens
        )  # fmt: skip
        assert f"pins {figures.pins_tokens}" in result.reason


async def test_pruning_that_landed_before_a_failed_summary_still_authorizes_a_retry(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *bulky_turn(1), *closed_turns(2, start=2)[:-1], user("Fix it."))
        loop.enqueue(Reply.http_error(400, "unsupported parameter: temperature"))

        result = (await recover(h, 3, overflow_error())).result

        assert (result.retry, result.pruned_count, result.cause) == (True, 1, "SUMMARY_FAILED")
        assert list(result.compactions) == []
        log = [body(e) for e in await h.events()]
        assert log.count("compaction_prune") == 1
        assert log[-1] == "compaction_end"


@pytest.mark.parametrize(
    ("window", "chars", "prunes"),
    [(2048, 8000, 1), (1536, 20000, 2)],
    ids=["under-the-pruner-threshold", "already-pruned-still-too-large"],
)
async def test_a_tool_result_that_alone_exceeds_a_small_window_is_pruned_to_fit(
    tmp_path: Path, loop: OpenAICompatServer, window: int, chars: int, prunes: int
) -> None:
    small = {
        "provider": PROVIDER,
        "model": "small",
        "context_window": window,
        "max_output_tokens": 256,
        "base_url": loop.base_url,
    }
    step = [
        turn_start(1),
        user("Read the server log and tell me what failed. " + "It is long. " * 60),
        *in_step(1, 1, assistant(calls=[("read-1", "read", '{"path":"server.log"}')])),
        tool_result("read-1", "GET /health 200 OK\n" * (chars // 19), name="read"),
    ]
    loop.enqueue(Reply(text="The user asked to read the server log."))
    async with started(tmp_path, loop, policy=RELAXED, routes=[small]) as h:
        await h.create(system("Be brief."), header(PROVIDER, "small", tools=TOOLS), *step)
        envelope = (await h.pressure()).breakdown

        result = (await recover(h, 1, overflow_error())).result

        assert result.retry
        assert result.pruned_count == prunes
        room = window - 256 - (envelope.system_tokens + envelope.tools_tokens)
        (node,) = [n for n in (await h.surface()).nodes if n.type == "tool/result"]
        assert heuristic_price(node.message) <= room // 2
        replaced = [e for e in await h.events() if e.surface_op.kind == REPLACE]
        assert [body(e) for e in replaced][:prunes] == ["tool_result"] * prunes


async def test_recovery_needs_an_open_turn_and_a_known_session(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *closed_turns(2))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await recover(h, 9, overflow_error())
        got = details(caught.value)
        assert (got.code, got.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NO_OPEN_TURN")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await recover(dataclasses.replace(h, session_id="nope"), 1, overflow_error())
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_routes_declared_window_decides_over_the_one_the_caller_states(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    huge = user("Summarize this whole report: " + "The quarterly figures grew. " * 450)
    async with started(tmp_path, loop, kind="extractive") as h:  # the built-in route, no key
        await h.create(system("Be brief."), header("openai", "gpt-4o"), turn_start(1), huge)

        stated = overflow_error(context_window=100, prompt_tokens=3000)
        result = (await recover(h, 1, stated)).result

        assert result.decline == DECLINE.RECOVERY_DECLINE_INDIVISIBLE_UNIT  # not ENVELOPE_ONLY
        figures = result.figures
        assert (figures.context_window, figures.window_source) == (128_000, "route")
        assert figures.prompt_tokens == 3000


@pytest.mark.parametrize(
    "stated",
    [{"context_window": 2**63 - 1, "prompt_tokens": -1}, {"context_window": -5}],
    ids=["above-any-window", "negative"],
)
async def test_a_figure_no_request_can_have_counts_as_not_stated(
    tmp_path: Path, loop: OpenAICompatServer, stated: dict[str, int]
) -> None:
    nocap = {"provider": "llama", "model": "smollm2", "base_url": loop.base_url}
    huge = user("Summarize this whole report: " + "The quarterly figures grew. " * 450)
    async with started(tmp_path, loop, routes=[nocap]) as h:
        await h.create(system("Be brief."), header("llama", "smollm2"), turn_start(1), huge)

        result = (await recover(h, 1, overflow_error(**stated))).result

        assert result.decline == DECLINE.RECOVERY_DECLINE_INDIVISIBLE_UNIT
        figures = result.figures
        assert (figures.context_window, figures.window_source, figures.prompt_tokens) == (0, "", 0)
        assert "an unknown window" in result.reason


HUGE = 10**20  # above int64


@pytest.mark.parametrize(
    ("reply", "decline"),
    [
        (pe.overflow("llama.cpp", window=HUGE, prompt_tokens=HUGE), "INDIVISIBLE_UNIT"),
        (pe.overflow("anthropic", window=HUGE, prompt_tokens=HUGE), "INDIVISIBLE_UNIT"),
        (pe.gateway_image_budget(99_999_999_999), "OFFLOAD_COUNT_UNKNOWN"),
        (Reply(status=400, body="[" * 100_000), "NOT_RECOVERABLE"),
    ],
    ids=["llama-above-int64", "anthropic-above-int64", "offload-above-int32", "deep-nesting"],
)
async def test_a_hostile_raw_error_is_classified_and_recovered_against_the_route(
    tmp_path: Path, loop: OpenAICompatServer, reply: Reply, decline: str
) -> None:
    huge = user("Summarize this whole report: " + "The quarterly figures grew. " * 450)
    loop.enqueue(reply)
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), turn_start(1), huge)
        refused = await send(loop, await h.build())

        result = (await recover(h, 1, raw_error(refused))).result

        got = result.classification
        assert (got.context_window, got.prompt_tokens, got.offload_images) == (0, 0, 0)
        assert DECLINE.Name(result.decline) == f"RECOVERY_DECLINE_{decline}"
        if decline == "INDIVISIBLE_UNIT":
            assert (result.figures.context_window, result.figures.window_source) == (
                WINDOW,
                "route",
            )
