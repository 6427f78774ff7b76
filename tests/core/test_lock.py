"""The log-recorded compaction lock: live brackets, stale crash evidence, matching ends."""

from __future__ import annotations

import pytest

from compactd.core.fold import SessionFold
from compactd.core.lock import LiveBracket, LockState, live_bracket, stale_brackets
from compactd.errors import CompactionBusy, InvalidArgument
from tests.builders import SessionEvent, compaction_end, compaction_start, end_seed, user


def lock_of(*events: SessionEvent) -> LockState:
    """The lock folded from ``events`` at seqs 0, 1, 2, ..."""
    state = LockState()
    for seq, event in enumerate(events):
        state.apply(event, seq)
    return state


def test_no_bracket_means_not_busy() -> None:
    state = lock_of(user("a"))
    assert live_bracket(state) is None
    assert stale_brackets(state) == []


def test_unmatched_start_is_the_live_bracket() -> None:
    assert live_bracket(lock_of(user("a"), compaction_start("k1"))) == LiveBracket("k1", 1)


def test_matched_start_releases_the_lock() -> None:
    assert live_bracket(lock_of(compaction_start("k1"), compaction_end("k1"))) is None


def test_a_failed_close_still_releases_the_lock() -> None:
    assert live_bracket(lock_of(compaction_start("k1"), compaction_end("k1", "boom"))) is None


def test_unmatched_start_before_the_newest_end_seed_is_stale_and_does_not_block() -> None:
    state = lock_of(compaction_start("k1"), end_seed())
    assert live_bracket(state) is None
    assert stale_brackets(state) == [LiveBracket("k1", 0)]


def test_only_the_newest_end_seed_is_the_boundary() -> None:
    state = lock_of(end_seed(), compaction_start("k1"), end_seed(), compaction_start("k2"))
    assert live_bracket(state) == LiveBracket("k2", 3)
    assert stale_brackets(state) == [LiveBracket("k1", 1)]


def test_the_latest_unmatched_start_after_the_boundary_is_reported() -> None:
    state = lock_of(end_seed(), compaction_start("k1"), compaction_start("k2"))
    assert live_bracket(state) == LiveBracket("k2", 2)


def test_lock_copy_is_independent() -> None:
    state = lock_of(compaction_start("k1"))
    copy = state.copy()
    copy.apply(compaction_end("k1"), 1)
    assert live_bracket(state) == LiveBracket("k1", 0)
    assert live_bracket(copy) is None


# --- through the fold -------------------------------------------------------------------------


def test_a_second_start_while_one_is_live_is_busy() -> None:
    fold = SessionFold()
    fold.admit([user("a"), compaction_start("k1")])
    with pytest.raises(CompactionBusy, match="k1") as caught:
        fold.admit([user("b"), compaction_start("k2")])
    assert caught.value.reason == "COMPACTION_BUSY"
    assert caught.value.metadata == {"compaction_id": "k1", "start_seq": "1"}
    assert fold.revision == 2
    assert live_bracket(fold.lock) == LiveBracket("k1", 1)


def test_a_start_after_the_end_releases_the_lock_is_admitted() -> None:
    fold = SessionFold()
    fold.admit([compaction_start("k1"), compaction_end("k1"), compaction_start("k2")])
    assert live_bracket(fold.lock) == LiveBracket("k2", 2)


def test_a_stale_start_before_an_end_seed_does_not_block_a_new_start() -> None:
    fold = SessionFold()
    fold.admit([compaction_start("k1"), end_seed()])
    fold.admit([compaction_start("k2")])
    assert live_bracket(fold.lock) == LiveBracket("k2", 2)
    assert stale_brackets(fold.lock) == [LiveBracket("k1", 0)]


def test_a_restored_live_start_blocks_until_an_end_seed() -> None:
    log = SessionFold().admit([user("a"), compaction_start("k1")]).events
    restored = SessionFold()
    restored.admit(log, check=False)
    with pytest.raises(CompactionBusy):
        restored.admit([compaction_start("k2")])
    restored.admit([end_seed(), compaction_start("k2")])
    assert live_bracket(restored.lock) == LiveBracket("k2", 3)


@pytest.mark.parametrize(
    "history",
    [[], [compaction_start("k1"), compaction_end("k1")]],
    ids=["never_started", "already_closed"],
)
def test_an_end_that_matches_no_open_start_is_rejected(history: list[SessionEvent]) -> None:
    fold = SessionFold()
    fold.admit([user("a"), *history])
    with pytest.raises(InvalidArgument, match="names no open compaction/start") as caught:
        fold.admit([compaction_end("k1")])
    assert caught.value.violations[0].field.endswith("].compaction_end.compaction_id")
    assert fold.revision == 1 + len(history)


def test_an_end_may_close_a_stale_start() -> None:
    fold = SessionFold()
    fold.admit([compaction_start("k1"), end_seed(), compaction_end("k1")])
    assert stale_brackets(fold.lock) == []


def test_a_start_reusing_an_open_compaction_id_is_rejected() -> None:
    fold = SessionFold()
    fold.admit([compaction_start("k1"), end_seed()])
    with pytest.raises(InvalidArgument, match="a compaction id is used once"):
        fold.admit([compaction_start("k1")])


def test_a_busy_batch_leaves_the_lock_unchanged() -> None:
    fold = SessionFold()
    fold.admit([compaction_start("k1")])
    with pytest.raises(CompactionBusy):
        fold.admit(
            [compaction_end("k1"), end_seed(), compaction_start("k2"), compaction_start("k3")]
        )
    assert live_bracket(fold.lock) == LiveBracket("k1", 0)
    assert fold.lock.last_end_seed == -1
