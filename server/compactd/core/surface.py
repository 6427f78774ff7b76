"""The surface: the model-visible node sequence folded from the append-only log.

An APPEND surface event adds a node at the end. A REPLACE locates ``start_seq`` and ``end_seq``
by their *current surface positions* (never ``start <= seq <= end``), shadows that contiguous
span and puts the new node at the span's position. The fold is incremental: ``apply`` costs what
the change touches, and ``undo`` reverts a change so a batch can be applied atomically.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeAlias

from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.core.pairing import CorruptPairing
from compactd.errors import FieldViolation, ReplacementRejected
from compactd.speed import untrack
from compactd.v1 import events_pb2

#: A call index entry: the one seq of a call id's node, or the seqs of several (a tuple of one
#: costs 56 bytes, a set 216; a bare int is the node's own ``seq`` object).
_Seqs: TypeAlias = int | tuple[int, ...]


class SurfaceNode:
    """One surface node: the event that created it (its ``seq`` is the node's identity).

    The event is kept serialized (``data``) and parsed when read (``event``): a parsed event
    holds about 1 KiB of protobuf arena beyond its bytes, so a resident surface of parsed events
    costs over twice its bytes. What the fold's hot paths read of every node (its type, the calls
    it makes, the call it answers) is kept beside the bytes. Immutable.

    Not tracked by the cyclic collector: a node holds an int, bytes, strings and a tuple of
    strings, none of which can lead back to it, so it is in no reference cycle (CPython untracks
    such tuples and dicts itself). Tracked, every resident node would lengthen each full
    collection, a pause of the event loop (about 0.1 ms per thousand objects).
    """

    __slots__ = ("answers", "calls", "data", "seq", "type")

    def __init__(
        self, seq: int, event: SessionEvent, data: bytes | None = None, kind: str | None = None
    ) -> None:
        self.seq = seq
        # Deterministic: the log's row of the event holds these very bytes
        # (``AdmittedBatch.serialized``; a surface event holds no map field, so both ways of
        # serializing it give the same bytes).
        self.data = event.SerializeToString(deterministic=True) if data is None else data
        if kind is None:  # read once: ``ev.event_type``, ``tool_call_ids`` (or the caller's)
            kind = event.WhichOneof("body") or ""
        self.type = ev.EVENT_TYPES.get(kind, "")
        calls = ev.tool_call_ids(event) if kind == "assistant_message" else ()
        self.calls: tuple[str, ...] = tuple(calls) if calls else ()
        self.answers = event.tool_result.tool_call_id if kind == "tool_result" else ""
        untrack(self)  # compactd.speed: see the class docstring

    @classmethod
    def of_stored(
        cls, seq: int, data: bytes, type_: str, calls: tuple[str, ...], answers: str
    ) -> SurfaceNode:
        """The node of the stored event ``data`` at ``seq`` whose facts (its type, the calls
        it makes, the call it answers) a snapshot kept: made without parsing the event."""
        node = cls.__new__(cls)
        node.seq, node.data, node.type = seq, data, type_
        node.calls, node.answers = calls, answers
        untrack(node)  # compactd.speed: see the class docstring
        return node

    @property
    def event(self) -> SessionEvent:
        """The node's event, parsed anew: a copy (changing it changes no node)."""
        return SessionEvent.FromString(self.data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SurfaceNode):
            return NotImplemented
        return self.seq == other.seq and self.data == other.data

    def __hash__(self) -> int:
        return hash((self.seq, self.data))

    def __repr__(self) -> str:
        return f"SurfaceNode(seq={self.seq}, type={self.type!r}, {len(self.data)} bytes)"


@dataclass(frozen=True, slots=True)
class SurfaceChange:
    """What one surface event did: the node at ``position`` replaced ``shadowed`` (none: APPEND,
    or an INSERT when ``inserted``)."""

    position: int
    node: SurfaceNode
    shadowed: tuple[SurfaceNode, ...]
    inserted: bool = False


