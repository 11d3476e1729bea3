"""How well the held-out judge ranks policies as gold does, on the runs a sweep (or several) left in a state folder.

    .venv/bin/python -m benchmarks.judge.run --state-dir /tmp/tune     # every completed run there

For every completed run: the final policy's held-out RM mean and gold mean (from its summary), and its evaluation
replies (``eval_samples.parquet`` of its last heldout-eval). Per seed, the Spearman correlation across runs between
the held-out judge's means and gold's says whether choosing settings on the judge would choose what gold prefers.

Beside the judge the runs used (the held-out pairs plus ``reward_model.heldout_onpolicy_pairs`` labelled replies of
the SFT policy), it trains the judge without those pairs (held-out pairs only, the same seed, initialisation and
settings: what the pipeline had before) and scores the same replies, so the two judges are compared on the same
policies. Gold is read here to measure the judges, never to choose settings. Prints JSON and writes
``benchmarks/results/judge.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pandas as pd

from benchmarks.common import default_out, machine, write_result
from rlhf_core.evaluation.metrics import spearman
from rlhf_core.models.roles import init_reward_model
from rlhf_core.models.text import pad_id
from rlhf_core.training.reward_training import train_reward_model
from rlhf_core.data.records import PreferencePair
from tasks.config import load_config
from tasks.io import read_pairs
from tasks.models import load_tokenizer
from tasks.reward_model import pair_scores
from tasks.run_store import RunStore


MIN_RUNS = 3
"""A seed is ranked when it has at least this many completed runs (two give a rank correlation of +-1)."""


def completed_runs(store: RunStore) -> list[dict[str, Any]]:
    """Each completed run's seed, final held-out and gold means, evaluation replies and its inputs' folders."""
    runs = []
    for record in store.list_runs(reconcile=False):
        if record.status != "completed" or not store.summary_file(record.run_id).is_file():
            continue
        summary = json.loads(store.summary_file(record.run_id).read_text())
        last = sorted(label for label in record.stages if label.startswith("heldout-eval-"))[-1]
        samples = pd.read_parquet(store.layout.artifact_dir("heldout-eval", record.stages[last].key)
                                  / "eval_samples.parquet")
        final = summary["iterations"][-1]
        runs.append({"run_id": record.run_id, "seed": summary["seed"], "heldout": final["eval/heldout/mean"],
                     "gold": final["eval/gold/mean"], "replies": list(zip(samples.prompt, samples.policy_reply)),
                     "data": store.layout.artifact_dir("data-prep", record.stages["data-prep"].key),
                     "sft": store.layout.artifact_dir("sft", record.stages["sft"].key),
                     "config": store.config_file(record.run_id)})
    return runs


def plain_judge(run: dict[str, Any]) -> tuple[Any, Any, int]:
    """The held-out RM as trained without on-policy pairs: the held-out pairs, the same init and settings."""
    config = load_config(run["config"])
    training = config.reward_model.heldout
    sft_dir = next(p for p in run["sft"].iterdir() if (p / "config.json").is_file())
    tokenizer = load_tokenizer(sft_dir)
    model, _ = init_reward_model(str(sft_dir), training.seed, pad_token_id=pad_id(tokenizer))
    model.config.pad_token_id = pad_id(tokenizer)
    heldout = read_pairs(run["data"] / "heldout_pairs.parquet")
    train_reward_model(model, tokenizer, heldout, [], training)
    return model.eval(), tokenizer, training.max_length


def mean_score(model: Any, tokenizer: Any, max_length: int, replies: list[tuple[str, str]]) -> float:
    chosen, _ = pair_scores(model, tokenizer, [PreferencePair(p, r, r) for p, r in replies], max_length)
    return statistics.fmean(chosen)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = completed_runs(RunStore(args.state_dir))
    per_seed: dict[str, Any] = {}
    groups = {seed: [r for r in runs if r["seed"] == seed] for seed in sorted({r["seed"] for r in runs})}
    skipped = {str(seed): len(group) for seed, group in groups.items() if len(group) < MIN_RUNS}
    if len(skipped) == len(groups):
        raise SystemExit(f"no seed under {args.state_dir} has {MIN_RUNS} or more completed runs to rank "
                         f"(completed runs per seed: {skipped or 'none'})")
    for seed, group in groups.items():
        if str(seed) in skipped:
            continue
        model, tokenizer, max_length = plain_judge(group[0])
        plain = [mean_score(model, tokenizer, max_length, r["replies"]) for r in group]
        gold, judge = [r["gold"] for r in group], [r["heldout"] for r in group]
        per_seed[str(seed)] = {"runs": len(group), "spearman_judge_gold": spearman(judge, gold),
                               "spearman_plain_judge_gold": spearman(plain, gold),
                               "gold_of_judge_choice": group[max(range(len(group)), key=judge.__getitem__)]["gold"],
                               "gold_of_plain_choice": group[max(range(len(group)), key=plain.__getitem__)]["gold"],
                               "best_gold": max(gold)}
    write_result({"machine": machine(), "state_dir": str(args.state_dir), "per_seed": per_seed,
                  "skipped_seeds": skipped},
                 args.out or default_out("judge", smoke=False))


if __name__ == "__main__":
    main()
