"""The session fold: seqs, atomic batches, rollback, restore, incrementality, fold == refold."""

from __future__ import annotations

import gc
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import compactd.core
from compactd.core import events as events_module
from compactd.core.fold import RECENT_COMPACTION_IDS, RECENT_EVENT_IDS, AdmittedBatch, SessionFold
from compactd.core.lock import live_bracket
from compactd.core.pairing import CorruptPairing, balanced_cuts
from compactd.core.steps import run_to_end
from compactd.core.surface import SurfaceNode, shadow_history
from compactd.errors import CompactdError, CompactionBusy, InvalidArgument, ReplacementRejected
from compactd.store.base import encode_batch, encode_batch_in_steps
from compactd.v1 import events_pb2
from tests.builders import (
    SessionEvent,
    assistant,
    checkpoint,
    compaction_end,
    compaction_start,
    developer,
    end_seed,
    header,
    image_block,
    offload,
    replace,
    step_end,
    step_start,
    system,
    tool,
    tool_result,
    turn_end,
    turn_start,
    user,
)

T = TypeVar("T")
CORE_DIR = str(Path(compactd.core.__file__).parent)


def snapshot(fold: SessionFold) -> tuple[Any, ...]:
    """Everything the fold derives, in comparable form (incremental state included)."""
    return (
        fold.revision,
        [(n.seq, n.event.SerializeToString(deterministic=True)) for n in fold.surface],
        [fold.surface.position_of(seq) for seq in range(fold.revision + 1)],
        dict(fold.surface._calls),  # the incremental call index must match a refold's
        fold.surface.replacements,
        fold.offload_generation,
        None if fold.header is None else fold.header.SerializeToString(deterministic=True),
        fold.header_seq,
        fold.replacements_at_header,
        fold.lock.last_end_seed,
        dict(fold.lock.open_starts),
        set(fold.open_turns),
        fold.open_step,
        fold.surface_bytes,
        dict(fold.offloads),
        dict(fold.event_ids),
        [m.SerializeToString(deterministic=True) for m in fold.messages()],
    )


def refold(log: list[SessionEvent]) -> SessionFold:
    """A fresh fold of a stored log, as a restore does it."""
    fold = SessionFold()
    fold.admit(log, check=False)
    return fold


def with_id(event: SessionEvent, event_id: str) -> SessionEvent:
    event.event_id = event_id
    return event


# --- seqs, copies and time --------------------------------------------------------------------


def test_admit_assigns_contiguous_seqs_to_copies_of_the_events() -> None:
    fold = SessionFold()
    fold.admit([user("a")])
    sent = [user("b"), turn_start(1), assistant("c")]
    batch = fold.admit(sent)
    assert batch.first_seq == 1
    assert [e.seq for e in batch.events] == [1, 2, 3]
    assert fold.revision == 4
    assert [e.seq for e in sent] == [0, 0, 0]
    assert batch.events[0] is not sent[0]


def test_admit_fills_a_missing_time_and_keeps_a_client_time() -> None:
    now, client = Timestamp(seconds=1_700_000_000), Timestamp(seconds=42)
    timed = user("b")
    timed.time.CopyFrom(client)
    first, second = SessionFold().admit([user("a"), timed], now=now).events
    assert first.time == now
    assert second.time == client


def test_event_ids_map_to_their_seqs() -> None:
    fold = SessionFold()
    fold.admit([user("a"), with_id(user("b"), "id-b"), with_id(turn_start(1), "id-t")])
    assert fold.event_ids == {"id-b": 1, "id-t": 2}


def test_an_event_id_already_in_the_log_is_rejected() -> None:
    fold = SessionFold()
    fold.admit([with_id(user("a"), "x")])
    with pytest.raises(InvalidArgument, match="already in the log") as caught:
        fold.admit([user("b"), with_id(user("c"), "x")])
    assert caught.value.violations[0].field == "events[1].event_id"
    assert fold.event_ids == {"x": 0}
    assert fold.revision == 1