class Surface:
    """The current surface of one session."""

    def __init__(self) -> None:
        self._nodes: list[SurfaceNode] = []
        self._position: dict[int, int] = {}  # seq -> position, for current nodes
        self._calls: dict[str, int] = {}  # tool call id -> count of current nodes making it
        # Kept so selection reads the tail it needs, not the whole surface (``core.selection``):
        self._makers: dict[str, _Seqs] = {}  # call id -> seqs of current nodes making it
        self._answers: dict[str, _Seqs] = {}  # call id -> seqs of current results naming it
        self._unanswered: set[str] = set()  # call ids made on the surface, answered by no node
        self._repeated: set[str] = set()  # call ids more than one current node makes
        self._ever_repeated = False  # whether any call id was ever made by two nodes at once
        self._unanswered_at: tuple[int, frozenset[str]] = (-1, frozenset())  # (changes, ids)
        self.replacements = 0  # replacement generation: REPLACE events folded so far
        # What shadowed each node is not kept: it grows with the log, and only inspection reads
        # it (``shadow_history`` derives it from the log).
        self.changes = 0  # every apply and undo, never decremented: "has anything changed?"

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[SurfaceNode]:
        return iter(self._nodes)

    def __getitem__(self, position: int) -> SurfaceNode:
        return self._nodes[position]

    @property
    def nodes(self) -> Sequence[SurfaceNode]:
        """Nodes in position order (read-only view)."""
        return self._nodes

    def position_of(self, seq: int) -> int | None:
        """The current position of the node created by ``seq``, or None if it is not a node."""
        return self._position.get(seq)

    def unanswered_calls(self) -> set[str]:
        """Call ids on the surface that no later ``tool/result`` answers (as
        ``selection.open_calls`` walks them), without walking the surface."""
        if self._unanswered_at[0] == self.changes:
            return set(self._unanswered_at[1])
        found = set(self._unanswered)
        for call_id in self._repeated:  # rare: only then may every answer precede the first call
            answers = _seqs(self._answers.get(call_id))
            first = self.first_call_position(call_id)
            if answers and first is not None and all(self._position[s] < first for s in answers):
                found.add(call_id)
        self._unanswered_at = (self.changes, frozenset(found))
        return found

    def first_call_position(self, call_id: str) -> int | None:
        """The position of the earliest current node making ``call_id`` (None: none does)."""
        makers = self._makers.get(call_id)
        if makers is None:
            return None
        if isinstance(makers, int):
            return self._position[makers]
        return min(self._position[seq] for seq in makers)

    def check(self, event: SessionEvent, seq: int, op: int | None = None) -> None:
        """Raise ``ReplacementRejected`` or ``CorruptPairing`` if ``event`` may not fold.
        ``op``: its ``_op_kind``, when the caller has it."""
        if op is None:
            op = _op_kind(event)
        if event.source_event_seqs or op == events_pb2.SURFACE_OP_KIND_REPLACE:
            # an append cites no sources (nearly every event): nothing to compare
            _check_sources(event, seq, op == events_pb2.SURFACE_OP_KIND_REPLACE)
        if op == events_pb2.SURFACE_OP_KIND_REPLACE:
            self._check_replace(event, seq)
        elif op == events_pb2.SURFACE_OP_KIND_INSERT:
            self._check_insert(event, seq)
        if event.HasField("tool_result"):
            self._check_result_has_call(event)

    def apply(
        self,
        event: SessionEvent,
        seq: int,
        data: bytes | None = None,
        op: int | None = None,
        kind: str | None = None,
    ) -> SurfaceChange:
        """Fold one surface event (call ``check`` first). ``data``: its deterministic bytes,
        ``op``: its ``_op_kind``, ``kind``: its body, when the caller has them. Returns the
        change, for ``undo``."""
        self.changes += 1
        node = SurfaceNode(seq, event, data, kind)
        if op is None:
            op = _op_kind(event)
        if op == events_pb2.SURFACE_OP_KIND_INSERT:
            position = self._position[event.surface_op.start_seq] + 1
            self._splice(position, (), (node,))
            return SurfaceChange(position, node, (), inserted=True)
        if op != events_pb2.SURFACE_OP_KIND_REPLACE:
            position = len(self._nodes)
            self._nodes.append(node)
            self._position[seq] = position
            if node.calls or node.answers:  # most messages make and answer no call
                self._track_calls(node, +1)
            return SurfaceChange(position, node, ())
        start = self._position[event.surface_op.start_seq]
        end = self._position[event.surface_op.end_seq]
        shadowed = tuple(self._nodes[start : end + 1])
        self._splice(start, shadowed, (node,))
        self.replacements += 1
        return SurfaceChange(start, node, shadowed)

    def restore(self, nodes: Sequence[SurfaceNode], replacements: int) -> None:
        """Become the surface of ``nodes`` (in position order) after ``replacements`` REPLACEs:
        how a snapshot is restored, without replaying the log that made it. The call indexes
        are rebuilt from the nodes."""
        self._nodes = list(nodes)
        self._position = {node.seq: i for i, node in enumerate(self._nodes)}
        self._calls, self._makers, self._answers = {}, {}, {}
        self._unanswered, self._repeated = set(), set()
        for node in self._nodes:
            self._track_calls(node, +1)
        self._unanswered_at = (-1, frozenset())
        self.replacements = replacements
        self.changes += 1  # a restored surface is not one a selection saw

    def undo(self, change: SurfaceChange) -> None:
        """Revert ``change``, which must be the most recent change not yet undone."""
        self.changes += 1
        self._splice(change.position, (change.node,), change.shadowed)
        if change.shadowed:
            self.replacements -= 1

    def _splice(self, start: int, old: Sequence[SurfaceNode], new: Sequence[SurfaceNode]) -> None:
        self._nodes[start : start + len(old)] = new
        for node in old:
            del self._position[node.seq]
            self._track_calls(node, -1)
        for offset, node in enumerate(new):
            self._position[node.seq] = start + offset
            self._track_calls(node, +1)
        if len(old) != len(new):  # positions after the span moved
            for position in range(start + len(new), len(self._nodes)):
                self._position[self._nodes[position].seq] = position

    def _track_calls(self, node: SurfaceNode, delta: int) -> None:
        """Count the calls ``node`` makes and the call its result answers (+1 or -1)."""
        for call_id in node.calls:
            count = self._calls.get(call_id, 0) + delta
            if count:
                self._calls[call_id] = count
            else:
                self._calls.pop(call_id, None)
            self._index(self._makers, call_id, node.seq, delta)
            if count > 1:
                self._repeated.add(call_id)
                self._ever_repeated = True
            else:
                self._repeated.discard(call_id)
            self._refresh_answer(call_id)
        if node.answers:
            self._index(self._answers, node.answers, node.seq, delta)
            self._refresh_answer(node.answers)

    @staticmethod
    def _index(index: dict[str, _Seqs], call_id: str, seq: int, delta: int) -> None:
        seqs = _seqs(index.get(call_id))
        if delta > 0:
            if seq not in seqs:
                index[call_id] = (*seqs, seq) if seqs else seq
        elif seq in seqs:
            kept = tuple(s for s in seqs if s != seq)
            if not kept:
                del index[call_id]
            else:
                index[call_id] = kept if len(kept) > 1 else kept[0]

    def _refresh_answer(self, call_id: str) -> None:
        if call_id in self._calls and call_id not in self._answers:
            self._unanswered.add(call_id)
        else:
            self._unanswered.discard(call_id)

    def _check_result_has_call(self, event: SessionEvent) -> None:
        call_id = event.tool_result.tool_call_id
        if call_id not in self._calls:
            raise CorruptPairing(
                f"tool/result answers call id {call_id!r} that no earlier surface node made",
                violations=[FieldViolation("tool_result.tool_call_id", "no earlier call")],
            )

    def _check_replace(self, event: SessionEvent, seq: int) -> None:
        op = event.surface_op
        start = self._endpoint(op.start_seq, seq, "start_seq")
        end = self._endpoint(op.end_seq, seq, "end_seq")
        if start > end:
            _reject(
                "surface_op",
                f"start_seq {op.start_seq} is at position {start}, after end_seq {op.end_seq} "
                f"at position {end}",
            )
        shadowed = self._nodes[start : end + 1]
        _check_cites_shadowed(event, shadowed)
        if ev.body_name(event) == "tool_result":
            self._check_tool_result_rewrite(event, shadowed)
            return
        self._check_system_head(event, start, end)
        self._check_balanced_span(start, end)

    def _check_insert(self, event: SessionEvent, seq: int) -> None:
        """An INSERT names one current node (``start_seq == end_seq``) and cites its source;
        a tool/result it inserts answers a call an earlier node made."""
        op = event.surface_op
        if op.start_seq != op.end_seq:
            _reject("surface_op", "an INSERT names one node: end_seq must equal start_seq")
        self._endpoint(op.start_seq, seq, "start_seq")
        if not event.source_event_seqs:
            _reject("source_event_seqs", "an INSERT must cite its source_event_seqs")

    def _endpoint(self, target: int, seq: int, name: str) -> int:
        if target >= seq:
            _reject(f"surface_op.{name}", f"{name} {target} is not an earlier event")
        position = self._position.get(target)
        if position is None:
            _reject(f"surface_op.{name}", f"{name} {target} is not a current surface node")
        return position

    def _check_tool_result_rewrite(
        self, event: SessionEvent, shadowed: Sequence[SurfaceNode]
    ) -> None:
        rule = "a tool/result replacement rewrites exactly one current tool/result"
        if len(shadowed) != 1 or shadowed[0].type != ev.TOOL_RESULT:
            _reject("surface_op", rule)
        old, new = shadowed[0].event.tool_result, event.tool_result
        if (old.tool_call_id, old.tool_name, old.is_error) != (
            new.tool_call_id,
            new.tool_name,
            new.is_error,
        ):
            _reject("tool_result", f"{rule} and may change only its content")

    def _check_system_head(self, event: SessionEvent, start: int, end: int) -> None:
        if start != 0 or self._nodes[0].type != ev.SYSTEM_MESSAGE:
            return
        rule = "a span including the system/message at position 0 must be exactly that node"
        if end != 0:
            _reject("surface_op", rule)
        if ev.body_name(event) != "system_message":
            _reject("body", f"{rule}, replaced by a system/message")

    def _check_balanced_span(self, start: int, end: int) -> None:
        if self._ever_repeated:
            balanced = self._walked_balance(start, end)
        else:
            balanced = not (self._open_at(start) or self._open_at(end + 1))
        if not balanced or self._orphans_after(start, end):
            _reject("surface_op", "a replaced span must begin and end at balanced tool-call cuts")

    def _walked_balance(self, start: int, end: int) -> bool:
        """Both cuts balanced, walking the surface up to the span's end: once a call id was made
        twice, a replacement may have left one of its results before its only making (which
        ``pairing`` rejects, and the call indices do not show)."""
        open_calls: set[str] = set()
        made: set[str] = set()
        try:
            for position, node in enumerate(self._nodes[: end + 1]):
                if position == start and open_calls:
                    return False
                _advance(node, open_calls, made)
        except CorruptPairing:
            return False
        return not open_calls

    def _open_at(self, cut: int) -> bool:
        """Whether a call is open at the cut before position ``cut``: ``pairing.open_calls_after``
        of the nodes before it would not be empty.

        A call is open there when the last node before the cut making its id has no result of
        it between them. Its id then has no result at all (``_unanswered``) or has one at or
        after the cut (no id was ever made twice, so a result follows its one making): only
        those ids are looked at, and only the nodes from the cut on are read (the span and the
        tail, not the prefix condensed long ago).
        """
        candidates = set(self._unanswered)
        for node in self._nodes[cut:]:
            if node.answers:
                candidates.add(node.answers)
        return any(self._open_before(call_id, cut) for call_id in candidates)

    def _open_before(self, call_id: str, cut: int) -> bool:
        position = self._position
        makes = [position[seq] for seq in _seqs(self._makers.get(call_id)) if position[seq] < cut]
        if not makes:
            return False
        last = max(makes)
        answers = _seqs(self._answers.get(call_id))
        return not any(last < position[seq] < cut for seq in answers)

    def _orphans_after(self, start: int, end: int) -> bool:
        """Whether shadowing ``start..end`` leaves a later result whose call only the span made.

        A call may have several results; the end cut closes at the first, so a later one would
        otherwise survive its call and leave the surface with a result that answers nothing.
        """
        in_span: dict[str, int] = {}
        for node in self._nodes[start : end + 1]:
            for call_id in node.calls:
                in_span[call_id] = in_span.get(call_id, 0) + 1
        position = self._position
        return any(
            position[seq] > end
            for call_id, count in in_span.items()
            if self._calls[call_id] == count  # only the span makes it
            for seq in _seqs(self._answers.get(call_id))
        )


