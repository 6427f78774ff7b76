"""The PostgreSQL store's schema: numbered migrations, applied by ``compactd migrate``.

The database records the version it is at in ``compactd_schema``. A replica serves exactly the
version it was built for: an older database must be migrated first (``compactd migrate`` or
``serve --migrate``), a newer one belongs to a newer compactd. Both are refused at start with a
message that says which, so a rolling upgrade never runs old code on a new schema by accident.
An empty database is created at the current version (nothing to migrate from). Migrations run
under a transaction-scoped advisory lock, so replicas started together migrate once.

A new migration is one entry appended to ``MIGRATIONS``; never edit a released one.
"""

from __future__ import annotations

from typing import Final

import psycopg
from psycopg.rows import TupleRow

from compactd.errors import StartupError
from compactd.reasons import Reason

# Any constant: every compactd that migrates this database takes the same advisory lock.
_MIGRATION_LOCK: Final = 0x636F6D70  # "comp"

MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    # 1: the log itself, keyed by (tenant, session id).
    (
        """CREATE TABLE sessions (
            tenant      TEXT COLLATE "C" NOT NULL,
            session_id  TEXT COLLATE "C" NOT NULL,
            create_time TIMESTAMPTZ NOT NULL,
            update_time TIMESTAMPTZ NOT NULL,
            policy_json TEXT,
            revision    BIGINT NOT NULL DEFAULT 0,
            PRIMARY KEY (tenant, session_id)
        )""",
        """CREATE TABLE events (
            tenant     TEXT COLLATE "C" NOT NULL,
            session_id TEXT COLLATE "C" NOT NULL,
            seq        BIGINT NOT NULL,
            event_id   TEXT,
            type       TEXT NOT NULL,
            data       BYTEA NOT NULL,
            PRIMARY KEY (tenant, session_id, seq),
            FOREIGN KEY (tenant, session_id) REFERENCES sessions (tenant, session_id)
                ON DELETE CASCADE
        )""",
        """CREATE UNIQUE INDEX events_event_id
            ON events (tenant, session_id, event_id) WHERE event_id IS NOT NULL""",
    ),
    # 2: replicas: the bracket lease lives on the session row its appends lock anyway.
    (
        "ALTER TABLE sessions ADD COLUMN lease_owner TEXT",
        "ALTER TABLE sessions ADD COLUMN lease_token TEXT",
        "ALTER TABLE sessions ADD COLUMN lease_expires TIMESTAMPTZ",
    ),
    # 3: fold snapshots (issue 11): the newest one per session, whichever replica wrote it.
    (
        """CREATE TABLE snapshots (
            tenant     TEXT COLLATE "C" NOT NULL,
            session_id TEXT COLLATE "C" NOT NULL,
            revision   BIGINT NOT NULL,
            data       BYTEA NOT NULL,
            PRIMARY KEY (tenant, session_id),
            FOREIGN KEY (tenant, session_id) REFERENCES sessions (tenant, session_id)
                ON DELETE CASCADE
        )""",
    ),
    # 4: the append rate every replica shares: one token bucket per tenant (``taken``: whether
    # the last take found a token, so one statement both takes and answers).
    (
        """CREATE TABLE append_buckets (
            tenant  TEXT COLLATE "C" PRIMARY KEY,
            tokens  DOUBLE PRECISION NOT NULL,
            updated TIMESTAMPTZ NOT NULL,
            taken   BOOLEAN NOT NULL
        )""",
    ),
    # 5: sub-agent sessions: a child names its parent (same tenant) and, forked, the seq.
    (
        'ALTER TABLE sessions ADD COLUMN parent_id TEXT COLLATE "C"',
        "ALTER TABLE sessions ADD COLUMN fork_at_seq BIGINT",
        """CREATE INDEX sessions_parent ON sessions (tenant, parent_id, session_id)
            WHERE parent_id IS NOT NULL""",
    ),
    # 6: summaries prepared ahead of the trigger (issue 35): one candidate per session, with
    # its preparer's lease, so any replica may apply it and a dead preparer's lapses.
    (
        """CREATE TABLE candidates (
            tenant       TEXT COLLATE "C" NOT NULL,
            session_id   TEXT COLLATE "C" NOT NULL,
            candidate_id TEXT NOT NULL,
            owner        TEXT NOT NULL,
            digest       TEXT NOT NULL,
            start_seq    BIGINT NOT NULL,
            end_seq      BIGINT NOT NULL,
            started      TIMESTAMPTZ NOT NULL,
            expires      TIMESTAMPTZ NOT NULL,
            summary      BYTEA,
            ready        TIMESTAMPTZ,
            PRIMARY KEY (tenant, session_id),
            FOREIGN KEY (tenant, session_id) REFERENCES sessions (tenant, session_id)
                ON DELETE CASCADE
        )""",
    ),
)

