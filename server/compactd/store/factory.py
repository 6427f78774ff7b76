"""Choosing a store by URL: ``sqlite:///PATH``, ``postgresql://...`` or ``memory://``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from compactd.errors import ConfigError
from compactd.store.base import Clock, EventStore, utc_now

if TYPE_CHECKING:
    from compactd.config import ServerConfig

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(
    url: str,
    *,
    synchronous: str = "FULL",
    migrate: bool = False,
    pool_max: int = 8,
    statement_timeout_ms: int = 5000,
    connect_timeout_s: float = 5.0,
    clock: Clock = utc_now,
) -> EventStore:
    """An unopened store for ``url`` (call ``await store.open()``); ``clock`` stamps sessions'
    create and last-append times.

    ``migrate`` lets a PostgreSQL store apply pending schema migrations when it opens;
    ``pool_max``, ``statement_timeout_ms`` and ``connect_timeout_s`` bound its connections.
    """
    if url.startswith("sqlite:///"):
        from compactd.store.sqlite import SqliteEventStore

        return SqliteEventStore(url[len("sqlite:///") :], synchronous=synchronous, clock=clock)
    if url.startswith(POSTGRES_SCHEMES):
        from compactd.store.postgres import PostgresEventStore

        return PostgresEventStore(
            url,
            migrate=migrate,
            pool_max=pool_max,
            statement_timeout_ms=statement_timeout_ms,
            connect_timeout_s=connect_timeout_s,
            clock=clock,
        )
    if url == "memory://":
        from compactd.store.memory import MemoryEventStore

        return MemoryEventStore(clock=clock)
    raise ConfigError(
        f"store: unsupported URL {url!r} (sqlite:///PATH, postgresql://... or memory://)"
    )


def store_for(config: ServerConfig, *, clock: Clock = utc_now) -> EventStore:
    """The unopened store a server configuration names."""
    return open_store(
        config.store,
        synchronous=config.sqlite_synchronous,
        migrate=config.store_migrate,
        pool_max=config.postgres_pool_max,
        statement_timeout_ms=config.postgres_statement_timeout_ms,
        connect_timeout_s=config.postgres_connect_timeout_s,
        clock=clock,
    )
