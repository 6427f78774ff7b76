"""Request-header fold: config, adapter defaults and tools for the next request.

The folded header is the last full ``request/header`` snapshot in the log prefix. Empty tools and
empty adapter defaults canonicalize to absent; tool declarations compare in order. A header's
``reason`` records why it was logged: INITIAL, RESUME, CHANGE, or SERIES when the surface was
replaced (or a new message series started) while config and tools stayed the same;
``starts_series`` marks a change that coincides with a new series.
"""

from __future__ import annotations

from dataclasses import dataclass

from compactd.v1 import events_pb2

RequestHeader = events_pb2.RequestHeader


def canonical(header: RequestHeader) -> RequestHeader:
    """A copy with the reason fields cleared and empty parts canonicalized to absent."""
    copy = RequestHeader()
    copy.CopyFrom(header)
    copy.reason = events_pb2.HEADER_REASON_UNSPECIFIED
    copy.starts_series = False
    if not copy.adapter_defaults.fields:
        copy.ClearField("adapter_defaults")
    if not copy.config.extra.fields:
        copy.config.ClearField("extra")
    if not copy.config.ListFields():
        copy.ClearField("config")
    return copy


def same_request(a: RequestHeader, b: RequestHeader) -> bool:
    """Whether two headers produce the same request besides messages (tools compared in order)."""
    return canonical(a).SerializeToString(deterministic=True) == canonical(b).SerializeToString(
        deterministic=True
    )


@dataclass(frozen=True, slots=True)
class HeaderReason:
    """The reason to record for a header, and whether it starts a series."""

    reason: events_pb2.HeaderReason.ValueType
    starts_series: bool = False


def classify(
    previous: RequestHeader | None,
    proposed: RequestHeader,
    *,
    series_boundary: bool,
    resuming: bool = False,
) -> HeaderReason | None:
    """The reason a ``proposed`` header should be logged after ``previous``; None if it need not be.

    ``series_boundary`` is true when the surface was replaced (or the runtime starts a new message
    series) since ``previous`` was logged; ``resuming`` when the session was just restored.
    """
    if previous is None:
        return HeaderReason(events_pb2.HEADER_REASON_INITIAL)
    if not same_request(previous, proposed):
        return HeaderReason(events_pb2.HEADER_REASON_CHANGE, starts_series=series_boundary)
    if series_boundary:
        return HeaderReason(events_pb2.HEADER_REASON_SERIES)
    if resuming:
        return HeaderReason(events_pb2.HEADER_REASON_RESUME)
    return None
