"""Service configuration: defaults, then the TOML file, then the environment, then flags.

``ServerConfig`` is the one declaration of every setting: a frozen pydantic dataclass whose
fields carry their type, default, constraint and description. Adding a setting is adding one
field (a scalar, or a ``Table`` that its owning module validates); the loader, the environment
variables, the error messages, ``check-config`` and the JSON Schema follow from it.

Sources, lowest first: the defaults; the TOML file (top-level keys, or the scalars under
``[server]``); ``COMPACTD_*`` variables, read by pydantic-settings (``COMPACTD_LISTEN``, nested
keys with ``__``: ``COMPACTD_SUMMARIZER__KIND=openai``, ``COMPACTD_COMPACTION__THRESHOLD_RATIO``
for the camelCase ``thresholdRatio``; a whole table as JSON: ``COMPACTD_PRUNER='{...}'``); then
the command-line flags. Values of owned tables from the environment are read as JSON when they
parse as JSON (numbers, booleans, arrays), else as strings.

An unknown key in the file is an error naming it; an unknown ``COMPACTD_*`` variable is not (other
tools share the prefix: the client suites read ``COMPACTD_ADDRESS``): ``unknown_variables`` lists
them, and ``compactd`` warns about each and ignores it. Every error names the bad key as the user
wrote it: ``server.max_message_bytes``, ``COMPACTD_LISTEN``, ``--store``.

Tables owned by other modules (``[compaction]``, the spec's policy keys; ``[[routes]]``;
``[summarizer]``; ``[pruner]``) are carried as plain data and validated by their owners at start
(``api.server.components``).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, ValidationError, create_model
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from compactd.core.limits import RESPONSE_MARGIN_BYTES, AppendLimits
from compactd.errors import ConfigError

ENV_PREFIX: Final = "COMPACTD_"
#: Variables with the prefix that are not settings (the CLI reads the config file's path).
NOT_SETTINGS: Final = frozenset({"COMPACTD_CONFIG"})

#: A table validated by its owning module.
Table = dict[str, Any]


class CamelCaseKeys:
    """Marks a table whose keys are camelCase: ``..._THRESHOLD_RATIO`` sets ``thresholdRatio``."""


def _listen(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected HOST:PORT")
    return value


def _optional_listen(value: str) -> str:
    return _listen(value) if value else value


def _store(value: str) -> str:
    # postgresql:// (issue 12, replicas): several compactd processes serve one database.
    postgres = value.startswith(("postgresql://", "postgres://"))
    if not (value.startswith("sqlite:///") or value == "memory://" or postgres):
        raise ValueError("expected sqlite:///PATH, postgresql://... or memory://")
    return value


def _one_of(*choices: str) -> AfterValidator:
    def check(value: str) -> str:
        if value.upper() not in choices:
            raise ValueError(f"expected {', '.join(choices[:-1])} or {choices[-1]}")
        return value

    return AfterValidator(check)


Listen = Annotated[str, AfterValidator(_listen)]
Store = Annotated[str, AfterValidator(_store)]
Positive = Annotated[int, Field(gt=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ServerConfig:
    """Everything ``compactd serve`` needs. Defaults are the documented ones."""

    listen: Listen = Field("127.0.0.1:50051", description="HOST:PORT to bind; port 0 picks one")
    store: Store = Field(
        "sqlite:///./compactd.db", description="sqlite:///PATH, postgresql://... or memory://"
    )
    sqlite_synchronous: Annotated[str, _one_of("FULL", "EXTRA", "NORMAL")] = Field(
        "FULL", description="SQLite synchronous mode: FULL, EXTRA or NORMAL"
    )
    max_message_bytes: Positive = Field(16 * 1024 * 1024, description="largest gRPC message")
    max_batch_events: Positive = Field(1000, description="most events in one AppendEvents")
    max_streams: Positive = Field(1024, description="most concurrent response streams, in all")
    max_streams_per_session: Positive = Field(32, description="most response streams a session")
    max_block_bytes: Positive = Field(1 << 20, description="largest content block appended")
    max_event_bytes: Positive = Field(2 << 20, description="largest event appended")
    max_surface_bytes: Positive = Field(
        12 << 20, description="largest surface + header of a session"
    )
    max_json_depth: Positive = Field(64, description="deepest tool schema / arguments JSON")
    # Cost follows the work (issue 11): fold snapshots and the bound on sessions in memory.
    snapshot_interval_events: Annotated[int, Field(ge=0)] = Field(
        1000,
        description="fewest events between a session's fold snapshots (a long log's come after "
        "one event per 16 entries they copy); 0: never snapshot",
    )
    max_resident_sessions: Annotated[int, Field(ge=0)] = Field(
        1024, description="sessions kept in memory at most (LRU); 0: no bound"
    )
    keepalive_time_s: PositiveSeconds = Field(60.0, description="gRPC keepalive ping interval")
    keepalive_timeout_s: PositiveSeconds = Field(20.0, description="keepalive ping timeout")
    shutdown_grace_s: Annotated[float, Field(ge=0)] = Field(
        10.0, description="seconds in-flight calls may finish after SIGTERM"
    )
    log_level: Annotated[str, _one_of("DEBUG", "INFO", "WARNING", "ERROR")] = Field(
        "INFO", description="DEBUG, INFO, WARNING or ERROR"
    )
    log_format: Literal["json", "text"] = Field("json", description="json or text")
    metrics_listen: Annotated[str, AfterValidator(_optional_listen)] = Field(
        "", description="HOST:PORT of the Prometheus /metrics endpoint; empty: none"
    )
    # Replicas and the PostgreSQL store (issue 12): several processes serving one database.
    store_migrate: bool = Field(
        False, description="apply pending PostgreSQL schema migrations at start (serve --migrate)"
    )
    postgres_pool_max: Positive = Field(8, description="most PostgreSQL connections per replica")
    postgres_statement_timeout_ms: Positive = Field(
        5000, description="PostgreSQL statement and lock timeout, in milliseconds"
    )
    postgres_connect_timeout_s: PositiveSeconds = Field(
        5.0, description="longest a PostgreSQL call waits for a connection before UNAVAILABLE"
    )
    bracket_lease_s: PositiveSeconds = Field(
        30.0, description="seconds a replica's compaction bracket lease runs between renewals"
    )
    # Issue 10: TLS and authentication (checked together by ``check_transport``; the tables are
    # validated by ``compactd.api.auth`` and ``compactd.service.retention``).
    tls_cert_file: str = Field(
        "", description="PEM certificate chain of the listener; with tls_key_file: TLS on"
    )
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file")
    tls_client_ca_file: str = Field(
        "", description="PEM CA bundle: mutual TLS, every client presents a cert it signed"
    )
    tls_reload_interval_s: Annotated[float, Field(ge=0)] = Field(
        10.0, description="seconds between checks of the TLS and token files (SIGHUP: at once)"
    )
    insecure_plaintext: bool = Field(
        False, description="allow plaintext on a non-loopback listen (a mesh terminates mTLS)"
    )
    health_listen: Annotated[str, AfterValidator(_optional_listen)] = Field(
        "", description="HOST:PORT of a plaintext health-only listener (probes); empty: none"
    )
    auth_tokens_file: str = Field(
        "", description="file of 'TENANT SHA256-HEX' lines: bearer tokens by their hash"
    )
    auth_tokens: Table = field(default_factory=dict)  # tenant = "sha256 hex" or a list of them
    auth_identities: Table = field(default_factory=dict)  # mTLS SAN (SPIFFE ID, DNS) = tenant
    auth_jwt: Table = field(default_factory=dict)  # issuer, audience, jwks_file, tenant_claim
    session_retention_s: Table = field(default_factory=dict)  # tenant = idle seconds to keep
    compaction: Annotated[Table, CamelCaseKeys] = field(default_factory=dict)
    routes: tuple[Table, ...] = ()
    summarizer: Table = field(default_factory=dict)
    pruner: Table = field(default_factory=dict)
    # Issue 10: tenant quotas. [quotas] defaults and [quotas.tenants.ID] overrides, validated by
    # compactd.service.quotas.QuotaSettings (COMPACTD_QUOTAS__APPENDS_PER_SECOND=50).
    quotas: Table = field(default_factory=dict)

    @property
    def host_port(self) -> tuple[str, int]:
        """``listen`` split into host and port."""
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


_ADAPTER: Final = TypeAdapter(ServerConfig)
# pydantic's record of the dataclass's fields (types, defaults, constraints, descriptions).
_FIELDS: Final[dict[str, FieldInfo]] = ServerConfig.__pydantic_fields__  # type: ignore[attr-defined]
TABLES: Final = tuple(
    name for name, info in _FIELDS.items() if info.annotation in (Table, tuple[Table, ...])
)
SCALARS: Final = tuple(name for name in _FIELDS if name not in TABLES)


class _EnvironmentSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="ignore"
    )


# The same fields, for pydantic-settings' environment source (it reads a settings class).
_Environment = create_model(  # type: ignore[call-overload]
    "CompactdEnvironment",
    __base__=_EnvironmentSettings,
    **{name: (info.annotation, info) for name, info in _FIELDS.items()},
)


class _EnvironSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of ``os.environ``."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(_Environment)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(
            self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str
        )

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError as err:  # pydantic-settings would raise SettingsError, unnamed
            variable = ENV_PREFIX + field_name.upper()
            raise ConfigError(f"{variable}: expected JSON ({err})") from None


def load(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Build and validate the configuration (``ConfigError`` names the bad key).

    Args:
        path: The TOML file, if any.
        environ: The environment; defaults to ``os.environ``.
        overrides: Command-line flags by setting name; None values are not given.
    """
    env = os.environ if environ is None else environ
    file, origin = _from_file(Path(path)) if path is not None else ({}, {})
    sources = _Sources(
        file=file,
        origin=origin,
        env=_from_env(env),
        flags={key: value for key, value in (overrides or {}).items() if value is not None},
    )
    try:
        config = _ADAPTER.validate_python(sources.merged())
    except ValidationError as err:
        raise ConfigError(sources.describe(err.errors()[0])) from None
    check_limits(config)
    check_transport(config)
    return config


