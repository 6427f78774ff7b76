"""The incremental meter: cached node prices, breakdown, usage anchoring, incremental == recount."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactd.core.fold import SessionFold
from compactd.core.meter import Measurement, Method, SessionMeter, _Ledger, recount, route_price
from compactd.core.pricing import (
    HEURISTIC,
    HeuristicTokenizer,
    ImagePricing,
    NodeCost,
    PricingProfile,
    heuristic_price,
    price_tools,
)
from compactd.errors import CompactdError
from compactd.routes import Route
from compactd.tokenizers import framing_for
from compactd.v1 import events_pb2
from tests.builders import (
    SessionEvent,
    assistant,
    checkpoint,
    header,
    image_block,
    offload,
    pin,
    replace,
    system,
    tool,
    tool_result,
    user,
)

T = TypeVar("T")
ROUTE = Route("deepseek", "deepseek-chat", 128_000, tokenizer="heuristic")
EXACT = Route("deepseek", "deepseek-chat", 128_000, tokenizer="cl100k_base")
OTHER = Route("openai", "gpt-4o", 128_000, tokenizer="heuristic")


class Session:
    """A fold and its meter, fed batch by batch as a committed session would be."""

    def __init__(self, *events: SessionEvent) -> None:
        self.fold = SessionFold()
        self.meter = SessionMeter(self.fold)
        self.events: list[SessionEvent] = []
        if events:
            self.add(*events)

    def add(self, *events: SessionEvent) -> list[int]:
        batch = self.fold.admit(events)
        self.meter.observe(self.fold, batch)
        self.events.extend(batch.events)
        return [e.seq for e in batch.events]

    def measure(self, route: Route = ROUTE) -> Measurement:
        return self.meter.measure(self.fold, route)


def with_usage(event: SessionEvent, total: int) -> SessionEvent:
    event.assistant_message.usage.CopyFrom(
        events_pb2.Usage(input_tokens=total - 10, cache_read_tokens=4, cache_write_tokens=1,
                         output_tokens=5, reasoning_tokens=3)
    )  # fmt: skip
    return event


def routed(tools: Sequence[events_pb2.ToolDeclaration] = ()) -> SessionEvent:
    return header("deepseek", "deepseek-chat", tools=tools)


# ---- the breakdown ---------------------------------------------------------------------------


def test_a_measurement_breaks_the_envelope_down() -> None:
    tools = [tool("read", '{"type":"object"}')]
    session = Session(
        routed(tools), system("You are terse."), user("abcd"), system("Later rules."), user("x")
    )
    m = session.measure()
    assert m.system == 8
    assert m.tools == price_tools(tools, HEURISTIC)
    assert m.messages == 9 + heuristic_price(system("Later rules.")) + heuristic_price(user("x"))
    assert (m.images, m.config) == (0, 0)
    assert m.total == m.system + m.tools + m.messages
    assert (m.method, m.tokenizer, m.anchor_seq) == (Method.HEURISTIC, "heuristic", None)
    assert m.revision == 5


def test_images_are_their_own_part() -> None:
    priced = Route("p", "m", 1000, image_pricing=ImagePricing(per_image=500))
    session = Session(user("see", blocks=[image_block("a.png"), image_block("b.png")]))
    before = session.measure(priced)
    assert before.images == 2 * (500 + 2)  # 500 per image plus ceil(len("a.png") / 4)
    session.add(offload({0: [1]}))
    after = session.measure(priced)
    assert 500 + 2 < after.images < before.images
    assert after == recount(session.fold, priced)


def test_an_exact_route_measures_exactly_with_its_framing() -> None:
    session = Session(routed(), system("hello world"), user("hello world"))
    m = session.measure(EXACT)
    assert (m.method, m.tokenizer) == (Method.TOKENIZER, "cl100k_base")
    framing = framing_for("cl100k_base")
    assert m.system == 2 + framing.per_system
    assert m.messages == 2 + framing.per_message
    assert m.config == framing.per_request


def test_a_shadowed_node_leaves_the_total() -> None:
    session = Session(system("s"), user("a" * 400), assistant("b" * 400), user("c"))
    before = session.measure().total
    [seq] = session.add(replace(checkpoint("k1", "short"), 1, 2, [1, 2]))
    after = session.measure()
    assert after.total == before - heuristic_price(user("a" * 400)) - heuristic_price(
        assistant("b" * 400)
    ) + heuristic_price(session.fold.surface[1].event)
    assert session.fold.surface[1].seq == seq
    assert after == recount(session.fold, ROUTE)


def test_a_replaced_system_head_stays_the_system_part() -> None:
    session = Session(system("old"), user("a"))
    session.add(replace(system("a much longer system prompt"), 0, 0, [0]))
    assert session.measure().system == heuristic_price(system("a much longer system prompt"))


def test_route_price_of_nodes_sums_cached_prices() -> None:
    session = Session(system("s"), user("abcd"), assistant("efgh"))
    assert session.meter.route_price_of_nodes(session.fold, [1, 2], ROUTE) == 9 + 9
    exact = session.meter.route_price_of_nodes(session.fold, [1], EXACT)
    assert exact == route_price(user("abcd"), EXACT)
    session.add(replace(checkpoint("k", "sum"), 1, 2, [1, 2]))
    with pytest.raises(ValueError, match="not a current surface node"):
        session.meter.route_price_of_nodes(session.fold, [1], ROUTE)


def test_a_meter_rejects_another_sessions_fold() -> None:
    session = Session(user("a"))
    with pytest.raises(ValueError, match="another session"):
        session.meter.measure(SessionFold(), ROUTE)


# ---- incrementality --------------------------------------------------------------------------


@dataclass
class CountingTokenizer:
    """The heuristic, counting how many texts it was asked to price."""

    calls: int = 0
    name: str = "counting"
    exact: bool = False

    def count(self, text: str) -> int:
        self.calls += 1
        return HeuristicTokenizer().count(text)


@dataclass(frozen=True)
class CountingRoute:
    provider: str
    model: str
    pricing: PricingProfile


def test_each_node_is_priced_once_and_a_measure_reprices_nothing() -> None:
    counter = CountingTokenizer()
    route = CountingRoute("p", "m", PricingProfile(counter, HEURISTIC.framing))
    session = Session(system("s"), *(user(f"message {i}") for i in range(1000)))
    session.meter.measure(session.fold, route)
    assert counter.calls == 1001  # the first measurement prices every node once
    for _ in range(10):
        session.meter.measure(session.fold, route)
    assert counter.calls == 1001
    session.add(user("one more"))
    assert counter.calls == 1002  # an append prices the new node only
    session.add(replace(checkpoint("k", "summary"), 1, 500, range(1, 501)))
    assert counter.calls == 1003  # a replacement prices the new node; the shadowed just leave
    session.meter.measure(session.fold, route)
    assert counter.calls == 1003


def test_a_priced_resident_surface_leaves_the_cyclic_collector_nothing_per_node() -> None:
    """Its nodes are untracked and their prices shared: a full collection's pause does not grow
    with the nodes a process keeps resident."""
    gc.collect()
    before = len(gc.get_objects())
    session = Session(system("s"), *(user(f"message {i % 7}") for i in range(2000)))
    for route in (ROUTE, EXACT):
        session.meter.measure(session.fold, route)
    del session.events  # the test's own copies of the events, not the session's
    gc.collect()
    assert len(gc.get_objects()) - before < 100  # 2,001 nodes priced for two profiles


def test_a_profile_first_measured_late_matches_a_recount() -> None:
    session = Session(system("s"), user("a"), assistant("b"))
    session.measure(ROUTE)
    session.add(user("c" * 50), replace(checkpoint("k", "x"), 1, 2, [1, 2]))
    assert session.measure(EXACT) == recount(session.fold, EXACT)
    session.add(user("d"))
    assert session.measure(EXACT) == recount(session.fold, EXACT)
    assert session.measure(ROUTE) == recount(session.fold, ROUTE)


# ---- anchoring on provider usage -------------------------------------------------------------


def anchored_session(usage: int = 1000) -> Session:
    return Session(routed(), system("s"), user("question"), with_usage(assistant("answer"), usage))


def test_usage_anchors_the_envelope_it_priced() -> None:
    session = anchored_session(1000)
    m = session.measure()
    assert (m.method, m.total, m.anchor_seq) == (Method.ANCHORED, 1000, 3)
    assert m.total == m.system + m.tools + m.messages + m.images + m.config
    assert m.messages == 1000 - m.system  # the gap to the estimate goes to messages


def test_the_surface_after_the_anchor_is_priced_as_a_delta() -> None:
    session = anchored_session(1000)
    session.add(user("follow-up"), user("x" * 40))
    expected = 1000 + heuristic_price(user("follow-up")) + heuristic_price(user("x" * 40))
    assert session.measure().total == expected


def test_usage_below_the_estimate_leaves_the_estimate() -> None:
    session = anchored_session(5)
    assert session.measure() == recount(session.fold, ROUTE)


def test_only_the_latest_anchor_counts() -> None:
    session = anchored_session(1000)
    session.add(user("again"), with_usage(assistant("second"), 2000))
    m = session.measure()
    assert (m.total, m.anchor_seq) == (2000, 5)


def test_a_changed_header_ends_the_anchor() -> None:
    session = anchored_session(1000)
    session.add(routed([tool("new_tool")]))
    assert session.measure().method is Method.HEURISTIC


def test_a_relogged_equal_header_keeps_the_anchor() -> None:
    session = anchored_session(1000)
    session.add(header("deepseek", "deepseek-chat", reason=events_pb2.HEADER_REASON_SERIES))
    assert session.measure().method is Method.ANCHORED


def test_another_route_is_never_anchored() -> None:
    session = anchored_session(1000)
    assert session.measure(OTHER).method is Method.HEURISTIC


def test_a_replacement_before_the_anchor_ends_it() -> None:
    session = Session(
        routed(), system("s"), user("q" * 100), assistant("a" * 100), user("next"),
        with_usage(assistant("answer"), 1000),
    )  # fmt: skip
    session.add(replace(checkpoint("k", "sum"), 2, 3, [2, 3]))
    assert session.measure() == recount(session.fold, ROUTE)


def test_pruning_after_the_anchor_updates_the_delta() -> None:
    session = anchored_session(1000)
    session.add(assistant(calls=[("c1", "read", "{}")]), tool_result("c1", "r" * 400, name="read"))
    before = session.measure()
    assert before.method is Method.ANCHORED
    session.add(replace(tool_result("c1", "short", name="read"), 5, 5, [5]))
    after = session.measure()
    assert after.method is Method.ANCHORED
    saved = heuristic_price(tool_result("c1", "r" * 400)) - heuristic_price(
        tool_result("c1", "short")
    )
    assert before.total - after.total == saved


def test_an_offload_before_the_anchor_ends_it() -> None:
    session = Session(
        routed(), user("see", blocks=[image_block("a.png")]), with_usage(assistant("ok"), 5000)
    )
    assert session.measure().method is Method.ANCHORED
    session.add(offload({1: [0]}))
    assert session.measure() == recount(session.fold, ROUTE)


def test_an_offload_after_the_anchor_reprices_the_delta() -> None:
    session = anchored_session(1000)
    [seq] = session.add(user("look", blocks=[image_block("b.png")]))
    before = session.measure()
    session.add(offload({seq: [0]}))
    after = session.measure()
    assert after.method is Method.ANCHORED
    offloaded = heuristic_price(session.fold.surface[seq - 1].event, {0})
    assert after.total == 1000 + offloaded
    assert after.total != before.total


def test_an_anchor_shadowed_by_a_checkpoint_ends() -> None:
    session = anchored_session(1000)
    session.add(user("more"))
    session.add(replace(checkpoint("k", "sum"), 2, 3, [2, 3]))
    assert session.measure() == recount(session.fold, ROUTE)


def test_a_restored_session_finds_its_anchor() -> None:
    source = anchored_session(1000)
    source.add(user("after"))
    fold = SessionFold()
    fold.admit(source.events, check=False)
    meter = SessionMeter(fold)
    assert meter.measure(fold, ROUTE) == source.measure()
    assert source.measure().method is Method.ANCHORED


def test_a_restored_session_with_a_header_after_the_anchor_is_not_anchored() -> None:
    source = anchored_session(1000)
    source.add(header("deepseek", "deepseek-chat", reason=events_pb2.HEADER_REASON_RESUME))
    fold = SessionFold()
    fold.admit(source.events, check=False)
    assert SessionMeter(fold).measure(fold, ROUTE) == recount(fold, ROUTE)


# ---- incremental == recount (property) -------------------------------------------------------

TEXT = st.text(alphabet=st.sampled_from('ab c\n中文😀{}":'), max_size=60)


class Driver:
    """Draws random valid batches against a session and checks the meter after each."""

    def __init__(self, data: st.DataObject, session: Session, *, usage: bool) -> None:
        self.data = data
        self.session = session
        self.usage = usage
        self.calls = 0

    def draw(self, strategy: st.SearchStrategy[T]) -> T:
        return self.data.draw(strategy)

    def batch(self) -> list[SessionEvent]:
        kind = self.draw(
            st.sampled_from(
                ["user", "assistant", "call", "prune", "double_prune", "checkpoint", "offload",
                 "append_offload", "header", "system", "pin", "unpin"]
            )
        )  # fmt: skip
        events: list[SessionEvent] = getattr(self, f"_{kind}")()
        return events

    def _text(self) -> str:
        return self.draw(TEXT)

    def _user(self) -> list[SessionEvent]:
        images = [image_block(f"i{k}.png") for k in range(self.draw(st.integers(0, 2)))]
        return [user(self._text(), blocks=images)]

    def _assistant(self) -> list[SessionEvent]:
        event = assistant(self._text(), reasoning=self._text())
        if self.usage and self.draw(st.booleans()):
            with_usage(event, self.draw(st.integers(10, 5000)))
        return [event]

    def _call(self) -> list[SessionEvent]:
        self.calls += 1
        call_id = f"c{self.calls}"
        images = [image_block("shot.png")] if self.draw(st.booleans()) else []
        return [
            assistant(calls=[(call_id, "run", self._text())]),
            tool_result(call_id, self._text(), name="run", blocks=images),
        ]

    def _results(self) -> list[int]:
        return [n.seq for n in self.session.fold.surface if n.type == "tool/result"]

    def _pruned(self, seq: int) -> SessionEvent:
        old = self.session.fold.surface[self.session.fold.surface.position_of(seq) or 0].event
        event = tool_result(old.tool_result.tool_call_id, self._text(), name="run")
        return replace(event, seq, seq, [seq])

    def _prune(self) -> list[SessionEvent]:
        results = self._results()
        if not results:
            return self._user()
        return [self._pruned(self.draw(st.sampled_from(results)))]

    def _double_prune(self) -> list[SessionEvent]:
        first = self._prune()
        if not self._results():
            return first
        again = SessionEvent()
        again.CopyFrom(first[0])
        seq = self.session.fold.revision  # the seq the first replacement will get
        again.surface_op.start_seq = again.surface_op.end_seq = seq
        again.source_event_seqs[:] = [seq]
        return [*first, again]

    def _checkpoint(self) -> list[SessionEvent]:
        nodes = list(self.session.fold.surface)
        if len(nodes) < 2:
            return self._user()
        i = self.draw(st.integers(1, len(nodes) - 1))
        j = self.draw(st.integers(i, len(nodes) - 1))
        span = [n.seq for n in nodes[i : j + 1]]
        return [
            replace(
                checkpoint(f"k{self.session.fold.revision}", self._text()), span[0], span[-1], span
            )
        ]

    def _with_images(self) -> list[tuple[int, int]]:
        found: list[tuple[int, int]] = []
        for node in self.session.fold.surface:
            body = node.event.WhichOneof("body")
            if body in ("user_message", "tool_result"):
                count = sum(1 for b in getattr(node.event, body).content if b.HasField("image"))
                found.extend((node.seq, k) for k in range(count))
        return found

    def _offload(self) -> list[SessionEvent]:
        images = self._with_images()
        if not images:
            return self._append_offload()
        seq, index = self.draw(st.sampled_from(images))
        return [offload({seq: [index]})]

    def _append_offload(self) -> list[SessionEvent]:
        seq = self.session.fold.revision
        return [user(self._text(), blocks=[image_block("new.png")]), offload({seq: [0]})]

    def _header(self) -> list[SessionEvent]:
        names = self.draw(st.lists(st.sampled_from(["read", "write", "run"]), unique=True))
        return [routed([tool(name, '{"type":"object"}') for name in names])]

    def _system(self) -> list[SessionEvent]:
        head = self.session.fold.surface[0] if len(self.session.fold.surface) else None
        if head is not None and head.type == "system/message" and self.draw(st.booleans()):
            return [replace(system(self._text()), head.seq, head.seq, [head.seq])]
        return [system(self._text())]

    def _pin(self) -> list[SessionEvent]:
        key = self.draw(st.sampled_from(["goal", "plan", "fix"]))
        return [pin(key, "p" + self._text())]

    def _unpin(self) -> list[SessionEvent]:
        keys = sorted(self.session.fold.pins)
        if not keys:
            return self._pin()
        return [pin(self.draw(st.sampled_from(keys)), clear=True)]

    def step(self) -> None:
        events = self.batch()
        try:
            self.session.add(*events)
        except CompactdError:
            return  # an unbalanced span or a similar rule: the fold took nothing


ROUTES = (ROUTE, Route("p", "m", 1000, image_pricing=ImagePricing(per_image=85, per_tile=170)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_incremental_equals_recount_after_random_batches(data: st.DataObject) -> None:
    session = Session(routed(), system("head"))
    driver = Driver(data, session, usage=False)
    for _ in range(data.draw(st.integers(1, 30))):
        driver.step()
        for route in ROUTES:
            assert session.measure(route) == recount(session.fold, route)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_incremental_equals_recount_with_an_exact_tokenizer(data: st.DataObject) -> None:
    session = Session(routed(), system("head"))
    driver = Driver(data, session, usage=False)
    for _ in range(data.draw(st.integers(1, 15))):
        driver.step()
    assert session.measure(EXACT) == recount(session.fold, EXACT)
    deepseek = Route("deepseek", "deepseek-v4-flash", 1_048_576, tokenizer="deepseek-v4")
    assert session.measure(deepseek) == recount(session.fold, deepseek)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_anchoring_never_reports_less_than_the_estimate(data: st.DataObject) -> None:
    session = Session(routed(), system("head"))
    driver = Driver(data, session, usage=True)
    for _ in range(data.draw(st.integers(1, 30))):
        driver.step()
        measured, estimate = session.measure(), recount(session.fold, ROUTE)
        if measured.method is Method.ANCHORED:
            assert measured.total >= estimate.total
            assert measured.anchor_seq is not None
            assert session.fold.surface.position_of(measured.anchor_seq) is not None
            parts = (measured.system, measured.tools, measured.images, measured.config)
            assert parts == (estimate.system, estimate.tools, estimate.images, estimate.config)
        else:
            assert measured == estimate


# ---- prices made ahead of observe (in a worker thread) and persisted -----------------------


def test_prices_prepared_ahead_equal_prices_made_while_observing() -> None:
    plain, ahead = Session(), Session()
    batches = [
        [routed(), system("be brief"), user("look", blocks=[image_block("a.png")])],
        [assistant("ok", calls=[("c1", "read", "{}")]), tool_result("c1", "data " * 40)],
        [offload({2: [0]}), with_usage(assistant("done"), 900)],
        [replace(user("summary"), 3, 4, [3, 4]), user("next")],
    ]
    for events in batches:
        plain.add(*events)
        batch = ahead.fold.admit(events)
        ahead.meter.prepare(ahead.fold, batch, [EXACT.pricing])  # builds EXACT's ledger too
        ahead.meter.observe(ahead.fold, batch)
        for route in (ROUTE, EXACT):
            assert ahead.measure(route) == plain.measure(route)
    assert ahead.meter.persisted_prices() == plain.meter.persisted_prices()
    assert ahead.measure(EXACT).total == recount(ahead.fold, EXACT).total


def _appends(driver: Driver) -> list[SessionEvent]:
    """Several append-only batches in one: what a runtime's large batch looks like."""
    kinds = driver.draw(st.lists(st.sampled_from(["user", "assistant", "call"]), min_size=1))
    return [event for kind in kinds for event in getattr(driver, f"_{kind}")()]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_observing_prepared_batches_equals_observing_them_unprepared(data: st.DataObject) -> None:
    plain, ahead = Session(routed(), system("head")), Session(routed(), system("head"))
    for session in (plain, ahead):
        session.measure(ROUTE)
    driver = Driver(data, plain, usage=True)
    for _ in range(data.draw(st.integers(1, 20))):
        events = _appends(driver) if data.draw(st.booleans()) else driver.batch()
        try:
            plain.add(*events)
        except CompactdError:
            continue
        batch = ahead.fold.admit(events)
        ahead.meter.prepare(ahead.fold, batch, [EXACT.pricing] if data.draw(st.booleans()) else [])
        if data.draw(st.booleans()):  # a ledger built between the prices made and the commit
            ahead.measure(OTHER)
        ahead.meter.observe(ahead.fold, batch)
        for route in (ROUTE, EXACT, OTHER):
            for anchored in (True, False):
                got = ahead.meter.measure(ahead.fold, route, anchored=anchored)
                assert got == plain.meter.measure(plain.fold, route, anchored=anchored)
        assert ahead.meter.anchor_of(ROUTE) == plain.meter.anchor_of(ROUTE)
        assert ahead.meter.anchor_state() == plain.meter.anchor_state()
        assert ahead.meter.persisted_prices() == plain.meter.persisted_prices()


