"""``ExtractiveSummarizer``: a deterministic summary that needs no model.

For air-gapped deployments, as the test default, and as the quality gate's optional fallback. It
extracts facts instead of writing prose: the user's requests (verbatim, clipped), tools and
commands used, the file paths the span acts on (not those only a tool printed or a written file
holds: bulk, not facts), error lines, and the last state of the work, laid out in the same eight
sections the compaction instruction asks a model for (``prompts.SUMMARY_SECTIONS``; an empty one
is its heading alone). Paths,
commands and error lines come from ``core.probes``, the extraction the quality gate probes with,
so a summary this summarizer writes keeps the gate's probes whenever they fit ``max_tokens``.

A prior checkpoint in the span (a ``<compacted-summary>`` block) is folded forward, never copied
as a nested block: its paths, commands (``$ cmd`` bullets), error lines and requests are merged
with the span's own, deduplicated by what identifies each (a path's last two segments, a
command's program and first argument) and listed most recent first; the newer state replaces the
older "Work in Progress" and "Immediate Next Step".

The output fits its budget (below) under the reference heuristic (4 UTF-16 code units per
token), or the route's own count when the bracket hands it over: when everything does not
fit, the most useful facts are kept first: the session's first and the latest request; the
gate's probes; then every path, command and stated error line of the span and of the prior
checkpoint, alternating between the two and between the kinds, so a tight budget keeps the
newest of each and an older span's facts keep a share; then the current state and the next step
(the retained messages right after the checkpoint show where the work stands) and the other
requests; then tool counts and updates. A command keeps its first segment that runs a
program (``cd`` steps and pipelines dropped), an error line its first characters. A summary that
would keep less than the gate's default share of its probes is refitted with the probes first,
requests quoted by their shortest run of six words (``PROBE_FLOOR``). When the prior
checkpoint's paths and commands do not all fit, each is written by what identifies it only (a
path's last two segments, a command's program and first argument), so that more of them do.
Same input, same bytes.

A checkpoint costs a small share of what it replaces: the framed checkpoint fits ``SPAN_SHARE``
of its span (of the span's route price, ``SummaryRequest.span_tokens``, when the bracket knows it),
whatever the span's size, the gate's probes included (they rank right after the
current state, so a tight share keeps the most valuable facts and drops the rest). The share is
counted by the route when the bracket hands over its count (``SummaryRequest.checkpoint_tokens``):
the framed checkpoint then takes the largest fit within ``ROUTE_SHARE`` (15%) of the span as the
quality gate measures it. Without that count the share is checked with ``estimated_tokens``,
which errs high where the heuristic errs low (punctuation-dense paths and commands, non-ASCII
text), so the route's count mostly stays under 15% too (the bracket writes one that does not
again, smaller), at the cost of room left unused. ``max_tokens`` caps a model's generation, not
this checkpoint: a summary that takes a share of its span is bounded by that share and by the
room the window leaves (``SummaryRequest.room_tokens``); without a share (``span_share=None``),
``max_tokens`` bounds it. A span so small
that the share cannot hold ``MIN_CHECKPOINT_TOKENS`` (the sections, the current state and the
first probes) gets that many, never more than half the span; a policy that wants no checkpoint
above 15% sets ``minReductionRatio`` to 0.85: selection then declines such a span
(``SPAN_TOO_SMALL``, ``minimum_span_tokens``) before any summary is written. A checkpoint cut
to fit the window (a room) takes its share alone however small the span: the gate does not judge
its probes, and the recall handle keeps the span's facts within reach; when the eight empty
sections framed would take half that share or more, it is written lean (``_lean``): the sections
it has facts for only (the gate does not judge its sections either). A later fold reads a missing
section as an empty one.
Paths are dense: "Files Touched" writes one line per directory (``DIR/: a/b.py, c/d.py``, each
path keeping its last two segments; the directory the paths take the fewest characters under is
written once), in the section's order (most recent first), which a later fold reads back as
paths in that order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from compactd.core import probes, prompts
from compactd.core.gate import DEFAULT_MIN_PROBE_RETENTION
from compactd.core.pins import head_length
from compactd.core.pricing import heuristic_price, utf16_length
from compactd.core.recall import checkpoint_handle, with_recall_handles, without_recall_handles
from compactd.providers.base import SummaryError, SummaryRequest, SummaryResult
from compactd.reasons import Reason
from compactd.v1 import session_service_pb2

Message = session_service_pb2.Message
_ROLE = session_service_pb2

# Section indexes into prompts.SUMMARY_SECTIONS.
_GOALS, _TECH, _FILES, _ERRORS, _OUTSTANDING, _PROGRESS, _NEXT, _ESSENTIAL = range(8)
_UNITS_PER_TOKEN = 4
#: The largest share of its span a framed checkpoint takes, by its estimate (below the 15% the
#: summary-quality goal allows: the estimate errs high on most text; a checkpoint the route counts
#: above 15% anyway is written again smaller, ``service.bracket``).
SPAN_SHARE = 0.14
#: The largest share of its span a framed checkpoint takes when the route counts it
#: (``SummaryRequest.checkpoint_tokens``): the summary-quality goal itself.
ROUTE_SHARE = 0.15
#: The share of the policy's allowance (``1 - minReductionRatio``) a smallest checkpoint may take
#: of the smallest span selection accepts: at 0.85, 250 tokens of 1,852 (13.5%).
_SPAN_MARGIN = 0.9


def _framed_tokens(summary: str) -> float:
    """The estimated tokens of the checkpoint a summary becomes: its frame, and its recall
    section counted pessimistically (``_SECTION_TOKENS``)."""
    return estimated_tokens(prompts.frame_checkpoint(summary)) + _SECTION_TOKENS


#: The checkpoint's recall section (``core.recall``; a handle of typical width), at one token
#: per two characters: a handle's digits and punctuation split into short pieces, so the byte-pair
#: estimate would count it low.
_SECTION_TOKENS = len(with_recall_handles("", [checkpoint_handle(10_000)])) / 2
_FRAME_UNITS = utf16_length(prompts.frame_checkpoint("")) + int(_SECTION_TOKENS * 4)
#: The least a framed checkpoint may take (estimated tokens) when ``SPAN_SHARE`` of its span is
#: less: the eight sections with the current state and the first probes (about a hundred tokens
#: of bullets). From a span of ``MIN_CHECKPOINT_TOKENS / SPAN_SHARE`` (1,852) on, the share rules.
MIN_CHECKPOINT_TOKENS = 250
#: The share of the gate's probes a summary keeps before it is refitted with the probes first:
#: the gate's default threshold (``minProbeRetention``).
PROBE_FLOOR = DEFAULT_MIN_PROBE_RETENTION
#: What identifies an error line: its first characters (a clip keeps at least these).
ERROR_CHARS = 60
#: Error lines taken from one tool result (the gate probes its last three).
_ERRORS_PER_RESULT = 12
_ROOMY_UNITS = 2400  # bullets below this share keep one state line, leaving room for probes
_REFITS = 4  # fits tried before settling on the smallest (each shrinks the room by the overshoot)
_ELLIPSIS = "…"

# A prior checkpoint is exactly ``prompts.frame_checkpoint(summary)``; see ``_checkpoint_summary``.
_CHECKPOINT_HEADS = tuple(f"{p}\n\n{prompts.SUMMARY_OPEN_TAG}\n" for p in prompts.PREAMBLES)
_CHECKPOINT_TAIL = f"\n{prompts.SUMMARY_CLOSE_TAG}"


@dataclass(frozen=True)
class _Limits:
    request_units: int = 800
    item_units: int = 240
    command_units: int = 80
    error_units: int = 100  # an error line: its first 60 characters identify it
    state_units: int = 80  # a "Work in Progress" line; the next step takes ``item_units``
    state_lines: int = 3  # the last assistant message, tool call and tool result
    older_identities: bool = False  # a prior checkpoint's paths and commands: identities only


@dataclass
class _Facts:
    """Everything extracted from a span, in first-seen order."""

    prior: dict[int, list[str]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    tools: dict[str, int] = field(default_factory=dict)
    # Ordered sets (dicts): a long span names thousands of paths.
    commands: dict[str, None] = field(default_factory=dict)
    named_paths: dict[str, None] = field(default_factory=dict)  # the paths the span acts on
    stated_errors: dict[str, None] = field(default_factory=dict)  # lines that state an error
    updates: list[str] = field(default_factory=list)
    progress: list[str] = field(default_factory=list)
    next_step: str = ""
    has_new: bool = False


@dataclass(frozen=True)
class _Candidate:
    """One bullet that may enter the summary; lower ``rank`` is kept first."""

    rank: tuple[int, int]
    section: int
    order: int
    text: str


class ExtractiveSummarizer:
    """A ``Summarizer`` that extracts facts deterministically; never calls a model."""

    name = "extractive"

    def __init__(
        self,
        *,
        request_chars: int = 800,
        item_chars: int = 240,
        span_share: float | None = SPAN_SHARE,
    ) -> None:
        """Configure clipping.

        Args:
            request_chars: Longest quoted user request, in UTF-16 code units.
            item_chars: Longest other bullet (path, command, error line, state), same unit.
            span_share: The share of its span a framed checkpoint may take (``allowed_tokens``);
                None: ``max_tokens`` alone bounds it.
        """
        self._limits = _Limits(request_units=request_chars, item_units=item_chars)
        self._share = span_share

    async def summarize(self, request: SummaryRequest) -> SummaryResult:
        """Summarize ``request.messages`` within ``request.max_tokens``.

        Raises:
            SummaryError: ``max_tokens`` cannot hold even the eight empty sections.
        """
        text, found = self._summary(
            request.messages, request.max_tokens, request.span_tokens, request.checkpoint_tokens,
            request.room_tokens,
        )  # fmt: skip
        text = self._distinct(text, _span(request.messages), _Facts())
        return SummaryResult(
            text=text, usage=None, provider="compactd", model=self.name, finish_reason="stop",
            span_facts=found,
        )  # fmt: skip

    def summary_text(
        self,
        messages: Sequence[Message],
        max_tokens: int,
        *,
        span_tokens: int = 0,
        checkpoint_tokens: Callable[[str], int] | None = None,
    ) -> str:
        """The summary of ``messages`` (a leading system message is the head and is skipped);
        ``span_tokens`` and ``checkpoint_tokens`` as ``SummaryRequest`` has them."""
        text = self._summary(messages, max_tokens, span_tokens, checkpoint_tokens)[0]
        return self._distinct(text, _span(messages), _Facts())

    def _summary(
        self,
        messages: Sequence[Message],
        max_tokens: int,
        span_tokens: int = 0,
        count: Callable[[str], int] | None = None,
        room: int = 0,
    ) -> tuple[str, probes.SpanFacts]:
        """The summary and the span facts it was written from; ``span_tokens``, the span's route
        price when known (else its heuristic price), is what its share is taken of; ``count``,
        the route price of the checkpoint a text becomes, when known: the checkpoint then fills
        ``ROUTE_SHARE`` of the span as the route counts it rather than as the estimate does.
        A summary that takes a share of its span is bounded by that share and ``room`` (the
        request's room beside the floor, 0: none), not by ``max_tokens``: that caps a model's
        generation, and a checkpoint of a span many times the window needs more than a model
        would write in one call."""
        shared = self._share is not None
        cap = room if shared else min(room or max_tokens, max_tokens)
        budget = cap * _UNITS_PER_TOKEN if cap else _UNBOUNDED
        skeleton = _render({})
        if utf16_length(skeleton) > budget:
            name = "the room" if shared else "max_tokens"
            raise SummaryError(
                f"{name}={cap} cannot hold the summary's eight sections (needs at "
                f"least {-(-utf16_length(skeleton) // _UNITS_PER_TOKEN)})",
                reason=Reason.SUMMARIZER_MISCONFIGURED,
            )
        span = _span(messages)
        found = probes.span_facts(span)
        facts = _extract(span, found, self._limits)
        limits = self._limits
        # A lone prior checkpoint is written again as it was: only the budget bounds it.
        allowed = None
        share = budget
        fits: _Fits | None = None
        lean = False
        if facts.has_new and self._share is not None:
            priced = span_tokens or sum(map(heuristic_price, span))
            allowed = allowed_tokens(priced, self._share, strict=_strict(room))
            if count is not None and span_tokens:
                fits = _Fits(count, counted_allowance(span_tokens, strict=_strict(room)), budget)
            lean = _lean(priced * self._share, _strict(room), fits)
            if lean:  # the share alone, without the empty sections' floor
                allowed, skeleton = priced * self._share, ""
            units = int(allowed * _UNITS_PER_TOKEN) - _FRAME_UNITS
            share = min(budget, max(utf16_length(skeleton), units))
        # Clipped to the room the bullets share, whichever bounds it (the span's share, the
        # room or ``max_tokens``): a long request quoted whole would crowd out every fact.
        limits = _tightened(limits, share - utf16_length(skeleton))
        ranking = _candidates(facts, limits)
        _promote_probes(ranking, found, limits)
        text = _fit_share(ranking.candidates, share, allowed, fits, lean)
        if _drops_older_facts(facts, text):
            # The older spans' paths and commands did not all fit: each keeps only what
            # identifies it (a path's last two segments, a command's program and first
            # argument), so that the room holds more of them.
            limits = replace(limits, older_identities=True)
            ranking = _candidates(facts, limits)
            _promote_probes(ranking, found, limits)
            text = _fit_share(ranking.candidates, share, allowed, fits, lean)
        checked = probes.select_probes(found)
        if probes.retention(checked, text).ratio >= PROBE_FLOOR:
            return text, found
        # The gate would reject it: the probes go before everything, each request quoted by its
        # first words only, the state on one line.
        limits = replace(limits, state_lines=1, request_units=_QUOTE_UNITS)
        ranking = _candidates(facts, limits)
        _promote_probes(ranking, found, limits, tier=-1)
        first = text
        text = _fit_share(ranking.candidates, share, allowed, fits, lean)
        better = probes.retention(checked, text).ratio > probes.retention(checked, first).ratio
        return (text if better else first), found

    def _distinct(self, text: str, messages: Sequence[Message], facts: _Facts) -> str:
        """``text``, told apart from a prior checkpoint that already holds all of it (the gate
        rejects a summary that merely repeats a span message): the state then says how many
        messages followed that checkpoint."""
        folded = _fold(text)
        for message in messages:
            prior = _checkpoint_summary(_text(message))
            later = len(messages) - 1 - list(messages).index(message)
            if prior is not None and later and folded in _fold(prior):
                note = f"- {later} more message(s) since the previous checkpoint\n"
                heading = f"## {prompts.SUMMARY_SECTIONS[_PROGRESS]}\n"
                return text.replace(heading, heading + note, 1)
        return text


def allowed_tokens(span_tokens: float, share: float = SPAN_SHARE, *, strict: bool = False) -> float:
    """The estimated tokens a framed checkpoint of a ``span_tokens`` span may take: ``share`` of
    it, or for a span too small for that to hold ``MIN_CHECKPOINT_TOKENS``, that many but never
    more than half the span (and never less than the eight empty sections). ``strict``: the
    share alone (and the sections), for a checkpoint cut to fit the window (``_strict``)."""
    small = 0.0 if strict else min(MIN_CHECKPOINT_TOKENS, span_tokens / 2)
    return max(span_tokens * share, small, _SKELETON_TOKENS)


def _strict(room: int) -> bool:
    """Whether a checkpoint takes its share of the span and no more, however small the span: one
    cut to fit the window (``room``). ``MIN_CHECKPOINT_TOKENS`` is room for the quality gate's
    first probes, and the gate does not judge the probes of such a checkpoint; a span too small
    for its share to hold facts keeps them behind the checkpoint's recall handle."""
    return room > 0


def _lean(share_tokens: float, strict: bool, fits: _Fits | None) -> bool:
    """Whether a checkpoint leaves its empty sections out: one cut to fit the window (``strict``)
    whose share of its span (``share_tokens`` estimated, or the route's count in ``fits``) the
    eight empty sections framed would take more than half of (``_LEAN_SHARE``), or cannot hold
    at all. Such a bracket cannot be declined (the request would go over the window) and the
    gate does not judge its sections, so the headings no fact fills give way to facts, and the
    checkpoint stays within its share; the recall handle and the open handles are the frame's,
    kept either way."""
    if not strict:
        return False
    if fits is not None:
        return fits.count(_render({})) > fits.allowed * _LEAN_SHARE
    return share_tokens * _LEAN_SHARE < _SKELETON_TOKENS


#: The share of a room checkpoint's allowance its empty sections may take before it goes lean.
_LEAN_SHARE = 0.5


def minimum_span_tokens(min_reduction_ratio: float | None) -> int:
    """The smallest span whose extractive checkpoint reduces it by ``min_reduction_ratio``: every
    span when the checkpoint may take half of it or more, else the span that
    ``MIN_CHECKPOINT_TOKENS`` fits with ``_SPAN_MARGIN`` to spare (selection declines a smaller
    one, ``SPAN_TOO_SMALL``): the route may count the checkpoint higher than its estimate and the
    span lower than the heuristic prices it."""
    if min_reduction_ratio is None or 1 - min_reduction_ratio >= 0.5:
        return 0
    return math.ceil(MIN_CHECKPOINT_TOKENS / ((1 - min_reduction_ratio) * _SPAN_MARGIN))


def _tightened(limits: _Limits, content_units: int) -> _Limits:
    """Clipping for a summary whose bullets share ``content_units``: the current state and the
    requests (tier 0) clipped so that they leave room for the gate's probes. A request is kept by
    a quote of a few words, a state line by its head."""
    return replace(
        limits,
        request_units=min(limits.request_units, max(60, content_units // 10)),
        state_units=min(limits.state_units, max(48, content_units // 10)),
        state_lines=1 if content_units < _ROOMY_UNITS else limits.state_lines,
        error_units=min(limits.error_units, max(ERROR_CHARS * 5 // 4 + 4, content_units // 12)),
        command_units=min(limits.command_units, max(48, content_units // 16)),
    )


@dataclass(frozen=True)
class _Fits:
    """The route's count of a checkpoint, the most it may take, and the most code units its
    summary may (``max_tokens``)."""

    count: Callable[[str], int]
    allowed: int
    budget: int


def counted_allowance(span_tokens: int, *, strict: bool = False) -> int:
    """The route tokens a framed checkpoint of a ``span_tokens`` span (route-priced) may take
    when the route counts it: ``ROUTE_SHARE`` of it, rounded down, or for a span too small for
    that to hold ``MIN_CHECKPOINT_TOKENS``, that many but never more than half the span
    (``strict``: the share alone)."""
    small = 0 if strict else min(MIN_CHECKPOINT_TOKENS, span_tokens // 2)
    share = math.floor(span_tokens * ROUTE_SHARE)
    if share and 1 - share / span_tokens < 1 - ROUTE_SHARE:  # the gate's float comparison
        share -= 1
    return max(share, small)


def _fit_share(
    candidates: Sequence[_Candidate],
    share: int,
    allowed: float | None,
    fits: _Fits | None = None,
    lean: bool = False,
) -> str:
    """``_fit`` within ``share`` code units, refitted smaller while the framed checkpoint's
    ``estimated_tokens`` exceed ``allowed`` (None: the code units alone bound it); with the
    route's count (``fits``), the largest fit it counts within its allowance instead."""
    if fits is not None:
        return _fit_counted(candidates, share, fits, lean)
    text = _fit(candidates, share, lean)
    if allowed is None:
        return text
    floor = utf16_length(_render({}, lean))
    for _ in range(_REFITS):
        estimate = _framed_tokens(text)
        if estimate <= allowed or share <= floor:
            return text
        share = max(floor, int(share * allowed / estimate) - _UNITS_PER_TOKEN)
        text = _fit(candidates, share, lean)
    return text


def _fit_counted(
    candidates: Sequence[_Candidate], share: int, fits: _Fits, lean: bool = False
) -> str:
    """The fit of the most code units whose checkpoint the route counts within
    ``fits.allowed``, searched from ``share`` (the estimate's guess): the estimate errs high, so
    the route's count leaves room the estimate would waste (a checkpoint at 11% of its span where
    15% is allowed). Each try scales the code units by what the count says is left; the smallest
    fit (the eight sections, or none when ``lean``) stands when nothing fits."""
    floor = utf16_length(_render({}, lean))
    low, high = floor, fits.budget + 1  # the largest share known to fit, the least known not to
    best = ""
    share = max(floor, min(share, fits.budget))
    for _ in range(_COUNTED_TRIES):
        text = _fit(candidates, share, lean)
        counted = fits.count(text)
        if counted <= fits.allowed:
            if share > low or not best:
                low, best = share, text
        else:
            high = min(high, share)
        if high - low <= _COUNTED_PRECISION:
            break
        guess = int(share * fits.allowed / max(counted, 1))
        if lean:  # the frame is most of a lean checkpoint: scale what is left, not the whole
            guess = share + (fits.allowed - counted) * _UNITS_PER_TOKEN
        share = min(max(guess, low + 1), high - 1)
        if share <= low:  # pragma: no cover - the bracket closes before this
            break
    return best or _fit(candidates, floor, lean)


#: Fits tried against the route's count, and how close (code units) the search stops.
_COUNTED_TRIES = 6
_UNBOUNDED = 1 << 40  # code units: no bound but the span's share
_COUNTED_PRECISION = 16


# Roughly how a byte-pair tokenizer splits text before merging (a word with its leading space,
# up to three digits, a run of punctuation, a run of spaces): each piece is a token or more.
_PIECE_TOKENS = 1.15  # a long identifier or path segment is several tokens: err high
_PIECE = re.compile(r"[^\r\nA-Za-z\d]?[A-Za-z]+|\d{1,3}| ?[^\sA-Za-z\d]+[\r\n]*|\s*[\r\n]+|\s+")


def estimated_tokens(text: str) -> float:
    """Tokens a route tokenizer (o200k_base, cl100k_base) is likely to count for ``text``, erring
    high: the pieces a byte-pair tokenizer starts from or 4 ASCII characters a token, whichever
    is more, plus 2 tokens per non-ASCII character (rare scripts take several bytes a token)."""
    if text.isascii():
        return max(len(text) / _UNITS_PER_TOKEN, _PIECE_TOKENS * len(_PIECE.findall(text)))
    # Its ASCII characters, in order: ``errors="ignore"`` drops every other one, at C speed.
    ascii_text = text.encode("ascii", "ignore").decode("ascii")
    return estimated_tokens(ascii_text) + 2 * (len(text) - len(ascii_text))


# --- extraction ------------------------------------------------------------------------------


def _span(messages: Sequence[Message]) -> Sequence[Message]:
    """The messages to summarize: the system head and the pins stay outside every summary."""
    return messages[head_length(messages) :]


def _extract(messages: Sequence[Message], found: probes.SpanFacts, limits: _Limits) -> _Facts:
    """The span's facts: paths, commands and errors from ``found`` (``probes.span_facts``), the
    requests, prior checkpoints, tools and the state of the work from this walk."""
    facts = _Facts(commands=dict.fromkeys(found.commands), named_paths=dict.fromkeys(found.paths))
    for message in messages:
        if message.role == _ROLE.MESSAGE_ROLE_USER:
            _add_user(facts, message)
        elif message.role == _ROLE.MESSAGE_ROLE_ASSISTANT:
            _add_assistant(facts, message, limits)
        elif message.role == _ROLE.MESSAGE_ROLE_TOOL:
            _add_tool_result(facts, message)
        else:
            text = _text(message).strip()
            if text:
                facts.updates.append(text)
                facts.has_new = True
    facts.next_step = _next_step(messages)
    return facts


def _add_user(facts: _Facts, message: Message) -> None:
    text = _text(message)
    folded = _checkpoint_summary(text)
    if folded is not None:
        _merge_prior(facts.prior, _expand_files(_parse_sections(folded)))
        return
    facts.has_new = True
    if text.strip():
        # A repeated request is kept once, at its latest position.
        if text.strip() in facts.requests:
            facts.requests.remove(text.strip())
        facts.requests.append(text.strip())
    images = sum(1 for block in message.content if block.HasField("image"))
    if images:
        facts.requests.append(f"[{images} image(s) attached]")


def _add_assistant(facts: _Facts, message: Message, limits: _Limits) -> None:
    facts.has_new = True
    text = _text(message).strip()
    facts.progress = []
    if text:
        _add_unique(facts.progress, "Last assistant message: " + _clip(text, limits.item_units))
    for block in message.content:
        if block.HasField("tool_call"):
            call = block.tool_call
            facts.tools[call.name] = facts.tools.get(call.name, 0) + 1
            _add_unique(facts.progress, f"Last tool call: {call.name} {call.arguments_json}")


def _add_tool_result(facts: _Facts, message: Message) -> None:
    facts.has_new = True
    text = _text(message)
    for line in probes.error_lines(text, is_error=message.is_error, limit=_ERRORS_PER_RESULT):
        if states_error(line) or message.is_error:
            facts.stated_errors.pop(line, None)  # a repeated error moves to its latest place
            facts.stated_errors[line] = None
    name = message.name or message.tool_call_id or "tool"
    status = "failed" if message.is_error else "returned"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "(no text)")
    _add_unique(facts.progress, f"Last tool result: {name} {status}: {first}")


_STATES = re.compile(
    r"^[^\w]*(?:[A-Z]\s+)?(?:FAILED|FAIL|ERROR|npm ERR!)\b|:\d+(?::\d+)?:\s*error\b"
)


def states_error(line: str) -> bool:
    """Whether an error line states an error (``KeyError: 'x'``, ``error: ...``, ``FAILED
    tests/...``, ``a.c:3:5: error: ...``) rather than merely mention one (source code, logs)."""
    return probes.stated_error(line) is not None or _STATES.search(line) is not None


def _next_step(messages: Sequence[Message]) -> str:
    """What comes next, judged only from how the span ends (a request is not quoted again: the
    Goals section holds the latest one whole)."""
    if not messages:
        return ""
    last = messages[-1]
    if last.role == _ROLE.MESSAGE_ROLE_USER and _checkpoint_summary(_text(last)) is None:
        return f"Answer the latest user request (the last in {prompts.SUMMARY_SECTIONS[_GOALS]})"
    if last.role == _ROLE.MESSAGE_ROLE_TOOL:
        return f"Continue from the result of {last.name or 'the last tool call'}"
    return ""


def _checkpoint_summary(text: str) -> str | None:
    """The summary a framed checkpoint carries, or None when ``text`` is not one.

    Only the whole frame counts: a request that merely contains the tags, or a summary that
    quotes a closing tag, is never cut at an inner tag (that lost the rest of the summary).
    """
    text = without_recall_handles(text)
    for head in _CHECKPOINT_HEADS:  # today's preamble, or one an earlier version wrote
        framed = len(text) >= len(head) + len(_CHECKPOINT_TAIL)
        if framed and text.startswith(head) and text.endswith(_CHECKPOINT_TAIL):
            inner = text[len(head) : len(text) - len(_CHECKPOINT_TAIL)]
            return prompts.without_open_handles(inner)
    return None


def _text(message: Message) -> str:
    return "\n\n".join(block.text.text for block in message.content if block.HasField("text"))


def _fold(text: str) -> str:
    """``text`` as the gate compares it for an echo: whitespace collapsed, case folded."""
    return " ".join(text.split()).casefold()


def _add_unique(items: list[str], item: str) -> None:
    if item and item not in items:
        items.append(item)


# --- folding a prior checkpoint ------------------------------------------------------------


def _parse_sections(summary: str) -> dict[int, list[str]]:
    """Bullets of a summary by section index; unknown headings go to Essential Context.

    Reads what ``_render`` writes (continuation lines indented by two spaces) and, leniently,
    model-written summaries (``*`` bullets, plain lines).
    """
    sections: dict[int, list[str]] = {}
    current = _ESSENTIAL
    for line in summary.splitlines():
        bullets = sections.setdefault(current, [])
        if line.startswith("#"):
            current = _section_index(line.lstrip("#").strip())
        elif line.startswith(("- ", "* ")):
            bullets.append(line[2:])
        elif line.startswith((" ", "\t")) and bullets:
            bullets[-1] += "\n" + (line[2:] if line.startswith("  ") else line.lstrip())
        elif line.strip():
            bullets.append(line.strip())
    return {
        index: kept
        for index, items in sections.items()
        if (kept := [item for item in items if item.strip() != prompts.EMPTY_SECTION])
    }


def _expand_files(sections: dict[int, list[str]]) -> dict[int, list[str]]:
    """A prior summary's grouped "Files Touched" lines (``DIR/: a/b.py, c/d.py``) as one path
    each, so they group again with the span's own paths."""
    files = sections.get(_FILES)
    if files:
        sections[_FILES] = [path for line in files for path in _FileGroups.paths_of(line)]
    return sections


def _section_index(title: str) -> int:
    lowered = title.lower()
    for index, known in enumerate(prompts.SUMMARY_SECTIONS):
        if known.lower() == lowered:
            return index
    return _ESSENTIAL


def _merge_prior(prior: dict[int, list[str]], more: dict[int, list[str]]) -> None:
    for index, items in more.items():
        bucket = prior.setdefault(index, [])
        for item in items:
            _add_unique(bucket, item)


# --- selection within the budget -----------------------------------------------------------


class _Ranking:
    """Collects candidate bullets in first-seen order, each with its rank, once per section."""

    def __init__(self) -> None:
        self.candidates: list[_Candidate] = []
        self._seen: dict[tuple[int, str], int] = {}  # -> index in candidates

    def has(self, section: int, text: str) -> bool:
        """Whether ``text`` (as clipped) is a candidate of ``section`` already."""
        return (section, text) in self._seen

    def add(
        self,
        tier: int,
        section: int,
        items: Sequence[str],
        cap: int,
        *,
        newest_first: bool,
        promote: bool = False,
        after: int = 0,
    ) -> None:
        """Add ``items`` (clipped to ``cap``) at ``tier``; within a tier, older or newer first.

        An item already added keeps its place and rank, unless ``promote`` and ``tier`` ranks it
        higher: then it moves up to ``tier`` (its place in the section stays).
        """
        for position, item in enumerate(items):
            text = _clip(item, cap)
            recency = after + (len(items) - position if newest_first else position)
            index = self._seen.get((section, text))
            if index is not None:
                seen = self.candidates[index]
                if promote and (tier, recency) < seen.rank:
                    self.candidates[index] = _Candidate((tier, recency), section, seen.order, text)
                continue
            self._seen[(section, text)] = order = len(self.candidates)
            self.candidates.append(_Candidate((tier, recency), section, order, text))


def _candidates(facts: _Facts, limits: _Limits) -> _Ranking:
    """Every possible bullet, ranked: tier 0 (the first and the latest request) is kept first,
    then the gate's probes and the session's first request (tier 1, ``_promote_probes``), then
    every path, command and error line of this span and of the prior checkpoint, merged and most
    recent first (tier 2, ``_fact_pool``), then the state of the work, the next step and the
    other requests (tier 3: the retained messages right after the checkpoint show where the work
    stands), then tools and updates (tier 4)."""
    ranking = _Ranking()
    item, request = limits.item_units, limits.request_units
    progress = facts.progress if facts.has_new else facts.prior.get(_PROGRESS, [])
    state = progress[-limits.state_lines :]
    ranking.add(3, _PROGRESS, state, limits.state_units, newest_first=False)
    next_step = [facts.next_step] if facts.has_new else facts.prior.get(_NEXT, [])
    step_units = min(item, 2 * limits.state_units)
    ranking.add(3, _NEXT, [step for step in next_step if step][:1], step_units, newest_first=False)
    prior_goals = [g for g in facts.prior.get(_GOALS, []) if not _is_quoted(g, facts.requests)]
    ranking.add(0, _GOALS, prior_goals[:1], request, newest_first=False)  # the original request
    _rank_requests(ranking, facts.requests, request, first=not prior_goals)
    _fact_pool(ranking, facts, limits)
    ranking.add(3, _GOALS, prior_goals[1:], request, newest_first=True)
    ranking.add(3, _OUTSTANDING, facts.prior.get(_OUTSTANDING, []), request, newest_first=False)
    # Lines that merely mention an error (source code, logs) are no fact: only stated errors
    # (``states_error``) enter the summary, in the pool above. Paths seen only in tool output or
    # in a written file's content are bulk, not what the span acted on: a checkpoint that listed
    # them would hand them to the next fold as if they were facts, crowding out real ones.
    tools = [f"Tool {name} called {count}x" for name, count in facts.tools.items()]
    ranking.add(4, _TECH, tools, item, newest_first=False)
    updates = [f"Instruction update: {text}" for text in facts.updates]
    ranking.add(4, _ESSENTIAL, updates, request, newest_first=True)
    for section, items in sorted(facts.prior.items()):
        if section in (_TECH, _ESSENTIAL):
            # A prior span's tool counts are its own; this span counts its calls anew.
            rest = [i for i in items if _prior_command(i) is None
                    and not (facts.has_new and _TOOL_COUNT.match(i))]  # fmt: skip
            ranking.add(4, section, rest, max(item, request), newest_first=False)
    return ranking


def _fact_pool(ranking: _Ranking, facts: _Facts, limits: _Limits) -> None:
    """Tier 2: every path, command and stated error line of the span and of the prior
    checkpoint, each kind deduplicated and listed most recent first (the span's newest first,
    then the prior's, which lists its own newest first). Within the budget the span's facts and
    the prior's alternate (``_interleave``), and the kinds alternate too (the n-th of each
    ranks alike): a tight budget keeps the newest facts of every kind, and an older span's facts
    keep a share of the room instead of being summarized away by the newer ones."""
    named = [p for p in facts.named_paths if _FileGroups.is_file(p)]
    older = facts.prior.get(_FILES, [])
    if limits.older_identities:
        older = list(dict.fromkeys(map(_path_tail, older)))
    _interleave(ranking, _FILES, list(reversed(named)), older, limits.item_units)
    own: dict[str, str] = {}  # identity -> the command's newest form
    for command in reversed(list(facts.commands)):
        form = command_form(command, limits.command_units)
        if form:
            own.setdefault(command_identity(form), f"$ {form}")
    prior: dict[str, str] = {}
    for bullet in facts.prior.get(_TECH, []):
        stated = _prior_command(bullet)
        if stated and command_identity(stated) not in own:
            # An older span's command keeps what identifies it and a little of the rest (only
            # what identifies it when the older facts do not all fit).
            units = 0 if limits.older_identities else _PRIOR_COMMAND_UNITS
            form = command_form(stated, units) or stated
            prior.setdefault(command_identity(stated), f"$ {form}")
    _interleave(ranking, _TECH, list(own.values()), list(prior.values()), _WHOLE)
    errors = [e for e in reversed(list(facts.stated_errors)) if _identifies(e)]
    seen = {_error_identity(e) for e in errors}
    older = [e for e in facts.prior.get(_ERRORS, []) if _error_identity(e) not in seen]
    _interleave(ranking, _ERRORS, errors, older, limits.error_units, _prior_error_units)


def _interleave(
    ranking: _Ranking,
    section: int,
    own: Sequence[str],
    prior: Sequence[str],
    cap: int,
    prior_cap: Callable[[str], int] | None = None,
) -> None:
    """``own`` then ``prior`` into ``section`` at tier 2 (listed in that order), ranked
    alternately: the span's n-th and the prior's n-th come before either's n+1-th. ``prior`` is
    clipped to ``prior_cap(item)`` (default ``cap``): an older fact keeps what identifies it."""
    for position, item in enumerate(own):
        ranking.add(2, section, [item], cap, newest_first=False, after=2 * position)
    for position, item in enumerate(prior):
        kept = cap if prior_cap is None else min(cap, prior_cap(item))
        ranking.add(2, section, [item], kept, newest_first=False, after=2 * position + 1)


def _drops_older_facts(facts: _Facts, text: str) -> bool:
    """Whether ``text`` leaves out a path (by its last two segments) or a command (by its
    program and first argument) of the prior checkpoint."""
    shown = text.casefold()
    paths = (p for p in facts.prior.get(_FILES, []) if _FileGroups.is_path(p))
    if any(_FileGroups.tail(path) not in shown for path in paths):
        return True
    stated = (_prior_command(bullet) for bullet in facts.prior.get(_TECH, []))
    forms = (command_form(command) or command for command in stated if command is not None)
    return any(command_identity(form) not in shown for form in forms)


def _path_tail(bullet: str) -> str:
    """A prior checkpoint's path as its last two segments (a trailing slash kept); any other
    bullet as it is."""
    if not _FileGroups.is_path(bullet) or bullet.strip("/").count("/") < 2:
        return bullet
    tail = "/".join(bullet.rstrip("/").split("/")[-2:])
    return tail + "/" if bullet.endswith("/") else tail


def _error_identity(line: str) -> str:
    """What identifies an error line: its first ``ERROR_CHARS`` characters, whitespace
    collapsed, case-folded (a clip's ellipsis dropped)."""
    return " ".join(line.removesuffix(_ELLIPSIS).split()).casefold()[:ERROR_CHARS]


#: What an older span's fact keeps (code units): a command its program, first argument and a
#: little more; an error line its first ``ERROR_CHARS`` characters even when cut at a word.
_PRIOR_COMMAND_UNITS = 40
_PRIOR_ERROR_CHARS = ERROR_CHARS * 5 // 4


def _prior_error_units(line: str) -> int:
    """The code units an older error line keeps: its first ``_PRIOR_ERROR_CHARS`` characters
    (characters, not units: one outside the BMP takes two) and the ellipsis."""
    return utf16_length(line[:_PRIOR_ERROR_CHARS]) + len(_ELLIPSIS)


def _prior_command(bullet: str) -> str | None:
    """The command a prior checkpoint's bullet states (``$ cmd``, or ``Ran: cmd`` of older
    checkpoints), else None."""
    for mark in ("$ ", "Ran: "):
        if bullet.startswith(mark):
            return bullet[len(mark) :].strip()
    return None


_TOOL_COUNT = re.compile(r"^Tool \S+ called \d+x$")
_QUOTE_UNITS = 64  # a request quoted by its first words (the gate's probes need six)
_WHOLE = 1 << 20  # the cap of a bullet formed (and clipped) already
_SEGMENT = re.compile(r"&&|\|\||[;|\n]")
_SETUP = ("cd", "pushd", "popd", "set", "export", "source")


def command_form(command: str, max_units: int = 80) -> str:
    """A command as a checkpoint keeps it: its first segment that runs a program (``cd`` steps
    and the rest of a pipeline dropped), whitespace collapsed, its program and first argument
    whole and the rest clipped to ``max_units``."""
    for segment in _SEGMENT.split(command):
        words = segment.split()
        if words and words[0] not in _SETUP:
            head = " ".join(words[:2])
            rest = " ".join(words[2:])
            if not rest or utf16_length(head) + 1 + utf16_length(rest) <= max_units:
                return f"{head} {rest}".rstrip()
            room = max_units - utf16_length(head) - 1
            return f"{head} {_clip(rest, room)}" if room >= 8 else head
    return ""


def command_identity(form: str) -> str:
    """A command's program and first argument, case-folded: two spellings of one are one fact."""
    return " ".join(form.casefold().split()[:2])


def _promote_probes(
    ranking: _Ranking, span: probes.SpanFacts, limits: _Limits, tier: int = 1
) -> None:
    """The quality gate's probes (``probes.select_probes``) rank at ``tier`` (right after the
    current state, or before it), so a summary that has room for them keeps every fact the gate
    checks."""
    by_kind: dict[probes.ProbeKind, list[str]] = {kind: [] for kind in probes.ProbeKind}
    for probe in probes.select_probes(span):
        by_kind[probe.kind].append(probe.origin or probe.text)
    item, request = limits.item_units, limits.request_units
    kinds = probes.ProbeKind
    requests = by_kind[kinds.REQUEST]
    if tier < 0:  # quoted by their first words only: a run of REQUEST_WORDS of them keeps one
        ranking.add(tier, _GOALS, [_quote(r) for r in requests], _WHOLE, newest_first=False,
                    promote=True)  # fmt: skip
    else:
        # The first and the latest request are written whole already (tier 0); the others are
        # quoted by a run of words, which keeps them for the gate at a fraction of the room a
        # whole request takes from the facts.
        whole = [r for r in requests if ranking.has(_GOALS, _clip(r, request))]
        quoted = [_quote(r) for r in requests if r not in whole]
        ranking.add(tier, _GOALS, quoted, _WHOLE, newest_first=False, promote=True)
    ranking.add(tier, _FILES, by_kind[kinds.PATH], item, newest_first=False, promote=True)
    commands = [f"$ {command_form(c, limits.command_units)}" for c in by_kind[kinds.COMMAND]]
    ranking.add(tier, _TECH, commands, _WHOLE, newest_first=False, promote=True)
    errors = by_kind[kinds.ERROR]
    ranking.add(tier, _ERRORS, errors, limits.error_units, newest_first=False, promote=True)


def _quote(request: str) -> str:
    """The shortest run of ``REQUEST_WORDS`` consecutive words of ``request`` (as retention
    compares words), marked as a quote: the least a summary writes to keep the request."""
    words = probes.words(request)[: 64 * probes.REQUEST_WORDS]
    k = min(len(words), probes.REQUEST_WORDS)
    if len(words) <= k:
        return request
    runs = (words[i : i + k] for i in range(len(words) - k + 1))
    return f"… {' '.join(min(runs, key=lambda run: sum(map(len, run))))} …"


def _rank_requests(
    ranking: _Ranking, requests: Sequence[str], cap: int, *, first: bool = True
) -> None:
    """The latest request is tier 0, and the first one when ``first`` (no prior checkpoint holds
    the session's original request); the others are tier 3, newest first."""
    if not requests:
        return
    ranking.add(0 if first else 3, _GOALS, requests[:1], cap, newest_first=False)
    ranking.add(3, _GOALS, requests[1:-1], cap, newest_first=True)
    if len(requests) > 1:
        ranking.add(0, _GOALS, requests[-1:], cap, newest_first=False)


def _is_quoted(bullet: str, requests: Sequence[str]) -> bool:
    """Whether a prior checkpoint's request bullet quotes one of ``requests`` (clipped)."""
    head = bullet.removesuffix(_ELLIPSIS).rstrip()
    return any(request.startswith(head) or head.startswith(request) for request in requests)


def _fit(candidates: Sequence[_Candidate], budget: int, lean: bool = False) -> str:
    """Render the highest-ranked candidates that fit in ``budget`` (code units of estimated
    tokens, ``_units``); one that does not fit is clipped, or skipped for a later, smaller one."""
    chosen: dict[int, list[_Candidate]] = {}
    paths = [c.text for c in candidates if c.section == _FILES and _FileGroups.is_path(c.text)]
    files = _FileGroups(paths)
    taken: list[_Candidate] = []  # the paths, in the order the budget took them
    used = _units(_render({}, lean))
    for candidate in sorted(candidates, key=lambda c: (c.rank, c.order)):
        # Each bullet adds its line and a newline (an empty section is its heading alone); in a
        # lean summary the first bullet of a section also writes its heading.
        credit = -1
        if lean and candidate.section not in chosen:
            credit -= _units(f"## {prompts.SUMMARY_SECTIONS[candidate.section]}\n\n")
        room = budget - used + credit
        if candidate.section == _FILES and _FileGroups.is_path(candidate.text):
            cost = files.cost(candidate.text)
            if cost > room:
                continue
            files.add(candidate.text)
            taken.append(candidate)
            chosen.setdefault(_FILES, [])
            used += cost - credit
            continue
        fitted = candidate if _units(_bullet(candidate.text)) <= room else _shrunk(candidate, room)
        if fitted is None:
            continue
        chosen.setdefault(fitted.section, []).append(fitted)
        used += _units(_bullet(fitted.text)) - credit
    by_section = {
        index: [c.text for c in sorted(items, key=lambda c: c.order)]
        for index, items in chosen.items()
    }
    if _FILES in by_section:
        # Written in their section's order (most recent first), not in the order the budget
        # took them: a later fold reads the list back in this order.
        ordered = _FileGroups(paths)
        for candidate in sorted(taken, key=lambda c: c.order):
            ordered.add(candidate.text)
        by_section[_FILES] = [*ordered.lines(), *by_section[_FILES]]
    return _render(by_section, lean)


class _FileGroups:
    """The "Files Touched" paths, written one line per directory: ``DIR/: a/b.py, c/d.py``.

    Each path keeps its last two segments on the line (what identifies a file, and what the
    quality gate's path probes look for) and the rest is written once per line, so a session's
    long absolute paths cost a fraction of one bullet each. The full path is the line's prefix
    followed by the item.
    """

    _SEPARATOR = ", "
    MIN_PREFIX = 8  # a shorter directory is written out in each path

    def __init__(self, paths: Sequence[str]) -> None:
        """Group under the deepest directory most of ``paths`` share (a session's project root),
        else under each path's own directory."""
        self._groups: dict[str, list[str]] = {}
        self._tails: set[str] = set()  # the last two segments of every path added
        self._root = _common_root(paths)

    @staticmethod
    def is_path(text: str) -> bool:
        """Whether a Files bullet is a bare path (groupable) rather than prose."""
        return bool(text) and not any(c.isspace() for c in text) and "," not in text

    @staticmethod
    def is_file(path: str) -> bool:
        """Whether ``path`` names a file or a nested directory: an extension, or a slash inside."""
        name = path.rstrip("/").rpartition("/")[2]
        return "/" in path.strip("/") or "." in name[1:]

    @staticmethod
    def split(path: str) -> tuple[str, str]:
        """``(directory prefix, last two segments)`` of ``path``."""
        parts = path.rstrip("/").split("/")
        prefix = "/".join(parts[:-2]) + "/"
        if len(parts) <= 2 or len(prefix) < _FileGroups.MIN_PREFIX:  # nothing worth sharing
            return "", path
        return prefix, "/".join(parts[-2:]) + ("/" if path.endswith("/") else "")

    @classmethod
    def paths_of(cls, line: str) -> list[str]:
        """The paths a rendered line stands for (the line itself when it is not a group)."""
        prefix, colon, items = line.partition(": ")
        if colon and cls.is_path(prefix) and prefix.endswith("/"):
            return [prefix + item for item in items.split(cls._SEPARATOR) if item]
        if colon or "," not in line:
            return [line]
        return [item for item in line.split(cls._SEPARATOR) if item]

    def _key(self, path: str) -> tuple[str, str]:
        if self._root and path.startswith(self._root):
            rest = path[len(self._root) :]
            if rest.rstrip("/").count("/") >= 1:
                return self._root, rest
        return self.split(path)

    @staticmethod
    def tail(path: str) -> str:
        """What identifies a path: its last two segments, case-folded (two spellings of one
        file, absolute and relative, are listed once)."""
        return "/".join(path.casefold().rstrip("/").split("/")[-2:])

    def cost(self, path: str) -> int:
        """Code units adding ``path`` takes: an item on its line, or a new line (nothing for a
        path whose last two segments are listed already)."""
        if self.tail(path) in self._tails:
            return 0
        prefix, item = self._key(path)
        if prefix in self._groups:
            if item.rstrip("/") in (known.rstrip("/") for known in self._groups[prefix]):
                return 0
            return _units(self._SEPARATOR + item)
        head = f"{prefix}: " if prefix else ""
        return _units(_bullet(head + item)) + 1

    def add(self, path: str) -> None:
        """Add ``path`` to its directory's line (unless its last two segments are listed)."""
        if self.tail(path) in self._tails:
            return
        self._tails.add(self.tail(path))
        prefix, item = self._key(path)
        items = self._groups.setdefault(prefix, [])
        if item.rstrip("/") not in (known.rstrip("/") for known in items):
            items.append(item)

    def lines(self) -> list[str]:
        """One line per directory, in first-seen order."""
        return [
            (f"{prefix}: " if prefix else "") + self._SEPARATOR.join(items)
            for prefix, items in self._groups.items()
        ]


def _common_root(paths: Sequence[str]) -> str:
    """The directory (``/a/b/``), two levels deep or more, that the absolute ``paths`` take the
    fewest characters under when the ones below it (with two segments to spare) are written
    after it once and the others one line per directory; "" when none saves any."""
    absolute = list(dict.fromkeys(p for p in paths if p.startswith("/")))
    if len(absolute) < 2:
        return ""
    counts: dict[str, int] = {}
    for path in absolute:
        parts = path.rstrip("/").split("/")[1:-2]  # each path keeps two segments below it
        for depth in range(2, len(parts) + 1):
            root = "/" + "/".join(parts[:depth]) + "/"
            counts[root] = counts.get(root, 0) + 1
    shared = sorted((r for r, n in counts.items() if n >= 2), key=lambda r: -counts[r] * len(r))
    candidates = ["", *shared[:_ROOTS_TRIED]]
    return min(candidates, key=lambda root: (_grouped_length(absolute, root), -len(root)))


_ROOTS_TRIED = 12  # the directories that share the most characters


def _grouped_length(paths: Sequence[str], root: str) -> int:
    """The characters ``paths`` take written under ``root`` (those below it) and one line per
    directory (the others), as ``_FileGroups`` writes them."""
    prefixes: set[str] = set()
    total = len(root) + 4 if root else 0
    for path in paths:
        rest = path[len(root) :] if root and path.startswith(root) else ""
        if rest.rstrip("/").count("/") >= 1:
            total += len(rest) + 2
            continue
        prefix, item = _FileGroups.split(path)
        total += len(item) + 2
        if prefix not in prefixes:
            prefixes.add(prefix)
            total += len(prefix) + 4
    return total


def _shrunk(candidate: _Candidate, room: int) -> _Candidate | None:
    """The candidate clipped so its bullet line takes at most ``room`` units; None if too small."""
    # A bullet line adds "- " and two spaces of indentation per continuation line; lines are
    # what ``str.splitlines`` cuts (``\r``, ``\x1e``, ... too), as ``_bullet`` does.
    continuations = max(0, len(candidate.text.splitlines()) - 1)
    room_for_text = room - 2 - 2 * continuations
    # A fact clipped below what identifies it is no longer that fact: it is left for a later,
    # smaller one.
    least = max(24, _identity_units(candidate) + len(_ELLIPSIS))
    if room_for_text < least:
        return None
    text = _clip(candidate.text, room_for_text)
    for _ in range(_REFITS):  # text the estimate prices above its code units: clip it further
        cost = _units(_bullet(text))
        if cost <= room:
            return _Candidate(candidate.rank, candidate.section, candidate.order, text)
        room_for_text = room_for_text * room // cost - 1
        if room_for_text < least:
            return None
        text = _clip(candidate.text, room_for_text)
    return None


def _identity_units(candidate: _Candidate) -> int:
    """The code units a clip of ``candidate`` must keep for it to still identify its fact: a
    command's ``$ program argument``, an error line's first ``ERROR_CHARS`` characters (a word
    cut included, ``_at_word``), nothing for other bullets."""
    text = candidate.text
    if candidate.section == _TECH and text.startswith("$ "):
        return utf16_length(" ".join(text.split()[:3]))
    if candidate.section == _ERRORS:
        return utf16_length(text[:_PRIOR_ERROR_CHARS])
    return 0


def _identifies(error: str) -> bool:
    """Whether an error line's first ``ERROR_CHARS`` characters say something (two words or
    more): a bare ``ERROR:`` tells a later reader nothing."""
    return len(error[:ERROR_CHARS].split()) >= 2


def _render(sections: dict[int, list[str]], lean: bool = False) -> str:
    """The eight sections in order; an empty one is its heading alone (every token a "(none)"
    line took is one a fact cannot), or left out when ``lean`` (``_lean``)."""
    blocks = []
    for index, title in enumerate(prompts.SUMMARY_SECTIONS):
        bullets = sections.get(index, [])
        if bullets or not lean:
            blocks.append("\n".join([f"## {title}", *map(_bullet, bullets)]))
    return "\n\n".join(blocks)


def _bullet(text: str) -> str:
    """A bullet line; continuation lines are indented so the bullet stays one item."""
    return "- " + "\n  ".join(text.splitlines() or [""])


# --- text measurement ----------------------------------------------------------------------


def _units(text: str) -> int:
    """What ``text`` costs in the summary's budget: its ``estimated_tokens`` as code units (at
    least its code units), so a bullet the route would count high is fitted, or dropped, alone."""
    return math.ceil(estimated_tokens(text) * _UNITS_PER_TOKEN)


def _clip(text: str, max_units: int) -> str:
    """``text`` within ``max_units`` code units, cut at a word boundary with an ellipsis."""
    if utf16_length(text) <= max_units:
        return text
    room = max(0, max_units - len(_ELLIPSIS))
    if text.isascii():  # one code unit per character: cut directly
        return _at_word(text[:room], room)
    # The first ``room`` code units, as UTF-16 holds them; a surrogate pair they cut in half
    # (its high half last) leaves with its character.
    units = text.encode("utf-16-le")[: 2 * room]
    if len(units) >= 2 and 0xD8 <= units[-1] <= 0xDB:
        units = units[:-2]
    return _at_word(units.decode("utf-16-le"), room)


def _at_word(head: str, room: int) -> str:
    """``head`` cut back to its last space when that loses at most a fifth, plus the ellipsis."""
    space = head.rfind(" ")
    if space >= room * 4 // 5:
        head = head[:space]
    return head.rstrip() + _ELLIPSIS


_SKELETON_TOKENS = _framed_tokens(_render({}))
#: The least ``max_tokens`` that holds the eight empty sections (a smaller cap fails).
SKELETON_TOKENS = -(-utf16_length(_render({})) // _UNITS_PER_TOKEN)
#: What a checkpoint adds to its summary, in estimated tokens: the preamble, the tags, the recall
#: section, and a short "Open Handles" section.
CHECKPOINT_FRAME_TOKENS = math.ceil(_FRAME_UNITS / _UNITS_PER_TOKEN) + 16
