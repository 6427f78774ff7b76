"""The event store seam: one durable, append-only log of ``SessionEvent``s per session.

Every storage backend (SQLite, PostgreSQL, the in-memory fake) implements :class:`EventStore` with
identical semantics; ``tests/store`` runs one conformance suite against all of them. The helpers
here (batch encoding, the shared error constructors) keep the backends' answers word for word
alike.

Events are stored as their deterministic protobuf serialization, so a read returns the exact
bytes that were appended. The store assigns nothing: the caller (the session service) stamps each
event's ``seq`` and ``time`` before :meth:`EventStore.append`; the store only checks that the
batch continues the log and keeps it, all or nothing.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, NamedTuple, Self, TypeVar

from compactd import errors
from compactd.core.steps import run_to_end
from compactd.reasons import Reason
from compactd.store.candidates import Candidate, CandidateClaim, ProcessCandidates
from compactd.store.leases import Lease, LeaseOp
from compactd.tenancy import DEFAULT_TENANT
from compactd.v1 import events_pb2

#: The tenant a store call names when it names none: the owner of data written before tenancy.
DEFAULT_TENANT_ID = DEFAULT_TENANT.id


class SessionKey(NamedTuple):
    """A session's primary key in a relational backend."""

    tenant: str
    session_id: str


Clock = Callable[[], datetime]
"""Returns the current time as an aware UTC ``datetime``; injected so tests can pin it."""


def utc_now() -> datetime:
    """The default :data:`Clock`: the system clock, in UTC."""
    return datetime.now(UTC)


@dataclass(frozen=True)
class SessionRecord:
    """A session as the store keeps it.

    Attributes:
        session_id: The session's id.
        create_time: When the session was created (aware, UTC, microsecond precision).
        policy_json: Per-session compaction policy overrides as JSON text, opaque to the store.
        revision: Number of events in the log, which is also the next event's seq.
        tenant: The tenant that owns the session; ids are unique per tenant.
        update_time: When the last batch landed (the create time before any): what a
            retention period counts idleness from.
        parent_session_id: The parent session of a child (a sub-agent's session), of the same
            tenant; empty for a top-level session.
        fork_at_seq: The parent's seq a forked child copied the surface at; None otherwise.
    """

    session_id: str
    create_time: datetime
    policy_json: str | None
    revision: int
    tenant: str = DEFAULT_TENANT_ID
    update_time: datetime | None = None
    parent_session_id: str = ""
    fork_at_seq: int | None = None

    @property
    def last_active(self) -> datetime:
        """When the session last changed (its last append, else its creation)."""
        return self.update_time or self.create_time


@dataclass(frozen=True)
class StoreStats:
    """Counters a store keeps about its writes, to make group commit observable.

    Attributes:
        commits: Write transactions committed (one per ``create_session`` or append in the
            in-memory store; one per group of queued writes in SQLite).
        batches: Append batches processed, landed or failed.
        failed_batches: Append batches refused by their own checks (seq conflict, unknown
            session, duplicate event id).
        events: Events that landed.
        commit_seconds: Time committed write transactions took, from their start to their
            commit's return (the durable commit, an fsync on SQLite, included): SQLite's groups
            of queued writes, PostgreSQL's appends; 0 in the in-memory store.
        queued_seconds: Time the writes of those transactions waited for them to start, summed
            per write: SQLite's writer queue, PostgreSQL's wait for a pooled connection (its
            appends); 0 in the in-memory store.
    """

    commits: int = 0
    batches: int = 0
    failed_batches: int = 0
    events: int = 0
    commit_seconds: float = 0.0
    queued_seconds: float = 0.0

    def plus(
        self,
        *,
        commits: int = 0,
        batches: int = 0,
        failed_batches: int = 0,
        events: int = 0,
        commit_seconds: float = 0.0,
        queued_seconds: float = 0.0,
    ) -> StoreStats:
        """These counters with the given increments added."""
        return StoreStats(
            commits=self.commits + commits,
            batches=self.batches + batches,
            failed_batches=self.failed_batches + failed_batches,
            events=self.events + events,
            commit_seconds=self.commit_seconds + commit_seconds,
            queued_seconds=self.queued_seconds + queued_seconds,
        )


@dataclass(frozen=True)
class StoreUsage:
    """What one tenant holds in a store: its sessions and its logs' bytes.

    Attributes:
        sessions: Sessions owned.
        bytes: The serialized size of every event of those sessions.
    """

    sessions: int = 0
    bytes: int = 0


