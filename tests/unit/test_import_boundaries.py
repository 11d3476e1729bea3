"""One-way imports, checked on the AST: flows -> tasks -> rlhf_core, and nothing imports infra.

rlhf_core is pure (stdlib, numpy, torch, transformers): no prefect, mlflow, pandas, pyarrow, and no
tasks/flows. deepspeed and peft are allowed only inside the adapter modules named in ADAPTERS. Inside rlhf_core a
module imports only from its own part or the parts before it in CORE_ORDER, and no two files of any layer import
each other, directly or round a longer circle; no module exports names lazily (a module ``__getattr__``).
The checker also sees imports nested in functions, ``if TYPE_CHECKING:`` blocks, relative imports and
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("rlhf_core", "tasks", "flows")

#: Engines rlhf_core may use only through one small adapter module each.
ADAPTER_ONLY = frozenset({"deepspeed", "peft"})
ADAPTERS = frozenset({"rlhf_core/distributed/zero.py", "rlhf_core/models/lora.py"})
#: I/O, orchestration and upper layers that the pure core must never see.
CORE_FORBIDDEN = frozenset({"prefect", "mlflow", "pandas", "pyarrow", "tasks", "flows"})
#: One module per stage in tasks/; a stage never imports another (what two share lives in an adapter module).
STAGE_MODULES = frozenset({"tasks.data_prep", "tasks.sft", "tasks.reward_model", "tasks.best_of_n",
                           "tasks.ppo_iteration", "tasks.heldout_eval", "tasks.rm_refresh", "tasks.dpo"})
#: The one package that talks to MLflow.
TRACKING_ADAPTER = "tasks/tracking/"
#: Never unpickle anything: records are JSON, checkpoints safetensors + JSON.
PICKLERS = frozenset({"pickle", "cloudpickle", "dill", "joblib"})
#: The parts of rlhf_core in import order: each imports only itself and the parts before it.
CORE_ORDER = ("rlhf_core.ranges", "rlhf_core.compat", "rlhf_core.ppo", "rlhf_core.config", "rlhf_core.data",
              "rlhf_core.demo", "rlhf_core.models", "rlhf_core.training", "rlhf_core.distributed",
              "rlhf_core.evaluation")


@dataclass(frozen=True)
class Violation:
    """One import that breaks the layering."""

    path: str
    line: int
    module: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.module!r}: {self.reason}"


def module_name(rel_path: str) -> tuple[str, bool]:
    """``rlhf_core/demo/x.py`` -> (``rlhf_core.demo.x``, False); ``.../__init__.py`` -> (package, True)."""
    parts = rel_path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def resolve_relative(current: str, is_package: bool, level: int, module: str | None) -> str:
    """Absolute name of ``from <level dots><module> import ...`` written in module ``current``."""
    package = current.split(".") if is_package else current.split(".")[:-1]
    base = package[: max(0, len(package) - (level - 1))]
    return ".".join([*base, module] if module else base)


def imported_modules(tree: ast.AST, rel_path: str) -> Iterator[tuple[int, str]]:
    """Yield (line, absolute module name) for every import in ``tree``, however nested."""
    current, is_package = module_name(rel_path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.lineno, node.module or ""
                if (node.module or "").split(".")[0] in LAYERS:  # ``from tasks import sft``: names may be modules
                    yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
                continue
            base = resolve_relative(current, is_package, node.level, node.module)
            if node.module:
                yield node.lineno, base
            else:  # ``from . import x``: each name may be a submodule
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}" if base else alias.name
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if name in {"import_module", "__import__"} and isinstance(first, ast.Constant):
                if isinstance(first.value, str):
                    yield node.lineno, first.value


def rule_for(rel_path: str, module: str) -> str | None:
    """Why ``rel_path`` may not import ``module``, or None when it may."""
    top = module.split(".")[0]
    layer = rel_path.split("/")[0]
    if top == "infra":
        return "nothing imports infra/ (deployment files only); pass settings in through config instead"
    if layer == "rlhf_core":
        if top in CORE_FORBIDDEN:
            return (
                "rlhf_core must stay pure (stdlib, numpy, torch, transformers); "
                "move I/O, tracking and orchestration into tasks/ or flows/"
            )
        if top in ADAPTER_ONLY and rel_path not in ADAPTERS:
            return f"{top} may be imported only in the adapters {sorted(ADAPTERS)}; import the adapter instead"
    if layer == "tasks" and top == "flows":
        return "tasks must not import flows (flows compose tasks, never the other way round)"
    if top in PICKLERS:
        return "no pickles anywhere: state records are JSON, tensors safetensors (a pickle runs code when loaded)"
    if top == "mlflow" and layer in ("tasks", "flows") and not rel_path.startswith(TRACKING_ADAPTER):
        return f"every MLflow call goes through {TRACKING_ADAPTER}; add the helper there"
    this = rel_path[: -len(".py")].replace("/", ".")
    stage_of = next((m for m in STAGE_MODULES if module == m or module.startswith(m + ".")), None)
    if this in STAGE_MODULES and stage_of is not None and stage_of != this:
        return (f"stage modules never import each other ({this} -> {stage_of}); move what they share into an "
                "adapter module (tasks/io.py, tasks/models.py, tasks/judging.py, ...)")
    return None


def check_source(source: str, rel_path: str) -> list[Violation]:
    """All layering violations in one file's source, ``rel_path`` relative to the repo root (posix)."""
    try:
        tree = ast.parse(source, filename=rel_path)
    except SyntaxError as err:
        raise AssertionError(f"{rel_path}:{err.lineno}: cannot parse for the import check: {err.msg}") from err
    violations = []
    for line, module in imported_modules(tree, rel_path):
        reason = rule_for(rel_path, module)
        if reason is not None:
            violations.append(Violation(rel_path, line, module, reason))
    # ``from x import y`` is seen as x and x.y: report the import once, by its shortest breaking name.
    violations = [v for v in violations if not any(o.line == v.line and v.module.startswith(o.module + ".")
                                                   for o in violations)]
    return sorted(violations, key=lambda v: (v.path, v.line, v.module))


