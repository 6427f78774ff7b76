"""Certificates the tests make: a CA, a server certificate for localhost, client certificates.

Each is written as PEM files under a folder the test owns, so the server reads them as it reads
a deployment's (and a test can overwrite them to rotate).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pem:
    """A certificate and its key, as PEM bytes and as files."""

    cert: bytes
    key: bytes
    cert_file: Path
    key_file: Path


class Authority:
    """A throwaway certificate authority that signs server and client certificates."""

    def __init__(self, folder: Path, name: str = "compactd test CA") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            _builder(self._name, self._name, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = cert.public_bytes(serialization.Encoding.PEM)
        self.cert_file = folder / f"{name.replace(' ', '-')}.pem"
        self.cert_file.write_bytes(self.cert)

    def server(self, stem: str = "server") -> Pem:
        """A certificate for ``localhost`` and 127.0.0.1."""
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        return self._issue(stem, "localhost", names)

    def client(self, stem: str, *, spiffe_id: str = "", dns: str = "") -> Pem:
        """A client certificate whose SANs are the given SPIFFE ID (a URI) and DNS name."""
        names: list[x509.GeneralName] = []
        if spiffe_id:
            names.append(x509.UniformResourceIdentifier(spiffe_id))
        if dns:
            names.append(x509.DNSName(dns))
        return self._issue(stem, stem, names)

    def _issue(self, stem: str, common_name: str, names: list[x509.GeneralName]) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        builder = _builder(subject, self._name, key.public_key())
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        cert_file, key_file = self.folder / f"{stem}.pem", self.folder / f"{stem}.key"
        cert_file.write_bytes(cert)
        key_file.write_bytes(key_pem)
        return Pem(cert, key_pem, cert_file, key_file)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
