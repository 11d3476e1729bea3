"""rlhf_core.data stays pure: no pandas, pyarrow, prefect or mlflow imports (checked on the source AST)."""

from __future__ import annotations

import ast
from pathlib import Path

import rlhf_core.data

FORBIDDEN = {"pandas", "pyarrow", "prefect", "mlflow", "tasks", "flows"}


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_rlhf_core_data_imports_nothing_impure() -> None:
    files = sorted(Path(rlhf_core.data.__file__).parent.glob("*.py"))
    assert len(files) >= 10
    offenders = {f.name: imported_roots(f) & FORBIDDEN for f in files if imported_roots(f) & FORBIDDEN}
    assert offenders == {}
