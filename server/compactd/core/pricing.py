"""Token prices of the pieces of a request envelope: messages, the system head, tools, config.

Two kinds of pricing share one algorithm, parameterized by a ``Tokenizer`` and a ``Framing``:

- The reference heuristic (``HEURISTIC``), exactly as the spec states it: 4 characters per token
  counted in UTF-16 code units; a text or reasoning block ``ceil(len/4) + 4``; a tool call
  ``ceil(len(name)/4) + ceil(len(arguments)/4) + 4``; any other block ``4 + ceil(len(its
  canonical JSON)/4)``; a message is its blocks ``+ 4``; a system message is ``ceil(len/4) + 4``
  with no per-block overhead and 0 when empty; tools ``ceil(len(JSON of the declarations)/4) +
  4``, 0 when absent. It is the fallback for routes without a tokenizer and the fixed price of
  every shadow price the compaction log records.
- Exact pricing: a real tokenizer counts the text, and the route family's ``Framing`` adds the
  chat format's per-message, per-tool-call and per-tool tokens.

- Template pricing (open models): the route's chat template (``core.chat_template``) rendered
  one message at a time and counted by its tokenizer; the framing (begin-of-sequence, system
  block, tools preamble, generation prompt) is priced apart, through ``price_tools`` and
  ``price_config``, which then need the system head's text.

Images still sent cost the route's ``ImagePricing`` plus their handle text when the route
declares one, else the structural (heuristic) block price; offloaded images cost their
placeholder text, which the projection already put in their place.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Final, NamedTuple, Protocol, runtime_checkable

from google.protobuf import json_format

from compactd.core import events as ev
from compactd.core.chat_template import TemplatePricing, chat_message, chat_tools
from compactd.core.events import SessionEvent
from compactd.core.projection import Message, project
from compactd.v1 import events_pb2, session_service_pb2

ContentBlock = events_pb2.ContentBlock
RequestHeader = events_pb2.RequestHeader
ToolDeclaration = events_pb2.ToolDeclaration

_SYSTEM = session_service_pb2.MESSAGE_ROLE_SYSTEM


@runtime_checkable
class Tokenizer(Protocol):
    """The tokenizer seam: counts the tokens of a text.

    ``exact`` is False only for the heuristic; a measurement made with an exact tokenizer is
    reported as EXACT. Implementations must be deterministic and safe to share between sessions.
    """

    @property
    def name(self) -> str:
        """Stable name reported in breakdowns (``cl100k_base``, ``deepseek-v4``, ``heuristic``)."""
        ...

    @property
    def exact(self) -> bool:
        """Whether counts are the model's own tokenization."""
        ...

    def count(self, text: str) -> int:
        """Number of tokens ``text`` encodes to (no special tokens added)."""
        ...


def utf16_length(text: str) -> int:
    """Length of ``text`` in UTF-16 code units (astral characters count twice)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-16-le")) // 2


def quarter_tokens(text: str) -> int:
    """The heuristic's token count of a text: ``ceil(utf16 length / 4)``."""
    return (utf16_length(text) + 3) // 4


class HeuristicTokenizer:
    """The reference heuristic as a tokenizer: 4 UTF-16 code units per token, rounded up.

    The first-class fake of the ``Tokenizer`` seam: no data files, instant, deterministic.
    """

    name = "heuristic"
    exact = False

    def count(self, text: str) -> int:
        """``ceil(len(text in UTF-16 code units) / 4)``."""
        return quarter_tokens(text)


@dataclass(frozen=True, slots=True)
class Framing:
    """Tokens a chat format adds around the content, per structural element.

    Attributes:
        per_message: Added to every message that is not a system message (role markers).
        per_system: Added to a non-empty system message.
        per_block: Added to every text and reasoning block.
        per_tool_call: Added to every tool call, besides its name and arguments.
        per_tool: Added to every tool declaration, besides its JSON.
        per_tools: Added once when the request declares any tool.
        per_request: Added once per request (begin-of-sequence, reply priming); reported as
            config tokens.
    """

    per_message: int = 0
    per_system: int = 0
    per_block: int = 0
    per_tool_call: int = 0
    per_tool: int = 0
    per_tools: int = 0
    per_request: int = 0


