"""Fold snapshots: a session's folded state at one revision, so a restore skips the log before it.

A snapshot is what the fold derived from the log that the log's surface events alone do not say
(open turns and step, the lock, the header's seq, offloads, event ids, compaction ids, the
lifecycle boundary, the rewrite and offload counters) plus the
surface as a list of node seqs and the meter's node prices per pricing profile
(``PricingProfile.key``), aligned with those nodes, and what each node keeps beside its bytes
(``NodeFacts``: its type, the calls it makes, the call it answers). It holds no event bodies: the
nodes are the stored events at those seqs (the store keeps the exact bytes the fold admitted,
``EventStore.read_stored`` hands them over unparsed), so a snapshot stays small however large the
surface is, and a restore makes the nodes from those bytes without parsing them.

``encode`` and ``decode`` are pure (JSON text, versioned); ``rebuild`` makes a ``SessionFold``
from a decoded snapshot and the events it names. A snapshot that does not decode, or names an
event the caller could not read, is refused with ``SnapshotInvalid``: the caller replays the
log instead.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from compactd.core import header as hdr
from compactd.core.events import SessionEvent
from compactd.core.fold import (
    RECENT_COMPACTION_IDS,
    RECENT_EVENT_IDS,
    OpenSubagent,
    SessionFold,
)
from compactd.core.lock import LockState
from compactd.core.pricing import NodeCost, node_cost
from compactd.core.steps import run_to_end
from compactd.core.surface import SurfaceNode

VERSION: Final = 3
#: Versions ``decode`` reads: version 2 predates pinned state and sub-agents (its fold had none).
READABLE: Final = frozenset({2, 3})
# Entries copied or encoded between pauses when a snapshot is made on the event loop.
CHUNK: Final = 512
#: The anchor of a snapshot whose meter had none: names no node, so a restore (of any release)
#: takes no anchor rather than looking for one that the meter had already dropped.
NO_ANCHOR: Final = (-1, -1)


class SnapshotInvalid(ValueError):
    """A snapshot that cannot be used (another version, malformed, or naming missing events)."""


@dataclass(frozen=True)
class FoldSnapshot:
    """A fold's state at ``revision`` (see the module docstring).

    Attributes:
        revision: Events folded (the log prefix ``[0, revision)``).
        instance_id: The process lifecycle that wrote it (its ``SessionManager.instance_id``).
        surface: Node seqs in position order.
        prices: Per pricing-profile key, each node's (messages, images) price, aligned with
            ``surface``.
        anchor: The meter's usage anchor (the anchoring message's seq, the header seq in force
            when it arrived), ``NO_ANCHOR`` when the meter had none, or None when no meter
            followed the fold (a restore then looks for one).
    """

    revision: int
    instance_id: str
    surface: list[int]
    replacements: int
    header_seq: int
    replacements_at_header: int
    open_turns: list[int]
    open_step: tuple[int, int] | None
    offloads: dict[int, list[int]]
    event_ids: dict[str, int]
    compaction_ids: list[str]
    last_end_seed: int
    open_starts: dict[str, int]
    restored_at: int
    prices: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    anchor: tuple[int, int] | None = None
    offload_generation: int = 0
    rewritten_at: int = -1
    pins: dict[str, int] = field(default_factory=dict)  # key -> seq of the pin in force
    pins_seq: int = -1
    open_subagents: dict[str, int] = field(default_factory=dict)  # child -> its start's seq
    #: Each node's facts (``NodeFacts``), aligned with ``surface``: with them a restore makes
    #: the nodes from the stored bytes without parsing them. None in a snapshot without them.
    facts: NodeFacts | None = None

    def needed_seqs(self) -> list[int]:
        """The seqs of the stored events ``rebuild`` needs: the nodes, the header, the
        anchor's header, the pins in force and the open sub-agents' starts."""
        return sorted(set(self.surface) | set(self.parsed_seqs()))

    def parsed_seqs(self) -> list[int]:
        """The seqs of the stored events ``rebuild`` needs parsed when it has the nodes'
        ``facts`` (the nodes' own are needed as bytes): the header, the anchor's header, the
        pins in force and the open sub-agents' starts."""
        seqs = set(self.pins.values()) | set(self.open_subagents.values())
        if self.header_seq >= 0:
            seqs.add(self.header_seq)
        if self.anchor is not None and self.anchor[1] >= 0:
            seqs.add(self.anchor[1])
        return sorted(seqs)

    def node_prices(self) -> dict[str, dict[int, NodeCost]]:
        """``prices`` keyed by node seq, as the meter takes them."""
        return {
            key: {seq: node_cost(m, i) for seq, (m, i) in zip(self.surface, costs, strict=True)}
            for key, costs in self.prices.items()
        }


@dataclass(frozen=True)
class NodeFacts:
    """What a surface node keeps beside its bytes (``SurfaceNode``), for every node of a
    snapshot's surface: its type, the tool calls it makes and the call it answers (by seq, only
    where there are any)."""

    types: list[str]
    calls: dict[int, tuple[str, ...]]
    answers: dict[int, str]

    @classmethod
    def of(cls, nodes: Sequence[SurfaceNode]) -> NodeFacts:
        return cls(
            [n.type for n in nodes],
            {n.seq: n.calls for n in nodes if n.calls},
            {n.seq: n.answers for n in nodes if n.answers},
        )

    def document(self) -> dict[str, Any]:
        """The JSON value: the distinct types and each node's index among them."""
        names = list(dict.fromkeys(self.types))
        index = {name: i for i, name in enumerate(names)}
        return {
            "types": names,
            "type_of": [index[t] for t in self.types],
            "calls": [[seq, list(calls)] for seq, calls in self.calls.items()],
            "answers": [[seq, call] for seq, call in self.answers.items()],
        }

    @classmethod
    def decoded(cls, raw: dict[str, Any], nodes: int) -> NodeFacts:
        names = [str(t) for t in raw["types"]]
        types = [names[i] for i in raw["type_of"]]
        if len(types) != nodes:
            raise SnapshotInvalid("node facts do not cover the surface")
        return cls(
            types,
            {int(seq): tuple(str(c) for c in calls) for seq, calls in raw["calls"]},
            {int(seq): str(call) for seq, call in raw["answers"]},
        )


def capture(
    fold: SessionFold,
    instance_id: str,
    prices: Mapping[str, Mapping[int, NodeCost]],
    anchor: tuple[int, int] | None,
) -> FoldSnapshot:
    """The snapshot of ``fold`` now (read only: it may run in a worker thread while the session's
    lock keeps the fold still). ``prices`` must price every surface node of the keys it holds."""
    return run_to_end(capture_in_steps(fold, instance_id, prices, anchor))


def capture_in_steps(
    fold: SessionFold,
    instance_id: str,
    prices: Mapping[str, Mapping[int, NodeCost]],
    anchor: tuple[int, int] | None,
) -> Generator[None, None, FoldSnapshot]:
    """``capture``, pausing (``yield``) after every ``CHUNK`` nodes, so that the event loop runs
    other calls between steps (the session's lock keeps the fold still)."""
    surface: list[int] = []
    types: list[str] = []
    calls: dict[int, tuple[str, ...]] = {}
    answers: dict[int, str] = {}
    for start in range(0, len(fold.surface), CHUNK):
        nodes = fold.surface.nodes[start : start + CHUNK]
        facts = NodeFacts.of(nodes)
        surface += [n.seq for n in nodes]
        types += facts.types
        calls.update(facts.calls)
        answers.update(facts.answers)
        yield
    kept: dict[str, list[tuple[int, int]]] = {}
    for key, costs in prices.items():
        if not all(seq in costs for seq in surface):
            continue
        pairs: list[tuple[int, int]] = []
        for start in range(0, len(surface), CHUNK):
            chunk = [costs[seq] for seq in surface[start : start + CHUNK]]
            pairs += [(c.messages, c.images) for c in chunk]
            yield
        kept[key] = pairs
    event_ids = dict(fold.event_ids)  # one C call
    yield
    return FoldSnapshot(
        revision=fold.revision,
        instance_id=instance_id,
        surface=surface,
        replacements=fold.surface.replacements,
        header_seq=fold.header_seq,
        replacements_at_header=fold.replacements_at_header,
        open_turns=sorted(fold.open_turns),
        open_step=fold.open_step,
        offloads={seq: sorted(indexes) for seq, indexes in fold.offloads.items()},
        event_ids=event_ids,
        compaction_ids=list(fold.compaction_ids),
        last_end_seed=fold.lock.last_end_seed,
        open_starts=dict(fold.lock.open_starts),
        restored_at=fold.restored_at,
        prices=kept,
        anchor=anchor,
        offload_generation=fold.offload_generation,
        rewritten_at=fold.rewritten_at,
        pins={key: seq for key, (seq, _) in fold.pins.items()},
        pins_seq=fold.pins_seq,
        open_subagents={child: open.seq for child, open in fold.open_subagents.items()},
        facts=NodeFacts(types, calls, answers),
    )


def encode(snapshot: FoldSnapshot) -> bytes:
    """The snapshot as versioned JSON bytes."""
    return json.dumps(_document(snapshot), separators=(",", ":")).encode("utf-8")


def encode_in_steps(snapshot: FoldSnapshot) -> Generator[None, None, bytes]:
    """``encode``'s very bytes, made ``CHUNK`` entries at a time with a pause (``yield``)
    between: one ``json.dumps`` of a long log's snapshot holds the GIL for milliseconds."""
    flat: dict[str, list[int]] = {}
    for key, pairs in snapshot.prices.items():
        values: list[int] = []
        for start in range(0, len(pairs), CHUNK):
            values += [c for pair in pairs[start : start + CHUNK] for c in pair]
            yield
        flat[key] = values
    facts = None
    if snapshot.facts is not None:
        facts = yield from _facts_in_steps(snapshot.facts)
    text = yield from _json_in_steps(_document(snapshot, flat, facts))
    return text.encode("utf-8")


def _facts_in_steps(facts: NodeFacts) -> Generator[None, None, dict[str, Any]]:
    """``facts.document()``, ``CHUNK`` nodes at a time with a pause (``yield``) between."""
    names: dict[str, int] = {}
    type_of: list[int] = []
    for start in range(0, len(facts.types), CHUNK):
        chunk = facts.types[start : start + CHUNK]
        for name in dict.fromkeys(chunk):  # a few distinct types: one C pass finds them
            names.setdefault(name, len(names))
        type_of += [names[name] for name in chunk]
        yield
    items = list(facts.calls.items())
    calls: list[list[Any]] = []
    for start in range(0, len(items), CHUNK):
        calls += [[seq, list(c)] for seq, c in items[start : start + CHUNK]]
        yield
    pairs = list(facts.answers.items())
    answers: list[list[Any]] = []
    for start in range(0, len(pairs), CHUNK):
        answers += [[seq, call] for seq, call in pairs[start : start + CHUNK]]
        yield
    return {"types": list(names), "type_of": type_of, "calls": calls, "answers": answers}


def _json_in_steps(value: Any) -> Generator[None, None, str]:
    """``json.dumps(value, separators=(",", ":"))``, a chunk of a long list or dict at a time
    (a dict's keys are strings)."""
    if isinstance(value, list) and len(value) > CHUNK:
        parts = []
        for start in range(0, len(value), CHUNK):
            parts.append(_dumps(value[start : start + CHUNK])[1:-1])
            yield
        return "[" + ",".join(parts) + "]"
    if isinstance(value, dict) and len(value) > CHUNK:  # many entries: a chunk of them at once
        items = list(value.items())
        parts = []
        for start in range(0, len(items), CHUNK):
            parts.append(_dumps(dict(items[start : start + CHUNK]))[1:-1])
            yield
        return "{" + ",".join(parts) + "}"
    if isinstance(value, dict):  # few entries, perhaps long ones
        parts = []
        for key, item in value.items():
            parts.append(_dumps(key) + ":" + (yield from _json_in_steps(item)))
        return "{" + ",".join(parts) + "}"
    return _dumps(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _document(
    snapshot: FoldSnapshot,
    flat_prices: dict[str, list[int]] | None = None,
    facts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if flat_prices is None:
        flat_prices = {
            key: [c for pair in pairs for c in pair] for key, pairs in snapshot.prices.items()
        }
    data: dict[str, Any] = {
        "v": VERSION,
        "revision": snapshot.revision,
        "instance_id": snapshot.instance_id,
        "surface": snapshot.surface,
        "replacements": snapshot.replacements,
        "header_seq": snapshot.header_seq,
        "replacements_at_header": snapshot.replacements_at_header,
        "open_turns": snapshot.open_turns,
        "open_step": list(snapshot.open_step) if snapshot.open_step is not None else None,
        "offloads": [[seq, indexes] for seq, indexes in snapshot.offloads.items()],
        "event_ids": snapshot.event_ids,
        "compaction_ids": snapshot.compaction_ids,
        "last_end_seed": snapshot.last_end_seed,
        "open_starts": snapshot.open_starts,
        "restored_at": snapshot.restored_at,
        "prices": flat_prices,
        "anchor": list(snapshot.anchor) if snapshot.anchor is not None else None,
        "offload_generation": snapshot.offload_generation,
        "rewritten_at": snapshot.rewritten_at,
        "pins": snapshot.pins,
        "pins_seq": snapshot.pins_seq,
        "open_subagents": snapshot.open_subagents,
        "shadowed_by": [],  # no longer kept; written empty so earlier releases still decode it
    }
    if facts is not None:  # a key earlier releases do not read: they parse the nodes
        data["node_facts"] = facts
    elif snapshot.facts is not None:
        data["node_facts"] = snapshot.facts.document()
    return data


def decode(data: bytes) -> FoldSnapshot:
    """The snapshot ``encode`` wrote.

    Raises:
        SnapshotInvalid: Another version, or not a snapshot.
    """
    try:
        raw = json.loads(data)
        if raw.get("v") not in READABLE:
            raise SnapshotInvalid(f"snapshot version {raw.get('v')!r}, expected {VERSION}")
        step = raw["open_step"]
        anchor = raw["anchor"]
        surface = [int(s) for s in raw["surface"]]
        prices: dict[str, list[tuple[int, int]]] = {}
        for key, flat in raw["prices"].items():
            if len(flat) != 2 * len(surface):
                raise SnapshotInvalid(f"prices of {key!r} do not cover the surface")
            prices[str(key)] = list(zip(flat[0::2], flat[1::2], strict=True))
        return FoldSnapshot(
            revision=int(raw["revision"]),
            instance_id=str(raw["instance_id"]),
            surface=surface,
            replacements=int(raw["replacements"]),
            header_seq=int(raw["header_seq"]),
            replacements_at_header=int(raw["replacements_at_header"]),
            open_turns=[int(t) for t in raw["open_turns"]],
            open_step=(int(step[0]), int(step[1])) if step is not None else None,
            offloads={int(seq): [int(i) for i in idx] for seq, idx in raw["offloads"]},
            event_ids={str(k): int(v) for k, v in raw["event_ids"].items()},
            compaction_ids=[str(c) for c in raw["compaction_ids"]],
            last_end_seed=int(raw["last_end_seed"]),
            open_starts={str(k): int(v) for k, v in raw["open_starts"].items()},
            restored_at=int(raw["restored_at"]),
            prices=prices,
            anchor=(int(anchor[0]), int(anchor[1])) if anchor is not None else None,
            offload_generation=int(raw["offload_generation"]),
            rewritten_at=int(raw["rewritten_at"]),
            pins={str(k): int(v) for k, v in raw.get("pins", {}).items()},
            pins_seq=int(raw.get("pins_seq", -1)),
            open_subagents={str(k): int(v) for k, v in raw.get("open_subagents", {}).items()},
            facts=NodeFacts.decoded(raw["node_facts"], len(surface))
            if "node_facts" in raw
            else None,
        )  # an earlier snapshot's "shadowed_by" is ignored: the fold no longer keeps it
    except SnapshotInvalid:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise SnapshotInvalid(f"malformed snapshot: {err!r}") from err


def rebuild(
    snapshot: FoldSnapshot,
    events: Mapping[int, SessionEvent],
    node_bytes: Mapping[int, bytes] | None = None,
) -> SessionFold:
    """The fold the snapshot describes, its nodes and header taken from ``events`` (by seq).
    With ``node_bytes`` (the stored bytes of the nodes' events, by seq) and the snapshot's node
    ``facts``, the nodes are made from those bytes and ``events`` needs only the
    ``parsed_seqs``: no node's event is parsed.

    Raises:
        SnapshotInvalid: An event the snapshot names is missing, or is not what it says.
    """
    facts = snapshot.facts if node_bytes is not None else None
    needed = snapshot.parsed_seqs() if facts is not None else snapshot.needed_seqs()
    missing = [s for s in needed if s not in events]
    if facts is not None:
        assert node_bytes is not None
        missing += [s for s in snapshot.surface if s not in node_bytes]
    if missing:
        raise SnapshotInvalid(f"the log has no events at seqs {missing[:5]}")
    fold = SessionFold()
    fold.revision = snapshot.revision
    offloads = {seq: frozenset(idx) for seq, idx in snapshot.offloads.items()}
    if facts is not None:
        assert node_bytes is not None
        nodes = _stored_nodes(snapshot.surface, facts, node_bytes)
    else:
        nodes = [SurfaceNode(seq, events[seq]) for seq in snapshot.surface]
    fold.surface.restore(nodes, snapshot.replacements)
    if snapshot.header_seq >= 0:
        stored = events[snapshot.header_seq]
        if not stored.HasField("request_header"):
            raise SnapshotInvalid(f"seq {snapshot.header_seq} is not a request/header")
        fold.header = hdr.canonical(stored.request_header)
    fold.header_seq = snapshot.header_seq
    fold.replacements_at_header = snapshot.replacements_at_header
    fold.open_turns = set(snapshot.open_turns)
    fold.open_step = snapshot.open_step
    fold.offloads = offloads
    # Oldest first, as the fold evicts them (a snapshot from before the bound kept every id).
    by_seq = sorted(snapshot.event_ids.items(), key=lambda item: item[1])
    fold.event_ids = dict(by_seq[-RECENT_EVENT_IDS:])
    # Oldest first (a snapshot from before the bound held every id, sorted: any of them makes as
    # good a window, since no started bracket reuses an older id).
    fold.compaction_ids = dict.fromkeys(snapshot.compaction_ids[-RECENT_COMPACTION_IDS:])
    fold.lock = LockState(snapshot.last_end_seed, dict(snapshot.open_starts))
    fold.restored_at = snapshot.restored_at
    fold.offload_generation = snapshot.offload_generation
    fold.rewritten_at = snapshot.rewritten_at
    for key, seq in sorted(snapshot.pins.items()):
        stored = events[seq]
        if not stored.HasField("state_pin") or stored.state_pin.key != key:
            raise SnapshotInvalid(f"seq {seq} is not a state/pin of key {key!r}")
        fold.pins[key] = (seq, stored.state_pin.text)
    fold.pins_seq = snapshot.pins_seq
    for child, seq in sorted(snapshot.open_subagents.items()):
        start = events[seq]
        if start.subagent_start.child_session_id != child:
            raise SnapshotInvalid(f"seq {seq} is not the subagent/start of {child!r}")
        body = start.subagent_start
        fold.open_subagents[child] = OpenSubagent(seq, body.tool_call_id, body.task)
    fold.restore_sizes()
    return fold


def _stored_nodes(
    surface: Sequence[int], facts: NodeFacts, stored: Mapping[int, bytes]
) -> list[SurfaceNode]:
    calls, answers, of_stored = facts.calls, facts.answers, SurfaceNode.of_stored
    return [
        of_stored(seq, stored[seq], type_, calls.get(seq, ()), answers.get(seq, ""))
        for seq, type_ in zip(surface, facts.types, strict=True)
    ]
