"""Request-header fold: last snapshot wins, canonical comparison, and the recorded reason."""

from __future__ import annotations

import pytest

from compactd.core.fold import SessionFold
from compactd.core.header import HeaderReason, canonical, classify, same_request
from compactd.core.pairing import CorruptPairing
from compactd.v1 import events_pb2
from tests.builders import (
    SessionEvent,
    assistant,
    end_seed,
    header,
    replace,
    system,
    tool,
    tool_result,
    user,
)

INITIAL = events_pb2.HEADER_REASON_INITIAL
RESUME = events_pb2.HEADER_REASON_RESUME
CHANGE = events_pb2.HEADER_REASON_CHANGE
SERIES = events_pb2.HEADER_REASON_SERIES

READ, WRITE = tool("read", '{"type":"object"}'), tool("write", '{"type":"object"}')


def body(event: SessionEvent) -> events_pb2.RequestHeader:
    return event.request_header


def recorded(fold: SessionFold, event: SessionEvent) -> tuple[int, bool]:
    """Admit a header and return the reason and starts_series the fold recorded on it."""
    (stored,) = fold.admit([event]).events
    return stored.request_header.reason, stored.request_header.starts_series


# --- canonical form and comparison ------------------------------------------------------------


def test_empty_adapter_defaults_canonicalize_to_absent() -> None:
    with_empty = body(header("p", "m"))
    with_empty.adapter_defaults.SetInParent()
    assert with_empty.HasField("adapter_defaults")
    assert not canonical(with_empty).HasField("adapter_defaults")
    assert same_request(with_empty, body(header("p", "m")))


def test_empty_tools_and_empty_extra_settings_canonicalize_to_absent() -> None:
    with_empty = body(header("p", "m", tools=[]))
    with_empty.config.extra.SetInParent()
    assert not canonical(with_empty).config.HasField("extra")
    assert same_request(with_empty, body(header("p", "m")))


def test_non_empty_adapter_defaults_are_part_of_the_request() -> None:
    with_defaults = body(header("p", "m"))
    with_defaults.adapter_defaults.update({"stream": True})
    assert canonical(with_defaults).adapter_defaults["stream"] is True
    assert not same_request(with_defaults, body(header("p", "m")))


def test_reason_fields_do_not_make_a_header_different() -> None:
    a = body(header("p", "m", tools=[READ], reason=INITIAL))
    b = body(header("p", "m", tools=[READ], reason=SERIES))
    b.starts_series = True
    assert same_request(a, b)
    assert canonical(b).reason == events_pb2.HEADER_REASON_UNSPECIFIED
    assert not canonical(b).starts_series


def test_tools_compare_in_order() -> None:
    assert same_request(
        body(header("p", "m", tools=[READ, WRITE])), body(header("p", "m", tools=[READ, WRITE]))
    )
    assert not same_request(
        body(header("p", "m", tools=[READ, WRITE])), body(header("p", "m", tools=[WRITE, READ]))
    )


def test_a_tool_schema_byte_change_is_a_change() -> None:
    spaced = tool("read", '{"type": "object"}')
    assert not same_request(
        body(header("p", "m", tools=[READ])), body(header("p", "m", tools=[spaced]))
    )


# --- classify ---------------------------------------------------------------------------------


def test_classify_first_header_is_initial() -> None:
    proposed = body(header("p", "m"))
    assert classify(None, proposed, series_boundary=True) == HeaderReason(INITIAL)


@pytest.mark.parametrize(
    ("boundary", "resuming", "expected"),
    [
        (False, False, HeaderReason(CHANGE)),
        (True, False, HeaderReason(CHANGE, starts_series=True)),
        (False, True, HeaderReason(CHANGE)),
    ],
)
def test_classify_a_config_change(boundary: bool, resuming: bool, expected: HeaderReason) -> None:
    previous, proposed = body(header("p", "m")), body(header("p", "m2"))
    assert classify(previous, proposed, series_boundary=boundary, resuming=resuming) == expected


