"""The summary quality gate: what a summary must be before it may replace history.

A summary that only has to be "non-empty and smaller than the span" can be a ten-token echo of
one message, or a paragraph that keeps none of the work. The gate runs before the commit,
deterministically and without a second model call, and reports every check a summary fails:

- ``SECTIONS``: the eight sections of the compaction instruction (``prompts.SUMMARY_SECTIONS``),
  each as a heading line, in order (``## Title``; ``#`` levels, numbering, bold and a trailing
  colon are tolerated);
- ``ECHO``: the summary is not a copy of one span message (after case and whitespace folding, it
  is not contained in one message's text: a repeated prior checkpoint is an echo too);
- ``REDUCTION``: the framed checkpoint is at least ``min_reduction_ratio`` smaller than the span
  (route prices); a checkpoint that is not smaller at all fails here too;
- ``PROBES``: at least ``min_probe_retention`` of the span's probes (``core.probes``: the user's
  requests, file paths, commands and error strings) are kept; the failure lists the missed ones.

The default retention threshold (``DEFAULT_MIN_PROBE_RETENTION``) comes from measurements on the
shared agent transcripts (README, "Summary quality gate"). Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from compactd.core import prompts
from compactd.core.probes import Probe, Retention, message_text, retention
from compactd.v1 import session_service_pb2

Message = session_service_pb2.Message

DEFAULT_MIN_REDUCTION_RATIO: Final = 0.1
DEFAULT_MIN_PROBE_RETENTION: Final = 0.5
_CLIP = 120  # characters of a missed probe in a failure detail


class GateCheck(enum.StrEnum):
    """One check of the gate."""

    SECTIONS = "SECTIONS"
    ECHO = "ECHO"
    REDUCTION = "REDUCTION"
    PROBES = "PROBES"


@dataclass(frozen=True, slots=True)
class GateSettings:
    """The gate's thresholds (policy keys ``minReductionRatio`` and ``minProbeRetention``)."""

    min_reduction_ratio: float = DEFAULT_MIN_REDUCTION_RATIO
    min_probe_retention: float = DEFAULT_MIN_PROBE_RETENTION
    #: Whether all eight sections must be there (``SECTIONS``): not for an extractive checkpoint
    #: cut to fit the window, which leaves out the headings it has no room for (no policy key).
    require_sections: bool = True


@dataclass(frozen=True, slots=True)
class GateFailure:
    """A check the summary failed, with what it found."""

    check: GateCheck
    detail: str
    missed: tuple[Probe, ...] = ()  # PROBES: the probes the summary does not hold


@dataclass(frozen=True, slots=True)
class Verdict:
    """The gate's findings on one summary.

    Attributes:
        failures: The failed checks, in check order; empty when the summary passed.
        retention: Which probes the summary kept.
        reduction: ``1 - checkpoint_tokens / span_tokens``.
        checkpoint_tokens: Route price of the framed checkpoint.
        span_tokens: Route price of the span.
    """

    failures: tuple[GateFailure, ...]
    retention: Retention
    reduction: float
    checkpoint_tokens: int
    span_tokens: int

    @property
    def smaller(self) -> bool:
        """Whether the framed checkpoint is smaller than the span at all."""
        return self.checkpoint_tokens < self.span_tokens

    @property
    def passed(self) -> bool:
        """Whether the summary may be committed."""
        return not self.failures

    def describe(self) -> str:
        """One line naming every failed check and what it found (empty when passed)."""
        return "; ".join(f"{failure.check}: {failure.detail}" for failure in self.failures)


@dataclass(frozen=True, slots=True)
class Findings:
    """What the checks that read the summary's text found (``examine``): everything the gate
    decides but the reduction, which needs the checkpoint's price."""

    sections: str | None  # ``section_problem``
    echo: int | None  # ``echoed_message``
    retention: Retention


def examine(
    summary: str,
    span: Sequence[Message],
    probes: Sequence[Probe],
    serialized: Sequence[bytes] | None = None,
    pinned: str = "",
) -> Findings:
    """The text checks of ``judge`` (sections, echo, probes), apart from pricing the checkpoint:
    a caller may price it meanwhile, off the event loop. ``serialized``: as ``echoed_message``
    takes it. ``pinned``: the text of the pins in force (``core.pins``); a probe it holds is kept
    whatever the summary says, since every request shows the pins (a summary is not asked to
    repeat them)."""
    kept_text = f"{summary}\n{pinned}" if pinned else summary
    return Findings(
        section_problem(summary),
        echoed_message(summary, span, serialized),
        retention(probes, kept_text),
    )


