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

from rlhf_core.data import PPO_PROMPTS, PREFERENCE_PAIRS, DataPrepConfig
from rlhf_core.demo.config import DemoDataConfig
from rlhf_core.demo.tables import EVAL_PROMPTS, SFT_DEMONSTRATIONS
from tasks import data_prep

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("rlhf_core", "tasks", "flows")
#: Modules that hold gold: the scorer itself and the evaluation helpers built on it.
GOLD_MODULES = frozenset({"rlhf_core.demo.gold", "rlhf_core.evaluation.demo_eval"})
#: Names that carry gold, however they are reached (``from rlhf_core.demo import gold_score``, ``demo.gold_score``).
GOLD_NAMES = frozenset({"gold", "gold_score", "gold_breakdown", "reply_features", "RULES", "demo_eval"})
#: Files allowed to read gold, each by name (a glob like ``tasks/*eval*.py`` would let a new training module in by
#: its name): the demo task, the evaluation module, the evaluation stages (heldout-eval, best-of-n), rm-refresh's
#: gold-judged measurement set, and tasks/sft.py, whose gold report runs after training and goes to its metrics only.
ALLOWED = ("rlhf_core/demo/*", "rlhf_core/evaluation/demo_eval.py", "tasks/heldout_eval.py", "tasks/best_of_n.py",
           "tasks/refresh_eval.py", "tasks/sft.py")
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
    assert {"rlhf_core/training/sft.py", "rlhf_core/training/refresh.py", "tasks/data_prep.py", "tasks/rm_refresh.py",
            "tasks/ppo_iteration.py", "tasks/reward_model.py", "rlhf_core/evaluation/demo_eval.py"} <= found
    # every allowed file exists (a rename must not leave a stale entry that a new file could slip through) ...
    allowed_files = [p for p in ALLOWED if "*" not in p]
    assert [p for p in allowed_files if p not in found] == []
    # ... and the allowed evaluation files really use gold, so the scan is looking at the right names
    for rel_path in ("rlhf_core/evaluation/demo_eval.py", "tasks/heldout_eval.py", "tasks/best_of_n.py",
                     "tasks/refresh_eval.py"):
        source = (REPO / rel_path).read_text(encoding="utf-8")
        assert list(gold_uses(source, rel_path)), rel_path


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
        ("tasks/ppo_iteration.py", "from rlhf_core import demo\nx = demo.gold_score('p', 'r')\n",
         "<attribute>.gold_score"),
        ("tasks/rm_refresh.py", "from rlhf_core.demo import gold_score\n", "rlhf_core.demo.gold_score"),
        ("tasks/rm_refresh.py", "from rlhf_core.evaluation.demo_eval import gold_judged\n",
         "rlhf_core.evaluation.demo_eval.gold_judged"),
        ("tasks/judging.py", "from rlhf_core.demo import gold_score\n", "rlhf_core.demo.gold_score"),
        ("tasks/data_prep.py", "from rlhf_core.demo.gold import gold_score\n", "rlhf_core.demo.gold.gold_score"),
        ("tasks/labelling.py", "from rlhf_core.demo import gold_score\n", "rlhf_core.demo.gold_score"),
        ("rlhf_core/training/refresh.py", "from rlhf_core.evaluation import demo_eval\n",
         "rlhf_core.evaluation.demo_eval"),
        ("tasks/eval_helpers.py", "from rlhf_core.demo import gold_score\n", "rlhf_core.demo.gold_score"),
        ("flows/pipeline.py", "def f():\n    from rlhf_core.demo.gold import gold_score\n",
         "rlhf_core.demo.gold.gold_score"),
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
        ("tasks/best_of_n.py", "from rlhf_core.demo import gold_score\n"),
        ("tasks/refresh_eval.py", "from rlhf_core.evaluation.demo_eval import gold_judged\n"),
        ("tasks/sft.py", "from rlhf_core.evaluation.demo_eval import gold_report\n"),
        ("tasks/data_prep.py", "from rlhf_core.demo import generate_preference_pairs, SimulatedAnnotator\n"),
        ("rlhf_core/training/ppo_step.py", "from rlhf_core.demo import render_prompt\ngolden = 1\n"),
    ],
)
def test_checker_allows_evaluation_code_and_the_annotator(rel_path: str, source: str) -> None:
    assert violations(source, rel_path) == []


def test_training_tables_hold_no_gold_or_hidden_metadata(tmp_path: Path) -> None:
    cfg = data_prep.Config("demo", DataPrepConfig(), demo=DemoDataConfig(n_pairs=120, n_sft=80, n_eval_prompts=12),
                           seed=5)
    result = data_prep.prepare(cfg, tmp_path)
    training = {result.train_pairs: PREFERENCE_PAIRS, result.heldout_pairs: PREFERENCE_PAIRS,
                result.ppo_prompts: PPO_PROMPTS, result.sft_train: SFT_DEMONSTRATIONS,
                result.sft_eval: SFT_DEMONSTRATIONS}
    for relative, schema in training.items():
        names = set(pq.read_schema(tmp_path / relative).names)
        assert names == set(schema.names), relative
        assert not names & LEAKY_COLUMNS, relative
        assert pq.read_metadata(tmp_path / relative).num_rows > 0, relative
    # the metadata exists, but only in the evaluation file (so the column check above would catch a leak)
    eval_columns = set(pq.read_schema(tmp_path / result.eval_prompts).names)
    assert {"intent", "tone"} <= eval_columns & LEAKY_COLUMNS
    assert eval_columns == set(EVAL_PROMPTS.names)
    assert result.eval_prompts == "eval_prompts.parquet"
    assert pq.read_metadata(tmp_path / result.eval_prompts).num_rows == 12