def _count_ahead(meter: SessionMeter, events: Sequence[SessionEvent]) -> None:
    steps = meter.count_ahead(events)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            job = done.value
            break
    if job is not None:
        job()


def test_prices_made_for_a_batch_rolled_back_are_not_taken_by_the_next() -> None:
    plain, ahead = Session(routed(), system("head")), Session(routed(), system("head"))
    lost = ahead.fold.admit([user("a message the store never took"), assistant("and its answer")])
    ahead.meter.prepare(ahead.fold, lost)
    ahead.fold.rollback(lost)  # the commit failed
    events = [user("what the log holds"), with_usage(assistant("instead"), 700)]
    plain.add(*events)
    ahead.add(*events)  # the same seqs, priced on their own
    for route in (ROUTE, EXACT):
        assert ahead.measure(route) == plain.measure(route)
    assert ahead.meter.anchor_state() == plain.meter.anchor_state()


def test_texts_counted_ahead_price_a_batch_as_counting_it_while_preparing() -> None:
    plain, ahead = Session(routed(), system("head")), Session(routed(), system("head"))
    for session in (plain, ahead):
        session.measure(EXACT)
    refused = [tool_result("nobody", "no call made this")]
    _count_ahead(ahead.meter, refused)  # a batch the fold then refuses leaves nothing wrong
    with pytest.raises(CompactdError):
        ahead.fold.admit(refused)
    for events in (
        [user("look at this"), assistant("ok", calls=[("c1", "read", '{"p": 1}')])],
        [tool_result("c1", "data " * 40), with_usage(assistant("done 中文"), 900), user("next")],
    ):
        plain.add(*events)
        _count_ahead(ahead.meter, events)
        batch = ahead.fold.admit(events)
        ahead.meter.prepare(ahead.fold, batch)
        ahead.meter.observe(ahead.fold, batch)
        for route in (ROUTE, EXACT):
            assert ahead.measure(route) == plain.measure(route)
    assert ahead.meter.measure(ahead.fold, EXACT, anchored=False) == recount(ahead.fold, EXACT)