def judge(
    summary: str,
    span: Sequence[Message],
    probes: Sequence[Probe],
    *,
    checkpoint_tokens: int,
    span_tokens: int,
    settings: GateSettings,
    findings: Findings | None = None,
) -> Verdict:
    """Run every check on ``summary``.

    Args:
        summary: The raw summary text (before framing).
        span: The span's messages (without the system head).
        probes: The span's probes (``probes.select_probes``).
        checkpoint_tokens: Route price of the framed checkpoint.
        span_tokens: Route price of the span it would replace.
        settings: The thresholds.
        findings: ``examine(summary, span, probes)``, when the caller ran it already.
    """
    found = findings if findings is not None else examine(summary, span, probes)
    failures: list[GateFailure] = []
    if found.sections is not None and settings.require_sections:
        failures.append(GateFailure(GateCheck.SECTIONS, found.sections))
    if found.echo is not None:
        quoted = _clip(message_text(span[found.echo]))
        failures.append(
            GateFailure(GateCheck.ECHO, f"repeats span message {found.echo}: {quoted!r}")
        )
    reduction = 1 - checkpoint_tokens / span_tokens if span_tokens > 0 else 0.0
    if reduction < settings.min_reduction_ratio or checkpoint_tokens >= span_tokens:
        failures.append(
            GateFailure(
                GateCheck.REDUCTION,
                f"the checkpoint ({checkpoint_tokens} tokens framed) reduces the span "
                f"({span_tokens} tokens) by {_percent(reduction)}; at least "
                f"{_percent(settings.min_reduction_ratio)} is required",
            )
        )
    kept = found.retention
    if kept.ratio < settings.min_probe_retention:
        failures.append(
            GateFailure(
                GateCheck.PROBES,
                f"keeps {sum(kept.kept)} of {len(kept.probes)} probes ({_percent(kept.ratio)}); "
                f"at least {_percent(settings.min_probe_retention)} are required; missed: "
                + ", ".join(f"{p.kind} {_clip(p.text)!r}" for p in kept.missed),
                kept.missed,
            )
        )
    return Verdict(tuple(failures), kept, reduction, checkpoint_tokens, span_tokens)


_HEADING_MARKS = re.compile(r"^(?:#+\s*)?(?:\d+[.)]\s*)?")


def section_problem(summary: str) -> str | None:
    """What is wrong with the summary's sections, or None when all eight are there in order."""
    wanted = {title.casefold(): index for index, title in enumerate(prompts.SUMMARY_SECTIONS)}
    found: list[int] = []
    for line in summary.splitlines():
        index = wanted.get(_heading_title(line))
        if index is not None and index not in found:
            found.append(index)
    missing = [prompts.SUMMARY_SECTIONS[i] for i in range(len(wanted)) if i not in found]
    if missing:
        return f"missing section(s): {', '.join(missing)}"
    if found != sorted(found):
        return "sections out of order: " + ", ".join(prompts.SUMMARY_SECTIONS[i] for i in found)
    return None


def _heading_title(line: str) -> str:
    """A heading line's title, normalized (``## 3. **Files Touched:**`` -> ``files touched``)."""
    text = _HEADING_MARKS.sub("", line.strip()).strip()
    text = text.strip("*_").strip().rstrip(":").strip("*_").strip()
    return text.casefold()


