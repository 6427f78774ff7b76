"""The span's shadow price (``TokenMeasurement.shadowed_tokens``) from the meter's maintained
heuristic prices equals pricing the span's nodes afresh with the reference heuristic."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactd.core.fold import SessionFold
from compactd.core.pricing import heuristic_price
from compactd.core.surface import SurfaceNode
from compactd.service.bracket import shadow_price_of_nodes
from tests.builders import system
from tests.core.test_meter import Driver, Session, routed


def reference(fold: SessionFold, nodes: Sequence[SurfaceNode]) -> int:
    """The simple price: each node projected with its offloads and priced by the heuristic."""
    return sum(heuristic_price(n.event, fold.offloads.get(n.seq, frozenset())) for n in nodes)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_maintained_shadow_price_of_any_span_equals_pricing_it_afresh(
    data: st.DataObject,
) -> None:
    session = Session(routed(), system("head"))
    driver = Driver(data, session, usage=False)
    for _ in range(data.draw(st.integers(1, 25))):
        driver.step()
        nodes = list(session.fold.surface)
        start = data.draw(st.integers(0, len(nodes)))
        end = data.draw(st.integers(start, len(nodes)))
        span = nodes[start:end]
        seqs = [n.seq for n in span]
        got = shadow_price_of_nodes(session.meter, session.fold, seqs)
        assert got == reference(session.fold, span)
