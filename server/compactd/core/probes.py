"""The exact facts of a span, and whether a summary kept them.

One extraction serves two readers. The extractive summarizer lays a span's facts out as bullets;
the quality gate (``core.gate``) samples the ones that matter most as *probes* and checks that a
summary still holds them. Facts, in first-seen order:

- **requests**: what the user asked (user messages other than prior checkpoints), each kept once,
  at its latest position;
- **paths**: file paths in user and assistant text and the paths tool calls act on (values of
  ``path``-style keys, paths inside commands). Tool output and file contents written by a call
  are bulk: the paths they mention are never probed;
- **commands**: shell commands in tool-call arguments (``command``, ``cmd``, ``script``,
  ``shell``) and ``$ `` lines of user messages;
- **errors**: the last error lines of each tool result (a failed tool with no recognisable line
  gives its first line).

A probe is *retained* when the summary holds it the way a faithful summary writes facts (all
comparisons ignore case and Markdown quoting): a request or an error when some run of
``REQUEST_WORDS`` / ``ERROR_WORDS`` consecutive words of it appears in the summary (a quote; the
whole text when it is shorter), a command when the first ``COMMAND_WORDS`` words of its first
significant segment do (``cd`` steps and redirections dropped, so ``cd app && mix test 2>&1 |
tail`` is kept by "mix test"), a path when its last two segments do (``lib/app/mod.py`` keeps
``/home/u/src/lib/app/mod.py``; a one-segment name must be a whole word or a path's last
segment).

Pure: no I/O, no clock; the same span and summary always give the same probes and verdicts.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from compactd.core import prompts
from compactd.core.steps import run_to_end
from compactd.v1 import session_service_pb2

Message = session_service_pb2.Message
_ROLE = session_service_pb2

PATH_KEYS = ("path", "file_path", "filepath", "filename", "file", "paths", "files")
COMMAND_KEYS = ("command", "cmd", "script", "shell")
ERRORS_PER_RESULT = 3

_KNOWN_EXTENSIONS = (
    "py|pyi|ts|tsx|js|jsx|mjs|cjs|json|jsonl|toml|yaml|yml|md|rst|txt|go|rs|java|kt|c|h|cc|cpp|"
    "hpp|cs|rb|php|sh|bash|zsh|sql|proto|html|css|scss|xml|ini|cfg|conf|lock|csv|ipynb|swift|lua|"
    "env|log|mk|gradle|tf"
)
# A path never crosses a character outside ``[\w:/.~@+-]`` (the classes below and their
# lookbehinds stay inside it), so the regexes run only on the maximal runs of those characters
# that can hold one: a slash before a name character (``_PATH_TOKEN``) or a dot before a word
# character (``_BARE_FILE``). One compiled scan of the text finds just those runs; ordinary
# words never reach Python.
_RUN = re.compile(r"(?<![\w:/.~@+-])[\w:/.~@+-]*?(?:/[\w.@+-]|\.\w)[\w:/.~@+-]*")
# Where a run can hold one (a superset of ``_RUN``'s required part), and a run's end from
# there: ``_path_runs`` scans the text for these at C speed and runs ``_RUN`` only around them.
_RUN_HIT = re.compile(r"[/.][\w.@+-]")
_RUN_END = re.compile(r"[\w:/.~@+-]*")
_PATH_TOKEN = re.compile(r"(?<![\w:/.~@+-])[\w.~@+-]*(?:/[\w.@+-]+)+/?")
_BARE_FILE = re.compile(rf"(?<![\w/.-])[\w-]+(?:\.[\w-]+)*\.(?:{_KNOWN_EXTENSIONS})\b")
_ERROR_LINE = re.compile(
    r"(?i:\b(?:error|exception|traceback|failed|failure|fatal|panic|denied|not found)\b)"
    r"|\w(?:Error|Exception|Warning)\b"
)


# ---- extraction primitives (shared with the extractive summarizer) ---------------------------


def message_text(message: Message) -> str:
    """The text blocks of ``message``, joined by blank lines."""
    return "\n\n".join(block.text.text for block in message.content if block.HasField("text"))


def paths_in(text: str) -> list[str]:
    """File paths in ``text``, each once: tokens with a slash first, then bare file names.

    A token with a slash counts when it is absolute or home-relative (``/x``, ``~/x``, ``./x``,
    ``../x``), has two slashes or more, or ends with an extension; a bare name counts when its
    extension is a known source or data extension. An HTML closing tag (``</h1>``) is no path.
    """
    slashed: dict[str, None] = {}
    bare: dict[str, None] = {}
    for found in _path_runs(text):
        run = found.group(0)
        if "/" in run:
            # ``</h1>``, ``</div>``: markup closes a tag, it names no file.
            tag = found.start() > 0 and text[found.start() - 1] == "<"
            for match in _PATH_TOKEN.finditer(run):
                token = match.group(0).rstrip(".,:;")
                if tag and match.start() == 0 and _is_tag_name(token):
                    continue
                if _looks_like_path(token):
                    slashed[token] = None
        if "." in run.rstrip(".,:;"):  # a dot that only ends a sentence starts no extension
            bare.update(dict.fromkeys(match.group(0) for match in _BARE_FILE.finditer(run)))
    return [*slashed, *(name for name in bare if name not in slashed)]


def _path_runs(text: str) -> Iterator[re.Match[str]]:
    """``_RUN.finditer(text)``, without running the regex over ordinary words.

    A run is maximal, so it never crosses a space, newline or tab: from each hit of
    ``_RUN_HIT`` (every run ``_RUN`` matches holds one), ``_RUN`` scans only from the last such
    whitespace before the hit to the end of the hit's run, and the next hit is sought after
    that. What lies between holds no hit, so no run ``_RUN`` would match.
    """
    cursor = 0
    search, run_end, runs, rfind = _RUN_HIT.search, _RUN_END.match, _RUN.finditer, text.rfind
    while (hit := search(text, cursor)) is not None:
        at = hit.start()
        start = max(
            cursor, rfind(" ", cursor, at) + 1, rfind("\n", cursor, at) + 1,
            rfind("\t", cursor, at) + 1,
        )  # fmt: skip
        end = run_end(text, at).end()  # type: ignore[union-attr]  # ``*`` always matches
        yield from runs(text, start, end)
        cursor = end


def _is_tag_name(token: str) -> bool:
    """Whether ``token`` (right after a ``<``) is a closing tag's ``/name``: one segment, no dot."""
    name = token[1:]
    return token.startswith("/") and bool(name) and "/" not in name and "." not in name