def test_prices_counted_ahead_of_other_events_are_not_taken() -> None:
    plain, ahead = Session(routed(), system("head")), Session(routed(), system("head"))
    for session in (plain, ahead):
        session.measure(EXACT)
    _count_ahead(ahead.meter, [user("a batch refused before its admission"), assistant("no")])
    events = [user("what the log holds"), assistant("instead")]
    plain.add(*events)
    batch = ahead.fold.admit(events)  # as many nodes as the batch counted ahead
    ahead.meter.prepare(ahead.fold, batch)
    ahead.meter.observe(ahead.fold, batch)
    for route in (ROUTE, EXACT):
        assert ahead.measure(route) == plain.measure(route)


def test_a_meter_restored_from_persisted_prices_measures_as_the_one_that_made_them() -> None:
    live = Session(routed(), system("be brief"), user("hello"), with_usage(assistant("hi"), 500))
    live.measure(EXACT)
    restored = SessionMeter(
        live.fold,
        persisted=live.meter.persisted_prices(),
        anchor=(3, 0, live.fold.header),
    )
    for route in (ROUTE, EXACT):
        assert restored.measure(live.fold, route) == live.measure(route)
    assert restored.anchor_state() == live.meter.anchor_state()


_COSTS = st.dictionaries(
    st.integers(0, 30), st.builds(NodeCost, st.integers(0, 50), st.integers(0, 9))
)


