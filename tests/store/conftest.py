"""The store fixtures: every conformance test runs once per backend.

A new backend joins the suite by adding one entry to ``BACKENDS``.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from compactd.store import EventStore, MemoryEventStore, SqliteEventStore

StoreFactory = Callable[[], EventStore]

# A small read chunk makes every multi-event read cross chunk boundaries.
READ_CHUNK = 7


def _memory(_: Path) -> StoreFactory:
    return lambda: MemoryEventStore(read_chunk=READ_CHUNK)


def _sqlite(tmp_path: Path) -> StoreFactory:
    counter = itertools.count()
    return lambda: SqliteEventStore(
        str(tmp_path / f"events-{next(counter)}.db"), read_chunk=READ_CHUNK
    )


BACKENDS: dict[str, Callable[[Path], StoreFactory]] = {"memory": _memory, "sqlite": _sqlite}


@pytest.fixture(params=sorted(BACKENDS))
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Makes fresh, unopened stores of one backend (each SQLite store in its own file)."""
    return BACKENDS[request.param](tmp_path)


@pytest.fixture
async def store(store_factory: StoreFactory) -> AsyncIterator[EventStore]:
    """An open, empty store of one backend, closed after the test."""
    async with store_factory() as opened:
        yield opened