def test_a_turn_that_is_already_open_is_rejected() -> None:
    fold = SessionFold()
    fold.admit([turn_start(1)])
    with pytest.raises(InvalidArgument, match="turn 1 is already open"):
        fold.admit([turn_start(1)])
    fold.admit([turn_end(1), turn_start(1)])
    assert fold.open_turns == {1}


# --- atomic batches and rollback --------------------------------------------------------------


def base_events() -> list[SessionEvent]:
    """A header, a system head, a tool exchange, an image, an open turn and a live bracket."""
    return [
        system("s"),  # 0
        header("p", "m", tools=[tool("read")]),  # 1
        user("look", blocks=[image_block("a.png")]),  # 2
        assistant(calls=[("c1", "read", "{}")]),  # 3
        tool_result("c1", "out"),  # 4
        with_id(turn_start(1), "t1"),  # 5
        compaction_start("k1"),  # 6
    ]


def base_fold() -> SessionFold:
    fold = SessionFold()
    fold.admit(base_events())
    return fold


GOOD_PAIR = [user("fine"), header("p", "m2")]


@pytest.mark.parametrize(
    ("third", "error"),
    [
        (replace(user("x"), start=2, end=4, sources=[2, 3]), ReplacementRejected),
        (replace(user("x"), start=3, end=3, sources=[3]), ReplacementRejected),
        (replace(user("x"), start=0, end=2, sources=[0, 2]), ReplacementRejected),
        (tool_result("nope", "x"), CorruptPairing),
        (compaction_start("k2"), CompactionBusy),
        (compaction_end("k9"), InvalidArgument),
        (offload({3: [0]}), InvalidArgument),
        (with_id(user("dup"), "t1"), InvalidArgument),
    ],
    ids=[
        "uncited",
        "unbalanced",
        "system_head",
        "orphan_result",
        "busy",
        "unmatched_end",
        "bad_offload",
        "known_id",
    ],
)
def test_a_batch_whose_third_event_breaks_a_rule_leaves_the_state_unchanged(
    third: SessionEvent, error: type[CompactdError]
) -> None:
    fold = base_fold()
    before = snapshot(fold)
    with pytest.raises(error):
        fold.admit([*GOOD_PAIR, third])
    assert snapshot(fold) == before
    assert fold.admit([user("next")]).first_seq == 7


def test_a_rejected_batch_that_first_replaced_and_offloaded_is_fully_undone() -> None:
    fold = base_fold()
    before = snapshot(fold)
    good = [
        replace(user("sum"), start=2, end=4, sources=[2, 3, 4]),  # 7
        compaction_end("k1"),
        end_seed(),
    ]
    with pytest.raises(ReplacementRejected):
        fold.admit([offload({2: [0]}), *good, replace(user("x"), start=7, end=0, sources=[0, 7])])
    assert snapshot(fold) == before


def test_rollback_reverts_an_admitted_batch() -> None:
    fold = base_fold()
    before = snapshot(fold)
    batch = fold.admit(
        [
            offload({2: [0]}),
            replace(tool_result("c1", "[pruned]"), start=4, end=4, sources=[4]),
            compaction_end("k1"),
            end_seed(),
            header("p", "m3"),
            with_id(turn_end(1), "t1-end"),
            replace(system("s2"), start=0, end=0, sources=[0]),
            user("tail"),
        ]
    )
    assert snapshot(fold) != before
    fold.rollback(batch)
    assert snapshot(fold) == before


def test_an_admitted_batch_holds_three_collector_tracked_objects_per_event() -> None:
    """Its event copy, its surface change and one undo record (a tuple, not closures): the
    young collections a large batch sets off, pauses of the event loop, stay few."""
    events = [user(f"message {i}") for i in range(500)]
    fold = SessionFold()
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        batch = fold.admit(events)
        held = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert len(batch.events) == 500
    assert held <= 3 * 500 + 20


# --- restore ----------------------------------------------------------------------------------


