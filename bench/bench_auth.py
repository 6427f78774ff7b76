"""What TLS and authentication cost per RPC, side by side with plaintext, in one run.

Five servers in this process, each with the real settings of one deployment (certificates made
for the run by the ``cryptography`` package in a temporary folder):

- ``plaintext``: no TLS, authentication off (the reference);
- ``plaintext + bearer``: ``auth_tokens`` (the token's SHA-256), the token in ``authorization``;
- ``TLS``: ``tls_cert_file`` / ``tls_key_file``, authentication off;
- ``TLS + bearer``: TLS and ``auth_tokens``;
- ``mTLS + identity``: ``tls_client_ca_file`` and ``auth_identities`` (the client's SPIFFE ID).

Each client keeps one channel (a connection reused, as real clients do) and calls
``CheckPressure`` on a small session of its tenant. The servers are measured batch by batch,
in an order that rotates each round, so every figure sees the same machine, heap and load; each
row is every call of every round. A second table times what a new connection costs (channel,
handshake and the first call), interleaved the same way.

    python bench/bench_auth.py [--rounds 20] [--calls 200] [--connects 10]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import ipaddress
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from compactd import config
from compactd.api.auth import hash_token
from compactd.api.server import RunningServer, create_server
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub

ROUTE = {"provider": "local", "model": "w128k", "context_window": 128_000}
TOKEN = "bench-token-4f1c9a7e2b6d8053"
SPIFFE_ID = "spiffe://bench.example/agent"
TENANT = "bench"


# ---- certificates ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """PEM files of a CA, a server certificate (localhost, 127.0.0.1) and a client one."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: bytes
    client_key: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    names: Sequence[x509.GeneralName] = (),
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, signer = issuer if issuer is not None else (name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(signer, hashes.SHA256())


def make_pki(folder: Path) -> Pki:
    """A CA and the certificates it signs, written under ``folder``."""
    ca_key = _key()
    ca = _certificate("bench CA", ca_key, None)
    issuer = (ca.subject, ca_key)
    server_key, client_key = _key(), _key()
    server = _certificate(
        "localhost",
        server_key,
        issuer,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client = _certificate("agent", client_key, issuer, [x509.UniformResourceIdentifier(SPIFFE_ID)])
    pem = serialization.Encoding.PEM
    paths = {"ca.pem": ca.public_bytes(pem), "server.pem": server.public_bytes(pem),
             "server.key": _pem_key(server_key)}  # fmt: skip
    for name, data in paths.items():
        (folder / name).write_bytes(data)
    return Pki(
        folder / "ca.pem",
        folder / "server.pem",
        folder / "server.key",
        client.public_bytes(pem),
        _pem_key(client_key),
    )


# ---- the deployments ---------------------------------------------------------------------------


@dataclass
class Deployment:
    """One server configuration and a client of it."""

    name: str
    settings: dict[str, Any]
    tls: bool = False
    mutual: bool = False
    bearer: bool = False
    server: RunningServer | None = None
    channel: grpc.aio.Channel | None = None
    session_id: str = ""
    calls: list[float] = field(default_factory=list)
    connects: list[float] = field(default_factory=list)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKEN}"),) if self.bearer else ()

    def open_channel(self, pki: Pki) -> grpc.aio.Channel:
        assert self.server is not None
        address = self.server.address
        if not self.tls:
            return grpc.aio.insecure_channel(address)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki.ca.read_bytes(),
            private_key=pki.client_key if self.mutual else None,
            certificate_chain=pki.client_cert if self.mutual else None,
        )
        return grpc.aio.secure_channel(address, credentials)


def deployments(pki: Pki) -> list[Deployment]:
    tls = {"tls_cert_file": str(pki.server_cert), "tls_key_file": str(pki.server_key)}
    tokens = {"auth_tokens": {TENANT: hash_token(TOKEN)}}
    mutual = {**tls, "tls_client_ca_file": str(pki.ca), "auth_identities": {SPIFFE_ID: TENANT}}
    return [
        Deployment("plaintext", {}),
        Deployment("plaintext + bearer", tokens, bearer=True),
        Deployment("TLS", tls, tls=True),
        Deployment("TLS + bearer", {**tls, **tokens}, tls=True, bearer=True),
        Deployment("mTLS + identity", mutual, tls=True, mutual=True),
    ]


