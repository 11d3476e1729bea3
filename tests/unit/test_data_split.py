"""Stable ids and the prompt-hash split: no leakage, deterministic, fractions roughly respected."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf_core
from rlhf_core.data import (DataPrepConfig, SourceFile, SourceRow, Split, assign_split, pair_id, prepare_data,
                            prompt_id)


REPO = str(Path(rlhf_core.__file__).resolve().parents[1])


def corpus(n_prompts: int, pairs_per_prompt: int = 3) -> SourceFile:
    records = [
        {"prompt": f"User: question {p}?\nAssistant:", "chosen": f" good {k}", "rejected": f" bad {k}"}
        for p in range(n_prompts) for k in range(pairs_per_prompt)
    ]
    return SourceFile("c.jsonl", ("prompt", "chosen", "rejected"), [SourceRow("c.jsonl", i, r) for i, r in enumerate(records)])


def test_ids_are_sha256_of_the_joined_parts() -> None:
    assert prompt_id("hi") == hashlib.sha256(b"hi").hexdigest()[:16]
    assert pair_id("p", "c", "r") == hashlib.sha256(b"p\x1fc\x1fr").hexdigest()[:16]
    assert pair_id("p", "c", "r") != pair_id("pc", "", "r")


def test_split_ids_do_not_depend_on_python_hash_seed() -> None:
    code = "from rlhf_core.data import DataPrepConfig, assign_split, prompt_id; " \
           "print(prompt_id('x'), [assign_split(f'p{i}', DataPrepConfig()).value for i in range(20)])"
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={"PYTHONHASHSEED": seed, "PYTHONPATH": REPO}).stdout for seed in ("1", "2")}
    assert len(outputs) == 1
    assert outputs.pop().startswith(prompt_id("x"))


def test_no_prompt_in_two_splits_and_fractions_roughly_respected() -> None:
    tables = prepare_data([corpus(2000)], DataPrepConfig(train_fraction=0.7, heldout_fraction=0.2, ppo_fraction=0.1))
    train = {p["prompt"] for p in tables.train_pairs}
    heldout = {p["prompt"] for p in tables.heldout_pairs}
    ppo = {p["prompt"] for p in tables.ppo_prompts}
    assert not (train & heldout) and not (train & ppo) and not (heldout & ppo)
    assert len(train | heldout | ppo) == 2000
    assert len(train) / 2000 == pytest.approx(0.7, abs=0.04)
    assert len(heldout) / 2000 == pytest.approx(0.2, abs=0.04)
    assert len(ppo) / 2000 == pytest.approx(0.1, abs=0.03)
    assert tables.counts.ppo_split_pairs == 3 * len(ppo)  # every pair of a PPO prompt went to the PPO split
    assert len({p["prompt_id"] for p in tables.ppo_prompts}) == len(ppo)


def test_split_is_deterministic_and_salt_changes_it() -> None:
    first = prepare_data([corpus(300)], DataPrepConfig())
    again = prepare_data([corpus(300)], DataPrepConfig())
    salted = prepare_data([corpus(300)], DataPrepConfig(split_salt="other"))
    assert first.train_pairs == again.train_pairs and first.ppo_prompts == again.ppo_prompts
    assert first.train_pairs != salted.train_pairs


def test_split_does_not_depend_on_row_order_or_other_rows() -> None:
    config = DataPrepConfig()
    prompts = [f"prompt {i}" for i in range(200)]
    alone = {p: assign_split(p, config) for p in prompts}
    assert {p: assign_split(p, config) for p in reversed(prompts)} == alone


def test_with_prompts_file_the_ppo_share_goes_to_train_and_heldout() -> None:
    config = DataPrepConfig(train_fraction=0.5, heldout_fraction=0.25, ppo_fraction=0.25)
    splits = [assign_split(f"p{i}", config, ppo_from_pairs=False) for i in range(4000)]
    assert Split.PPO not in splits
    assert splits.count(Split.TRAIN) / 4000 == pytest.approx(2 / 3, abs=0.03)
    # a prompt that was TRAIN stays TRAIN: redistribution only widens the buckets
    assert all(assign_split(f"p{i}", config, False) is Split.TRAIN
               for i in range(4000) if assign_split(f"p{i}", config) is Split.TRAIN)


@pytest.mark.parametrize(
    "kwargs",
    [dict(train_fraction=0.5, heldout_fraction=0.2, ppo_fraction=0.2), dict(train_fraction=0.0, heldout_fraction=0.5,
     ppo_fraction=0.5), dict(max_length=0), dict(max_quarantine_fraction=1.5), dict(heldout_fraction=-0.1,
     ppo_fraction=0.3)],
)
def test_config_rejects_bad_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="data"):
        DataPrepConfig(**kwargs)
