"""Bearer JWTs from an identity provider: signature by a JWKS file, issuer, audience, expiry.

``[auth_jwt]`` configures it: ``issuer``, ``audience`` and ``jwks_file`` (the provider's public
keys as a JSON Web Key Set, reloaded like the tokens file) are required; ``tenant_claim``
(default ``tenant``) names the claim whose value is the caller's tenant; ``algorithms`` (default
``RS256``, ``ES256``) may list asymmetric algorithms only, so a key set can never be used as a
shared secret; ``leeway_s`` (default 30) tolerates clock skew. A token must carry ``exp``,
``iss`` and ``aud``. PyJWT does the verification.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jwt

from compactd.errors import ConfigError
from compactd.tenancy import Tenant

_ASYMMETRIC: Final = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
_KEYS: Final = frozenset(
    {"issuer", "audience", "jwks_file", "tenant_claim", "algorithms", "leeway_s"}
)


@dataclass(frozen=True)
class JwtVerifier:
    """Verifies a JWT and reads its tenant claim."""

    issuer: str
    audience: str
    jwks_file: str
    keys: tuple[jwt.PyJWK, ...]
    tenant_claim: str = "tenant"
    algorithms: tuple[str, ...] = ("RS256", "ES256")
    leeway_s: float = 30.0

    def tenant_of(self, token: str) -> Tenant | None:
        """The token's tenant if its signature, issuer, audience and times hold, else None."""
        claims = self._claims(token)
        value = None if claims is None else claims.get(self.tenant_claim)
        if not isinstance(value, str) or not value or len(value) > 128:
            return None
        return Tenant(value)

    def _claims(self, token: str) -> dict[str, Any] | None:
        try:
            kid = jwt.get_unverified_header(token).get("kid")
        except jwt.PyJWTError:
            return None
        for key in self.keys:
            if kid is not None and key.key_id not in (None, kid):
                continue
            try:
                claims: dict[str, Any] = jwt.decode(
                    token,
                    key,
                    algorithms=list(self.algorithms),
                    audience=self.audience,
                    issuer=self.issuer,
                    leeway=self.leeway_s,
                    options={"require": ["exp", "iss", "aud"]},
                )
            except jwt.PyJWTError:
                continue
            return claims
        return None

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> JwtVerifier | None:
        """The ``[auth_jwt]`` table, validated; None when it is empty.

        Raises:
            ConfigError: naming the bad or missing key.
        """
        if not table:
            return None
        unknown = sorted(set(table) - _KEYS)
        if unknown:
            raise ConfigError(f"auth_jwt.{unknown[0]}: unknown setting (known: {sorted(_KEYS)})")
        for required in ("issuer", "audience", "jwks_file"):
            if not isinstance(table.get(required), str) or not table[required]:
                raise ConfigError(f"auth_jwt.{required}: required (a non-empty string)")
        algorithms = tuple(table.get("algorithms", ("RS256", "ES256")))
        weak = [a for a in algorithms if a not in _ASYMMETRIC]
        if weak or not algorithms:
            known = ", ".join(sorted(_ASYMMETRIC))
            raise ConfigError(f"auth_jwt.algorithms: asymmetric algorithms only ({known})")
        leeway = table.get("leeway_s", 30.0)
        if isinstance(leeway, bool) or not isinstance(leeway, int | float) or leeway < 0:
            raise ConfigError("auth_jwt.leeway_s: expected seconds >= 0")
        return cls(
            issuer=table["issuer"],
            audience=table["audience"],
            jwks_file=table["jwks_file"],
            keys=_key_set(table["jwks_file"]),
            tenant_claim=str(table.get("tenant_claim", "tenant")),
            algorithms=algorithms,
            leeway_s=float(leeway),
        )


def _key_set(path: str) -> tuple[jwt.PyJWK, ...]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"auth_jwt.jwks_file: cannot read {path}: {error.strerror}") from None
    try:
        keys = tuple(jwt.PyJWKSet.from_json(text).keys)
    except (jwt.PyJWTError, ValueError) as error:
        raise ConfigError(f"auth_jwt.jwks_file: {path} is not a usable JWK set ({error})") from None
    return keys