def test_restore_refolds_a_stored_log_to_the_same_state() -> None:
    fold, log = SessionFold(), list[SessionEvent]()
    for batch in (
        base_events(),
        [offload({2: [0]}), user("a")],
        [replace(checkpoint("k1", "sum"), start=2, end=8, sources=[6, 2, 3, 4, 8])],
        [compaction_end("k1"), header("p", "m2")],
    ):
        log += fold.admit(batch).events
    restored = refold(log)
    assert snapshot(restored) == snapshot(fold)
    assert [e.seq for e in log] == list(range(len(log)))


def test_restore_rejects_a_log_with_a_gap() -> None:
    log = SessionFold().admit([user("a"), user("b")]).events
    log[1].seq = 5
    fold = SessionFold()
    with pytest.raises(InvalidArgument, match="expected seq 1, got 5"):
        fold.admit(log, check=False)
    assert fold.revision == 0


# --- image offload marks ----------------------------------------------------------------------


def test_offload_marks_the_selected_images_of_a_current_node() -> None:
    fold = base_fold()
    batch = fold.admit([offload({2: [0]})])
    assert fold.offloads == {2: frozenset({0})}
    assert batch.reprojected == {2}


@pytest.mark.parametrize(
    ("target", "field", "reason"),
    [
        ({3: [0]}, "image_offload.targets[0].seq", "only user and tool input images"),
        ({1: [0]}, "image_offload.targets[0].seq", "is not a current surface node"),
        ({99: [0]}, "image_offload.targets[0].seq", "is not a current surface node"),
        ({2: [1]}, "image_offload.targets[0].image_indexes", "the node has 1 image"),
        ({2: []}, "image_offload.targets[0].image_indexes", "the node has 1 image"),
        ({2: [-1]}, "image_offload.targets[0].image_indexes", "the node has 1 image"),
        ({4: [0]}, "image_offload.targets[0].image_indexes", "the node has 0 image"),
    ],
    ids=[
        "assistant",
        "log_only",
        "unknown",
        "out_of_range",
        "empty",
        "negative",
        "no_images",
    ],
)
def test_an_offload_must_select_existing_input_images_of_current_nodes(
    target: dict[int, list[int]], field: str, reason: str
) -> None:
    fold = base_fold()
    with pytest.raises(InvalidArgument, match=reason) as caught:
        fold.admit([offload(target)])
    assert caught.value.violations[0].field == f"events[0].{field}"
    assert fold.offloads == {}


def test_an_offload_of_a_shadowed_node_is_rejected() -> None:
    fold = base_fold()
    fold.admit([replace(user("sum"), start=2, end=4, sources=[2, 3, 4])])
    with pytest.raises(InvalidArgument, match="is not a current surface node"):
        fold.admit([offload({2: [0]})])


# --- incrementality ---------------------------------------------------------------------------


def conversation(exchanges: int) -> list[SessionEvent]:
    events = [system("s")]
    for i in range(exchanges):
        call = f"c{i}"
        events += [user(f"u{i}"), assistant(calls=[(call, "t", "{}")]), tool_result(call, "r")]
    return events


def core_lines_run(action: Callable[[], object]) -> int:
    """How many lines of ``compactd.core`` code ``action`` executes: work, not time."""
    lines = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal lines
        if not frame.f_code.co_filename.startswith(CORE_DIR):
            return None
        lines += event == "line"
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        action()
    finally:
        sys.settrace(previous)
    return lines


def append_cost(exchanges: int) -> int:
    """Core lines run by appending one tool exchange to a fold of ``exchanges`` exchanges."""
    fold = SessionFold()
    fold.admit(conversation(exchanges))
    nodes = list(fold.surface.nodes)
    positions = [fold.surface.position_of(n.seq) for n in nodes]
    exchange = [user("next"), assistant(calls=[("new", "t", "{}")]), tool_result("new", "r")]
    cost = core_lines_run(lambda: fold.admit(exchange))
    assert all(a is b for a, b in zip(nodes, fold.surface.nodes, strict=False))
    assert [fold.surface.position_of(n.seq) for n in nodes] == positions
    return cost


