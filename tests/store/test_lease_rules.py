"""The lease rules (``store.leases.apply``) as a property: fencing holds for any history."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from compactd import errors
from compactd.store.leases import Lease, LeaseAction, LeaseOp, apply

START = datetime(2026, 1, 1, tzinfo=UTC)

steps = st.lists(
    st.tuples(
        st.sampled_from(list(LeaseAction)),
        st.sampled_from(["a", "b", "c"]),  # owners
        st.sampled_from(["k1", "k2", "k3"]),  # tokens (brackets)
        st.floats(0, 3),  # seconds the clock moves before the step
    ),
    max_size=40,
)


@given(steps)
def test_a_broken_or_taken_lease_never_accepts_its_old_holders_writes(
    history: list[tuple[LeaseAction, str, str, float]],
) -> None:
    lease: Lease | None = None
    now = START
    lost: set[tuple[str, str]] = set()  # (owner, token) whose lease another took or broke
    for action, owner, token, wait in history:
        now += timedelta(seconds=wait)
        op = LeaseOp(action, owner, token, ttl_s=1.0)
        before = lease
        try:
            lease = apply("s", lease, op, now)
        except (errors.Fenced, errors.CompactionBusy):
            assert lease is before
            continue
        if action in (LeaseAction.HOLD, LeaseAction.RELEASE):
            # Accepted writes come only from the lease's current holder, never a fenced one.
            assert before is not None
            assert (before.owner, before.token) == (owner, token)
            assert (owner, token) not in lost
        if action is LeaseAction.ACQUIRE and before is not None:
            # A live lease of another bracket is never taken; an expired one is lost for good.
            assert before.token == token or before.expires <= now
            if (before.owner, before.token) != (owner, token):
                lost.add((before.owner, before.token))
        if action in (LeaseAction.BREAK, LeaseAction.CLEAR) and before is not None:
            assert action is LeaseAction.CLEAR or before.expires <= now
            lost.add((before.owner, before.token))
        if lease is not None:
            lost.discard((lease.owner, lease.token))


def test_a_whole_bracket_in_one_batch_holds_nothing_and_waits_for_a_live_lease() -> None:
    live = apply("s", None, LeaseOp(LeaseAction.ACQUIRE, "a", "k1", ttl_s=1.0), START)
    whole = LeaseOp(LeaseAction.WHOLE, "b", "k2")
    try:
        apply("s", live, whole, START)
    except errors.CompactionBusy:
        pass
    else:
        raise AssertionError("a whole bracket went through another's live lease")
    assert apply("s", live, whole, START + timedelta(seconds=2)) is None  # lapsed: taken over
    assert apply("s", None, whole, START) is None
