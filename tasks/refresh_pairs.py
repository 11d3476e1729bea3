"""The rm-refresh stage's data: fresh on-policy reply pairs, labelled, validated and split by prompt.

Two replies of the current policy per seeded PPO prompt are checked like any preference data before anyone
labels them, labelled by ``refresh.annotator`` (simulated, rm_judge in process; file: exported, then imported
once people have labelled them), split by prompt into refresh-train (less a validation share) and
on-policy-eval, and joined with the earlier refreshes' pairs, replayed original pairs and the held-out pairs.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from rlhf_core.data import PREFERENCE_PAIRS, QUARANTINE, QuarantineReason, SourceRow
from rlhf_core.data.schema import CHOSEN, PROMPT, REASON, REJECTED
from rlhf_core.demo.annotator import SimulatedAnnotator
from rlhf_core.evaluation.annotators import (Annotator, PerPairAnnotator, ReplyPair, RewardModelJudge, preference_pairs,
                                             sample_reply_pairs)
from rlhf_core.models.roles import freeze, load_policy, load_reward_model
from rlhf_core.training.reward_training import PreferencePair
from tasks.config import PipelineConfig
from tasks.io import read_frame, read_parquet, write_parquet
from tasks.labelling import export_unlabelled, import_labels, preference_rows, to_pairs, validate_preferences
from tasks.reward_model import read_pairs
from tasks.runtime import device_of, dtype_of, local_model

STAGE = "rm-refresh"
UNLABELLED_STEM = "unlabelled_pairs"
SKIPPED_FILE = "sampling_quarantine.parquet"

Record = dict[str, object]


class LabelsPendingError(RuntimeError):
    """The file annotator exported pairs and waits for people to label them (a retry cannot help)."""

    def __init__(self, message: str, exported_path: str) -> None:
        super().__init__(message)
        self.exported_path = exported_path
        """The unlabelled pairs file to fill in."""


@dataclass(frozen=True)
class _Fresh:
    """Labelled, validated fresh pairs, every rejected one with its reason, and the counts."""

    records: list[Record]
    quarantine: list[Record]
    counts: dict[str, float]


@dataclass(frozen=True)
class RefreshData:
    """What the continued training and the before/after measurements read."""

    train: list[PreferencePair]
    """Fresh refresh-train pairs (less the validation ones), the earlier refreshes' train pairs, then the
    replayed old pairs."""
    validation: list[PreferencePair]
    """Fresh pairs that choose the epoch to keep (``refresh.validation_fraction``; empty = keep the last)."""
    onpolicy: list[PreferencePair]
    """Fresh on-policy-eval pairs (their prompts are not in ``train``'s fresh part)."""
    heldout: list[PreferencePair]
    """The original held-out pairs."""
    tables: dict[str, str]
    """Parquet tables written for this refresh (logged as artifacts)."""
    counts: dict[str, float]
    """``refresh/n_*`` and ``labels/*`` counts."""


def prepare_refresh_data(config: PipelineConfig, iteration: int, policy_uri: str, heldout_rm_uri: str,
                         train_pairs: str, heldout_pairs: str, ppo_prompts: str, here: Path,
                         earlier_pairs: Sequence[str] = ()) -> RefreshData:
    """Fresh labelled pairs split by prompt into refresh-train (less a validation share) and on-policy-eval,
    the earlier refreshes' train pairs, the replayed old pairs and the held-out pairs; the fresh tables
    (refresh-train with its validation pairs, which later refreshes train on) and the quarantine are written
    under ``here``."""
    section, seed = config.refresh, config.seed * 1000 + iteration
    fresh = collect_fresh_pairs(config, iteration, policy_uri, heldout_rm_uri, ppo_prompts, here)
    train_new, eval_new = split_by_prompt(fresh.records, section.on_policy_eval_fraction, seed)
    fit_new, validation = (split_by_prompt(train_new, section.validation_fraction, seed + 1)
                           if section.validation_fraction > 0 else (train_new, []))
    earlier = [pair for path in earlier_pairs for pair in read_pairs(path)]
    n_fresh = len(fit_new) + len(earlier)
    replay = replay_sample(read_pairs(train_pairs), n_fresh, config, seed) if section.keep_old_pairs else []
    tables = {"train": write_parquet(train_new, PREFERENCE_PAIRS, here / "refresh_train_pairs.parquet"),
              "eval": write_parquet(eval_new, PREFERENCE_PAIRS, here / "onpolicy_eval_pairs.parquet"),
              "quarantine": write_parquet(fresh.quarantine, QUARANTINE, here / "refresh_quarantine.parquet")}
    counts = {**fresh.counts, "refresh/n_new_pairs": float(len(fresh.records)),
              "refresh/n_train_new": float(len(fit_new)), "refresh/n_validation": float(len(validation)),
              "refresh/n_onpolicy_eval": float(len(eval_new)),
              "refresh/n_earlier_refresh_pairs": float(len(earlier)), "refresh/n_old_replayed": float(len(replay))}
    return RefreshData(to_pairs(fit_new) + earlier + replay, to_pairs(validation), to_pairs(eval_new),
                 read_pairs(heldout_pairs), tables, counts)


def collect_fresh_pairs(config: PipelineConfig, iteration: int, policy_uri: str, heldout_rm_uri: str,
                        ppo_prompts: str, here: Path) -> _Fresh:
    """Sample on-policy pairs and label them with ``refresh.annotator`` (file: import, or export and stop)."""
    section = config.refresh
    if section.annotator == "file" and section.labels_file is not None:
        return _imported(config, iteration, here)
    candidates, skipped = sample_candidates(config, iteration, policy_uri, ppo_prompts, here)
    if section.annotator == "file":
        exported = export_unlabelled(candidates, here / f"{UNLABELLED_STEM}.{section.export_format}")
        raise LabelsPendingError(
            f"rm-refresh iteration {iteration}: {len(candidates)} unlabelled on-policy pairs were exported to "
            f"{exported}. Fill its 'label' column with 'a' (reply_a is better) or 'b' (reply_b is better) for each "
            "row (instructions: tasks/labelling.py), save it as CSV or Parquet, and resume the same run with "
            f"refresh.labels_file=<the labelled file>", exported)
    prefers_a = build_annotator(config, iteration, heldout_rm_uri).label(candidates)
    source = f"{STAGE}-{iteration}:{section.annotator}"
    judged = preference_rows(source, preference_pairs(candidates, prefers_a))
    records, rejected = validate_preferences(source, judged, config.data.prep)
    counts = {**_skip_counts(skipped, len(candidates) + len(skipped)),
              "refresh/label_a_fraction": sum(prefers_a) / len(prefers_a), "labels/rows_in": float(len(judged)),
              "labels/accepted": float(len(records)), "labels/quarantined": float(len(rejected))}
    return _Fresh(records, skipped + rejected, counts)


def sample_candidates(config: PipelineConfig, iteration: int, policy_uri: str, ppo_prompts: str,
                      here: Path) -> tuple[list[ReplyPair], list[Record]]:
    """Two replies of the current policy to each of ``refresh.n_pairs`` seeded PPO prompts, checked like any
    preference data *before* anyone labels them: pairs with identical or empty replies, exact repeats and the
    like are skipped with their reason (returned, and written to ``here/sampling_quarantine.parquet``)."""
    prompts = read_frame(ppo_prompts, ["prompt"])["prompt"].tolist()
    if not prompts:
        raise ValueError(f"PPO prompt table {ppo_prompts} is empty; rm-refresh samples its pairs from these prompts")
    seed = config.seed * 1000 + iteration
    drawn = draw_prompts(prompts, config.refresh.n_pairs, random.Random(f"{STAGE}:{seed}"))
    policy_dir = local_model(policy_uri)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = freeze(load_policy(policy_dir, dtype_of(config)).to(device_of(config)))
    sampled = sample_reply_pairs(policy, tokenizer, drawn, config.ppo.generation, seed)
    source = f"{STAGE}-{iteration}:sampled"
    rows = [SourceRow(source, i, {PROMPT: p.prompt, CHOSEN: p.reply_a, REJECTED: p.reply_b})
            for i, p in enumerate(sampled)]
    records, skipped = validate_preferences(source, rows, config.data.prep)
    write_parquet(skipped, QUARANTINE, here / SKIPPED_FILE)
    if not records:
        raise ValueError(f"none of the {len(sampled)} on-policy reply pairs is usable (reasons in "
                         f"{here / SKIPPED_FILE}); a collapsed policy repeats itself: raise "
                         "ppo.generation.temperature or refresh.n_pairs")
    return [ReplyPair(str(r[PROMPT]), str(r[CHOSEN]), str(r[REJECTED])) for r in records], skipped


def _skip_counts(skipped: Sequence[Mapping[str, object]], n_sampled: int) -> dict[str, float]:
    """``refresh/n_sampled``, ``refresh/n_skipped``, ``refresh/n_identical_skipped``, ``refresh/skipped/<reason>``."""
    by_reason = Counter(str(r[REASON]) for r in skipped)
    return {"refresh/n_sampled": float(n_sampled), "refresh/n_skipped": float(len(skipped)),
            "refresh/n_identical_skipped": float(by_reason[QuarantineReason.IDENTICAL_PAIR.value]),
            **{f"refresh/skipped/{reason}": float(n) for reason, n in sorted(by_reason.items())}}


def draw_prompts(prompts: Sequence[str], n: int, rng: random.Random) -> list[str]:
    """``n`` prompts without repeats when there are enough, else every prompt as often as needed (shuffled)."""
    if len(prompts) >= n:
        return rng.sample(list(prompts), n)
    drawn: list[str] = []
    while len(drawn) < n:
        drawn += rng.sample(list(prompts), len(prompts))
    return drawn[:n]


def build_annotator(config: PipelineConfig, iteration: int, heldout_rm_uri: str) -> Annotator:
    """The configured in-process annotator: the simulated one (demo) or a reward-model judge."""
    section = config.refresh
    if section.annotator == "simulated":
        # The demo's human stand-in: its labels are the only thing training ever sees of gold.
        return PerPairAnnotator(SimulatedAnnotator(section.annotator_temperature, seed=config.seed * 1000 + iteration))
    if section.annotator == "rm_judge":
        judge_dir = local_model(section.judge_model or heldout_rm_uri)
        judge = freeze(load_reward_model(judge_dir, dtype_of(config)).to(device_of(config)))
        return RewardModelJudge(judge, AutoTokenizer.from_pretrained(judge_dir), config.reward_model.heldout.max_length,
                                config.eval.batch_size)
    raise ValueError(f"refresh.annotator={section.annotator!r} labels through files (tasks/labelling.py), "
                     "not in process")


def _imported(config: PipelineConfig, iteration: int, here: Path) -> _Fresh:
    """The labelled file of an earlier export, with the pairs that export skipped."""
    section = config.refresh
    exported = here / f"{UNLABELLED_STEM}.{section.export_format}"
    if not exported.is_file():
        raise FileNotFoundError(f"refresh.labels_file is set but this run exported no pairs at {exported}; rerun "
                                "rm-refresh without refresh.labels_file to export them, label that file, then resume")
    labels = import_labels(section.labels_file.replace("{iteration}", str(iteration)), str(exported),
                           config.data.prep)
    skipped = read_parquet(here / SKIPPED_FILE, QUARANTINE) if (here / SKIPPED_FILE).is_file() else []
    counts = {**_skip_counts(skipped, labels.n_exported + len(skipped)), **labels.counts()}
    return _Fresh(labels.records, skipped + labels.quarantine, counts)


def split_by_prompt(records: Sequence[Record], eval_fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """(refresh-train, on-policy-eval) records; a prompt's pairs all land on one side, so eval is unseen."""
    prompts = list(dict.fromkeys(str(r[PROMPT]) for r in records))
    if len(prompts) < 2:
        raise ValueError(f"rm-refresh needs labelled pairs on at least 2 prompts (one to train on, one to evaluate "
                         f"on), got {len(prompts)}; raise refresh.n_pairs or check the refresh quarantine table")
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: min(len(prompts) - 1, max(1, round(eval_fraction * len(prompts))))])
    return [r for r in records if r[PROMPT] not in held], [r for r in records if r[PROMPT] in held]


def replay_sample(old: Sequence[PreferencePair], n_new: int, config: PipelineConfig, seed: int) -> list[PreferencePair]:
    """A seeded sample of ``refresh.old_pairs_ratio * n_new`` original training pairs (at most all of them)."""
    k = min(len(old), round(config.refresh.old_pairs_ratio * n_new))
    return random.Random(seed).sample(list(old), k)
