"""The shared decisions: bracket shapes, the pricer of tentative nodes, span choice, rollback."""

from __future__ import annotations

from compactd.core.fold import SessionFold
from compactd.core.meter import SessionMeter, route_price
from compactd.core.planner import (
    SHAPES,
    PlanMode,
    choose_span,
    node_pricer,
    span_pricer,
    tentatively,
)
from compactd.core.pruner import PrunerConfig, plan_prunes
from compactd.core.selection import DeclineCode, Declined, Selection, SelectionMode
from compactd.routes import Route
from compactd.v1 import events_pb2
from tests.builders import SessionEvent, assistant, system, tool_result, user
from tests.core.test_fold import snapshot

ROUTE = Route("", "")  # the heuristic


def conversation(results: int = 4, big: bool = True) -> list[SessionEvent]:
    events = [system("be brief")]
    for i in range(results):
        events += [
            user(f"request {i} " * 20),
            assistant(calls=[(f"c{i}", "run", "{}")]),
            tool_result(f"c{i}", ("output line\n" * 900) if big and i == 1 else f"ok {i}"),
        ]
    return events


def folded(events: list[SessionEvent]) -> SessionFold:
    fold = SessionFold()
    fold.admit(events)
    return fold


def test_each_path_opens_the_bracket_its_trigger_names() -> None:
    assert SHAPES[PlanMode.AUTO].trigger == events_pb2.COMPACTION_TRIGGER_PRESSURE
    assert SHAPES[PlanMode.AUTO].retains
    assert SHAPES[PlanMode.AUTO].guarded
    assert not SHAPES[PlanMode.MANUAL].prunes  # Compact never prunes
    assert SHAPES[PlanMode.OVERFLOW].selection is SelectionMode.MAXIMAL
    assert not SHAPES[PlanMode.OVERFLOW].min_span  # overflow recovery accepts any span
    assert SHAPES[PlanMode.SWITCH].trigger == events_pb2.COMPACTION_TRIGGER_MODEL_SWITCH


def test_a_tentative_fold_is_rolled_back_to_exactly_the_state_before() -> None:
    fold = folded(conversation())
    before = snapshot(fold)
    plans = plan_prunes(fold, PrunerConfig(), lambda node: 1)
    assert len(plans) == 1
    with tentatively(fold, [e for p in plans for e in p.events]) as batch:
        assert batch.first_seq == len(conversation())
        assert fold.surface.replacements == 1
        (change,) = [c for c in batch.surface_changes if c.shadowed]
        assert (change.node.seq, [n.seq for n in change.shadowed]) == (
            batch.first_seq + 1,
            [plans[0].shadowed_seq],
        )
    assert snapshot(fold) == before


def test_a_tentative_fold_assigns_the_seqs_a_real_append_assigns() -> None:
    fold = folded(conversation())
    events = [e for p in plan_prunes(fold, PrunerConfig(), lambda node: 1) for e in p.events]
    with tentatively(fold, events):
        planned = [(n.seq, n.event.SerializeToString()) for n in fold.surface]
    fold.admit(events)
    assert [(n.seq, n.event.SerializeToString()) for n in fold.surface] == planned


def test_the_pricer_uses_the_meter_and_prices_tentative_nodes_as_the_meter_would() -> None:
    fold = folded(conversation())
    meter = SessionMeter(fold)
    events = [e for p in plan_prunes(fold, PrunerConfig(), lambda node: 1) for e in p.events]
    with tentatively(fold, events):
        price = node_pricer(meter, fold, ROUTE)
        tentative = [price(n) for n in fold.surface]
    batch = fold.admit(events)
    meter.observe(fold, batch)
    assert [meter.route_price_of_nodes(fold, (n.seq,), ROUTE) for n in fold.surface] == tentative
    assert tentative == [route_price(n.event, ROUTE) for n in fold.surface]


def test_the_span_pricer_sums_what_the_node_pricer_gives_tentative_nodes_included() -> None:
    fold = folded(conversation())
    meter = SessionMeter(fold)
    events = [e for p in plan_prunes(fold, PrunerConfig(), lambda node: 1) for e in p.events]
    nodes = list(fold.surface)
    price = node_pricer(meter, fold, ROUTE)
    assert span_pricer(meter, fold, ROUTE)(nodes) == sum(price(n) for n in nodes)
    with tentatively(fold, events):
        nodes = list(fold.surface)  # a pruned result the meter has not observed
        assert span_pricer(meter, fold, ROUTE)(nodes) == sum(price(n) for n in nodes)
        for mode in SelectionMode:
            chosen = [
                choose_span(fold, price, selection=mode, retained_budget=50, min_span_tokens=0,
                            span_price=spans)
                for spans in (None, span_pricer(meter, fold, ROUTE))
            ]  # fmt: skip
            assert chosen[0] == chosen[1]


def test_choose_span_lets_the_hold_decline_a_chosen_span_and_nothing_else() -> None:
    fold = folded(conversation(big=False))
    price = node_pricer(SessionMeter(fold), fold, ROUTE)
    held: list[Selection] = []

    def hold(chosen: Selection) -> Declined:
        held.append(chosen)
        return Declined(DeclineCode.KNOWN_FAILURE, "held")

    free = choose_span(
        fold, price, selection=SelectionMode.MAXIMAL, retained_budget=0, min_span_tokens=0
    )
    got = choose_span(
        fold, price, selection=SelectionMode.MAXIMAL, retained_budget=0, min_span_tokens=0,
        hold=hold,
    )  # fmt: skip
    assert got == Declined(DeclineCode.KNOWN_FAILURE, "held")
    assert held == [free]
    small = choose_span(
        fold, price, selection=SelectionMode.MAXIMAL, retained_budget=0, min_span_tokens=10**9,
        hold=hold,
    )  # fmt: skip
    assert isinstance(small, Declined)
    assert small.code is DeclineCode.SPAN_TOO_SMALL
    assert len(held) == 1  # a declined selection never reaches the hold


def test_a_switch_retry_reaches_into_the_tail_and_a_pressure_retry_does_not() -> None:
    auto, switch = SHAPES[PlanMode.AUTO], SHAPES[PlanMode.SWITCH]
    assert [auto.selection_for(a) for a in (0, 1, 2)] == [SelectionMode.PRESSURE] * 3
    assert [switch.selection_for(a) for a in (0, 1)] == [
        SelectionMode.PRESSURE,
        SelectionMode.MAXIMAL,
    ]