@given(_COSTS, st.lists(st.integers(0, 40), unique=True), st.sets(st.integers(0, 40)))
def test_dropping_a_span_at_once_equals_dropping_its_nodes_in_turn(
    costs: dict[int, NodeCost], seqs: list[int], in_delta: set[int]
) -> None:
    one, span = _Ledger(HEURISTIC), _Ledger(HEURISTIC)
    for ledger in (one, span):
        for seq, cost in costs.items():
            ledger.put(seq, cost, seq in in_delta)
    for seq in seqs:
        one.drop(seq, seq in in_delta)
    span.drop_span(seqs, in_delta)
    assert (span.costs, span.messages, span.images, span.delta) == (
        one.costs, one.messages, one.images, one.delta,
    )  # fmt: skip


# ---- pinned state ----------------------------------------------------------------------------


def test_pins_are_their_own_part_of_the_envelope_and_leave_when_cleared() -> None:
    session = Session(routed(), system("head"), user("hi"))
    before = session.measure()
    session.add(pin("goal", "ship the parser"), pin("plan", "1. lex 2. parse"))
    pinned = session.measure()
    message = session.fold.pins_message()
    assert message is not None
    assert pinned.pins == route_price(message, ROUTE) > 0
    assert pinned.total == before.total + pinned.pins
    assert pinned.messages == before.messages
    assert pinned.system == before.system
    assert pinned == recount(session.fold, ROUTE)
    session.add(pin("goal", clear=True), pin("plan", clear=True))
    assert session.measure().total == before.total
    assert session.measure().pins == 0


def test_a_pin_change_ends_the_usage_anchor() -> None:
    session = Session(routed(), system("head"), user("hi"), with_usage(assistant("ok"), 900))
    assert session.measure().method is Method.ANCHORED
    session.add(pin("goal", "ship it"))
    assert session.measure() == recount(session.fold, ROUTE)
    assert session.measure().method is not Method.ANCHORED