# The reference heuristic's structure: every overhead is 4 tokens and nothing frames a request.
HEURISTIC_FRAMING = Framing(per_message=4, per_system=4, per_block=4, per_tool_call=4, per_tools=4)


@dataclass(frozen=True, slots=True)
class ImagePricing:
    """A route's price for one input image that is still sent.

    ``per_image`` alone is a flat price. With ``per_tile`` the size-based formula applies: the
    image is scaled to fit ``max_side`` x ``max_side``, then so its short side is at most
    ``short_side``, and costs ``per_image + per_tile * tiles`` where tiles are
    ``tile_side``-pixel squares covering it. An image without known dimensions is priced as a
    ``short_side`` square.
    """

    per_image: int
    per_tile: int = 0
    tile_side: int = 512
    max_side: int = 2048
    short_side: int = 768

    def tokens(self, width: int, height: int) -> int:
        """The tokens of one image of ``width`` x ``height`` pixels (0 or less: unknown)."""
        if not self.per_tile:
            return self.per_image
        if width <= 0 or height <= 0:
            width = height = self.short_side
        scale = min(1.0, self.max_side / max(width, height))
        w, h = width * scale, height * scale
        scale = min(1.0, self.short_side / min(w, h))
        w, h = w * scale, h * scale
        tiles = math.ceil(w / self.tile_side) * math.ceil(h / self.tile_side)
        return self.per_image + self.per_tile * tiles


@dataclass(frozen=True, slots=True)
class PricingProfile:
    """Everything a node's price depends on besides the node: one cache key of the meter.

    Attributes:
        tokenizer: Counts text.
        framing: The chat format's structural tokens.
        image_pricing: The route's image price; None prices images structurally.
        sends_reasoning: Whether the route sends assistant reasoning back (exact pricing only;
            the heuristic always counts reasoning, as the reference does).
        template: The chat template pricing of an open-model route (None: ``framing`` applies).
        count: ``tokenizer.count``, bound once.
        prices_reasoning: Whether reasoning blocks are priced (``sends_reasoning`` or heuristic).
        fallback: Why the route's own tokenizer or template is not used (a missing file), ""
            when it is; reported with every measurement, never compared.
        template_key: The template's stable identity (tokenizer and template digests), "" for
            none: profiles compare and hash by it, never by the template object.
    """

    tokenizer: Tokenizer = field(compare=False)
    framing: Framing
    image_pricing: ImagePricing | None = None
    sends_reasoning: bool = True
    template: TemplatePricing | None = field(default=None, compare=False, repr=False)
    fallback: str = field(default="", compare=False)
    tokenizer_name: str = field(init=False, default="")
    template_key: str = field(init=False, default="")
    count: Callable[[str], int] = field(init=False, compare=False, repr=False)
    prices_reasoning: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Profiles compare and hash by the tokenizer's name, so equal routes share one cache.
        object.__setattr__(self, "tokenizer_name", self.tokenizer.name)
        object.__setattr__(self, "template_key", self.template.key if self.template else "")
        # Bound once: the meter counts every text block through it.
        object.__setattr__(self, "count", self.tokenizer.count)
        object.__setattr__(self, "prices_reasoning", self.sends_reasoning or not self.exact)

    @property
    def exact(self) -> bool:
        """Whether the tokenizer is exact."""
        return self.tokenizer.exact

    @property
    def key(self) -> str:
        """A stable text identity of the profile, equal for equal profiles in every process
        (tokenizer name, template digests, framing, image pricing, reasoning): what persisted
        prices can be keyed by."""
        f, images = self.framing, self.image_pricing
        framing = ",".join(map(str, (f.per_message, f.per_system, f.per_block, f.per_tool_call,
                                     f.per_tool, f.per_tools, f.per_request)))  # fmt: skip
        image = "-" if images is None else ",".join(
            map(str, (images.per_image, images.per_tile, images.tile_side, images.max_side,
                      images.short_side))
        )  # fmt: skip
        reasoning = "r" if self.sends_reasoning else "n"
        return f"{self.tokenizer_name}|{self.template_key}|{framing}|{image}|{reasoning}"


