"""Bearer tokens and client identities: how credentials are configured, checked and rotated."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from compactd import config
from compactd.api.auth import REFUSAL, Credentials, hash_token
from compactd.api.server import RunningServer, create_server
from compactd.errors import ConfigError
from compactd.tenancy import Tenant
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import details
from tests.certs import Authority

TOKEN_A, TOKEN_B = "alpha-" + "1" * 30, "bravo-" + "2" * 30


def test_a_token_maps_to_its_tenant_by_its_digest_only() -> None:
    credentials = Credentials.from_settings(
        {"a": hash_token(TOKEN_A), "b": [f"sha256:{hash_token(TOKEN_B)}"]}, "", {}
    )

    assert credentials.tenant_of_token(TOKEN_A) == Tenant("a")
    assert credentials.tenant_of_token(TOKEN_B) == Tenant("b")
    assert credentials.tenant_of_token(TOKEN_A[:-1]) is None
    assert credentials.tenant_of_token("") is None
    assert all(TOKEN_A.encode() not in digest for digest, _ in credentials.token_digests)


def test_the_tokens_file_holds_tenant_and_digest_lines(tmp_path: Path) -> None:
    file = tmp_path / "tokens"
    file.write_text(
        f"# rotated monthly\na {hash_token(TOKEN_A)}\n\nb sha256:{hash_token(TOKEN_B)}\n"
    )

    credentials = Credentials.from_settings({}, str(file), {})

    assert credentials.tenant_of_token(TOKEN_B) == Tenant("b")
    assert credentials.enabled


@pytest.mark.parametrize(
    ("tokens", "line", "named"),
    [
        ({"a": TOKEN_A}, "", "auth_tokens.a[0]"),  # a raw token instead of its digest
        ({"bad tenant": hash_token(TOKEN_A)}, "", "auth_tokens.bad tenant"),
        ({}, f"a {TOKEN_A}", "tokens:1"),
        ({}, "only-one-word", "tokens:1"),
    ],
)
def test_a_bad_credential_entry_is_a_config_error_that_never_echoes_it(
    tokens: dict[str, str], line: str, named: str, tmp_path: Path
) -> None:
    file = tmp_path / "tokens"
    file.write_text(line)
    with pytest.raises(ConfigError, match=re.escape(named)) as caught:
        Credentials.from_settings(tokens, str(file) if line else "", {})
    assert TOKEN_A not in caught.value.message


def test_without_credentials_authentication_is_off() -> None:
    assert not Credentials.from_settings({}, "", {}).enabled


@pytest.fixture
async def tokened(
    server_config: config.ServerConfig, tmp_path: Path
) -> AsyncIterator[RunningServer]:
    """A loopback plaintext server whose tokens live in a file (reloaded on demand)."""
    file = tmp_path / "tokens"
    file.write_text(f"a {hash_token(TOKEN_A)}\n")
    running = await create_server(
        replace(server_config, auth_tokens_file=str(file), tls_reload_interval_s=0)
    )
    try:
        yield running
    finally:
        await running.stop(0)


async def _create(running: RunningServer, token: str | None, sid: str = "") -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    async with grpc.aio.insecure_channel(running.address) as channel:
        try:
            await SessionServiceStub(channel).CreateSession(
                pb.CreateSessionRequest(session_id=sid), metadata=metadata, timeout=10
            )
        except grpc.aio.AioRpcError as error:
            refusal = (error.code(), error.details())
        else:
            return grpc.StatusCode.OK
    assert refusal[1] == REFUSAL
    return refusal[0]


async def test_a_known_token_is_served_and_anything_else_is_unauthenticated(
    tokened: RunningServer,
) -> None:
    assert await _create(tokened, TOKEN_A) == grpc.StatusCode.OK
    for token in (None, "", TOKEN_B, TOKEN_A + "x", TOKEN_A[1:]):
        assert await _create(tokened, token) == grpc.StatusCode.UNAUTHENTICATED, token
    async with grpc.aio.insecure_channel(tokened.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await SessionServiceStub(channel).CreateSession(
                pb.CreateSessionRequest(), metadata=(("authorization", f"Basic {TOKEN_A}"),)
            )
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("second", [TOKEN_B, TOKEN_A])
async def test_a_call_with_more_than_one_authorization_header_is_refused(
    tokened: RunningServer, second: str
) -> None:
    """Two headers naming different tenants (or even one twice) never pick one: refused."""
    _rewrite(tokened, f"a {hash_token(TOKEN_A)}\nb {hash_token(TOKEN_B)}\n")
    assert await tokened.reload() is True
    headers = (("authorization", f"Bearer {TOKEN_A}"), ("authorization", f"Bearer {second}"))
    async with grpc.aio.insecure_channel(tokened.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await SessionServiceStub(channel).CreateSession(
                pb.CreateSessionRequest(), metadata=headers, timeout=10
            )
    refusal = details(caught.value)
    assert (refusal.code, refusal.reason) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "CREDENTIALS_INVALID",
    )
    assert refusal.message == REFUSAL


def _rewrite(running: RunningServer, text: str) -> None:
    Path(running.config.auth_tokens_file).write_text(text)


async def test_rotating_the_tokens_file_takes_effect_on_reload_without_a_restart(
    tokened: RunningServer,
) -> None:
    _rewrite(tokened, f"b {hash_token(TOKEN_B)}\n")

    assert await tokened.reload() is True

    assert await _create(tokened, TOKEN_B) == grpc.StatusCode.OK
    assert await _create(tokened, TOKEN_A) == grpc.StatusCode.UNAUTHENTICATED


async def test_a_broken_tokens_file_keeps_the_previous_tokens(tokened: RunningServer) -> None:
    _rewrite(tokened, f"a {TOKEN_A}\n")  # not a digest

    assert await tokened.reload() is False

    assert await _create(tokened, TOKEN_A) == grpc.StatusCode.OK


async def test_a_token_and_a_certificate_of_different_tenants_are_refused(
    server_config: config.ServerConfig, tmp_path: Path
) -> None:
    ca = Authority(tmp_path / "ca")
    issued = ca.server()
    running = await create_server(
        replace(
            server_config,
            tls_cert_file=str(issued.cert_file),
            tls_key_file=str(issued.key_file),
            tls_client_ca_file=str(ca.cert_file),
            auth_tokens={"b": hash_token(TOKEN_B)},
            auth_identities={"agent-a.example.org": "a"},
        )
    )
    try:
        agent = ca.client("agent", dns="agent-a.example.org")
        tls = grpc.ssl_channel_credentials(ca.cert, agent.key, agent.cert)
        mixed = grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(TOKEN_B))
        codes = []
        for credentials in (tls, mixed):
            async with grpc.aio.secure_channel(f"localhost:{running.port}", credentials) as ch:
                try:
                    await SessionServiceStub(ch).CreateSession(pb.CreateSessionRequest())
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
        assert codes == [grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED]  # DNS SAN -> a
    finally:
        await running.stop(0)
