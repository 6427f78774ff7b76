"""README's example runs as written against a live server (the docs match the code)."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compactd.api.server import RunningServer

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    match = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert match is not None, "README has no Python example"
    return match.group(1)


async def test_the_readme_example_prints_the_rebuilt_request(server: RunningServer) -> None:
    code = _example()
    assert code.count("\n") <= 26  # short enough to read at a glance
    code = code.replace("127.0.0.1:50051", server.address)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    printed = out.decode()
    for role in ("SYSTEM", "USER", "ASSISTANT", "TOOL"):
        assert f"MESSAGE_ROLE_{role}" in printed
    assert 'model: "deepseek-chat"' in printed


@pytest.mark.skipif(
    shutil.which("git") is None or not (README.parent / ".git").exists(),
    reason="needs git and a checkout",
)
def test_git_ignores_the_files_the_readmes_commands_leave() -> None:
    # `compactd serve` leaves its store and the store's lock, `compactd replay` its report.
    left = ["compactd.db", "compactd.db-wal", "compactd.db.lock", "replay-report.html"]
    checked = subprocess.run(
        ["git", "check-ignore", "--no-index", *left], cwd=README.parent, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert checked.stdout.split() == left