HEURISTIC = PricingProfile(HeuristicTokenizer(), HEURISTIC_FRAMING)


class NodeCost(NamedTuple):
    """The price of one message: its image part (images sent and offload placeholders) and the
    rest (text, reasoning, tool calls, framing). A named tuple: the meter makes one per node."""

    messages: int
    images: int = 0

    @property
    def total(self) -> int:
        """Both parts."""
        return self.messages + self.images


ZERO = NodeCost(0, 0)

#: Shared text-only costs, by their token count (see ``node_cost``), and how many at most.
_SHARED_COSTS: dict[int, NodeCost] = {}
SHARED_COSTS_MAX: Final = 1 << 16


def node_cost(messages: int, images: int = 0) -> NodeCost:
    """``NodeCost(messages, images)``, one shared object per text-only cost.

    The meter keeps a cost per resident node and pricing profile, but few distinct ones. Each
    distinct object is one more object the cyclic collector walks on every full collection, a
    pause on the event loop that would otherwise grow with every node of every resident session.
    The table is bounded (``SHARED_COSTS_MAX`` entries); a cost past it is made unshared.
    """
    if images:
        return NodeCost(messages, images)
    cost = _SHARED_COSTS.get(messages)
    if cost is None:
        cost = NodeCost(messages)
        if len(_SHARED_COSTS) < SHARED_COSTS_MAX:
            cost = _SHARED_COSTS.setdefault(messages, cost)  # atomic: counting threads make costs
    return cost


def price_message(
    message: Message, pricing: PricingProfile, placeholders: Set[int] = frozenset()
) -> NodeCost:
    """The price of one projected message.

    Args:
        message: A message as ``core.projection.project`` returns it.
        pricing: The profile to price with.
        placeholders: Indexes of content blocks that are offload placeholders (priced as text,
            reported as images).
    """
    if pricing.template is not None:
        return _template_cost(message, pricing, pricing.template)
    if message.role == _SYSTEM:
        return node_cost(_system_tokens(message, pricing))
    cost = _content_cost(message.content, pricing)
    if not placeholders:
        return cost
    # Placeholder blocks are priced as the text they are, then reported with the images.
    moved = sum(_text_part(message.content[i], pricing) for i in placeholders)
    return node_cost(cost.messages - moved, cost.images + moved)


def price_node(
    event: SessionEvent, pricing: PricingProfile, offloaded: Set[int] = frozenset()
) -> NodeCost:
    """The price of the message a surface event projects to (``ZERO`` if it projects to none)."""
    kind = event.WhichOneof("body")
    if not offloaded and kind in _OWN_CONTENT and pricing.template is None:
        # Without offloads these project to their own content blocks, unchanged; pricing the
        # blocks in place spares copying them (a third of the meter's own cost per event).
        content = getattr(event, kind).content
        return _content_cost(content, pricing, drop_empty=kind == "assistant_message")
    message = project(event, offloaded)
    if message is None:
        return ZERO
    return price_message(message, pricing, _placeholder_indexes(event, message, offloaded))


_OWN_CONTENT = frozenset({"user_message", "assistant_message", "tool_result"})


def price_nodes(
    items: Sequence[tuple[SessionEvent, Set[int]]],
    pricing: PricingProfile,
    counted: Mapping[str, int] | None = None,
) -> list[NodeCost]:
    """``price_node`` of many ``(event, offloaded)`` at once, equal to pricing them one by one.

    A tokenizer with a batch API (``count_batch(texts) -> counts``; tiktoken's and HF
    tokenizers' encode many texts in parallel without the GIL) counts every text of the batch in
    one call: the nodes are walked once to collect their texts, the texts are counted together,
    and the walk is repeated with those counts. Template routes and tokenizers without a batch API
    price node by node. ``counted`` holds texts counted ahead (``TextsAhead``): the nodes are
    walked once, any other text counted as it comes. It only reads the events (a worker thread
    may run it).
    """
    if counted is not None:
        priced = with_counted(pricing, counted)
        return [price_node(event, priced, offloaded) for event, offloaded in items]
    batch = getattr(pricing.tokenizer, "count_batch", None)
    if batch is None or pricing.template is not None or len(items) < 2:
        return [price_node(event, pricing, offloaded) for event, offloaded in items]
    recorder = _TextRecorder(pricing.tokenizer)
    recording = replace(pricing, tokenizer=recorder)
    for event, offloaded in items:
        price_node(event, recording, offloaded)
    texts = list(recorder.texts)
    counts = dict(zip(texts, batch(texts), strict=True)) if texts else {}
    priced = replace(pricing, tokenizer=_CountedTexts(pricing.tokenizer, counts))
    return [price_node(event, priced, offloaded) for event, offloaded in items]


