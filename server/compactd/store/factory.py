"""Choosing a store by URL: ``sqlite:///PATH`` or ``memory://``."""

from __future__ import annotations

from compactd.errors import ConfigError
from compactd.store.base import Clock, EventStore, utc_now


def open_store(url: str, *, synchronous: str = "FULL", clock: Clock = utc_now) -> EventStore:
    """An unopened store for ``url`` (call ``await store.open()``); ``clock`` stamps sessions'
    create and last-append times."""
    if url.startswith("sqlite:///"):
        from compactd.store.sqlite import SqliteEventStore

        return SqliteEventStore(url[len("sqlite:///") :], synchronous=synchronous, clock=clock)
    if url == "memory://":
        from compactd.store.memory import MemoryEventStore

        return MemoryEventStore(clock=clock)
    raise ConfigError(f"store: unsupported URL {url!r} (sqlite:///PATH or memory://)")
