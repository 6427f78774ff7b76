"""Turns and steps around imported messages, so an imported conversation is a valid log.

compactd accepts an ``assistant/message`` only inside an open step of an open turn, and a
``tool/result`` after the step that made its call. A converter feeds the messages in order;
``Timeline`` adds the brackets:

* a user message opens a turn (closing the previous one once the assistant has answered in it);
* each assistant message is one step: ``step/start``, the message, ``step/end`` (a turn is opened
  first if none is);
* tool results, system and developer messages go where they come;
* ``finish`` closes the open turn (reason ``imported``) unless the caller keeps it open.
"""

from __future__ import annotations

from compactd_client.events import step_end, step_start, turn_end, turn_start
from compactd_client.v1.events_pb2 import SessionEvent


class Timeline:
    """Collects events, adding turn and step brackets (see the module docstring)."""

    def __init__(self, first_turn: int = 1) -> None:
        self.events: list[SessionEvent] = []
        self._next_turn = first_turn
        self._turn: int | None = None
        self._steps = 0

    def other(self, event: SessionEvent) -> None:
        """A system, developer or tool message, or a log-only event: appended as is."""
        self.events.append(event)

    def user(self, event: SessionEvent) -> None:
        """User input: opens a turn (the next one, once the assistant answered in this one)."""
        if self._turn is not None and self._steps:
            self.close("completed")
        if self._turn is None:
            self._open()
        self.events.append(event)

    def assistant(self, event: SessionEvent) -> None:
        """One model reply: one step of the open turn."""
        if self._turn is None:
            self._open()
        assert self._turn is not None
        self._steps += 1
        self.events += [
            step_start(self._turn, self._steps),
            event,
            step_end(self._turn, self._steps),
        ]

    def close(self, reason: str) -> None:
        """Close the open turn, if any."""
        if self._turn is not None:
            self.events.append(turn_end(self._turn, reason))
            self._turn = None

    def finish(self, close_turn: bool) -> list[SessionEvent]:
        """Every event, the last turn closed when ``close_turn``."""
        if close_turn:
            self.close("imported")
        return self.events

    def _open(self) -> None:
        self._turn, self._steps = self._next_turn, 0
        self._next_turn += 1
        self.events.append(turn_start(self._turn))
