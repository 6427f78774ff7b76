"""Credentials out of every text compactd logs, stores, traces or returns.

A provider's error text (or its answer) can echo what it was sent: an ``Authorization`` header,
the key itself, a key put in the route's ``base_url``. ``Redactor`` replaces, in any text:

- the values of the API-key variables and the contents of the API-key files the routes name
  (read when redacting, so a rotated key is covered) and any literal secret it was given, such
  as a ``base_url``'s password;
- ``Authorization`` / ``Proxy-Authorization`` values and ``Bearer`` / ``Basic`` credentials;
- ``api_key``-like assignments (``api-key: ...``, ``"x-api-key":"..."``, ``?key=...``,
  ``access_token=...``, ``password=...``);
- well-known key shapes (``sk-...``, ``sk-proj-...``, ``sk-ant-...``, AWS ``AKIA...``, GitHub
  ``ghp_...``, Slack ``xox?-...``, Google ``AIza...``, Hugging Face ``hf_...``);
- the user information of URLs (``https://user:secret@host`` becomes ``https://[REDACTED]@host``).

The compaction engine redacts a failed summary's error before it reaches the log, the
``compaction/summary-error`` and ``compaction/end`` events, the span or the caller, and removes
the literal secrets (``Redactor.literals``: the keys themselves, not the patterns, which would
also cut ordinary text a summary must keep) from a summary before it is stored;
``RedactingFilter`` does the same as ``Redactor`` for every log record a handler emits (its
message, and the strings of its extra fields, inside mappings and lists too).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Final
from urllib.parse import unquote, urlsplit

REDACTED: Final = "[REDACTED]"
#: Literal secrets shorter than this are not searched for (they would match ordinary text).
MIN_SECRET_LENGTH: Final = 6

_KEY_NAMES = (
    r"(?:x-)?api[-_]?key|apikey|api[-_]?secret|client[-_]?secret|secret[-_]?key|secret"
    r"|(?:access|auth|refresh|session|id)[-_]?token|token|password|passwd|pwd|key"
)
_PATTERNS: Final[tuple[tuple[re.Pattern[str], str], ...]] = (
    # URL user information: scheme://user:password@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@\"'<>]+@"), rf"\1{REDACTED}@"),
    # Authorization headers, whatever their scheme, to the end of the value
    (
        re.compile(r"(?i)\b((?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?)[^\"'\r\n,}]+"),
        rf"\1{REDACTED}",
    ),
    # Bearer and Basic credentials anywhere
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{6,}"), rf"\1 {REDACTED}"),
    # key-like names assigned a value: JSON, headers, query strings, env lines
    (
        re.compile(
            rf"(?i)(?<![\w-])((?:{_KEY_NAMES})[\"']?\s*[:=]\s*[\"']?)(?![\"'\s]|{re.escape(REDACTED)})"
            r"[^\"'\s,;&}]{4,}"
        ),
        rf"\1{REDACTED}",
    ),
    # well-known key shapes
    (re.compile(r"\bsk-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{12,}"), REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"), REDACTED),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"), REDACTED),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{30,}"), REDACTED),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"), REDACTED),
)


class Redactor:
    """Removes credentials from text (see the module docstring for what it finds).

    Args:
        secrets: Literal secrets to remove wherever they appear (shorter than
            ``MIN_SECRET_LENGTH`` characters: ignored).
        env_names: Names of variables whose current values are secrets (API-key variables).
        environ: Where to read them; defaults to ``os.environ``.
        files: Files whose contents (stripped) are secrets (API-key files); read again when
            they change, a missing or unreadable one holds nothing.
    """

    def __init__(
        self,
        secrets: Iterable[str] = (),
        *,
        env_names: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
        files: Iterable[str] = (),
    ) -> None:
        self._secrets = frozenset(s for s in secrets if len(s) >= MIN_SECRET_LENGTH)
        self._env_names = tuple(dict.fromkeys(n for n in env_names if n))
        self._environ = environ if environ is not None else os.environ
        self._files = {path: _SecretFile(path) for path in dict.fromkeys(f for f in files if f)}

    def __call__(self, text: str) -> str:
        """``text`` with every credential replaced by ``[REDACTED]``."""
        if not text:
            return text
        text = self.literals(text)
        for pattern, replacement in _PATTERNS:
            text = pattern.sub(replacement, text)
        return text

    def literals(self, text: str) -> str:
        """``text`` with the literal secrets (the keys themselves) replaced, and nothing else."""
        # Longest first, so a secret that contains another is removed whole.
        for secret in sorted(self._literals(), key=len, reverse=True):
            text = text.replace(secret, REDACTED)
        return text

    def _literals(self) -> set[str]:
        found = set(self._secrets)
        for name in self._env_names:
            value = self._environ.get(name, "")
            if len(value) >= MIN_SECRET_LENGTH:
                found.add(value)
        for secret_file in self._files.values():
            value = secret_file.read()
            if len(value) >= MIN_SECRET_LENGTH:
                found.add(value)
        return found


class _SecretFile:
    """A key file's current text, read again only when its size or modification time moves."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None
        self._text = ""

    def read(self) -> str:
        try:
            stat = os.stat(self.path)
        except OSError:
            return ""
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen != self._seen:
            try:
                with open(self.path, encoding="utf-8") as handle:
                    self._text = handle.read().strip()
            except (OSError, UnicodeDecodeError):
                self._text = ""
            self._seen = seen
        return self._text


