"""The store fixtures: every conformance test runs once per backend.

A new backend joins the suite by adding one entry to ``BACKENDS``.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from compactd.store import EventStore, MemoryEventStore, SqliteEventStore
from compactd.store.postgres import PostgresEventStore
from tests import postgres

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


def _postgresql(request: pytest.FixtureRequest) -> StoreFactory:
    url: str = request.getfixturevalue("postgres_database")
    return lambda: PostgresEventStore(postgres.fresh_schema(url), read_chunk=READ_CHUNK)


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], StoreFactory]] = {
    "memory": lambda _, path: _memory(path),
    "sqlite": lambda _, path: _sqlite(path),
    "postgresql": lambda request, _: _postgresql(request),
}


@pytest.fixture(scope="module")
def postgres_database() -> Iterator[str]:
    """A throwaway PostgreSQL database for this test module (dropped after it)."""
    yield from postgres.database()


@pytest.fixture(params=sorted(BACKENDS))
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Makes fresh, unopened stores of one backend (each SQLite store in its own file, each
    PostgreSQL store in its own schema of the module's database)."""
    return BACKENDS[request.param](request, tmp_path)


@pytest.fixture
async def store(store_factory: StoreFactory) -> AsyncIterator[EventStore]:
    """An open, empty store of one backend, closed after the test."""
    async with store_factory() as opened:
        yield opened
