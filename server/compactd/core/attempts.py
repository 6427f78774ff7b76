"""Bounded compaction attempts: which failed spans wait, and how many brackets a crossing gets.

**Failure memory.** A bracket that closes without committing is remembered per (span, summary
target, failure kind). A span's key names its nodes and their projections (``span_key``), so any
change to it (a node appended to it or replaced, an image offloaded) makes a new span. A known
failing span is not sent to the same target again until its backoff elapses: after the n-th
consecutive failure of one kind, ``backoffSeconds * 2 ** (n - 1)``, at most ``maxSeconds``. An
explicit request (``Compact``) is never held back; its failures are remembered like any other.

**Crossing budget.** A *threshold crossing* runs from the first step measured above the trigger to
the next one measured below it. It gets ``1 + compactionRetries`` brackets, committed or failed.
When they are spent and pressure is still above, the crossing is *exhausted*: it is reported once
and no bracket opens until a backoff elapses (the same formula, n counting the exhaustions of this
crossing), when the crossing gets a fresh budget. ``Compact`` ends the crossing.

Not remembered: a bracket whose span drifted (it changed anyway) or that was cancelled. The memory
is a plain value the caller keeps per session; time is passed in (seconds on any monotonic clock).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Final

from compactd.reasons import Reason

#: Close reasons that say nothing about the span or its summary target.
NOT_REMEMBERED: Final = frozenset({Reason.SPAN_DRIFT, Reason.CANCELLED})
MAX_ENTRIES: Final = 64


@dataclass(frozen=True, slots=True)
class Backoff:
    """``base * 2 ** (n - 1)`` seconds after the n-th failure, at most ``cap``."""

    base: float
    cap: float

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` consecutive failures (0 for none)."""
        if failures <= 0 or self.base <= 0:
            return 0.0
        return min(self.cap, self.base * 2.0 ** min(failures - 1, 62))


def span_key(seqs: Iterable[int], offloads: Mapping[int, Set[int]]) -> str:
    """A short identity of a span: its node seqs, in order, and their offloaded images."""
    digest = hashlib.blake2b(digest_size=16)
    for seq in seqs:
        marks = sorted(offloads.get(seq, ()))
        digest.update(f"{seq}:{','.join(map(str, marks))};".encode())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Hold:
    """Why a span is not sent to a target now."""

    reason: str  # the failure kind, e.g. SUMMARY_REJECTED
    failures: int  # consecutive failures of that kind
    retry_in: float  # seconds until the backoff elapses


@dataclass(slots=True)
class _Failures:
    count: int
    until: float
    touched: float


@dataclass(slots=True)
class Crossing:
    """One threshold crossing's budget.

    Attributes:
        brackets: Brackets opened in the current budget.
        exhaustions: How many times the budget ran out in this crossing.
        renew_at: When an exhausted crossing gets a fresh budget (None: not exhausted).
    """

    brackets: int = 0
    exhaustions: int = 0
    renew_at: float | None = None

    def may_open(self, budget: int, now: float) -> bool:
        """Whether a bracket may open now (a crossing whose backoff elapsed is renewed)."""
        if self.renew_at is not None and now >= self.renew_at:
            self.brackets, self.renew_at = 0, None
        return self.renew_at is None and self.brackets < budget

    def opened(self) -> None:
        """Count a bracket that opened (whatever its outcome)."""
        self.brackets += 1

    def exhaust(self, now: float, backoff: Backoff) -> bool:
        """Mark the spent budget; True the first time (the caller reports it then, only)."""
        if self.renew_at is not None:
            return False
        self.exhaustions += 1
        self.renew_at = now + backoff.delay(self.exhaustions)
        return True

    def retry_in(self, now: float) -> float:
        """Seconds until an exhausted crossing is renewed (0 when it is not exhausted)."""
        return max(0.0, self.renew_at - now) if self.renew_at is not None else 0.0


@dataclass
class AttemptLedger:
    """One session's failure memory and current crossing."""

    crossing: Crossing | None = None
    _failures: dict[tuple[str, str, str], _Failures] = field(default_factory=dict)

    def hold(self, span: str, target: str, now: float) -> Hold | None:
        """Why ``span`` must not be sent to ``target`` now, or None when it may."""
        held: Hold | None = None
        for (key_span, key_target, reason), entry in self._failures.items():
            if (key_span, key_target) != (span, target) or entry.until <= now:
                continue
            if held is None or entry.until - now > held.retry_in:
                held = Hold(reason, entry.count, entry.until - now)
        return held

    def remember(
        self, span: str, target: str, reason: str, now: float, backoff: Backoff
    ) -> float | None:
        """Record a failed bracket; the time its span may be sent again (None: not remembered)."""
        if reason in NOT_REMEMBERED or backoff.base <= 0:
            return None
        key = (span, target, reason)
        entry = self._failures.get(key)
        count = 1 if entry is None else entry.count + 1
        until = now + backoff.delay(count)
        self._failures[key] = _Failures(count, until, now)
        self._forget_oldest()
        return until

    def open_crossing(self) -> Crossing:
        """The current crossing, started now if there is none."""
        if self.crossing is None:
            self.crossing = Crossing()
        return self.crossing

    def close_crossing(self) -> None:
        """End the current crossing (pressure measured below, or an explicit ``Compact``)."""
        self.crossing = None

    def _forget_oldest(self) -> None:
        while len(self._failures) > MAX_ENTRIES:
            oldest = min(self._failures, key=lambda key: self._failures[key].touched)
            del self._failures[oldest]