class EventRow(NamedTuple):
    """One event ready to store: its indexed columns and its serialized bytes (a tuple: a large
    batch makes one per event on the event loop, and a frozen dataclass costs several times as
    much to make)."""

    seq: int
    event_id: str | None
    type: str
    data: bytes


def event_type(event: events_pb2.SessionEvent) -> str:
    """The spec's type string of an event, derived from its ``body`` field.

    ``user_message`` -> ``user/message``, ``compaction_summary_error`` ->
    ``compaction/summary-error``: the first word is the family, the rest joins with hyphens.

    Raises:
        InvalidArgument: if no body is set.
    """
    field = event.WhichOneof("body")
    if field is None:
        raise errors.InvalidArgument("event has no body")
    known = _TYPES.get(field)
    if known is None:
        family, _, rest = field.partition("_")
        known = _TYPES[field] = f"{family}/{rest.replace('_', '-')}"
    return known


#: ``event_type`` by body field, as it makes them (a large batch asks once per event).
_TYPES: dict[str, str] = {}


def encode_batch(events: Sequence[events_pb2.SessionEvent]) -> list[EventRow]:
    """Checks a batch's internal shape and serializes it.

    The batch must have contiguous seqs (``events[i].seq == events[0].seq + i``), a body on every
    event, and no event id repeated within itself. Whether it continues the log is the backend's
    check, made inside its transaction.

    Raises:
        InvalidArgument: naming the offending ``events[i]`` field.
    """
    return run_to_end(encode_batch_in_steps(events))


def encode_batch_in_steps(
    events: Sequence[events_pb2.SessionEvent],
    serialized: Mapping[int, bytes] | None = None,
) -> Generator[None, None, list[EventRow]]:
    """``encode_batch``, pausing (``yield``) between two events, so that an event loop can run
    other calls between steps (a caller then hands the rows to ``EventStore.append``); a
    one-event batch is encoded in one step.
    ``serialized`` holds, by seq, events' deterministic bytes the caller already has (a surface
    node's): they are used as they are."""
    known = serialized or {}
    rows: list[EventRow] = []
    seen: set[str] = set()
    for i, event in enumerate(events):
        if i:
            yield
        if event.seq != events[0].seq + i:
            raise _bad_field(f"events[{i}].seq", f"expected {events[0].seq + i}, got {event.seq}")
        if event.event_id in seen:
            raise _bad_field(f"events[{i}].event_id", f"{event.event_id!r} repeats in the batch")
        if event.event_id:
            seen.add(event.event_id)
        body = event.WhichOneof("body")
        if body is None:
            raise _bad_field(f"events[{i}].body", "exactly one body must be set")
        rows.append(
            EventRow(
                seq=event.seq,
                event_id=event.event_id or None,
                type=_TYPES.get(body) or event_type(event),  # a known type without the call
                data=known[event.seq]
                if event.seq in known
                else event.SerializeToString(deterministic=True),
            )
        )
    return rows


def decode_event(data: bytes) -> events_pb2.SessionEvent:
    """Parses stored bytes back into a fresh event."""
    event = events_pb2.SessionEvent()
    event.ParseFromString(data)
    return event


def check_read_range(from_seq: int, to_seq: int | None) -> None:
    """Rejects a negative ``from_seq`` or ``to_seq``.

    Raises:
        InvalidArgument: naming the field.
    """
    if from_seq < 0:
        raise _bad_field("from_seq", "must be >= 0")
    if to_seq is not None and to_seq < 0:
        raise _bad_field("to_seq", "must be >= 0")


def check_limit(limit: int) -> None:
    """Rejects a page size below one.

    Raises:
        InvalidArgument: naming ``limit``.
    """
    if limit < 1:
        raise _bad_field("limit", "must be >= 1")


def session_not_found(session_id: str) -> errors.NotFound:
    """The error every backend raises for an unknown session."""
    return errors.NotFound(
        f"session {session_id!r} does not exist", metadata={"session_id": session_id}
    )


def session_exists(session_id: str) -> errors.AlreadyExists:
    """The error every backend raises when a session id is taken."""
    return errors.AlreadyExists(
        f"session {session_id!r} already exists", metadata={"session_id": session_id}
    )


