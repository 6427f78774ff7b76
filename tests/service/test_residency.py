"""Sessions as a bounded cache: snapshots, restores and evictions give the same session.

A session restored from a snapshot (after an eviction or a restart) has the fold and the prices
of one that never left memory; eviction is not a restart (no ``session/end-seed``); a snapshot
write that dies halfway leaves the old snapshot whole; a large batch is priced off the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactd.core import snapshot as snapshots
from compactd.core.fold import RECENT_COMPACTION_IDS, RECENT_EVENT_IDS, SessionFold
from compactd.core.meter import SessionMeter, recount
from compactd.core.policy import PressurePolicy
from compactd.core.pricing import price_node
from compactd.errors import InvalidArgument, Unavailable
from compactd.routes import RouteCatalog
from compactd.service import sessions
from compactd.service.pressure import PressureService, warm_up
from compactd.service.sessions import SessionHandle, SessionManager
from compactd.store import sqlite as sqlite_store
from compactd.store.base import EventStore
from compactd.store.memory import MemoryEventStore
from compactd.store.sqlite import SqliteEventStore
from compactd.tokenizers import load_tokenizer
from tests.builders import (
    SessionEvent,
    assistant,
    compaction_end,
    compaction_start,
    header,
    image_block,
    offload,
    replace,
    system,
    tool_result,
    user,
)

ROOT = Path(__file__).resolve().parents[2]
TRANSCRIPTS = ROOT / "testdata" / "transcripts" / "openai.jsonl"
KILLER = Path(__file__).with_name("snapshot_killer.py")
PROVIDER, MODEL = "openai", "gpt-4-turbo"  # cl100k_base: a tokenizer with a batch API


def transcript_events(prefix: str = "") -> Iterator[SessionEvent]:
    """Surface events of the shipped OpenAI transcripts (tool calls paired), in order."""
    for index, line in enumerate(TRANSCRIPTS.read_text(encoding="utf-8").splitlines()):
        calls: set[str] = set()
        for message in json.loads(line)["messages"]:
            event = _event(message, f"{prefix}{index}.", calls)
            if event is not None:
                yield event


def _event(message: dict[str, Any], prefix: str, calls: set[str]) -> SessionEvent | None:
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    if isinstance(content, list):
        text = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    role = message["role"]
    if role == "assistant":
        made = [
            (prefix + c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ]
        calls.update(c[0] for c in made)
        return assistant(text, calls=made) if text or made else None
    if role == "tool":
        call_id = prefix + str(message.get("tool_call_id", ""))
        return tool_result(call_id, text) if call_id in calls else None
    if role == "system":
        return None
    return user(text) if text else None


def fold_state(fold: SessionFold) -> tuple[object, ...]:
    """Everything a fold holds, comparable."""
    return (
        fold.revision,
        [(n.seq, _timeless(n.event)) for n in fold.surface],
        fold.surface.replacements,
        fold.header.SerializeToString(deterministic=True) if fold.header else b"",
        fold.header_seq,
        fold.replacements_at_header,
        sorted(fold.open_turns),
        fold.open_step,
        dict(fold.offloads),
        dict(fold.event_ids),
        list(fold.compaction_ids),
        (fold.lock.last_end_seed, dict(fold.lock.open_starts)),
        fold.restored_at,
        fold.offload_generation,
        fold.rewritten_at,
        sorted(fold.surface.unanswered_calls()),
        fold.surface_bytes,
    )


def _timeless(event: SessionEvent) -> bytes:
    copy = SessionEvent()
    copy.CopyFrom(event)
    copy.ClearField("time")  # two processes stamp the same event at different times
    return copy.SerializeToString(deterministic=True)


def but_lifecycle(state: tuple[object, ...]) -> tuple[object, ...]:
    """``fold_state`` without what a restart's ``session/end-seed`` changes (the revision, the
    lock's lifecycle boundary, ``restored_at``)."""
    return state[1:11] + state[13:]


