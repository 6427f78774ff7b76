"""Image offload over a real server: RecoverFromError(IMAGE_OFFLOAD_REQUIRED) and the always-on
summary-error recovery inside a bracket.

The runtime's request (with inline images) goes to the loopback provider, which refuses its image
budget; the service offloads the oldest input images, the rebuilt request carries attachment text
in their place, and the meter prices that text. Offloads survive a larger route, a restart and a
later compaction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from compactd.core.pricing import quarter_tokens
from compactd.core.projection import offload_placeholder
from compactd.testing import provider_errors as pe
from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from tests.api.rpc import details
from tests.builders import (
    assistant,
    header,
    in_step,
    system,
    tool_result,
    turn_end,
    turn_start,
    user,
)
from tests.compaction_fixtures import (
    MAX_OUTPUT,
    POLICY,
    PROVIDER,
    WINDOW,
    Harness,
    body,
    started,
    summary_requests,
)
from tests.runtime import closed_turns, of_type, raw_error, recover, send

IMAGES = cpb.PROVIDER_ERROR_KIND_IMAGE_OFFLOAD_REQUIRED
DECLINE = cpb.RecoveryDecline
IMAGE_TOKENS = 765
VISION = "vision"


def vision_route(loop: OpenAICompatServer, model: str = VISION, **overrides: Any) -> dict[str, Any]:
    """A loopback route that prices every image sent at ``IMAGE_TOKENS``."""
    return {
        "provider": PROVIDER,
        "model": model,
        "context_window": WINDOW,
        "max_output_tokens": MAX_OUTPUT,
        "image_tokens": IMAGE_TOKENS,
        "base_url": loop.base_url,
        **overrides,
    }


def picture(name: str) -> events_pb2.ContentBlock:
    """An inline PNG with a name and a read-only path, as a runtime attaches a file."""
    image = events_pb2.ImageBlock(
        media_type="image/png",
        name=name,
        path=f"/attachments/{name}",
        data=b"\x89PNG " + name.encode(),
    )
    return events_pb2.ContentBlock(image=image)


def looking(turn: int) -> list[events_pb2.SessionEvent]:
    """A closed turn: two user images, a tool returning a screenshot, an assistant answer."""
    return [
        turn_start(turn),
        user("Look at these two plots.", blocks=[picture("a.png"), picture("b.png")]),
        *in_step(turn, 1, assistant(calls=[("shot-1", "screenshot", "{}")])),
        tool_result(
            "shot-1", "captured the dashboard", name="screenshot", blocks=[picture("c.png")]
        ),
        *in_step(turn, 2, assistant(text="The dashboard shows the same drop as the plots.")),
        turn_end(turn),
    ]


def opening() -> list[events_pb2.SessionEvent]:
    return [system("You read plots and dashboards."), header(PROVIDER, VISION)]


def sent_images(request: dict[str, Any]) -> int:
    """Image parts of a chat-completions body."""
    return sum(
        1
        for message in request["messages"]
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "image_url"
    )


def explicit(count: int) -> cpb.ProviderError:
    return cpb.ProviderError(kind=IMAGES, offload_images=count)


async def events_of(h: Harness, name: str) -> list[events_pb2.SessionEvent]:
    return of_type(await h.events(), name)


async def test_the_oldest_input_images_are_offloaded_in_message_order_and_the_step_retries(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(pe.vllm_image_limit(2), pe.vllm_image_limit(1))
    policy = {**POLICY, "maxOverflowRetries": 0}  # offload spends no overflow retry
    async with started(tmp_path, loop, policy=policy, routes=[vision_route(loop)]) as h:
        await h.create(*opening(), *looking(1), turn_start(2))
        await h.append(user("And this one?", blocks=[picture("d.png")]))
        log = await h.events()
        first_user = of_type(log, "user_message")[0].seq
        tool_seq = of_type(log, "tool_result")[0].seq
        before = await h.pressure()

        refused = await send(loop, await h.build())
        run = await recover(h, 2, raw_error(refused))

        result = run.result
        assert (result.retry, result.kind, result.offloaded_images) == (True, IMAGES, 2)
        assert (result.classification.rule, result.classification.offload_images) == (
            "vllm/image_limit",
            2,
        )
        (offload,) = await events_of(h, "image_offload")
        targets = [(t.seq, list(t.image_indexes)) for t in offload.image_offload.targets]
        assert targets == [(first_user, [0, 1])]
        assert [(p.step, p.seq) for p in run.progress] == [
            (cpb.COMPACTION_STEP_OFFLOAD, offload.seq)
        ]
        assert await events_of(h, "llm_retry") == []
        assert list(result.compactions) == []

        content = result.request.messages[1].content
        a, b = (picture(n).image for n in ("a.png", "b.png"))
        assert [block.text.text for block in content[1:]] == [
            offload_placeholder(a),
            offload_placeholder(b),
        ]
        assert "read-only path /attachments/a.png" in content[1].text.text
        after = await h.pressure()
        sent = IMAGE_TOKENS + quarter_tokens("a.png")  # an image and its name, as the route prices
        placeholders = sum(quarter_tokens(offload_placeholder(i)) + 4 for i in (a, b))
        assert (
            after.breakdown.images_tokens
            == before.breakdown.images_tokens - 2 * sent + placeholders
        )

        retried = await send(loop, result.request)  # refused again: one image too many
        again = (await recover(h, 2, raw_error(retried))).result
        assert again.offloaded_images == 1
        second = (await events_of(h, "image_offload"))[-1]
        assert [(t.seq, list(t.image_indexes)) for t in second.image_offload.targets] == [
            (tool_seq, [0])
        ]
        assert (await send(loop, again.request)).status_code == 200
        assert sent_images(loop.requests[-1].json) == 1  # only d.png, asked about now


async def test_an_offload_survives_a_larger_route_a_restart_and_a_later_compaction(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    routes = [vision_route(loop), vision_route(loop, "vision-big", context_window=128_000)]
    async with started(tmp_path, loop, routes=routes) as h:
        await h.create(*opening(), *looking(1), turn_start(2), user("Anything else?"))
        assert (await recover(h, 2, explicit(2))).result.retry
        offloaded = (await h.build()).messages[1]

        await h.append(header(PROVIDER, "vision-big"))  # the runtime moves to a larger window
        assert (await h.build()).messages[1] == offloaded

    async with started(tmp_path, loop, routes=routes) as h:  # a new process, the same log
        assert (await h.build()).messages[1] == offloaded
        await h.append(*in_step(2, 1, assistant(text="Nothing else stands out.")), turn_end(2))
        run = await h.compact()
        assert run.result.outcome.items_condensed > 0

    (summary,) = summary_requests(loop)
    replayed = json.dumps(summary["messages"])
    assert offload_placeholder(picture("a.png").image) in replayed
    assert sent_images(summary) == 1  # c.png only: a and b stay offloaded in the summary too


async def test_a_summary_refused_on_image_budget_offloads_only_the_region_and_retries_in_place(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(pe.gateway_image_budget(1))
    async with started(tmp_path, loop, routes=[vision_route(loop)]) as h:
        await h.create(*opening(), *looking(1), *closed_turns(12, start=2), turn_start(20))
        (today,) = await h.append(user("Compare with today's plot.", blocks=[picture("e.png")]))

        run = await h.prepare(20)

        (outcome,) = run.result.compactions
        log = await h.events()
        start = next(i for i, e in enumerate(log) if body(e) == "compaction_start")
        assert [body(e) for e in log[start:]] == [
            "compaction_start",
            "compaction_summary_error",
            "image_offload",
            "compaction_summary",
            "user_message",
            "compaction_end",
        ]
        error = log[start + 1].compaction_summary_error
        assert (error.reason, error.attempt, error.retrying) == ("IMAGE_OFFLOAD_REQUIRED", 1, True)
        targets = log[start + 2].image_offload.targets
        first_user = of_type(log, "user_message")[0].seq
        assert [(t.seq, list(t.image_indexes)) for t in targets] == [(first_user, [0])]  # a.png
        first, second = summary_requests(loop)
        assert (sent_images(first), sent_images(second)) == (3, 2)
        assert outcome.range.end_seq < today  # e.png's message is in the kept tail
        last = (await h.build()).messages[-1]
        assert last.content[-1].HasField("image")  # e.png is still sent
        # Re-derived and re-priced: the logged figures are those of the offloaded span.
        tokens = log[start + 3].compaction_summary.tokens
        swapped = tokens.envelope_before - tokens.shadowed_route_tokens
        assert swapped + tokens.checkpoint_route_tokens == tokens.envelope_after
        assert tokens.envelope_after == (await h.pressure()).measured_tokens


async def test_an_offload_recorded_inside_a_bracket_stays_when_the_summary_then_fails(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(pe.gateway_image_budget(1), Reply.http_error(400, "unsupported parameter: top_p"))
    async with started(tmp_path, loop, routes=[vision_route(loop)]) as h:
        await h.create(*opening(), *looking(1), *closed_turns(12, start=2), turn_start(20))
        await h.append(user("Go on."))

        run = await h.prepare(20)

        assert list(run.result.compactions) == []
        assert any("SUMMARY_FAILED" in w for w in run.result.warnings)
        log = await h.events()
        assert body(log[-1]) == "compaction_end"
        assert log[-1].compaction_end.error_reason == "SUMMARY_FAILED"
        assert len(of_type(log, "image_offload")) == 1
        kept = (await h.build()).messages[1].content[1]
        assert kept.text.text == offload_placeholder(picture("a.png").image)


async def test_an_image_budget_without_a_count_or_without_images_left_keeps_the_error(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply.http_error(413, "Request Entity Too Large"))
    async with started(tmp_path, loop, routes=[vision_route(loop)]) as h:
        await h.create(*opening(), *looking(1), turn_start(2), user("Again?"))
        refused = await send(loop, await h.build())

        unknown = (await recover(h, 2, raw_error(refused))).result
        assert (unknown.retry, unknown.decline) == (
            False,
            DECLINE.RECOVERY_DECLINE_OFFLOAD_COUNT_UNKNOWN,
        )
        assert unknown.classification.reason == "IMAGE_OFFLOAD_REQUIRED"

        assert (await recover(h, 2, explicit(5))).result.offloaded_images == 3
        before = await h.events()
        none_left = (await recover(h, 2, explicit(1))).result
        assert (none_left.retry, none_left.decline) == (False, DECLINE.RECOVERY_DECLINE_NO_IMAGES)
        assert await h.events() == before


async def test_a_transient_provider_error_is_classified_but_not_recovered(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(pe.rate_limited("anthropic", retry_after=3))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), turn_start(1), user("Hi."))
        before = await h.events()
        refused = await send(loop, await h.build())

        result = (await recover(h, 1, raw_error(refused))).result

        assert (result.retry, result.decline) == (False, DECLINE.RECOVERY_DECLINE_NOT_RECOVERABLE)
        classified = result.classification
        assert (classified.reason, classified.retryable, classified.retry_after_seconds) == (
            "RATE_LIMITED",
            True,
            3.0,
        )
        assert await h.events() == before


@pytest.mark.parametrize(
    ("error", "retries", "field"),
    [
        (cpb.ProviderError(), 0, "error.kind"),
        (explicit(0), 0, "error.offload_images"),
        (explicit(1), -1, "retries_so_far"),
    ],
    ids=["no-kind-no-raw", "offload-without-count", "negative-retries"],
)
async def test_a_malformed_recovery_request_is_invalid_argument_naming_the_field(
    tmp_path: Path,
    loop: OpenAICompatServer,
    error: cpb.ProviderError,
    retries: int,
    field: str,
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), turn_start(1), user("Hi."))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await recover(h, 1, error, retries)
        got = details(caught.value)
        assert got.code == grpc.StatusCode.INVALID_ARGUMENT
        assert got.fields == [field]


# ---- images a summary cannot carry (audit item 0) -------------------------------------------


@pytest.mark.parametrize(
    ("image", "field"),
    [
        (events_pb2.ImageBlock(name="image.png"), "image"),
        (events_pb2.ImageBlock(), "image"),
        (events_pb2.ImageBlock(name="raw.png", data=b"\x89PNG"), "image.media_type"),
    ],
    ids=["name-only", "empty", "inline-without-media-type"],
)
async def test_an_image_that_cannot_be_read_again_is_refused_at_append_naming_it(
    tmp_path: Path, loop: OpenAICompatServer, image: events_pb2.ImageBlock, field: str
) -> None:
    # Accepted, it would stop every later model summary of the session (UNSUPPORTED_CONTENT).
    async with started(tmp_path, loop, routes=[vision_route(loop)]) as h:
        await h.create(*opening(), turn_start(1))
        block = events_pb2.ContentBlock(image=image)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.append(user("see"), user("this", blocks=[block]))
        got = details(caught.value)
        assert got.code == grpc.StatusCode.INVALID_ARGUMENT
        assert got.fields == [f"events[1].user_message.content[1].{field}"]
        assert len(await h.events()) == 3  # nothing of the batch was written


@pytest.mark.parametrize(
    "image",
    [
        events_pb2.ImageBlock(media_type="image/png", name="inline.png", data=b"\x89PNG i"),
        events_pb2.ImageBlock(name="linked.png", path="/attachments/linked.png"),
        events_pb2.ImageBlock(attachment_id="att-7"),
    ],
    ids=["inline", "path", "attachment"],
)
async def test_a_readable_image_is_accepted_and_a_model_summary_still_runs(
    tmp_path: Path, loop: OpenAICompatServer, image: events_pb2.ImageBlock
) -> None:
    async with started(tmp_path, loop, routes=[vision_route(loop)]) as h:
        block = events_pb2.ContentBlock(image=image)
        await h.create(*opening(), turn_start(1), user("Look.", blocks=[block]))
        await h.append(*in_step(1, 1, assistant(text="Seen.")), turn_end(1))
        await h.append(*closed_turns(12, start=2))

        run = await h.compact()

        assert run.result.outcome.items_condensed > 0
        (summary,) = summary_requests(loop)
        assert sent_images(summary) == (1 if image.data else 0)
        if not image.data:  # a reference the endpoint cannot fetch goes as its offload text
            assert offload_placeholder(image) in json.dumps(summary["messages"])
