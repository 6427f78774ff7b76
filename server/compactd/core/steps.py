"""Work written as steps: a generator that pauses (``yield``) where an event loop may run other
calls, and returns its value at the end (``service.sessions.in_steps`` runs one on the loop).
The core stays free of the loop: the same steps also run to their end at once."""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


def run_to_end(steps: Generator[None, None, T]) -> T:
    """Run ``steps`` without pausing; its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: T = done.value
            return result
