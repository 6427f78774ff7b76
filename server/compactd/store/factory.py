"""Choosing a store by URL: ``sqlite:///PATH``, ``postgresql://...`` or ``memory://``."""

from __future__ import annotations

from compactd.errors import ConfigError
from compactd.store.base import EventStore

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(url: str, *, synchronous: str = "FULL", migrate: bool = False) -> EventStore:
    """An unopened store for ``url`` (call ``await store.open()``).

    ``migrate`` lets a PostgreSQL store apply pending schema migrations when it opens.
    """
    if url.startswith("sqlite:///"):
        from compactd.store.sqlite import SqliteEventStore

        return SqliteEventStore(url[len("sqlite:///") :], synchronous=synchronous)
    if url.startswith(POSTGRES_SCHEMES):
        from compactd.store.postgres import PostgresEventStore

        return PostgresEventStore(url, migrate=migrate)
    if url == "memory://":
        from compactd.store.memory import MemoryEventStore

        return MemoryEventStore()
    raise ConfigError(
        f"store: unsupported URL {url!r} (sqlite:///PATH, postgresql://... or memory://)"
    )