def _looks_like_path(token: str) -> bool:
    if token.startswith(("/", "~/", "./", "../")):
        return len(token) > 1
    return token.count("/") >= 2 or _has_extension(token)


def _has_extension(token: str) -> bool:
    """Whether ``token`` ends with ``.`` and 1-10 ASCII letters or digits."""
    dot = token.rfind(".", max(0, len(token) - 11))
    suffix = token[dot + 1 :] if dot >= 0 else ""
    return bool(suffix) and suffix.isascii() and suffix.isalnum()


@dataclass(frozen=True, slots=True)
class CallFacts:
    """What one tool call's arguments name, in document order.

    Attributes:
        commands: Values of command keys (a list of strings is joined by spaces).
        paths: Every path: values of path keys and path-like tokens in any string.
        named_paths: The paths the call acts on: values of path keys and paths inside
            commands (not paths inside other strings, such as a file's new content).
    """

    commands: tuple[str, ...]
    paths: tuple[str, ...]
    named_paths: tuple[str, ...]


def call_facts(arguments_json: str, *, every_path: bool = True) -> CallFacts:
    """Commands and paths in a tool call's JSON arguments (path-like tokens when not JSON).

    ``every_path`` False keeps only the path keys' values in ``paths`` (the probes read just
    ``named_paths``): the scan of every other string, a written file's content included, is
    skipped.
    """
    try:
        arguments: Any = json.loads(arguments_json) if arguments_json else {}
    except ValueError:
        return CallFacts((), tuple(paths_in(arguments_json)) if every_path else (), ())
    commands: dict[str, None] = {}
    paths: dict[str, None] = {}
    named: dict[str, None] = {}
    # An editor tool's ``command`` ("view", "str_replace" beside a ``path``) names an action on
    # that path, not a shell command.
    editor = isinstance(arguments, dict) and any(str(k).lower() in PATH_KEYS for k in arguments)
    for key, value in _walk(arguments):
        strings = [value] if isinstance(value, str) else []
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            strings = value
        if key in COMMAND_KEYS and strings:
            command = " ".join(strings)
            if editor and len(command.split()) == 1:
                continue
            commands[command] = None
            named.update(dict.fromkeys(paths_in(command)))
        elif key in PATH_KEYS:
            listed = dict.fromkeys(item for item in strings if item)
            paths.update(listed)
            named.update(listed)
        if every_path:
            for item in strings:
                paths.update(dict.fromkeys(paths_in(item)))
    commands.pop("", None)
    return CallFacts(tuple(commands), tuple(paths), tuple(named))


