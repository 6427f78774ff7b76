"""The docs hold together and match the code: every page is reachable from the README and links
back, every link lands on a file and a heading, every Python block compiles, every TypeScript
block type-checks against the TypeScript client, every TOML block is a configuration
``compactd serve`` accepts, the tables that list the code's settings and RPCs are
complete, and the runnable examples run against a live server.

(README's own example, the errors table, the recovery loop and the secure configuration have
their tests in ``test_readme*.py``; the replay quick start in ``test_replay.py``.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from compactd import config
from compactd.api.server import RunningServer, components

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [README, ROOT / "CONTRIBUTING.md", *PAGES]
TYPESCRIPT = ROOT / "clients" / "typescript"
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _blocks(path: Path, language: str) -> list[str]:
    """The fenced blocks of ``language`` in ``path``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", _text(path), re.DOTALL | re.MULTILINE)


def _outside_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of ``path``."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _outside_code(_text(path)), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def test_the_readme_is_a_front_page() -> None:
    assert len(_text(README).splitlines()) < 400


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_a_page_has_a_title_links_back_and_is_linked_from_the_readme(page: Path) -> None:
    text = _text(page)
    assert text.startswith("# ")
    assert "](../README.md)" in text
    assert f"](docs/{page.name})" in _text(README)


@pytest.mark.parametrize("path", MARKDOWN, ids=_ids(MARKDOWN))
def test_every_relative_link_lands_on_a_file_and_a_heading(path: Path) -> None:
    broken = []
    for target in _LINK.findall(_outside_code(_text(path))):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        lands = linked.exists() and (
            not anchor or linked.suffix != ".md" or anchor in _anchors(linked)
        )
        if not lands:
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("path", MARKDOWN, ids=_ids(MARKDOWN))
def test_every_python_block_compiles(path: Path) -> None:
    for number, code in enumerate(_blocks(path, "python")):
        compile(code, f"{path.name}, python block {number + 1}", "exec")


@pytest.mark.parametrize("path", MARKDOWN, ids=_ids(MARKDOWN))
def test_every_json_block_parses(path: Path) -> None:
    for code in _blocks(path, "json"):
        json.loads(code)


@pytest.mark.parametrize("path", MARKDOWN, ids=_ids(MARKDOWN))
def test_every_toml_block_is_a_configuration_serve_accepts(path: Path, tmp_path: Path) -> None:
    for number, code in enumerate(_blocks(path, "toml")):
        file = tmp_path / f"block{number}.toml"
        file.write_text(code, encoding="utf-8")
        settings = config.load(file, environ={})
        components(settings)  # routes, policy, summarizer: as `compactd serve` validates them