def seq_conflict(session_id: str, first_seq: int, revision: int) -> errors.SeqConflict:
    """The error every backend raises when a batch does not continue the log."""
    return errors.SeqConflict(
        f"batch starts at seq {first_seq} but session {session_id!r} is at revision {revision}",
        metadata={
            "session_id": session_id,
            "first_seq": str(first_seq),
            "revision": str(revision),
        },
    )


def duplicate_event_ids(session_id: str, event_ids: Sequence[str]) -> errors.InvalidArgument:
    """The error every backend raises when a batch reuses event ids already in the log."""
    listed = ", ".join(repr(i) for i in sorted(event_ids))
    return errors.InvalidArgument(
        f"event ids already in session {session_id!r}: {listed}",
        violations=[
            errors.FieldViolation("event_id", f"{i!r} already exists") for i in sorted(event_ids)
        ],
        reason=Reason.DUPLICATE_EVENT_ID,
        metadata={"session_id": session_id},
    )


def store_closed() -> errors.Unavailable:
    """The error raised by a store used before ``open()`` or after ``close()``."""
    return errors.Unavailable("event store is not open")


def _bad_field(field: str, description: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"{field}: {description}", violations=[errors.FieldViolation(field, description)]
    )


T = TypeVar("T")


class Outcome(asyncio.Future[T]):
    """A write's outcome, which a caller's cancellation does not take: ``cancel`` is refused,
    so a task cancelled while it awaits the outcome wakes (with ``CancelledError``) only once
    the write is settled, and can still read it here."""

    def cancel(self, msg: Any = None) -> bool:
        return False

    def settle_from(self, task: asyncio.Future[T]) -> None:
        """Settle as ``task`` did (a done callback)."""
        if task.cancelled():  # the loop is closing: nobody waits for the outcome
            super().cancel()
        elif (error := task.exception()) is not None:
            self.set_exception(error)
        else:
            self.set_result(task.result())


