"""Who may call: bearer tokens and mutual-TLS client identities mapped to tenants.

``Credentials`` is the table of what the server accepts: SHA-256 digests of bearer tokens (from
``auth_tokens`` and the ``auth_tokens_file``; the server never holds a token itself), client
certificate identities (a SAN: SPIFFE ID, URI or DNS name, from ``auth_identities``), each naming
a tenant, and optionally JWTs of an identity provider (``[auth_jwt]``, ``api.jwt_auth``) whose
tenant claim names the tenant. ``Authentication`` is the interceptor: with credentials
configured, every call of compactd's services must carry one that resolves to a tenant, and
runs bound to it (``compactd.tenancy.bound_tenant``, set inside the handler's own task); health
checking and reflection stay open. A call without, or with a wrong one, answers UNAUTHENTICATED
with one fixed message, whatever was wrong: nothing in the answer helps guessing.

Rules: a presented token decides (a bad token fails even on a good client certificate, and a
token and a certificate naming different tenants fail); without a token the certificate's
identity decides. With no credentials configured, authentication is off and every call runs as
``DEFAULT_TENANT``.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import re
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast

import grpc

from compactd.api import status
from compactd.api.interceptors import (
    Behavior,
    Continuation,
    Handler,
    HandlerCache,
    Interceptor,
    coroutine,
    guarded,
    rewrapped,
)
from compactd.api.jwt_auth import JwtVerifier
from compactd.config import ServerConfig
from compactd.errors import ConfigError, Unauthenticated
from compactd.tenancy import Tenant, bound_tenant

log = logging.getLogger(__name__)

#: Services every caller may use: probes and tooling need them before they hold credentials.
OPEN_SERVICES: Final = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
)
#: The whole answer to a refused call (a constant: it reveals nothing about the attempt).
REFUSAL: Final = "missing or invalid credentials"
_DIGEST = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})$")
_TENANT = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Where gRPC puts the client certificate's identities in a call's auth context.
_IDENTITY_PROPERTIES: Final = ("x509_subject_alternative_name", "peer_spiffe_id")


@dataclass(frozen=True)
class Credentials:
    """The accepted credentials: token digests and client identities, each naming a tenant."""

    token_digests: tuple[tuple[bytes, Tenant], ...] = ()
    identities: Mapping[str, Tenant] = field(default_factory=dict)
    jwt: JwtVerifier | None = None

    @property
    def enabled(self) -> bool:
        """Whether any credential is configured (else authentication is off)."""
        return bool(self.token_digests or self.identities or self.jwt)

    def tenant_of_token(self, token: str) -> Tenant | None:
        """The tenant whose token (or verified JWT) this is; digests compared in constant time."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found: Tenant | None = None
        for known, tenant in self.token_digests:  # no early exit: time does not tell which
            if hmac.compare_digest(digest, known):
                found = tenant
        if found is None and self.jwt is not None and token.count(".") == 2:
            found = self.jwt.tenant_of(token)
        return found

    def tenant_of_identities(self, identities: Iterable[str]) -> Tenant | None:
        """The tenant of the first configured identity among a certificate's, else None."""
        for identity in identities:
            tenant = self.identities.get(identity)
            if tenant is not None:
                return tenant
        return None

    @classmethod
    def from_settings(
        cls,
        tokens: Mapping[str, Any],
        tokens_file: str,
        identities: Mapping[str, Any],
        jwt: Mapping[str, Any] | None = None,
    ) -> Credentials:
        """Validate the ``auth_tokens`` table, the tokens file, ``auth_identities`` and
        ``auth_jwt`` (reading its key set).

        Raises:
            ConfigError: naming the bad entry (never echoing a digest).
        """
        digests = [*_table_digests(tokens)]
        if tokens_file:
            digests.extend(_file_digests(Path(tokens_file)))
        mapped: dict[str, Tenant] = {}
        for identity, tenant in identities.items():
            mapped[str(identity)] = _tenant(tenant, f"auth_identities.{identity}")
        return cls(tuple(digests), mapped, JwtVerifier.from_table(jwt or {}))


def hash_token(token: str) -> str:
    """The hex SHA-256 digest of ``token``, as the tokens table and file hold it."""
    return hashlib.sha256(token.encode()).hexdigest()


def _tenant(value: object, where: str) -> Tenant:
    if not isinstance(value, str) or not _TENANT.match(value):
        raise ConfigError(f"{where}: a tenant id is 1-128 characters of [A-Za-z0-9._:-]")
    return Tenant(value)


def _digest(value: object, where: str) -> bytes:
    match = _DIGEST.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(
            f"{where}: expected the token's SHA-256 as 64 hex digits (sha256:HEX), "
            "not the token itself"
        )
    return bytes.fromhex(match.group(1))


def _table_digests(tokens: Mapping[str, Any]) -> Iterable[tuple[bytes, Tenant]]:
    for tenant_id, value in tokens.items():
        tenant = _tenant(tenant_id, f"auth_tokens.{tenant_id}")
        values = value if isinstance(value, list) else [value]
        for index, digest in enumerate(values):
            yield _digest(digest, f"auth_tokens.{tenant_id}[{index}]"), tenant


