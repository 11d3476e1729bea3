"""The README is a user guide that must stay true: its code imports, its config examples load."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from tasks.config import load_config
from tests.tiny_models import gpt2_config, save_model_dir, word_tokenizer

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_ppo_in_a_few_lines_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The snippet, unchanged, on a tiny policy and reward model saved where it looks for them; run twice, the
    second call resumes from the checkpoint the first one finished with."""
    block = README.split("## PPO in a few lines", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    torch.manual_seed(0)
    save_model_dir(GPT2LMHeadModel(gpt2_config(len(word_tokenizer()))), word_tokenizer(), tmp_path / "path/to/sft")
    save_model_dir(GPT2ForSequenceClassification(gpt2_config(len(word_tokenizer()), num_labels=1)), word_tokenizer(),
                   tmp_path / "path/to/rm")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    history = namespace["result"].history
    assert len(history) == 6 and all(math.isfinite(step["ppo/kl/mean"]) for step in history)
    assert (tmp_path / "state/ppo/latest").exists()
    exec(compile(block, "README.md", "exec"), again := {})
    assert again["result"].resumed_from_step == 6 and again["result"].history == history


#: ``rlhf sweep --grid KEY=V1,V2`` examples: each value is an override of its own.
GRIDS = re.findall(r"--grid ((?:[a-z_]+\.)+[a-z_]+)=([^\s`]+)", README)
EXAMPLES = sorted(set(re.findall(r"`((?:[a-z_]+\.)+[a-z_]+=[^`\s]+)`", README)) |
                  {m for m in re.findall(r"(?<=\s)((?:[a-z_]+\.)+[a-z_]+=[^\s`]+)", README) if "/" not in m}
                  - {f"{key}={values}" for key, values in GRIDS}
                  | {f"{key}={value}" for key, values in GRIDS for value in values.split(",")})


#: Settings the README shows next to an example that needs them.
COMPANIONS = {"refresh.labels_file": ["refresh.annotator=file"],
              "distributed.num_processes": ["distributed.deepspeed_config=infra/deepspeed/zero2.json"],
              "ppo.advantage=grpo": ["ppo.samples_per_prompt=4"], "ppo.advantage=rloo": ["ppo.samples_per_prompt=4"],
              "ppo.kl.placement": ["ppo.kl.estimator=k3"]}


@pytest.mark.parametrize("override", EXAMPLES)
def test_every_config_example_in_the_readme_loads(override: str):
    companions = next((c for key, c in COMPANIONS.items() if override == key or override.startswith(key + "=")), [])
    load_config(None, "tiny", [*companions, override])


def test_the_examples_were_found():
    assert {"ppo.kl.coef=0.1", "sft.learning_rate=2e-3", "ppo.iterations=5"} <= set(EXAMPLES)
    assert GRIDS and {"ppo.learning_rate=1e-4", "ppo.learning_rate=3e-4"} <= set(EXAMPLES)


def test_the_layout_table_names_every_module_of_tasks():
    """README's layout row of ``tasks/`` names each of its modules and packages (a new module goes into the guide)."""
    row = next(line for line in README.splitlines() if line.startswith("| `tasks/` |"))
    tasks = Path(__file__).resolve().parents[2] / "tasks"
    names = {p.stem for p in tasks.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in tasks.iterdir() if (p / "__init__.py").is_file()}
    assert names and sorted(n for n in names if f"`{n}" not in row) == []


#: What a reader of the repository cannot open: a tracker's issue numbers and files outside the repository.
OUTSIDE = re.compile("|".join([r"\bissues?\s+#?\d", r"\bissue's\b", r"PPO_" + "NOTES", r"\.\./shared"]),
                     re.IGNORECASE)


def test_no_doc_or_comment_names_an_issue_or_a_file_outside_the_repository():
    root = Path(__file__).resolve().parents[2]
    files = [root / "README.md", root / "pyproject.toml", *root.glob("docs/*.md"), *root.glob("infra/**/*.yaml"),
             *(path for package in ("rlhf_core", "tasks", "flows", "benchmarks", "tests")
               for path in (root / package).rglob("*.py"))]
    found = [f"{path.relative_to(root)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]
    assert found == []
