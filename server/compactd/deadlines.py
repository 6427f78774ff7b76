"""The deadline of the call being served, for the work done under it.

The API binds each call's deadline (``context.time_remaining()``) when its handler starts
(``api.status.handle_errors``); code below it reads what is left with ``remaining``. Tasks a
call starts copy its context (asyncio's rule), so a commit the call hands to a task is bounded
by the same deadline. The PostgreSQL store bounds every operation by it
(``store.postgres``): a call answers ``STORE_UNAVAILABLE`` before its deadline rather than
being held past it by a database that does not answer.
"""

from __future__ import annotations

import contextvars
import math
import time
from typing import Final

_DEADLINE: Final = contextvars.ContextVar[float | None]("compactd_call_deadline", default=None)


def bind(time_remaining: float | None) -> None:
    """Record the current call's deadline, ``time_remaining`` seconds from now (None, or a
    value that is not finite: the call has none)."""
    if time_remaining is None or not math.isfinite(time_remaining):
        _DEADLINE.set(None)
        return
    _DEADLINE.set(time.monotonic() + max(time_remaining, 0.0))


def remaining() -> float | None:
    """Seconds left before the current call's deadline (0 once past it); None without one."""
    deadline = _DEADLINE.get()
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)