async def start(deployment: Deployment, folder: Path, pki: Pki) -> None:
    base = config.load(
        None,
        environ={},
        overrides={
            "listen": "127.0.0.1:0",
            "store": f"sqlite:///{folder / (deployment.name.replace(' ', '_') + '.db')}",
        },
    )
    settings = dataclasses.replace(base, routes=(ROUTE,), **deployment.settings)
    config.check_transport(settings)
    deployment.server = await create_server(settings)
    deployment.channel = deployment.open_channel(pki)
    sessions = SessionServiceStub(deployment.channel)
    metadata = deployment.metadata
    created = await sessions.CreateSession(pb.CreateSessionRequest(), metadata=metadata)
    deployment.session_id = created.session.session_id
    header = events_pb2.RequestHeader(
        config=events_pb2.RequestConfig(provider="local", model="w128k")
    )
    events = [
        events_pb2.SessionEvent(system_message=events_pb2.SystemMessage(text="You help.")),
        events_pb2.SessionEvent(request_header=header),
    ]
    request = pb.AppendEventsRequest(session_id=deployment.session_id, events=events)
    await sessions.AppendEvents(request, metadata=metadata)


# ---- measuring ---------------------------------------------------------------------------------


async def batch(deployment: Deployment, calls: int) -> None:
    assert deployment.channel is not None
    stub = CompactionServiceStub(deployment.channel)
    request = cpb.CheckPressureRequest(session_id=deployment.session_id)
    metadata = deployment.metadata
    for _ in range(calls):
        started = time.perf_counter()
        await stub.CheckPressure(request, metadata=metadata)
        deployment.calls.append(time.perf_counter() - started)


async def connects(deployment: Deployment, pki: Pki, count: int) -> None:
    request = cpb.CheckPressureRequest(session_id=deployment.session_id)
    for _ in range(count):
        started = time.perf_counter()
        channel = deployment.open_channel(pki)
        await CompactionServiceStub(channel).CheckPressure(request, metadata=deployment.metadata)
        deployment.connects.append(time.perf_counter() - started)
        await channel.close(None)


async def interleaved(
    all_: list[Deployment], rounds: int, step: Callable[[Deployment], Any]
) -> None:
    for round_ in range(rounds):
        shift = round_ % len(all_)
        for deployment in all_[shift:] + all_[:shift]:
            await step(deployment)


def _p(samples: Sequence[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q * 100) - 1]


def table(title: str, all_: list[Deployment], pick: Callable[[Deployment], list[float]]) -> None:
    reference = pick(all_[0])
    base_mean, base_p50 = statistics.fmean(reference), statistics.median(reference)
    print(f"\n{title}")
    print("| server | calls | mean | p50 | p99 | mean / plaintext | p50 / plaintext |")
    print("|---|---|---|---|---|---|---|")
    for deployment in all_:
        times = pick(deployment)
        mean, p50, p99 = statistics.fmean(times), statistics.median(times), _p(times, 0.99)
        cells = [deployment.name, str(len(times))]
        cells += [f"{value * 1e3:.3f} ms" for value in (mean, p50, p99)]
        cells += [f"{mean / base_mean:.2f}x", f"{p50 / base_p50:.2f}x"]
        print("| " + " | ".join(cells) + " |")


async def run(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bench-auth-"))
    pki = make_pki(folder)
    all_ = deployments(pki)
    try:
        for deployment in all_:
            await start(deployment, folder, pki)
        await interleaved(all_, 2, lambda d: batch(d, 50))  # warm up every server and channel
        for deployment in all_:
            deployment.calls.clear()
        await interleaved(all_, args.rounds, lambda d: batch(d, args.calls))
        await interleaved(all_, args.connects, lambda d: connects(d, pki, 1))
    finally:
        for deployment in all_:
            if deployment.channel is not None:
                await deployment.channel.close(None)
            if deployment.server is not None:
                await deployment.server.stop(0)
    table(
        f"CheckPressure per RPC on a kept connection ({args.rounds} interleaved rounds of "
        f"{args.calls} calls per server)",
        all_,
        lambda d: d.calls,
    )
    table(
        f"A new connection: channel, handshake and the first CheckPressure ({args.connects} "
        "interleaved rounds)",
        all_,
        lambda d: d.connects,
    )
    print("\ngoal: TLS + bearer (and mTLS + identity) at most 1.2x plaintext per RPC")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--calls", type=int, default=200, help="calls per server per round")
    parser.add_argument("--connects", type=int, default=10, help="new connections per server")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