def node_texts(
    event: SessionEvent, pricing: PricingProfile, offloaded: Set[int] = frozenset()
) -> list[str] | None:
    """The texts ``price_node(event, pricing, offloaded)`` counts, each once; None for a chat
    template route (it prices rendered text). Counted elsewhere (a worker thread: tokenizers
    release the GIL), they price the node on ``with_counted`` exactly as ``price_node`` does."""
    if pricing.template is not None:
        return None
    recorder = _TextRecorder(pricing.tokenizer)
    price_node(event, replace(pricing, tokenizer=recorder), offloaded)
    return list(recorder.texts)


def with_counted(pricing: PricingProfile, counted: Mapping[str, int]) -> PricingProfile:
    """``pricing`` with ``counted`` texts (``TextsAhead``) answered from their counts; any other
    text is counted by its tokenizer as it comes: ``price_node`` with it equals ``price_node``
    with ``pricing``."""
    return replace(pricing, tokenizer=_CountedTexts(pricing.tokenizer, counted))


@dataclass(frozen=True, slots=True)
class CountedAhead:
    """What ``TextsAhead.count`` made: every collected text's tokens, and the price of each node
    collected, in ``TextsAhead.add`` order (None: one ``price_node`` must price, with the
    counts)."""

    counts: dict[str, int]
    prices: list[NodeCost | None]


class TextsAhead:
    """The texts nodes will be priced by with ``pricing``, collected before they are priced, so
    that one batched tokenizer call (``count``) can run while other work goes on, and the nodes'
    prices made from the counts in the same worker thread; None from ``of`` for a profile
    without a batch tokenizer or with a chat template.

    A node's price is its price with every text counted as 0 tokens (which ``add`` makes while
    it collects the texts) plus the tokens of the texts it counted, each time it counted one:
    every text's count is added to the message part. Only an image's handle text is added to
    the image part, and a priced image shows in that part's price (unless the route prices an
    image at 0 tokens: then no node is priced so); an assistant message that sends no block
    costs 0 whatever its empty texts count (a node priced 0 with texts is left to
    ``price_node``)."""

    def __init__(self, pricing: PricingProfile, batch: Callable[[list[str]], list[int]]) -> None:
        self.pricing = pricing
        self._batch = batch
        self._recorder = _TextRecorder(pricing.tokenizer)
        self._recording = replace(pricing, tokenizer=self._recorder)
        # Per node collected: its price without its texts' tokens (-1: ``price_node`` prices
        # it), and where its texts end in the recorder's ``counted``. Flat lists of ints: a
        # container per node would be as many more objects for the cyclic collector to chase.
        self._partial: list[int] = []
        self._ends: list[int] = []
        images = pricing.image_pricing
        self._sums = images is None or images.per_image > 0

    @classmethod
    def of(cls, pricing: PricingProfile) -> TextsAhead | None:
        batch = getattr(pricing.tokenizer, "count_batch", None)
        return None if batch is None or pricing.template is not None else cls(pricing, batch)

    def add(self, event: SessionEvent) -> None:
        """Collect the texts of a new node of ``event`` (no image offloaded yet)."""
        counted = self._recorder.counted
        start = len(counted)
        partial = price_node(event, self._recording)
        summed = self._sums and not partial.images and (partial.messages or len(counted) == start)
        self._partial.append(partial.messages if summed else -1)
        self._ends.append(len(counted))

    def count(self) -> CountedAhead:
        """Every collected text's tokens, in one batched call (a worker thread: the tokenizers
        release the GIL), and the collected nodes' prices."""
        texts = list(self._recorder.texts)
        counts = dict(zip(texts, self._batch(texts), strict=True)) if texts else {}
        # Tokens of the texts counted so far, in the order they were counted: a node's texts'
        # tokens are the difference of two of these.
        running = [0, *itertools.accumulate(map(counts.__getitem__, self._recorder.counted))]
        prices: list[NodeCost | None] = []
        start = 0
        for partial, end in zip(self._partial, self._ends, strict=True):
            summed = partial >= 0
            prices.append(node_cost(partial + running[end] - running[start]) if summed else None)
            start = end
        return CountedAhead(counts, prices)


