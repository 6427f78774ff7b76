"""The service as a process: `compactd serve`, SIGKILL durability and SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from compactd.v1 import events_pb2 as ev
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.processes import serving


def _batch(n: int) -> list[ev.SessionEvent]:
    events = []
    for i in range(3):
        event = ev.SessionEvent(
            user_message=ev.UserMessage(content=[ev.ContentBlock(text=ev.TextBlock(text=f"{n}"))])
        )
        event.event_id = f"batch-{n}-{i}"
        events.append(event)
    return events


async def _append_until_killed(address: str, proc: subprocess.Popen[str]) -> dict[str, int]:
    acknowledged: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as chan:
        stub = SessionServiceStub(chan)
        await stub.CreateSession(pb.CreateSessionRequest(session_id="crash"))
        enough = asyncio.Event()

        async def writer(worker: int) -> None:
            n = 0
            while True:
                batch = _batch(worker * 100_000 + n)
                try:
                    reply = await stub.AppendEvents(
                        pb.AppendEventsRequest(session_id="crash", events=batch), timeout=10
                    )
                except grpc.aio.AioRpcError:
                    return
                acknowledged.update({e.event_id: s for e, s in zip(batch, reply.seqs, strict=True)})
                if len(acknowledged) >= 600:
                    enough.set()
                n += 1

        async def killer() -> None:
            await enough.wait()
            proc.send_signal(signal.SIGKILL)

        await asyncio.gather(killer(), *(writer(w) for w in range(4)))
    return acknowledged


async def _read_all(address: str) -> list[ev.SessionEvent]:
    async with grpc.aio.insecure_channel(address) as chan:
        stub = SessionServiceStub(chan)
        request = pb.ListEventsRequest(session_id="crash")
        return [r.event async for r in stub.ListEvents(request)]


async def test_sigkill_during_appends_loses_no_acknowledged_event(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    with serving(db) as (proc, address, _):
        acknowledged = await _append_until_killed(address, proc)
    assert len(acknowledged) >= 600
    with serving(db) as (_, address, _):
        events = await _read_all(address)
    stored = {e.event_id: e.seq for e in events if e.event_id}
    assert all(stored.get(eid) == seq for eid, seq in acknowledged.items())
    assert [e.seq for e in events] == list(range(len(events)))
    batches: dict[str, int] = {}
    for event_id in stored:
        key = event_id.rsplit("-", 1)[0]
        batches[key] = batches.get(key, 0) + 1
    assert set(batches.values()) == {3}, "a batch was half written"
    assert events[-1].WhichOneof("body") == "session_end_seed"


def test_sigterm_shuts_down_gracefully(tmp_path: Path) -> None:
    with serving(tmp_path / "term.db") as (proc, _, output):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert "stopped" in output.text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--listen", "nowhere"], "listen: expected HOST:PORT"),
        (["serve", "--store", "mysql://x"], "store: expected sqlite:///PATH"),
    ],
)
def test_bad_settings_fail_at_start_naming_the_key(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "compactd", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert message in result.stderr


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    """`compactd serve` that is expected to refuse to start (it exits on its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPACTD_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-m", "compactd", "serve", "--log-format", "text", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_a_second_server_on_a_port_in_use_refuses_to_start(tmp_path: Path) -> None:
    with serving(tmp_path / "first.db") as (first, address, _):
        second = _serve("--listen", address, "--store", f"sqlite:///{tmp_path / 'second.db'}")
        assert first.poll() is None  # the first one keeps serving alone
    assert second.returncode == 3
    assert f"cannot start: cannot listen on {address}" in second.stderr
    assert "Traceback" not in second.stderr + second.stdout


def test_a_second_server_on_the_same_store_refuses_to_start(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    with serving(db) as (first, _, _):
        second = _serve("--listen", "127.0.0.1:0", "--store", f"sqlite:///{db}")
        assert first.poll() is None
    assert second.returncode == 3
    assert f"the store {db} is already owned by another compactd (pid {first.pid})" in second.stderr
    assert "Traceback" not in second.stderr + second.stdout
    with serving(db) as (third, _, _):  # the owner is gone: the store is free again
        assert third.poll() is None


def test_a_store_in_a_missing_folder_is_a_clear_configuration_error(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "folder" / "x.db"
    result = _serve("--listen", "127.0.0.1:0", "--store", f"sqlite:///{missing}")
    assert result.returncode == 2
    assert f"store: the folder {missing.parent} of sqlite:///{missing} does not exist" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr + result.stdout


@contextlib.contextmanager
def _read_only_folder(folder: Path) -> Iterator[Path]:
    """``folder`` on a read-only file system (a read-only tmpfs mounted over it, as root), or
    without write permission (not root: the same failure, EACCES instead of EROFS)."""
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr!r}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_store_on_a_read_only_file_system_is_a_named_start_up_failure(tmp_path: Path) -> None:
    with _read_only_folder(tmp_path / "ro") as folder:
        result = _serve("--listen", "127.0.0.1:0", "--store", f"sqlite:///{folder / 's.db'}")
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert f"cannot start: cannot open the store sqlite:///{folder / 's.db'}" in result.stderr
    assert "STORE_UNAVAILABLE" in result.stderr
