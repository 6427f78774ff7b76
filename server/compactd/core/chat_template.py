"""Chat templates: a model's Jinja template rendered as the serving stack renders it, and priced
one message at a time.

Rendering follows transformers' ``apply_chat_template`` (which vLLM uses, and llama.cpp's minja
mirrors): an immutable sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, a ``tojson`` filter with transformers' signature,
``raise_exception`` and ``strftime_now`` globals, and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables. Messages are OpenAI-style dicts: tool-call
arguments parsed from their JSON text into objects (as vLLM does before rendering), text blocks
joined as the wire adapter joins them, reasoning as ``reasoning_content`` only when the route
sends it back.

Pricing is incremental. A rendering's token count is additive across special tokens: the
tokenizer extracts added tokens before it normalizes, pre-tokenizes and merges, so each stretch of
text between two of them is encoded on its own (``SegmentCounter``; a property test proves it
against the tokenizer). Chat templates put a special token around every message, so a message's
price is what inserting it into a fixed neighbourhood adds to the count (``TemplatePricing``).
What a conversation adds once (begin-of-sequence, the system block, the tools preamble, the
generation prompt) is the *framing*, priced apart from the messages and cached per system text and
tool list. A property test proves ``framing + sum of message prices == count(full rendering)``
for every catalog template; ``TemplatePricing.self_check`` runs the same comparison on a sample
conversation when a route loads a template, so a template that is not additive is reported, not
trusted.

Pure: no file or clock access; the loader (``compactd.tokenizers``) reads files and passes the
date.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from compactd.v1 import events_pb2, session_service_pb2

Message = session_service_pb2.Message
ChatMessage = dict[str, Any]

# The wire adapter joins several text blocks of one message with a blank line.
TEXT_JOIN: Final = "\n\n"

_ROLES: Final = {
    session_service_pb2.MESSAGE_ROLE_SYSTEM: "system",
    session_service_pb2.MESSAGE_ROLE_DEVELOPER: "system",  # open-model templates know no developer
    session_service_pb2.MESSAGE_ROLE_USER: "user",
    session_service_pb2.MESSAGE_ROLE_ASSISTANT: "assistant",
    session_service_pb2.MESSAGE_ROLE_TOOL: "tool",
}


class TemplateError(ValueError):
    """A template that does not compile, or that raised while rendering."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """One compiled chat template.

    Args:
        source: The Jinja text (``chat_template`` of a ``tokenizer_config.json``).
        special_tokens: Template variables such as ``bos_token`` and ``eos_token``.
        today: The date ``strftime_now`` formats (templates that print today's date).

    Raises:
        TemplateError: The source does not compile.
    """

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        today: dt.date = dt.date(2026, 1, 1),
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        moment = dt.datetime(today.year, today.month, today.day)
        env.globals["strftime_now"] = moment.strftime
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as err:
            raise TemplateError(f"chat template does not compile: {err}") from err
        self.source = source
        self._variables = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, None for none).

        Raises:
            TemplateError: The template raised (``raise_exception``) or failed.
        """
        try:
            return self._template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        except TemplateError:
            raise
        except Exception as err:  # a template is user code: any failure is its failure
            raise TemplateError(f"chat template failed: {err}") from err


class SegmentCounter:
    """Counts a rendering as the tokenizer would, one stretch between special tokens at a time.

    The tokenizer splits out its added tokens (leftmost, longest first) before anything else, so
    ``count(a + special + b) == count(a) + 1 + count(b)``; each stretch is counted once and cached,
    so the fixed text around a message (role markers, dummy neighbours) costs a dictionary lookup.

    Args:
        count: The tokenizer's count of a text without added begin/end tokens.
        specials: The tokenizer's added tokens (each encodes to exactly one token).
        cache_size: Stretches remembered.
    """

    def __init__(
        self, count: Callable[[str], int], specials: Iterable[str], cache_size: int = 8192
    ) -> None:
        ordered = sorted({s for s in specials if s}, key=len, reverse=True)
        self.specials: tuple[str, ...] = tuple(ordered)
        self._split = re.compile("|".join(map(re.escape, ordered))).split if ordered else None
        self._count = count
        self._cached = functools.lru_cache(maxsize=cache_size)(count)

    def count(self, text: str) -> int:
        """Tokens of ``text``, special tokens included."""
        if self._split is None:
            return self._count(text)
        pieces = self._split(text)
        cached = self._cached
        return len(pieces) - 1 + sum(cached(piece) for piece in pieces if piece)

    def count_fresh(self, text: str) -> int:
        """As ``count``, caching only short stretches (a message body is seen once; the markers
        and dummy neighbours around it repeat)."""
        if self._split is None:
            return self._count(text)
        pieces = self._split(text)
        cached, count = self._cached, self._count
        total = len(pieces) - 1
        for piece in pieces:
            if piece:
                total += cached(piece) if len(piece) <= _SHORT else count(piece)
        return total


_SHORT: Final = 64  # stretches up to this length are cached


def _sentinel(index: int) -> str:
    """Placeholder ``index`` of a spliced rendering (private-use characters: never in a
    template, and content holding them takes the full rendering)."""
    return f"\ue000compactd-{index}\ue001"


# Probe contents that check a template inserts a message's content verbatim (no trimming, no
# escaping): plain, with a special token, with inner newlines.
_PROBES: Final = ("alpha beta", "x <|im_end|> \u03b3 12", "line one\nline two")
# Probes with surrounding whitespace: a role passing them takes such content verbatim too (Qwen's
# user and tool turns; not its assistant turns, whose content it strips of leading newlines).
_SPACED_PROBES: Final = (" lead", "trail\n", "\n\nboth \n\t")

# Neighbourhoods a message is inserted into: (before, after). Dummy messages carry "x".
_CALL: Final = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {}}}
_USER: Final = {"role": "user", "content": "x"}
_ASSISTANT: Final = {"role": "assistant", "content": "x"}
_TOOL: Final = {"role": "tool", "content": "x", "tool_call_id": "call_0", "name": "f"}
_TWO_CALLS: Final = {"role": "assistant", "content": "", "tool_calls": [_CALL, _CALL]}
_CONTEXTS: Final[dict[str, tuple[tuple[ChatMessage, ...], tuple[ChatMessage, ...]]]] = {
    "user": ((_USER, _ASSISTANT), (_ASSISTANT,)),
    "system": ((_USER, _ASSISTANT), (_USER,)),
    "assistant": ((_USER,), (_USER,)),
    # The second result of a two-call step: a result inside a run of results.
    "tool": ((_USER, _TWO_CALLS, _TOOL), (_USER,)),
}
_BODY: Final = (_USER,)  # the smallest conversation a framing is measured against


