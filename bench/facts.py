"""Every fact of a span, and which of them a model-visible request still shows.

The benchmark's own fact extractor, written apart from ``core.probes`` (the quality gate's
extraction, which samples a few probes per kind): a summarizer tuned to the gate's probes must
not be able to pass this measure by keeping only those. It takes *every* distinct fact of a
span's original messages (prior checkpoints give none):

- **paths**: file paths the conversation names: in user and assistant text, in tool-call
  arguments (the values of path keys, and paths inside commands). Paths that appear only in tool
  output or inside a file's new content (a written file, an edit's replacement text) are bulk
  the model read, not facts it acted on, and are not counted. A path is identified by its last
  two segments (``pkg/mod.py`` for ``/home/u/src/pkg/mod.py``);
- **commands**: shell commands in tool-call arguments (``command``, ``cmd``, ``script``,
  ``shell``), in fenced ``bash``/``sh`` blocks of assistant text (agents that act through
  text), and ``$ `` lines of user text. A command is identified by its program and first
  argument (``pytest tests/x.py`` for ``cd app && pytest tests/x.py -q 2>&1 | tail``; leading
  ``cd``, ``export`` and variable assignments skipped);
- **errors**: the lines of tool results that state an error (``KeyError: 'x'``, ``error: ...``,
  ``E   AssertionError``, ``Traceback``, ``FAILED tests/...``, ``fatal: ...``, ``npm ERR!``), and
  the first line of a failed result that states none. An error is identified by its first 60
  characters (whitespace collapsed, case folded).

A fact is *visible* when the request's text holds its identity: the path's last two segments
(a one-segment path as a whole word), the command's two words in a row, the error's first 60
characters. Matching ignores case, surrounding quotes and runs of whitespace.

Pure: no I/O; the same messages always give the same facts.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from compactd.core import prompts
from compactd.v1 import session_service_pb2

Message = session_service_pb2.Message

PATH_KEYS = frozenset({"path", "file_path", "filepath", "filename", "file", "paths", "files"})
COMMAND_KEYS = frozenset({"command", "cmd", "script", "shell"})
ERROR_CHARS = 60

_EXTENSIONS = (
    "py|pyi|ts|tsx|js|jsx|mjs|cjs|json|jsonl|toml|yaml|yml|md|rst|txt|go|rs|java|kt|c|h|cc|cpp|"
    "hpp|cs|rb|php|sh|bash|zsh|sql|proto|html|css|scss|xml|ini|cfg|conf|lock|csv|ipynb|swift|lua|"
    "ex|exs|heex|eex|env|log|mk|gradle|tf|vue|svelte|dart|scala|pl|r|jl"
)
# A slashed token: absolute, home- or dot-relative, or two segments or more.
_SLASHED = re.compile(r"(?<![\w/.~@+:-])(?:~|\.{1,2})?/?[\w.@+-]+(?:/[\w.@+-]+)+/?")
_BARE = re.compile(rf"(?<![\w/.@+-])[\w-]+(?:\.[\w-]+)*\.(?:{_EXTENSIONS})(?![\w/])")
_URL_HEAD = re.compile(r"[a-z][a-z0-9+.-]*://\S*", re.I)
# A line that states an error (after an optional marker: ``E   ``, ``** (``, ``✗ ``).
_STATES_ERROR = re.compile(
    r"^[^\w]*(?:E\s+)?(?:"
    r"\w+(?:Error|Exception)\b|(?:Error|Exception)\s*:"
    r"|(?i:error|fatal|panic)\b\s*[:!\]\[(]"
    r"|(?i:traceback)\b|FAILED\b|FAIL\b|ERROR\b|npm ERR!"
    r")"
    r"|:\d+(?::\d+)?:\s*(?i:error|fatal)\b"  # a compiler's ``file:12:5: error: ...``
)
_FENCE = re.compile(r"```(?:bash|sh|shell|console|zsh)[ \t]*\n(.*?)```", re.S)
_SEGMENTS = re.compile(r"&&|\|\||[;|\n]")
_SKIP_PROGRAMS = frozenset({"cd", "pushd", "popd", "export", "source", "set", "sudo", "time"})
_STRIP = "`'\"*()[]{}<>,;:!?."


class FactKind(enum.StrEnum):
    """A class of fact."""

    PATH = "path"
    COMMAND = "command"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Fact:
    """One distinct fact: its class, its identity (what a request must show) and one spelling."""

    kind: FactKind
    key: str
    text: str


# ---- extraction ---------------------------------------------------------------------------------


def span_facts(messages: Iterable[Message]) -> list[Fact]:
    """Every distinct fact of ``messages``, in first-seen order (identities deduplicated)."""
    found: dict[tuple[FactKind, str], Fact] = {}

    def add(kind: FactKind, texts: Iterable[str]) -> None:
        for text in texts:
            key = identity(kind, text)
            if key and (kind, key) not in found:
                found[(kind, key)] = Fact(kind, key, text)

    for message in messages:
        text = _text(message)
        if message.role == session_service_pb2.MESSAGE_ROLE_USER:
            if _is_checkpoint(text):
                continue
            add(FactKind.PATH, paths_in(text))
            add(FactKind.COMMAND, [ln[2:] for ln in text.splitlines() if ln.startswith("$ ")])
        elif message.role == session_service_pb2.MESSAGE_ROLE_ASSISTANT:
            add(FactKind.PATH, paths_in(text))
            fenced = [line for block in _FENCE.findall(text) for line in _lines(block)]
            add(FactKind.COMMAND, fenced)
            add(FactKind.PATH, (p for line in fenced for p in paths_in(line)))
            for block in message.content:
                if block.HasField("tool_call"):
                    commands, paths = call_facts(block.tool_call.arguments_json)
                    add(FactKind.COMMAND, commands)
                    add(FactKind.PATH, paths)
        elif message.role == session_service_pb2.MESSAGE_ROLE_TOOL:
            add(FactKind.ERROR, error_lines(text, failed=message.is_error))
    return list(found.values())


def paths_in(text: str) -> list[str]:
    """File paths in ``text`` (URLs skipped), each once, in order."""
    text = _URL_HEAD.sub(" ", text)
    found: dict[str, None] = {}
    for match in _SLASHED.finditer(text):
        token = match.group(0).rstrip(".,:;")
        if _is_path(token):
            found[token] = None
    for match in _BARE.finditer(text):
        found.setdefault(match.group(0), None)
    return list(found)


def _is_path(token: str) -> bool:
    if token.startswith(("/dev/", "/proc/")) or token.strip("/.~") == "":
        return False
    segments = [s for s in token.split("/") if s]
    if token.startswith(("/", "~/", "./", "../")):
        return len(segments) >= 2 or "." in segments[-1]
    return len(segments) >= 3 or bool(re.search(r"\.[A-Za-z]\w{0,9}$", token))


def call_facts(arguments_json: str) -> tuple[list[str], list[str]]:
    """``(commands, paths)`` a tool call's JSON arguments name (paths: path keys' values and paths
    inside commands; not paths inside other strings such as a written file's content)."""
    try:
        arguments: Any = json.loads(arguments_json) if arguments_json else {}
    except ValueError:
        return [], []
    commands: list[str] = []
    paths: list[str] = []
    # An editor tool's ``command`` ("view", "str_replace" beside a ``path``) is no shell command.
    editor = isinstance(arguments, dict) and bool(PATH_KEYS & {str(k).lower() for k in arguments})
    for key, value in _walk(arguments, ""):
        strings = [value] if isinstance(value, str) else []
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            strings = list(value)
        if key in COMMAND_KEYS and strings:
            command = " ".join(strings)
            if editor and len(command.split()) == 1:
                continue
            commands.append(command)  # a script or a heredoc is one command: its first
            paths += paths_in(command)
        elif key in PATH_KEYS:
            paths += [s for s in strings if s.strip()]
    return commands, paths


