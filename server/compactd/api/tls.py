"""TLS on the listener, with certificates that rotate without a restart.

``ServerTls`` serves the PEM files named by ``tls_cert_file``/``tls_key_file`` (and, for mutual
TLS, requires client certificates signed by ``tls_client_ca_file``) through gRPC's dynamic
server credentials: gRPC asks ``ServerTls`` for the certificate configuration at each new
handshake, and gets a new one only after ``reload`` saw the files change. Connections already
open keep the certificate they were made with; new ones get the new. A reload that finds a
broken or half-written file keeps serving the previous certificate and says so in the log.

``Reloader`` runs every reload: on SIGHUP at once (``trigger``), and every
``tls_reload_interval_s`` (Kubernetes and cert-manager swap secret files in place; nothing
signals the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from compactd.config import ServerConfig
from compactd.errors import CompactdError, ConfigError

log = logging.getLogger(__name__)

_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PRIVATE_KEY = b"PRIVATE KEY-----"


@dataclass(frozen=True)
class _Files:
    """The PEM bytes of one certificate configuration."""

    cert: bytes
    key: bytes
    client_ca: bytes | None


class ServerTls:
    """The listener's certificate configuration, replaced when its files change.

    Raises (on construction):
        ConfigError: A file is missing, unreadable or not PEM of the right kind.
    """

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "") -> None:
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self._lock = threading.Lock()  # gRPC calls ``_fetch`` from its own threads
        self._files = self._read()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.reloads = 0  # configurations handed to gRPC after the first (for tests and logs)

    @classmethod
    def from_config(cls, config: ServerConfig) -> ServerTls | None:
        """The TLS of ``config``; None when it serves plaintext."""
        if not config.tls_cert_file:
            return None
        return cls(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate."""
        return bool(self.client_ca_file)

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that fetch the current configuration at each handshake."""
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self._files),
            self._fetch,  # type: ignore[arg-type]  # the stubs omit "None: unchanged"
            require_client_authentication=self.mutual,
        )

    def reload(self) -> bool:
        """Re-read the files; True when they changed and the next handshakes use them.

        A file that cannot be used leaves the current configuration in place (logged).
        """
        try:
            files = self._read()
        except ConfigError as error:
            log.warning("TLS files not reloaded, serving the previous ones: %s", error.message)
            return False
        with self._lock:
            if files == self._files:
                return False
            self._files = files
            self._pending = _configuration(files)
        log.info("TLS certificate reloaded", extra={"tls_cert_file": self.cert_file})
        return True

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # None keeps gRPC's current configuration: a new one only once per change.
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is not None:
                self.reloads += 1
            return pending

    def _read(self) -> _Files:
        cert = _pem(self.cert_file, "tls_cert_file", _CERTIFICATE)
        key = _pem(self.key_file, "tls_key_file", _PRIVATE_KEY)
        ca = _pem(self.client_ca_file, "tls_client_ca_file", _CERTIFICATE) if self.mutual else None
        return _Files(cert, key, ca)


def _configuration(files: _Files) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(files.key, files.cert)], root_certificates=files.client_ca
    )


def _pem(path: str, setting: str, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{setting}: cannot read {path}: {error.strerror}") from None
    if marker not in data:
        kind = "certificate" if marker == _CERTIFICATE else "private key"
        raise ConfigError(f"{setting}: {path} holds no PEM {kind}")
    return data


# ---- reloading ---------------------------------------------------------------------------------

#: One reloadable thing: re-reads its files, answers whether anything changed.
Reload = Callable[[], bool]


class Reloader:
    """Runs ``reloads`` every ``interval_s`` (0: never by itself) and whenever triggered."""

    def __init__(self, reloads: Sequence[Reload], interval_s: float) -> None:
        self.reloads = list(reloads)
        self.interval_s = interval_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin polling (on the running loop)."""
        if self.reloads and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def trigger(self) -> None:
        """Reload now (SIGHUP)."""
        self._wake.set()

    async def reload_now(self) -> bool:
        """Run every reload once, off the loop; True if any changed."""
        return await asyncio.to_thread(self._reload_all)

    async def stop(self) -> None:
        """Stop polling."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _reload_all(self) -> bool:
        changed = False
        for reload in self.reloads:
            try:
                changed = reload() or changed
            except CompactdError as error:  # a bad new file: keep serving, say why
                log.warning("reload failed, keeping the previous settings: %s", error.message)
        return changed

    async def _run(self) -> None:
        timeout = self.interval_s or None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            await self.reload_now()
