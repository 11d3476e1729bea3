"""The code a stage runs, as a digest: its module and every project module it imports, directly or through others.

A module's part of the digest is its syntax tree with every docstring and bare string statement left out (the
attribute docstrings of config fields included), so comments, docstrings and formatting change no key; any change
to what the code does, in the stage's module or one it reaches, changes the key of that stage (and, through their
inputs, of the stages downstream of it). What counts as imported, per module:

- every ``import`` / ``from ... import`` in it, at the top or inside a function (lazy imports are still imports);
  ``from package import name`` counts ``package.name`` too where that is a module;
- the packages above each imported module (their ``__init__`` runs first);
- every string in its code that is the dotted name of a project module (``"tasks.distributed_train"``, which a
  stage starts with ``python -m``; ``importlib.import_module("...")``): code reached without an ``import`` statement
  is named by a string somewhere. Docstrings are not code and name nothing here; a name built at run time (an
  f-string) cannot be followed, so the project builds none.
"""

from __future__ import annotations

import ast
import hashlib
import marshal
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import CodeType


def module_file(root: Path, name: str) -> Path | None:
    """The file of module ``name`` under ``root`` (``a/b.py`` or ``a/b/__init__.py``); None when there is none."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(root: Path, name: str, packages: Sequence[str],
                     files: dict[str, Path | None] | None = None) -> set[str]:
    """The project modules module ``name`` imports or names, with the packages above them (``files``: module files
    already looked up, shared by the calls of one :func:`closure`)."""
    files = {} if files is None else files
    found = set()
    for module in _read(module_file(root, name)).named:
        parts = module.split(".")
        if parts[0] in packages:
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    for module in found - files.keys():
        files[module] = module_file(root, module)
    return {m for m in found if files[m] is not None}


@dataclass(frozen=True)
class _Module:
    named: frozenset[str]
    """Dotted names the module imports (``from a import b``: ``a`` and ``a.b``) or quotes."""
    code: bytes
    """:func:`normalised`."""


def _read(path: Path) -> _Module:
    """The module at ``path``, parsed once per version of the file (its size and modification time)."""
    stat = path.stat()
    return _parse(path, stat.st_mtime_ns, stat.st_size)


#: A string that is a dotted name: a module named in a string.
_DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")


@lru_cache(maxsize=4096)
def _parse(path: Path, mtime_ns: int, size: int) -> _Module:
    tree = _strip_strings(ast.parse(path.read_bytes()))
    named = {node.value for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED_NAME.fullmatch(node.value)}
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(path, node.module, node.level)
            named |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    code = marshal.dumps(_without_positions(compile(tree, "<module>", "exec", dont_inherit=True)))
    return _Module(frozenset(named), code)


#: The fields of a node that hold a block of statements (and the handlers and cases that hold blocks).
_BLOCK_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")


def _blocks(tree: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """Every block of a tree, as (node, field): expressions are not visited (imports and docstrings are statements).
    A block the caller replaces meanwhile is descended as replaced."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for field in _BLOCK_FIELDS:
            if isinstance(getattr(node, field, None), list):
                yield node, field
                stack.extend(getattr(node, field))


def _statements(tree: ast.AST) -> Iterator[ast.stmt]:
    """Every statement of a module, nested ones included."""
    for node, field in _blocks(tree):
        yield from (child for child in getattr(node, field) if isinstance(child, ast.stmt))


def _absolute(path: Path, module: str | None, level: int) -> str:
    """The absolute module of ``from <level dots><module> import ...`` written in the file at ``path``."""
    if level == 0:
        return module or ""
    folder = path.parent
    for _ in range(level - 1):
        folder = folder.parent
    return ".".join([*_package_name(folder), *([module] if module else [])])


def _package_name(folder: Path) -> list[str]:
    """The dotted name of the package in ``folder``: its folder names up to the first without ``__init__.py``."""
    names = []
    while (folder / "__init__.py").is_file():
        names.insert(0, folder.name)
        folder = folder.parent
    return names


def closure(root: Path, name: str, packages: Sequence[str]) -> frozenset[str]:
    """Module ``name`` and every project module it reaches through imports."""
    seen: set[str] = set()
    files: dict[str, Path | None] = {}
    todo = [name]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(imported_modules(root, module, packages, files) - seen)
    return frozenset(seen)


def _strip_strings(tree: ast.Module) -> ast.Module:
    """Drop string-only expression statements (docstrings, attribute docstrings); an emptied body gets ``pass``."""
    for node, field in _blocks(tree):
        block = getattr(node, field)
        kept = [child for child in block if not _is_string_statement(child)]
        if field == "body" and not kept:
            kept = [ast.copy_location(ast.Pass(), block[0])]
        setattr(node, field, kept)
    return tree


def _is_string_statement(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _without_positions(code: CodeType) -> CodeType:
    """``code`` and the code objects inside it with no line numbers or file name."""
    consts = tuple(_without_positions(c) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_consts=consts, co_firstlineno=1, co_linetable=b"", co_filename="")


def normalised(path: Path) -> bytes:
    """What a module does, without its comments, docstrings and layout: its code compiled from the syntax tree with
    the string statements left out, without positions, marshalled."""
    return _read(path).code


def code_digest(root: Path, modules: Sequence[str]) -> str:
    """16 hex digits of sha256 over each module's path and :func:`normalised` tree, in name order."""
    digest = hashlib.sha256()
    for name in sorted(modules):
        path = module_file(root, name)
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(normalised(path))
    return digest.hexdigest()[:16]


def package_modules(root: Path, packages: Sequence[str]) -> list[str]:
    """Every module of ``packages`` under ``root``."""
    names = []
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names
