"""The shared helpers every backend relies on: type strings and batch checks."""

from __future__ import annotations

import pytest

from compactd import errors
from compactd.store.base import encode_batch, encode_batch_in_steps, event_type
from compactd.v1 import events_pb2

from .builders import batch, user_event, varied_events

_BODY_FIELDS = [f.name for f in events_pb2.SessionEvent.DESCRIPTOR.oneofs_by_name["body"].fields]


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        ("system_message", "system/message"),
        ("tool_result", "tool/result"),
        ("turn_start", "turn/start"),
        ("request_header", "request/header"),
        ("compaction_summary", "compaction/summary"),
        ("compaction_summary_error", "compaction/summary-error"),
        ("image_offload", "image/offload"),
        ("session_end_seed", "session/end-seed"),
        ("llm_retry", "llm/retry"),
    ],
)
def test_event_type_is_the_spec_name_of_the_body(field: str, expected: str) -> None:
    event = events_pb2.SessionEvent()
    getattr(event, field).SetInParent()

    assert event_type(event) == expected


def test_every_body_kind_has_a_distinct_type() -> None:
    types = set()
    for field in _BODY_FIELDS:
        event = events_pb2.SessionEvent()
        getattr(event, field).SetInParent()
        types.add(event_type(event))

    assert len(types) == len(_BODY_FIELDS)


def test_encode_batch_keeps_ids_types_and_deterministic_bytes() -> None:
    events = [user_event(4, "a"), user_event(5)]

    rows = encode_batch(events)

    assert [(r.seq, r.event_id, r.type) for r in rows] == [
        (4, "a", "user/message"),
        (5, None, "user/message"),
    ]
    assert rows[0].data == events[0].SerializeToString(deterministic=True)


def test_encode_batch_accepts_an_empty_batch() -> None:
    assert encode_batch([]) == []


def test_encode_batch_names_the_first_out_of_order_seq() -> None:
    events = batch(3, 3)
    events[2].seq = 9

    with pytest.raises(errors.InvalidArgument) as caught:
        encode_batch(events)

    assert caught.value.violations[0].field == "events[2].seq"


def test_encoding_a_batch_in_steps_pauses_between_events_and_gives_encode_batchs_rows() -> None:
    events = varied_events(0)
    steps = encode_batch_in_steps(events)
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            rows = done.value
            break
        pauses += 1
    assert pauses == len(events) - 1
    assert rows == encode_batch(events)
