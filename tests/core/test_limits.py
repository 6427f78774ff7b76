"""Append limits: blocks, events and the surface are bounded so every read of a legal session
fits one message; JSON nesting and token counts are bounded for whatever parses them."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.api.status import code_for
from compactd.core.fold import SessionFold
from compactd.core.limits import MAX_TOKEN_COUNT, AppendLimits, json_depth, node_bytes
from compactd.core.projection import offload_placeholder, project
from compactd.core.validation import Origin, check_batch
from compactd.errors import InvalidArgument, ResourceExhausted
from compactd.reasons import Reason
from compactd.v1 import session_service_pb2
from tests.builders import (
    SessionEvent,
    assistant,
    compaction_start,
    header,
    image_block,
    in_step,
    offload,
    replace,
    text_block,
    tool,
    turn_start,
    user,
)

CLIENT = Origin.CLIENT
SMALL = AppendLimits(max_block_bytes=100, max_event_bytes=200, max_surface_bytes=1000)


def client_errors(events: list[SessionEvent], limits: AppendLimits = SMALL) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        check_batch(events, max_events=10, origin=CLIENT, limits=limits)
    return caught.value


# ---- JSON depth -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("", 0),
        ("42", 0),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"a": "[[[[[[[[ not nesting ]]]"}', 1),
        ('{"a": "escaped \\" [[[ quote"}', 1),
        ("[[[[", 4),  # invalid JSON still counts
        ("]]]][", 1),
        ('[ "unterminated [[[', 1),  # no parser reads past an unterminated string
        ('[ "ends in a backslash \\', 1),
    ],
)
def test_json_depth_counts_brackets_outside_strings(text: str, depth: int) -> None:
    assert json_depth(text) == depth


def test_json_depth_of_a_hostile_megabyte_needs_no_recursion() -> None:
    assert json_depth("[" * 1_000_000) == 1_000_000


def test_json_depth_of_an_unterminated_megabyte_string_is_linear() -> None:
    # Each escaped quote used to restart a scan of the rest: over an hour for this megabyte.
    assert json_depth('["' + '\\"' * 500_000 + "[[") == 1


@settings(max_examples=100)
@given(
    st.recursive(
        st.none() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=20,
    )
)
def test_json_depth_matches_the_nesting_of_real_json(value: object) -> None:
    import json

    def nesting(v: object) -> int:
        if isinstance(v, list):
            return 1 + max((nesting(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((nesting(x) for x in v.values()), default=0)
        return 0

    assert json_depth(json.dumps(value)) == nesting(value)


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (
            header("p", "m", tools=[tool("deep", "[" * 65 + "]" * 65)]),
            "events[0].request_header.tools[0].input_schema_json",
        ),
        (
            assistant(calls=[("c1", "run", '{"a":' * 65 + "1" + "}" * 65)]),
            "events[0].assistant_message.content[0].tool_call.arguments_json",
        ),
    ],
    ids=["tool-schema", "tool-call-arguments"],
)
def test_json_nested_past_the_limit_is_refused_for_every_origin(
    event: SessionEvent, field: str
) -> None:
    for origin in Origin:
        with pytest.raises(InvalidArgument) as caught:
            check_batch([event], max_events=10, origin=origin)
        (violation,) = caught.value.violations
        assert violation.field == field
        assert "at most 64 levels" in violation.description


def test_a_schema_nested_deeper_than_the_parser_allows_is_invalid_not_a_crash() -> None:
    limits = AppendLimits(max_json_depth=100_000)
    deep = header("p", "m", tools=[tool("deep", "[" * 50_000 + "]" * 50_000)])
    with pytest.raises(InvalidArgument) as caught:
        check_batch([deep], max_events=10, limits=limits)
    assert "not valid JSON" in caught.value.violations[0].description


# ---- token counts and numbers ---------------------------------------------------------------


@pytest.mark.parametrize("value", [MAX_TOKEN_COUNT + 1, 2**63 - 1, -1])
def test_usage_beyond_the_token_range_is_refused(value: int) -> None:
    event = assistant("ok")
    event.assistant_message.usage.input_tokens = value
    with pytest.raises(InvalidArgument) as caught:
        check_batch([event], max_events=10)
    assert caught.value.violations[0].field == "events[0].assistant_message.usage.input_tokens"


def test_usage_at_the_token_limit_is_accepted() -> None:
    event = assistant("ok")
    for name in ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens"):
        setattr(event.assistant_message.usage, name, MAX_TOKEN_COUNT)
    check_batch([event], max_events=10)


@pytest.mark.parametrize("value", [MAX_TOKEN_COUNT + 1, -5])
def test_an_output_reservation_beyond_the_token_range_is_refused(value: int) -> None:
    event = header("p", "m")
    event.request_header.config.max_output_tokens = value
    with pytest.raises(InvalidArgument) as caught:
        check_batch([event], max_events=10)
    assert caught.value.violations[0].field == "events[0].request_header.config.max_output_tokens"


def test_non_finite_header_numbers_are_refused_naming_each() -> None:
    event = header("p", "m")
    config = event.request_header.config
    config.temperature = float("nan")
    config.extra.update({"ok": 1, "nested": {"deep": [1, float("inf")]}})
    event.request_header.adapter_defaults.update({"x": float("-inf")})
    with pytest.raises(InvalidArgument) as caught:
        check_batch([event], max_events=10)
    assert [v.field for v in caught.value.violations] == [
        "events[0].request_header.config.temperature",
        "events[0].request_header.config.extra.nested.deep[1]",
        "events[0].request_header.adapter_defaults.x",
    ]


# ---- blocks and events --------------------------------------------------------------------------


def test_a_block_over_the_limit_is_event_too_large() -> None:
    error = client_errors([user("fine"), user("x" * 120)])
    assert error.reason == Reason.EVENT_TOO_LARGE
    assert [v.field for v in error.violations] == ["events[1].user_message.content[0]"]


def test_an_event_over_the_limit_is_event_too_large() -> None:
    error = client_errors([user(blocks=[image_block("x" * 60) for _ in range(4)])])
    assert error.reason == Reason.EVENT_TOO_LARGE
    assert [v.field for v in error.violations] == ["events[0]"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 160), min_size=1, max_size=4), min_size=1, max_size=4),
    st.integers(1, 150),
    st.integers(1, 400),
)
def test_every_oversized_block_and_event_is_named_as_a_check_of_each_would_name_it(
    texts: list[list[int]], max_block: int, max_event: int
) -> None:
    events = [user(blocks=[text_block("x" * n) for n in sizes]) for sizes in texts]
    limits = AppendLimits(max_block_bytes=max_block, max_event_bytes=max_event)
    expected = []
    for i, event in enumerate(events):
        if event.ByteSize() > max_event:
            expected.append(f"events[{i}]")
        blocks = event.user_message.content
        expected += [
            f"events[{i}].user_message.content[{k}]"
            for k, b in enumerate(blocks)
            if b.ByteSize() > max_block
        ]
    if not expected:
        check_batch(events, max_events=10, origin=CLIENT, limits=limits)
        return
    error = client_errors(events, limits)
    assert error.reason == Reason.EVENT_TOO_LARGE
    assert [v.field for v in error.violations] == expected


def test_a_server_only_event_is_refused_before_an_oversized_one() -> None:
    error = client_errors([user("x" * 300), compaction_start("k")])
    assert error.reason == Reason.SERVER_ONLY_EVENT
    assert [v.field for v in error.violations] == ["events[1].compaction_start"]


def test_an_oversized_event_is_refused_before_a_malformed_one() -> None:
    malformed = user("fine")
    malformed.seq = 4
    error = client_errors([malformed, user("x" * 120)])
    assert error.reason == Reason.EVENT_TOO_LARGE
    assert [v.field for v in error.violations] == ["events[1].user_message.content[0]"]


def test_sizes_bound_client_batches_only() -> None:
    check_batch([user("x" * 120)], max_events=10, origin=Origin.SERVER, limits=SMALL)


# ---- the surface --------------------------------------------------------------------------------


def test_node_bytes_bound_the_projected_node() -> None:
    event = user("look", blocks=[image_block("shot.png", path="/a/shot.png"), image_block("b")])
    for offloaded in (frozenset(), frozenset({0}), frozenset({0, 1})):
        message = project(event, offloaded)
        assert message is not None
        node = session_service_pb2.SurfaceNode(
            position=2**40, seq=2**40, type="user/message", message=message, compaction_id="k" * 32
        )
        assert node.ByteSize() <= node_bytes(event, offloaded)
    placeholder = offload_placeholder(event.user_message.content[1].image)
    assert node_bytes(event, {0}) > node_bytes(event) + len(placeholder)


def surface_of(*events: SessionEvent) -> SessionFold:
    fold = SessionFold()
    fold.admit(list(events), origin=CLIENT, max_surface_bytes=10_000)
    return fold


def test_the_fold_counts_current_nodes_and_the_header() -> None:
    fold = surface_of(user("a" * 100), header("p", "m", tools=[tool("read")]))
    expected = node_bytes(fold.surface[0].event) + fold.header.ByteSize()  # type: ignore[union-attr]
    assert fold.surface_bytes == expected
    fold.admit([replace(user("s"), start=0, end=0, sources=[0])], origin=CLIENT)
    assert fold.surface_bytes == node_bytes(fold.surface[0].event) + fold.header.ByteSize()  # type: ignore[union-attr]


def test_a_batch_growing_the_surface_past_its_limit_is_surface_full() -> None:
    fold = SessionFold()
    fold.admit([user("a" * 400)], origin=CLIENT, max_surface_bytes=1000)
    before = (fold.revision, fold.surface_bytes)
    with pytest.raises(ResourceExhausted) as caught:
        fold.admit([user("b" * 300), user("c" * 300)], origin=CLIENT, max_surface_bytes=1000)
    assert caught.value.reason == Reason.SURFACE_FULL
    assert caught.value.metadata["limit"] == "1000"
    assert code_for(caught.value).name == "RESOURCE_EXHAUSTED"
    assert (fold.revision, fold.surface_bytes) == before


def test_an_over_full_surface_may_still_shrink() -> None:
    fold = SessionFold()
    fold.admit([user("a" * 900), user("b" * 900)])  # the server's own appends are not bounded
    fold.admit(
        [replace(user("short"), start=0, end=1, sources=[0, 1])],
        origin=CLIENT,
        max_surface_bytes=1000,
    )
    assert fold.surface_bytes < 1000


def test_an_offload_reprices_its_node() -> None:
    fold = SessionFold()
    fold.admit([user("see", blocks=[image_block("plot.png", path="/att/plot.png")])])
    before = fold.surface_bytes
    fold.admit([offload({0: [0]})])
    assert fold.surface_bytes == node_bytes(fold.surface[0].event, {0}) > before


def test_log_only_events_cost_the_surface_nothing() -> None:
    fold = surface_of(turn_start(1), *in_step(1, 1, assistant("hi")))
    assert fold.surface_bytes == node_bytes(fold.surface[0].event)


def test_struct_numbers_are_checked_at_any_depth() -> None:
    struct = struct_pb2.Struct()
    struct.update({"a": [{"b": float("nan")}]})
    event = header("p", "m")
    event.request_header.config.extra.CopyFrom(struct)
    with pytest.raises(InvalidArgument):
        check_batch([event], max_events=10)