def layer_files() -> list[Path]:
    """Every .py file under the three layers (a layer not created yet is simply skipped)."""
    return sorted(p for layer in LAYERS for p in (REPO / layer).rglob("*.py"))


def format_violations(violations: list[Violation]) -> str:
    """A failure message listing file:line and the offending import, one per line."""
    lines = [f"{len(violations)} import(s) break the one-way layering flows -> tasks -> rlhf_core:"]
    lines += [f"  {v}" for v in violations]
    return "\n".join(lines)


def test_layers_respect_one_way_imports():
    violations = []
    for path in layer_files():
        rel_path = path.relative_to(REPO).as_posix()
        violations += check_source(path.read_text(encoding="utf-8"), rel_path)
    assert not violations, format_violations(violations)


def test_the_walk_sees_the_core_modules():
    # guards against a silent pass because the walk found nothing
    found = {p.relative_to(REPO).as_posix() for p in layer_files()}
    assert {"rlhf_core/ppo/masking.py", "rlhf_core/ppo/losses.py", "rlhf_core/ppo/advantages.py"} <= found


# --- the checker itself must be able to fail ------------------------------------------------------------


@pytest.mark.parametrize(
    ("rel_path", "source", "line", "module"),
    [
        ("rlhf_core/foo.py", "import mlflow\n", 1, "mlflow"),
        ("rlhf_core/foo.py", "import torch\nfrom pandas import DataFrame\n", 2, "pandas"),
        ("rlhf_core/foo.py", "import pyarrow.parquet as pq\n", 1, "pyarrow.parquet"),
        ("rlhf_core/foo.py", "def f():\n    import prefect\n", 2, "prefect"),
        ("rlhf_core/foo.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pandas\n", 3, "pandas"),
        ("rlhf_core/foo.py", "from tasks.ppo import run\n", 1, "tasks.ppo"),
        ("rlhf_core/sub/x.py", "from flows import pipeline\n", 1, "flows"),
        ("rlhf_core/foo.py", "import importlib\nm = importlib.import_module('mlflow')\n", 2, "mlflow"),
        ("rlhf_core/foo.py", "m = __import__('pyarrow')\n", 1, "pyarrow"),
        ("rlhf_core/models/roles.py", "import deepspeed\n", 1, "deepspeed"),
        ("rlhf_core/models/roles.py", "from peft import LoraConfig\n", 1, "peft"),
        ("rlhf_core/demo/lora.py", "import peft\n", 1, "peft"),  # only rlhf_core/models/lora.py itself is an adapter
        ("tasks/train.py", "from flows.pipeline import run\n", 1, "flows.pipeline"),
        ("tasks/train.py", "import infra.deepspeed\n", 1, "infra.deepspeed"),
        ("flows/pipeline.py", "from infra import settings\n", 1, "infra"),
        ("rlhf_core/foo.py", "import infra\n", 1, "infra"),
        ("tasks/sft.py", "from tasks.data_prep import prepare\n", 1, "tasks.data_prep"),
        ("tasks/heldout_eval.py", "from tasks import best_of_n\n", 1, "tasks.best_of_n"),
        ("tasks/reward_model.py", "from mlflow import MlflowClient\n", 1, "mlflow"),
        ("flows/commands.py", "import mlflow\n", 1, "mlflow"),
        ("tasks/run_store/runs.py", "import pickle\n", 1, "pickle"),
        ("flows/pipeline.py", "import cloudpickle\n", 1, "cloudpickle"),
    ],
)
def test_checker_flags_synthetic_violation(rel_path, source, line, module):
    violations = check_source(source, rel_path)
    assert [(v.line, v.module) for v in violations] == [(line, module)]
    message = format_violations(violations)
    assert f"{rel_path}:{line}: imports {module!r}" in message


