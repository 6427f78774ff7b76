"""The incremental token meter: the price of a session's request envelope at one revision.

A ``SessionMeter`` follows one session's fold. Every committed batch is ``observe``d once: each
surface node it adds or reprojects is priced when it arrives and kept, so ``measure`` adds cached
totals instead of repricing the session. Prices depend on the route's ``PricingProfile``
(tokenizer, framing, image pricing), so the meter keeps one ledger per profile, built on first
use and then maintained with the others: the cost of a batch is the nodes it touches.

Provider usage anchors a measurement. When an appended ``assistant/message`` carries the usage of
the request it answered, that usage (input + cache read + cache write + output tokens; reasoning is
already in output) prices the envelope up to and including that message, and only the surface
after it is priced by the meter. Only the latest such message counts, and only while

- it is still on the surface, and nothing at or before its position was replaced or reprojected
  (image offload) since it arrived;
- the route measured is the latest header's route, and the header in force now is the same
  request (``core.header.same_request``) as the one in force when the message arrived;
- the usage is not below the meter's own estimate of the same envelope;
- for the first such message after a checkpoint whose summary was prepared ahead of the trigger
  (``CompactionCheckpointSource.prepared_ahead``), the usage is not closer to the envelope
  before that checkpoint than to the one after it (it exceeds the meter's estimate by less than
  half of what the checkpoint freed on the route's pricing): a request built before the
  candidate was applied priced the larger surface, not the new one. The margin is kept in
  memory only: a meter rebuilt from a snapshot or the log between the two accepts the usage.

Otherwise the estimate stands. Reports say how the figure was obtained: EXACT (the route's
tokenizer and chat template), TOKENIZER (the route's tokenizer with its family's published
framing), HEURISTIC (the reference heuristic), or ANCHORED. The service reports a heuristic
measurement of a route whose provider publishes no tokenizer as ESTIMATED.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.core.fold import AdmittedBatch, SessionFold
from compactd.core.header import same_request
from compactd.core.pricing import (
    CountedAhead,
    NodeCost,
    PricingProfile,
    TextsAhead,
    heuristic_price,
    price_config,
    price_message,
    price_node,
    price_nodes,
    price_tools,
    with_counted,
)
from compactd.core.projection import Message
from compactd.core.steps import run_to_end
from compactd.core.surface import SurfaceChange, SurfaceNode
from compactd.v1 import events_pb2

__all__ = [
    "Measurement",
    "MeteredRoute",
    "Method",
    "SessionMeter",
    "heuristic_price",
    "recount",
    "route_price",
]


class Method(enum.Enum):
    """How a measurement was obtained."""

    EXACT = "exact"
    ANCHORED = "anchored"
    HEURISTIC = "heuristic"
    TOKENIZER = "tokenizer"
    ESTIMATED = "estimated"


class MeteredRoute(Protocol):
    """What the meter needs of a route: its identity and its pricing profile."""

    @property
    def provider(self) -> str:
        """Provider name."""
        ...

    @property
    def model(self) -> str:
        """Model name."""
        ...

    @property
    def pricing(self) -> PricingProfile:
        """How this route prices a node."""
        ...


@dataclass(frozen=True, slots=True)
class Measurement:
    """The priced envelope at one revision.

    The parts add up to ``total``. For ANCHORED, the gap between the provider's usage and the
    meter's estimate of the same envelope is attributed to ``messages``.

    Attributes:
        revision: The log revision measured (events committed).
        total: Tokens of the whole envelope.
        system: The system head (the ``system/message`` at surface position 0).
        tools: Tool declarations.
        messages: Every other message, images excluded.
        images: Images still sent and offload placeholders.
        config: Request framing of the routed config.
        method: EXACT, ANCHORED or HEURISTIC.
        tokenizer: The tokenizer's name.
        anchor_seq: For ANCHORED, the seq of the anchoring ``assistant/message``.
        pins: The pinned-state message (``core.pins``): the pins in force, never compacted.
    """

    revision: int
    total: int
    system: int
    tools: int
    messages: int
    images: int
    config: int
    method: Method
    tokenizer: str
    anchor_seq: int | None = None
    pins: int = 0


def route_price(
    item: SessionEvent | Message, route: MeteredRoute, offloaded: Set[int] = frozenset()
) -> int:
    """The route price of one event (projected with ``offloaded``) or projected message.

    For nodes not (yet) on the surface, e.g. a checkpoint before it is appended.
    """
    if isinstance(item, SessionEvent):
        return price_node(item, route.pricing, offloaded).total
    return price_message(item, route.pricing).total


def recount(
    fold: SessionFold, route: MeteredRoute, declared: Sequence[events_pb2.ToolDeclaration] = ()
) -> Measurement:
    """A from-scratch price of ``fold``'s envelope, without usage anchoring: the reference the
    incremental meter must equal (``declared``: the tools it declares besides the header's, see
    ``SessionMeter.declare_tools``). Costs the whole session; for tests and benchmarks."""
    pricing = route.pricing
    costs = {
        n.seq: price_node(n.event, pricing, fold.offloads.get(n.seq, frozenset()))
        for n in fold.surface
    }
    return _assemble(
        revision=fold.revision,
        pricing=pricing,
        costs=costs,
        head=_head_seq(fold),
        totals=_sum(costs.values()),
        tools=price_tools(envelope_tools(fold.header, declared), pricing, _head_text(fold)),
        config=price_config(fold.header, pricing, _head_text(fold)),
        pins=_pins_price(fold.pins_message(), pricing),
    )


#: Tools compactd declares in a rebuilt request besides the header's, given the header in force.
DeclaredTools = Callable[[events_pb2.RequestHeader | None], Sequence[events_pb2.ToolDeclaration]]


def _no_tools(header: events_pb2.RequestHeader | None) -> Sequence[events_pb2.ToolDeclaration]:
    return ()


def envelope_tools(
    header: events_pb2.RequestHeader | None, declared: Sequence[events_pb2.ToolDeclaration]
) -> list[events_pb2.ToolDeclaration]:
    """The tools a rebuilt request declares: the header's, then compactd's own."""
    return [*(header.tools if header is not None else ()), *declared]


@dataclass(frozen=True, slots=True)
class _Anchor:
    seq: int
    usage: int
    header_seq: int  # the request/header in force when the message arrived (-1: none)
    header: events_pb2.RequestHeader | None
    # Per pricing, the tokens a checkpoint prepared ahead freed just before this message: usage
    # that exceeds the estimate by half of it or more priced the surface before the checkpoint.
    stale_margins: Mapping[PricingProfile, int] = field(default_factory=dict)


def _prepared_ahead(node: SurfaceNode) -> bool:
    """Whether ``node`` is a checkpoint whose summary was prepared ahead of the trigger."""
    return node.event.user_message.source.compaction_checkpoint.prepared_ahead


class _Ledger:
    """Cached node prices of one pricing profile and their running totals."""

    def __init__(self, pricing: PricingProfile) -> None:
        self.pricing = pricing
        self.costs: dict[int, NodeCost] = {}
        self.messages = 0
        self.images = 0
        self.delta = 0  # total of the nodes after the anchor
        # ((header seq, head seq, declared version), price)
        self._tools: tuple[tuple[int, int | None, int], int] = ((-2, None, -1), 0)
        self._pins: tuple[int, int] = (-2, 0)  # (seq of the latest state/pin, -1: none), price

    def put(self, seq: int, cost: NodeCost, in_delta: bool) -> None:
        if seq in self.costs:
            self.drop(seq, in_delta)
        self.costs[seq] = cost
        self.messages += cost.messages
        self.images += cost.images
        if in_delta:
            self.delta += cost.total

    def drop(self, seq: int, in_delta: bool) -> None:
        cost = self.costs.pop(seq, None)
        if cost is None:
            return
        self.messages -= cost.messages
        self.images -= cost.images
        if in_delta:
            self.delta -= cost.total

    def drop_span(self, seqs: Sequence[int], in_delta: Set[int]) -> None:
        """``drop`` each of ``seqs`` (``in_delta``: those after the anchor), the totals summed
        once."""
        costs, messages, images, delta = self.costs, 0, 0, 0
        for seq in seqs:
            cost = costs.pop(seq, None)
            if cost is not None:
                messages += cost.messages
                images += cost.images
                if seq in in_delta:
                    delta += cost.total
        self.messages -= messages
        self.images -= images
        self.delta -= delta

    def tools(
        self,
        key: tuple[int, int],
        tools: Callable[[], Sequence[events_pb2.ToolDeclaration]],
        head: tuple[int | None, str | None] = (None, None),
    ) -> int:
        """The price of ``tools()``, cached per ``key`` (header seq, declared tools' version)
        and system head (``(seq, text)``)."""
        full = (key[0], head[0], key[1])
        if self._tools[0] != full:
            self._tools = (full, price_tools(tools(), self.pricing, head[1]))
        return self._tools[1]

    def pins(self, pins_seq: int, message: Message | None) -> int:
        """The pinned-state message's price, cached per pin generation (``pins_seq``): a pin
        change prices one message, once per ledger."""
        if self._pins[0] != pins_seq:
            self._pins = (pins_seq, _pins_price(message, self.pricing))
        return self._pins[1]


@dataclass(frozen=True, slots=True)
class _Staged:
    """Prices ``prepare`` made for ``batch`` (that very batch: one rolled back leaves its seqs
    to the next): new ledgers, and node prices per profile, keyed by seq (reprojections by
    -1 - seq; a profile is hashed once per batch, not once per node); ``appended`` when the
    batch only appended nodes."""

    batch: AdmittedBatch
    ledgers: dict[PricingProfile, dict[int, NodeCost]]
    nodes: dict[PricingProfile, dict[int, NodeCost]]
    appended: _Appended | None = None


@dataclass(frozen=True, slots=True)
class _Appended:
    """A batch that only appended surface nodes (none shadowed, reprojected or offloaded, no
    header): what ``observe`` adds, made ahead so that it costs a few bulk updates.

    ``anchor`` is the last appended ``assistant/message`` with usage, as (seq, usage); ``after``
    the seqs appended after it (all of them without one); ``prices`` per profile the appended
    nodes' prices and their sums (messages, images, total of ``after``)."""

    nodes: dict[int, SurfaceNode]
    anchor: tuple[int, int] | None
    after: list[int]
    prices: dict[PricingProfile, tuple[dict[int, NodeCost], int, int, int]]


class SessionMeter:
    """The incremental meter of one session.

    Create it from the session's fold (it takes the committed state as it is), then call
    ``observe`` after every committed batch, in commit order. It keeps its own view of the
    committed nodes, so a measurement never sees a batch that is admitted but not yet committed.
    """

    def __init__(
        self,
        fold: SessionFold,
        *,
        persisted: Mapping[str, Mapping[int, NodeCost]] | None = None,
        anchor: tuple[int, int, events_pb2.RequestHeader | None] | None = None,
    ) -> None:
        self._fold = fold
        self.revision = fold.revision
        self._nodes: dict[int, SurfaceNode] = {n.seq: n for n in fold.surface}
        self._offloads: dict[int, frozenset[int]] = dict(fold.offloads)
        self._head = _head_seq(fold)
        self._head_text: tuple[int | None, str | None] = (None, None)  # (head seq, its text)
        self._header_seq = fold.header_seq
        self._header = fold.header
        self._pins_seq = fold.pins_seq
        self._pins_message = fold.pins_message()
        self._ledgers: dict[PricingProfile, _Ledger] = {}
        self._declare: DeclaredTools = _no_tools
        self._declared_version = 0
        self._anchor: _Anchor | None = None
        self._stale_margins: dict[PricingProfile, int] = {}  # for the next anchor (_new_anchor)
        self._shadowed_prices: dict[PricingProfile, int] = {}  # a checkpoint's span, per pricing
        self._after_anchor: set[int] = set()
        self._same_header: tuple[tuple[int, int], bool] = ((-1, -2), False)  # (anchor, header)
        # Node prices restored from a snapshot, per ``PricingProfile.key``: a ledger built for
        # that profile takes them instead of pricing its nodes again. An entry is dropped when
        # its node leaves the surface or is reprojected.
        self._persisted: dict[str, dict[int, NodeCost]] = {
            key: dict(costs) for key, costs in (persisted or {}).items()
        }
        # Prices ``prepare_in_steps`` made for the batch being committed.
        self._staged: _Staged | None = None
        # Texts of the batch on its way counted ahead (``count_ahead``) and its nodes' prices, per
        # profile, with the events they were collected from; filled in by a worker thread.
        self._ahead: dict[PricingProfile, tuple[Sequence[SessionEvent], CountedAhead]] = {}
        self._batch_prices: dict[PricingProfile, dict[int, NodeCost]] = {}
        if anchor is None:
            self._bootstrap_anchor(fold)
        else:
            self._restore_anchor(fold, *anchor)

    @property
    def header(self) -> events_pb2.RequestHeader | None:
        """The latest committed ``request/header`` (as observed), or None."""
        return self._header

    def declare_tools(self, declare: DeclaredTools) -> None:
        """Price the tools ``declare(header)`` names after the header's in every envelope: tools
        compactd adds to rebuilt requests (the recall tool), as a function of the header in
        force (the route it names decides)."""
        self._declare = declare
        self._declared_version += 1

    def declared_tools(
        self, header: events_pb2.RequestHeader | None
    ) -> Sequence[events_pb2.ToolDeclaration]:
        """The tools compactd declares besides ``header``'s (see ``declare_tools``)."""
        return self._declare(header)

    # ---- observing ----------------------------------------------------------------------

    def observe(self, fold: SessionFold, batch: AdmittedBatch) -> None:
        """Fold one committed batch in: price what it added or reprojected, drop what it
        shadowed. Call with the fold in the state right after the batch.

        Prices ``prepare`` staged for this batch are used as they are; anything else is priced
        here."""
        staged, self._staged = self._staged, None
        if staged is not None and staged.batch is batch:
            for pricing, costs in staged.ledgers.items():
                if pricing not in self._ledgers:
                    self._install(pricing, costs)
            if staged.appended is not None:
                self._observe_appended(fold, staged.appended)
                return
            self._batch_prices = staged.nodes
        changes = iter(batch.surface_changes)
        for event in batch.events:
            kind = event.WhichOneof("body")
            if kind in ev.SURFACE_BODIES:
                self._apply(fold, next(changes), kind)
            elif kind == "request_header":
                self._header_seq, self._header = event.seq, event.request_header
            elif kind == "image_offload":
                self._offloaded(fold, event.image_offload)
            elif kind == "state_pin":
                self._pinned(fold)
        for seq in batch.reprojected:
            self._reproject(fold, seq)
        self._head = _head_seq(fold)
        self.revision = fold.revision
        self._batch_prices = {}

    def _observe_appended(self, fold: SessionFold, appended: _Appended) -> None:
        """``observe`` of a batch that only appended nodes, as ``_apply`` of each would do it."""
        self._nodes.update(appended.nodes)
        if appended.anchor is not None:
            seq, usage = appended.anchor
            self._anchor = self._new_anchor(seq, usage)
            self._after_anchor = set(appended.after)
        elif self._anchor is not None:
            self._after_anchor.update(appended.after)
        in_delta = self._anchor is not None
        for ledger in self._ledgers.values():
            priced = appended.prices.get(ledger.pricing)
            if priced is None:  # a ledger built since ``prepare``
                priced = _priced(appended, ledger.pricing)
            costs, messages, images, after = priced
            ledger.costs.update(costs)
            ledger.messages += messages
            ledger.images += images
            if appended.anchor is not None:
                ledger.delta = after
            elif in_delta:
                ledger.delta += after
        self._head = _head_seq(fold)
        self.revision = fold.revision

    # ---- pricing off the event loop -----------------------------------------------------

    def count_ahead(
        self, events: Sequence[SessionEvent], profiles: Iterable[PricingProfile] | None = None
    ) -> Generator[None, None, Callable[[], None] | None]:
        """Collect the texts the nodes of ``events`` (a checked batch about to be admitted) will
        be priced by for every ledger with a batch tokenizer (or for ``profiles``, beside what
        was counted ahead already), pausing (``yield``) after each event; the job it returns
        counts them in one batched call per profile (a worker thread: the tokenizers release
        the GIL) and prices the nodes from the counts, for ``prepare`` to take. Counts depend
        on the texts alone, and the prices are taken only for a batch admitted from these very
        ``events``: a batch refused after all leaves nothing wrong behind."""
        chosen = list(self._ledgers) if profiles is None else list(profiles)
        aheads = [a for p in chosen if (a := TextsAhead.of(p)) is not None]
        if profiles is None:
            self._ahead = {}
        counted = self._ahead
        if not aheads:
            return None
        for event in events:
            if event.WhichOneof("body") in ev.SURFACE_BODIES:
                for ahead in aheads:
                    ahead.add(event)
            yield

        def count() -> None:
            for ahead in aheads:
                counted[ahead.pricing] = (events, ahead.count())

        return count

    def uncounted(self, wanted: Iterable[PricingProfile] = ()) -> list[PricingProfile]:
        """The ledgers' and ``wanted`` profiles with a batch tokenizer whose texts nothing
        counted ahead (``count_ahead``): ``prepare_in_steps`` would count them in one batched
        call where it runs."""
        profiles = dict.fromkeys([*self._ledgers, *wanted])
        return [p for p in profiles if p not in self._ahead and TextsAhead.of(p) is not None]

    def prepare(
        self, fold: SessionFold, batch: AdmittedBatch, wanted: Iterable[PricingProfile] = ()
    ) -> None:
        """``prepare_in_steps`` run to its end at once, with the ledgers of ``wanted`` profiles
        not kept yet (``price_ledgers``)."""
        ledgers = self.price_ledgers([p for p in wanted if p not in self._ledgers])
        for _ in self.prepare_in_steps(fold, batch, ledgers):
            pass

    def price_ledgers(
        self, profiles: Iterable[PricingProfile]
    ) -> dict[PricingProfile, dict[int, NodeCost]]:
        """``price_ledger`` of each of ``profiles`` (a worker thread: it only reads the meter)."""
        return {p: self.price_ledger(p) for p in dict.fromkeys(profiles)}

    def prepare_in_steps(
        self,
        fold: SessionFold,
        batch: AdmittedBatch,
        ledgers: Mapping[PricingProfile, dict[int, NodeCost]] | None = None,
    ) -> Generator[None, None, None]:
        """Price, ahead of ``observe``, what ``batch`` adds or reprojects for every ledger and
        for ``ledgers`` (``price_ledgers`` of profiles not kept yet, installed by ``observe``),
        pausing (``yield``) after each node, so that the loop runs other calls between steps.
        Texts ``count_ahead`` counted are taken from its counts; a ledger without them (a
        tokenizer with a batch API, when nothing was counted ahead) is priced in one batched
        call.

        Only reads the meter and the fold, so it runs while the batch commits; the session's
        lock must keep both still until ``observe``. Without it (or after a rollback, or when it
        was not run to its end) ``observe`` prices on its own.
        """
        self._staged = None
        profiles = list(self._ledgers)
        ledgers = {p: c for p, c in (ledgers or {}).items() if p not in self._ledgers}
        # (key, event, offloaded, index of its surface change or -1: a reprojected node)
        items: list[tuple[int, SessionEvent, Set[int], int]] = []
        parsed = {event.seq: event for event in batch.events}  # a node parses its bytes anew
        position_of = fold.surface.position_of
        for index, change in enumerate(batch.surface_changes):
            seq = change.node.seq
            if position_of(seq) is not None:
                event = parsed.get(seq)
                node = change.node.event if event is None else event
                items.append((seq, node, frozenset(), index))
            yield
        for seq in batch.reprojected:
            position = position_of(seq)
            if position is not None:
                event = fold.surface[position].event
                items.append((-1 - seq, event, fold.offloads.get(seq, frozenset()), -1))
            yield
        nodes: dict[PricingProfile, dict[int, NodeCost]] = {}
        ahead, self._ahead = self._ahead, {}
        for pricing in [*profiles, *ledgers]:
            costs = nodes[pricing] = {}
            counted, prices = _counted_ahead(ahead.get(pricing), batch)
            if counted is None and TextsAhead.of(pricing) is None:  # priced node by node
                counted = {}
            if counted is None:  # nothing counted ahead: one batched count of all the texts
                made = price_nodes([(e, o) for _, e, o, _ in items], pricing)
                costs.update(zip([key for key, _, _, _ in items], made, strict=True))
                yield
                continue
            priced = with_counted(pricing, counted)
            for key, event, offloaded, index in items:
                cost = prices[index] if index >= 0 and prices else None
                costs[key] = price_node(event, priced, offloaded) if cost is None else cost
                yield
        appended = yield from _only_appended(batch)
        if appended is not None:
            for pricing in [*profiles, *ledgers]:
                appended.prices[pricing] = yield from _priced_in_steps(
                    appended, pricing, nodes[pricing]
                )
        self._staged = _Staged(batch, ledgers, nodes, appended)

    def price_ledger(self, pricing: PricingProfile) -> dict[int, NodeCost]:
        """Every current node's price for ``pricing`` (persisted prices where kept), in a
        worker thread if need be: it only reads the meter."""
        persisted = self._persisted.get(pricing.key, {})
        missing = [seq for seq in self._nodes if seq not in persisted]
        priced = price_nodes(
            [(self._nodes[s].event, self._offloads.get(s, frozenset())) for s in missing], pricing
        )
        fresh = dict(zip(missing, priced, strict=True))
        return {seq: persisted[seq] if seq in persisted else fresh[seq] for seq in self._nodes}

    def has_ledger(self, pricing: PricingProfile) -> bool:
        """Whether ``measure`` with ``pricing`` is O(1) already."""
        return pricing in self._ledgers

    def add_ledger(self, pricing: PricingProfile, costs: Mapping[int, NodeCost]) -> None:
        """Keep ``costs`` (``price_ledger``'s, made while nothing was observed) as the ledger of
        ``pricing``."""
        if pricing not in self._ledgers:
            self._install(pricing, costs)

    def persisted_prices(self) -> dict[str, dict[int, NodeCost]]:
        """Every node price the meter keeps, per ``PricingProfile.key``: what a snapshot
        persists (read only)."""
        # ``list(...)`` first: a ledger may be installed on the loop meanwhile (one C call each,
        # so the GIL keeps them whole), and a Python loop over a changing dict would fail.
        found = {key: dict(costs) for key, costs in list(self._persisted.items())}
        for pricing, ledger in list(self._ledgers.items()):
            found[pricing.key] = dict(ledger.costs)
        return found

    def anchor_state(self) -> tuple[int, int] | None:
        """The usage anchor as (message seq, header seq in force when it arrived), or None."""
        if self._anchor is None:
            return None
        return self._anchor.seq, self._anchor.header_seq

    def _restore_anchor(
        self,
        fold: SessionFold,
        seq: int,
        header_seq: int,
        header: events_pb2.RequestHeader | None,
    ) -> None:
        """Take the anchor a snapshot recorded: the message at ``seq`` (a current node), and
        ``header`` (logged at ``header_seq``) the one in force when it arrived."""
        position = fold.surface.position_of(seq)
        if position is None:
            return
        node = fold.surface[position]
        self._anchor = _Anchor(seq, _usage(node.event), header_seq, header)
        self._after_anchor = {n.seq for n in fold.surface.nodes[position + 1 :]}

    def _install(self, pricing: PricingProfile, costs: Mapping[int, NodeCost]) -> _Ledger:
        ledger = _Ledger(pricing)
        for seq, cost in costs.items():
            ledger.put(seq, cost, seq in self._after_anchor)
        self._ledgers[pricing] = ledger
        self._persisted.pop(pricing.key, None)
        return ledger

    def _apply(self, fold: SessionFold, change: SurfaceChange, kind: str) -> None:
        """Price the node one surface event created (``kind``: its body) and drop what it
        shadowed. Runs once per appended message: kept to the few lookups it needs."""
        seq = change.node.seq
        event = change.node.event if kind == "assistant_message" else None  # parsed once
        in_delta = False
        ahead = bool(change.shadowed) and kind == "user_message" and _prepared_ahead(change.node)
        if ahead:  # priced before they are forgotten
            self._shadowed_prices = {
                pricing: sum(ledger.costs[s.seq].total for s in change.shadowed
                             if s.seq in ledger.costs)
                for pricing, ledger in self._ledgers.items()
            }  # fmt: skip
        if change.shadowed or change.inserted:  # an INSERT changes what comes before later nodes
            if change.shadowed:
                self._forget_span([old.seq for old in change.shadowed])
            if self._anchor is not None and self._before_anchor(fold, seq):
                self._drop_anchor()
            in_delta = self._anchor is not None
        elif event is not None and _usage(event):
            self._set_anchor(seq, event)
        else:
            in_delta = self._anchor is not None
        if fold.surface.position_of(seq) is None:
            return  # shadowed later in this batch
        self._nodes[seq] = change.node
        if in_delta:
            self._after_anchor.add(seq)
        staged = self._batch_prices
        for ledger in self._ledgers.values():
            # A new node has no offloads yet; an offload in this batch reprojects it afterwards.
            cost = staged.get(ledger.pricing, _NONE).get(seq)
            if cost is None:
                if event is None:
                    event = change.node.event
                cost = price_node(event, ledger.pricing)
            ledger.put(seq, cost, in_delta)
        if ahead:
            self._ahead_margins(change)

    def _forget_span(self, seqs: Sequence[int]) -> None:
        """``_forget`` each of ``seqs`` (a REPLACE's shadowed span), with the lookups hoisted
        out of the loop. Dropping the anchor first is the same as dropping it in turn: a node
        forgotten before it was not after it, and the drop zeroes every delta anyway."""
        if self._anchor is not None and self._anchor.seq in set(seqs):
            self._drop_anchor()
        after, nodes, offloads = self._after_anchor, self._nodes, self._offloads
        in_delta = after.intersection(seqs)
        after.difference_update(in_delta)
        persisted = list(self._persisted.values())
        for seq in seqs:
            nodes.pop(seq, None)
            offloads.pop(seq, None)
            for costs in persisted:
                costs.pop(seq, None)
        for ledger in self._ledgers.values():
            ledger.drop_span(seqs, in_delta)

    def _offloaded(self, fold: SessionFold, offload: events_pb2.ImageOffload) -> None:
        for target in offload.targets:
            if self._anchor is not None and self._before_anchor(fold, target.seq):
                self._drop_anchor()

    def _pinned(self, fold: SessionFold) -> None:
        """Take the pins in force after the batch (the message sits before every node but the
        head, so a usage anchor no longer covers the request as it is now)."""
        self._pins_seq, self._pins_message = fold.pins_seq, fold.pins_message()
        if self._anchor is not None:
            self._drop_anchor()

    def _reproject(self, fold: SessionFold, seq: int) -> None:
        if seq not in self._nodes:
            return
        self._offloads[seq] = fold.offloads.get(seq, frozenset())
        in_delta = seq in self._after_anchor
        for costs in self._persisted.values():
            costs.pop(seq, None)
        staged = self._batch_prices
        for ledger in self._ledgers.values():
            cost = staged.get(ledger.pricing, _NONE).get(-1 - seq)
            if cost is None:
                cost = self._price(seq, ledger.pricing)
            ledger.put(seq, cost, in_delta)

    def _price(self, seq: int, pricing: PricingProfile) -> NodeCost:
        return price_node(self._nodes[seq].event, pricing, self._offloads.get(seq, frozenset()))

    # ---- the anchor ---------------------------------------------------------------------

    def _set_anchor(self, seq: int, event: SessionEvent) -> None:
        self._anchor = self._new_anchor(seq, _usage(event))
        self._after_anchor.clear()
        for ledger in self._ledgers.values():
            ledger.delta = 0

    def _new_anchor(self, seq: int, usage: int) -> _Anchor:
        """The anchor of message ``seq``; the first after a checkpoint prepared ahead carries
        that checkpoint's freed tokens as its stale margins."""
        margins, self._stale_margins = self._stale_margins, {}
        return _Anchor(seq, usage, self._header_seq, self._header, MappingProxyType(margins))

    def _ahead_margins(self, change: SurfaceChange) -> None:
        """After a checkpoint prepared ahead: per pricing, what it freed (route tokens of the
        nodes it shadowed less its own), for the next usage anchor (``_new_anchor``)."""
        seq = change.node.seq
        margins = {}
        for pricing, ledger in self._ledgers.items():
            checkpoint = ledger.costs.get(seq)
            if checkpoint is not None:
                margins[pricing] = self._shadowed_prices[pricing] - checkpoint.total
        self._stale_margins = margins

    def _drop_anchor(self) -> None:
        self._anchor = None
        self._after_anchor.clear()
        for ledger in self._ledgers.values():
            ledger.delta = 0

    def _before_anchor(self, fold: SessionFold, seq: int) -> bool:
        """Whether the current node ``seq`` sits at or before the anchor (post-batch positions:
        replacements keep the relative order of the nodes they do not shadow)."""
        assert self._anchor is not None
        anchor_at = fold.surface.position_of(self._anchor.seq)
        node_at = fold.surface.position_of(seq)
        if anchor_at is None:
            return True  # the anchor is shadowed within this batch
        return node_at is not None and node_at <= anchor_at

    def _bootstrap_anchor(self, fold: SessionFold) -> None:
        """Find the anchor of a fold restored without this meter watching.

        The latest appended ``assistant/message`` with usage anchors when no later event could
        have changed what precedes it: no node before it is newer, no image before it is
        offloaded, and no header was logged after it (conservative: those facts are not kept).
        """
        nodes = fold.surface.nodes
        for position in range(len(nodes) - 1, -1, -1):
            node = nodes[position]
            if ev.is_replace(node.event) or ev.is_insert(node.event) or not _usage(node.event):
                continue
            earlier = nodes[:position]
            stale = (
                fold.header_seq > node.seq
                or fold.pins_seq > node.seq
                or any(n.seq > node.seq for n in earlier)
                or any(n.seq in fold.offloads for n in earlier)
            )
            if not stale:
                self._anchor = _Anchor(node.seq, _usage(node.event), fold.header_seq, fold.header)
                self._after_anchor = {n.seq for n in nodes[position + 1 :]}
            return

    def _anchor_applies(self, route: MeteredRoute) -> bool:
        anchor, header = self._anchor, self._header
        if anchor is None or header is None:
            return False
        if (route.provider, route.model) != (header.config.provider, header.config.model):
            return False
        if anchor.header_seq == self._header_seq:
            return True
        key = (anchor.seq, self._header_seq)
        if self._same_header[0] != key:
            same = anchor.header is not None and same_request(anchor.header, header)
            self._same_header = (key, same)
        return self._same_header[1]

    # ---- measuring ----------------------------------------------------------------------

    def measure(
        self, fold: SessionFold, route: MeteredRoute, *, anchored: bool = True
    ) -> Measurement:
        """The envelope's price for ``route`` at the last observed revision.

        Costs O(1) once the route's profile has a ledger; the first measurement with a new
        profile prices every current node once. ``fold`` must be the fold this meter follows.
        With ``anchored=False``, the meter's own estimate even when usage would anchor it.
        """
        self._check_fold(fold)
        pricing = route.pricing  # a property that looks the profile up: once per measurement
        ledger = self._ledger(pricing)
        head_text = self._system_text()
        estimate = _assemble(
            revision=self.revision,
            pricing=pricing,
            costs=ledger.costs,
            head=self._head,
            totals=NodeCost(ledger.messages, ledger.images),
            tools=ledger.tools(
                (self._header_seq, self._declared_version),
                lambda: envelope_tools(self._header, self.declared_tools(self._header)),
                (self._head, head_text),
            ),
            config=price_config(self._header, pricing, head_text),
            pins=ledger.pins(self._pins_seq, self._pins_message),
        )
        if not anchored or not self._anchor_applies(route):
            return estimate
        assert self._anchor is not None
        covered = estimate.total - ledger.delta  # the estimate of the envelope usage priced
        if self._anchor.usage < covered:
            return estimate
        margin = self._anchor.stale_margins.get(pricing)
        if margin is not None and self._anchor.usage - covered >= margin / 2:
            return estimate  # it priced the surface before a checkpoint prepared ahead
        gap = self._anchor.usage - covered
        return _replace_anchored(estimate, gap, self._anchor.seq)

    def anchor_of(self, route: MeteredRoute) -> tuple[int, int, int] | None:
        """``(seq, usage, delta)`` of the usage anchor when it anchors ``route``'s measurement:
        the anchoring message, its usage, and the route tokens of the nodes after it."""
        if self._anchor is None or self.measure(self._fold, route).anchor_seq is None:
            return None
        return self._anchor.seq, self._anchor.usage, self._ledger(route.pricing).delta

    def route_price_of_nodes(
        self, fold: SessionFold, seqs: Iterable[int], route: MeteredRoute
    ) -> int:
        """The route price of the current surface nodes ``seqs`` (cached prices).

        Raises:
            ValueError: A seq is not a current surface node.
        """
        self._check_fold(fold)
        ledger = self._ledger(route.pricing)
        total = 0
        for seq in seqs:
            cost = ledger.costs.get(seq)
            if cost is None:
                raise ValueError(f"seq {seq} is not a current surface node")
            total += cost.total
        return total

    def _system_text(self) -> str | None:
        """The system head's text, parsed once per head (a node's event never changes)."""
        if self._head is None:
            return None
        if self._head_text[0] != self._head:
            node = self._nodes.get(self._head)
            if node is None:
                return None
            self._head_text = (self._head, _system_text(node.event))
        return self._head_text[1]

    def _ledger(self, pricing: PricingProfile) -> _Ledger:
        ledger = self._ledgers.get(pricing)
        if ledger is None:  # the service builds ledgers off the loop first (``price_ledger``)
            ledger = self._install(pricing, self.price_ledger(pricing))
        return ledger

    def _check_fold(self, fold: SessionFold) -> None:
        if fold is not self._fold:
            raise ValueError("this meter follows another session's fold")


#: Bodies whose events ``observe`` folds one by one (``_Appended`` does not cover them).
_NONE: Mapping[int, NodeCost] = MappingProxyType({})  # no staged prices
_PRICED_STEP = 64  # entries summed or looked at between pauses (a few operations each)


def _counted_ahead(
    ahead: tuple[Sequence[SessionEvent], CountedAhead] | None, batch: AdmittedBatch
) -> tuple[dict[str, int] | None, list[NodeCost | None]]:
    """The texts ``count_ahead`` counted (None: none), and the prices it made of the batch's
    surface changes, by index (empty: it collected other events than the batch was admitted
    from, a batch refused since)."""
    if ahead is None:
        return None, []
    events, counted = ahead
    same = events is batch.source or events is batch.events
    if not same or len(counted.prices) != len(batch.surface_changes):
        return counted.counts, []
    return counted.counts, counted.prices


def _only_appended(batch: AdmittedBatch) -> Generator[None, None, _Appended | None]:
    """The nodes ``batch`` appended, when that is all it did to what the meter keeps; pauses
    (``yield``) between passes over the batch."""
    # ``rewrites``: a header, an image offload, a pin (or a REPLACE or INSERT) among its events.
    if batch.rewrites or batch.reprojected:
        return None
    if any(c.shadowed or c.inserted for c in batch.surface_changes):
        return None
    yield
    events = batch.events
    nodes = {change.node.seq: change.node for change in batch.surface_changes}
    anchor = None
    # Only an appended assistant/message with usage (``answered``) can be the anchor: the
    # latest one whose usage is not 0. Its event is parsed already (a node parses anew).
    for seq in reversed(batch.answered):
        usage = _usage(events[seq - batch.first_seq]) if seq in nodes else 0
        if usage:
            anchor = (seq, usage)
            break
        yield
    after = [seq for seq in nodes if anchor is None or seq > anchor[0]]
    return _Appended(nodes, anchor, after, {})


def _priced(
    appended: _Appended, pricing: PricingProfile, staged: Mapping[int, NodeCost] = _NONE
) -> tuple[dict[int, NodeCost], int, int, int]:
    """``_priced_in_steps`` run to its end at once."""
    return run_to_end(_priced_in_steps(appended, pricing, staged))


def _priced_in_steps(
    appended: _Appended, pricing: PricingProfile, staged: Mapping[int, NodeCost]
) -> Generator[None, None, tuple[dict[int, NodeCost], int, int, int]]:
    """The appended nodes' prices for ``pricing`` (``staged`` ones where made) and their sums:
    messages, images, and the total of the nodes after the batch's anchor; pauses (``yield``)
    after each node that had to be priced here and every ``_PRICED_STEP`` that were staged."""
    costs: dict[int, NodeCost] = {}
    messages = images = 0
    for index, (seq, node) in enumerate(appended.nodes.items()):
        cost = staged.get(seq)
        if cost is None:
            cost = price_node(node.event, pricing)
            yield
        elif index % _PRICED_STEP == 0:
            yield
        costs[seq] = cost
        messages += cost.messages
        images += cost.images
    after = sum(costs[seq].total for seq in appended.after)
    return costs, messages, images, after


def _usage(event: SessionEvent) -> int:
    """The provider usage an ``assistant/message`` carries (0 if none): input + cache read +
    cache write + output tokens; reasoning is already counted in output."""
    if not event.HasField("assistant_message"):
        return 0
    message = event.assistant_message
    if not message.HasField("usage"):
        return 0
    u = message.usage
    return u.input_tokens + u.cache_read_tokens + u.cache_write_tokens + u.output_tokens


def _head_seq(fold: SessionFold) -> int | None:
    nodes = fold.surface.nodes  # the list, read once (``Surface``'s ``len`` and ``[]`` are calls)
    if nodes and nodes[0].type == ev.SYSTEM_MESSAGE:
        return nodes[0].seq
    return None


def _system_text(event: SessionEvent | None) -> str | None:
    return event.system_message.text if event is not None else None


def _head_text(fold: SessionFold) -> str | None:
    head = _head_seq(fold)
    return _system_text(fold.surface[0].event) if head is not None else None


def _pins_price(message: Message | None, pricing: PricingProfile) -> int:
    """The route price of the pinned-state message (0 when no pin is in force)."""
    return 0 if message is None else price_message(message, pricing).total


def _sum(costs: Iterable[NodeCost]) -> NodeCost:
    messages = images = 0
    for cost in costs:
        messages += cost.messages
        images += cost.images
    return NodeCost(messages, images)


def _assemble(
    *,
    revision: int,
    pricing: PricingProfile,
    costs: dict[int, NodeCost],
    head: int | None,
    totals: NodeCost,
    tools: int,
    config: int,
    pins: int = 0,
) -> Measurement:
    head_cost = costs.get(head, NodeCost(0)) if head is not None else NodeCost(0)
    system = head_cost.total
    messages = totals.messages - head_cost.messages
    images = totals.images - head_cost.images
    return Measurement(
        revision=revision,
        total=system + tools + messages + images + config + pins,
        system=system,
        tools=tools,
        messages=messages,
        images=images,
        config=config,
        method=_method(pricing),
        tokenizer=pricing.tokenizer.name,
        pins=pins,
    )


def _method(pricing: PricingProfile) -> Method:
    if pricing.template is not None and pricing.exact:
        return Method.EXACT
    return Method.TOKENIZER if pricing.exact else Method.HEURISTIC


def _replace_anchored(estimate: Measurement, gap: int, anchor_seq: int) -> Measurement:
    return Measurement(
        revision=estimate.revision,
        total=estimate.total + gap,
        system=estimate.system,
        tools=estimate.tools,
        messages=estimate.messages + gap,
        images=estimate.images,
        config=estimate.config,
        method=Method.ANCHORED,
        tokenizer=estimate.tokenizer,
        anchor_seq=anchor_seq,
        pins=estimate.pins,
    )
