"""Replies of large reads made in steps: the very bytes the message form serializes to, made a
bounded chunk of surface nodes per step."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from compactd.core import events as ev
from compactd.core.fold import SessionFold
from compactd.core.meter import SessionMeter
from compactd.core.pins import pin_list
from compactd.core.projection import project
from compactd.core.steps import run_to_end
from compactd.core.surface import SurfaceNode
from compactd.errors import InvalidArgument
from compactd.service.requests import (
    REPLY_CHUNK,
    build_request,
    detail_parts_in_steps,
    request_reply_in_steps,
    surface_parts_in_steps,
    surface_reply_in_steps,
    surface_response,
)
from compactd.service.sessions import SessionHandle
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as pb
from tests.builders import (
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


def _old_surface(fold: SessionFold) -> pb.GetSurfaceResponse:
    """GetSurface's reply as it was built before replies were made in steps."""
    nodes = []
    for position, node in enumerate(fold.surface):
        event = node.event
        nodes.append(
            pb.SurfaceNode(
                position=position,
                seq=node.seq,
                type=node.type,
                message=project(event, fold.offloads.get(node.seq, frozenset())),
                source_event_seqs=event.source_event_seqs,
                compaction_id=ev.checkpoint_compaction_id(event),
            )
        )
    return pb.GetSurfaceResponse(revision=fold.revision, nodes=nodes)


def _old_request(fold: SessionFold) -> pb.BuildRequestResponse:
    """BuildRequest's reply as it was built before replies were made in steps."""
    response = pb.BuildRequestResponse(
        revision=fold.revision,
        messages=fold.messages(),
        header_seq=fold.header_seq,
        pins=pin_list(fold.pin_texts()),
    )
    if fold.header is not None:
        if fold.header.HasField("config"):
            response.config.CopyFrom(fold.header.config)
        if fold.header.HasField("adapter_defaults"):
            response.adapter_defaults.CopyFrom(fold.header.adapter_defaults)
        response.tools.extend(fold.header.tools)
    return response


def _event(kind: int, index: int, fold: SessionFold) -> events_pb2.SessionEvent:
    """One event of a generated session: each kind of node, replacements and offloads."""
    seqs = [n.seq for n in fold.surface]
    if kind == 0:
        return user(f"question {index} " * (index % 5))
    if kind == 1:
        return system("" if index % 3 == 0 else f"system {index}")  # empty: projects to nothing
    if kind == 2:
        return assistant(f"answer {index}", calls=[(f"c{index}", "read", '{"a":1}')])
    if kind == 3 and fold.surface.unanswered_calls():
        return tool_result(sorted(fold.surface.unanswered_calls())[0], f"result {index}")
    if kind == 4:
        return user(f"look {index}", blocks=[image_block(f"i{index}.png", path=f"/a/{index}")])
    if kind == 5 and seqs:
        return offload({seqs[-1]: [0]})
    if kind == 6 and len(seqs) >= 2:
        start, end = seqs[index % len(seqs)], seqs[-1]
        sources = seqs[seqs.index(start) :]
        return replace(user(f"summary {index}"), start=start, end=end, sources=sources)
    if kind == 7:
        return checkpoint(f"k{index}", f"checkpoint {index}")
    if kind == 9:
        return pin(f"key{index % 3}", f"pinned {index}")
    if kind == 10 and fold.pins:
        return pin(sorted(fold.pins)[0], clear=True)
    return header("openai", "gpt-4o", tools=[tool(f"t{index}", description="d")])


def _fold(kinds: list[int]) -> SessionFold:
    fold = SessionFold()
    for index, kind in enumerate(kinds):
        with contextlib.suppress(InvalidArgument):  # a replacement the fold refuses: left out
            fold.admit([_event(kind, index, fold)])
    return fold


def _handle(fold: SessionFold) -> SessionHandle:
    context = SimpleNamespace(meter=SessionMeter(fold))  # declares no tools of its own
    return cast(SessionHandle, SimpleNamespace(fold=fold, context=context, incarnation=""))


@given(st.lists(st.integers(0, 8), max_size=4 * REPLY_CHUNK))
def test_a_surface_reply_made_in_steps_is_the_bytes_of_the_reply_built_at_once(
    kinds: list[int],
) -> None:
    fold = _fold(kinds)
    expected = _old_surface(fold).SerializeToString()
    assert run_to_end(surface_reply_in_steps(fold)) == expected
    assert surface_response(_handle(fold)).SerializeToString() == expected


@given(st.lists(st.integers(0, 10), max_size=4 * REPLY_CHUNK))
def test_a_request_reply_made_in_steps_is_the_bytes_of_the_request_built_at_once(
    kinds: list[int],
) -> None:
    fold = _fold(kinds)
    expected = _old_request(fold).SerializeToString()
    assert run_to_end(request_reply_in_steps(fold)) == expected
    assert build_request(_handle(fold)).SerializeToString() == expected
    # The incarnation rides in the first part; the parsed reply is the request built at once.
    stamped = pb.BuildRequestResponse.FromString(run_to_end(request_reply_in_steps(fold, (), "7")))
    assert stamped.incarnation == "7"
    stamped.incarnation = ""
    assert stamped.SerializeToString() == expected


def _steps(steps: Any) -> int:
    count = 0
    try:
        while True:
            next(steps)
            count += 1
    except StopIteration:
        return count


def test_a_reply_pauses_once_per_chunk_of_surface_nodes() -> None:
    nodes = 5 * REPLY_CHUNK + 3
    fold = _fold([0] * nodes)
    assert len(fold.surface) == nodes
    assert _steps(surface_reply_in_steps(fold)) == math.ceil(nodes / REPLY_CHUNK)
    assert _steps(request_reply_in_steps(fold)) == math.ceil(nodes / REPLY_CHUNK)


def _priced(node: SurfaceNode) -> tuple[int, int]:
    return node.seq * 7 + len(node.data), len(node.data)


@given(
    st.lists(st.integers(0, 8), max_size=3 * REPLY_CHUNK),
    st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(-1, 10**6), st.sampled_from(["", "c1"])),
        max_size=3 * REPLY_CHUNK,
    ),
    st.integers(0, 300),
    st.booleans(),
)
def test_a_surface_with_detail_made_in_steps_is_the_bytes_of_the_reply_built_at_once(
    kinds: list[int], shadows: list[tuple[int, int, str]], generation: int, anchored: bool
) -> None:
    fold = _fold(kinds)
    shadowed = sorted({seq: (by, "user/message", cid) for seq, by, cid in shadows}.items())
    # As GetSurface's detail was built before: the message whole, then serialized.
    expected = _old_surface(fold)
    for wire, node in zip(expected.nodes, fold.surface, strict=True):
        wire.detail.route_tokens, wire.detail.shadow_tokens = _priced(node)
    head = pb.SurfaceDetail(replacement_generation=generation, content_generation=generation)
    head.route.provider, head.route.model = "", ""  # the heuristic's empty route
    if anchored:
        head.anchor.seq, head.anchor.usage_tokens, head.anchor.delta_tokens = 3, 5007, 12
    expected.detail.CopyFrom(head)
    for seq, (by, kind, compaction_id) in shadowed:
        expected.detail.shadowed.add(
            seq=seq, type=kind, shadowed_by_seq=by, compaction_id=compaction_id
        )
    made = run_to_end(surface_parts_in_steps(fold, _priced))
    made += run_to_end(detail_parts_in_steps(head, shadowed))
    assert b"".join(made) == expected.SerializeToString()