def service_over(store: EventStore, **kwargs: Any) -> tuple[SessionManager, PressureService]:
    manager = SessionManager(store, instance_id=kwargs.pop("instance_id", None), **kwargs)
    service = PressureService(manager, RouteCatalog(), PressurePolicy.from_settings(None))
    return manager, service


@pytest.fixture
async def store() -> AsyncIterator[MemoryEventStore]:
    store = MemoryEventStore()
    await store.open()
    yield store
    await store.close()


async def _grow(handle: SessionHandle, events: list[SessionEvent], batch: int = 400) -> None:
    await handle.append([header(PROVIDER, MODEL), system("You are an agent.")])
    for start in range(0, len(events), batch):
        await handle.append(events[start : start + batch])


def _route_recount(handle: SessionHandle, service: PressureService) -> int:
    return recount(handle.fold, service.route_for(PROVIDER, MODEL)).total


async def test_a_large_batch_is_priced_in_steps_on_the_loop_and_reports_equal_a_recount(
    store: MemoryEventStore,
) -> None:
    manager, service = service_over(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    await handle.append([header(PROVIDER, MODEL)])
    await service.check("s")  # the route's ledger exists: the next batch is priced ahead
    steps: list[int] = []
    meter = handle.context.meter
    original = meter.prepare_in_steps

    def spy(*args: Any) -> Generator[None, None, None]:
        for step in original(*args):
            steps.append(threading.get_ident())
            yield step

    meter.prepare_in_steps = spy  # type: ignore[method-assign]
    await handle.append(list(transcript_events())[:300])
    assert len(steps) > 1  # it paused between nodes
    assert set(steps) == {threading.get_ident()}  # on the loop: no thread takes the GIL from it
    report = await service.check("s")
    assert report.measured_tokens == _route_recount(handle, service)


async def test_texts_nothing_counted_ahead_are_counted_in_a_worker_thread(
    store: MemoryEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, service = service_over(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    await handle.append([header(PROVIDER, MODEL)])
    await service.check("s")
    tokenizer = service.route_for(PROVIDER, MODEL).pricing.tokenizer
    original = tokenizer.count_batch
    threads: list[int] = []

    def spy(texts: list[str]) -> list[int]:
        threads.append(threading.get_ident())
        counts: list[int] = original(texts)
        return counts

    monkeypatch.setattr(tokenizer, "count_batch", spy)
    # Admitted with no precount (as the log a restore folds after its snapshot).
    events = list(transcript_events())[:300]
    for index, event in enumerate(events):
        event.seq = handle.fold.revision + index
    batch = handle.fold.admit(events, check=False)
    await handle.run_preparers(batch)  # as an append's: in steps on the loop
    assert threads
    assert threading.get_ident() not in threads  # not on the loop: it would hold it throughout
    meter = handle.context.meter
    priced: list[int] = []
    prepare = meter.prepare

    def spy_prepare(*args: Any) -> None:
        priced.append(threading.get_ident())
        prepare(*args)

    monkeypatch.setattr(meter, "prepare", spy_prepare)
    await handle.run_preparers(batch, in_thread=True)  # a restore's tail: a caller waits
    handle.fold.rollback(batch)
    assert priced
    assert threading.get_ident() not in priced  # all of it in a worker thread


async def test_other_calls_run_while_a_large_batch_lands_and_see_it_whole_or_not_at_all(
    store: MemoryEventStore,
) -> None:
    manager, service = service_over(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    await handle.append([header(PROVIDER, MODEL)])
    before = (handle.revision, (await service.check("s")).measured_tokens)
    appending = asyncio.ensure_future(handle.append(list(transcript_events())[:600]))
    seen: set[tuple[int, int]] = set()
    turns = 0
    while not appending.done():  # a reader that does not take the session's lock
        seen.add((handle.revision, service.report(handle).measured_tokens))
        turns += 1
        await asyncio.sleep(0)
    await appending
    after = (handle.revision, (await service.check("s")).measured_tokens)
    assert turns > 10  # the batch was checked, counted and admitted in steps
    assert seen <= {before, after}
    assert after[1] == _route_recount(handle, service)


async def test_a_restart_restores_from_the_snapshot_with_prices_equal_to_a_recount(
    store: MemoryEventStore,
) -> None:
    manager, service = service_over(store, snapshot_interval=200)
    await manager.create("s", None)
    handle = await manager.get("s")
    await service.check("s", service.route_for(PROVIDER, MODEL))
    await _grow(handle, list(transcript_events()) + list(transcript_events("b")))
    await manager.close()
    kept = await store.get_snapshot("s")
    assert kept is not None
    assert kept[0] >= handle.revision - 400
    snap = snapshots.decode(kept[1])
    profile = service.route_for(PROVIDER, MODEL).pricing
    by_seq = {e.seq: e for e in await store.read_seqs("s", snap.surface)}
    persisted = snap.node_prices()[profile.key]
    offloads = {s: frozenset(i) for s, i in snap.offloads.items()}
    assert persisted == {
        s: price_node(by_seq[s], profile, offloads.get(s, frozenset())) for s in snap.surface
    }  # persisted prices equal a recount, node by node

    again, service2 = service_over(store, snapshot_interval=200)
    restored = await again.get("s")
    replayed = SessionFold()
    replayed.admit([e async for e in store.read("s")], check=False)
    assert but_lifecycle(fold_state(restored.fold)) == but_lifecycle(fold_state(replayed))
    assert restored.fold.restored_at == restored.revision - 1  # a restart: a new lifecycle
    report = await service2.check("s")
    assert report.measured_tokens == _route_recount(restored, service2)


async def test_restoring_after_an_eviction_starts_no_new_lifecycle(
    store: MemoryEventStore,
) -> None:
    manager, service = service_over(store, snapshot_interval=50)
    await manager.create("s", None)
    handle = await manager.get("s")
    await _grow(handle, list(transcript_events())[:120])
    before = fold_state(handle.fold)
    report = await service.check("s")
    assert await manager.evict("s")
    assert manager.resident == 0
    del handle
    manager.residency._alive.clear()  # no finished future may hand the old handle back
    restored = await manager.get("s")
    types = [e.WhichOneof("body") async for e in store.read("s")]
    assert "session_end_seed" not in types
    assert fold_state(restored.fold) == before
    after = await service.check("s")
    for one in (report, after):
        one.breakdown.ClearField("anchor_age_seconds")
    assert after == report


async def test_an_evicted_session_keeps_its_in_process_memory(store: MemoryEventStore) -> None:
    manager, _ = service_over(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    await handle.append([user("hello")])
    memory = handle.context.memory
    memory.warned_targets.add("local/small")
    handle_context = handle.context
    assert await manager.evict("s")
    del handle
    manager.residency._alive.clear()
    restored = await manager.get("s")
    assert restored.context is not handle_context  # a new residency: a new meter
    assert restored.context.memory is memory  # eviction is not a restart
    assert restored.context.memory.warned_targets == {"local/small"}


async def test_deleting_a_session_deletes_its_snapshot(store: MemoryEventStore) -> None:
    manager, _ = service_over(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    await handle.append([user("hello")])
    await manager.snapshot(handle)
    assert await manager.evict("s")
    assert await manager.delete("s")
    assert await store.get_snapshot("s") is None
    await manager.create("s", None)
    assert (await manager.get("s")).revision == 0  # fresh: nothing of the old session


async def test_a_session_in_use_is_not_evicted(store: MemoryEventStore) -> None:
    manager, _ = service_over(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    await handle.append([user("hello")])
    async with handle.lock:
        assert not await manager.evict("s")
    revisions = handle.revisions()
    await anext(revisions)
    assert not await manager.evict("s")  # a stream follows it
    await revisions.aclose()
    await handle.append([compaction_start("c1")])
    assert not await manager.evict("s")  # a bracket is open
    assert manager.resident == 1


async def test_resident_sessions_stay_within_the_bound(store: MemoryEventStore) -> None:
    manager, _ = service_over(store, max_resident=2)
    for name in "abcde":
        await manager.create(name, None)
        handle = await manager.get(name)
        await handle.append([user(f"hello {name}")])
        del handle
        await asyncio.sleep(0)
        if manager.residency._evicting is not None:
            await manager.residency._evicting
    assert manager.resident <= 2
    assert manager.evictions >= 3
    assert (await manager.get("a")).fold.revision == 1  # restored on demand, as it was


async def test_a_snapshot_write_that_dies_halfway_leaves_the_old_one(tmp_path: Path) -> None:
    store = SqliteEventStore(str(tmp_path / "s.db"))
    await store.open()
    try:
        manager, _ = service_over(store)
        await manager.create("s", None)
        handle = await manager.get("s")
        await handle.append([user("one"), user("two")])
        await manager.snapshot(handle)
        old = await store.get_snapshot("s")
        await handle.append([user("three")])

        def die() -> None:
            raise sqlite3.OperationalError("disk I/O error")  # the process dies mid-write

        sqlite_store._between_snapshot_steps = die
        try:
            with pytest.raises(Unavailable):
                await manager.snapshot(handle)
        finally:
            sqlite_store._between_snapshot_steps = lambda: None
        assert await store.get_snapshot("s") == old
        before = fold_state(handle.fold)
        again, _ = service_over(store)
        restored = await again.get("s")  # a restart: old snapshot + the log after it
        assert but_lifecycle(fold_state(restored.fold)) == but_lifecycle(before)
        assert [n.event.user_message.content[0].text.text for n in restored.fold.surface] == [
            "one",
            "two",
            "three",
        ]
    finally:
        await store.close()


async def test_a_process_killed_inside_a_snapshot_write_restores_from_the_old_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.db"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(KILLER), str(path), stdout=asyncio.subprocess.PIPE, cwd=ROOT
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 9
    assert out.decode().split() == ["snapshotted", "2"]
    store = SqliteEventStore(str(path))
    await store.open()
    try:
        kept = await store.get_snapshot("s")
        assert kept is not None
        assert kept[0] == 2  # the old snapshot, whole
        again, _ = service_over(store)
        restored = await again.get("s")  # its snapshot, then the log after it
        texts = [n.event.user_message.content[0].text.text for n in restored.fold.surface]
        assert texts == ["one", "two", "three"]
        replayed = SessionFold()
        replayed.admit([e async for e in store.read("s")], check=False)
        assert but_lifecycle(fold_state(restored.fold)) == but_lifecycle(fold_state(replayed))
    finally:
        await store.close()


async def test_an_unusable_snapshot_is_ignored_and_the_log_replayed(
    store: MemoryEventStore,
) -> None:
    manager, _ = service_over(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    await handle.append([user("one"), user("two")])
    expected = fold_state(handle.fold)
    await store.put_snapshot("s", 2, b"{not json")
    again, _ = service_over(store, instance_id=manager.instance_id)
    restored = await again.get("s")
    assert but_lifecycle(fold_state(restored.fold)) == but_lifecycle(expected)


async def test_restoring_a_large_session_lets_other_sessions_answer_first(
    store: MemoryEventStore,
) -> None:
    manager, service = service_over(store)
    for name in ("big", "small"):
        await manager.create(name, None)
    big = await manager.get("big")
    events = list(transcript_events())
    await _grow(big, events * 4, batch=1000)
    small = await manager.get("small")
    await small.append([header(PROVIDER, MODEL), user("hi")])
    await service.check("small")
    again, service2 = service_over(store)
    await again.get("small")
    await service2.check("small")
    order: list[str] = []

    async def restore() -> None:
        await service2.check("big")
        order.append("big")

    async def others() -> None:
        await asyncio.sleep(0)
        for _ in range(3):
            await service2.check("small")
        order.append("small")

    await asyncio.gather(restore(), others())
    assert order == ["small", "big"]


def test_warm_up_counts_with_every_routes_pricing_before_any_session_needs_it() -> None:
    counted: list[str] = []

    class Route:
        def __init__(self, name: str) -> None:
            self.pricing = self
            self.name = name

        def count(self, text: str) -> int:
            counted.append(self.name)
            return len(text)

    warm_up([Route("a"), Route("b")])  # type: ignore[arg-type]
    assert counted == ["a", "b"]
    routes = RouteCatalog()
    warm_up(routes)
    assert load_tokenizer.cache_info().currsize >= 2  # cl100k_base and o200k_base at least


# ---- the property: evictions change nothing -------------------------------------------------


def _plain(event: SessionEvent) -> SessionEvent:
    """The event without tool calls (the property's spans need no pairing)."""
    if event.HasField("assistant_message"):
        texts = [b.text.text for b in event.assistant_message.content if b.HasField("text")]
        return assistant(" ".join(texts) or "ok")
    return event


_ROUTE_EVENTS = [_plain(e) for e in transcript_events() if not e.HasField("tool_result")][:80]


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, int]]:
    kinds = st.sampled_from(["append", "append", "usage", "image", "offload", "replace", "evict"])
    return draw(st.lists(st.tuples(kinds, st.integers(0, 10_000)), min_size=1, max_size=14))


async def _apply(handle: SessionHandle, op: str, arg: int, cursor: list[int]) -> None:
    fold = handle.fold
    nodes = [n for n in fold.surface if n.event.WhichOneof("body") != "system_message"]
    if op == "append":
        start = cursor[0] % len(_ROUTE_EVENTS)
        chunk = _ROUTE_EVENTS[start : start + 1 + arg % 20]
        cursor[0] += len(chunk)
        await handle.append(chunk)
    elif op == "usage":
        message = assistant(f"answer {arg}")
        message.assistant_message.usage.input_tokens = 50_000 + arg
        await handle.append([message])
    elif op == "image":
        await handle.append([user(f"look {arg}", blocks=[image_block("a.png", path="/att/a.png")])])
    elif op == "offload":
        images = [n for n in nodes if n.event.HasField("user_message") and len(
            n.event.user_message.content) > 1 and n.seq not in fold.offloads]  # fmt: skip
        if images:
            await handle.append([offload({images[arg % len(images)].seq: [0]})])
    elif op == "replace" and len(nodes) >= 2:
        first = arg % (len(nodes) - 1)
        last = first + 1
        span = [n.seq for n in nodes[first : last + 1]]
        if all(not n.event.HasField("tool_result") for n in nodes[first : last + 1]):
            await handle.append([replace(user(f"summary {arg}"), span[0], span[-1], span)])


@given(ops=operations())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_evictions_give_the_surface_and_prices_of_a_process_that_never_evicted(
    ops: list[tuple[str, int]],
) -> None:
    asyncio.run(_compare(ops))


async def test_a_restore_takes_no_anchor_the_meter_had_dropped() -> None:
    # The latest usage message is replaced: the meter drops its anchor and must not fall back to
    # the earlier usage message after a restore (the snapshot says it had none).
    await _compare([("usage", 0), ("usage", 0), ("append", 0), ("replace", 1), ("evict", 0)])


async def _compare(ops: list[tuple[str, int]]) -> None:
    stores = [MemoryEventStore(), MemoryEventStore()]
    for store in stores:
        await store.open()
    kept, kept_service = service_over(stores[0])
    evicting, evicting_service = service_over(stores[1], snapshot_interval=3)
    cursors = [[0], [0]]
    route = kept_service.route_for(PROVIDER, MODEL)
    for manager in (kept, evicting):
        await manager.create("s", None)
        handle = await manager.get("s")
        await handle.append([header(PROVIDER, MODEL), system("You are an agent.")])
    del handle
    for op, arg in ops:
        if op == "evict":
            if await evicting.evict("s"):
                # Nothing here holds the handle; a finished future the loop has not dropped yet
                # may, which would hand the same handle back: forget it, so the next get
                # restores the session from its snapshot.
                evicting.residency._alive.clear()
            continue
        for manager, cursor in ((kept, cursors[0]), (evicting, cursors[1])):
            await _apply(await manager.get("s"), op, arg, cursor)
    a, b = await kept.get("s"), await evicting.get("s")
    # The two logs differ only in their time stamps, whose varints may differ in size.
    assert fold_state(a.fold)[:-1] == fold_state(b.fold)[:-1]
    replayed = SessionFold()
    replayed.admit([e async for e in stores[1].read("s")], check=False)
    assert fold_state(b.fold) == fold_state(replayed)
    reports = [await kept_service.check("s"), await evicting_service.check("s")]
    for report in reports:
        report.breakdown.ClearField("anchor_age_seconds")  # wall time
    assert reports[0] == reports[1]
    meter_a, meter_b = a.context.meter, b.context.meter
    assert isinstance(meter_b, SessionMeter)
    assert meter_a.measure(a.fold, route, anchored=False) == meter_b.measure(
        b.fold, route, anchored=False
    )
    assert meter_b.measure(b.fold, route, anchored=False).total == recount(b.fold, route).total
    for store in stores:
        await store.close()


def test_snapshots_of_a_long_log_come_less_often_so_their_cost_per_event_is_bounded() -> None:
    fold = SessionFold()
    assert sessions.snapshot_due(fold, 1000) == 1000
    # 64k entries to copy (set directly: a fold keeps at most ``RECENT_EVENT_IDS`` ids).
    fold.event_ids.update({f"e{n}": n for n in range(64_000)})
    assert sessions.snapshot_due(fold, 1000) == 4000
    fold.event_ids.update({f"f{n}": n for n in range(32_000)})
    assert sessions.snapshot_due(fold, 1000) == 6000
    assert sessions.snapshot_due(fold, 10_000) == 10_000


def test_snapshots_stay_readable_by_and_from_releases_that_kept_what_shadowed_each_node() -> None:
    fold = SessionFold()
    fold.admit([user("a"), user("b")])
    raw = json.loads(snapshots.encode(snapshots.capture(fold, "i", {}, None)))
    assert raw["shadowed_by"] == []  # an earlier release requires the key
    raw["shadowed_by"] = [[0, 2, "user/message", ""]]  # what an earlier release wrote
    decoded = snapshots.decode(json.dumps(raw).encode("utf-8"))
    assert (decoded.revision, decoded.surface) == (2, [0, 1])


def _drain(steps: Generator[None, None, Any]) -> tuple[Any, int]:
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, pauses
        pauses += 1


def test_a_snapshot_made_in_steps_equals_one_made_at_once_byte_for_byte() -> None:
    fold = SessionFold()
    events = list(transcript_events())[: 3 * snapshots.CHUNK]
    fold.admit(events)
    meter = SessionMeter(fold)
    pricing = RouteCatalog().resolve(PROVIDER, MODEL).pricing
    meter.add_ledger(pricing, meter.price_ledger(pricing))
    prices, anchor = meter.persisted_prices(), meter.anchor_state()
    snap, paused = _drain(snapshots.capture_in_steps(fold, "i", prices, anchor))
    assert paused > 2  # it let the loop run other calls
    assert snap == snapshots.capture(fold, "i", prices, anchor)
    data, paused = _drain(snapshots.encode_in_steps(snap))
    assert paused > 2
    assert data == snapshots.encode(snap)
    assert snapshots.decode(data).surface == [n.seq for n in fold.surface]


def test_a_restore_from_the_nodes_stored_bytes_makes_the_nodes_parsing_them_would() -> None:
    fold = SessionFold()
    fold.admit([system("be brief"), *list(transcript_events())[:400]])
    snap = snapshots.decode(snapshots.encode(snapshots.capture(fold, "i", {}, None)))
    assert snap.facts is not None
    assert any(snap.facts.calls.values())
    assert any(snap.facts.answers.values())
    stored = {n.seq: n.data for n in fold.surface}
    parsed = {n.seq: n.event for n in fold.surface}
    others = {s: parsed[s] for s in snap.parsed_seqs()}
    from_bytes = snapshots.rebuild(snap, others, stored)
    from_events = snapshots.rebuild(snap, parsed)
    assert [_facts(n) for n in from_bytes.surface] == [_facts(n) for n in fold.surface]
    assert [_facts(n) for n in from_events.surface] == [_facts(n) for n in fold.surface]
    assert fold_state(from_bytes) == fold_state(from_events)
    # A snapshot without the facts (an earlier release's) is restored from parsed events.
    older = dataclasses.replace(snap, facts=None)
    assert fold_state(snapshots.rebuild(older, parsed, stored)) == fold_state(from_events)
    with pytest.raises(snapshots.SnapshotInvalid):
        snapshots.rebuild(snap, others, {s: d for s, d in stored.items() if s != 5})


def _facts(node: Any) -> tuple[Any, ...]:
    return (node.seq, node.data, node.type, node.calls, node.answers)


def test_a_snapshot_keeps_the_fold_s_ids_and_a_restore_the_latest_of_an_older_one() -> None:
    fold = SessionFold()
    events = [user(f"m{n}") for n in range(RECENT_EVENT_IDS + 50)]
    for n, event in enumerate(events):
        event.event_id = f"e{n}"
    fold.admit(events)
    fold.admit([user("next")])  # a batch begins: the ids beyond the latest are forgotten
    snap = snapshots.capture(fold, "i", {}, None)
    assert list(snap.event_ids) == [f"e{n}" for n in range(50, RECENT_EVENT_IDS + 50)]
    # A snapshot an earlier release wrote held every id of the log: the restore keeps the latest.
    older = dataclasses.replace(snap, event_ids={f"e{n}": n for n in range(RECENT_EVENT_IDS + 50)})
    restored = snapshots.rebuild(older, {n.seq: n.event for n in fold.surface})
    assert restored.event_ids == fold.event_ids


def test_a_snapshot_keeps_the_latest_bracket_ids_in_order_and_so_does_a_restore() -> None:
    fold = SessionFold()
    brackets = RECENT_COMPACTION_IDS + 10
    for n in range(brackets):
        fold.admit([compaction_start(f"k{n:03}"), compaction_end(f"k{n:03}")])
    fold.admit([user("next")])
    snap = snapshots.capture(fold, "i", {}, None)
    latest = [f"k{n:03}" for n in range(10, brackets)]
    assert snapshots.decode(snapshots.encode(snap)).compaction_ids == latest
    restored = snapshots.rebuild(snap, {n.seq: n.event for n in fold.surface})
    assert list(restored.compaction_ids) == latest
    # A snapshot an earlier release wrote held every bracket id, sorted: the restore keeps a
    # window of them, and a start reusing one it kept is still refused.
    older = dataclasses.replace(snap, compaction_ids=sorted(f"k{n:03}" for n in range(brackets)))
    restored = snapshots.rebuild(older, {n.seq: n.event for n in fold.surface})
    assert list(restored.compaction_ids) == latest
    with pytest.raises(InvalidArgument, match="a compaction id is used once"):
        restored.admit([compaction_start(latest[-1])])