def _file_digests(path: Path) -> list[tuple[bytes, Tenant]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"auth_tokens_file: cannot read {path}: {error.strerror}") from None
    digests = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"auth_tokens_file: {path}:{number}"
        if len(words) != 2:
            raise ConfigError(f"{where}: expected 'TENANT SHA256-HEX'")
        digests.append((_digest(words[1], where), _tenant(words[0], where)))
    return digests


# ---- the interceptor ---------------------------------------------------------------------------


class Authentication(Interceptor):
    """Binds each call of compactd's services to its caller's tenant, or refuses it.

    ``credentials`` may be replaced while serving (``update``: tokens rotated by SIGHUP or a
    changed file); calls already running keep the tenant they started with.
    """

    resolves_per_method = True  # credentials are read when a call runs

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self._cache = HandlerCache()

    def update(self, credentials: Credentials) -> None:
        """Accept ``credentials`` from the next call on."""
        self.credentials = credentials

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler:
        handler: Handler | None = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return cast(Handler, handler)
        return self._cache.get(method, handler, self._authenticated)

    def _authenticated(self, handler: Handler) -> Handler:
        return rewrapped(handler, self._wrapped)

    def _wrapped(self, behavior: Behavior) -> Behavior:
        if inspect.isasyncgenfunction(behavior):
            return guarded(behavior, self._guard)
        awaited = coroutine(behavior)

        # A coroutine handler (every unary call) without a context manager per call.
        async def call(request: Any, context: Any) -> Any:
            if not self.credentials.enabled:  # authentication off: the default tenant's call
                return await awaited(request, context)
            tenant = await self._tenant(context)
            if tenant is None:
                return await awaited(request, context)
            with bound_tenant(tenant):
                return await awaited(request, context)

        return call

    @asynccontextmanager
    async def _guard(self, request: Any, context: Any) -> AsyncIterator[Any]:
        tenant = await self._tenant(context)
        if tenant is None:
            yield request
            return
        with bound_tenant(tenant):
            yield request

    async def _tenant(self, context: Any) -> Tenant | None:
        """The caller's tenant (None: authentication is off); aborts UNAUTHENTICATED."""
        credentials = self.credentials
        if not credentials.enabled:
            return None
        tenant = _caller(credentials, context)
        if tenant is None:
            await status.abort(context, Unauthenticated(REFUSAL))
        return cast(Tenant, tenant)


def _caller(credentials: Credentials, context: Any) -> Tenant | None:
    """The tenant the call's credentials resolve to, or None (refused)."""
    token = _bearer_token(context.invocation_metadata() or ())
    by_certificate = credentials.tenant_of_identities(_identities(context.auth_context()))
    if token is None:
        return by_certificate
    by_token = credentials.tenant_of_token(token)
    if by_token is None or (by_certificate is not None and by_certificate != by_token):
        return None
    return by_token


def _bearer_token(metadata: Iterable[Any]) -> str | None:
    """The token of the ``authorization: Bearer <token>`` header; None without one, "" for a
    malformed one or for more than one header (a call never names two callers: whichever the
    server picked, the other tenant's token would ride along unchecked)."""
    values = [value for key, value in metadata if key == "authorization"]
    if not values:
        return None
    if len(values) > 1:
        return ""
    text = values[0].decode("latin-1") if isinstance(values[0], bytes) else str(values[0])
    scheme, _, token = text.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _identities(auth_context: Mapping[str, Iterable[bytes]]) -> list[str]:
    """The client certificate's SAN values (SPIFFE ID first); empty without mutual TLS."""
    found: list[str] = []
    for name in reversed(_IDENTITY_PROPERTIES):
        for value in auth_context.get(name, ()):
            text = value.decode("utf-8", "replace")
            if text not in found:
                found.append(text)
    return found


def credentials_from(config: ServerConfig) -> Credentials:
    """The credentials ``config`` accepts (reads the tokens file).

    Raises:
        ConfigError: naming the bad entry.
    """
    return Credentials.from_settings(
        config.auth_tokens, config.auth_tokens_file, config.auth_identities, config.auth_jwt
    )


class TokensFileReload:
    """A ``tls.Reload`` for the tokens file and the JWKS file: rebuilds the credentials when
    their bytes change."""

    def __init__(self, config: ServerConfig, authentication: Authentication) -> None:
        self._config = config
        self._authentication = authentication
        self._seen = self._bytes()

    def __call__(self) -> bool:
        current = self._bytes()
        if current == self._seen:
            return False
        credentials = credentials_from(self._config)  # a bad file raises: the old ones stay
        self._seen = current
        self._authentication.update(credentials)
        log.info(
            "bearer tokens reloaded",
            extra={"auth_tokens_file": self._config.auth_tokens_file,
                   "tokens": len(credentials.token_digests)},
        )  # fmt: skip
        return True

    def _bytes(self) -> tuple[bytes | None, ...]:
        return tuple(_read(path) for path in self.paths(self._config))

    @staticmethod
    def paths(config: ServerConfig) -> list[str]:
        """The credential files of ``config`` (the tokens file, the JWKS file)."""
        jwks = config.auth_jwt.get("jwks_file", "")
        return [p for p in (config.auth_tokens_file, jwks) if isinstance(p, str) and p]


def _read(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError:
        return None
