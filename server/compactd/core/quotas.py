"""Per-tenant quotas: what each tenant may hold and how fast it may append.

Four quotas, each counted per tenant (``compactd.tenancy``) and each off when its limit is 0:

- ``streams``: response streams open at once (``ListEvents`` follow, ``WatchPressure``, ...);
- ``appends_per_second``: ``AppendEvents`` calls, by a token bucket that holds at most
  ``append_burst`` calls and refills at the rate; a refusal says when the next call fits (the
  shell lets a call wait a little for its token first: ``service.quotas``);
- ``sessions``: sessions the tenant owns;
- ``bytes``: bytes of the tenant's logs (each event's serialized size).

``QuotaLedger`` is the pure part: limits, usage and the buckets, given the time by its caller.
Every admission is a check and a count in one step (no await between them), so concurrent calls
cannot both take the last unit. A refusal is a ``Refusal`` value; the shell
(``compactd.service.quotas``) turns it into RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Final

UNLIMITED: Final = 0


class Quota(StrEnum):
    """The quotas a tenant is held to (the names of the settings)."""

    STREAMS = "max_streams"
    APPENDS = "appends_per_second"
    SESSIONS = "max_sessions"
    BYTES = "max_bytes"


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """One tenant's limits; 0 turns a quota off.

    Attributes:
        max_streams: Response streams open at once.
        appends_per_second: Sustained ``AppendEvents`` calls per second.
        append_burst: Calls the bucket holds (0: the rate rounded up, at least 1).
        max_sessions: Sessions owned.
        max_bytes: Bytes of the logs owned.
    """

    max_streams: int = UNLIMITED
    appends_per_second: float = UNLIMITED
    append_burst: int = UNLIMITED
    max_sessions: int = UNLIMITED
    max_bytes: int = UNLIMITED

    @property
    def burst(self) -> float:
        """The bucket's capacity in calls."""
        if self.append_burst:
            return float(self.append_burst)
        return float(max(1, math.ceil(self.appends_per_second)))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a tenant was refused: the quota, its limit, what is in use, when to retry.

    ``retry_after`` (seconds) is set for the rate only: a held quota frees when the tenant
    closes a stream or deletes a session, which no clock can promise.
    """

    tenant: str
    quota: Quota
    limit: float
    used: float
    retry_after: float | None = None


@dataclass(slots=True)
class TokenBucket:
    """A token bucket: ``burst`` tokens at most, refilled at ``rate`` per second."""

    rate: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float, cost: float = 1.0) -> float:
        """Take ``cost`` tokens: 0.0 when taken, else the seconds until they would be there."""
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
        self.updated = max(self.updated, now)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate


@dataclass(slots=True)
class TenantUsage:
    """What one tenant holds now, and its append bucket (made on its first append)."""

    streams: int = 0
    sessions: int = 0
    bytes: int = 0
    bucket: TokenBucket | None = None


@dataclass
class QuotaLedger:
    """Limits and usage of every tenant seen, keyed by tenant id.

    Args:
        default: The limits of a tenant without overrides.
        overrides: Limits by tenant id (whole ``QuotaLimits``: merge with ``with_overrides``).
    """

    default: QuotaLimits = field(default_factory=QuotaLimits)
    overrides: Mapping[str, QuotaLimits] = field(default_factory=dict)
    usage: dict[str, TenantUsage] = field(default_factory=dict)

    def limits(self, tenant: str) -> QuotaLimits:
        """The limits ``tenant`` is held to."""
        return self.overrides.get(tenant, self.default)

    def of(self, tenant: str) -> TenantUsage:
        """The usage of ``tenant`` (zero for a tenant not seen before)."""
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
        return usage

    def seed(self, tenant: str, *, sessions: int, stored_bytes: int) -> None:
        """Start ``tenant``'s held quotas from what the store already holds for it."""
        usage = self.of(tenant)
        usage.sessions, usage.bytes = sessions, stored_bytes

    def open_stream(self, tenant: str) -> Refusal | None:
        """Count one more open stream, or refuse it."""
        limit, usage = self.limits(tenant).max_streams, self.of(tenant)
        if limit and usage.streams >= limit:
            return Refusal(tenant, Quota.STREAMS, limit, usage.streams)
        usage.streams += 1
        return None

    def close_stream(self, tenant: str) -> None:
        """One stream of ``tenant`` ended."""
        usage = self.of(tenant)
        usage.streams = max(0, usage.streams - 1)

    def take_append(self, tenant: str, now: float) -> Refusal | None:
        """Take one append from ``tenant``'s bucket at time ``now`` (seconds), or refuse it."""
        limits, usage = self.limits(tenant), self.of(tenant)
        rate = limits.appends_per_second
        if not rate:
            return None
        bucket = usage.bucket
        if bucket is None or bucket.rate != rate or bucket.burst != limits.burst:
            bucket = usage.bucket = TokenBucket(rate, limits.burst, limits.burst, now)
        wait = bucket.take(now)
        if not wait:
            return None
        return Refusal(tenant, Quota.APPENDS, rate, rate, retry_after=wait)

    def reserve_session(self, tenant: str) -> Refusal | None:
        """Count one more session (release it if the create fails), or refuse it."""
        limit, usage = self.limits(tenant).max_sessions, self.of(tenant)
        if limit and usage.sessions >= limit:
            return Refusal(tenant, Quota.SESSIONS, limit, usage.sessions)
        usage.sessions += 1
        return None

    def release_session(self, tenant: str, count: int = 1) -> None:
        """``count`` sessions of ``tenant`` are gone (or were never created)."""
        usage = self.of(tenant)
        usage.sessions = max(0, usage.sessions - count)

    def reserve_bytes(self, tenant: str, size: int, *, enforce: bool = True) -> Refusal | None:
        """Count ``size`` more stored bytes, or refuse them when ``enforce`` and over the limit.

        Without ``enforce`` the bytes are counted whatever the limit (compactd's own events:
        a compaction bracket must be able to close even for a tenant at its quota).
        """
        limit, usage = self.limits(tenant).max_bytes, self.of(tenant)
        if enforce and limit and usage.bytes + size > limit:
            return Refusal(tenant, Quota.BYTES, limit, usage.bytes)
        usage.bytes += size
        return None

    def release_bytes(self, tenant: str, size: int) -> None:
        """``size`` stored bytes of ``tenant`` are gone (or were never written)."""
        usage = self.of(tenant)
        usage.bytes = max(0, usage.bytes - size)

    @property
    def counts_stored(self) -> bool:
        """Whether any tenant has a sessions or bytes quota (the store's usage must be known)."""
        every = (self.default, *self.overrides.values())
        return any(limits.max_sessions or limits.max_bytes for limits in every)


def with_overrides(base: QuotaLimits, values: Mapping[str, float]) -> QuotaLimits:
    """``base`` with the given fields replaced (a tenant's table over the defaults)."""
    return replace(base, **values)  # type: ignore[arg-type]