def test_every_typescript_block_typechecks_against_the_typescript_client(tmp_path: Path) -> None:
    tsc = TYPESCRIPT / "node_modules" / ".bin" / "tsc"
    if not (tsc.exists() and (TYPESCRIPT / "lib" / "index.d.ts").exists()):
        message = "the TypeScript client is not built: run clients/setup"
        if os.environ.get("CI") == "true":  # as tests/clients/test_suites.py: CI must have it
            pytest.fail(message)
        pytest.skip(message)
    blocks = [code for path in MARKDOWN for code in _blocks(path, "ts")]
    assert blocks
    package = tmp_path / "node_modules" / "@compactd" / "client"
    package.parent.mkdir(parents=True)
    package.symlink_to(TYPESCRIPT)  # `import ... from "@compactd/client"` as an installed package
    files = []
    for number, code in enumerate(blocks):
        file = tmp_path / f"block{number}.ts"
        file.write_text(code, encoding="utf-8")
        files.append(str(file))
    options = ["--noEmit", "--strict", "--module", "nodenext", "--moduleResolution", "nodenext",
               "--target", "es2022", "--skipLibCheck", "--types", "node",
               "--typeRoots", str(TYPESCRIPT / "node_modules" / "@types")]  # fmt: skip
    done = subprocess.run([str(tsc), *options, *files], cwd=tmp_path, capture_output=True,
                          text=True, check=False, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_settings_table_names_every_server_setting() -> None:
    page = _text(DOCS / "configuration.md")
    table = page[page.index("| setting | default | meaning |") :]
    named = set(re.findall(r"`\[*\[?([a-z_]+)\]?\]*`", table[: table.index("\n\n")]))
    settings = {field.name for field in dataclasses.fields(config.ServerConfig)}
    assert sorted(settings - named) == []


def test_the_contract_page_names_every_rpc() -> None:
    rpcs = set()
    for proto in (ROOT / "protos" / "compactd" / "v1").glob("*.proto"):
        rpcs.update(re.findall(r"^\s*rpc (\w+)\(", _text(proto), re.MULTILINE))
    assert rpcs
    page = _text(DOCS / "contract.md")
    assert sorted(rpc for rpc in rpcs if f"`{rpc}`" not in page) == []


def test_the_telemetry_page_names_every_metric_and_span() -> None:
    server = ROOT / "server" / "compactd"
    code = "\n".join(_text(p) for p in server.rglob("*.py") if "v1" not in p.parts)
    metrics = set(re.findall(r'create_[a-z_]+\(\s*"([a-z_.]+)"', code))
    metrics |= set(re.findall(r'\(\s*"(compactd\.store\.[a-z_.]+)", "', code))
    spans = set(re.findall(r'start_as_current_span\(\s*"([a-z_.]+)"', code))
    assert {"compactd.compactions", "compactd.sessions.live", "compactd.store.commits"} <= metrics
    assert {"compaction.bracket", "compaction.gate"} <= spans
    page = _text(DOCS / "telemetry.md")
    assert sorted(name for name in metrics | spans if f"`{name}`" not in page) == []


# ---- the runnable examples of docs/ ------------------------------------------------------------


def _clients_function(name: str) -> Callable[..., str]:
    """docs/clients.md's function ``name``, executed from the Python block that defines it."""
    (code,) = [c for c in _blocks(DOCS / "clients.md", "python") if f"def {name}(" in c]
    assert code.count("\n") <= 16  # a few lines
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    function: Callable[..., str] = namespace[name]
    return function


def _clients_chat() -> Callable[..., str]:
    """docs/clients.md's ``chat`` function."""
    return _clients_function("chat")


def _completion(body: Mapping[str, Any], text: str) -> dict[str, Any]:
    """An OpenAI chat completion answering ``body`` with ``text``."""
    return {
        "model": body["model"],
        "choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 1},
    }


async def test_the_clients_page_turn_runs_against_a_live_server(server: RunningServer) -> None:
    from compactd_client import CompactdClient
    from compactd_client.events import event_type, request_header, system_message

    chat = _clients_chat()
    sent: list[Mapping[str, Any]] = []

    def call_model(body: Mapping[str, Any]) -> dict[str, Any]:
        sent.append(body)
        return _completion(body, f"answer {len(sent)}")

    def run() -> tuple[list[str], list[str]]:
        with CompactdClient(server.address, timeout=30) as client:
            sid = client.create_session().session_id
            client.append_events(sid, [system_message("Be terse."),
                                       request_header("openai", "gpt-4o")])  # fmt: skip
            answers = [chat(client, sid, turn, f"question {turn}", call_model) for turn in (1, 2)]
            logged = [event_type(e) for e in client.list_events(sid)]
            return answers, logged

    answers, logged = await asyncio.to_thread(run)

    assert answers == ["answer 1", "answer 2"]
    assert [m["role"] for m in sent[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert sent[1]["messages"][2]["content"] == "answer 1"
    assert logged.count("assistant/message") == 2
    assert logged[-1] == "turn/end"


async def test_the_clients_page_delegation_runs_against_a_live_server(
    server: RunningServer,
) -> None:
    from compactd_client import CompactdClient
    from compactd_client.events import request_header, system_message, turn_end, turn_start

    delegate = _clients_function("delegate")

    def run() -> tuple[str, list[str], list[str], list[str]]:
        with CompactdClient(server.address, timeout=30) as client:
            sid = client.create_session().session_id
            opening = [system_message("Be terse."), request_header("openai", "gpt-4o")]
            client.append_events(sid, [*opening, turn_start(1), turn_end(1)])
            result = delegate(client, sid, "call-7", lambda child: f"ran in {child}")
            pins = [p.key for p in client.build_request(sid).pins]
            children = client.list_sessions(parent_session_id=sid).sessions
            logged = [e.WhichOneof("body") or "" for e in client.list_events(sid)][-2:]
            return result, pins, [c.session_id for c in children], logged

    result, pins, children, logged = await asyncio.to_thread(run)

    assert children == [result.removeprefix("ran in ")]
    assert pins == ["goal"]
    assert logged == ["subagent_end", "state_pin"]
