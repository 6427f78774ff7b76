"""Running `compactd serve` as a real process in tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_LISTENING = re.compile(r"compactd listening on (\S+)")


class Output:
    """Lines a server process printed, drained by a thread so the pipe never fills."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.address = threading.Event()
        self._thread = threading.Thread(target=self._drain, args=(proc,), daemon=True)
        self._thread.start()

    def _drain(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)
            if _LISTENING.search(line):
                self.address.set()
        proc.stdout.close()

    def text(self) -> str:
        """Everything printed so far (call after the process exited for all of it)."""
        self._thread.join(timeout=30)
        return "".join(self.lines)


@contextmanager
def serving(db: Path, *options: str) -> Iterator[tuple[subprocess.Popen[str], str, Output]]:
    """Run `compactd serve` on a free port over ``db`` (plus ``options``).

    Yields the process, its address and its output; kills it on exit if it still runs. The
    environment's COMPACTD_* and OTEL_* variables are left out so the test decides everything.
    """
    with serving_store(f"sqlite:///{db}", *options) as served:
        yield served


@contextmanager
def serving_store(store: str, *options: str) -> Iterator[tuple[subprocess.Popen[str], str, Output]]:
    """``serving`` over any store URL (a PostgreSQL database several replicas share)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPACTD_", "OTEL_"))}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "compactd", "serve", *options),
            *("--listen", "127.0.0.1:0", "--store", store, "--log-format", "text"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    output = Output(proc)
    try:
        assert output.address.wait(timeout=60), "server did not start"
        match = _LISTENING.search("".join(output.lines))
        assert match is not None
        yield proc, match.group(1), output
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        output.text()
