"""A stage's code version is a digest of the code it runs: its module and the project modules it imports, without
comments or docstrings. A documentation edit reruns nothing; a code edit reruns the stages that reach it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tasks.run_store.code_digest import closure, code_digest, imported_modules
from tasks.run_store.keys import CODE_PACKAGES, CODE_ROOT, code_version

STAGES = ["data_prep", "sft", "reward_model", "best_of_n", "ppo_iteration", "dpo", "heldout_eval", "rm_refresh"]


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    """A copy of the algorithm and task packages to edit."""
    for package in CODE_PACKAGES:
        shutil.copytree(CODE_ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def versions(root: Path) -> dict[str, str]:
    return {stage: code_digest(root, sorted(closure(root, f"tasks.{stage}", CODE_PACKAGES))) for stage in STAGES}


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, old
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def test_comments_docstrings_and_layout_change_no_stage_key(checkout: Path):
    before = versions(checkout)
    edit(checkout / "tasks/plots.py", "from __future__ import annotations\n",
         "from __future__ import annotations\n\n# A comment a reader asked for.\n")
    edit(checkout / "rlhf_core/ppo/losses.py", '"""', '"""An edited first line of the docstring.\n\n')
    edit(checkout / "rlhf_core/config/ppo.py", '    """Longest response;', '    """The longest response;')
    edit(checkout / "rlhf_core/config/ppo.py", "    max_new_tokens: PositiveInt = 48\n",
         "    max_new_tokens: PositiveInt = 48  # tokens, not characters\n")
    edit(checkout / "tasks/ppo_iteration.py", "\ndef ", "\n\n\ndef ")  # blank lines: layout only
    assert versions(checkout) == before


def test_a_code_edit_reruns_exactly_the_stages_that_reach_it(checkout: Path):
    """best-of-N's selection code is reached by the best-of-n stage alone; the KL estimators by every stage
    (the config names them); a stage's own module by that stage alone."""
    before = versions(checkout)
    reach = {stage for stage in STAGES
             if "rlhf_core.evaluation.best_of_n" in closure(checkout, f"tasks.{stage}", CODE_PACKAGES)}
    assert reach == {"best_of_n"}
    edit(checkout / "rlhf_core/evaluation/best_of_n.py", "\ndef ", "\nSENTINEL = 1\n\n\ndef ")
    after = versions(checkout)
    assert {stage for stage in STAGES if after[stage] != before[stage]} == {"best_of_n"}
    edit(checkout / "tasks/ppo_iteration.py", "\ndef ", "\nSENTINEL = 1\n\n\ndef ")
    again = versions(checkout)
    assert {stage for stage in STAGES if again[stage] != after[stage]} == {"ppo_iteration"}
    edit(checkout / "rlhf_core/ppo/kl.py", "\ndef ", "\nSENTINEL = 1\n\n\ndef ")
    changed = {stage for stage in STAGES if versions(checkout)[stage] != again[stage]}
    assert changed == {s for s in STAGES if "rlhf_core.ppo.kl" in closure(checkout, f"tasks.{s}", CODE_PACKAGES)}


def test_an_edit_to_the_ppo_losses_reruns_the_training_stages_and_not_data_prep_or_sft(checkout: Path):
    """The clipped losses and the Bradley-Terry loss are run by reward-model training, PPO and the refresh; the stages
    downstream of those take a new key through their inputs. Data-prep, SFT, DPO, best-of-N and held-out evaluation
    run none of it and keep their code version."""
    before = versions(checkout)
    edit(checkout / "rlhf_core/ppo/losses.py", "\ndef ", "\nSENTINEL = 1\n\n\ndef ")
    after = versions(checkout)
    assert {stage for stage in STAGES if after[stage] != before[stage]} == {"reward_model", "ppo_iteration",
                                                                             "rm_refresh"}


def test_an_edit_to_the_advantage_estimators_reruns_ppo_alone(checkout: Path):
    """GAE and the critic-free estimators are PPO's: no other stage's code reaches them (the reward-model stage
    launches its workers through its own job module, the shared loaders build no PPO model, and the optimizer
    path every loop steps through holds no rollout code), so no other stage's code version changes."""
    before = versions(checkout)
    edit(checkout / "rlhf_core/ppo/advantages.py", "\ndef ", "\nSENTINEL = 1\n\n\ndef ")
    after = versions(checkout)
    assert {stage for stage in STAGES if after[stage] != before[stage]} == {"ppo_iteration"}


def test_a_docstring_naming_a_module_adds_nothing_to_the_closure(checkout: Path):
    (checkout / "tasks/quiet_stage.py").write_text(
        '"""Runs like ``tasks.distributed_train`` would, but in process."""\n\n'
        'def compute():\n    """See \'rlhf_core.training.ppo_loop\'."""\n    return 1\n', encoding="utf-8")
    assert imported_modules(checkout, "tasks.quiet_stage", CODE_PACKAGES) == set()


def test_imports_inside_functions_and_modules_named_in_strings_count(checkout: Path):
    """A lazy import in a function body is an import; a module a stage starts by name (``python -m``) or a package
    exports lazily (``importlib``) is named by a string, and counts too."""
    (checkout / "tasks/lazy_stage.py").write_text(
        "def compute():\n    from rlhf_core.ppo.advantages import gae\n    return gae\n\n"
        "WORKER = ['-m', 'tasks.distributed_train']\n"
        "def roles():\n    import importlib\n    return importlib.import_module('rlhf_core.models.roles')\n",
        encoding="utf-8")
    found = imported_modules(checkout, "tasks.lazy_stage", CODE_PACKAGES)
    assert {"rlhf_core", "rlhf_core.ppo", "rlhf_core.ppo.advantages", "tasks", "tasks.distributed_train",
            "rlhf_core.models", "rlhf_core.models.roles"} <= found


def test_the_pipeline_keys_come_from_each_stages_module():
    from tasks import data_prep, ppo_iteration

    assert data_prep.STAGE.module == "tasks.data_prep" and ppo_iteration.STAGE.module == "tasks.ppo_iteration"
    assert code_version("tasks.data_prep") != code_version("tasks.ppo_iteration")
    assert code_version("no.such.module") == code_version()  # a stage outside the checkout: every module counts
