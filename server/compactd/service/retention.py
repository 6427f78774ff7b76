"""Retention: sessions idle longer than their tenant's period are deleted by a background sweep.

``session_retention_s`` maps tenant ids to seconds (``default`` is the tenant of every call when
authentication is off). A session's idleness counts from its last append (``SessionRecord.
last_active``); a sweep deletes, through ``SessionManager.delete``, every session of a listed
tenant idle for longer than the period, so followers end and the log goes durably. Tenants not
listed keep their sessions forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from compactd.errors import ConfigError, NotFound
from compactd.service.sessions import SessionManager
from compactd.store.base import Clock, utc_now
from compactd.tenancy import Tenant

log = logging.getLogger(__name__)

_PAGE = 500
_LONGEST_WAIT_S = 300.0  # a sweep at least every 5 minutes


def periods_from(table: Mapping[str, Any]) -> dict[Tenant, timedelta]:
    """The ``session_retention_s`` table, validated.

    Raises:
        ConfigError: A period is not a positive number of seconds.
    """
    periods: dict[Tenant, timedelta] = {}
    for tenant, seconds in table.items():
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
            raise ConfigError(
                f"session_retention_s.{tenant}: expected a positive number of seconds, "
                f"got {seconds!r}"
            )
        periods[Tenant(str(tenant))] = timedelta(seconds=float(seconds))
    return periods


class RetentionSweeper:
    """Deletes idle sessions of the tenants in ``periods``, now (``sweep``) or on a timer."""

    def __init__(
        self,
        manager: SessionManager,
        periods: Mapping[Tenant, timedelta],
        *,
        clock: Clock = utc_now,
    ) -> None:
        self.manager = manager
        self.periods = dict(periods)
        self.clock = clock
        self._task: asyncio.Task[None] | None = None

    @property
    def interval_s(self) -> float:
        """Seconds between sweeps: a tenth of the shortest period, at most five minutes."""
        shortest = min(p.total_seconds() for p in self.periods.values())
        return min(max(shortest / 10, 1.0), _LONGEST_WAIT_S)

    async def sweep(self) -> int:
        """Delete every session idle past its tenant's period; returns how many went."""
        deleted = 0
        for tenant, period in self.periods.items():
            deleted += await self._sweep_tenant(tenant, self.clock() - period)
        return deleted

    def start(self) -> None:
        """Sweep on a timer (on the running loop) until ``stop``; nothing to do without periods."""
        if self.periods and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _sweep_tenant(self, tenant: Tenant, cutoff: datetime) -> int:
        idle: list[str] = []
        after = ""
        while True:
            page = await self.manager.list(after=after, limit=_PAGE, tenant=tenant)
            idle.extend(r.session_id for r in page if r.last_active < cutoff)
            if len(page) < _PAGE:
                break
            after = page[-1].session_id
        deleted = 0
        for session_id in idle:
            with contextlib.suppress(NotFound):  # deleted meanwhile: nothing left to do
                # Checked again under the session's lock: an append since the listing keeps it.
                if await self.manager.delete(session_id, tenant=tenant, idle_before=cutoff):
                    deleted += 1
        if deleted:
            log.info("idle sessions deleted", extra={"tenant": tenant.id, "sessions": deleted})
        return deleted

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except Exception:  # a failed sweep must not end retention: the next one retries
                log.exception("retention sweep failed")