@pytest.mark.parametrize(
    ("rel_path", "source"),
    [
        ("rlhf_core/foo.py", "import torch\nimport numpy as np\nfrom transformers import AutoModel\n"),
        ("rlhf_core/foo.py", "import mlflowish\nimport tasks_helper\n"),  # only whole top-level names count
        ("rlhf_core/distributed/zero.py", "import deepspeed\n"),
        ("rlhf_core/models/lora.py", "from peft import LoraConfig, get_peft_model\n"),
        ("rlhf_core/demo/x.py", "from ..ppo.masking import masked_mean\nfrom . import data\n"),
        ("tasks/tracking/registry.py", "import mlflow\nfrom mlflow import MlflowClient\n"),
        ("tasks/train.py", "import pandas as pd\nimport pyarrow.parquet\nfrom rlhf_core import ppo\n"),
        ("tasks/sft.py", "from tasks.io import read_parquet\nfrom tasks.stage import Stage\n"),
        ("flows/pipeline.py", "from tasks import train\nimport prefect\nfrom tasks import sft, best_of_n\n"),
    ],
)
def test_checker_allows_legal_imports(rel_path, source):
    assert check_source(source, rel_path) == []


def test_relative_imports_are_resolved():
    tree = ast.parse("from ..data import rows\nfrom . import tokenizer\nfrom .. import config\n")
    found = [module for _, module in imported_modules(tree, "rlhf_core/demo/run.py")]
    assert found == ["rlhf_core.data", "rlhf_core.demo.tokenizer", "rlhf_core.config"]
    tree = ast.parse("from .sub import x\n")
    assert [m for _, m in imported_modules(tree, "rlhf_core/demo/__init__.py")] == ["rlhf_core.demo.sub"]


def test_failure_message_lists_every_violation():
    source = "import torch\nimport mlflow\nimport pandas as pd\n"
    message = format_violations(check_source(source, "rlhf_core/bad.py"))
    assert message.splitlines()[0].startswith("2 import(s) break")
    assert "rlhf_core/bad.py:2: imports 'mlflow'" in message
    assert "rlhf_core/bad.py:3: imports 'pandas'" in message


# --- no circles, and rlhf_core's parts in one order ----------------------------------------------------------


