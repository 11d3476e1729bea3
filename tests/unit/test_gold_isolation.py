"""Gold stays on the evaluation side: no training code imports the gold scorer, no training table holds it.

The demo task's gold scorer (``rlhf_core.demo.gold``) and the evaluation module built on it
(``rlhf_core.evaluation.demo_eval``) may be imported only by the demo task itself and by evaluation code. The simulated
annotator inside ``rlhf_core/demo/`` reads gold on purpose: it plays the human labeller.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhf_core.data import PPO_PROMPTS, PREFERENCE_PAIRS
from rlhf_core.demo.config import DemoDataConfig
from tasks.demo_data import EVAL_PROMPTS, SFT_DEMONSTRATIONS, run_demo_data_prep

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("rlhf_core", "tasks", "flows")
#: Modules that hold gold: the scorer itself and the evaluation helpers built on it.
GOLD_MODULES = frozenset({"rlhf_core.demo.gold", "rlhf_core.evaluation.demo_eval"})
#: Names that carry gold, however they are reached (``from rlhf_core.demo import gold_score``, ``demo.gold_score``).
GOLD_NAMES = frozenset({"gold", "gold_score", "gold_breakdown", "reply_features", "RULES", "demo_eval"})
#: Files allowed to read gold: the demo task, the evaluation module, and evaluation stages. tasks/sft.py is one:
#: its gold report runs after training and goes to sft_metrics.json only.
ALLOWED = ("rlhf_core/demo/*", "rlhf_core/evaluation/demo_eval.py", "tasks/*eval*.py", "tasks/sft.py")
#: Columns that would leak gold or the hidden prompt metadata into training.
LEAKY_COLUMNS = frozenset({"gold", "gold_score", "score", "quality", "intent", "tone", "product", "other_product",
                           "order", "device", "message", "correct_action"})


def _absolute(node: ast.ImportFrom, rel_path: str) -> str:
    """Absolute module of a (possibly relative) ``from ... import``."""
    if node.level == 0:
        return node.module or ""
    package = rel_path[: -len(".py")].split("/")[:-1]  # x.py and __init__.py both sit in their package
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def gold_uses(source: str, rel_path: str) -> Iterator[tuple[int, str]]:
    """(line, what) for every import of a gold module or gold name, and every ``x.<gold name>`` access."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name in GOLD_MODULES)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, rel_path)
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if module in GOLD_MODULES or full in GOLD_MODULES or alias.name in GOLD_NAMES:
                    yield node.lineno, full
        elif isinstance(node, ast.Attribute) and node.attr in GOLD_NAMES - {"gold"}:  # x.gold is too common a name
            yield node.lineno, f"<attribute>.{node.attr}"


def violations(source: str, rel_path: str) -> list[str]:
    """``path:line: uses X`` for each gold use in a file that may not read gold."""
    if any(fnmatch(rel_path, pattern) for pattern in ALLOWED):
        return []
    return [f"{rel_path}:{line}: uses {what}" for line, what in gold_uses(source, rel_path)]


def layer_files() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (REPO / layer).rglob("*.py"))


def test_no_training_module_reads_gold() -> None:
    found = []
    for path in layer_files():
        rel_path = path.relative_to(REPO).as_posix()
        found += violations(path.read_text(encoding="utf-8"), rel_path)
    assert not found, ("gold is for evaluation only; move these uses into rlhf_core/evaluation/demo_eval.py:\n"
                       + "\n".join(found))


def test_the_walk_sees_training_and_evaluation_modules() -> None:
    found = {p.relative_to(REPO).as_posix() for p in layer_files()}
    assert {"rlhf_core/training/sft.py", "tasks/demo_data.py", "tasks/data_prep.py",
            "rlhf_core/evaluation/demo_eval.py"} <= found
    # the allowed evaluation module really does use gold, so the scan is looking at the right names
    source = (REPO / "rlhf_core/evaluation/demo_eval.py").read_text(encoding="utf-8")
    assert any("gold_score" in what for _, what in gold_uses(source, "rlhf_core/evaluation/demo_eval.py"))


@pytest.mark.parametrize(
    ("rel_path", "source", "what"),
    [
        ("rlhf_core/training/ppo_step.py", "from rlhf_core.demo import gold_score\n", "rlhf_core.demo.gold_score"),
        ("rlhf_core/training/ppo_step.py", "from rlhf_core.demo.gold import RULES\n", "rlhf_core.demo.gold.RULES"),
        ("rlhf_core/training/ppo_step.py", "import rlhf_core.demo.gold\n", "rlhf_core.demo.gold"),
        ("rlhf_core/training/ppo_step.py", "from rlhf_core.evaluation import demo_eval\n",
         "rlhf_core.evaluation.demo_eval"),
        ("rlhf_core/sub/x.py", "from ..demo import gold_breakdown\n", "rlhf_core.demo.gold_breakdown"),
        ("tasks/reward_model.py", "from rlhf_core.evaluation.demo_eval import gold_summary\n",
         "rlhf_core.evaluation.demo_eval.gold_summary"),
        ("tasks/ppo.py", "from rlhf_core import demo\nx = demo.gold_score('p', 'r')\n", "<attribute>.gold_score"),
        ("flows/pipeline.py", "def f():\n    from rlhf_core.demo.gold import gold_score\n", "rlhf_core.demo.gold.gold_score"),
    ],
)
def test_checker_flags_gold_in_training_code(rel_path: str, source: str, what: str) -> None:
    assert [v.split(": uses ")[1] for v in violations(source, rel_path)] == [what]


@pytest.mark.parametrize(
    ("rel_path", "source"),
    [
        ("rlhf_core/demo/annotator.py", "from rlhf_core.demo.gold import gold_score\n"),
        ("rlhf_core/evaluation/demo_eval.py", "from rlhf_core.demo.gold import gold_breakdown, gold_score\n"),
        ("tasks/heldout_eval.py", "from rlhf_core.evaluation.demo_eval import gold_report\n"),
        ("tasks/demo_data.py", "from rlhf_core.demo import generate_preference_pairs, SimulatedAnnotator\n"),
        ("rlhf_core/training/ppo_step.py", "from rlhf_core.demo import render_prompt\ngolden = 1\n"),
    ],
)
def test_checker_allows_evaluation_code_and_the_annotator(rel_path: str, source: str) -> None:
    assert violations(source, rel_path) == []


def test_training_tables_hold_no_gold_or_hidden_metadata(tmp_path: Path) -> None:
    result = run_demo_data_prep(tmp_path, DemoDataConfig(n_pairs=120, n_sft=80, n_eval_prompts=12), seed=5)
    training = {result.prep.train_pairs: PREFERENCE_PAIRS, result.prep.heldout_pairs: PREFERENCE_PAIRS,
                result.prep.ppo_prompts: PPO_PROMPTS, result.sft_train: SFT_DEMONSTRATIONS,
                result.sft_eval: SFT_DEMONSTRATIONS}
    for path, schema in training.items():
        names = set(pq.read_schema(path).names)
        assert names == set(schema.names), path
        assert not names & LEAKY_COLUMNS, path
    # the metadata exists, but only in the evaluation file (so the column check above would catch a leak)
    eval_columns = set(pq.read_schema(result.eval_prompts).names)
    assert {"intent", "tone"} <= eval_columns & LEAKY_COLUMNS
    assert eval_columns == set(EVAL_PROMPTS.names)
    assert Path(result.eval_prompts).name == "eval_prompts.parquet"
