"""The session fold: everything compactd derives from one session's log, kept incrementally.

``SessionFold.admit`` checks a batch against the current state, assigns seqs and folds it in one
step; ``rollback`` reverts an admitted batch (for a store commit that failed). Restoring a session
is ``admit`` over its stored events with checks off: the log was valid when it was written.

A runtime's batch (``Origin.CLIENT``) must also keep the step brackets: an ``assistant/message``
APPEND only inside an open step (``step/start`` ... ``step/end``); a ``step/start`` needs no other
step open (its turn need not have been opened with ``turn/start``: the reference accepts such a
step, and its own logs hold them); a ``step/end`` names the open step; a turn ends only after its
open step did. Violations carry reason ``STEP_BRACKET``. ``tool/result``s may follow the step that
made their calls. compactd's own appends (``Origin.SERVER``) are trusted;
the fold tracks the open step for every origin, restores included.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Final, NamedTuple, NoReturn

from google.protobuf.timestamp_pb2 import Timestamp

from compactd.core import events as ev
from compactd.core import header as hdr
from compactd.core.events import SessionEvent
from compactd.core.limits import NODE_OVERHEAD_BYTES, node_bytes
from compactd.core.lock import LockState, live_bracket
from compactd.core.offload import INPUT_KINDS, image_count
from compactd.core.pins import pins_message, with_pins
from compactd.core.projection import Message, derive_messages
from compactd.core.steps import run_to_end
from compactd.core.surface import Surface, SurfaceChange, SurfaceNode
from compactd.core.validation import Origin, check_origin_in_steps
from compactd.errors import CompactionBusy, FieldViolation, InvalidArgument, ResourceExhausted
from compactd.reasons import Reason
from compactd.v1 import events_pb2

#: Identified events whose ids a fold keeps (``SessionFold.event_ids``): a runtime retries its
#: latest batch, so the ids of the latest events answer nearly every retry without the store,
#: and the map's memory follows this bound rather than the log's length.
RECENT_EVENT_IDS: Final = 1024

#: Bracket ids a fold keeps (``SessionFold.compaction_ids``) to refuse a ``compaction/start``
#: that reuses one. Only the server appends that event, with a fresh random id per bracket, so
#: a reuse is a retried start: a recent one. The set's memory follows this bound, not the
#: number of brackets the log ever held.
RECENT_COMPACTION_IDS: Final = 64


class OpenSubagent(NamedTuple):
    """A sub-agent started and not ended: its ``subagent/start``'s seq, spawning tool call and
    one-line task."""

    seq: int
    tool_call_id: str
    task: str


@dataclass(slots=True)
class AdmittedBatch:
    """What one admitted batch did, for the store, the meter and ``rollback``."""

    first_seq: int
    events: list[SessionEvent]
    surface_changes: list[SurfaceChange] = field(default_factory=list)
    reprojected: set[int] = field(default_factory=set)  # node seqs whose projection changed
    header_changed: bool = False
    rewrites: bool = (
        False  # it holds a rewrite (see ``SessionFold.rewritten_at``), not appends only
    )
    byte_size: int = 0  # the admitted events' ``ByteSize`` (as stored), summed; 0 for a restore
    answered: list[int] = field(default_factory=list)  # appended assistant/messages with usage
    # The events it was admitted from (the caller's: what a meter's prices made ahead of the
    # admission were made from, ``SessionMeter.count_ahead``).
    source: Sequence[SessionEvent] = ()
    # Undo records, ``(function, *arguments)`` each: one tuple for what ``_fold`` does to every
    # event, where closures or partials would hold the collector's young generation several
    # objects per event (a large batch's young collections are pauses of the event loop).
    _undo: list[tuple[Any, ...]] = field(default_factory=list, repr=False)

    def serialized(self) -> dict[int, bytes]:
        """The deterministic bytes of the batch's surface events, by seq: their nodes keep them,
        so a store need not serialize those events again (``encode_batch_in_steps``)."""
        return {change.node.seq: change.node.data for change in self.surface_changes}

    def release(self) -> list[list[Any]]:
        """Empty the batch's per-event lists (its events, their surface changes, its undo
        records) into the lists returned, for the caller to free a chunk at a time: a committed
        batch is not rolled back, and 1,000 events freed at once hold the caller for
        milliseconds. Afterwards the batch names only its first seq and its counts."""
        held: list[list[Any]] = [self._undo, self.surface_changes, self.events]
        self._undo, self.surface_changes, self.events = [], [], []
        self.source = ()
        return held


class SessionFold:
    """Folded state of one session's log."""

    def __init__(self) -> None:
        self.revision = 0
        self.surface = Surface()
        self.lock = LockState()
        self.header: events_pb2.RequestHeader | None = None
        self.header_seq = -1
        self.replacements_at_header = 0
        self.open_turns: set[int] = set()
        self.open_step: tuple[int, int] | None = None  # (turn, step) between step/start and /end
        self.offloads: dict[int, frozenset[int]] = {}  # node seq -> offloaded image indexes
        self.offload_generation = 0  # image/offload events folded (they change what nodes send)
        # The pins in force: key -> (seq, text) of its latest ``state/pin`` (cleared keys gone),
        # and the seq of the latest ``state/pin`` folded (-1: none), which the meter keys on.
        self.pins: dict[str, tuple[int, str]] = {}
        self.pins_seq = -1
        # Sub-agents started and not ended: child session id -> its ``subagent/start``.
        self.open_subagents: dict[str, OpenSubagent] = {}
        # Event id -> seq of the latest identified events, oldest first: at most
        # ``RECENT_EVENT_IDS`` before a batch, and the batch's own (``_forget_older_ids``). The
        # log holds them all; the service asks the store about older ones.
        self.event_ids: dict[str, int] = {}
        # The latest ``RECENT_COMPACTION_IDS`` bracket ids before a batch, and the batch's own,
        # oldest first (a dict as an ordered set).
        self.compaction_ids: dict[str, None] = {}
        self.restored_at = -1  # seq of the session/end-seed this process appended, if any
        # Seq of the latest event that changed what an earlier request showed (a surface
        # REPLACE, an image/offload, a request/header): a request built at a later revision is
        # still the prefix of today's (``appended_since``). Events a fold did not admit itself
        # (a snapshot restore sets ``revision``) are not seen here: ``appended_since`` then
        # trusts only revisions from the restored one on.
        self.rewritten_at = -1
        self._folded = 0  # events this fold admitted itself (a snapshot restore sets revision)
        # What reads of the surface and the header carry, bounded by ``max_surface_bytes``.
        self.surface_bytes = 0
        # Current node seq -> its ``node_bytes`` where that is not ``_node_bytes(node)`` (images
        # offloaded): a map of every node would cost more than a tenth of the surface's bytes.
        self._node_bytes: dict[int, int] = {}

    def admit(
        self,
        events: Sequence[SessionEvent],
        *,
        now: Timestamp | None = None,
        check: bool = True,
        origin: Origin = Origin.SERVER,
        max_surface_bytes: int | None = None,
    ) -> AdmittedBatch:
        """Assign seqs to copies of ``events``, check them against the state, and fold them.

        Raises ``InvalidArgument`` (or a subclass), ``CompactionBusy`` or ``ResourceExhausted``
        and leaves the state unchanged when any event may not fold. Events already stored keep
        their seq when ``check`` is off. ``origin`` CLIENT refuses server-only events
        (``SERVER_ONLY_EVENT``), enforces the step brackets (``STEP_BRACKET``) and refuses a
        batch that grows ``surface_bytes`` past ``max_surface_bytes`` (``SURFACE_FULL``).
        """
        return run_to_end(
            self.admit_in_steps(
                events, now=now, check=check, origin=origin, max_surface_bytes=max_surface_bytes
            )
        )

    def admit_in_steps(
        self,
        events: Sequence[SessionEvent],
        *,
        now: Timestamp | None = None,
        check: bool = True,
        origin: Origin = Origin.SERVER,
        max_surface_bytes: int | None = None,
        step: int = 256,
        origin_checked: bool = False,
    ) -> Generator[None, None, AdmittedBatch]:
        """``admit``, pausing (``yield``) after every ``step`` events so a caller on an event loop
        can let other work run; the generator returns the batch. Closing it before it returns
        rolls back what it admitted. ``origin_checked``: the caller refused the batch's
        server-only events for ``origin`` already (``check_batch`` does)."""
        if check and not origin_checked:
            yield from check_origin_in_steps(events, origin)
        self._forget_older_ids()
        client = check and origin is Origin.CLIENT
        batch = AdmittedBatch(self.revision, [], source=events)
        before = self.surface_bytes
        try:
            for index, event in enumerate(events):
                if index and not index % step:
                    yield
                self._admit_one(event, batch, now, check, client)
            if client and max_surface_bytes is not None:
                self._check_surface_size(before, max_surface_bytes)
        except InvalidArgument as error:
            index = len(batch.events)  # the event that failed
            self.rollback(batch)
            # Point each violation at the event in the request: ``events[2].surface_op``.
            error.violations = tuple(
                FieldViolation(f"events[{index}].{v.field}", v.description)
                for v in error.violations
            )
            raise
        except BaseException:
            self.rollback(batch)
            raise
        return batch

    def rollback(self, batch: AdmittedBatch) -> None:
        """Revert an admitted batch (the most recent one)."""
        for function, *arguments in reversed(batch._undo):
            function(*arguments)
        batch._undo.clear()

    def _check_surface_size(self, before: int, limit: int) -> None:
        after = self.surface_bytes
        if after > limit and after > before:  # a batch that shrinks an over-full surface may
            raise ResourceExhausted(
                f"the session's surface and header would hold {after} bytes, more than its "
                f"{limit}-byte limit (max_surface_bytes); compact the session or start a new one",
                reason=Reason.SURFACE_FULL,
                metadata={"limit": str(limit), "surface_bytes": str(before), "after": str(after)},
            )

    def messages(self) -> list[Message]:
        """The request's messages: derived from the surface with projections applied, and the
        pinned-state message (``core.pins``) right after the system head."""
        messages = derive_messages(((n.seq, n.event) for n in self.surface), self.offloads)
        return with_pins(messages, self.pins_message(), head=self.head_projects())

    def pin_texts(self) -> dict[str, str]:
        """The pins in force: key -> text."""
        return {key: text for key, (_, text) in self.pins.items()}

    def pins_message(self) -> Message | None:
        """The pinned-state message of the pins in force (None: no pin is in force)."""
        return pins_message(self.pin_texts()) if self.pins else None

    def head_projects(self) -> bool:
        """Whether the surface opens with a system head that projects to a message."""
        nodes = self.surface.nodes
        if not nodes or nodes[0].type != ev.SYSTEM_MESSAGE:
            return False
        return bool(nodes[0].event.system_message.text)

    def _admit_one(
        self,
        source: SessionEvent,
        batch: AdmittedBatch,
        now: Timestamp | None,
        check: bool,
        client: bool,
    ) -> None:
        seq = self.revision
        size: int | None = None
        kind = source.WhichOneof("body") or ""  # ``ev.body_name``, once per event
        surface = kind in ev.SURFACE_BODIES
        # The surface op's kind (0: none), read once for the surface's check and apply.
        op = source.surface_op.kind if surface and source.HasField("surface_op") else 0
        if check:
            event = SessionEvent()
            event.CopyFrom(source)
        else:  # a stored event the restore owns: kept as parsed (a copy would double its RSS)
            event = source
        data: bytes | None = None
        if check:
            event.seq = seq
            if now is not None and not event.HasField("time"):
                event.time.CopyFrom(now)
            if event.event_id and event.event_id in self.event_ids:
                # The service answers retries before admitting; a known id here is a reuse.
                _invalid("event_id", f"{event.event_id!r} is already in the log")
            if surface:
                self.surface.check(event, seq, op)
            if client and kind in _STEP_RULED:
                self._check_step_rules(event, kind)
            if not surface:  # the log's rules are about log-only events
                self._check_log_rules(event, kind, seq)
            # Once: the surface bound and the tenant's quota read its length; a surface node
            # and the store keep these very bytes.
            if surface:
                data = event.SerializeToString(deterministic=True)
                size = len(data)
            else:
                size = event.ByteSize()
        elif event.seq != seq:
            raise InvalidArgument(
                f"stored log is not contiguous: expected seq {seq}, got {event.seq}"
            )
        self._fold(event, kind, seq, batch, data, surface, op)
        if size is not None:  # the fold fills in a header's reason: count the header as stored
            batch.byte_size += event.ByteSize() if kind == "request_header" else size
        batch.events.append(event)

    def appended_since(self, revision: int) -> list[SurfaceNode] | None:
        """The surface nodes appended at or after ``revision``, in order, when that is all that
        changed since: the request built at ``revision`` plus these nodes' messages is the request
        now. None when a replacement, an image offload or a header landed since (or ``revision``
        is not one of this log's). Costs the nodes returned, not the surface."""
        unseen = self.revision - self._folded  # a restored prefix whose rewrites are unknown
        if not max(0, unseen) <= revision <= self.revision or self.rewritten_at >= revision:
            return None
        nodes = self.surface.nodes
        first = len(nodes)
        while first > 0 and nodes[first - 1].seq >= revision:
            first -= 1
        return list(nodes[first:])

    def _fold(
        self,
        event: SessionEvent,
        kind: str,
        seq: int,
        batch: AdmittedBatch,
        data: bytes | None = None,
        surface: bool = False,
        op: int = 0,
    ) -> None:
        """Fold ``event`` (its body is ``kind``, a surface body if ``surface``; ``data``: its
        deterministic bytes, if known; ``op``: its surface op's kind, 0 without one)."""
        self.revision += 1
        self._folded += 1
        replace = op in _REWRITING  # ``ev.is_replace(event) or ev.is_insert(event)``
        if replace or kind in _REWRITES:  # a rewrite, not an append
            batch._undo.append((setattr, self, "rewritten_at", self.rewritten_at))
            self.rewritten_at = seq
            batch.rewrites = True
        event_id = event.event_id
        if event_id:
            self.event_ids[event_id] = seq
        undo = len(batch._undo)
        batch._undo.append((SessionFold._unfold, self, event_id, None))
        if surface:
            change = self.surface.apply(event, seq, data, op, kind)
            batch.surface_changes.append(change)
            batch._undo[undo] = (SessionFold._unfold, self, event_id, change)
            if change.shadowed:
                self._drop_sizes(change.shadowed, batch)
            self.surface_bytes += _node_bytes(change.node)  # a new node: its read size is its own
            self._node_bytes.pop(change.node.seq, None)  # ``_set_node_bytes`` of that size
        usage = kind == "assistant_message" and event.assistant_message.HasField("usage")
        if usage and not replace:  # what the calibration reads, not every event
            batch.answered.append(seq)
        if kind == "request_header":
            self._fold_header(event, seq, batch)
        elif kind in ("turn_start", "turn_end"):
            self._fold_turn(event, kind, batch)
        if kind in ("step_start", "step_end", "turn_end"):
            self._fold_step(event, kind, batch)
        elif kind == "image_offload":
            self._fold_offload(event, batch)
        elif kind == "state_pin":
            self._fold_pin(event, seq, batch)
        elif kind in ("subagent_start", "subagent_end"):
            self._fold_subagent(event, kind, seq, batch)
        if kind == "compaction_start":
            compaction_id = event.compaction_start.compaction_id
            self.compaction_ids[compaction_id] = None
            batch._undo.append((self.compaction_ids.pop, compaction_id, None))
        if kind in ("compaction_start", "compaction_end", "session_end_seed"):
            before = self.lock.copy()
            self.lock.apply(event, seq)
            batch._undo.append((setattr, self, "lock", before))

    def _resize(self, node: SurfaceNode, size: int | None, batch: AdmittedBatch) -> None:
        """Record a resident ``node``'s new read size (None: it left the surface), undoably."""
        previous = self._size_of(node)
        self.surface_bytes += (size or 0) - previous
        self._set_node_bytes(node, size)
        batch._undo.append((SessionFold._undo_resize, self, node, size, previous))

    def _drop_sizes(self, nodes: Sequence[SurfaceNode], batch: AdmittedBatch) -> None:
        """``_resize(node, None, batch)`` for each of ``nodes`` (a REPLACE's shadowed span,
        distinct nodes), with one undo for them all."""
        sizes = self._node_bytes
        previous = [sizes.pop(node.seq, 0) or _node_bytes(node) for node in nodes]
        self.surface_bytes -= sum(previous)
        batch._undo.append((SessionFold._undo_drop_sizes, self, nodes, previous))

    def _undo_drop_sizes(self, nodes: Sequence[SurfaceNode], previous: Sequence[int]) -> None:
        self.surface_bytes += sum(previous)
        for node, size in zip(nodes, previous, strict=True):
            self._set_node_bytes(node, size)

    def _size_of(self, node: SurfaceNode) -> int:
        return self._node_bytes.get(node.seq) or _node_bytes(node)

    def restore_sizes(self) -> None:
        """Recompute ``surface_bytes`` from the surface, offloads and header (after a snapshot
        set them directly)."""
        offloads = self.offloads
        self._node_bytes = {
            n.seq: node_bytes(n.event, offloads[n.seq]) for n in self.surface if n.seq in offloads
        }
        header = self.header.ByteSize() if self.header is not None else 0
        pins = sum(_pin_bytes(pin) for pin in self.pins.values())
        self.surface_bytes = sum(self._size_of(n) for n in self.surface) + header + pins

    def _undo_resize(self, node: SurfaceNode, size: int | None, previous: int) -> None:
        self.surface_bytes -= (size or 0) - previous
        self._set_node_bytes(node, previous)

    def _set_node_bytes(self, node: SurfaceNode, size: int | None) -> None:
        if size is None or size == _node_bytes(node):
            self._node_bytes.pop(node.seq, None)
        else:
            self._node_bytes[node.seq] = size

    def _forget_older_ids(self) -> None:
        """Keep the ids of the latest ``RECENT_EVENT_IDS`` identified events and of the latest
        ``RECENT_COMPACTION_IDS`` brackets only. Done as a batch begins, when the one before it
        can no longer be rolled back: a rollback then takes out the batch's own ids and leaves
        the rest as they were."""
        for ids, kept in (
            (self.event_ids, RECENT_EVENT_IDS),
            (self.compaction_ids, RECENT_COMPACTION_IDS),
        ):
            for _ in range(len(ids) - kept):
                del ids[next(iter(ids))]

    def _unfold(self, event_id: str, change: SurfaceChange | None) -> None:
        """Undo what ``_fold`` does for every event: the node it added (its size, its surface
        change), its event id, the revision."""
        if change is not None:
            self.surface_bytes -= _node_bytes(change.node)
            self._set_node_bytes(change.node, None)
            self.surface.undo(change)
        if event_id:
            self.event_ids.pop(event_id, None)
        self.revision -= 1
        self._folded -= 1

    def _fold_header(self, event: SessionEvent, seq: int, batch: AdmittedBatch) -> None:
        previous = (self.header, self.header_seq, self.replacements_at_header)
        proposed = event.request_header
        if proposed.reason == events_pb2.HEADER_REASON_UNSPECIFIED:
            # The server records why the header was logged when the runtime did not say.
            verdict = hdr.classify(
                self.header,
                proposed,
                series_boundary=self.surface.replacements != self.replacements_at_header,
                resuming=self.restored_at >= 0 and self.header_seq < self.restored_at,
            )
            if verdict is not None:  # None: a redundant snapshot, recorded without a reason
                proposed.reason = verdict.reason
                proposed.starts_series = verdict.starts_series
        self.header = hdr.canonical(proposed)
        self.header_seq = seq
        self.replacements_at_header = self.surface.replacements
        batch.header_changed = True
        grown = self.header.ByteSize() - (previous[0].ByteSize() if previous[0] else 0)
        self.surface_bytes += grown

        def undo() -> None:
            self.header, self.header_seq, self.replacements_at_header = previous
            self.surface_bytes -= grown

        batch._undo.append((undo,))

    def _fold_turn(self, event: SessionEvent, kind: str, batch: AdmittedBatch) -> None:
        before = set(self.open_turns)
        if kind == "turn_start":
            self.open_turns.add(event.turn_start.turn)
        else:
            self.open_turns.discard(event.turn_end.turn)
        batch._undo.append((setattr, self, "open_turns", before))

    def _fold_step(self, event: SessionEvent, kind: str, batch: AdmittedBatch) -> None:
        before = self.open_step
        if kind == "step_start":
            self.open_step = (event.step_start.turn, event.step_start.step)
        elif kind == "step_end" or (before is not None and before[0] == event.turn_end.turn):
            self.open_step = None  # a trusted or stored log's stray end still closes the step
        if self.open_step != before:
            batch._undo.append((setattr, self, "open_step", before))

    def _check_step_rules(self, event: SessionEvent, kind: str) -> None:
        open_step = self.open_step
        if kind == "assistant_message" and not ev.is_replace(event) and open_step is None:
            _step_violation(
                "assistant_message",
                "an assistant/message is appended only inside an open step "
                "(step/start ... step/end)",
            )
        elif kind == "step_start":
            if open_step is not None:
                _step_violation(
                    "step_start", f"step {open_step[1]} of turn {open_step[0]} is still open"
                )
        elif kind == "step_end":
            named = (event.step_end.turn, event.step_end.step)
            if named != open_step:
                now = (
                    "no step is open"
                    if open_step is None
                    else (f"the open step is step {open_step[1]} of turn {open_step[0]}")
                )
                _step_violation(
                    "step_end", f"step {named[1]} of turn {named[0]} is not open: {now}"
                )
        elif kind == "turn_end" and open_step is not None and open_step[0] == event.turn_end.turn:
            _step_violation(
                "turn_end.turn",
                f"step {open_step[1]} of turn {open_step[0]} is still open; end it first",
            )

    def _fold_offload(self, event: SessionEvent, batch: AdmittedBatch) -> None:
        self.offload_generation += 1
        batch._undo.append((setattr, self, "offload_generation", self.offload_generation - 1))
        for target in event.image_offload.targets:
            previous = self.offloads.get(target.seq)
            self.offloads[target.seq] = (previous or frozenset()) | frozenset(target.image_indexes)
            batch.reprojected.add(target.seq)
            batch._undo.append((SessionFold._restore_offload, self, target.seq, previous))
            position = self.surface.position_of(target.seq)
            if position is not None:  # a stored log may name a node no longer on the surface
                node = self.surface[position]
                self._resize(node, node_bytes(node.event, self.offloads[target.seq]), batch)

    def _fold_pin(self, event: SessionEvent, seq: int, batch: AdmittedBatch) -> None:
        pin = event.state_pin
        previous, previous_seq = self.pins.get(pin.key), self.pins_seq
        if pin.clear:
            self.pins.pop(pin.key, None)
        else:
            self.pins[pin.key] = (seq, pin.text)
        self.pins_seq = seq
        grown = _pin_bytes(self.pins.get(pin.key)) - _pin_bytes(previous)
        self.surface_bytes += grown
        batch._undo.append((SessionFold._unfold_pin, self, pin.key, previous, previous_seq, grown))

    def _unfold_pin(
        self, key: str, previous: tuple[int, str] | None, previous_seq: int, grown: int
    ) -> None:
        if previous is None:
            self.pins.pop(key, None)
        else:
            self.pins[key] = previous
        self.pins_seq = previous_seq
        self.surface_bytes -= grown

    def _fold_subagent(
        self, event: SessionEvent, kind: str, seq: int, batch: AdmittedBatch
    ) -> None:
        child = getattr(event, kind).child_session_id
        previous = self.open_subagents.get(child)
        if kind == "subagent_start":
            start = event.subagent_start
            self.open_subagents[child] = OpenSubagent(seq, start.tool_call_id, start.task)
        else:
            self.open_subagents.pop(child, None)
        batch._undo.append((SessionFold._restore_subagent, self, child, previous))

    def _restore_subagent(self, child: str, previous: OpenSubagent | None) -> None:
        if previous is None:
            self.open_subagents.pop(child, None)
        else:
            self.open_subagents[child] = previous

    def _restore_offload(self, seq: int, previous: frozenset[int] | None) -> None:
        if previous is None:
            self.offloads.pop(seq, None)
        else:
            self.offloads[seq] = previous

    def _check_log_rules(self, event: SessionEvent, kind: str, seq: int) -> None:
        if kind == "compaction_start":
            live = live_bracket(self.lock)
            if live is not None:
                raise CompactionBusy(
                    f"compaction {live.compaction_id} (seq {live.start_seq}) is still open",
                    metadata={
                        "compaction_id": live.compaction_id,
                        "start_seq": str(live.start_seq),
                    },
                )
            if event.compaction_start.compaction_id in self.compaction_ids:
                _invalid("compaction_start.compaction_id", "a compaction id is used once")
        elif kind == "compaction_end":
            if event.compaction_end.compaction_id not in self.lock.open_starts:
                _invalid("compaction_end.compaction_id", "names no open compaction/start")
        elif kind == "turn_start" and event.turn_start.turn in self.open_turns:
            _invalid("turn_start.turn", f"turn {event.turn_start.turn} is already open")
        elif kind == "image_offload":
            self._check_offload(event)
        elif kind == "state_pin" and event.state_pin.clear:
            if event.state_pin.key not in self.pins:
                _invalid("state_pin.key", f"no pin {event.state_pin.key!r} is in force to clear")
        elif kind == "subagent_start":
            child = event.subagent_start.child_session_id
            if child in self.open_subagents:
                _invalid(
                    "subagent_start.child_session_id",
                    f"sub-agent {child!r} is already open (seq {self.open_subagents[child].seq})",
                )
        elif kind == "subagent_end":
            child = event.subagent_end.child_session_id
            if child not in self.open_subagents:
                _invalid("subagent_end.child_session_id", f"no sub-agent {child!r} is open")

    def _check_offload(self, event: SessionEvent) -> None:
        """An ``image/offload`` names at least one target; each target a distinct current
        ``user/message`` or ``tool/result`` node and, strictly increasing, indexes of its image
        blocks."""
        targets = event.image_offload.targets
        if not targets:
            _invalid("image_offload.targets", "an offload selects at least one image")
        seen: set[int] = set()
        for i, target in enumerate(targets):
            field_name = f"image_offload.targets[{i}]"
            if target.seq in seen:
                _invalid(f"{field_name}.seq", f"node {target.seq} is targeted twice")
            seen.add(target.seq)
            position = self.surface.position_of(target.seq)
            if position is None:
                _invalid(f"{field_name}.seq", f"{target.seq} is not a current surface node")
            node_event = self.surface[position].event
            if ev.body_name(node_event) not in INPUT_KINDS:
                _invalid(f"{field_name}.seq", "only user and tool input images can be offloaded")
            images = image_count(node_event)
            indexes = list(target.image_indexes)
            if not indexes or min(indexes) < 0 or max(indexes) >= images:
                _invalid(
                    f"{field_name}.image_indexes",
                    f"non-empty indexes in 0..{images - 1}: the node has {images} image(s)",
                )
            if any(a >= b for a, b in pairwise(indexes)):
                _invalid(f"{field_name}.image_indexes", "indexes must be strictly increasing")


