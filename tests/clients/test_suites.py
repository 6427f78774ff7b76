"""Every client's own suite, the cross-language scenarios and the examples, run from pytest.

Each test runs one documented command as a subprocess and passes when it exits 0. A missing
toolchain (``clients/setup`` installs Node's packages and Debian's Go) skips locally but fails
under CI (``CI=true``), so a green CI never hides a missing install step.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "clients"


def _require(ok: bool, what: str) -> None:
    if not ok:
        message = f"{what} is missing: run clients/setup"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def _node_ready() -> bool:
    return (CLIENTS / "typescript" / "node_modules" / ".bin" / "tsc").exists()


def _go_ready() -> bool:
    grpc_sources = Path("/usr/share/gocode/src/google.golang.org/grpc")
    return shutil.which("go") is not None and grpc_sources.is_dir()


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, check=False, timeout=600
    )
    assert done.returncode == 0, (
        f"{' '.join(command)}\n{done.stdout[-8000:]}\n{done.stderr[-8000:]}"
    )


def test_python_client_suite_passes() -> None:
    _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        CLIENTS / "python",
    )


def test_the_python_client_installs_alone_into_a_fresh_venv_typed(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    _run([str(venv / "bin" / "pip"), "install", "-q", str(CLIENTS / "python")], tmp_path)
    check = (
        "import importlib.resources as r, importlib.util as u\n"
        "import compactd_client\n"
        "from compactd_client import anthropic, openai\n"
        "assert r.files('compactd_client').joinpath('py.typed').is_file()\n"
        "assert r.files('compactd_client.v1').joinpath('events_pb2.pyi').is_file()\n"
        "assert u.find_spec('compactd') is None  # the server is not needed\n"
        "print(len(openai.events_from_messages([{'role': 'user', 'content': 'hi'}])))\n"
    )
    done = subprocess.run([str(venv / "bin" / "python"), "-c", check], capture_output=True,
                          text=True, check=False, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"  # turn/start, user/message, turn/end


def test_typescript_client_suite_passes() -> None:
    _require(_node_ready(), "clients/typescript/node_modules")
    _run(["npm", "test", "--silent"], CLIENTS / "typescript")


def test_go_client_builds_and_passes_its_tests_in_module_mode() -> None:
    _require(_go_ready(), "Debian's Go toolchain and gRPC sources")
    _run([str(CLIENTS / "go" / "modbuild")], CLIENTS / "go")


def test_the_typescript_package_installs_into_a_fresh_folder_and_its_readme_example_runs(
    tmp_path: Path,
) -> None:
    _require(_node_ready(), "clients/typescript/node_modules")
    readme = (CLIENTS / "typescript" / "README.md").read_text(encoding="utf-8")
    example = re.search(r"```js\n(.*?)```", readme, re.DOTALL)
    assert example is not None, "clients/typescript/README.md has no js example"
    install = re.search(r"^npm install .*$", readme, re.MULTILINE)
    assert install is not None, "clients/typescript/README.md has no npm install line"
    _run(["npm", "pack", "--pack-destination", str(tmp_path)], CLIENTS / "typescript")
    app = tmp_path / "app"
    app.mkdir()
    _run(["npm", "init", "-y"], app)
    command = install.group(0).replace("/path/to", str(tmp_path)).split()
    _run([*command, "--no-audit", "--no-fund", "--prefer-offline"], app)
    sys.path.insert(0, str(CLIENTS))
    from harness import LoopbackStack

    with LoopbackStack() as stack:
        (app / "example.mjs").write_text(example.group(1).replace("127.0.0.1:50051", stack.address))
        done = subprocess.run(["node", "example.mjs"], cwd=app, capture_output=True, text=True,
                              check=False, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"content":"1 failed"' in done.stdout  # the rebuilt request, as OpenAI messages
    assert "tokens before compaction" in done.stdout


def test_every_language_passes_the_scenarios_against_one_server() -> None:
    _require(_node_ready(), "clients/typescript/node_modules")
    _require(_go_ready(), "Debian's Go toolchain and gRPC sources")
    _run([sys.executable, str(CLIENTS / "run-scenarios")], ROOT)


def test_every_example_agent_loop_runs() -> None:
    _require(_node_ready(), "clients/typescript/node_modules")
    _require(_go_ready(), "Debian's Go toolchain and gRPC sources")
    _run([sys.executable, str(ROOT / "examples" / "run")], ROOT)