SCHEMA_VERSION: Final = len(MIGRATIONS)


async def version(conn: psycopg.AsyncConnection[TupleRow]) -> int | None:
    """The database's schema version; None when compactd never created its schema there."""
    cursor = await conn.execute("SELECT to_regclass('compactd_schema') IS NOT NULL")
    row = await cursor.fetchone()
    if row is None or not row[0]:
        return None
    cursor = await conn.execute("SELECT version FROM compactd_schema")
    row = await cursor.fetchone()
    return 0 if row is None else int(row[0])


async def migrate(conn: psycopg.AsyncConnection[TupleRow], *, target: int = SCHEMA_VERSION) -> int:
    """Applies every migration past the database's version up to ``target``; returns the
    version reached. Refuses a database newer than this server.

    Raises:
        StartupError: The database's schema is newer than ``SCHEMA_VERSION``.
    """
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        await conn.execute("CREATE TABLE IF NOT EXISTS compactd_schema (version INTEGER NOT NULL)")
        current = await version(conn) or 0
        if current > SCHEMA_VERSION:
            raise too_new(current)
        for number in range(current + 1, target + 1):
            for statement in MIGRATIONS[number - 1]:
                await conn.execute(statement.encode())
        reached = max(current, target)
        await conn.execute("DELETE FROM compactd_schema")
        await conn.execute("INSERT INTO compactd_schema (version) VALUES (%s)", (reached,))
    return reached


async def check(conn: psycopg.AsyncConnection[TupleRow], *, apply: bool) -> int:
    """Makes sure the database is at ``SCHEMA_VERSION`` before a replica serves it.

    An empty database is created; an older one is migrated only when ``apply`` is set.

    Raises:
        StartupError: ``SCHEMA_TOO_OLD`` (run ``compactd migrate``) or ``SCHEMA_TOO_NEW``.
    """
    current = await version(conn)
    if current is None or (apply and current < SCHEMA_VERSION):
        return await migrate(conn)
    if current < SCHEMA_VERSION:
        raise StartupError(
            f"the PostgreSQL store's schema is at version {current}, older than the version "
            f"{SCHEMA_VERSION} this compactd serves: run `compactd migrate --store URL` (or "
            "start with `serve --migrate`) first",
            reason=Reason.SCHEMA_TOO_OLD,
            metadata={"schema_version": str(current), "server_version": str(SCHEMA_VERSION)},
        )
    if current > SCHEMA_VERSION:
        raise too_new(current)
    return current


def too_new(current: int) -> StartupError:
    """The refusal of a database written by a newer compactd."""
    return StartupError(
        f"the PostgreSQL store's schema is at version {current}, newer than the version "
        f"{SCHEMA_VERSION} this compactd understands: upgrade this replica (a newer compactd "
        "migrated the database), or point it at another database",
        reason=Reason.SCHEMA_TOO_NEW,
        metadata={"schema_version": str(current), "server_version": str(SCHEMA_VERSION)},
    )
