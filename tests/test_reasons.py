"""Every error reason is named in one module (``compactd.reasons``), and that module, the docs'
table and the clients' typed errors list the same reasons."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from compactd.reasons import Reason

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "server" / "compactd"
ERRORS_DOC = ROOT / "docs" / "errors.md"
_VALUES = {reason.value for reason in Reason}


def _documented() -> dict[str, str]:
    """reason -> its code column, from the docs' table (``| reason | code | when |``)."""
    text = ERRORS_DOC.read_text(encoding="utf-8")
    table = text[text.index("| reason | code | when |") :]
    table = table[: table.index("\n\n")] if "\n\n" in table else table
    codes: dict[str, str] = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for reason in re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[0]):
            codes[reason] = cells[1]
    return codes


def _server_modules() -> list[Path]:
    return [
        path
        for path in SERVER.rglob("*.py")
        # ``testing`` holds other providers' wire bodies (``"status": "RESOURCE_EXHAUSTED"``).
        if not {"v1", "testing"} & set(path.relative_to(SERVER).parts) and path.name != "reasons.py"
    ]


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def test_no_module_but_reasons_spells_a_reason() -> None:
    # A reason written as a string anywhere else (``reason="SPAN_DRIFT"``, an alias constant, a
    # comparison with a reason's text) is one the reasons module may not list: name it instead.
    spelled = []
    for path in _server_modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in _VALUES
                and id(node) not in docstrings
            ):
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert spelled == []


def test_every_reason_raised_is_a_reason_member() -> None:
    # ``reason=`` arguments and ``reason =`` class attributes hold a Reason member or a value
    # passed along (``error.reason``): never a literal of their own.
    literal = []
    for path in _server_modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            values: list[ast.expr] = []
            if isinstance(node, ast.Call):
                values = [k.value for k in node.keywords if k.arg == "reason"]
            elif isinstance(node, ast.ClassDef):
                for statement in node.body:
                    targets = (
                        statement.targets
                        if isinstance(statement, ast.Assign)
                        else [statement.target]
                        if isinstance(statement, ast.AnnAssign)
                        else []
                    )
                    value = getattr(statement, "value", None)
                    if value is not None and any(
                        isinstance(t, ast.Name) and t.id == "reason" for t in targets
                    ):
                        values.append(value)
            for value in values:
                if isinstance(value, ast.Constant) and re.fullmatch(
                    r"[A-Z][A-Z0-9_]+", value.value
                ):
                    literal.append(f"{path.relative_to(ROOT)}:{value.lineno}: {value.value!r}")
                if (
                    isinstance(value, ast.Attribute)
                    and isinstance(value.value, ast.Name)
                    and value.value.id == "Reason"
                ):
                    assert value.attr in Reason.__members__, f"{path}:{value.lineno}"
    assert literal == []


def test_the_docs_table_lists_exactly_the_reasons() -> None:
    documented = _documented()
    assert sorted(set(documented) - _VALUES) == []  # documented, but no such reason
    assert sorted(_VALUES - set(documented)) == []  # a reason the docs do not explain


_CODES = {  # the code column of the docs' table, as each client's code enum spells it
    "INVALID_ARGUMENT": ("InvalidArgument", "InvalidArgument"),
    "NOT_FOUND": ("NotFound", "NotFound"),
    "ALREADY_EXISTS": ("AlreadyExists", "AlreadyExists"),
    "ABORTED": ("Aborted", "Aborted"),
    "FAILED_PRECONDITION": ("FailedPrecondition", "FailedPrecondition"),
    "RESOURCE_EXHAUSTED": ("ResourceExhausted", "ResourceExhausted"),
    "UNAVAILABLE": ("Unavailable", "Unavailable"),
    "UNAUTHENTICATED": ("Unauthenticated", "Unauthenticated"),
}


def _camel(reason: str) -> str:
    return "".join(word.capitalize() for word in reason.split("_"))


def test_the_python_clients_typed_errors_are_reasons_named_after_them() -> None:
    import grpc
    from compactd_client import errors as client_errors

    documented = _documented()
    for reason, cls in client_errors._BY_REASON.items():
        assert reason in _VALUES
        assert cls.__name__ == f"{_camel(reason)}Error"
        code = documented[reason]
        assert client_errors.error_class(getattr(grpc.StatusCode, code), reason) is cls


def test_the_typescript_clients_typed_errors_are_reasons_named_after_them() -> None:
    source = (ROOT / "clients" / "typescript" / "src" / "errors.ts").read_text(encoding="utf-8")
    rows = re.findall(r'\["([A-Z_]+)", \[Code\.(\w+), (\w+)\]\]', source)
    assert rows, "no reason rows found in errors.ts"
    documented = _documented()
    for reason, code, cls in rows:
        assert reason in _VALUES
        assert cls == f"{_camel(reason)}Error"
        assert _CODES[documented[reason]][0] == code


def test_the_go_clients_typed_errors_are_reasons_named_after_them() -> None:
    source = (ROOT / "clients" / "go" / "compactd" / "errors.go").read_text(encoding="utf-8")
    rows = re.findall(r'(Err\w+)\s*=\s*&Error\{Code: codes\.(\w+), Reason: "([A-Z_]+)"\}', source)
    assert rows, "no reason rows found in errors.go"
    documented = _documented()
    for name, code, reason in rows:
        assert reason in _VALUES
        assert name == f"Err{_camel(reason)}"
        assert _CODES[documented[reason]][1] == code


@pytest.mark.parametrize("reason", sorted(Reason))
def test_a_reason_is_its_own_wire_text(reason: Reason) -> None:
    assert reason == reason.value == str(reason) == f"{reason}"
