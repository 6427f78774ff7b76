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


SERVER = Path(__file__).resolve().parents[1] / "server" / "compactd"
_REASON = re.compile(r'reason\s*=\s*"([A-Z][A-Z0-9_]+)"|reason=base\.([A-Z][A-Z0-9_]+)')
_CONSTANT = re.compile(r'^[A-Z][A-Z0-9_]+(?::\s*Final)?\s*=\s*"([A-Z][A-Z0-9_]+)"$', re.MULTILINE)


def test_every_reason_the_service_can_answer_is_documented() -> None:
    readme = README.read_text(encoding="utf-8")
    table = readme[readme.index("| reason | code | when |") :]
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table[: table.index("\n\n")]))
    found: set[str] = set()
    for path in SERVER.rglob("*.py"):
        if "v1" in path.parts:
            continue
        text = path.read_text(encoding="utf-8")
        found.update(a or b for a, b in _REASON.findall(text))
    found.update(_CONSTANT.findall((SERVER / "providers" / "base.py").read_text(encoding="utf-8")))
    assert {"SEQ_CONFLICT", "SUMMARIZER_MISCONFIGURED", "TIMEOUT"} <= found
    assert sorted(found - documented) == []


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
