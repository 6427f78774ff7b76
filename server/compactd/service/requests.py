"""Read models of a session: its surface and its reconstructed request, as the wire shows them.

A large surface's reply is long work: a surface at ``max_surface_bytes`` has tens of thousands
of nodes, each parsed, projected and serialized (about a second of Python in all). The RPCs take
the ``*_reply_in_steps`` forms, which make the reply's serialized bytes ``REPLY_CHUNK`` nodes at
a time with a pause (``yield``) between, for ``compactd.speed.in_steps`` to run on the loop, and
hand grpc those bytes (``api.replies.Serialized``): neither building the reply nor serializing
it holds the event loop for long (``bench/bench_neighbours.py``). The bytes are those of the
message form: a message's serialized fields concatenated is the message (each chunk of nodes
serializes as its part of the repeated field).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence

from compactd.core import events as ev
from compactd.core.fold import SessionFold
from compactd.core.pins import pin_list
from compactd.core.projection import Message, derive_messages, project
from compactd.core.surface import SurfaceNode
from compactd.service.sessions import SessionHandle
from compactd.speed import in_steps
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.events_pb2 import ToolDeclaration

#: Surface nodes (or shadowed nodes of a surface's detail) made into a reply between pauses.
REPLY_CHUNK = 32
#: A surface node's detail: its (route tokens, shadow tokens).
NodeDetail = Callable[[SurfaceNode], tuple[int, int]]
#: A shadowed node of a surface's detail: (seq, (shadowed by seq, its type, compaction id)).
Shadowed = tuple[int, tuple[int, str, str]]
# GetSurfaceResponse.detail's tag: field 100, length-delimited.
_DETAIL_TAG = bytes([(100 << 3 | 2) & 0x7F | 0x80, (100 << 3 | 2) >> 7])


def surface_response(handle: SessionHandle) -> pb.GetSurfaceResponse:
    """The current surface of a session, as the wire shows it."""
    fold = handle.fold
    response = pb.GetSurfaceResponse(revision=fold.revision)
    _add_nodes(response, fold, range(len(fold.surface)))
    return response


def surface_reply_in_steps(fold: SessionFold) -> Generator[None, None, bytes]:
    """``surface_response`` of the session of ``fold`` serialized, made ``REPLY_CHUNK`` nodes
    at a time with a pause (``yield``) after each, then joined in a step of its own. The caller
    keeps the fold still (the session's lock)."""
    parts = yield from surface_parts_in_steps(fold)
    return b"".join(parts)


def surface_parts_in_steps(
    fold: SessionFold, detail: NodeDetail | None = None
) -> Generator[None, None, list[bytes]]:
    """``surface_reply_in_steps``'s bytes in pieces (each node's ``detail`` set from ``detail``
    when given), not yet joined: joining is one copy of the whole reply, in one call."""
    parts = [pb.GetSurfaceResponse(revision=fold.revision).SerializeToString()]
    for start in range(0, len(fold.surface), REPLY_CHUNK):
        chunk = pb.GetSurfaceResponse()
        _add_nodes(chunk, fold, range(start, min(start + REPLY_CHUNK, len(fold.surface))))
        if detail is not None:
            for wire in chunk.nodes:
                wire.detail.route_tokens, wire.detail.shadow_tokens = detail(
                    fold.surface[wire.position]
                )
        parts.append(chunk.SerializeToString())
        yield
    return parts


def detail_parts_in_steps(
    head: pb.SurfaceDetail, shadowed: Sequence[Shadowed]
) -> Generator[None, None, list[bytes]]:
    """A ``GetSurfaceResponse`` holding only its ``detail``, serialized in pieces: ``head``
    (route, generations, anchor) with ``shadowed`` added in order, ``REPLY_CHUNK`` of them at a
    time with a pause (``yield``) after each. After ``surface_parts_in_steps``'s pieces, the
    response with both."""
    parts = [head.SerializeToString()]
    for start in range(0, len(shadowed), REPLY_CHUNK):
        chunk = pb.SurfaceDetail()
        for seq, (by, kind, compaction_id) in shadowed[start : start + REPLY_CHUNK]:
            chunk.shadowed.add(seq=seq, type=kind, shadowed_by_seq=by, compaction_id=compaction_id)
        parts.append(chunk.SerializeToString())
        yield
    return [_DETAIL_TAG, _varint(sum(len(part) for part in parts)), *parts]


def _varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _add_nodes(response: pb.GetSurfaceResponse, fold: SessionFold, positions: range) -> None:
    """Add the surface nodes at ``positions`` to ``response``, as the wire shows them."""
    for position in positions:
        node = fold.surface[position]
        event = node.event  # parsed once: a node keeps its event serialized
        message = project(event, fold.offloads.get(node.seq, frozenset()))
        wire = response.nodes.add(position=position, seq=node.seq, type=node.type)
        if message is not None:
            wire.message.CopyFrom(message)
        wire.source_event_seqs.extend(event.source_event_seqs)
        wire.compaction_id = ev.checkpoint_compaction_id(event)


def build_request(handle: SessionHandle) -> pb.BuildRequestResponse:
    """The reconstructed model request: derived messages plus the folded header."""
    fold = handle.fold
    response = _request_header(fold, declared_tools(handle))
    response.revision = fold.revision
    response.incarnation = handle.incarnation
    response.messages.extend(fold.messages())
    return response


def request_reply_in_steps(
    fold: SessionFold, declared: Sequence[ToolDeclaration] = (), incarnation: str = ""
) -> Generator[None, None, bytes]:
    """``build_request`` of the session of ``fold``, serialized, its messages made
    ``REPLY_CHUNK`` surface nodes at a time with a pause (``yield``) after each, then joined in a
    step of its own; ``declared``: compactd's own tools (``declared_tools``); ``incarnation``:
    the session's (``SessionHandle.incarnation``). The caller keeps the fold still (the
    session's lock)."""
    first_part = pb.BuildRequestResponse(revision=fold.revision, incarnation=incarnation)
    parts = [first_part.SerializeToString()]
    nodes = fold.surface.nodes
    parts += _head_and_pins(fold)  # the pinned-state message right after the system head
    first = 1 if fold.pins and fold.head_projects() else 0
    for start in range(first, len(nodes), REPLY_CHUNK):
        chunk = pb.BuildRequestResponse()
        add = chunk.messages.add
        for message in appended_messages(fold, nodes[start : start + REPLY_CHUNK]):
            add().CopyFrom(message)
        parts.append(chunk.SerializeToString())
        yield
    parts.append(_request_header(fold, declared).SerializeToString())
    return b"".join(parts)


async def request_in_steps(handle: SessionHandle) -> bytes:
    """``request_reply_in_steps`` of the session, compactd's own tools included, run on the loop
    (``in_steps``): the request's bytes, for a result that carries the request
    (``MergeFromString`` parses them in one call, a fraction of building the message on the
    loop). The caller holds the session's lock."""
    reply = request_reply_in_steps(handle.fold, declared_tools(handle), handle.incarnation)
    return await in_steps(reply)


def declared_tools(handle: SessionHandle) -> Sequence[ToolDeclaration]:
    """The tools compactd adds to the session's requests after the header's (the recall tool,
    when the policy turns it on), priced by the meter like the header's."""
    return handle.context.meter.declared_tools(handle.fold.header)


def _head_and_pins(fold: SessionFold) -> list[bytes]:
    """The serialized messages a request opens with when pins are in force: the system head's
    (when it projects to one), then the pinned-state message; none without pins."""
    pinned = fold.pins_message()
    if pinned is None:
        return []
    head = appended_messages(fold, fold.surface.nodes[:1]) if fold.head_projects() else []
    head.append(pinned)
    return [pb.BuildRequestResponse(messages=head).SerializeToString()]


def _request_header(
    fold: SessionFold, declared: Sequence[ToolDeclaration]
) -> pb.BuildRequestResponse:
    """A request's fields past its messages: the folded header's config, defaults and tools,
    then ``declared`` (compactd's own tools), and the pins in force."""
    response = pb.BuildRequestResponse(header_seq=fold.header_seq)
    response.pins.extend(pin_list(fold.pin_texts()))
    if fold.header is not None:
        if fold.header.HasField("config"):
            response.config.CopyFrom(fold.header.config)
        if fold.header.HasField("adapter_defaults"):
            response.adapter_defaults.CopyFrom(fold.header.adapter_defaults)
        response.tools.extend(fold.header.tools)
    response.tools.extend(declared)
    return response


def appended_messages(fold: SessionFold, nodes: Iterable[SurfaceNode]) -> list[Message]:
    """The messages ``nodes`` (appended surface nodes, in order) add to a request."""
    return derive_messages(((n.seq, n.event) for n in nodes), fold.offloads)
