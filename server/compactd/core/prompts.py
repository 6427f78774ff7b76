"""The texts compactd adds to model requests when it compacts a conversation.

Two texts reach a model: the *checkpoint* (the preamble plus the summary framed in
``<compacted-summary>`` tags) replaces the shadowed span in the conversation, and the *compaction
instruction* is the final user message of the private summary request. Both are constants (or pure
functions of their inputs) so the same inputs always produce the same request bytes, which keeps
provider prefix caches warm.

The instruction asks for eight sections, in order; ``SUMMARY_SECTIONS`` names them so the
deterministic extractive summarizer writes the same structure a model is asked for.
"""

from __future__ import annotations

from compactd.core.handles import OpenHandles
from compactd.core.pins import PINS_OPEN_TAG

SUMMARY_OPEN_TAG = "<compacted-summary>"
SUMMARY_CLOSE_TAG = "</compacted-summary>"

#: The eight section titles of a summary, in the order the instruction requires.
SUMMARY_SECTIONS: tuple[str, ...] = (
    "Goals and Requests",
    "Technical Context",
    "Files Touched",
    "Errors and Resolutions",
    "Outstanding Work",
    "Work in Progress",
    "Immediate Next Step",
    "Essential Context",
)

#: What an empty section holds, so no section is ever dropped.
EMPTY_SECTION = "(none)"

#: Short, as it opens every checkpoint: on a small window each token it takes is one a fact
#: carried forward cannot.
CHECKPOINT_PREAMBLE = (
    "Automatic summary of an earlier part of this conversation, condensed to free context space. "
    "Treat it as settled background, do not comment on it, and continue from the messages after it."
)
#: The preambles earlier versions opened checkpoints with: a log holding one still folds it as a
#: checkpoint.
EARLIER_PREAMBLES = (
    "The block below was written automatically to stand in for an older part of this "
    "conversation, which was condensed to make room in the context window. Rely on it as settled "
    "background rather than repeating it, do not comment on it, and carry on with the task from "
    "the messages that come after it.",
)
PREAMBLES = (CHECKPOINT_PREAMBLE, *EARLIER_PREAMBLES)

_SECTION_GUIDANCE: tuple[str, ...] = (
    "what the user asked for, first and as it changed; quote their words when the wording matters",
    "languages, libraries, tools, patterns and conventions the work relies on",
    "each exact path with why it matters and what changed, with short snippets when needed",
    "each error as it appeared, and how it was resolved (or that it is still open), plus any "
    "related user feedback",
    "work the user asked for that is not finished yet",
    "exactly what was being done when this checkpoint was taken",
    f'the one action that should come next, in line with the latest request, or "{EMPTY_SECTION}"',
    "decisions and why they were made, constraints, user preferences, open questions and any "
    "data needed to continue",
)

_RULES = (
    "Keep exact file paths, commands, error messages, identifiers, numbers, function signatures "
    "and code fragments character for character.",
    "Record the user's feedback and explicit instructions faithfully, corrections above all.",
    "Write in concise, technical English.",
    "Do not mention this request, summarizing, or that anything was condensed.",
    "Reply with the checkpoint text only: call no tools and take no other action.",
    f"A {SUMMARY_OPEN_TAG} block earlier in the conversation is an older checkpoint. Do not "
    "copy it as it stands: keep what is still true, drop what is outdated, and merge it with the "
    "newer messages into one checkpoint with the same sections.",
    f"The runtime keeps the {PINS_OPEN_TAG} block (pinned task state) and appends an "
    '"Open Handles" section itself: write neither.',
)


def frame_checkpoint(summary: str, handles: str = "") -> str:
    """The checkpoint text that replaces a shadowed span.

    Args:
        summary: The raw summary returned by a summarizer (stored as is on
            ``compaction/summary``).
        handles: The checkpoint's open handles (``open_handles_section``), written by compactd
            after the summary; ``""`` when none is open.

    Returns:
        ``CHECKPOINT_PREAMBLE``, a blank line, then ``summary`` (and, after a blank line, the
        handles) inside ``<compacted-summary>`` tags, each tag on its own line.
    """
    body = f"{summary}\n\n{handles}" if handles else summary
    return f"{CHECKPOINT_PREAMBLE}\n\n{SUMMARY_OPEN_TAG}\n{body}\n{SUMMARY_CLOSE_TAG}"


#: The heading of the checkpoint's open-handles section (after the eight summary sections).
OPEN_HANDLES_TITLE = "Open Handles"
_OPEN_HANDLES_HEADING = f"## {OPEN_HANDLES_TITLE}\n"


def open_handles_section(handles: OpenHandles) -> str:
    """The checkpoint's "Open Handles" section: one bullet per open sub-agent (child id, the
    call that spawned it, its task), per tool call of the span still without a result, and one
    naming the pinned keys; ``""`` when nothing is open. A pure function of ``handles``."""
    if not handles:
        return ""
    lines = []
    for child, start in handles.subagents:
        spawned = f" (spawned by tool call `{start.tool_call_id}`)" if start.tool_call_id else ""
        task = f": {start.task}" if start.task else ""
        lines.append(f"- sub-agent `{child}` still running{spawned}{task}")
    for call_id, name in handles.calls:
        lines.append(f"- tool call `{call_id}` (`{name}`) has no result yet")
    if handles.pins:
        keys = ", ".join(f"`{key}`" for key in handles.pins)
        lines.append(f"- pinned state in force, kept word for word: {keys}")
    return _OPEN_HANDLES_HEADING + "\n".join(lines)


def without_open_handles(summary: str) -> str:
    """A checkpoint's summary without the open-handles section compactd appended (a prior
    checkpoint's handles are not facts to fold again: the next checkpoint lists its own)."""
    at = summary.rfind("\n\n" + _OPEN_HANDLES_HEADING)
    return summary if at < 0 else summary[:at]


def summary_skeleton() -> str:
    """The smallest summary the instruction allows: every section holding ``EMPTY_SECTION``."""
    return "\n\n".join(f"## {title}\n- {EMPTY_SECTION}" for title in SUMMARY_SECTIONS)


def compaction_instruction(focus: str | None = None) -> str:
    """The final user message of a summary request.

    Args:
        focus: Optional text from an on-demand ``/compact`` naming what the summary should
            emphasise; blank text counts as none.

    Returns:
        The instruction; with a focus, the focus is appended as a last paragraph.
    """
    text = _base_instruction()
    if focus is not None and focus.strip():
        text += (
            "\n\nGive particular attention to the following, as the user asked:\n" + focus.strip()
        )
    return text


def _base_instruction() -> str:
    sections = "\n\n".join(
        f"## {title}\n- [{guidance}]"
        for title, guidance in zip(SUMMARY_SECTIONS, _SECTION_GUIDANCE, strict=True)
    )
    rules = "\n".join(f"- {rule}" for rule in _RULES)
    return (
        "Stop working on the task for a moment. Your job now is to write a checkpoint of the "
        "conversation above, so that another model can pick the work up from it with nothing "
        "essential missing.\n\n"
        "Use exactly the Markdown layout below: all eight sections, in this order, each as a "
        f'list of short bullet points rather than paragraphs. Put "{EMPTY_SECTION}" under a '
        "section that has nothing to record; never leave a section out.\n\n"
        f"{sections}\n\n"
        f"Rules:\n{rules}"
    )