class TemplatePricing:
    """Token prices of chat messages and of a request's framing under one template + tokenizer.

    ``framing(system, tools) + sum(message_tokens(m) for m in messages)`` equals the tokens of
    ``render([system, *messages], tools, add_generation_prompt=True)`` for additive templates
    (every catalog template; see ``self_check``).

    Args:
        template: The chat template.
        counter: Counts renderings.
        key: Stable identity (tokenizer and template digests): profiles compare by it.
    """

    def __init__(self, template: ChatTemplate, counter: SegmentCounter, key: str) -> None:
        # Shared by the event loop and the pricing worker threads. Every cache here maps a key
        # to a value that depends on the key alone, and is read and filled by single dict (or
        # attribute) operations, which are atomic with or without the GIL; a race only computes
        # a value twice. ``SegmentCounter``'s ``lru_cache`` locks itself; Jinja renders are
        # thread-safe.
        self.template = template
        self.counter = counter
        self.key = key
        self._base: dict[str, int] = {}
        self._framing: dict[tuple[str | None, str], int] = {}
        self._system: tuple[str, int] = ("", 0)
        self._shapes: dict[tuple[str, int, bool, bool], str | None] = {}
        # Content the template inspects (tag-like literals such as "</think>", special tokens)
        # takes the full rendering: the template may branch on it.
        self._guard = _literal_guard(template.source, counter.specials)

    # ---- messages -------------------------------------------------------------------------

    def message_tokens(self, message: ChatMessage, *, splice: bool = True) -> int:
        """What ``message`` adds to a rendering (a system message: one after the head).

        An assistant message with tool calls is priced with one result per call after it, less
        those results' own prices: it carries what a run of results adds once (Qwen's
        ``<|im_start|>user`` around the run, for instance).

        A message whose rendering inserts its strings verbatim (content, tool-call ids, names,
        and arguments as their ``tojson`` text; checked once per shape with probe messages) is
        priced from that rendering with its strings spliced in, without running the template
        again (``splice=False`` renders anyway: the reference the splice is tested against).
        """
        fast = self._spliced(message) if splice else None
        if fast is not None:
            return fast
        role = message["role"]
        calls = len(message.get("tool_calls") or ())
        before, after = _CONTEXTS.get(role, _CONTEXTS["user"])
        results = (_TOOL,) * calls
        text = self.template.render(
            [*before, message, *results, *after], add_generation_prompt=False
        )
        tokens = self.counter.count_fresh(text) - self._base_tokens(role)
        if calls:
            tokens -= calls * self._dummy_tool_price
        return tokens

    def _spliced(self, message: ChatMessage) -> int | None:
        """The price from a verified rendering with the message's strings spliced in, or None
        when the message or its role's rendering does not allow it."""
        content = message.get("content")
        if not isinstance(content, str) or (not content and "tool_calls" not in message):
            return None
        if set(message) - {"role", "content", "tool_call_id", "name", "tool_calls"}:
            return None
        role = message["role"]
        values = [content]
        calls = message.get("tool_calls") or ()
        for call in calls:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if not isinstance(arguments, dict) or set(call) != {"id", "type", "function"}:
                return None
            values += [str(call["id"]), str(function.get("name", "")), _tojson(arguments)]
        if any(self._unsafe(v) for v in values):
            return None
        key = (role, len(calls), bool(content), content != content.strip())
        shape = self._shape(key)
        if shape is None:
            return None
        text = shape
        for index, value in enumerate(values):
            text = text.replace(_sentinel(index), value)
        tokens = self.counter.count_fresh(text) - self._base_tokens(role)
        return tokens - len(calls) * self._dummy_tool_price if calls else tokens

    def _unsafe(self, value: str) -> bool:
        guard = self._guard
        return "\ue000" in value or (guard is not None and guard.search(value) is not None)

    def _shape(self, key: tuple[str, int, bool, bool]) -> str | None:
        """The rendering of a message of shape ``key`` (role, tool calls, has content, content
        with surrounding whitespace) in its neighbourhood, with sentinels for its strings; None
        when probe messages show the template does not insert them verbatim."""
        if key in self._shapes:
            return self._shapes[key]
        role, calls, has_content, spaced = key
        before, after = _CONTEXTS.get(role, _CONTEXTS["user"])
        results = (_TOOL,) * calls

        def message(values: Sequence[str], arguments: Sequence[Any], variant: int) -> ChatMessage:
            built: ChatMessage = {"role": role, "content": values[0]}
            if role == "tool":
                built["tool_call_id"], built["name"] = f"call_{variant}", f"tool{variant}"
            if calls:
                built["tool_calls"] = [
                    {"id": values[1 + 3 * i], "type": "function",
                     "function": {"name": values[2 + 3 * i], "arguments": arguments[i]}}
                    for i in range(calls)
                ]  # fmt: skip
            return built

        def render(values: Sequence[str], arguments: Sequence[Any], variant: int) -> str:
            built = message(values, arguments, variant)
            return self.template.render(
                [*before, built, *results, *after], add_generation_prompt=False
            )

        count = 1 + 3 * calls
        sentinels = [_sentinel(i) for i in range(count)]
        # The arguments of the shape are strings (spliced text); a template that renders object
        # arguments differently from their tojson text fails the probes below.
        shape_values = [sentinels[0] if has_content else "", *sentinels[1:]]
        shape: str | None = render(shape_values, sentinels[3::3], 0)  # ids may not be rendered
        assert shape is not None
        contents = _PROBES + (_SPACED_PROBES if spaced else ())
        for variant, probe in enumerate(contents, start=1):
            if shape is None:
                break
            arguments = [{"path": f"a{variant}.py", "n": [variant, "\u03b3"]}] * calls
            values = [probe if has_content else ""]
            for i in range(calls):
                values += [f"call_{variant}_{i}", f"tool_{variant}_{i}", _tojson(arguments[i])]
            expected = shape
            for index, value in enumerate(values):
                expected = expected.replace(_sentinel(index), value)
            if render(values, arguments, variant) != expected:
                shape = None
        self._shapes[key] = shape
        return shape

    def system_tokens(self, text: str) -> int:
        """``message_tokens`` of a system message with ``text`` (the last one cached: the head)."""
        if self._system[0] != text or not text:
            self._system = (text, self.message_tokens({"role": "system", "content": text}))
        return self._system[1]

    def _base_tokens(self, role: str) -> int:
        cached = self._base.get(role)
        if cached is None:
            before, after = _CONTEXTS.get(role, _CONTEXTS["user"])
            text = self.template.render([*before, *after], add_generation_prompt=False)
            cached = self._base[role] = self.counter.count(text)
        return cached

    @functools.cached_property
    def _dummy_tool_price(self) -> int:
        return self.message_tokens(dict(_TOOL))

    # ---- framing --------------------------------------------------------------------------

    def framing(self, system: str | None, tools: Sequence[Mapping[str, Any]] | None) -> int:
        """Tokens the request adds besides its messages: begin-of-sequence, the system head
        (``system``, None for none), the tools preamble and the generation prompt. Cached."""
        tools_key = json.dumps(list(tools), sort_keys=True) if tools else ""
        key = (system, tools_key)
        cached = self._framing.get(key)
        if cached is None:
            head = [{"role": "system", "content": system}] if system is not None else []
            text = self.template.render([*head, *_BODY], tools or None)
            body = sum(self.message_tokens(dict(m)) for m in _BODY)
            cached = self.counter.count(text) - body
            if len(self._framing) > 256:
                self._framing.clear()
            self._framing[key] = cached
        return cached

    def count_rendering(
        self,
        system: str | None,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> int:
        """The reference: the tokens of the full rendering, counted whole."""
        head = [{"role": "system", "content": system}] if system is not None else []
        return self.counter.count(self.template.render([*head, *messages], tools or None))

    def self_check(self) -> int:
        """Incremental minus full count on a sample conversation with a system head, tools, tool
        calls and results; 0 for an additive template. Raises ``TemplateError`` if it fails."""
        calls = [
            {"id": "call_a", "type": "function", "function": {"name": "run", "arguments": {}}},
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "read", "arguments": {"path": "a.py"}},
            },
        ]
        messages: list[ChatMessage] = [
            {"role": "user", "content": "Why does the test fail?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
            {"role": "tool", "content": "1 failed", "tool_call_id": "call_a", "name": "run"},
            {"role": "tool", "content": "def f(): ...", "tool_call_id": "call_b", "name": "read"},
            {"role": "assistant", "content": "Fixed: the path was wrong."},
            {"role": "user", "content": "Thanks!"},
        ]
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "run",
                    "description": "Run a shell command.",
                    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
                },
            }
        ]
        system = "You are a careful coding agent."
        incremental = self.framing(system, tools) + sum(self.message_tokens(m) for m in messages)
        return incremental - self.count_rendering(system, messages, tools)