def _walk(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    yield key.lower(), value
    if isinstance(value, dict):
        for child_key, child in value.items():
            yield from _walk(child, str(child_key))
    elif isinstance(value, list):
        for child in value:
            if not isinstance(child, str):
                yield from _walk(child, key)


def _lines(block: str) -> list[str]:
    """The command lines of a script: not blank, not comments."""
    return [
        ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")
    ]


def error_lines(text: str, *, failed: bool) -> list[str]:
    """The lines of a tool result that state an error (a failed result's first line if none)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    stated = [line for line in lines if _STATES_ERROR.search(line)]
    if failed and not stated and lines:
        return lines[:1]
    return stated


# ---- identities and visibility ----------------------------------------------------------------


def identity(kind: FactKind, text: str) -> str:
    """What identifies a fact: a path's last two segments, a command's program and first
    argument, an error's first ``ERROR_CHARS`` characters (all case-folded)."""
    if kind is FactKind.PATH:
        return path_key(text)
    if kind is FactKind.COMMAND:
        return " ".join(command_words(text)[:2])
    key = " ".join(text.split()).casefold()[:ERROR_CHARS].strip()
    return key if len(key.split()) >= 2 else ""  # a bare "error:" identifies nothing


def path_key(path: str) -> str:
    """The last two segments of ``path`` (only the last after ``.``, ``..``, ``~``), case-folded."""
    parts = [part for part in path.strip().split("/") if part][-2:]
    if parts and parts[0] in (".", "..", "~"):
        parts = parts[1:]
    return "/".join(parts).casefold()


def command_words(command: str) -> list[str]:
    """The words of a command's first segment that runs a program (``cd`` steps, variable
    assignments and redirections skipped), case-folded, quotes stripped."""
    for segment in _SEGMENTS.split(command):
        words = [w for raw in segment.split() if (w := raw.strip(_STRIP).casefold())]
        words = [w for w in words if ">" not in w and "<" not in w]
        while words and (words[0] in _SKIP_PROGRAMS or re.match(r"^\w+=", words[0])):
            words = words[1:] if words[0] not in ("cd", "pushd", "popd", "source") else []
        if words:
            return words
    return []


@dataclass(frozen=True)
class Visible:
    """A model-visible text, normalized once for every fact checked against it."""

    flat: str  # whitespace collapsed, case-folded
    words: str  # its words, quotes stripped, one space apart, padded with spaces
    names: frozenset[str]  # every word's last path segment

    @classmethod
    def of(cls, text: str) -> Visible:
        words = [w for raw in text.split() if (w := raw.strip(_STRIP).casefold())]
        names = frozenset(w.rstrip("/").rpartition("/")[2] for w in words)
        return cls(" ".join(text.split()).casefold(), f" {' '.join(words)} ", names)

    def shows(self, fact: Fact) -> bool:
        """Whether this text holds ``fact``'s identity."""
        if fact.kind is FactKind.PATH:
            return fact.key in self.flat if "/" in fact.key else fact.key in self.names
        if fact.kind is FactKind.COMMAND:
            return f" {fact.key} " in self.words
        return fact.key in self.flat


def kept(facts: Sequence[Fact], text: str) -> list[bool]:
    """For each fact, whether ``text`` shows it."""
    visible = Visible.of(text)
    return [visible.shows(fact) for fact in facts]


def _text(message: Message) -> str:
    return "\n\n".join(block.text.text for block in message.content if block.HasField("text"))


def _is_checkpoint(text: str) -> bool:
    return text.startswith(prompts.PREAMBLES) and prompts.SUMMARY_OPEN_TAG in text