class EventStore(abc.ABC):
    """The durable home of session logs.

    Sessions are keyed by (tenant, session id): every method takes the owning ``tenant``
    (keyword, ``DEFAULT_TENANT_ID`` when omitted), and a session of one tenant is invisible to
    every other (NotFound, absent from listings), whatever its id.

    Lifecycle: ``await open()`` before use, ``await close()`` when done (or ``async with``).
    Operations on a store that is not open raise ``errors.Unavailable``. Every method is safe to
    call from many tasks of one event loop at once.
    """

    @abc.abstractmethod
    async def open(self) -> None:
        """Prepares the store for use, creating its schema if missing. Idempotent."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finishes queued writes, then releases every resource. Idempotent."""

    @abc.abstractmethod
    async def create_session(
        self,
        session_id: str,
        policy_json: str | None,
        *,
        tenant: str = DEFAULT_TENANT_ID,
        parent: str = "",
        fork_at_seq: int | None = None,
    ) -> SessionRecord:
        """Creates an empty session (revision 0), durably; a child of ``parent`` (a session
        of the same tenant; the caller checks it exists) when that is set.

        Raises:
            AlreadyExists: if the id is taken.
        """

    @abc.abstractmethod
    async def get_session(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> SessionRecord | None:
        """The session, or None if it does not exist."""

    @abc.abstractmethod
    async def list_sessions(
        self,
        *,
        after: str = "",
        limit: int = 100,
        tenant: str = DEFAULT_TENANT_ID,
        parent: str | None = None,
    ) -> list[SessionRecord]:
        """Up to ``limit`` of the tenant's sessions whose ids sort after ``after``, in id order;
        with ``parent``, only that session's children.

        Pass the last id of one page as ``after`` to get the next.

        Raises:
            InvalidArgument: if ``limit`` < 1.
        """

    @abc.abstractmethod
    async def append(
        self,
        session_id: str,
        events: Sequence[events_pb2.SessionEvent],
        *,
        tenant: str = DEFAULT_TENANT_ID,
        lease: LeaseOp | None = None,
        rows: Sequence[EventRow] | None = None,
    ) -> int:
        """Appends a batch atomically and durably; returns the new revision.

        ``lease`` (a compaction bracket's batch) is checked and applied under the same lock as
        the seqs (see ``store.leases``): when it is refused, nothing is appended. ``rows``: the
        batch as ``encode_batch`` (or ``encode_batch_in_steps``) made it, when the caller did;
        the store then writes them and does not encode ``events`` again.

        The events already carry their seqs, contiguous from the session's revision, and their
        times. When this returns, every event is synced to stable storage; when it raises,
        none of them is in the log. An empty batch appends nothing and returns the revision.
        A cancelled caller does not retract a batch already handed to the store: use event ids
        to make retries safe.

        Raises:
            NotFound: if the session does not exist.
            SeqConflict: if ``events[0].seq`` is not the session's revision (another writer
                appended first).
            InvalidArgument: if the batch is malformed (see :func:`encode_batch`) or a
                non-empty event id already exists in the session (reason
                ``DUPLICATE_EVENT_ID``).
            Unavailable: if the store is closed or the database failed; nothing was appended.
            Fenced: if ``lease`` holds or releases a lease another replica took over.
            CompactionBusy: if ``lease`` acquires or breaks a lease that is still held.
        """

    def commit(
        self,
        session_id: str,
        events: Sequence[events_pb2.SessionEvent],
        *,
        tenant: str = DEFAULT_TENANT_ID,
        lease: LeaseOp | None = None,
        rows: Sequence[EventRow] | None = None,
    ) -> Outcome[int]:
        """``append``, handed to the store now; its outcome is the returned future's.

        For a caller that must learn the outcome even when it is cancelled (a session's fold
        follows its log): awaiting the future, a cancelled caller is told so only once the
        batch committed or failed, and the future then says which. Raises what ``append``
        raises before the batch is handed over (a closed store, a refused lease)."""
        outcome: Outcome[int] = Outcome()
        task = asyncio.ensure_future(
            self.append(session_id, events, tenant=tenant, lease=lease, rows=rows)
        )
        task.add_done_callback(outcome.settle_from)
        return outcome

    @abc.abstractmethod
    def read(
        self,
        session_id: str,
        from_seq: int = 0,
        to_seq: int | None = None,
        *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> AsyncIterator[events_pb2.SessionEvent]:
        """Streams events with ``from_seq <= seq < to_seq`` in seq order, in chunks.

        ``to_seq`` None means the session's revision when the iteration starts: events appended
        during the iteration are not included, so one read is one consistent prefix.

        Raises (on first iteration):
            NotFound: if the session does not exist.
            InvalidArgument: for a negative ``from_seq`` or ``to_seq``.
        """

    @abc.abstractmethod
    async def read_seqs(
        self, session_id: str, seqs: Sequence[int], *, tenant: str = DEFAULT_TENANT_ID
    ) -> list[events_pb2.SessionEvent]:
        """The events at the given seqs, in ascending seq order, each once.

        Seqs outside the log are skipped; the caller compares against what it asked for.

        Raises:
            NotFound: if the session does not exist.
        """

    async def read_stored(
        self, session_id: str, seqs: Sequence[int], *, tenant: str = DEFAULT_TENANT_ID
    ) -> dict[int, bytes]:
        """The stored bytes of the events at the given seqs, by seq, unparsed (what a restore
        makes surface nodes of). Seqs outside the log are skipped.

        This default parses ``read_seqs`` and serializes each event again (deterministic: the
        bytes the fold admitted); a backend that can hand its rows over as they are does.

        Raises:
            NotFound: if the session does not exist.
        """
        events = await self.read_seqs(session_id, seqs, tenant=tenant)
        return {e.seq: e.SerializeToString(deterministic=True) for e in events}

    @abc.abstractmethod
    async def find_event_ids(
        self, session_id: str, event_ids: Sequence[str], *, tenant: str = DEFAULT_TENANT_ID
    ) -> dict[str, int]:
        """Maps each given event id that exists in the session to its seq.

        Ids not in the log (and empty ids) are absent from the result.

        Raises:
            NotFound: if the session does not exist.
        """

    @abc.abstractmethod
    async def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID) -> bool:
        """Removes the session and its whole log, durably; True if it existed.

        Afterwards the id is free: a create makes a new, empty session under it.
        """

    async def usage(
        self, *, tenant: str | None = None, session_id: str | None = None
    ) -> dict[str, StoreUsage]:
        """Sessions and stored bytes (each event's serialized size) by tenant id.

        Every tenant that owns a session, or only ``tenant``; with ``session_id`` too, only that
        session (what deleting it gives back). The quotas start from these figures. A backend
        that cannot tell raises ``NotImplementedError``: the server then refuses sessions and
        bytes quotas at start.
        """
        raise NotImplementedError(f"{type(self).__name__} does not report usage")

    async def take_append_token(self, tenant: str, rate: float, burst: float) -> float | None:
        """Take one ``AppendEvents`` token from ``tenant``'s bucket kept in the store, the one
        every replica shares (``burst`` tokens at most, refilled at ``rate`` a second).

        Returns 0.0 when taken, else the seconds until a token is there; None when the store
        keeps no buckets (the default: a store one process owns, whose quota book counts alone).
        """
        return None

    # ---- fold snapshots (issue 11): optional; a store without them restores by replay ----

    async def put_snapshot(
        self, session_id: str, revision: int, data: bytes, *, tenant: str = DEFAULT_TENANT_ID
    ) -> None:
        """Keeps ``data``, the session's fold snapshot at ``revision``, replacing the one kept.

        Atomic: after a crash at any point, ``get_snapshot`` answers the old snapshot or the new
        one whole, never a mix. A snapshot never precedes its events: the caller writes it only
        after ``[0, revision)`` committed. Opaque to the store (``core.snapshot`` writes it). The
        default keeps nothing, which is always correct (restores replay the whole log).
        ``delete_session`` removes the snapshot with the log.

        Raises:
            NotFound: if the session does not exist.
            Unavailable: if the store is closed or the database failed; the old snapshot stays.
        """
        del session_id, revision, data, tenant

    async def get_snapshot(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> tuple[int, bytes] | None:
        """The kept snapshot as ``(revision, data)``, or None (none kept, or the session does
        not exist)."""
        del session_id, tenant
        return None

    @property
    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the write counters."""

    # --- replicas: leases and change notifications -----------------------------------------

    @property
    def shared(self) -> bool:
        """Whether several processes serve this store at once (replicas), so a process's
        cached fold may fall behind the log. False for stores one process owns."""
        return False

    @abc.abstractmethod
    async def get_lease(self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID) -> Lease | None:
        """The session's bracket lease, with its remaining time by the store's clock."""

    @abc.abstractmethod
    async def renew_lease(
        self,
        session_id: str,
        owner: str,
        token: str,
        ttl_s: float,
        *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:
        """Extends the lease for ``ttl_s`` from now if it still names ``owner`` and ``token``;
        False when it was lost (the bracket is fenced)."""

    # --- prepared-ahead candidates (``store.candidates``, issue 35) ------------------------
    # The defaults keep them in process memory, as a store one process owns may
    # (``ProcessCandidates``); a shared store keeps them where every replica sees them.

    _candidate_table: ProcessCandidates | None = None

    @property
    def _candidates(self) -> ProcessCandidates:
        if self._candidate_table is None:
            self._candidate_table = ProcessCandidates(utc_now)
        return self._candidate_table

    async def get_candidate(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> Candidate | None:
        """The session's prepared-ahead candidate, its lease's remaining time by the store's
        clock; None when it has none."""
        return self._candidates.get((tenant, session_id))

    async def claim_candidate(
        self, session_id: str, claim: CandidateClaim, ttl_s: float, *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:  # fmt: skip
        """Takes the session's candidate for ``claim`` (lease ``ttl_s`` from now) unless another
        one holds it (``candidates.may_claim``); False then."""
        return self._candidates.claim((tenant, session_id), claim, ttl_s)

    async def renew_candidate(
        self, session_id: str, candidate_id: str, owner: str, ttl_s: float, *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:  # fmt: skip
        """Extends the preparer's lease; False when the candidate is gone or claimed over."""
        return self._candidates.renew((tenant, session_id), candidate_id, owner, ttl_s)

    async def finish_candidate(
        self, session_id: str, candidate_id: str, owner: str, summary: bytes, *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:  # fmt: skip
        """Stores the prepared summary; False when the candidate is gone or claimed over."""
        return self._candidates.finish((tenant, session_id), candidate_id, owner, summary)

    async def drop_candidate(
        self, session_id: str, candidate_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> bool:
        """Removes candidate ``candidate_id`` (applied, or judged stale); False when the session
        holds another one or none."""
        return self._candidates.drop((tenant, session_id), candidate_id)

    async def changes(self) -> AsyncIterator[tuple[str, str]]:
        """(tenant, session id) of sessions other processes appended to or deleted, as they
        commit.

        A wake-up only: the subscriber catches up by seq. ``("", "")`` means "any session may
        have changed" (after a lost connection). A store one process owns never yields.
        """
        await asyncio.Event().wait()
        yield "", ""  # pragma: no cover - unreachable: gives the method its generator type

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
