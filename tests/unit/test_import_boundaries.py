"""One-way imports, checked on the AST: flows -> tasks -> rlhf_core, and nothing imports infra.

rlhf_core is pure (stdlib, numpy, torch, transformers): no prefect, mlflow, pandas, pyarrow, and no
tasks/flows. deepspeed and peft are allowed only inside the adapter modules named in ADAPTERS.
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
