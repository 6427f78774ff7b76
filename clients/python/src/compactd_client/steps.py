"""The request a step sends, from a ``PrepareStep`` result and the request the runtime holds.

A runtime that passes ``held_revision`` to ``prepare_step`` gets the full request back only when
compactd changed what it holds (a compaction, a prune, an image offload, a new header); otherwise
the result carries just the messages appended since (``request_unchanged``).
``step_request`` turns either answer into the request to send, and is the ``held`` of the next
step (its ``revision`` is the ``held_revision`` to pass).
"""

from __future__ import annotations

from compactd_client.v1.compaction_service_pb2 import PrepareStepResult
from compactd_client.v1.session_service_pb2 import BuildRequestResponse


def step_request(
    held: BuildRequestResponse | None, result: PrepareStepResult
) -> BuildRequestResponse:
    """The request to send for ``result``.

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