class ShadowHistory:
    """Every node a REPLACE of a stored log shadowed -> (the replacement's seq, the node's type,
    the replacement's compaction id if it is a checkpoint), in ``shadowed``.

    The fold does not keep it (it grows with the log, and only inspection reads it): ``add`` the
    log from its start, in seq order and in as many parts as suits, to fold its surface anew.
    Costs the log.
    """

    def __init__(self) -> None:
        self._surface = Surface()
        self.shadowed: dict[int, tuple[int, str, str]] = {}

    def add(self, events: Iterable[SessionEvent]) -> None:
        """Fold the next events of the log."""
        for event in events:
            if not ev.is_surface(event):
                continue
            change = self._surface.apply(event, event.seq)
            if change.shadowed:
                checkpoint = ev.checkpoint_compaction_id(event)
                for old in change.shadowed:
                    self.shadowed[old.seq] = (event.seq, old.type, checkpoint)


def shadow_history(log: Iterable[SessionEvent]) -> dict[int, tuple[int, str, str]]:
    """``ShadowHistory.shadowed`` of a whole stored ``log``."""
    history = ShadowHistory()
    history.add(log)
    return history.shadowed


def _seqs(entry: _Seqs | None) -> tuple[int, ...]:
    """The seqs a call index entry holds."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, int) else entry


def _op_kind(event: SessionEvent) -> int:
    """The event's surface op kind (``SURFACE_OP_KIND_UNSPECIFIED`` without an op): read once
    where ``ev.is_replace`` and ``ev.is_insert`` would each read it."""
    return event.surface_op.kind if event.HasField("surface_op") else 0


def _check_sources(event: SessionEvent, seq: int, replace: bool) -> None:
    if not event.source_event_seqs:  # an append's (nearly every event): nothing to compare
        if replace:
            _reject("source_event_seqs", "a replacement must cite its source_event_seqs")
        return
    sources = list(event.source_event_seqs)
    if len(set(sources)) != len(sources):
        _reject("source_event_seqs", "source_event_seqs must not repeat a seq")
    if any(s < 0 or s >= seq for s in sources):
        _reject("source_event_seqs", f"source_event_seqs must all be earlier than seq {seq}")


def open_calls_of(nodes: Iterable[SurfaceNode]) -> set[str]:
    """``pairing.open_calls_after`` of the nodes' events, read from the calls each node makes
    and the call it answers (kept beside its bytes): no event is parsed."""
    open_calls: set[str] = set()
    made: set[str] = set()
    for node in nodes:
        _advance(node, open_calls, made)
    return open_calls


def _advance(node: SurfaceNode, open_calls: set[str], made: set[str]) -> None:
    """``pairing._advance`` for one node."""
    if node.calls:  # only an assistant/message makes calls
        open_calls.update(node.calls)
        made.update(node.calls)
    elif node.type == ev.TOOL_RESULT:
        if node.answers not in made:
            raise CorruptPairing(
                f"tool/result answers call id {node.answers!r} that no earlier node made"
            )
        open_calls.discard(node.answers)  # several results may answer one call: the first closes


def _check_cites_shadowed(event: SessionEvent, shadowed: Sequence[SurfaceNode]) -> None:
    missing = sorted({n.seq for n in shadowed} - set(event.source_event_seqs))
    if missing:
        _reject(
            "source_event_seqs", f"a replacement must cite every shadowed node; missing {missing}"
        )


def _reject(field: str, description: str) -> NoReturn:
    raise ReplacementRejected(
        f"replacement rejected: {description}", violations=[FieldViolation(field, description)]
    )
