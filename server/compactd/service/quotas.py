"""The quota book: per-tenant quotas applied to the running call's tenant.

``QuotaBook`` wraps the pure ``core.quotas.QuotaLedger`` with the clock, the tenant of the call
(``compactd.tenancy.current_tenant``) and the error a refusal raises: ``QuotaExceeded``,
RESOURCE_EXHAUSTED with reason ``QUOTA_EXCEEDED``, a ``google.rpc.QuotaFailure`` naming the quota
and, for the append rate, a ``google.rpc.RetryInfo`` saying when the next call fits.

Who asks it: the ``TenantQuotas`` interceptor (streams, and the append rate: a call over it
waits up to ``MAX_HOLD_S`` for its token, then is refused before the handler runs),
``SessionManager.create`` (sessions) and ``SessionHandle`` (bytes, counted after the batch is
admitted and before it is committed). Held quotas (sessions, bytes) start from the
store's figures (``EventStore.usage``) when any tenant has one, so a restart forgets nothing, and
a deleted session gives back what the store held for it.

Settings: the ``[quotas]`` table holds the defaults, ``[quotas.tenants.ID]`` a tenant's overrides
(only the keys it sets)::

    [quotas]
    max_streams = 64
    appends_per_second = 50
    [quotas.tenants.batch-jobs]
    appends_per_second = 500
    max_bytes = 10_000_000_000
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final

from compactd.core.quotas import Quota, QuotaLedger, QuotaLimits, Refusal, with_overrides
from compactd.errors import CompactdError, ConfigError, QuotaExceeded, QuotaViolation
from compactd.metrics import Metrics
from compactd.store.base import EventStore, StoreUsage
from compactd.tenancy import current_tenant

#: The longest a call over the append rate waits for its token before it is refused.
MAX_HOLD_S: Final = 0.25
#: The shortest wait of a call over the rate (a refusal is never answered at once).
MIN_HOLD_S: Final = 0.02
#: The longest a call waits for the store's shared bucket (then this process's decides): the
#: token is taken before the call's handler, which answers a silent store within its deadline.
SHARED_TOKEN_TIMEOUT_S: Final = 0.5
#: Calls of one tenant that may wait at once; more are refused without waiting.
MAX_HELD: Final = 64
_KEYS: Final = {f.name: f.type for f in fields(QuotaLimits)}
_FLOAT_KEYS: Final = {"appends_per_second"}


@dataclass(frozen=True)
class QuotaSettings:
    """The ``[quotas]`` table: default limits and per-tenant overrides (0: no limit)."""

    default: QuotaLimits = field(default_factory=QuotaLimits)
    tenants: Mapping[str, QuotaLimits] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> QuotaSettings:
        """Parse and validate (``ConfigError`` names the bad key, e.g. ``quotas.tenants.a.x``)."""
        table = dict(values)
        tenants = table.pop("tenants", {})
        default = _limits(QuotaLimits(), table, "quotas")
        if not isinstance(tenants, Mapping):
            raise ConfigError("quotas.tenants: must be a table of tables, one per tenant id")
        overrides = {
            str(tenant): _limits(default, _table(table_of, f"quotas.tenants.{tenant}"),
                                 f"quotas.tenants.{tenant}")
            for tenant, table_of in tenants.items()
        }  # fmt: skip
        return cls(default, overrides)


def _table(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: must be a table")
    return value


def _limits(base: QuotaLimits, values: Mapping[str, Any], path: str) -> QuotaLimits:
    checked: dict[str, float] = {}
    for key, value in values.items():
        where = f"{path}.{key}"
        if key not in _KEYS:
            raise ConfigError(f"{where}: unknown setting (known: {', '.join(_KEYS)})")
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if key not in _FLOAT_KEYS and not isinstance(value, int):
            numeric = False
        if not numeric or not math.isfinite(value) or value < 0:
            kind = "a number" if key in _FLOAT_KEYS else "an integer"
            raise ConfigError(f"{where}: must be {kind} >= 0 (0: no limit), got {value!r}")
        checked[key] = value
    return with_overrides(base, checked)


@dataclass(frozen=True)
class Reservation:
    """Bytes counted for a batch not yet committed: ``release`` them if it never is."""

    book: QuotaBook
    tenant: str
    size: int

    def release(self) -> None:
        """Give the bytes back (the commit failed)."""
        self.book.ledger.release_bytes(self.tenant, self.size)


class QuotaBook:
    """Every tenant's quotas and usage, applied to the tenant of the running call.

    Args:
        settings: The ``[quotas]`` table.
        clock: Monotonic seconds (the append buckets' time).
        metrics: Where refusals are counted (``compactd.quota.refusals``).
    """

    def __init__(
        self,
        settings: QuotaSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings or QuotaSettings()
        self._metrics = metrics or Metrics()
        self.ledger = QuotaLedger(self.settings.default, self.settings.tenants)
        self._clock = clock
        self._held: dict[str, int] = {}  # calls over the rate waiting, by tenant
        self._shared: EventStore | None = None  # keeps the append buckets every replica shares

    async def load(self, store: EventStore) -> None:
        """Start the held quotas from the store (only when a sessions or bytes quota is set),
        and take append tokens from the store's buckets when replicas share it.

        Raises:
            ConfigError: A sessions or bytes quota is set and the store cannot report usage.
        """
        self._shared = store if store.shared else None
        if not self.ledger.counts_stored:
            return
        try:
            usage = await store.usage()
        except NotImplementedError:
            raise ConfigError(
                "quotas: max_sessions and max_bytes need a store that reports its usage "
                f"({type(store).__name__} does not)"
            ) from None
        for tenant, held in usage.items():
            self.ledger.seed(tenant, sessions=held.sessions, stored_bytes=held.bytes)

    def removed(self, tenant: str, held: StoreUsage) -> None:
        """``tenant`` deleted what ``held`` counts (a session and its log's bytes)."""
        self.ledger.release_session(tenant, held.sessions)
        self.ledger.release_bytes(tenant, held.bytes)

    def admit_append(self) -> None:
        """Take one append from the caller's bucket.

        Raises:
            QuotaExceeded: Over ``appends_per_second``; ``retry_after`` says when one fits.
        """
        self._refuse(self.ledger.take_append(current_tenant().id, self._clock()))

    def keeps_append_rate(self) -> bool:
        """Whether the caller's tenant has an ``appends_per_second`` to keep: without one every
        append is admitted at once (``admit_append_or_wait`` takes nothing)."""
        return bool(self.ledger.limits(current_tenant().id).appends_per_second)

    async def admit_append_or_wait(self) -> None:
        """Take one append from the caller's bucket, waiting up to ``MAX_HOLD_S`` for it.

        A call over the rate is held for the time its token needs (``MAX_HOLD_S`` at most, and
        ``MIN_HOLD_S`` at least), then takes the token if it has come, or is refused. So a
        client that retries at once, ignoring ``RetryInfo``, makes a few calls a second, not
        thousands: a refusal is cheap, a spinning client's thousands are not, and they would
        share the server with every other tenant. At most ``MAX_HELD`` calls of a tenant wait
        at once; more are refused without waiting.

        Raises:
            QuotaExceeded: Still over ``appends_per_second`` after the wait.
        """
        tenant = current_tenant().id
        refusal = await self._take_append(tenant)
        if refusal is None:
            return
        held = self._held.get(tenant, 0)
        if held < MAX_HELD and refusal.retry_after is not None:
            self._held[tenant] = held + 1
            try:
                await asyncio.sleep(min(MAX_HOLD_S, max(MIN_HOLD_S, refusal.retry_after)))
            finally:
                self._release_hold(tenant)
            refusal = await self._take_append(tenant)
        self._refuse(refusal)

    async def _take_append(self, tenant: str) -> Refusal | None:
        """One token of ``tenant``'s bucket: the store's, shared by every replica, when it
        keeps them; this process's otherwise, and while the store does not answer (each replica
        then allows the whole rate, as before replicas shared it)."""
        limits = self.ledger.limits(tenant)
        rate = limits.appends_per_second
        if self._shared is not None and rate:
            try:
                wait = await asyncio.wait_for(
                    self._shared.take_append_token(tenant, rate, limits.burst),
                    SHARED_TOKEN_TIMEOUT_S,
                )
            except (CompactdError, TimeoutError):
                wait = None  # the append itself will say what the store has
            if wait is not None:
                if not wait:
                    return None
                return Refusal(tenant, Quota.APPENDS, rate, rate, retry_after=wait)
        return self.ledger.take_append(tenant, self._clock())

    def _refuse(self, refusal: Refusal | None) -> None:
        """Raise ``refusal`` (counted) as ``QuotaExceeded``; nothing when it is None."""
        if refusal is None:  # every admitted call: no ``_raise`` call for it
            return
        self._metrics.quota_refused(refusal.tenant, refusal.quota.value)
        _raise(refusal)

    def _release_hold(self, tenant: str) -> None:
        left = self._held[tenant] - 1
        if left:
            self._held[tenant] = left
        else:
            del self._held[tenant]

    def open_stream(self) -> Callable[[], None]:
        """Count an open response stream of the caller; returns the function that closes it.

        Raises:
            QuotaExceeded: The caller already has ``max_streams`` open.
        """
        tenant = current_tenant().id
        self._refuse(self.ledger.open_stream(tenant))
        return _once(lambda: self.ledger.close_stream(tenant))

    def reserve_session(self, tenant: str | None = None) -> Callable[[], None]:
        """Count one more session of ``tenant`` (the caller's by default); returns the function
        that gives the count back (call it when no session was created: a failed or retried
        create).

        Raises:
            QuotaExceeded: The tenant already owns ``max_sessions``.
        """
        tenant = tenant or current_tenant().id
        self._refuse(self.ledger.reserve_session(tenant))
        return _once(lambda: self.ledger.release_session(tenant))

    def reserve_bytes(self, size: int, *, enforce: bool, tenant: str | None = None) -> Reservation:
        """Count ``size`` more stored bytes of ``tenant`` (the caller's by default; see
        ``QuotaLedger.reserve_bytes``).

        Raises:
            QuotaExceeded: ``enforce`` and the bytes would pass ``max_bytes``.
        """
        tenant = tenant or current_tenant().id
        self._refuse(self.ledger.reserve_bytes(tenant, size, enforce=enforce))
        return Reservation(self, tenant, size)


def _once(action: Callable[[], None]) -> Callable[[], None]:
    """``action``, done on the first call only (a count is given back once)."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return run


_WHAT: Final = {
    Quota.STREAMS: ("response streams open at once", "close one"),
    Quota.APPENDS: ("AppendEvents calls per second", "slow down"),
    Quota.SESSIONS: ("sessions", "delete one"),
    Quota.BYTES: ("bytes of stored logs", "delete a session"),
}


def _raise(refusal: Refusal | None) -> None:
    if refusal is None:
        return
    what, remedy = _WHAT[refusal.quota]
    limit = f"{refusal.limit:g}"
    retry = f", retry in {refusal.retry_after:.3f}s" if refusal.retry_after is not None else ""
    description = f"at most {limit} {what}"
    raise QuotaExceeded(
        f"tenant {refusal.tenant!r} is over its {refusal.quota.value} quota ({description}): "
        f"{remedy}{retry}",
        quota_violations=[
            QuotaViolation(
                subject=f"tenant:{refusal.tenant}",
                quota=refusal.quota.value,
                description=description,
                limit=refusal.limit,
            )
        ],
        retry_after=refusal.retry_after,
        metadata={"tenant": refusal.tenant, "quota": refusal.quota.value, "limit": limit},
    )