class _TextRecorder:
    """A tokenizer that only remembers the texts it is asked to count: each once (``texts``),
    and each time, in order (``counted``)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.name = tokenizer.name
        self.exact = tokenizer.exact
        self.texts: dict[str, None] = {}
        self.counted: list[str] = []

    def count(self, text: str) -> int:
        self.texts[text] = None
        self.counted.append(text)
        return 0


class _CountedTexts:
    """A tokenizer answering from counts made in advance (the real one for any other text)."""

    def __init__(self, tokenizer: Tokenizer, counts: Mapping[str, int]) -> None:
        self.name = tokenizer.name
        self.exact = tokenizer.exact
        self._counts = counts
        self._count = tokenizer.count

    def count(self, text: str) -> int:
        found = self._counts.get(text)
        return self._count(text) if found is None else found


def _content_cost(
    content: Iterable[ContentBlock], pricing: PricingProfile, *, drop_empty: bool = False
) -> NodeCost:
    """The blocks' price plus the message framing, images apart; with ``drop_empty``, ``ZERO``
    when no block is sent (none, or only empty text: an assistant message that projects to no
    message).

    The meter's hot loop: one pass in which each text is read from its proto once.
    """
    count, framing = pricing.count, pricing.framing
    per_block = framing.per_block
    text = framing.per_message
    images = 0
    sent = False
    for block in content:
        kind = block.WhichOneof("block")
        if kind == "text":
            body = block.text.text
            text += count(body) + per_block
            sent = sent or bool(body)
        elif kind == "image":
            images += _block_tokens(block, kind, pricing)
            sent = True
        else:
            text += _block_tokens(block, kind, pricing)
            sent = True
    if drop_empty and not sent:
        return ZERO
    return node_cost(text, images)


def _text_part(block: ContentBlock, pricing: PricingProfile) -> int:
    """What ``_content_cost`` counts as text for ``block`` alone (0 for an image)."""
    return _content_cost([block], pricing).messages - pricing.framing.per_message


def price_tools(
    tools: Sequence[ToolDeclaration], pricing: PricingProfile, system: str | None = None
) -> int:
    """The price of the tool declarations: their JSON plus framing; 0 when there are none.

    A template route renders them into its tools preamble, which can share a stretch of text with
    the system head: ``system`` is the head's text (None or "" for none).
    """
    if not tools:
        return 0
    if pricing.template is not None:
        declared = chat_tools(tools)
        head = system or None
        return pricing.template.framing(head, declared) - pricing.template.framing(head, None)
    framing = pricing.framing
    body = pricing.tokenizer.count(tools_json(tools))
    return body + framing.per_tools + framing.per_tool * len(tools)


def price_config(
    header: RequestHeader | None, pricing: PricingProfile, system: str | None = None
) -> int:
    """Tokens the routed request adds besides messages and tools: the format's request framing.

    Sampling settings travel as request parameters, not prompt tokens, so only the framing
    counts; the heuristic has none. On a template route it is the template's framing without
    tools, less the system head's own node price (``system``: the head's text), so that head,
    tools and config add up to the template's framing.
    """
    del header  # the framing is the same for every config of a route family
    template = pricing.template
    if template is None:
        return pricing.framing.per_request
    head = system or None
    framing = template.framing(head, None)
    if head is None:
        return framing
    return framing - template.system_tokens(head)


def heuristic_price(item: SessionEvent | Message, offloaded: Set[int] = frozenset()) -> int:
    """The fixed reference-heuristic price of one surface event or projected message.

    This is the shadow price the compaction log records (``compaction/prune.shadowed_tokens``,
    ``TokenMeasurement.shadowed_tokens`` / ``checkpoint_tokens``): route-independent, so pure
    projection folds stay consistent. An event is projected first with ``offloaded`` (its
    offloaded image indexes); an event that projects to no message (an empty system or assistant
    message, a log-only event) costs 0. ``offloaded`` is ignored for a message.
    """
    if isinstance(item, SessionEvent):
        return price_node(item, HEURISTIC, offloaded).total
    return price_message(item, HEURISTIC).total


def tools_json(tools: Sequence[ToolDeclaration]) -> str:
    """The declarations as one compact JSON array of ``{name, description, inputSchema}``.

    The schema is spliced in as the runtime wrote it (it is compared byte-for-byte), so the
    priced text is what an adapter would send.
    """
    parts = []
    for tool in tools:
        schema = tool.input_schema_json or "{}"
        head = json.dumps(
            {"name": tool.name, "description": tool.description},
            ensure_ascii=False,
            separators=(",", ":"),
        )
        parts.append(f'{head[:-1]},"inputSchema":{schema}}}')
    return "[" + ",".join(parts) + "]"


def canonical_block_json(block: ContentBlock) -> str:
    """A block's canonical JSON: proto3 JSON names, sorted keys, no spaces, unescaped text."""
    data = json_format.MessageToDict(block)
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def image_handle(image: events_pb2.ImageBlock) -> str:
    """The text that identifies a sent image next to its pixels: its name or attachment id."""
    return image.name or image.attachment_id


