"""Read models of a session: its surface and its reconstructed request, as the wire shows them."""

from __future__ import annotations

from collections.abc import Iterable

from compactd.core import events as ev
from compactd.core.fold import SessionFold
from compactd.core.projection import Message, derive_messages, project
from compactd.core.surface import SurfaceNode
from compactd.service.sessions import SessionHandle
from compactd.v1 import session_service_pb2 as pb


def surface_response(handle: SessionHandle) -> pb.GetSurfaceResponse:
    """The current surface of a session, as the wire shows it."""
    fold = handle.fold
    nodes = []
    for position, node in enumerate(fold.surface):
        event = node.event  # parsed once: a node keeps its event serialized
        message = project(event, fold.offloads.get(node.seq, frozenset()))
        nodes.append(
            pb.SurfaceNode(
                position=position,
                seq=node.seq,
                type=node.type,
                message=message,
                source_event_seqs=event.source_event_seqs,
                compaction_id=ev.checkpoint_compaction_id(event),
            )
        )
    return pb.GetSurfaceResponse(revision=fold.revision, nodes=nodes)


def build_request(handle: SessionHandle) -> pb.BuildRequestResponse:
    """The reconstructed model request: derived messages plus the folded header."""
    fold = handle.fold
    response = pb.BuildRequestResponse(
        revision=fold.revision, messages=fold.messages(), header_seq=fold.header_seq
    )
    if fold.header is not None:
        if fold.header.HasField("config"):
            response.config.CopyFrom(fold.header.config)
        if fold.header.HasField("adapter_defaults"):
            response.adapter_defaults.CopyFrom(fold.header.adapter_defaults)
        response.tools.extend(fold.header.tools)
    # compactd's own tools (the recall tool), priced by the meter like the header's.
    response.tools.extend(handle.context.meter.declared_tools(fold.header))
    return response


def appended_messages(fold: SessionFold, nodes: Iterable[SurfaceNode]) -> list[Message]:
    """The messages ``nodes`` (appended surface nodes, in order) add to a request."""
    return derive_messages(((n.seq, n.event) for n in nodes), fold.offloads)
