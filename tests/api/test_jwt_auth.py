"""JWTs of an identity provider: signature by the JWKS file, issuer, audience, expiry, tenant."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from compactd import config
from compactd.api.jwt_auth import JwtVerifier
from compactd.api.server import create_server
from compactd.errors import ConfigError
from compactd.tenancy import Tenant
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub

ISSUER, AUDIENCE = "https://idp.example.org", "compactd"


class Provider:
    """An identity provider: one RSA key, published as a JWKS file."""

    def __init__(self, folder: Path, kid: str = "k1") -> None:
        self.kid = kid
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.jwks_file = folder / "jwks.json"
        self.publish()

    def publish(self) -> None:
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        public.update(kid=self.kid, use="sig", alg="RS256")
        self.jwks_file.write_text(json.dumps({"keys": [public]}))

    def token(self, **claims: Any) -> str:
        body = {"iss": ISSUER, "aud": AUDIENCE, "exp": int(time.time()) + 300, "tenant": "a"}
        body.update(claims)
        return jwt.encode(body, self.key, algorithm="RS256", headers={"kid": self.kid})

    def table(self, **more: Any) -> dict[str, Any]:
        return {"issuer": ISSUER, "audience": AUDIENCE, "jwks_file": str(self.jwks_file), **more}


@pytest.fixture
def idp(tmp_path: Path) -> Provider:
    return Provider(tmp_path)


def _verifier(table: Mapping[str, Any]) -> JwtVerifier:
    verifier = JwtVerifier.from_table(table)
    assert verifier is not None
    return verifier


def test_a_valid_token_names_its_tenant(idp: Provider) -> None:
    assert _verifier(idp.table()).tenant_of(idp.token()) == Tenant("a")
    assert _verifier(idp.table(tenant_claim="org")).tenant_of(idp.token(org="b")) == Tenant("b")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _hs256_keyed_by(secret: bytes, claims: dict[str, Any]) -> str:
    """A token signed with HMAC over ``secret``: the classic algorithm-confusion forgery."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    body = _b64(json.dumps(claims).encode())
    mac = hmac.new(secret, f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{_b64(mac)}"


def test_tokens_that_fail_any_check_name_no_tenant(idp: Provider, tmp_path: Path) -> None:
    verifier = _verifier(idp.table())
    (tmp_path / "stranger").mkdir()
    stranger = Provider(tmp_path / "stranger")
    public_pem = idp.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    claims = {"iss": ISSUER, "aud": AUDIENCE, "exp": int(time.time()) + 60, "tenant": "a"}
    rejected = {
        "expired": idp.token(exp=int(time.time()) - 3600),
        "another audience": idp.token(aud="someone-else"),
        "another issuer": idp.token(iss="https://evil.example.org"),
        "no tenant claim": idp.token(tenant=None),
        "another key": stranger.token(),
        "unsigned": jwt.encode(claims, None, "none"),
        "HS256 keyed by the public key": _hs256_keyed_by(public_pem, claims),
        "garbage": "a.b.c",
    }
    for why, token in rejected.items():
        assert verifier.tenant_of(token) is None, why


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"issuer": ""}, "auth_jwt.issuer"),
        ({"algorithms": ["HS256"]}, "auth_jwt.algorithms"),
        ({"jwks_file": "/nowhere/jwks.json"}, "auth_jwt.jwks_file"),
        ({"audiences": "x"}, "auth_jwt.audiences"),
    ],
)
def test_a_bad_jwt_table_is_a_config_error_naming_the_key(
    idp: Provider, change: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        JwtVerifier.from_table(idp.table(**change))


async def _create(address: str, token: str) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await SessionServiceStub(channel).CreateSession(
                pb.CreateSessionRequest(session_id="s"), metadata=metadata, timeout=10
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_a_server_accepts_the_providers_tokens_and_follows_its_key_rotation(
    server_config: config.ServerConfig, idp: Provider
) -> None:
    settings = replace(server_config, auth_jwt=idp.table(), tls_reload_interval_s=0)
    running = await create_server(settings)
    try:
        assert await _create(running.address, idp.token()) == grpc.StatusCode.OK
        assert await _create(running.address, idp.token(aud="x")) == grpc.StatusCode.UNAUTHENTICATED
        assert [r.session_id for r in await running.manager.list(tenant=Tenant("a"))] == ["s"]

        old = idp.token(tenant="b")
        idp.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        idp.publish()
        assert await running.reload() is True
        assert await _create(running.address, old) == grpc.StatusCode.UNAUTHENTICATED
        assert await _create(running.address, idp.token(tenant="b")) == grpc.StatusCode.OK
    finally:
        await running.stop(0)