def _literal_guard(source: str, specials: Sequence[str]) -> re.Pattern[str] | None:
    """A pattern of every tag the template source spells (``<think>``, ``</tool_response>``,
    ``<|im_start|>``, ...) and every special token."""
    literals = set(re.findall(r"</?[A-Za-z_|\[][^<>\s'\"]{0,40}>", source))
    literals.update(specials)
    literals.discard("")
    if not literals:
        return None
    return re.compile("|".join(map(re.escape, sorted(literals, key=len, reverse=True))))


# ---- compactd messages as chat dicts ------------------------------------------------------------


def chat_message(message: Message, *, sends_reasoning: bool) -> ChatMessage:
    """A projected message as the OpenAI-style dict a chat template receives.

    Text blocks are joined with ``TEXT_JOIN``; images are left out (their price is the route's
    image pricing); tool-call arguments are parsed JSON objects when they parse, else the text.
    """
    role = _ROLES.get(message.role, "user")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.content:
        kind = block.WhichOneof("block")
        if kind == "text":
            texts.append(block.text.text)
        elif kind == "reasoning":
            reasoning.append(block.reasoning.text)
        elif kind == "tool_call":
            calls.append(_tool_call(block.tool_call))
    chat: ChatMessage = {"role": role, "content": TEXT_JOIN.join(texts)}
    if role == "tool":
        chat["tool_call_id"] = message.tool_call_id
        chat["name"] = message.name
    if calls:
        chat["tool_calls"] = calls
    if reasoning and sends_reasoning and role == "assistant":
        chat["reasoning_content"] = TEXT_JOIN.join(reasoning)
    return chat


def _tool_call(call: events_pb2.ToolCallBlock) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.arguments_json) if call.arguments_json else {}
    except ValueError:
        arguments = call.arguments_json
    if not isinstance(arguments, dict):
        arguments = call.arguments_json
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def chat_tools(tools: Sequence[events_pb2.ToolDeclaration]) -> list[dict[str, Any]]:
    """Tool declarations as the JSON-schema dicts templates receive (``{type, function}``)."""
    converted = []
    for tool in tools:
        try:
            parameters = json.loads(tool.input_schema_json) if tool.input_schema_json else {}
        except ValueError:
            parameters = {}
        function = {"name": tool.name, "description": tool.description, "parameters": parameters}
        converted.append({"type": "function", "function": function})
    return converted