#: Log-only events that change what an earlier request showed (see ``rewritten_at``).
_REWRITES: Final = frozenset({"image_offload", "request_header", "state_pin"})
#: Surface ops that rewrite the surface rather than append to it.
_REWRITING: Final = frozenset(
    {events_pb2.SURFACE_OP_KIND_REPLACE, events_pb2.SURFACE_OP_KIND_INSERT}
)
#: The events ``_check_step_rules`` has a rule for.
_STEP_RULED: Final = frozenset({"assistant_message", "step_start", "step_end", "turn_end"})


def _pin_bytes(pin: tuple[int, str] | None) -> int:
    """What a pin in force adds to a request's bytes (its text's UTF-8 length), 0 for none."""
    return 0 if pin is None else len(pin[1].encode("utf-8")) + NODE_OVERHEAD_BYTES


def _node_bytes(node: SurfaceNode) -> int:
    """``node_bytes`` of a node nothing is offloaded from, from the bytes it keeps."""
    return len(node.data) + NODE_OVERHEAD_BYTES


def _invalid(field_name: str, description: str) -> NoReturn:
    raise InvalidArgument(
        f"{field_name}: {description}", violations=[FieldViolation(field_name, description)]
    )


def _step_violation(field_name: str, description: str) -> NoReturn:
    raise InvalidArgument(
        f"step bracket broken: {field_name}: {description}",
        violations=[FieldViolation(field_name, description)],
        reason=Reason.STEP_BRACKET,
    )