def echoed_message(
    summary: str, span: Sequence[Message], serialized: Sequence[bytes] | None = None
) -> int | None:
    """The index of the span message ``summary`` merely repeats (is contained in), if any.

    ``serialized`` (one per span message) spares serializing the messages: each holds every
    text block of its message as UTF-8, verbatim, and is at least as long as its message's text
    as UTF-8. A message's serialized form is such bytes, and so is the event it projects from
    when the projection copied its blocks as they are (no offload).
    """
    needle = _fold(summary)
    if not needle:
        return None
    # Cheap necessary conditions first, so most messages are never read as text: folding never
    # lengthens a character more than threefold (casefold's longest expansion) and a message's
    # text is at most as long as its bytes; the needle's marks lie, as they are, in those bytes;
    # and its longest word, having no whitespace, lies inside one casefolded word of the text.
    if serialized is None:  # once per message (``ByteSize`` would serialize it again)
        serialized = [message.SerializeToString() for message in span]
    least = -(-len(needle) // _CASEFOLD_GROWTH)  # the fewest bytes whose text can fold to it
    sized = [index for index, data in enumerate(serialized) if len(data) >= least]
    if not sized:
        return None
    marks = needle_marks(needle)
    word = max(needle.split(" "), key=len)
    for index in sized:
        if marks and not _holds_marks(serialized[index], marks):
            continue
        message = span[index]
        text = message_text(message)
        growth = 1 if text.isascii() else _CASEFOLD_GROWTH
        if len(needle) > growth * len(text) or not folded_holds(text, word):
            continue
        if needle in _fold(text):
            return index
    return None


#: The characters no other character casefolds into (and that casefold to themselves): the
#: ASCII digits, punctuation and symbols (``tests/core/test_gate.py`` proves it).
MARK_CHARACTERS = "".join(chr(code) for code in range(0x21, 0x7F) if not chr(code).isalpha())
_MARK_LENGTH = 4  # shorter runs (``://``, a fence) are in too many messages to tell any apart
_MARKS = 3
_MARK = re.compile(f"[{re.escape(MARK_CHARACTERS)}]{{{_MARK_LENGTH},}}")


def needle_marks(needle: str) -> tuple[bytes, ...]:
    """The longest runs (up to three, four characters or more) of ``MARK_CHARACTERS`` in a
    folded needle, as UTF-8.

    Such a run has no whitespace and each of its characters casefolds from itself alone, so a
    text whose fold holds the needle holds the run as it is, inside one text block: its bytes
    are in the message's serialized bytes, which a search reads without decoding the text.
    """
    runs = sorted(set(_MARK.findall(needle)), key=len, reverse=True)
    return tuple(run.encode() for run in runs[:_MARKS])


def _holds_marks(serialized: bytes, marks: Sequence[bytes]) -> bool:
    return all(mark in serialized for mark in marks)


_CASEFOLD_GROWTH = 3
#: The non-ASCII characters whose casefold holds an ASCII character (``ß`` -> ``ss``, the
#: Kelvin sign -> ``k``, ligatures); ``tests/core/test_gate.py`` proves the list complete.
FOLDS_TO_ASCII = (  # sharp s, dotted I, long s, ŉ ǰ ẖ ẗ ẘ ẙ ẚ ẞ, Kelvin, ﬀ ﬁ ﬂ ﬃ ﬄ ﬅ ﬆ
    "\u00df\u0130\u0149\u017f\u01f0\u1e96\u1e97\u1e98\u1e99\u1e9a\u1e9e\u212a\ufb00\ufb01\ufb02\ufb03\ufb04\ufb05\ufb06"
)


def folded_holds(text: str, word: str) -> bool:
    """``word in text.casefold()``, for a casefolded ``word``, without casefolding the text
    when an ASCII word cannot need it.

    Casefolding ASCII is lowering it. In a text with none of ``FOLDS_TO_ASCII``, every ASCII
    character of the casefolded text is one of the text's own, lowered, and every other one is
    not ASCII: an ASCII word occurs in it exactly where it occurs, ASCII-lowered, in the text's
    UTF-8 bytes (whose non-ASCII characters are bytes no ASCII word holds). Encoding and
    lowering bytes costs a fraction of casefolding a non-ASCII string.
    """
    if text.isascii():
        return word in text.lower()
    if word.isascii() and not any(char in text for char in FOLDS_TO_ASCII):
        return word.encode() in text.encode().lower()
    return word in text.casefold()


def minimum_useful_span(skeleton_tokens: int, min_reduction_ratio: float | None) -> int:
    """The smallest span (tokens) a checkpoint could relieve.

    A checkpoint holds at least the framing and the eight empty sections (``skeleton_tokens``,
    priced on the route); with the gate on it must also reduce the span by
    ``min_reduction_ratio``. ``None`` means the gate is off: the span must only be larger.
    """
    if min_reduction_ratio is None:
        return skeleton_tokens + 1
    return max(skeleton_tokens + 1, math.ceil(skeleton_tokens / (1 - min_reduction_ratio)))


def _fold(text: str) -> str:
    return " ".join(text.split()).casefold()


def _clip(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _CLIP else flat[: _CLIP - 1] + "…"


def _percent(ratio: float) -> str:
    return f"{ratio * 100:.0f}%"