def test_appending_to_a_large_fold_does_not_touch_earlier_nodes() -> None:
    small = append_cost(5)
    assert small > 0
    assert append_cost(2000) == small


# --- properties: fold == refold ---------------------------------------------------------------

HEADERS = [
    header("p", "m"),
    header("p", "m", tools=[tool("read"), tool("write")]),
    header("p", "m", tools=[tool("write"), tool("read")]),
    header("q", "m2", tools=[tool("read")]),
]


def naive_balanced(events: list[SessionEvent], cut: int) -> bool:
    """Every call before ``cut`` has a result after it and before ``cut``."""
    for position, event in enumerate(events[:cut]):
        for call_id in events_module.tool_call_ids(event):
            later = events[position + 1 : cut]
            if not any(e.tool_result.tool_call_id == call_id for e in later):
                return False
    return True


def pairs_cleanly(events: list[SessionEvent]) -> bool:
    """Every result has a call in some earlier event."""
    return all(
        not e.HasField("tool_result")
        or any(e.tool_result.tool_call_id in events_module.tool_call_ids(p) for p in events[:i])
        for i, e in enumerate(events)
    )


class FoldMachine(RuleBasedStateMachine):
    """A random agent runtime and compaction engine driving one fold.

    After every step the incremental fold equals a from-scratch refold of its log, and the
    surface's balanced cuts match the naive definition. Replacements are drawn over any span and
    the fold must accept exactly the spans the rules allow; rejected and uncommitted batches
    (whose good part may replace, prune, offload or move the lock) must leave no trace.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fold = SessionFold()
        self.log: list[SessionEvent] = []
        self.fresh = itertools.count()
        self.data: st.DataObject | None = None

    # --- rules --------------------------------------------------------------------------------

    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        self.data = data
        self.commit(self.plan_append())

    @rule(data=st.data())
    def log_only(self, data: st.DataObject) -> None:
        self.data = data
        self.commit(self.plan_log_only())

    @rule(data=st.data(), between_cuts=st.booleans())
    def replace_a_span(self, data: st.DataObject, between_cuts: bool) -> None:
        self.data = data
        self.commit(self.plan_replace(between_cuts))

    @rule(data=st.data())
    def prune(self, data: st.DataObject) -> None:
        self.data = data
        self.commit(self.plan_prune())

    @rule(data=st.data())
    def rejected_batch(self, data: st.DataObject) -> None:
        """Good events that change everything, then one that breaks a rule: nothing remains."""
        self.data = data
        tentative = self.tentative()
        bad = self.plan_bad()
        self.undo(tentative)
        good = [e for batch in tentative for e in batch.events]
        self.expect_rejected([*good, bad], CompactdError)

    @rule(data=st.data())
    def uncommitted_batch(self, data: st.DataObject) -> None:
        """One batch folds like its events did one by one, and a failed commit rolls it back."""
        self.data = data
        before = snapshot(self.fold)
        tentative = self.tentative()
        after = snapshot(self.fold)
        self.undo(tentative)
        assert snapshot(self.fold) == before
        batch = self.fold.admit([e for b in tentative for e in b.events])
        assert snapshot(self.fold) == after
        self.fold.rollback(batch)
        assert snapshot(self.fold) == before

    @invariant()
    def shadow_history_names_what_replaced_every_node_that_left(self) -> None:
        history = shadow_history(self.log)
        made = {e.seq for e in self.log if events_module.is_surface(e)}
        assert set(history) == made - {n.seq for n in self.fold.surface}
        for seq, (by, kind, compaction_id) in history.items():
            replacement = self.log[by]
            assert events_module.is_replace(replacement)
            assert seq in replacement.source_event_seqs
            assert kind == events_module.event_type(self.log[seq])
            assert compaction_id == events_module.checkpoint_compaction_id(replacement)

    @invariant()
    def fold_equals_refold(self) -> None:
        assert snapshot(self.fold) == snapshot(refold(self.log))
        events = self.surface_events()
        cuts = [naive_balanced(events, i) for i in range(len(events) + 1)]
        assert balanced_cuts(events) == cuts

    def teardown(self) -> None:
        replayed = SessionFold()
        for event in self.log:  # every logged event was admissible, checked, in order
            replayed.admit([event])
        assert snapshot(replayed) == snapshot(self.fold)

    # --- plumbing -----------------------------------------------------------------------------

    def draw(self, strategy: st.SearchStrategy[T]) -> T:
        assert self.data is not None
        return self.data.draw(strategy)

    def commit(self, events: list[SessionEvent]) -> None:
        if events:
            batch = self.fold.admit(events)
            self.log += batch.events
            # The nodes keep the bytes a store writes for their events: the rows made from
            # them are the rows made by serializing every event.
            rows = run_to_end(encode_batch_in_steps(batch.events, batch.serialized()))
            assert rows == encode_batch(batch.events)
            assert batch.byte_size == sum(e.ByteSize() for e in batch.events)

    def tentative(self) -> list[AdmittedBatch]:
        """Admit 1..3 planned batches without logging them (each is planned on the last)."""
        planners = [
            self.plan_append,
            self.plan_log_only,
            lambda: self.plan_replace(True),
            self.plan_prune,
        ]
        batches = []
        for _ in range(self.draw(st.integers(1, 3))):
            events = self.draw(st.sampled_from(planners))()
            if events:
                batches.append(self.fold.admit(events))
        return batches

    def undo(self, batches: list[AdmittedBatch]) -> None:
        for batch in reversed(batches):
            self.fold.rollback(batch)

    def expect_rejected(self, batch: list[SessionEvent], error: type[CompactdError]) -> None:
        before = snapshot(self.fold)
        with pytest.raises(error):
            self.fold.admit(batch)
        assert snapshot(self.fold) == before

    def surface_events(self) -> list[SessionEvent]:
        return [n.event for n in self.fold.surface]

    def name(self, prefix: str) -> str:
        return f"{prefix}{next(self.fresh)}"

    # --- planners: each returns a batch that folds, or [] ---------------------------------------

    def plan_append(self) -> list[SessionEvent]:
        calls = sorted({c for e in self.surface_events() for c in events_module.tool_call_ids(e)})
        return [self.append_event(calls) for _ in range(self.draw(st.integers(1, 3)))]

    def append_event(self, calls: list[str]) -> SessionEvent:
        answered = [
            n.event.tool_result.tool_call_id for n in self.fold.surface if n.type == "tool/result"
        ]
        kinds = ["user", "assistant", "system", "developer", "empty"]
        kinds += ["result"] * 3 if calls else []
        kinds += ["again"] if answered else []  # a second result: the unit closed at the first
        kind = self.draw(st.sampled_from(kinds))
        if kind == "user":
            event = user(self.name("u"), blocks=self.images())
        elif kind == "assistant":
            new = [self.name("c") for _ in range(self.draw(st.integers(0, 2)))]
            calls += new
            event = assistant(self.name("a"), calls=[(c, "t", "{}") for c in new])
        elif kind == "result":
            event = tool_result(self.draw(st.sampled_from(calls)), "out", blocks=self.images())
        elif kind == "again":
            event = tool_result(self.draw(st.sampled_from(answered)), "again")
        elif kind == "system":
            event = system(self.draw(st.sampled_from(["", "be brief"])))
        elif kind == "developer":
            event = developer("note")
        else:
            event = assistant()
        if self.draw(st.booleans()):
            event.event_id = self.name("id")
        return event

    def images(self) -> list[Any]:
        return [image_block(self.name("img")) for _ in range(self.draw(st.integers(0, 2)))]

    def plan_log_only(self) -> list[SessionEvent]:
        options: list[Callable[[], SessionEvent]] = [
            lambda: self.draw(st.sampled_from(HEADERS)),
            lambda: turn_start(next(self.fresh)),
            end_seed,
        ]
        if live_bracket(self.fold.lock) is None:
            options.append(lambda: compaction_start(self.name("k")))
        if self.fold.lock.open_starts:
            opened = sorted(self.fold.lock.open_starts)
            options.append(lambda: compaction_end(self.draw(st.sampled_from(opened))))
        if self.fold.open_turns:
            turns = sorted(self.fold.open_turns)
            options.append(lambda: turn_end(self.draw(st.sampled_from(turns))))
            options.append(lambda: step_start(self.draw(st.sampled_from(turns)), 1))
        open_step = self.fold.open_step
        if open_step is not None:
            options.append(lambda: step_end(*open_step))
        with_images = self.nodes_with_images()
        if with_images:
            options.append(lambda: self.offload_of(with_images))
        return [self.draw(st.sampled_from(options))()]

    def nodes_with_images(self) -> dict[int, int]:
        found = {}
        for node in self.fold.surface:
            body = node.event.WhichOneof("body")
            if body in ("user_message", "tool_result"):
                count = sum(b.HasField("image") for b in getattr(node.event, body).content)
                if count:
                    found[node.seq] = count
        return found

    def offload_of(self, with_images: dict[int, int]) -> SessionEvent:
        seq = self.draw(st.sampled_from(sorted(with_images)))
        indexes = self.draw(st.sets(st.integers(0, with_images[seq] - 1), min_size=1))
        return offload({seq: sorted(indexes)})

    def plan_replace(self, between_cuts: bool) -> list[SessionEvent]:
        """A random span; one the rules forbid must be rejected here (and yields [])."""
        nodes = list(self.fold.surface)
        if not nodes:
            return []
        start, end = self.draw_span(nodes, between_cuts)
        head_is_system = nodes[0].type == "system/message"
        body = system("s2") if head_is_system and start == 0 and self.draw(st.booleans()) else None
        body = body or checkpoint(self.name("k"), "summary")
        shadowed = [n.seq for n in nodes[start : end + 1]]
        event = replace(body, start=nodes[start].seq, end=nodes[end].seq, sources=shadowed)
        events = [n.event for n in nodes]
        allowed = (
            naive_balanced(events, start)
            and naive_balanced(events, end + 1)
            and pairs_cleanly([*events[:start], body, *events[end + 1 :]])
            and not (
                head_is_system and start == 0 and (end != 0 or not body.HasField("system_message"))
            )
        )
        if allowed:
            return [event]
        self.expect_rejected([event], ReplacementRejected)
        return []

    def draw_span(self, nodes: list[SurfaceNode], between_cuts: bool) -> tuple[int, int]:
        """First and last position of a span, between balanced cuts when asked and possible."""
        cuts = [i for i, ok in enumerate(balanced_cuts([n.event for n in nodes])) if ok]
        if len(cuts) > 1 and between_cuts:
            start = self.draw(st.sampled_from(cuts[:-1]))
            return start, self.draw(st.sampled_from([c for c in cuts if c > start])) - 1
        start = self.draw(st.integers(0, len(nodes) - 1))
        return start, self.draw(st.integers(start, len(nodes) - 1))

    def plan_prune(self) -> list[SessionEvent]:
        results = [n for n in self.fold.surface if n.type == "tool/result"]
        if not results:
            return []
        node = self.draw(st.sampled_from(results))
        old = node.event.tool_result
        pruned = tool_result(
            old.tool_call_id, "[pruned]", name=old.tool_name, is_error=old.is_error
        )
        return [replace(pruned, start=node.seq, end=node.seq, sources=[node.seq])]

    def plan_bad(self) -> SessionEvent:
        """An event that breaks a rule in the current state."""
        seq = self.fold.revision
        options = [
            tool_result("never-called", "x"),
            compaction_end("never-started"),
            replace(user("x"), start=seq, end=seq, sources=[0]),
        ]
        if len(self.fold.surface):
            last = self.fold.surface[len(self.fold.surface) - 1].seq
            options.append(replace(user("x"), start=last, end=last, sources=[]))
        if live_bracket(self.fold.lock) is not None:
            options.append(compaction_start(self.name("k")))
        if self.fold.event_ids:
            options.append(with_id(user("dup"), min(self.fold.event_ids)))
        return self.draw(st.sampled_from(options))


FoldMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestIncrementalFoldEqualsRefold = FoldMachine.TestCase


def test_violations_name_the_event_in_the_batch() -> None:
    fold = SessionFold()
    fold.admit([system("s"), user("a")])
    bad = replace(user("sum"), start=1, end=1, sources=[0])  # does not cite seq 1
    with pytest.raises(ReplacementRejected) as caught:
        fold.admit([user("b"), bad])
    assert [v.field for v in caught.value.violations] == ["events[1].source_event_seqs"]


def test_a_redundant_header_is_recorded_without_a_reason() -> None:
    fold = SessionFold()
    first = fold.admit([header("p", "m")]).events[0]
    again = fold.admit([header("p", "m")]).events[0]
    assert first.request_header.reason == events_pb2.HEADER_REASON_INITIAL
    assert again.request_header.reason == events_pb2.HEADER_REASON_UNSPECIFIED


def test_a_compaction_id_is_never_reused_even_after_its_bracket_closed() -> None:
    fold = SessionFold()
    fold.admit([user("a"), compaction_start("k1"), compaction_end("k1")])
    with pytest.raises(InvalidArgument, match="a compaction id is used once"):
        fold.admit([compaction_start("k1")])
    fold.admit([compaction_start("k2")])  # a fresh id still opens a bracket


def test_a_fold_keeps_the_latest_bracket_ids_only_and_still_refuses_a_recent_one() -> None:
    fold = SessionFold()
    brackets = RECENT_COMPACTION_IDS + 40
    for n in range(brackets):
        fold.admit([compaction_start(f"k{n}"), compaction_end(f"k{n}")])
    fold.admit([user("next")])  # a batch begins: the ids beyond the latest are forgotten
    assert list(fold.compaction_ids) == [f"k{n}" for n in range(40, brackets)]
    with pytest.raises(InvalidArgument, match="a compaction id is used once"):
        fold.admit([compaction_start(f"k{brackets - RECENT_COMPACTION_IDS}")])
    assert len(fold.compaction_ids) == RECENT_COMPACTION_IDS  # the refusal kept them as they were


def test_a_rolled_back_start_gives_its_id_back_and_keeps_the_older_ones() -> None:
    fold = SessionFold()
    fold.admit([compaction_start("k0"), compaction_end("k0")])
    with pytest.raises(InvalidArgument, match="names no open compaction/start"):
        fold.admit([compaction_start("k1"), compaction_end("k2")])
    assert list(fold.compaction_ids) == ["k0"]
    fold.admit([compaction_start("k1")])  # the refused batch's id was never used


def test_a_released_batch_hands_over_its_lists_and_keeps_its_first_seq() -> None:
    fold = SessionFold()
    batch = fold.admit([user("a"), user("b")])
    events, changes = list(batch.events), list(batch.surface_changes)
    undo, changes_held, events_held = batch.release()
    assert (events_held, changes_held) == (events, changes)
    assert undo  # the undo records go too: a committed batch is not rolled back
    assert (batch.first_seq, batch.events, batch.surface_changes) == (0, [], [])
    assert [n.seq for n in fold.surface] == [0, 1]  # the fold keeps what it folded


def test_a_fold_keeps_its_latest_ids_and_a_rollback_takes_out_only_its_own() -> None:
    fold = SessionFold()
    fold.admit([with_id(user(f"m{n}"), f"e{n}") for n in range(RECENT_EVENT_IDS + 10)])
    assert len(fold.event_ids) == RECENT_EVENT_IDS + 10  # the last batch may still roll back
    batch = fold.admit([with_id(user("x"), "x")])
    latest = [f"e{n}" for n in range(10, RECENT_EVENT_IDS + 10)]
    assert list(fold.event_ids) == [*latest, "x"]
    fold.rollback(batch)
    assert list(fold.event_ids) == latest
    with pytest.raises(InvalidArgument, match="already in the log"):
        fold.admit([with_id(user("y"), "y"), with_id(user("y again"), "y")])
