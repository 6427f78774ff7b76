"""What ``compactd replay`` shows: a progress bar, a terminal table and one HTML report.

The HTML report is one self-contained file (inline CSS and SVG, no script, nothing fetched): a
summary table of every replayed conversation, then per conversation a chart of the envelope per
step (measured before ``PrepareStep`` and as sent) against the trigger and the window, with a
marker at each prune and each compaction, and one row per bracket: step, span (surface positions
and seqs), shadowed count, envelope tokens before and after, the span's and the checkpoint's
tokens, the summary's size, the duration and the outcome.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from typing import TextIO

from compactd.replay import CompactionRecord, SessionReplay, StepRecord, compaction_waits

# ---- the progress bar (stderr) ---------------------------------------------------------------


class ProgressBar:
    """A one-line progress bar over the transcripts' steps, redrawn in place on a terminal.

    Off a terminal it writes one line per conversation instead, so logs stay readable.
    """

    def __init__(self, stream: TextIO, total_steps: int, conversations: int) -> None:
        self._stream = stream
        self._total = max(1, total_steps)
        self._conversations = conversations
        self._done = 0
        self._compactions = 0
        self._current = -1
        self._tty = stream.isatty()

    def step(self, conversation: int, record: StepRecord) -> None:
        """Count one step of conversation number ``conversation`` (0-based)."""
        self._done += 1
        self._compactions += record.compactions
        if conversation != self._current:
            self._current = conversation
            if not self._tty:
                self._stream.write(f"conversation {conversation + 1}/{self._conversations}\n")
        if self._tty:
            self._draw(record)

    def _draw(self, record: StepRecord) -> None:
        width = 30
        filled = min(width, self._done * width // self._total)
        bar = "#" * filled + "." * (width - filled)
        self._stream.write(
            f"\r[{bar}] {self._done}/{self._total} steps  conversation "
            f"{self._current + 1}/{self._conversations}  {record.sent_tokens:>7,} tokens  "
            f"{self._compactions} compactions "
        )
        self._stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()


# ---- the terminal table ----------------------------------------------------------------------

COLUMNS = (
    "conversation",
    "msgs",
    "steps",
    "peak",
    "sent",
    "prunes",
    "compactions",
    "shadowed",
    "ckpt/span",
    "final",
)


def checkpoint_share(compactions: Sequence[CompactionRecord]) -> float | None:
    """Checkpoint tokens over span tokens of the committed brackets (None without any)."""
    committed = [c for c in compactions if c.committed and c.span_tokens]
    if not committed:
        return None
    return sum(c.checkpoint_tokens for c in committed) / sum(c.span_tokens for c in committed)


def rows(replays: Sequence[SessionReplay], width: int = 28) -> list[tuple[str, ...]]:
    """One row per conversation and a total row, as the table prints them."""
    table = [_row(_short(r.source, width), [r]) for r in replays]
    if len(replays) > 1:
        table.append(_row("total", replays))
    return table


def _row(label: str, replays: Sequence[SessionReplay]) -> tuple[str, ...]:
    compactions = [c for r in replays for c in r.compactions]
    committed = [c for c in compactions if c.committed]
    failed = len(compactions) - len(committed)
    share = checkpoint_share(compactions)
    return (
        label,
        f"{sum(r.messages for r in replays):,}",
        f"{sum(len(r.steps) for r in replays):,}",
        f"{max((r.peak_tokens for r in replays), default=0):,}",
        f"{sum(r.tokens_sent for r in replays):,}",
        f"{sum(len(r.prunes) for r in replays):,}",
        f"{len(committed)}" + (f" (+{failed} failed)" if failed else ""),
        f"{sum(c.shadowed for c in committed):,}",
        "-" if share is None else f"{share:.1%}",
        f"{sum(r.final_tokens for r in replays):,}",
    )


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def table(replays: Sequence[SessionReplay]) -> str:
    """The terminal table: first column left-aligned, the figures right-aligned."""
    return _aligned((*COLUMNS, ""), [(*row, "") for row in rows(replays)])


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def wait_line(replays: Sequence[SessionReplay]) -> str:
    """The agent-visible wait compaction added (``replay.compaction_waits``), over every step
    that compacted: p50, p95 and the total."""
    waits = [w for r in replays for w in compaction_waits(r)]
    if not waits:
        return "agent-visible wait added by compaction: no step compacted"
    p50, p95 = percentile(waits, 0.5), percentile(waits, 0.95)
    return (
        f"agent-visible wait added by compaction over {counted(len(waits), 'step')} that "
        f"compacted: p50 {p50 * 1000:,.0f} ms, p95 {p95 * 1000:,.0f} ms, "
        f"total {sum(waits):,.1f} s"
    )


BRACKET_COLUMNS = ("#", "step", "seqs", "shadowed", "before", "after", "span", "ckpt", "chars",
                   "ms", "outcome")  # fmt: skip


def bracket_table(replays: Sequence[SessionReplay]) -> str:
    """Every bracket of every conversation, one row each (``#`` is conversation.bracket)."""
    body = [
        (
            f"{number}.{index}",
            str(c.step),
            f"{c.start_seq}-{c.end_seq}",
            str(c.shadowed),
            f"{c.tokens_before:,}",
            f"{c.tokens_after:,}",
            f"{c.span_tokens:,}",
            f"{c.checkpoint_tokens:,}",
            f"{c.summary_chars:,}",
            f"{c.seconds * 1000:,.0f}",
            _outcome(c),
        )
        for number, result in enumerate(replays, 1)
        for index, c in enumerate(result.compactions, 1)
    ]
    if not body:
        return "no compaction brackets"
    return _aligned(BRACKET_COLUMNS, body)


def _outcome(record: CompactionRecord) -> str:
    """A bracket's outcome, marked when its summary was prepared ahead of the trigger."""
    return f"{record.outcome} (ahead)" if record.prepared_ahead else record.outcome


def _aligned(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell: the first and last left-aligned, figures right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *body, strict=True)]
    lines = []
    for cells in (header, *body):
        padded = [
            cell.ljust(w) if i in (0, len(cells) - 1) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


# ---- the HTML report -------------------------------------------------------------------------

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:2em;word-break:break-all}
table{border-collapse:collapse;margin:.5em 0}th,td{padding:2px 8px;border-bottom:1px solid #ddd}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f4f4f4}
.legend span{margin-right:1.5em}.swatch{display:inline-block;width:14px;height:3px;
vertical-align:middle;margin-right:4px}.muted{color:#777}svg{background:#fcfcfc}
"""
_COLORS = {
    "before": "#9aa5b1",
    "sent": "#1f6feb",
    "trigger": "#e08a00",
    "window": "#cf222e",
    "compaction": "#8250df",
    "prune": "#1a7f37",
}


def render_html(replays: Sequence[SessionReplay], *, title: str, settings: str) -> str:
    """The self-contained HTML report of ``replays``; ``settings`` describes the run."""
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><p class=muted>{html.escape(settings)}</p>",
        _summary_table(replays),
    ]
    for number, result in enumerate(replays, 1):
        parts.append(_session(number, result))
    parts.append("</body></html>")
    return "\n".join(parts)


def _summary_table(replays: Sequence[SessionReplay]) -> str:
    header = "".join(
        f"<th{'' if i == 0 else ' class=n'}>{html.escape(c)}</th>" for i, c in enumerate(COLUMNS)
    )
    body = []
    for index, row in enumerate(rows(replays, width=60)):
        anchor = index < len(replays)
        cells = [
            f"<td><a href='#s{index + 1}'>{html.escape(row[0])}</a></td>"
            if anchor
            else f"<td><b>{html.escape(row[0])}</b></td>",
            *(f"<td class=n>{html.escape(cell)}</td>" for cell in row[1:]),
        ]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{header}</tr>{''.join(body)}</table>"


def counted(number: int, noun: str) -> str:
    """``1 prune``, ``2 prunes``: ``number`` and ``noun``, plural but for one."""
    return f"{number:,} {noun}" if number == 1 else f"{number:,} {noun}s"


def _session(number: int, result: SessionReplay) -> str:
    committed = len(result.committed)
    facts = (
        f"session <code>{html.escape(result.session_id)}</code>: "
        f"{counted(result.messages, 'message')}, {counted(len(result.steps), 'step')}, "
        f"{counted(result.events, 'event')} in the log, {counted(len(result.prunes), 'prune')}, "
        f"{counted(committed, 'compaction')}; {result.tokens_sent:,} input tokens sent; "
        f"{result.seconds:.1f} s"
    )
    return (
        f"<h2 id=s{number}>{number}. {html.escape(result.source)}</h2><p>{facts}</p>"
        + chart(result)
        + _compaction_table(result.compactions)
    )


def chart(result: SessionReplay, width: int = 1000, height: int = 280) -> str:
    """An inline SVG: envelope tokens per step (before and sent) against trigger and window,
    with prune (green ticks) and compaction (purple lines) markers."""
    steps = result.steps
    if not steps:
        return "<p class='muted'>no model steps</p>"
    left, right, top, bottom = 64, 12, 12, 28
    plot_w, plot_h = width - left - right, height - top - bottom
    ceiling = max(max(s.window, s.before_tokens, s.trigger_tokens) for s in steps) * 1.05 or 1.0
    span = max(1, len(steps) - 1)

    def x(index: int) -> float:
        return left + plot_w * (index - 1) / span

    def y(tokens: float) -> float:
        return top + plot_h * (1 - tokens / ceiling)

    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img'>"
    ]
    out += _axes(left, top, plot_w, plot_h, ceiling, len(steps), y)
    for key, attr in (("window", "window"), ("trigger", "trigger_tokens")):
        points = " ".join(f"{x(s.index):.1f},{y(getattr(s, attr)):.1f}" for s in steps)
        dash = " stroke-dasharray='6 4'" if key == "trigger" else ""
        out.append(
            f"<polyline fill='none' stroke='{_COLORS[key]}' stroke-width='1.5'{dash} "
            f"points='{points}'><title>{key}</title></polyline>"
        )
    for step in steps:
        if step.compactions:
            out.append(
                f"<line x1='{x(step.index):.1f}' x2='{x(step.index):.1f}' y1='{top}' "
                f"y2='{top + plot_h}' stroke='{_COLORS['compaction']}' stroke-width='1' "
                f"opacity='.6'><title>step {step.index}: {step.compactions} compaction(s), "
                f"{step.before_tokens:,} to {step.sent_tokens:,} tokens</title></line>"
            )
        if step.pruned:
            out.append(
                f"<path d='M{x(step.index) - 5:.1f},{top + plot_h + 10} l5,-9 l5,9 z' "
                f"fill='{_COLORS['prune']}'><title>step {step.index}: {step.pruned} "
                f"tool result(s) pruned</title></path>"
            )
    for key, attr in (("before", "before_tokens"), ("sent", "sent_tokens")):
        points = " ".join(f"{x(s.index):.1f},{y(getattr(s, attr)):.1f}" for s in steps)
        out.append(
            f"<polyline fill='none' stroke='{_COLORS[key]}' stroke-width='2' points='{points}'/>"
        )
    for step in steps:
        out.append(
            f"<circle cx='{x(step.index):.1f}' cy='{y(step.sent_tokens):.1f}' r='2.5' "
            f"fill='{_COLORS['sent']}'><title>step {step.index} (turn {step.turn}): "
            f"{step.sent_tokens:,} tokens sent</title></circle>"
        )
    out.append("</svg>")
    return "".join(out) + _legend()


def _axes(
    left: int,
    top: int,
    plot_w: int,
    plot_h: int,
    ceiling: float,
    count: int,
    y: Callable[[float], float],
) -> list[str]:
    out = [
        f"<rect x='{left}' y='{top}' width='{plot_w}' height='{plot_h}' fill='none' stroke='#ccc'/>"
    ]
    for tokens in _ticks(ceiling):
        level = y(tokens)
        out.append(
            f"<line x1='{left}' x2='{left + plot_w}' y1='{level:.1f}' y2='{level:.1f}' "
            "stroke='#eee'/>"
            f"<text x='{left - 6}' y='{level + 4:.1f}' font-size='11' text-anchor='end'>"
            f"{tokens:,.0f}</text>"
        )
    out.append(
        f"<text x='{left}' y='{top + plot_h + 24}' font-size='11'>step 1</text>"
        f"<text x='{left + plot_w}' y='{top + plot_h + 24}' font-size='11' "
        f"text-anchor='end'>step {count}</text>"
    )
    return out


def _ticks(ceiling: float) -> list[int]:
    """Round token levels from 0 up to ``ceiling``, four or five steps (1, 2, 2.5 or 5 x 10^k)."""
    raw = max(1.0, ceiling / 5)
    magnitude = 10 ** (len(str(int(raw))) - 1)
    step = next(s for m in (1, 2, 2.5, 5, 10) if (s := max(1, int(m * magnitude))) >= raw)
    return list(range(0, int(ceiling) + 1, step))


def _legend() -> str:
    items = (
        ("before", "envelope before PrepareStep"),
        ("sent", "envelope sent"),
        ("trigger", "trigger"),
        ("window", "window"),
        ("compaction", "compaction"),
        ("prune", "prune"),
    )
    spans = "".join(
        f"<span><i class=swatch style='background:{_COLORS[k]}'></i>{label}</span>"
        for k, label in items
    )
    return f"<div class=legend>{spans}</div>"


_BRACKET_COLUMNS = (
    "#",
    "step",
    "trigger",
    "span (positions)",
    "span (seqs)",
    "shadowed",
    "tokens before",
    "tokens after",
    "span tokens",
    "checkpoint tokens",
    "summary chars",
    "summarizer",
    "duration",
    "outcome",
)


def _compaction_table(compactions: Sequence[CompactionRecord]) -> str:
    if not compactions:
        return "<p class=muted>no compaction brackets</p>"
    header = "".join(f"<th>{html.escape(c)}</th>" for c in _BRACKET_COLUMNS)
    body = []
    for number, c in enumerate(compactions, 1):
        cells = (
            str(number),
            str(c.step),
            c.trigger,
            f"{c.start_position}-{c.end_position}",
            f"{c.start_seq}-{c.end_seq}",
            str(c.shadowed),
            f"{c.tokens_before:,}",
            f"{c.tokens_after:,}",
            f"{c.span_tokens:,}",
            f"{c.checkpoint_tokens:,}",
            f"{c.summary_chars:,}",
            c.summarizer,
            f"{c.seconds * 1000:,.0f} ms",
            _outcome(c),
        )
        body.append(
            "<tr>" + "".join(f"<td class=n>{html.escape(cell)}</td>" for cell in cells) + "</tr>"
        )
    return f"<table><tr>{header}</tr>{''.join(body)}</table>"
