"""Shape rules for a batch: each violation names the field it is about."""

from __future__ import annotations

import pytest

from compactd.core.validation import MAX_EVENT_ID_LENGTH, check_batch
from compactd.errors import FieldViolation, InvalidArgument
from compactd.v1 import events_pb2
from tests.builders import (
    SessionEvent,
    assistant,
    compaction_start,
    header,
    offload,
    replace,
    tool,
    tool_result,
    turn_start,
    user,
)


def violations(events: list[SessionEvent], max_events: int = 100) -> list[FieldViolation]:
    """The violations ``check_batch`` reports (it must raise)."""
    with pytest.raises(InvalidArgument) as caught:
        check_batch(events, max_events=max_events)
    assert caught.value.reason == "INVALID_ARGUMENT"
    assert caught.value.violations
    return list(caught.value.violations)


def fields(events: list[SessionEvent], max_events: int = 100) -> list[str]:
    return [v.field for v in violations(events, max_events)]


def test_a_well_formed_batch_passes() -> None:
    batch = [
        user("a"),
        assistant(calls=[("c1", "read", "{}")]),
        tool_result("c1", "x"),
        replace(user("sum"), start=0, end=2, sources=[0, 1, 2]),
        header("p", "m", tools=[tool("read", '{"type":"object"}')]),
        turn_start(1),
        offload({0: [0]}),
    ]
    check_batch(batch, max_events=10)


def test_a_seq_set_by_the_client_is_rejected() -> None:
    event = user("a")
    event.seq = 5
    (violation,) = violations([user("ok"), event])
    assert violation.field == "events[1].seq"
    assert "assigned by the server" in violation.description


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [(253_402_300_800, 0), (-62_135_596_801, 0), (2**62, 0), (1, 1_000_000_000), (1, -1)],
)
def test_a_time_outside_the_timestamp_range_is_rejected(seconds: int, nanos: int) -> None:
    event = user("a")
    event.time.seconds, event.time.nanos = seconds, nanos
    (violation,) = violations([event])
    assert violation.field == "events[0].time"


@pytest.mark.parametrize(
    ("seconds", "nanos"), [(253_402_300_799, 999_999_999), (-62_135_596_800, 0), (0, 0)]
)
def test_a_time_at_the_ends_of_the_timestamp_range_is_accepted(seconds: int, nanos: int) -> None:
    event = user("a")
    event.time.seconds, event.time.nanos = seconds, nanos
    check_batch([event], max_events=1)


def test_unknown_enum_values_are_rejected_with_their_field() -> None:
    surface = user("a")
    surface.surface_op.kind = 9  # type: ignore[assignment]  # what a newer or hostile peer sends
    reason = header("p", "m")
    reason.request_header.reason = 99  # type: ignore[assignment]
    assert fields([surface, reason]) == [
        "events[0].surface_op.kind",
        "events[1].request_header.reason",
    ]


def test_an_event_without_a_body_is_rejected() -> None:
    assert fields([SessionEvent(event_id="x")]) == ["events[0].body"]


def test_log_only_event_carrying_a_surface_op_is_rejected() -> None:
    event = turn_start(1)
    event.surface_op.kind = events_pb2.SURFACE_OP_KIND_APPEND
    (violation,) = violations([event])
    assert violation.field == "events[0].surface_op"
    assert "turn/start is log-only" in violation.description


def test_log_only_event_carrying_source_event_seqs_is_rejected() -> None:
    event = compaction_start("k1")
    event.source_event_seqs.append(0)
    (violation,) = violations([user("a"), event])
    assert violation.field == "events[1].source_event_seqs"
    assert "compaction/start is log-only" in violation.description


def test_an_oversized_batch_is_rejected() -> None:
    (violation,) = violations([user(str(i)) for i in range(4)], max_events=3)
    assert violation.field == "events"
    assert "at most 3 events, got 4" in violation.description


def test_an_empty_batch_is_rejected() -> None:
    assert fields([]) == ["events"]


def test_duplicate_event_ids_in_a_batch_are_rejected() -> None:
    a, b, c = user("a"), user("b"), user("c")
    a.event_id, b.event_id, c.event_id = "x", "y", "x"
    (violation,) = violations([a, b, c])
    assert violation.field == "events[2].event_id"
    assert "repeats events[0]" in violation.description


def test_an_overlong_event_id_is_rejected() -> None:
    event = user("a")
    event.event_id = "i" * (MAX_EVENT_ID_LENGTH + 1)
    assert fields([event]) == ["events[0].event_id"]


def test_a_tool_schema_that_is_not_json_is_rejected() -> None:
    event = header("p", "m", tools=[tool("read", "{}"), tool("write", "{not json")])
    (violation,) = violations([user("a"), event])
    assert violation.field == "events[1].request_header.tools[1].input_schema_json"
    assert "not valid JSON" in violation.description


def test_a_tool_without_a_name_or_with_a_repeated_name_is_rejected() -> None:
    event = header("p", "m", tools=[tool("read"), tool(""), tool("read")])
    assert fields([event]) == [
        "events[0].request_header.tools[1].name",
        "events[0].request_header.tools[2].name",
    ]


def test_append_carrying_range_endpoints_is_rejected() -> None:
    event = user("a")
    event.surface_op.kind = events_pb2.SURFACE_OP_KIND_APPEND
    event.surface_op.end_seq = 3
    assert fields([event]) == ["events[0].surface_op"]


def test_replace_with_a_negative_endpoint_is_rejected() -> None:
    assert fields([replace(user("x"), start=-1, end=0, sources=[0])]) == ["events[0].surface_op"]


def test_a_tool_result_must_name_its_call() -> None:
    assert fields([tool_result("", "x")]) == ["events[0].tool_result.tool_call_id"]


def test_a_tool_call_block_needs_an_id_and_a_name() -> None:
    assert fields([assistant(calls=[("", "", "{}")])]) == [
        "events[0].assistant_message.content[0].tool_call.id",
        "events[0].assistant_message.content[0].tool_call.name",
    ]


def test_a_content_block_must_set_a_kind() -> None:
    event = user("a")
    event.user_message.content.add()
    assert fields([event]) == ["events[0].user_message.content[1]"]


def test_a_compaction_event_needs_its_id() -> None:
    assert fields([compaction_start("")]) == ["events[0].compaction_start.compaction_id"]


@pytest.mark.parametrize("indexes", [[], [-1]], ids=["empty", "negative"])
def test_offload_image_indexes_must_be_non_empty_and_non_negative(indexes: list[int]) -> None:
    assert fields([offload({0: indexes})]) == ["events[0].image_offload.targets[0].image_indexes"]


def test_every_violation_in_the_batch_is_reported_in_order() -> None:
    seq_set = user("a")
    seq_set.seq = 1
    bad_log_only = turn_start(1)
    bad_log_only.source_event_seqs.append(0)
    found = fields([seq_set, user("fine"), bad_log_only, SessionEvent()])
    assert found == ["events[0].seq", "events[2].source_event_seqs", "events[3].body"]


def test_the_message_summarizes_the_violations() -> None:
    event = user("a")
    event.seq = 3
    with pytest.raises(InvalidArgument, match=r"malformed events: events\[0\]\.seq"):
        check_batch([event], max_events=10)
