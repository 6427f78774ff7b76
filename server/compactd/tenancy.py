"""Who is calling: the tenant a call runs as, bound for the duration of one RPC.

The authentication interceptor binds the caller's tenant; the services, the quota book and the
store read it through ``current_tenant``. With authentication off every call runs as
``DEFAULT_TENANT``, which is also the tenant that data written before tenancy belongs to.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant: the owner of sessions, the unit quotas are counted in."""

    id: str


DEFAULT_TENANT = Tenant("default")

_current: ContextVar[Tenant] = ContextVar("compactd_tenant", default=DEFAULT_TENANT)


def current_tenant() -> Tenant:
    """The tenant the running call belongs to (``DEFAULT_TENANT`` outside any call)."""
    return _current.get()


@contextmanager
def bound_tenant(tenant: Tenant) -> Iterator[Tenant]:
    """Run the block as ``tenant``; the previous binding is restored after it."""
    token = _current.set(tenant)
    try:
        yield tenant
    finally:
        # A stream's generator may be closed from another task's context (its client went
        # away): the binding belongs to the finished call's context, nothing to restore here.
        with suppress(ValueError):
            _current.reset(token)