def _system_tokens(message: Message, pricing: PricingProfile) -> int:
    text = "".join(b.text.text for b in message.content if b.HasField("text"))
    if not text:
        return 0
    return pricing.tokenizer.count(text) + pricing.framing.per_system


def _block_tokens(block: ContentBlock, kind: str | None, pricing: PricingProfile) -> int:
    """The price of one block other than text (``kind``: its oneof field, None if unset)."""
    count = pricing.count
    if kind == "reasoning":
        if not pricing.prices_reasoning:
            return 0
        return count(block.reasoning.text) + pricing.framing.per_block
    if kind == "tool_call":
        call = block.tool_call
        return count(call.name) + count(call.arguments_json) + pricing.framing.per_tool_call
    if kind == "image" and pricing.image_pricing is not None:
        image = block.image
        handle = image_handle(image)
        extra = count(handle) if handle else 0
        return pricing.image_pricing.tokens(image.width, image.height) + extra
    return structural_tokens(block)


def _template_cost(
    message: Message, pricing: PricingProfile, template: TemplatePricing
) -> NodeCost:
    """A message's price on a template route: what its rendering adds (a system message: as one
    after the head; ``price_config`` accounts for the head's own framing), images apart."""
    chat = chat_message(message, sends_reasoning=pricing.sends_reasoning)
    images = sum(
        _block_tokens(block, "image", pricing)
        for block in message.content
        if block.HasField("image")
    )
    return node_cost(template.message_tokens(chat), images)


def structural_tokens(block: ContentBlock) -> int:
    """The heuristic price of a block that is not text, reasoning or a tool call."""
    return 4 + quarter_tokens(canonical_block_json(block))


def _placeholder_indexes(
    event: SessionEvent, message: Message, offloaded: Set[int]
) -> frozenset[int]:
    """Indexes of ``message`` blocks that stand in for offloaded images of ``event``.

    ``project`` maps input content one block to one block, so block ``i`` of the message is a
    placeholder exactly when block ``i`` of the event is an image and the message's is text.
    """
    if not offloaded:
        return frozenset()
    kind = ev.body_name(event)
    if kind not in ("user_message", "tool_result"):
        return frozenset()
    original = getattr(event, kind).content
    return frozenset(
        i
        for i, (before, after) in enumerate(zip(original, message.content, strict=True))
        if before.HasField("image") and after.HasField("text")
    )
