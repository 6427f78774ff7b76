"""`compactd serve` over TLS as a real process: SIGHUP rotates the certificate, no restart."""

from __future__ import annotations

import asyncio
import shutil
import signal
from pathlib import Path

import grpc

from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.certs import Authority
from tests.processes import serving


async def _creates(trust: bytes, port: str) -> bool:
    credentials = grpc.ssl_channel_credentials(trust)
    async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
        try:
            await SessionServiceStub(channel).CreateSession(pb.CreateSessionRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
    return True


async def test_sighup_reloads_the_certificate_of_a_running_server(tmp_path: Path) -> None:
    first, second = Authority(tmp_path / "one", "first CA"), Authority(tmp_path / "two", "CA 2")
    old, new = first.server("old"), second.server("new")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(old.cert_file, cert)
    shutil.copy(old.key_file, key)
    settings = tmp_path / "compactd.toml"
    settings.write_text(
        f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\ntls_reload_interval_s = 0\n'
    )

    with serving(tmp_path / "e.db", "--config", str(settings)) as (proc, address, output):
        port = address.rpartition(":")[2]
        assert await _creates(first.cert, port)
        shutil.copy(new.cert_file, cert)
        shutil.copy(new.key_file, key)
        assert not await _creates(second.cert, port)  # no polling: nothing changed yet

        proc.send_signal(signal.SIGHUP)
        for _ in range(100):
            if await _creates(second.cert, port):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the certificate was not reloaded on SIGHUP")
        assert proc.poll() is None  # the same process
        proc.terminate()
        proc.wait(timeout=30)
    log = output.text()
    assert "TLS certificate reloaded" in log
    assert "listener security" in log
