"""CheckPressure and WatchPressure in-process: reports, errors, policies, concurrent appends."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from compactd.core.meter import SessionMeter, recount
from compactd.core.policy import PressurePolicy
from compactd.errors import CapacityUnknown, ConfigError, FailedPrecondition, NotFound
from compactd.routes import Route, RouteCatalog
from compactd.service.pressure import PressureService
from compactd.service.sessions import SessionManager
from compactd.store.memory import MemoryEventStore
from compactd.v1 import compaction_service_pb2, events_pb2
from tests.builders import SessionEvent, assistant, header, system, user

ABOVE = compaction_service_pb2.PRESSURE_STATE_ABOVE
BELOW = compaction_service_pb2.PRESSURE_STATE_BELOW
_NAMES = itertools.count()
TIGHT = {"thresholdRatio": 1, "headroomTokens": 0, "maxTokens": 100, "retainTokens": 0}


@pytest.fixture
async def store() -> AsyncIterator[MemoryEventStore]:
    store = MemoryEventStore()
    await store.open()
    yield store
    await store.close()


@pytest.fixture
async def manager(store: MemoryEventStore) -> AsyncIterator[SessionManager]:
    manager = SessionManager(store)
    yield manager
    await manager.close()


@pytest.fixture
def service(manager: SessionManager) -> PressureService:
    routes = RouteCatalog.from_config(
        [
            {"provider": "test", "model": "small", "context_window": 65536},
            {"provider": "test", "model": "heuristic", "context_window": 200_000},
        ]
    )
    return PressureService(manager, routes, PressurePolicy.from_settings(None))


def routed(provider: str = "deepseek", model: str = "deepseek-chat", **config: Any) -> SessionEvent:
    event = header(provider, model)
    for key, value in config.items():
        setattr(event.request_header.config, key, value)
    return event


async def session(
    manager: SessionManager, *events: SessionEvent, policy: dict[str, Any] | None = None
) -> str:
    name = f"session-{next(_NAMES)}"
    await manager.create(name, policy)
    if events:
        await (await manager.get(name)).append(events)
    return name


async def measured(manager: SessionManager, session_id: str, route: Route) -> int:
    handle = await manager.get(session_id)
    return recount(handle.fold, route).total


async def test_check_reports_the_worked_example(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(
        manager, routed(max_output_tokens=8192), system("You are terse."), user("abcd")
    )
    report = await service.check(sid)
    assert (report.route.provider, report.route.model) == ("deepseek", "deepseek-chat")
    assert (report.context_window, report.output_reservation, report.headroom_tokens) == (
        128_000,
        8192,
        65536,
    )
    assert (report.trigger_tokens, report.retained_budget) == (54272, 19169)
    assert report.state == BELOW
    assert report.revision == 3
    breakdown = report.breakdown
    assert breakdown.method == compaction_service_pb2.MEASUREMENT_METHOD_TOKENIZER
    assert breakdown.tokenizer == "deepseek-v4"
    chat = service.route_for("deepseek", "deepseek-chat")
    assert report.measured_tokens == await measured(manager, sid, chat)
    parts = (
        breakdown.system_tokens
        + breakdown.tools_tokens
        + breakdown.messages_tokens
        + breakdown.images_tokens
        + breakdown.config_tokens
    )
    assert parts == report.measured_tokens


async def test_the_route_default_reserves_output_when_the_envelope_does_not(
    manager: SessionManager, service: PressureService
) -> None:
    report = await service.check(await session(manager, routed(), user("hi")))
    assert report.output_reservation == 4096
    assert report.trigger_tokens == min(102_400, 128_000 - 4096 - 65536)


async def test_pressure_is_above_at_equal_counts(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, routed(), system("s"), user("x" * 400), policy=TIGHT)
    total = await measured(manager, sid, Route("t", "w"))
    at = await service.check(sid, Route("t", "w", context_window=total))
    assert (at.trigger_tokens, at.measured_tokens, at.state) == (total, total, ABOVE)
    below = await service.check(sid, Route("t", "w", context_window=total + 1))
    assert below.state == BELOW


async def test_a_destination_route_is_measured_with_its_own_window_and_reservation(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, routed(max_output_tokens=8192), user("hello"))
    report = await service.check(sid, service.route_for("openai", "gpt-4o"))
    assert (report.route.provider, report.route.model) == ("openai", "gpt-4o")
    assert (report.context_window, report.output_reservation) == (128_000, 16_384)


async def test_no_route_and_no_header_is_route_unknown(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, user("hello"))
    with pytest.raises(FailedPrecondition) as caught:
        await service.check(sid)
    assert caught.value.reason == "ROUTE_UNKNOWN"


async def test_a_route_without_a_window_is_capacity_unknown(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, routed("local", "mystery"), user("hello"))
    with pytest.raises(CapacityUnknown) as caught:
        await service.check(sid)
    assert caught.value.reason == "CAPACITY_UNKNOWN"
    assert caught.value.metadata["route"] == "local/mystery"


async def test_a_policy_that_does_not_fit_the_window_is_policy_invalid(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, routed("test", "small"), user("hello"))
    with pytest.raises(FailedPrecondition) as caught:
        await service.check(sid)
    assert caught.value.reason == "POLICY_INVALID"
    assert caught.value.metadata["route"] == "test/small"


async def test_an_unknown_session_is_not_found(service: PressureService) -> None:
    with pytest.raises(NotFound):
        await service.check("nobody")


async def test_a_session_policy_layers_over_the_service_policy(
    manager: SessionManager, service: PressureService
) -> None:
    small = {"modelPolicies": [{"provider": "test", "model": "small", "headroomTokens": 4096}]}
    sid = await session(manager, routed("test", "small"), user("hello"), policy=small)
    report = await service.check(sid)
    assert report.trigger_tokens == min(52428, 65536 - 4096)
    assert report.retained_budget == 10485  # floor(0.16 * 65536)


async def test_interleaved_reports_each_carry_their_own_route_and_policy_figures(
    manager: SessionManager, service: PressureService
) -> None:
    # A report copies the figures its spec and route fix (built once per pair): checks that
    # alternate routes and policies must never see another pair's.
    small = {"modelPolicies": [{"provider": "test", "model": "small", "headroomTokens": 4096}]}
    plain = await session(manager, routed("test", "small"), user("hello"))
    custom = await session(manager, routed("test", "small"), user("hello"), policy=small)
    small_route, wide_route = (
        service.route_for("test", "small"),
        service.route_for("test", "heuristic"),
    )
    pairs = [(plain, wide_route), (custom, small_route), (custom, wide_route)]
    headrooms = set()
    for _ in range(2):
        for sid, route in pairs:
            handle = await manager.get(sid)
            report = await service.check(sid, route)
            spec = service.spec(handle, route)
            assert (report.route.provider, report.route.model) == (route.provider, route.model)
            assert report.context_window == spec.window
            assert report.output_reservation == spec.output_reservation
            assert report.headroom_tokens == spec.headroom
            assert report.trigger_tokens == spec.trigger
            assert report.retained_budget == spec.retained_budget
            assert report.measured_tokens == await measured(manager, sid, route)
            headrooms.add((sid, route.model, report.headroom_tokens))
    assert len(headrooms) == 3  # the same figures both rounds
    assert (custom, "small", 4096) in headrooms  # the override, on its route only
    assert all(headroom != 4096 for _, model, headroom in headrooms if model == "heuristic")


async def test_an_invalid_session_policy_is_a_config_error(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, routed(), user("hello"), policy={"retainRatio": 0.9})
    with pytest.raises(ConfigError):
        await service.check(sid)


async def test_provider_usage_anchors_the_report(
    manager: SessionManager, service: PressureService
) -> None:
    answer = assistant("answer")
    answer.assistant_message.usage.CopyFrom(events_pb2.Usage(input_tokens=20000, output_tokens=50))
    sid = await session(manager, routed(), system("s"), user("q"), answer)
    report = await service.check(sid)
    assert report.breakdown.method == compaction_service_pb2.MEASUREMENT_METHOD_ANCHORED
    assert report.breakdown.anchor_seq == 3
    assert report.measured_tokens == 20050


async def test_a_restored_session_gets_a_meter_that_matches_a_recount(
    store: MemoryEventStore, manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, routed(), system("s"), user("a" * 300), assistant("b"))
    restarted = SessionManager(store)
    restarted_service = PressureService(restarted, service.routes, service.policy)
    report = await restarted_service.check(sid)
    handle = await restarted.get(sid)
    assert isinstance(handle.context.meter, SessionMeter)
    route = service.route_for("deepseek", "deepseek-chat")
    assert report.measured_tokens == recount(handle.fold, route).total
    assert report.revision == handle.fold.revision  # includes the restore's session/end-seed
    await handle.append([user("after restore")])
    assert (await restarted_service.check(sid)).measured_tokens == recount(handle.fold, route).total
    await restarted.close()


# ---- WatchPressure ---------------------------------------------------------------------------


async def test_watch_reports_now_and_after_every_append(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, routed(), user("first"))
    handle = await manager.get(sid)
    stream = service.watch(sid)
    try:
        first = await anext(stream)
        assert first.revision == 2
        await handle.append([user("second")])
        second = await anext(stream)
        assert second.revision == 3
        assert second.measured_tokens > first.measured_tokens
    finally:
        await stream.aclose()


async def test_a_slow_watcher_gets_the_latest_report_and_never_blocks_appends(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, routed(), user("first"))
    handle = await manager.get(sid)
    stream = service.watch(sid)
    try:
        await anext(stream)
        for i in range(50):  # nobody reads meanwhile: every append still completes
            await asyncio.wait_for(handle.append([user(f"message {i}")]), timeout=30)
        latest = await anext(stream)
        assert latest.revision == handle.fold.revision == 52
        route = service.route_for("deepseek", "deepseek-chat")
        assert latest.measured_tokens == recount(handle.fold, route).total
    finally:
        await stream.aclose()


async def test_watch_errors_like_check(manager: SessionManager, service: PressureService) -> None:
    sid = await session(manager, routed("local", "mystery"))
    stream = service.watch(sid)
    with pytest.raises(CapacityUnknown):
        await anext(stream)
    await stream.aclose()


async def test_many_watchers_follow_concurrent_appends(
    manager: SessionManager, service: PressureService
) -> None:
    sid = await session(manager, routed(), system("s"))
    handle = await manager.get(sid)
    route = service.route_for("deepseek", "deepseek-chat")
    final_revision = 2 + 4 * 25

    async def watcher() -> list[compaction_service_pb2.PressureReport]:
        seen = []
        async for report in service.watch(sid):
            seen.append(report)
            if report.revision == final_revision:
                return seen
        raise AssertionError("the stream ended")

    async def appender(n: int) -> None:
        for i in range(25):
            await handle.append([user(f"writer {n} message {i}")])
            await asyncio.sleep(0)

    watchers = [asyncio.create_task(watcher()) for _ in range(8)]
    await asyncio.gather(*(appender(n) for n in range(4)))
    results = await asyncio.wait_for(asyncio.gather(*watchers), timeout=60)
    final = recount(handle.fold, route).total
    for seen in results:
        revisions = [r.revision for r in seen]
        assert revisions == sorted(set(revisions))  # increasing, possibly coalesced
        assert seen[-1].measured_tokens == final


async def test_the_logged_route_and_its_policy_come_from_the_committed_header(
    manager: SessionManager, service: PressureService
) -> None:
    small = {"modelPolicies": [{"provider": "test", "model": "small", "headroomTokens": 4096}]}
    sid = await session(manager, routed("test", "small"), policy=small)
    handle = await manager.get(sid)
    route = service.logged_route(handle)
    assert route == service.route_for("test", "small")
    assert service.target_policy(handle, route).headroom_tokens == 4096
    assert service.logged_route_or_heuristic(handle) == route
    assert service.named_route(handle) == route


async def test_without_a_header_there_is_only_a_heuristic_route(
    manager: SessionManager, service: PressureService
) -> None:
    handle = await manager.get(await session(manager, user("hello")))
    with pytest.raises(FailedPrecondition):
        service.logged_route(handle)
    assert service.named_route(handle) is None  # said without an error raised and caught
    fallback = service.logged_route_or_heuristic(handle)
    assert fallback.context_window is None
    assert not fallback.pricing.exact