@pytest.mark.parametrize(
    ("boundary", "resuming", "expected"),
    [
        (True, False, HeaderReason(SERIES)),
        (True, True, HeaderReason(SERIES)),
        (False, True, HeaderReason(RESUME)),
        (False, False, None),
    ],
)
def test_classify_an_unchanged_header(
    boundary: bool, resuming: bool, expected: HeaderReason | None
) -> None:
    same = body(header("p", "m", tools=[READ]))
    assert classify(same, same, series_boundary=boundary, resuming=resuming) == expected


# --- the fold ---------------------------------------------------------------------------------


def test_the_last_snapshot_wins() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m1", tools=[READ]), user("a"), header("p", "m2")])
    assert fold.header is not None
    assert fold.header.config.model == "m2"
    assert list(fold.header.tools) == []
    assert fold.header_seq == 2


def test_folded_header_is_canonical() -> None:
    event = header("p", "m")
    event.request_header.adapter_defaults.SetInParent()
    fold = SessionFold()
    fold.admit([event])
    assert fold.header is not None
    assert not fold.header.HasField("adapter_defaults")


def test_no_header_folds_to_none() -> None:
    fold = SessionFold()
    fold.admit([system("s"), user("a")])
    assert fold.header is None


def test_first_header_is_recorded_initial() -> None:
    assert recorded(SessionFold(), header("p", "m")) == (INITIAL, False)


def test_changed_config_is_recorded_change() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m")])
    assert recorded(fold, header("p", "m-large")) == (CHANGE, False)


def test_reordered_tools_are_recorded_change() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m", tools=[READ, WRITE])])
    assert recorded(fold, header("p", "m", tools=[WRITE, READ])) == (CHANGE, False)


def test_unchanged_config_after_a_replacement_is_recorded_series() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m", tools=[READ]), user("a"), user("b")])
    fold.admit([replace(user("sum"), start=1, end=2, sources=[1, 2])])
    assert recorded(fold, header("p", "m", tools=[READ])) == (SERIES, False)


def test_a_prune_is_a_surface_replacement_and_starts_a_series() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m"), assistant(calls=[("c1", "t", "{}")]), tool_result("c1", "x")])
    fold.admit([replace(tool_result("c1", "[pruned]"), start=2, end=2, sources=[2])])
    assert recorded(fold, header("p", "m")) == (SERIES, False)


def test_a_series_is_recorded_once_per_replacement() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m"), user("a")])
    fold.admit([replace(user("sum"), start=1, end=1, sources=[1])])
    assert recorded(fold, header("p", "m")) == (SERIES, False)
    assert recorded(fold, header("p", "m2")) == (CHANGE, False)


def test_changed_config_after_a_replacement_is_recorded_change_starting_a_series() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m"), user("a"), user("b")])
    fold.admit([replace(user("sum"), start=1, end=2, sources=[1, 2])])
    assert recorded(fold, header("p", "m2")) == (CHANGE, True)


def test_unchanged_header_after_a_restore_is_recorded_resume() -> None:
    log = SessionFold().admit([header("p", "m"), user("a")]).events
    restored = SessionFold()
    restored.admit(log, check=False)
    seed = restored.admit([end_seed()])
    restored.restored_at = seed.first_seq
    assert recorded(restored, header("p", "m")) == (RESUME, False)


def test_a_header_logged_after_the_restore_boundary_is_not_a_resume_again() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m"), user("a")])
    fold.restored_at = fold.admit([end_seed()]).first_seq
    fold.admit([header("p", "m")])
    assert recorded(fold, header("p", "m2")) == (CHANGE, False)


def test_an_explicit_client_reason_is_kept() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m")])
    explicit = header("p", "m", reason=SERIES)
    explicit.request_header.starts_series = True
    assert recorded(fold, explicit) == (SERIES, True)
    assert recorded(fold, header("p", "m", reason=RESUME)) == (RESUME, False)


def test_rejected_batch_restores_the_previous_header() -> None:
    fold = SessionFold()
    fold.admit([header("p", "m")])
    with pytest.raises(CorruptPairing):
        fold.admit([header("p", "m2"), tool_result("nope", "x")])
    assert fold.header is not None
    assert fold.header.config.model == "m"
    assert fold.header_seq == 0
