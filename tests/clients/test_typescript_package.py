"""The packed TypeScript package, installed offline outside the repository, from both module
systems: ESM ``import``, CommonJS ``require`` and TypeScript compiled to CommonJS (the default of
a project made by ``npm init -y``); its package.json carries no install-time script."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.clients.test_suites import CLIENTS, _node_ready, _require, _run

CLIENT = CLIENTS / "typescript"
#: What a consumer runs: a converter call that needs no server, and the client class.
PROGRAM = """
const events = openai.eventsFromMessages([{ role: "user", content: "hi" }]);
console.log(JSON.stringify([events.map(eventType), typeof CompactdClient]));
"""
EXPECTED = [["turn/start", "user/message", "turn/end"], "function"]


def _pack(folder: Path, into: Path) -> Path:
    """``npm pack`` of ``folder`` into ``into`` (its scripts run: the client builds itself)."""
    done = subprocess.run(["npm", "pack", "--json", "--pack-destination", str(into)], cwd=folder,
                          capture_output=True, text=True, check=False, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return into / json.loads(done.stdout)[0]["filename"]


def _runtime_dependencies() -> list[Path]:
    """The client's installed runtime dependencies (their own packages, packed offline)."""
    done = subprocess.run(["npm", "ls", "--omit=dev", "--all", "--parseable"], cwd=CLIENT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return [Path(line) for line in done.stdout.split()[1:]]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project made by ``npm init -y`` with the packed client installed (offline)."""
    _require(_node_ready(), "clients/typescript/node_modules")
    packs = tmp_path_factory.mktemp("packs")
    tarballs = [_pack(CLIENT, packs)]
    tarballs += [_pack(folder, packs) for folder in _runtime_dependencies()]
    app = tmp_path_factory.mktemp("app")
    _run(["npm", "init", "-y"], app)
    install = ["npm", "install", "--offline", "--no-audit", "--no-fund", *map(str, tarballs)]
    done = subprocess.run(install, cwd=app, capture_output=True, text=True, check=False,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "prepare" not in done.stdout + done.stderr  # no install-scripts warning
    return app


def _node(app: Path, script: str) -> list[object]:
    done = subprocess.run(["node", script], cwd=app, capture_output=True, text=True, check=False,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def test_the_packed_package_json_has_no_install_time_script(app: Path) -> None:
    manifest = json.loads((app / "node_modules/@compactd/client/package.json").read_text())
    assert not {"prepare", "preinstall", "install", "postinstall"} & set(manifest["scripts"])


def test_an_es_module_imports_the_package(app: Path) -> None:
    (app / "esm.mjs").write_text(
        'import { CompactdClient, eventType, openai } from "@compactd/client";\n' + PROGRAM
    )
    assert _node(app, "esm.mjs") == EXPECTED


def test_a_commonjs_script_requires_the_package_and_its_convert_entry(app: Path) -> None:
    (app / "cjs.cjs").write_text(
        'const { CompactdClient, eventType, openai } = require("@compactd/client");\n'
        'const convert = require("@compactd/client/convert");\n'
        "if (convert.openai.eventsFromMessages === undefined) throw new Error('convert');\n"
        + PROGRAM
    )
    assert _node(app, "cjs.cjs") == EXPECTED


def test_typescript_compiled_to_commonjs_uses_the_package_with_its_types(app: Path) -> None:
    (app / "main.ts").write_text(
        'import { CompactdClient, eventType, openai } from "@compactd/client";\n'
        'import type { SessionEvent } from "@compactd/client/convert";\n'
        + PROGRAM.replace("const events =", "const events: SessionEvent[] =")
        + "declare const console: { log(text: string): void };\n"
    )
    tsc = [str(CLIENT / "node_modules/.bin/tsc"), "--module", "node16", "--moduleResolution",
           "node16", "--target", "es2022", "--strict", "--skipLibCheck", "main.ts"]  # fmt: skip
    _run(tsc, app)
    assert "require(" in (app / "main.js").read_text()  # the package is CommonJS (npm init -y)
    assert _node(app, "main.js") == EXPECTED


def test_the_tarball_holds_both_builds(app: Path) -> None:
    lib = app / "node_modules/@compactd/client/lib"
    assert (lib / "index.js").is_file()
    assert (lib / "cjs/index.js").is_file()
    assert json.loads((lib / "cjs/package.json").read_text()) == {"type": "commonjs"}
    assert not (app / "node_modules/@compactd/client").is_symlink()  # packed, not linked
