"""The recall tool's calls, answered through ``SessionService.Recall``.

With the session policy ``recallTool`` on, every rebuilt request declares the recall tool (named
``recallToolName``, default ``recall``). When the model calls it, the runtime answers with
``client.answer_recall(session_id, call)``: the result is an ordinary ``tool/result`` event, to
append to the log and send back to the model like any tool's. A handle the log does not name, or
arguments that are not ``{"handle": ..., "query": ..., "page": ...}``, answer an error result the
model can read (``is_error``); any other failure raises.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compactd_client.errors import CompactdError
from compactd_client.events import tool_result
from compactd_client.v1.events_pb2 import ContentBlock, SessionEvent, ToolCallBlock
from compactd_client.v1.session_service_pb2 import RecallRequest, RecallResponse

__all__ = ["DEFAULT_TOOL_MAX_BYTES", "ToolCallLike", "is_recall_call"]

#: The most bytes of recalled events one answer carries (the model pages for more).
DEFAULT_TOOL_MAX_BYTES = 16384
#: Reasons that come back to the model as an error result rather than raise.
_MODEL_ERRORS = frozenset({"RECALL_HANDLE_UNKNOWN", "INVALID_ARGUMENT"})

#: A tool call: compactd's ``ToolCallBlock`` (or the ``ContentBlock`` holding it), an OpenAI
#: chat ``tool_calls`` item (``{"id", "function": {"name", "arguments"}}``) or an Anthropic
#: ``tool_use`` block (``{"id", "name", "input"}``).
ToolCallLike = ToolCallBlock | ContentBlock | Mapping[str, Any]


@dataclass(frozen=True)
class _Call:
    id: str
    name: str
    arguments: str


def is_recall_call(call: ToolCallLike, name: str = "recall") -> bool:
    """Whether ``call`` calls the recall tool (declared under ``name``)."""
    return _call(call).name == name


def recall_request(
    session_id: str, call: ToolCallLike, max_bytes: int
) -> RecallRequest | SessionEvent:
    """The ``Recall`` request a call asks for, or the error result of unusable arguments."""
    parsed = _call(call)
    try:
        arguments = json.loads(parsed.arguments or "{}")
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict) or not isinstance(arguments.get("handle"), str):
        return error_result(call, 'the arguments must be {"handle": "..."} (query, page optional)')
    return RecallRequest(
        session_id=session_id,
        handle=arguments["handle"],
        query=str(arguments.get("query") or ""),
        page_token=str(arguments.get("page") or ""),
        max_bytes=max_bytes,
    )


def answer(call: ToolCallLike, response: RecallResponse) -> SessionEvent:
    """The ``tool/result`` that answers ``call`` with a recalled page (its text)."""
    parsed = _call(call)
    return tool_result(parsed.id, response.text, tool_name=parsed.name)


def error_answer(call: ToolCallLike, error: CompactdError) -> SessionEvent:
    """The error result of a failed ``Recall`` the model can act on; raises ``error`` else."""
    if error.reason not in _MODEL_ERRORS:
        raise error
    return error_result(call, f"recall failed: {error.message}")


def error_result(call: ToolCallLike, message: str) -> SessionEvent:
    """An error ``tool/result`` answering ``call``."""
    parsed = _call(call)
    return tool_result(parsed.id, message, tool_name=parsed.name, is_error=True)


def _call(call: ToolCallLike) -> _Call:
    if isinstance(call, ContentBlock):
        call = call.tool_call
    if isinstance(call, ToolCallBlock):
        return _Call(call.id, call.name, call.arguments_json)
    if "function" in call:  # OpenAI chat completions
        function = call["function"]
        return _Call(str(call.get("id", "")), function["name"], function.get("arguments") or "")
    arguments = call.get("input", {})  # Anthropic tool_use
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return _Call(str(call.get("id", "")), str(call.get("name", "")), text)