def url_secrets(url: str) -> list[str]:
    """The user information of ``url`` (raw and decoded), as literal secrets."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = []
    for value in (parts.username, parts.password):
        if value:
            found += [value, unquote(value)]
    return found


def for_routes(routes: Iterable[object], *, environ: Mapping[str, str] | None = None) -> Redactor:
    """A redactor for a route catalog: its API-key variables and its URLs' user information.

    ``routes`` are ``compactd.routes.Route``s (anything with ``api_key_env``, ``api_key_file``
    and ``base_url``).
    """
    names: list[str] = []
    files: list[str] = []
    secrets: list[str] = []
    for route in routes:
        names.append(str(getattr(route, "api_key_env", "") or ""))
        files.append(str(getattr(route, "api_key_file", "") or ""))
        secrets += url_secrets(str(getattr(route, "base_url", "") or ""))
    return Redactor(secrets, env_names=names, environ=environ, files=files)


_STANDARD_RECORD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message"}


class RedactingFilter(logging.Filter):
    """A handler filter that redacts a record's message, its string extras and its traceback."""

    def __init__(self, redact: Callable[[str], str]) -> None:
        super().__init__()
        self._redact = redact

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's to report; leave it as it is
            return True
        record.msg = self._redact(message)
        record.args = None
        for key, value in list(record.__dict__.items()):
            if key not in _STANDARD_RECORD:
                setattr(record, key, self._redacted(value))
        if record.exc_info:
            record.exc_text = self._redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = self._redact(record.exc_text)
        return True

    def _redacted(self, value: object, depth: int = 0) -> object:
        """``value`` with its strings redacted, inside mappings, lists and tuples too (a
        start-up field maps route names to URLs); copies, never the caller's objects."""
        if isinstance(value, str):
            return self._redact(value)
        if depth >= _MAX_EXTRA_DEPTH:
            return value
        if isinstance(value, Mapping):
            return {
                self._redacted(k, depth + 1): self._redacted(v, depth + 1) for k, v in value.items()
            }
        if isinstance(value, list | tuple):
            items = [self._redacted(v, depth + 1) for v in value]
            return items if isinstance(value, list) else tuple(items)
        return value


#: How deep ``RedactingFilter`` looks into an extra's containers (log fields are shallow).
_MAX_EXTRA_DEPTH: Final = 8


def install(
    redact: Callable[[str], str], logger: logging.Logger | None = None
) -> Callable[[], None]:
    """Add a ``RedactingFilter`` to every handler of ``logger`` (the root logger by default).

    Returns the function that removes it again.
    """
    target = logger or logging.getLogger()
    log_filter = RedactingFilter(redact)
    handlers = list(target.handlers)
    for handler in handlers:
        handler.addFilter(log_filter)

    def uninstall() -> None:
        for handler in handlers:
            handler.removeFilter(log_filter)

    return uninstall
