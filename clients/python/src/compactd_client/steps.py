"""The request a step sends: the held request, the step's answer, and how one becomes the other.

``PrepareStep`` with ``held_revision`` (the revision of the request the caller holds) answers the
full request only when compactd changed what that request shows (a compaction, a prune, an image
offload, a new header); otherwise it carries just the messages appended since
(``request_unchanged``), so a step costs what it adds, not the session's length. With it goes
``held_incarnation`` (the held request's ``incarnation``): a session deleted and created again
under the same id by another process restarts its revisions, and the server answers the full
request when the incarnation is not the session's.

The clients' ``prepare_step`` does this by itself: each keeps a :class:`HeldRequests` (the last
request of each recently stepped session), sends its revision, and answers a
:class:`PreparedStep` whose ``request`` is always the full request to send.
``step_request`` is the same rule for a runtime that calls ``prepare_step_unary`` or
``prepare_step_stream`` and holds its requests itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from compactd_client.v1.compaction_service_pb2 import CompactionProgress, PrepareStepResult
from compactd_client.v1.session_service_pb2 import BuildRequestResponse

__all__ = ["DEFAULT_HELD_SESSIONS", "HeldRequests", "PreparedStep", "step_request"]

#: Sessions whose last request a client holds by default (the least recently stepped is dropped).
DEFAULT_HELD_SESSIONS = 64


@dataclass(frozen=True)
class PreparedStep:
    """What the default ``prepare_step`` answers.

    Attributes:
        request: The full request to send: what ``BuildRequest`` answers at ``request.revision``.
            It is the request the client holds for the session: the session's next
            ``prepare_step`` on this client extends it in place, so copy it
            (``BuildRequestResponse().CopyFrom(...)``) to keep this step's.
        result: The step's result as the server sent it: pressure ``before`` and ``after``,
            ``pruned_count``, ``compactions``, ``warnings``. Its ``request`` is absent when
            ``request_unchanged`` (then ``appended_messages`` are what the step added).
        progress: The step updates, in order, when the step was streamed (``on_progress``);
            empty otherwise.
    """

    request: BuildRequestResponse
    result: PrepareStepResult
    progress: tuple[CompactionProgress, ...] = ()


class HeldRequests:
    """The last full request of each recently stepped session, for ``held_revision``.

    Holds at most ``capacity`` sessions (least recently stepped dropped first; 0 holds none, so
    every step answers the full request). Thread-safe. The held requests are the ones
    ``PreparedStep.request`` hands out: :meth:`update` extends them in place.

    Raises:
        ValueError: ``capacity`` is negative.
    """

    def __init__(self, capacity: int = DEFAULT_HELD_SESSIONS) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._requests: OrderedDict[str, BuildRequestResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._requests)

    def revision(self, session_id: str) -> int | None:
        """The revision of the request held for the session (the ``held_revision`` to send),
        or None when none is held."""
        with self._lock:
            held = self._requests.get(session_id)
            return None if held is None else held.revision

    def held(self, session_id: str) -> tuple[int, str] | None:
        """The revision and incarnation of the request held for the session, read together
        (the ``held_revision`` and ``held_incarnation`` to send), or None when none is held."""
        with self._lock:
            held = self._requests.get(session_id)
            return None if held is None else (held.revision, held.incarnation)

    def update(
        self,
        session_id: str,
        sent: int | None,
        result: PrepareStepResult,
        sent_incarnation: str | None = None,
    ) -> BuildRequestResponse | None:
        """The full request of ``result``, now held for the session.

        Args:
            session_id: The session.
            sent: The ``held_revision`` the step was sent with (None: none).
            result: The step's result.
            sent_incarnation: The ``held_incarnation`` the step was sent with (None: not
                checked); the held request must still be of it to be extended.

        Returns:
            The result's request when it carries one; else the held request extended in place
            with ``appended_messages`` at ``request_revision``. None when the result omits the
            request and the held one is no longer at ``sent`` (dropped, or moved on by a
            concurrent step, or of another incarnation than ``sent_incarnation``), or carries
            neither: the caller then needs the full request another way.
        """
        with self._lock:
            if not result.request_unchanged:
                if not result.HasField("request"):  # not a step's answer: hold nothing
                    return None
                self._hold(session_id, result.request)
                return result.request
            held = self._requests.get(session_id)
            if held is None or sent is None or held.revision != sent:
                return None
            if sent_incarnation is not None and held.incarnation != sent_incarnation:
                return None
            # Cost follows the step: the held messages stay, the new ones are appended.
            held.messages.extend(result.appended_messages)
            held.revision = result.request_revision
            self._hold(session_id, held)
            return held

    def hold(self, session_id: str, request: BuildRequestResponse) -> None:
        """Holds ``request`` (a full request of the session) in place of the held one."""
        with self._lock:
            self._hold(session_id, request)

    def forget(self, session_id: str) -> None:
        """Drops the request held for the session, if any."""
        with self._lock:
            self._requests.pop(session_id, None)

    def clear(self) -> None:
        """Drops every held request."""
        with self._lock:
            self._requests.clear()

    def _hold(self, session_id: str, request: BuildRequestResponse) -> None:
        if self.capacity == 0:
            return
        self._requests[session_id] = request
        self._requests.move_to_end(session_id)
        while len(self._requests) > self.capacity:
            self._requests.popitem(last=False)


def step_request(
    held: BuildRequestResponse | None, result: PrepareStepResult
) -> BuildRequestResponse:
    """The request to send for ``result``, leaving ``held`` as it was (a copy: it costs the
    whole request; the clients' ``prepare_step`` extends its held request in place instead).

    Args:
        held: The request the runtime holds (the one built at the ``held_revision`` it sent), or
            None when it sent none.
        result: The ``PrepareStep`` result.

    Raises:
        ValueError: The result omits the request but ``held`` is None.
    """
    if not result.request_unchanged:
        return result.request
    if held is None:
        raise ValueError("the result omits the request: pass the request held_revision named")
    request = BuildRequestResponse()
    request.CopyFrom(held)
    request.messages.extend(result.appended_messages)
    request.revision = result.request_revision
    return request