_LOOPBACK_HOSTS = frozenset({"localhost", "::1"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (of a listen address) is reachable from this machine only."""
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def check_transport(config: ServerConfig) -> None:
    """TLS files come in pairs; identities need mutual TLS; plaintext off loopback is asked for.

    Raises:
        ConfigError: naming the setting to add.
    """
    if bool(config.tls_cert_file) != bool(config.tls_key_file):
        missing = "tls_key_file" if config.tls_cert_file else "tls_cert_file"
        raise ConfigError(f"{missing}: required with the other of tls_cert_file/tls_key_file")
    if config.tls_client_ca_file and not config.tls_cert_file:
        raise ConfigError("tls_client_ca_file: mutual TLS needs tls_cert_file and tls_key_file")
    if config.auth_identities and not config.tls_client_ca_file:
        raise ConfigError(
            "auth_identities: client identities come from client certificates; "
            "set tls_client_ca_file"
        )
    host, _ = config.host_port
    if not config.tls_cert_file and not config.insecure_plaintext and not is_loopback(host):
        raise ConfigError(
            f"listen: {config.listen} is not a loopback address and TLS is off; set "
            "tls_cert_file and tls_key_file, or insecure_plaintext = true when a mesh sidecar "
            "terminates mTLS in front of compactd"
        )


def check_limits(config: ServerConfig) -> None:
    """Reads of a legal session must fit one message: block <= event <= surface < message.

    Raises:
        ConfigError: naming the limit that could not hold.
    """
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


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """``COMPACTD_*`` variables that name no setting (warned about and ignored)."""
    env = os.environ if environ is None else environ
    return sorted(
        name
        for name in env
        if name.upper().startswith(ENV_PREFIX)
        and name.upper() not in NOT_SETTINGS
        and _setting_of(name) is None
    )


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the configuration file (for editors: taplo, VS Code, JetBrains)."""
    schema = _ADAPTER.json_schema(mode="validation")
    properties = schema["properties"]
    scalars = {name: properties[name] for name in SCALARS}
    properties["server"] = {
        "type": "object",
        "description": "The scalar settings, also accepted at the top level",
        "properties": scalars,
        "additionalProperties": False,
    }
    schema["title"] = "compactd configuration"
    schema["additionalProperties"] = False
    return schema


# ---- sources ---------------------------------------------------------------------------------


class _Sources:
    """The three sources' values, merged by precedence, and where each key came from."""

    def __init__(
        self,
        *,
        file: dict[str, Any],
        origin: dict[str, str],
        env: dict[str, Any],
        flags: dict[str, Any],
    ) -> None:
        self.file, self.origin, self.env, self.flags = file, origin, env, flags

    def merged(self) -> dict[str, Any]:
        values = dict(self.file)
        for source in (self.env, self.flags):
            for key, value in source.items():
                if isinstance(value, dict) and isinstance(values.get(key), dict):
                    values[key] = {**values[key], **value}
                else:
                    values[key] = value
        return values

    def describe(self, error: Mapping[str, Any]) -> str:
        """``where: what`` for one pydantic error, ``where`` as the user wrote the key."""
        location = [str(part) for part in error["loc"]]
        key = location[0] if location else ""
        if key in self.flags:
            where = "--" + key.replace("_", "-")
        elif key in self.env:
            where = ENV_PREFIX + key.upper()
        else:
            where = self.origin.get(key, key)
        for part in location[1:]:
            where += f"[{part}]" if part.isdigit() else f".{part}"
        return f"{where}: {_message(error)}"


def _from_file(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The file's settings, and how the user wrote each key that came from ``[server]``."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ConfigError(f"config file {path} does not exist") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from err
    server = data.pop("server", {})
    if not isinstance(server, dict):
        raise ConfigError("server: must be a table")
    origin: dict[str, str] = {}
    for key, value in server.items():
        if key not in SCALARS:
            raise ConfigError(f"server.{key}: unknown setting (known: {', '.join(SCALARS)})")
        data[key] = value
        origin[key] = f"server.{key}"
    unknown = [key for key in data if key not in _FIELDS]
    if unknown:
        known = ", ".join((*SCALARS, "server", *TABLES))
        raise ConfigError(f"{unknown[0]}: unknown setting (known: {known})")
    return data, origin


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    relevant = {name: value for name, value in environ.items() if _setting_of(name) is not None}
    values: dict[str, Any] = _EnvironSource(relevant)()
    for name in TABLES:
        if isinstance(values.get(name), dict):
            camel = CamelCaseKeys in _FIELDS[name].metadata
            values[name] = {
                (_camel(key) if camel else key): _literal(value)
                for key, value in values[name].items()
            }
    return values


def _setting_of(variable: str) -> str | None:
    """The setting a ``COMPACTD_*`` variable sets, or None."""
    name = variable.upper()
    if not name.startswith(ENV_PREFIX) or name in NOT_SETTINGS:
        return None
    key, nested, _ = name[len(ENV_PREFIX) :].lower().partition("__")
    if key in SCALARS and not nested:
        return key
    return key if key in TABLES else None


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _literal(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


_TYPES: Final = {"int": "int", "float": "float", "string": "str", "bool": "bool"}


def _message(error: Mapping[str, Any]) -> str:
    kind, value = str(error["type"]), error.get("input")
    base = kind.split("_")[0]
    if kind == "extra_forbidden" or kind == "unexpected_keyword_argument":
        return "unknown setting"
    if kind in ("dict_type", "model_type", "dataclass_type"):
        return f"must be a table, got {value!r}"
    if kind in ("tuple_type", "list_type"):
        return f"must be an array of tables ([[{error['loc'][0]}]]), got {value!r}"
    if base in _TYPES and kind.endswith(("_type", "_parsing", "_from_float")):
        return f"expected {_TYPES[base]}, got {value!r}"
    if kind == "greater_than" and error.get("ctx", {}).get("gt") == 0:
        return f"must be positive, got {value!r}"
    if kind == "greater_than_equal":
        return f"must be >= {error['ctx']['ge']}, got {value!r}"
    text = re.sub(r"^Value error, ", "", str(error["msg"]))
    return f"{text[0].lower()}{text[1:]}, got {value!r}"
