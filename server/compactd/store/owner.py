"""One owner per store file: an exclusive lock beside the database, held while a store is open.

Two servers on one SQLite file would each fold their own copy of a session (stale reads, two
live brackets at once). Until replicas are real, the first process to open a store owns it: it
holds ``flock(LOCK_EX)`` on ``<database>.lock`` (which it stamps with its pid) until it closes
the store or dies, and every other opener fails at once with ``StartupError`` reason
``STORE_LOCKED`` naming the holder. The lock is advisory and per open file: a second open in the
same process is refused too. The lock file stays behind; only the lock matters.
"""

from __future__ import annotations

import fcntl
import os

from compactd.errors import StartupError
from compactd.reasons import Reason


class OwnerLock:
    """The exclusive lock on ``<database>.lock`` (``acquire`` / ``release``, idempotent)."""

    def __init__(self, database: str) -> None:
        self.path = f"{database}.lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise ``StartupError`` without waiting: ``STORE_LOCKED`` (another
        process holds it) or ``STORE_UNAVAILABLE`` (the lock file cannot be opened: a read-only
        file system, a folder the server may not write)."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:  # a read-only file system, a folder the server cannot write
            database = self.path.removesuffix(".lock")
            raise StartupError(
                f"cannot open the store sqlite:///{database}: its lock file {self.path}: "
                f"{error.strerror}",
                reason=Reason.STORE_UNAVAILABLE,
                metadata={"lock_file": self.path},
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StartupError(
                f"the store {self.path.removesuffix('.lock')} is already owned by another "
                f"compactd{holder}; one store has one owner: stop it or choose another --store",
                reason=Reason.STORE_LOCKED,
                metadata={"lock_file": self.path},
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Give the lock up (closing the file releases it)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""
