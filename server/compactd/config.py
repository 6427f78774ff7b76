"""Service configuration: defaults, then the TOML file, then the environment, then flags.

One place reads the environment and the file. Values are validated at start; every error names
the bad key (``server.max_message_bytes``, ``COMPACTD_LISTEN``). Tables owned by other modules
(``[compaction]`` — the spec's policy keys, ``[[routes]]``, ``[summarizer]``, ``[pruner]``) are
carried as plain data and validated by their owners at start (``api.server.components``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from compactd.core.limits import RESPONSE_MARGIN_BYTES, AppendLimits
from compactd.errors import ConfigError

ENV_PREFIX = "COMPACTD_"


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``compactd serve`` needs. Defaults are the documented ones."""

    listen: str = "127.0.0.1:50051"  # HOST:PORT; port 0 picks a free port
    store: str = "sqlite:///./compactd.db"  # sqlite:///PATH or memory://
    sqlite_synchronous: str = "FULL"  # FULL (default), EXTRA or NORMAL
    max_message_bytes: int = 16 * 1024 * 1024
    max_batch_events: int = 1000
    max_streams: int = 1024  # concurrent response streams in the process
    max_streams_per_session: int = 32  # concurrent response streams of one session
    max_block_bytes: int = 1 << 20  # one content block of an appended event
    max_event_bytes: int = 2 << 20  # one appended event
    max_surface_bytes: int = 12 << 20  # a session's surface and header, as reads return them
    max_json_depth: int = 64  # nesting of tool schemas and tool-call arguments
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    shutdown_grace_s: float = 10.0
    log_level: str = "INFO"
    log_format: str = "json"  # json or text
    compaction: Mapping[str, Any] = field(default_factory=dict)
    routes: tuple[Mapping[str, Any], ...] = ()
    summarizer: Mapping[str, Any] = field(default_factory=dict)
    pruner: Mapping[str, Any] = field(default_factory=dict)

    @property
    def host_port(self) -> tuple[str, int]:
        """``listen`` split into host and port."""
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


_TABLES = ("compaction", "summarizer", "pruner")
_SCALARS = {f.name: f for f in fields(ServerConfig) if f.name not in ("routes", *_TABLES)}
_FILE_SECTIONS = {"routes", "server", *_TABLES}


def load(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Build and validate the configuration (``ConfigError`` names the bad key)."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_from_file(Path(path)))
    values.update(_from_env(os.environ if environ is None else environ))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    config = replace(ServerConfig(), **values)
    validate(config)
    return config


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ConfigError(f"config file {path} does not exist") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from err
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "server":
            if not isinstance(value, dict):
                raise ConfigError("server: must be a table")
            for sub, sub_value in value.items():
                key_name = _scalar_key(sub, f"server.{sub}")
                values[key_name] = _coerce(key_name, sub_value, f"server.{sub}")
        elif key == "routes":
            if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
                raise ConfigError("routes: must be an array of tables ([[routes]])")
            values["routes"] = tuple(value)
        elif key in _TABLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: must be a table")
            values[key] = value
        elif key in _SCALARS:
            values[key] = _coerce(key, value, key)
        else:
            known = ", ".join(sorted(set(_SCALARS) | _FILE_SECTIONS))
            raise ConfigError(f"{key}: unknown setting (known: {known})")
    return values


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "COMPACTD_CONFIG":
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in _SCALARS:
            raise ConfigError(f"{name}: unknown setting")
        values[key] = _coerce(key, raw, name)
    return values


def _scalar_key(key: str, where: str) -> str:
    if key not in _SCALARS:
        raise ConfigError(f"{where}: unknown setting")
    return key


def _coerce(key: str, value: Any, where: str) -> Any:
    kind = _SCALARS[key].type
    try:
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "str":
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected {kind}, got {value!r}") from None
    return value


def validate(config: ServerConfig) -> None:
    """Check the scalar settings; ``ConfigError`` names the first bad key."""
    host, _, port = config.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen: expected HOST:PORT, got {config.listen!r}")
    if not (config.store.startswith("sqlite:///") or config.store == "memory://"):
        raise ConfigError(f"store: expected sqlite:///PATH or memory://, got {config.store!r}")
    if config.sqlite_synchronous.upper() not in ("FULL", "EXTRA", "NORMAL"):
        raise ConfigError("sqlite_synchronous: expected FULL, EXTRA or NORMAL")
    _positive(config.max_message_bytes, "max_message_bytes")
    _positive(config.max_batch_events, "max_batch_events")
    _positive(config.max_streams, "max_streams")
    _positive(config.max_streams_per_session, "max_streams_per_session")
    _check_limits(config)
    _positive(config.keepalive_time_s, "keepalive_time_s")
    _positive(config.keepalive_timeout_s, "keepalive_timeout_s")
    if config.shutdown_grace_s < 0:
        raise ConfigError("shutdown_grace_s: must be >= 0")
    if config.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError("log_level: expected DEBUG, INFO, WARNING or ERROR")
    if config.log_format not in ("json", "text"):
        raise ConfigError("log_format: expected json or text")


def _check_limits(config: ServerConfig) -> None:
    """Reads of a legal session must fit one message: block <= event <= surface < message."""
    for key in ("max_block_bytes", "max_event_bytes", "max_surface_bytes", "max_json_depth"):
        _positive(getattr(config, key), key)
    if config.max_block_bytes > config.max_event_bytes:
        raise ConfigError("max_block_bytes: must not exceed max_event_bytes")
    if config.max_event_bytes > config.max_surface_bytes:
        raise ConfigError("max_event_bytes: must not exceed max_surface_bytes")
    room = config.max_message_bytes - RESPONSE_MARGIN_BYTES
    if config.max_surface_bytes > room:
        raise ConfigError(
            f"max_surface_bytes: must leave {RESPONSE_MARGIN_BYTES} bytes of max_message_bytes "
            f"for the rest of a response (at most {room}), got {config.max_surface_bytes}"
        )


def limits(config: ServerConfig) -> AppendLimits:
    """The append limits of ``config``."""
    return AppendLimits(
        max_block_bytes=config.max_block_bytes,
        max_event_bytes=config.max_event_bytes,
        max_surface_bytes=config.max_surface_bytes,
        max_json_depth=config.max_json_depth,
    )


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be positive, got {value}")
