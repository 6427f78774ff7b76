"""The surface's balanced-span check of a REPLACE, read from its call indices and the nodes from
the span on, equals the simple walk over the whole surface (kept here as the reference), on
random surfaces with repeated call ids, several results per call and earlier replacements."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactd.core import events as ev
from compactd.core.fold import SessionFold
from compactd.core.pairing import CorruptPairing, open_calls_after
from compactd.core.surface import Surface, SurfaceNode
from compactd.errors import CompactdError, ReplacementRejected
from tests.builders import assistant, checkpoint, replace, tool_result, user


def reference_balanced(nodes: Sequence[SurfaceNode], start: int, end: int) -> bool:
    """Both cuts balanced and no later result left whose call only the span made: the walk."""
    before = [n.event for n in nodes[:start]]
    through = [*before, *(n.event for n in nodes[start : end + 1])]
    try:
        if open_calls_after(before) or open_calls_after(through):
            return False
    except CorruptPairing:
        return False
    made: dict[str, int] = {}
    for node in nodes:
        for call_id in ev.tool_call_ids(node.event):
            made[call_id] = made.get(call_id, 0) + 1
    in_span: dict[str, int] = {}
    for node in nodes[start : end + 1]:
        for call_id in ev.tool_call_ids(node.event):
            in_span[call_id] = in_span.get(call_id, 0) + 1
    vanishing = {cid for cid, count in in_span.items() if made[cid] == count}
    return not any(
        n.type == ev.TOOL_RESULT and n.event.tool_result.tool_call_id in vanishing
        for n in nodes[end + 1 :]
    )


def fast_balanced(surface: Surface, start: int, end: int) -> bool:
    try:
        surface._check_balanced_span(start, end)
    except ReplacementRejected:
        return False
    return True


IDS = st.sampled_from(["a", "b", "c", "d"])


def fresh_ids() -> st.SearchStrategy[bool]:
    """Whether calls take new ids (the common case, the indexed path) or reuse a few."""
    return st.booleans()


def grow(fold: SessionFold, data: st.DataObject, fresh: bool) -> None:
    """One random batch: a message, calls (ids reused), a result, or a checkpoint."""
    kind = data.draw(st.sampled_from(["user", "calls", "result", "result", "checkpoint"]))
    nodes = list(fold.surface)
    if kind == "calls":
        ids = (
            [f"n{fold.revision}", f"m{fold.revision}"][: data.draw(st.integers(1, 2))]
            if fresh
            else data.draw(st.lists(IDS, min_size=1, max_size=2))
        )
        event = assistant(calls=[(call_id, "run", "{}") for call_id in ids])
    elif kind == "result" and any(n.type == ev.ASSISTANT_MESSAGE for n in nodes):
        made = sorted({cid for n in nodes for cid in ev.tool_call_ids(n.event)})
        if not made:
            return
        event = tool_result(data.draw(st.sampled_from(made)), "out", name="run")
    elif kind == "checkpoint" and len(nodes) >= 2:
        i = data.draw(st.integers(0, len(nodes) - 1))
        j = data.draw(st.integers(i, len(nodes) - 1))
        span = [n.seq for n in nodes[i : j + 1]]
        event = replace(checkpoint(f"k{fold.revision}", "sum"), span[0], span[-1], span)
    else:
        event = user("hi")
    with contextlib.suppress(CompactdError):  # a rule the fold keeps: it took nothing
        fold.admit([event])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_indexed_balanced_span_check_equals_walking_the_surface(data: st.DataObject) -> None:
    fold = SessionFold()
    fold.admit([user("start")])
    fresh = data.draw(fresh_ids())
    for _ in range(data.draw(st.integers(1, 30))):
        grow(fold, data, fresh)
        nodes = list(fold.surface)
        start = data.draw(st.integers(0, len(nodes) - 1))
        end = data.draw(st.integers(start, len(nodes) - 1))
        assert fast_balanced(fold.surface, start, end) == reference_balanced(nodes, start, end)
