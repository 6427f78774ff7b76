"""TLS and mutual TLS on the listener, with certificates the tests make; rotation, no restart."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from compactd import config
from compactd.api.server import RunningServer, create_server
from compactd.errors import ConfigError
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.certs import Authority, Pem

Credentials = Callable[[], grpc.ChannelCredentials]


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path / "ca")


@pytest.fixture
def served(ca: Authority, tmp_path: Path) -> Pem:
    """The server's certificate, copied to the paths the configuration names."""
    issued = ca.server()
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(issued.cert_file, live / "tls.crt")
    shutil.copy(issued.key_file, live / "tls.key")
    return Pem(issued.cert, issued.key, live / "tls.crt", live / "tls.key")


def _tls_config(base: config.ServerConfig, served: Pem, **more: object) -> config.ServerConfig:
    return replace(
        base, tls_cert_file=str(served.cert_file), tls_key_file=str(served.key_file), **more
    )


@pytest.fixture
async def tls_server(
    server_config: config.ServerConfig, served: Pem
) -> AsyncIterator[RunningServer]:
    running = await create_server(_tls_config(server_config, served, tls_reload_interval_s=0))
    try:
        yield running
    finally:
        await running.stop(0)


async def _create(credentials: grpc.ChannelCredentials, port: int, sid: str = "") -> str:
    async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
        reply = await SessionServiceStub(channel).CreateSession(
            pb.CreateSessionRequest(session_id=sid), timeout=10
        )
    return reply.session.session_id


async def _refused(credentials: grpc.ChannelCredentials, port: int) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _create(credentials, port)
    return caught.value.code()


async def test_a_tls_listener_serves_a_client_that_trusts_its_ca(
    tls_server: RunningServer, ca: Authority
) -> None:
    assert await _create(grpc.ssl_channel_credentials(ca.cert), tls_server.port, "over-tls")


