"""The lock files the service is built from (``scripts/lock``) satisfy ``pyproject.toml``'s
ranges, pin every package with its hashes, agree with each other, and are what the set-up and the
image install."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "requirements" / "runtime.txt"
DEV = ROOT / "requirements" / "dev.txt"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", re.MULTILINE)


def _pins(lock: Path) -> dict[str, str]:
    return {canonicalize_name(name): version for name, version in _PIN.findall(lock.read_text())}


def _project(path: Path) -> dict[str, object]:
    project: dict[str, object] = tomllib.loads(path.read_text(encoding="utf-8"))["project"]
    return project


def _requirements(path: Path, *extras: str) -> list[Requirement]:
    """``path``'s dependencies and those of ``extras``, the project's own name left out."""
    project = _project(path)
    listed = list(project.get("dependencies", []))  # type: ignore[call-overload]
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        listed += optional[extra]  # type: ignore[index]
    own = canonicalize_name(str(project["name"]))
    return [r for r in map(Requirement, listed) if canonicalize_name(r.name) != own]


def _unsatisfied(lock: Path, requirements: list[Requirement]) -> list[str]:
    pins = _pins(lock)
    wrong = []
    for requirement in requirements:
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is None or not requirement.specifier.contains(pinned, prereleases=True):
            wrong.append(f"{requirement} (locked: {pinned})")
    return wrong


def test_the_runtime_lock_satisfies_the_services_ranges() -> None:
    assert _unsatisfied(RUNTIME, _requirements(ROOT / "pyproject.toml")) == []


def test_the_dev_lock_satisfies_the_dev_extras_and_the_python_clients_ranges() -> None:
    requirements = _requirements(ROOT / "pyproject.toml", "dev", "open-models")
    requirements += _requirements(ROOT / "clients" / "python" / "pyproject.toml")
    assert _unsatisfied(DEV, requirements) == []


def test_both_locks_pin_the_same_versions() -> None:
    runtime, dev = _pins(RUNTIME), _pins(DEV)
    assert {name: (v, dev.get(name)) for name, v in runtime.items() if dev.get(name) != v} == {}


@pytest.mark.parametrize("lock", [RUNTIME, DEV], ids=["runtime", "dev"])
def test_every_pin_carries_its_hashes(lock: Path) -> None:
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock.read_text())
    pinned = [e for e in entries if _PIN.match(e)]
    assert len(pinned) == len(_pins(lock)) > 20
    assert [e.split()[0] for e in pinned if "--hash=sha256:" not in e] == []


def test_the_set_up_and_the_image_install_the_locks_with_their_hashes() -> None:
    setup = (ROOT / "scripts" / "setup").read_text()
    assert "install -q --require-hashes -r requirements/dev.txt" in setup
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "install --require-hashes -r requirements/runtime.txt" in dockerfile
    assert "install --no-deps ." in dockerfile