def _walk(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """``(key, value)`` pairs of a decoded JSON value, depth first, in document order."""
    yield key.lower(), value
    if isinstance(value, dict):
        for child_key, child in value.items():
            yield from _walk(child, str(child_key))
    elif isinstance(value, list):
        for child in value:
            if not isinstance(child, str):
                yield from _walk(child, key)


def shell_commands(text: str) -> list[str]:
    """Commands a user message shows as ``$ command`` lines."""
    return [line[2:].strip() for line in text.splitlines() if line.startswith("$ ")]


def error_lines(text: str, *, is_error: bool, limit: int = ERRORS_PER_RESULT) -> list[str]:
    """The last ``limit`` error lines of a tool result (its first line when it failed silently).

    The last matching lines carry the cause: a traceback ends with it.
    """
    if not is_error and not _may_hold_error(text):
        return []  # most results: substring scans only, no regex, no line split
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    matching = [line for line in lines if _ERROR_LINE.search(line)]
    if is_error and not matching:
        matching = lines[:1]
    return matching[-limit:] if limit else []


# Every match of ``_ERROR_LINE`` contains one of these, case-folded.
_ERROR_WORDS = (
    "error", "exception", "warning", "traceback", "fail", "fatal", "panic", "denied", "not found"
)  # fmt: skip


def _may_hold_error(text: str) -> bool:
    lowered = text.lower()
    return any(word in lowered for word in _ERROR_WORDS)


def is_checkpoint(text: str) -> bool:
    """Whether a user message's text is a checkpoint written by a bracket (``frame_checkpoint``)."""
    return text.startswith(prompts.PREAMBLES) and prompts.SUMMARY_OPEN_TAG in text


# ---- the facts of a span ---------------------------------------------------------------------


@dataclass
class SpanFacts:
    """The facts of a span.

    Attributes:
        requests: User requests, each once, in order of their latest position.
        paths: Path -> mentions in user text, assistant text and what calls act on (probed).
        commands: Every command use, in order.
        errors: Error line -> the tool that printed it (its latest), in first-seen order.
        mentioned: With ``bulk``: every path in user and assistant text and anywhere in tool-call
            arguments, in first-seen order.
        result_paths: With ``bulk``: paths in tool output, in first-seen order.
        error_entries: With ``bulk``: ``"tool: line"`` for each error line, in first-seen order.
    """

    requests: dict[str, None] = field(default_factory=dict)
    paths: dict[str, int] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    mentioned: dict[str, None] = field(default_factory=dict)
    result_paths: dict[str, None] = field(default_factory=dict)
    error_entries: dict[str, None] = field(default_factory=dict)


def span_facts(messages: Iterable[Message], *, bulk: bool = False) -> SpanFacts:
    """The facts of ``messages`` in one pass; system messages and prior checkpoints give none.

    ``bulk`` also collects what only a summary lists (``mentioned``, ``result_paths``,
    ``error_entries``); the probes never need it.
    """
    return run_to_end(span_facts_in_steps(messages, bulk=bulk))


def span_facts_in_steps(
    messages: Iterable[Message], *, bulk: bool = False
) -> Generator[None, None, SpanFacts]:
    """``span_facts``, a message per step: its value is the facts. A caller may run other work
    between steps (the quality gate extracts a span's facts while a model writes its summary)."""
    facts = SpanFacts()
    for message in messages:
        yield
        role = message.role
        if role == _ROLE.MESSAGE_ROLE_USER:
            text = message_text(message)
            request = text.strip()
            if not request or is_checkpoint(text):
                continue
            facts.requests.pop(request, None)  # a repeated request moves to its latest position
            facts.requests[request] = None
            _mention(facts, paths_in(text), bulk)
            facts.commands += shell_commands(text)
        elif role == _ROLE.MESSAGE_ROLE_ASSISTANT:
            _mention(facts, paths_in(message_text(message)), bulk)
            for block in message.content:
                if block.HasField("tool_call"):
                    found = call_facts(block.tool_call.arguments_json, every_path=bulk)
                    facts.commands += found.commands
                    _count(facts.paths, found.named_paths)
                    if bulk:
                        facts.mentioned.update(dict.fromkeys(found.paths))
        elif role == _ROLE.MESSAGE_ROLE_TOOL:
            text = message_text(message)
            name = message.name or message.tool_call_id or "tool"
            for line in error_lines(text, is_error=message.is_error):
                facts.errors[line] = name
                if bulk:
                    facts.error_entries[f"{name}: {line}"] = None
            if bulk:
                facts.result_paths.update(dict.fromkeys(paths_in(text)))
    return facts


def _mention(facts: SpanFacts, paths: list[str], bulk: bool) -> None:
    _count(facts.paths, paths)
    if bulk:
        facts.mentioned.update(dict.fromkeys(paths))


def _count(counts: dict[str, int], items: Iterable[str]) -> None:
    for item in items:
        counts[item] = counts.get(item, 0) + 1


# ---- probes -----------------------------------------------------------------------------------


class ProbeKind(enum.StrEnum):
    """What a probe stands for."""

    REQUEST = "request"
    PATH = "path"
    COMMAND = "command"
    ERROR = "error"


REQUEST_WORDS = 6  # a quote of a request: this many consecutive words of it
ERROR_WORDS = 4
COMMAND_WORDS = 2
QUOTE_CHARS = 160  # the longest quote of a request's first REQUEST_WORDS words worth probing
SHORT_QUOTE_CHARS = 100  # the longest shortest quote of REQUEST_WORDS words worth probing
MIN_REQUEST_WORDS = 3  # shorter requests ("yes", "continue") carry no fact to keep


@dataclass(frozen=True, slots=True)
class ProbeLimits:
    """How many probes of each kind a span yields (the most important first)."""

    requests: int = 6
    paths: int = 8
    commands: int = 6
    errors: int = 4


@dataclass(frozen=True, slots=True)
class Probe:
    """One exact fact of the span a summary should hold.

    Attributes:
        kind: What the fact is.
        text: The fact as a summary should hold it.
        origin: The span's text it came from when that differs (an error line with its marker:
            ``E   KeyError: 'x'`` for ``KeyError: 'x'``); empty otherwise.
    """

    kind: ProbeKind
    text: str
    origin: str = ""


def select_probes(facts: SpanFacts, limits: ProbeLimits = ProbeLimits()) -> tuple[Probe, ...]:
    """The probes of a span: the facts that matter most, at most ``limits`` of each kind.

    Requests: the first and the latest, then the others newest first (markup a runtime injects,
    ``<system-reminder>``, and requests under ``MIN_REQUEST_WORDS`` words are not probed). Paths:
    the most mentioned first (ties: first seen). Commands: the most used program first (ties: the
    most recent). Errors: newest first, only lines that state an error. Each probe is distinct
    after normalization, so two spellings of one fact count once.
    """
    probes: list[Probe] = []
    probes += _distinct(
        ProbeKind.REQUEST, _requests_in_order(list(facts.requests)), limits.requests
    )
    # Filtering commutes with a stable sort: each path is checked only until enough are chosen.
    by_mentions = sorted(facts.paths, key=lambda path: -facts.paths[path])
    probes += _distinct(ProbeKind.PATH, filter(_is_file_path, by_mentions), limits.paths)
    probes += _distinct(ProbeKind.COMMAND, _by_use(facts.commands), limits.commands)
    errors: dict[str, str] = {}  # stated error -> its line
    for line in reversed(list(facts.errors)):
        stated = _stated_error(line)
        if stated is not None:
            errors.setdefault(stated, line)
    chosen = _distinct(ProbeKind.ERROR, errors, limits.errors)
    probes += [
        Probe(p.kind, p.text, "" if errors[p.text] == p.text else errors[p.text]) for p in chosen
    ]
    return tuple(probes)


def _requests_in_order(requests: Sequence[str]) -> Iterator[str]:
    """The requests worth probing (``_is_request``), the first and the latest first, then the
    others newest first; each checked only when ``_distinct`` reads that far."""
    first = next((i for i, request in enumerate(requests) if _is_request(request)), None)
    if first is None:
        return
    yield requests[first]
    last = next(i for i in range(len(requests) - 1, first - 1, -1) if _is_request(requests[i]))
    if last != first:
        yield requests[last]
    yield from (requests[i] for i in range(last - 1, first, -1) if _is_request(requests[i]))


def _by_use(commands: Iterable[str]) -> list[str]:
    """Commands, the most used program first (ties: the most recent), newest spelling each."""
    latest: dict[tuple[str, ...], tuple[int, str]] = {}
    uses: dict[tuple[str, ...], int] = {}
    for order, command in enumerate(commands):
        key = _needle(ProbeKind.COMMAND, command)
        uses[key] = uses.get(key, 0) + 1
        latest[key] = (order, command)
    ranked = sorted(latest, key=lambda key: (-uses[key], -latest[key][0]))
    return [latest[key][1] for key in ranked]


def _is_request(text: str) -> bool:
    """A request worth probing: a few words, not markup a runtime injected (``<reminder>``), and
    quotable: its first ``REQUEST_WORDS`` words take at most ``QUOTE_CHARS`` characters (a wall
    of encoded data or an unbroken script is data a message carries, not what the user asked)."""
    if text.startswith("<"):
        return False
    head = text.split(maxsplit=4 * MIN_REQUEST_WORDS)[: 4 * MIN_REQUEST_WORDS]  # not all of it
    if len(" ".join(head[:REQUEST_WORDS])) > QUOTE_CHARS:
        return False
    return len(_words(" ".join(head))) >= MIN_REQUEST_WORDS and _quotable(text)


def _quotable(text: str) -> bool:
    """Whether some run of ``REQUEST_WORDS`` words of ``text`` (within its first words) takes at
    most ``SHORT_QUOTE_CHARS``: what a summary writes to keep the request. A tool's observation
    relayed as a user message, a path in every other word, has no such run: a summary within a
    small share of its span could not keep it, so it is not probed."""
    words = _words(text[: 64 * QUOTE_CHARS])[: 64 * REQUEST_WORDS]
    k = min(len(words), REQUEST_WORDS)
    lengths = [len(word) + 1 for word in words]
    run = sum(lengths[:k])
    best = run
    for i in range(k, len(lengths)):
        run += lengths[i] - lengths[i - k]
        best = min(best, run)
    return best - 1 <= SHORT_QUOTE_CHARS


def _is_file_path(path: str) -> bool:
    """A path worth probing: a file or a nested directory, not a device (``/dev/null``)."""
    if path.startswith(("/dev/", "/proc/")):
        return False
    return _has_extension(path) or path.strip("/").count("/") >= 1


_ERROR_START = re.compile(
    r"^[^\w]*(?:[A-Z]\s+)?"  # a marker before the message: "** (", "E   ", "✗ "
    r"(?P<stated>(?i:error|fatal|panic|failed|failure)\s*:|(?i:traceback)\b|\w+(?:Error|Exception)\b)"
)


def stated_error(line: str) -> str | None:
    """The error ``line`` states (``_stated_error``), or None when it merely mentions one."""
    return _stated_error(line)


def _stated_error(line: str) -> str | None:
    """The error an error line states, from its first word (``KeyError: 'x'`` of
    ``E   KeyError: 'x'``), when the line starts with one (``error: ...``, ``** (CompileError)
    ...``) and says something (three words or more). Lines that merely mention an error (source
    code, CSS classes) state none."""
    match = _ERROR_START.match(line)
    if match is None:
        return None
    stated = line[match.start("stated") :]
    return stated if len(_words(stated)) >= 2 else None


def _distinct(kind: ProbeKind, texts: Iterable[str], limit: int) -> list[Probe]:
    chosen: list[Probe] = []
    keys: set[tuple[str, ...]] = set()
    for text in texts:
        if len(chosen) >= limit:
            break
        key = _needle(kind, text)
        if key and key not in keys:
            keys.add(key)
            chosen.append(Probe(kind, text))
    return chosen


@dataclass(frozen=True, slots=True)
class Retention:
    """Which probes a summary kept."""

    probes: tuple[Probe, ...]
    kept: tuple[bool, ...]

    @property
    def ratio(self) -> float:
        """Kept probes over all probes (1.0 for a span without probes)."""
        return sum(self.kept) / len(self.probes) if self.probes else 1.0

    @property
    def missed(self) -> tuple[Probe, ...]:
        """The probes the summary does not hold, in probe order."""
        return tuple(p for p, kept in zip(self.probes, self.kept, strict=True) if not kept)


def retention(probes: Sequence[Probe], summary: str) -> Retention:
    """Which of ``probes`` ``summary`` holds (see the module docstring for the rules)."""
    words = _words(summary)
    flat = " ".join(words)
    names = {word.rstrip("/").rpartition("/")[2] for word in words}
    grams: dict[int, set[tuple[str, ...]]] = {}

    def has_run(needle: tuple[str, ...]) -> bool:
        k = len(needle)
        if k not in grams:  # every run of k consecutive words, zipped in C
            grams[k] = set(zip(*(words[i:] for i in range(k)), strict=False)) if k else {()}
        return needle in grams[k]

    kept = []
    for probe in probes:
        if probe.kind is ProbeKind.PATH:
            tail = _path_tail(probe.text)
            kept.append(tail in flat if "/" in tail else tail in names)
        else:
            kept.append(any(has_run(run) for run in _runs(probe)))
    return Retention(tuple(probes), tuple(kept))


def _runs(probe: Probe) -> Iterator[tuple[str, ...]]:
    """The word runs any one of which retains a request, command or error probe."""
    if probe.kind is ProbeKind.COMMAND:
        needle = _needle(probe.kind, probe.text)
        if needle:
            yield needle
        return
    words = _words(probe.text)
    k = min(len(words), REQUEST_WORDS if probe.kind is ProbeKind.REQUEST else ERROR_WORDS)
    for start in range(len(words) - k + 1):
        yield tuple(words[start : start + k])


def _needle(kind: ProbeKind, text: str) -> tuple[str, ...]:
    """The normalized identity of a fact: equal needles are one probe."""
    if kind is ProbeKind.PATH:
        return (_path_tail(text),)
    if kind is ProbeKind.COMMAND:
        return tuple(_command_core(text)[:COMMAND_WORDS])
    return tuple(_words(text))


_STRIP = "`'\"*()[]{}<>,;:!?."


def words(text: str) -> list[str]:
    """The words retention compares (``_words``): a run of ``REQUEST_WORDS`` of a request's
    words, written anywhere in a summary, keeps the request."""
    return _words(text)


def _words(text: str) -> list[str]:
    """Case-folded words with surrounding quotes, brackets and punctuation stripped."""
    return [word for raw in text.split() if (word := raw.strip(_STRIP).casefold())]


_SEGMENT_SPLIT = re.compile(r"&&|\|\||[;|\n]")


def _command_core(command: str) -> list[str]:
    """The words of a command's first significant segment (``cd`` steps, redirections dropped)."""
    for segment in _SEGMENT_SPLIT.split(command):
        words = [w for w in _words(segment) if ">" not in w and "<" not in w]
        if words and words[0] not in ("cd", "pushd", "set", "export", "source"):
            return words
    return []


def _path_tail(path: str) -> str:
    """The last two segments of a path, case-folded; only the last after ``.``, ``..``, ``~``."""
    parts = [part for part in path.strip().split("/") if part][-2:]
    if parts and parts[0] in (".", "..", "~"):
        parts = parts[1:]
    return "/".join(parts).casefold()
