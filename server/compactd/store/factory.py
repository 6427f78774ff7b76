"""Choosing a store by URL: ``sqlite:///PATH`` or ``memory://``."""

from __future__ import annotations

from compactd.errors import ConfigError
from compactd.store.base import EventStore


def open_store(url: str, *, synchronous: str = "FULL") -> EventStore:
    """An unopened store for ``url`` (call ``await store.open()``)."""
    if url.startswith("sqlite:///"):
        from compactd.store.sqlite import SqliteEventStore

        return SqliteEventStore(url[len("sqlite:///") :], synchronous=synchronous)
    if url == "memory://":
        from compactd.store.memory import MemoryEventStore

        return MemoryEventStore()
    raise ConfigError(f"store: unsupported URL {url!r} (sqlite:///PATH or memory://)")
