"""Pinned state: what a runtime pins (``state/pin``) and how a request shows it.

A ``state/pin`` is log-only. The pins in force (the latest pin of each key, cleared keys left
out) are rendered, in key order, into one system-role message that every rebuilt request holds
right after the system head (``SessionFold.messages``). No surface node holds them, so no
compaction or prune can select them; the meter prices their message like a node, in every
route's tokenizer. The rendering is a pure function of the pins in force: the same pins always
give the same bytes, whatever compactions happened in between.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

from compactd.v1 import events_pb2, session_service_pb2

PINS_OPEN_TAG: Final = "<pinned-state>"
PINS_CLOSE_TAG: Final = "</pinned-state>"
PINS_PREAMBLE: Final = (
    "The runtime pinned the entries below for this task. They stay in force, word for word, "
    "for the whole session and are never condensed; each [key] holds its latest value."
)
MAX_KEY_LENGTH: Final = 64
_KEY: Final = re.compile(r"[A-Za-z0-9._:/-]{1,64}")
_SYSTEM: Final = session_service_pb2.MESSAGE_ROLE_SYSTEM


def pin_violations(pin: events_pb2.StatePin) -> list[tuple[str, str]]:
    """The shape violations of a ``state/pin`` body, as (field, description) pairs."""
    found: list[tuple[str, str]] = []
    if not _KEY.fullmatch(pin.key):
        found.append(("key", f"1-{MAX_KEY_LENGTH} characters of [A-Za-z0-9._:/-]"))
    if pin.clear and pin.text:
        found.append(("text", "a clearing pin carries no text"))
    elif not pin.clear and not pin.text.strip():
        found.append(("text", "required (set clear to remove a key)"))
    return found


def render_pins(pins: Mapping[str, str]) -> str:
    """The text of the pinned-state message for ``pins`` (key -> text), keys in order; ``""``
    when no pin is in force."""
    if not pins:
        return ""
    entries = "\n\n".join(f"[{key}]\n{pins[key]}" for key in sorted(pins))
    return f"{PINS_OPEN_TAG}\n{PINS_PREAMBLE}\n\n{entries}\n{PINS_CLOSE_TAG}"


def pins_message(pins: Mapping[str, str]) -> session_service_pb2.Message | None:
    """The request message that renders ``pins``; None when no pin is in force."""
    text = render_pins(pins)
    if not text:
        return None
    message = session_service_pb2.Message(
        role=session_service_pb2.MESSAGE_ROLE_SYSTEM, pinned_state=True
    )
    message.content.add().text.text = text
    return message


def pin_list(pins: Mapping[str, str]) -> list[events_pb2.StatePin]:
    """The pins in force as ``StatePin``s, in key order."""
    return [events_pb2.StatePin(key=key, text=pins[key]) for key in sorted(pins)]


def with_pins(
    messages: list[session_service_pb2.Message],
    pinned: session_service_pb2.Message | None,
    *,
    head: bool,
) -> list[session_service_pb2.Message]:
    """``messages`` (a request's, derived from the surface) with ``pinned`` placed right after
    the system head: second when ``head`` (the first message is the system head), else first."""
    if pinned is not None:
        messages.insert(1 if head else 0, pinned)
    return messages


def head_length(messages: Sequence[session_service_pb2.Message]) -> int:
    """How many of a request's first ``messages`` are its head: the system head (a leading
    system message that is not the pins') and the pinned-state message after it. A summary
    request's span, the part a summary stands for, starts after them."""
    count = 0
    if messages and messages[0].role == _SYSTEM and not messages[0].pinned_state:
        count = 1
    if len(messages) > count and messages[count].pinned_state:
        count += 1
    return count
