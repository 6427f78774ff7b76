"""Durable session logs: the :class:`EventStore` seam and its backends."""

from compactd.store.base import EventStore, SessionRecord, StoreStats
from compactd.store.memory import MemoryEventStore
from compactd.store.sqlite import SqliteEventStore

__all__ = [
    "EventStore",
    "MemoryEventStore",
    "SessionRecord",
    "SqliteEventStore",
    "StoreStats",
]
