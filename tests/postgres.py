"""A real PostgreSQL for tests: a throwaway database per test module, a fresh schema per store.

``COMPACTD_TEST_POSTGRES`` names the server (default ``postgresql://postgres@127.0.0.1:5432``;
``.ci/run`` starts it). Outside CI, tests that need it are skipped when it does not answer; in CI
(``CI=true``) they fail instead, so a missing database can never pass for green.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import urllib.parse
import uuid
from collections.abc import Iterator

import psycopg
import pytest

SERVER = os.environ.get("COMPACTD_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432")


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(f"{SERVER}/postgres", autocommit=True, connect_timeout=3)


def available() -> bool:
    """Whether the test server answers."""
    try:
        with _admin():
            return True
    except psycopg.Error:
        return False


def require() -> None:
    """Skip (or, in CI, fail) a test that needs PostgreSQL when it does not answer."""
    if available():
        return
    message = f"PostgreSQL does not answer at {SERVER} (.ci/run starts it)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def database() -> Iterator[str]:
    """A fresh database's URL (yielded), dropped afterwards with every connection to it."""
    require()
    name = f"compactd_test_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{SERVER}/{name}"
    finally:
        with _admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_schemas = itertools.count()


def fresh_schema(url: str) -> str:
    """``url`` with a new, empty schema on its search path: a fresh store in the same database."""
    schema = f"store_{os.getpid()}_{next(_schemas)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    options = urllib.parse.quote(f"-csearch_path={schema}")
    return f"{url}?options={options}"


def terminate_backends(url: str) -> int:
    """Kills every other connection to ``url``'s database (a database restart, seen from a
    client); returns how many."""
    name = urllib.parse.urlsplit(url).path.lstrip("/")
    with _admin() as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        ).fetchall()
    return len(rows)


@contextlib.contextmanager
def refusing_connections(url: str) -> Iterator[None]:
    """While inside: ``url``'s database accepts no new connections (as if it were down)."""
    name = urllib.parse.urlsplit(url).path.lstrip("/")
    with _admin() as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
    try:
        yield
    finally:
        with _admin() as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
