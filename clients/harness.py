"""One compactd server on loopback for the clients' scenario suites and the examples.

``LoopbackStack`` starts two OpenAI-compatible model servers on loopback
(``compactd.testing.openai_server``): ``agent`` answers the agent's steps (tests and examples may
script it), ``summarizer`` writes every compaction summary (its deterministic default answer),
so summary calls never consume the agent's script. It then writes a config routing both models
with small windows (so a few kilobytes of history reach pressure), and starts
``compactd serve`` as a subprocess on a free port (``--listen 127.0.0.1:0``, the bound address
read from its first line) with a temporary SQLite file. ``stop()`` sends SIGTERM and waits.

The suites learn the server from the environment :func:`LoopbackStack.environ` returns:

* ``COMPACTD_ADDRESS``: ``127.0.0.1:PORT`` of compactd.
* ``COMPACTD_PROVIDER`` / ``COMPACTD_MODEL``: the agent route (window
  :data:`AGENT_WINDOW`), to log in ``request/header``.
* ``COMPACTD_AGENT_BASE_URL``: the agent model's ``/v1`` endpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from compactd.testing.openai_server import OpenAICompatServer

PROVIDER = "loopback"
AGENT_MODEL = "agent-12k"
SUMMARY_MODEL = "summarizer-64k"
#: The agent route's context window W, max output O and headroom B: the trigger is
#: floor(min(W * 0.8, W - O - B)) = 9830 tokens, the retained tail 0.16 * (W - O) = 1802.
AGENT_WINDOW = 12288
AGENT_OUTPUT = 1024
AGENT_HEADROOM = 1024
_READY = re.compile(r"compactd listening on (\S+)")
_START_TIMEOUT_S = 60.0


def config_toml(agent_base_url: str, summarizer_base_url: str) -> str:
    """The server configuration: two loopback routes and the summary target."""
    return f"""\
[compaction]
summarizationProvider = "{PROVIDER}"
summarizationModel = "{SUMMARY_MODEL}"

[[compaction.modelPolicies]]
provider = "{PROVIDER}"
model = "{AGENT_MODEL}"
headroomTokens = {AGENT_HEADROOM}
maxTokens = 1024

[[compaction.modelPolicies]]
provider = "{PROVIDER}"
model = "{SUMMARY_MODEL}"
headroomTokens = 4096
maxTokens = 2048

[[routes]]
provider = "{PROVIDER}"
model = "{AGENT_MODEL}"
context_window = {AGENT_WINDOW}
max_output_tokens = {AGENT_OUTPUT}
protocol = "openai"
base_url = "{agent_base_url}"

[[routes]]
provider = "{PROVIDER}"
model = "{SUMMARY_MODEL}"
context_window = 65536
max_output_tokens = 2048
protocol = "openai"
base_url = "{summarizer_base_url}"

[summarizer]
kind = "openai"
timeout_s = 30
max_attempts = 2
"""


@dataclass
class _Process:
    popen: subprocess.Popen[str]
    address: str
    log: list[str]
    pump: threading.Thread | None = None


class LoopbackStack:
    """compactd plus two loopback model servers, started together and stopped together.

    Attributes:
        agent: The agent model's server (script it with ``enqueue``).
        summarizer: The summarizer model's server.
        address: ``host:port`` of compactd, once started.
        workdir: Temporary directory holding the config and the SQLite file.
    """

    def __init__(self, *, python: str = sys.executable, keep_log: bool = False) -> None:
        self.agent = OpenAICompatServer()
        self.summarizer = OpenAICompatServer()
        self.address = ""
        self._python = python
        self._keep_log = keep_log
        self._tmp = tempfile.TemporaryDirectory(prefix="compactd-clients-")
        self.workdir = Path(self._tmp.name)
        self._process: _Process | None = None

    def start(self) -> LoopbackStack:
        """Starts the model servers, then compactd; returns once compactd accepts calls."""
        self.agent.start()
        self.summarizer.start()
        config = self.workdir / "compactd.toml"
        config.write_text(config_toml(self.agent.base_url, self.summarizer.base_url))
        store = f"sqlite:///{self.workdir / 'compactd.db'}"
        command = [self._python, "-m", "compactd", "serve", "--listen", "127.0.0.1:0",
                   "--store", store, "--config", str(config), "--log-format", "text",
                   "--log-level", "WARNING"]  # fmt: skip
        popen = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self._process = _Process(popen, "", [])
        self.address = self._await_address(popen)
        return self

    def _await_address(self, popen: subprocess.Popen[str]) -> str:
        assert popen.stdout is not None
        assert self._process is not None
        found: list[str] = []
        ready = threading.Event()
        self._process.pump = threading.Thread(
            target=_pump, args=(popen.stdout, self._process.log, found, ready), daemon=True
        )
        self._process.pump.start()
        if not ready.wait(_START_TIMEOUT_S) or not found:
            self.stop()
            raise RuntimeError("compactd did not start:\n" + "".join(self._process.log))
        return found[0]

    def environ(self) -> dict[str, str]:
        """The environment the suites read (see the module docstring), over ``os.environ``."""
        env = dict(os.environ)
        env.update(
            COMPACTD_ADDRESS=self.address,
            COMPACTD_PROVIDER=PROVIDER,
            COMPACTD_MODEL=AGENT_MODEL,
            COMPACTD_AGENT_BASE_URL=self.agent.base_url,
        )
        return env

    @property
    def server_log(self) -> str:
        """What compactd printed so far."""
        return "".join(self._process.log) if self._process else ""

    def stop(self) -> None:
        """SIGTERM compactd (graceful shutdown), then stop the model servers."""
        if self._process is not None:
            popen = self._process.popen
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
                try:
                    popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait()
            if self._process.pump is not None:
                self._process.pump.join(timeout=10)  # at the end of the output
            if popen.stdout is not None:
                popen.stdout.close()
            self._process = None
        self.agent.stop()
        self.summarizer.stop()
        with contextlib.suppress(OSError):
            self._tmp.cleanup()

    def __enter__(self) -> LoopbackStack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _pump(stream: IO[str], log: list[str], found: list[str], ready: threading.Event) -> None:
    """Copies compactd's output into ``log``; signals once the listening line appears."""
    for line in stream:
        log.append(line)
        match = _READY.search(line)
        if match and not found:
            found.append(match.group(1))
            ready.set()
    ready.set()  # the process ended: wake the waiter either way


@contextlib.contextmanager
def running() -> Iterator[LoopbackStack]:
    """``with running() as stack:`` a started stack, stopped on exit."""
    stack = LoopbackStack().start()
    try:
        yield stack
    finally:
        stack.stop()
