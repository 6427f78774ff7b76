"""Failure memory: the same work is never done twice with the same result.

A bracket that closes without committing is remembered per (span, summary target, failure kind).
A span's key names its nodes and their projections (``span_key``), so any change to it (a node
appended to it or replaced, an image offloaded) makes a new span: new history is new work. A
known failing span is not sent to the same target again:

- after a failure of the span or its summary (``SUMMARY_REJECTED``, ``SUMMARY_TRUNCATED``,
  ``SUMMARY_NOT_SMALLER``, a provider refusing the request, ...) never, while the span stays
  the same: the same request would get the same answer;
- after a transient failure of the provider (``reasons.TRANSIENT``: a timeout, a rate limit, an
  outage) once its backoff elapses: after the n-th consecutive failure of one kind,
  ``backoffSeconds * 2 ** (n - 1)``, at most ``maxSeconds``.

An explicit request (``Compact``) is never held back; its failures are remembered like any other.
Not remembered: a bracket whose span drifted (it changed anyway) or that was cancelled, and
nothing at all with a backoff of 0 (memory off). The memory is a plain value the caller keeps
per session; time is passed in (seconds on any monotonic clock).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Final

from compactd.reasons import TRANSIENT, Reason

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
    retry_in: float  # seconds until the backoff elapses (``math.inf``: until the span changes)


@dataclass(slots=True)
class _Failures:
    count: int
    until: float
    touched: float


@dataclass
class AttemptLedger:
    """One session's failure memory."""

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
        until = now + backoff.delay(count) if reason in TRANSIENT else math.inf
        self._failures[key] = _Failures(count, until, now)
        self._forget_oldest()
        return until

    def _forget_oldest(self) -> None:
        while len(self._failures) > MAX_ENTRIES:
            oldest = min(self._failures, key=lambda key: self._failures[key].touched)
            del self._failures[oldest]
