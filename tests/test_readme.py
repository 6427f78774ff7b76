"""README's example runs as written against a live server, with the client package alone (the
docs match the code, and a user who installed only ``compactd_client`` can run it)."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compactd.api.server import RunningServer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLIENT_SOURCE = ROOT / "clients" / "python" / "src"


def _example() -> str:
    section = README.read_text(encoding="utf-8").split("## Example: the Python client", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README has no Python example"
    return match.group(1)


def _printed() -> str:
    """The output the README shows under its example."""
    section = README.read_text(encoding="utf-8").split("## Example: the Python client", 1)[1]
    match = re.search(r"```python\n.*?```\n\n```\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README shows no output under its example"
    return match.group(1)


def test_the_readme_example_imports_the_client_package_only() -> None:
    imported = set()
    for node in ast.walk(ast.parse(_example())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported
    assert {name.split(".")[0] for name in imported} == {"compactd_client"}


def _without_the_server_package(directory: Path) -> dict[str, str]:
    """An environment in which ``import compactd`` fails (a package of that name that raises
    shadows the server's) and ``compactd_client`` comes from this checkout."""
    shadow = directory / "compactd"
    shadow.mkdir()
    (shadow / "__init__.py").write_text(
        "raise ImportError('the server package is not installed (a client-only environment)')\n"
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), str(CLIENT_SOURCE)])}


async def test_the_readme_example_prints_the_rebuilt_request_with_the_client_alone(
    server: RunningServer, tmp_path: Path
) -> None:
    code = _example()
    assert code.count("\n") <= 26  # short enough to read at a glance
    code = code.replace("127.0.0.1:50051", server.address)
    environment = _without_the_server_package(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=environment,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    assert out.decode() == _printed()


def test_the_client_only_environment_refuses_the_servers_stubs(tmp_path: Path) -> None:
    # What makes the test above fail for an example that imports compactd.v1.
    code = "from compactd.v1 import session_service_pb2"
    environment = _without_the_server_package(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=False
    )
    assert run.returncode != 0
    assert "the server package is not installed" in run.stderr


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