async def test_a_tls_listener_refuses_plaintext_and_an_untrusted_client(
    tls_server: RunningServer, tmp_path: Path
) -> None:
    stranger = Authority(tmp_path / "other", "another CA")
    assert await _refused(grpc.ssl_channel_credentials(stranger.cert), tls_server.port) == (
        grpc.StatusCode.UNAVAILABLE
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tls_server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await SessionServiceStub(channel).CreateSession(pb.CreateSessionRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_admits_only_clients_with_a_certificate_its_ca_signed(
    server_config: config.ServerConfig, served: Pem, ca: Authority, tmp_path: Path
) -> None:
    settings = _tls_config(server_config, served, tls_client_ca_file=str(ca.cert_file))
    running = await create_server(settings)
    try:
        agent = ca.client("agent", spiffe_id="spiffe://example.org/agent")
        good = grpc.ssl_channel_credentials(ca.cert, agent.key, agent.cert)
        assert await _create(good, running.port)
        no_cert = grpc.ssl_channel_credentials(ca.cert)
        assert await _refused(no_cert, running.port) == grpc.StatusCode.UNAVAILABLE
        forged = Authority(tmp_path / "forger", "forger CA").client("forged")
        foreign = grpc.ssl_channel_credentials(ca.cert, forged.key, forged.cert)
        assert await _refused(foreign, running.port) == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(0)


def _rotate(served: Pem, to: Pem) -> None:
    # Write aside and rename, as Kubernetes swaps a secret's files.
    for source, target in ((to.cert_file, served.cert_file), (to.key_file, served.key_file)):
        aside = target.with_suffix(".new")
        shutil.copy(source, aside)
        aside.replace(target)


async def test_a_reload_rotates_the_certificate_without_a_restart(
    tls_server: RunningServer, served: Pem, ca: Authority, tmp_path: Path
) -> None:
    successor = Authority(tmp_path / "next", "next CA")
    old_trust = grpc.ssl_channel_credentials(ca.cert)
    async with grpc.aio.secure_channel(f"localhost:{tls_server.port}", old_trust) as kept:
        stub = SessionServiceStub(kept)
        await stub.CreateSession(pb.CreateSessionRequest(session_id="before"), timeout=10)

        _rotate(served, successor.server("rotated"))
        assert await tls_server.reload() is True
        assert await tls_server.reload() is False  # unchanged files: nothing to do

        new_trust = grpc.ssl_channel_credentials(successor.cert)
        assert await _create(new_trust, tls_server.port, "after") == "after"
        assert await _refused(old_trust, tls_server.port) == grpc.StatusCode.UNAVAILABLE
        # A connection made before the rotation keeps working on its certificate.
        await stub.GetSurface(pb.GetSurfaceRequest(session_id="after"), timeout=10)


async def test_a_changed_file_is_picked_up_by_polling(
    server_config: config.ServerConfig, served: Pem, tmp_path: Path
) -> None:
    running = await create_server(_tls_config(server_config, served, tls_reload_interval_s=0.05))
    try:
        successor = Authority(tmp_path / "next", "next CA")
        _rotate(served, successor.server("rotated"))
        trust = grpc.ssl_channel_credentials(successor.cert)
        for _ in range(200):
            try:
                await _create(trust, running.port)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("the rotated certificate was never served")
    finally:
        await running.stop(0)


async def test_a_broken_new_file_keeps_the_previous_certificate(
    tls_server: RunningServer, served: Pem, ca: Authority
) -> None:
    served.cert_file.write_bytes(b"half-written")

    assert await tls_server.reload() is False
    assert await _create(grpc.ssl_channel_credentials(ca.cert), tls_server.port)


async def test_the_health_only_listener_answers_probes_in_plaintext(
    server_config: config.ServerConfig, served: Pem
) -> None:
    running = await create_server(_tls_config(server_config, served, health_listen="127.0.0.1:0"))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.health_port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="compactd.v1.SessionService"), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await SessionServiceStub(channel).CreateSession(pb.CreateSessionRequest())
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await running.stop(0)


async def test_the_start_up_log_names_the_addresses_the_listeners_bound(
    server_config: config.ServerConfig, served: Pem, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="compactd.api.server"):
        running = await create_server(
            _tls_config(server_config, served, health_listen="127.0.0.1:0")
        )
    try:
        (security,) = [r for r in caplog.records if r.getMessage() == "listener security"]
        assert security.listen == running.address  # type: ignore[attr-defined]
        assert not running.address.endswith(":0")
        assert security.health_listen == f"127.0.0.1:{running.health_port}"  # type: ignore[attr-defined]
    finally:
        await running.stop(0)


def test_a_missing_certificate_file_is_a_config_error_naming_it(
    server_config: config.ServerConfig, tmp_path: Path
) -> None:
    missing = replace(
        server_config,
        tls_cert_file=str(tmp_path / "nope.crt"),
        tls_key_file=str(tmp_path / "nope.key"),
    )
    with pytest.raises(ConfigError, match="tls_cert_file"):
        asyncio.run(create_server(missing))


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"listen": "0.0.0.0:50051"}, "insecure_plaintext"),
        ({"tls_cert_file": "/c.pem"}, "tls_key_file"),
        ({"tls_client_ca_file": "/ca.pem"}, "tls_client_ca_file"),
        ({"auth_identities": {"spiffe://x/y": "a"}}, "auth_identities"),
    ],
)
def test_unsafe_or_incomplete_transport_settings_are_refused(
    settings: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        config.load(None, environ={}, overrides=settings)


def test_plaintext_off_loopback_starts_only_when_asked_for() -> None:
    environ = {"COMPACTD_LISTEN": "0.0.0.0:50051", "COMPACTD_INSECURE_PLAINTEXT": "true"}
    assert config.load(None, environ=environ).insecure_plaintext is True


async def test_the_start_up_log_says_how_the_listener_is_protected(
    server_config: config.ServerConfig, served: Pem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="compactd.api.server")
    plain = replace(server_config, listen="0.0.0.0:0", insecure_plaintext=True)
    for settings in (plain, _tls_config(server_config, served)):
        running = await create_server(settings)
        await running.stop(0)

    said = [(r.levelno, getattr(r, "transport", None)) for r in caplog.records
            if getattr(r, "transport", None)]  # fmt: skip
    assert said == [(logging.WARNING, "plaintext"), (logging.INFO, "TLS")]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "insecure_plaintext" in warning.getMessage()
