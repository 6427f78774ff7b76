"""The secure configuration of docs/security.md runs as written: with its paths pointed at files
the test makes, it starts a server that serves health in plaintext, refuses a caller without
credentials, and admits a token's tenant and a certificate's, each held to the quota."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from compactd import config
from compactd.api.auth import hash_token
from compactd.api.server import create_server
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.certs import Authority

PAGE = Path(__file__).resolve().parents[1] / "docs" / "security.md"
SPIFFE_ID = "spiffe://example.org/ns/agents/sa/runner"


def _secure_toml() -> str:
    text = PAGE.read_text(encoding="utf-8")
    section = text.split("## Secure configuration", 1)[1]
    match = re.search(r"```toml\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the secure configuration section has no TOML block"
    return match.group(1)


def test_the_secure_configuration_is_ten_lines() -> None:
    assert len(_secure_toml().splitlines()) <= 10


async def test_the_secure_configuration_serves_tenants_over_mutual_tls(tmp_path: Path) -> None:
    ca = Authority(tmp_path / "pki")
    server_pem, agent = ca.server(), ca.client("agent", spiffe_id=SPIFFE_ID)
    builder = ca.client("builder")  # a certificate of the CA naming no tenant: its token does
    tokens = tmp_path / "tokens"
    tokens.write_text(f"builds {hash_token('builds-token-0123456789')}\n")
    toml = (
        _secure_toml()
        .replace("0.0.0.0:50051", "127.0.0.1:0")
        .replace("0.0.0.0:8081", "127.0.0.1:0")
        .replace("/run/secrets/tls/tls.crt", str(server_pem.cert_file))
        .replace("/run/secrets/tls/tls.key", str(server_pem.key_file))
        .replace("/run/secrets/tls/ca.crt", str(ca.cert_file))
        .replace("/run/secrets/compactd/tokens", str(tokens))
    )
    path = tmp_path / "compactd.toml"
    path.write_text(toml)
    settings = config.load(path, environ={}, overrides={"store": f"sqlite:///{tmp_path / 'c.db'}"})
    running = await create_server(settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.health_port}") as plain:
            reply = await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        credentials = grpc.ssl_channel_credentials(ca.cert, agent.key, agent.cert)
        async with grpc.aio.secure_channel(f"localhost:{running.port}", credentials) as channel:
            sessions = SessionServiceStub(channel)
            by_certificate = await sessions.CreateSession(pb.CreateSessionRequest(session_id="a"))
            assert by_certificate.session.session_id == "a"
        credentials = grpc.ssl_channel_credentials(ca.cert, builder.key, builder.cert)
        async with grpc.aio.secure_channel(f"localhost:{running.port}", credentials) as channel:
            sessions = SessionServiceStub(channel)
            token = (("authorization", "Bearer builds-token-0123456789"),)
            await sessions.CreateSession(pb.CreateSessionRequest(session_id="a"), metadata=token)
            listed = await sessions.ListSessions(pb.ListSessionsRequest(), metadata=token)
            assert [s.session_id for s in listed.sessions] == ["a"]  # the builds tenant's own
            bad = (("authorization", "Bearer wrong"),)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await sessions.ListSessions(pb.ListSessionsRequest(), metadata=bad)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await running.stop(0)
    assert running.quotas is not None
    assert running.quotas.ledger.limits("agents").appends_per_second == 50