def file_imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules among ``sources`` (``{rel_path: source}``) it imports by name, anywhere in the file.
    ``from package import name`` is an import of ``package.name`` where that is a module, else of the package; the
    packages Python runs on the way to a module are not counted (they are not a choice of the importing file)."""
    modules = {module_name(rel)[0]: rel for rel in sources}
    graph: dict[str, set[str]] = {}
    for module, rel in modules.items():
        tree = ast.parse(sources[rel], filename=rel)
        found, packages_of_from = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = (node.module or "") if node.level == 0 else resolve_relative(
                    module, rel.endswith("__init__.py"), node.level, node.module)
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
                packages_of_from.add((node.lineno, base))
        # every other import the boundary checker sees (plain, importlib); the ``from`` ones are resolved above
        found |= {name for line, name in imported_modules(tree, rel) if (line, name) not in packages_of_from}
        graph[module] = {name for name in found if name in modules and name != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other round a circle (strongly connected, two or more), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                group.append(stack.pop())
                if group[-1] == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def core_part(module: str) -> int | None:
    """The position in CORE_ORDER of the part ``module`` belongs to (None outside rlhf_core's parts)."""
    return next((i for i, part in enumerate(CORE_ORDER) if module == part or module.startswith(part + ".")), None)


def order_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Imports from an rlhf_core part to one after it in CORE_ORDER."""
    breaks = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            here, there = core_part(module), core_part(other)
            if here is not None and there is not None and there > here:
                breaks.append(f"{module} imports {other}: {CORE_ORDER[here]} may import only "
                              f"{', '.join(CORE_ORDER[: here + 1])}")
    return breaks


def lazy_exports(sources: dict[str, str]) -> list[str]:
    """Modules that define a module-level ``__getattr__`` (names exported lazily hide what imports what)."""
    return sorted(rel for rel, source in sources.items() if any(
        isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in ast.parse(source).body))


def layer_sources() -> dict[str, str]:
    return {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8") for p in layer_files()}


def test_no_two_files_import_each_other_round_a_circle():
    found = circles(file_imports(layer_sources()))
    assert not found, "import circles (move what both need to a module below them):\n" + "\n".join(
        " <-> ".join(group) for group in found)


def test_rlhf_core_parts_import_only_the_parts_before_them():
    assert not order_breaks(file_imports(layer_sources())), "\n".join(order_breaks(file_imports(layer_sources())))
    assert {module.split(".")[1] for module in file_imports(layer_sources()) if module.count(".") >= 1
            and module.startswith("rlhf_core.")} == {part.split(".")[1] for part in CORE_ORDER}, "CORE_ORDER names every part"


def test_no_module_exports_names_lazily():
    assert lazy_exports(layer_sources()) == []


def test_the_circle_and_order_checks_can_fail():
    sources = {
        "rlhf_core/models/a.py": "from rlhf_core.training.b import f\n",
        "rlhf_core/training/b.py": "def f():\n    from rlhf_core.models import a\n",
        "rlhf_core/training/__init__.py": "",
        "rlhf_core/models/__init__.py": "",
        "tasks/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tasks.y import Y\n",
        "tasks/y.py": "from tasks import x\n",
        "tasks/__init__.py": "",
        "tasks/z.py": "from tasks.x import X\n",  # imports into a circle, is not part of it
        "rlhf_core/ppo/__init__.py": "def __getattr__(name):\n    return name\n",
    }
    graph = file_imports(sources)
    assert circles(graph) == [["rlhf_core.models.a", "rlhf_core.training.b"], ["tasks.x", "tasks.y"]]
    assert order_breaks(graph) == ["rlhf_core.models.a imports rlhf_core.training.b: rlhf_core.models may import "
                                   "only " + ", ".join(CORE_ORDER[: CORE_ORDER.index("rlhf_core.models") + 1])]
    assert lazy_exports(sources) == ["rlhf_core/ppo/__init__.py"]
    # importing a submodule through its package is an import of the submodule, not a circle with the package
    assert circles(file_imports({"rlhf_core/demo/__init__.py": "from rlhf_core.demo.gold import g\n",
                                 "rlhf_core/demo/gold.py": "from rlhf_core.demo import phrases\n",
                                 "rlhf_core/demo/phrases.py": ""})) == []
    # ... but a plain import of that package in the same file still is one
    assert circles(file_imports({"rlhf_core/demo/__init__.py": "from rlhf_core.demo.gold import g\n",
                                 "rlhf_core/demo/gold.py": "import rlhf_core.demo\nfrom rlhf_core.demo import phrases\n",
                                 "rlhf_core/demo/phrases.py": ""})) == [["rlhf_core.demo", "rlhf_core.demo.gold"]]
