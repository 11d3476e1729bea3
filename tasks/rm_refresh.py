"""The rm-refresh stage: label fresh on-policy reply pairs and continue training the proxy reward model on them.

PPO pushes the policy towards replies the proxy RM was never trained on, which is where the proxy goes wrong
(reward hacking). This stage samples two replies per prompt from the *current* policy, has ``refresh.annotator``
pick the better one (simulated: the demo's annotator; rm_judge: a reward model; file: people, through an exported
file), validates the labels like any preference data, and splits the fresh pairs by prompt into refresh-train and
on-policy-eval (``rlhf_core.training.refresh``). The proxy is measured on the on-policy-eval and held-out pairs,
trained further on the fresh pairs (plus this run's earlier refreshes' pairs and replayed old ones), and measured
again. It is *promoted* (becomes the RM of the next PPO iteration, and ``champion`` when published) only when its
held-out accuracy holds.

With ``refresh.annotator='file'`` and no ``refresh.labels_file`` the stage exports the unlabelled pairs and stops
with :class:`LabelsPendingError` naming the file; label it (``tasks/labelling.py`` says how) and resume the run
with ``refresh.labels_file=<labelled copy>``.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig, RewardTrainingConfig
from rlhf_core.data import (
    PREFERENCE_PAIRS,
    QUARANTINE,
    DataPrepConfig,
    QuarantineReason,
    SourceRow,
)
from rlhf_core.data.schema import CHOSEN, PROMPT, REASON, REJECTED
from rlhf_core.demo.annotator import SimulatedAnnotator
from rlhf_core.evaluation.annotators import (
    Annotator,
    PerPairAnnotator,
    ReplyPair,
    RewardModelJudge,
    preference_pairs,
    sample_reply_pairs,
)
from rlhf_core.models.families import score_prefix
from rlhf_core.models.roles import freeze, load_reward_model
from rlhf_core.training.refresh import (
    draw_prompts,
    promotion,
    refresh_seed,
    replay_sample,
    split_by_prompt,
    training_config,
)
from rlhf_core.training.reward_training import encode_pairs, evaluate_reward_model, train_reward_model
from rlhf_core.data.records import PreferencePair
from tasks.config import PipelineConfig, RefreshSection
from tasks.io import read_pairs, read_parquet, read_prompts, write_json, write_parquet
from tasks.labelling import (
    export_unlabelled,
    import_labels,
    preference_rows,
    to_pairs,
    validate_preferences,
)
from tasks.models import load_frozen_lm, load_tokenizer, reward_members, save_ensemble
from tasks.refresh_eval import gold_judged_onpolicy
from tasks.run_store import Artifact, LocalPath
from tasks.runtime import ModelInput, Runtime, local_model
from tasks.stage import Publication, Stage, StageContext, stage_task

log = logging.getLogger(__name__)

NAME = "rm-refresh"
MODEL_DIR, METRICS_FILE = "reward_model", "metrics.json"
TRAIN_FILE, EVAL_FILE, QUARANTINE_FILE = ("refresh_train_pairs.parquet", "onpolicy_eval_pairs.parquet",
                                          "refresh_quarantine.parquet")
UNLABELLED_STEM, SKIPPED_FILE = "unlabelled_pairs", "sampling_quarantine.parquet"
EVALS_PER_TRAINING = 4
"""On-policy evaluations during the continued training (plus the final one)."""

Record = dict[str, object]


class LabelsPendingError(RuntimeError):
    """The file annotator exported pairs and waits for people to label them (a retry cannot help)."""

    def __init__(self, message: str, exported_path: str) -> None:
        super().__init__(message)
        self.exported_path = exported_path


@dataclass(frozen=True)
class Config:
    refresh: RefreshSection
    training: RewardTrainingConfig
    """``reward_model.training`` with the refresh's epochs, learning rate, per-iteration seed, best-epoch choice."""
    prep: DataPrepConfig
    """``data.prep``: fresh pairs are validated like any preference data."""
    generation: GenerationConfig
    """``ppo.generation``: how the policy samples its replies."""
    runtime: Runtime
    seed: int
    iteration: int
    """The PPO iteration whose policy writes the fresh pairs."""
    labels_file: LocalPath | None = None
    """file annotator: ``refresh.labels_file`` for this iteration (its content is part of the key)."""
    judge_max_length: int | None = None
    """rm_judge: tokens the judge reads (``reward_model.heldout.max_length``)."""
    judge_batch_size: int | None = None
    """rm_judge: replies scored at once (``eval.batch_size``)."""
    judge_max_tokens: int | None = None
    """rm_judge: most tokens in one scoring forward (``eval.max_tokens_per_forward``; None = rows only)."""
    gold: bool = False
    """The demo task: also measure the RM against gold's verdicts (never trained on)."""

    @classmethod
    def of(cls, config: PipelineConfig, iteration: int) -> Config:
        section, judge = config.refresh, config.refresh.annotator == "rm_judge"
        training = training_config(config.reward_model.training, iteration, section.epochs, section.learning_rate,
                                   section.validation_fraction > 0)
        labels = section.labels_file.replace("{iteration}", str(iteration)) if section.labels_file else None
        return cls(section, training, config.data.prep, config.ppo.generation, Runtime.of(config), config.seed,
                   iteration, labels, config.reward_model.heldout.max_length if judge else None,
                   config.eval.batch_size if judge else None, config.eval.max_tokens_per_forward if judge else None,
                   config.data.source == "demo")


@dataclass(frozen=True)
class Inputs:
    data: Artifact
    """data-prep: the original train pairs (replayed), held-out pairs (promotion), PPO prompts (fresh pairs)."""
    policy: ModelInput
    """The policy of this iteration: writes the fresh replies."""
    proxy: ModelInput
    """The proxy RM now in use: trained further."""
    judge: ModelInput | None = None
    """rm_judge without ``refresh.judge_model``: the held-out RM judges."""
    earlier: tuple[Artifact, ...] = ()
    """This run's earlier rm-refresh artifacts: their labelled pairs are trained on again (labels are expensive)."""

    @classmethod
    def of(cls, cfg: Config, data: Artifact, policy: ModelInput, proxy: ModelInput, heldout: ModelInput,
           earlier: Sequence[Artifact] = ()) -> Inputs:
        section = cfg.refresh
        judge = heldout if section.annotator == "rm_judge" and section.judge_model is None else None
        return cls(data, policy, proxy, judge, tuple(earlier))


@dataclass(frozen=True)
class Result:
    iteration: int
    promoted: bool
    """The refreshed RM replaces the proxy (next iteration's RM; ``champion`` when published)."""
    reason: str
    metrics: dict[str, float]
    """``refresh/{onpolicy,heldout,onpolicy_gold}_{accuracy,loss,margin}_{before,after}``, ``refresh/n_*``,
    ``labels/*``, ``refresh/best_epoch``, ``refresh/promoted``."""
    reward_model: str = MODEL_DIR
    train_pairs: str = TRAIN_FILE
    eval_pairs: str = EVAL_FILE
    quarantine: str = QUARANTINE_FILE
    metrics_file: str = METRICS_FILE


def model_input(artifact: Artifact) -> ModelInput:
    """The refreshed reward model of an rm-refresh artifact."""
    return ModelInput(artifact, STAGE.result(artifact).reward_model)


@dataclass(frozen=True)
class _Fresh:
    records: list[Record]
    quarantine: list[Record]
    counts: dict[str, float]


@dataclass(frozen=True)
class _Pairs:
    train: list[PreferencePair]
    validation: list[PreferencePair]
    onpolicy: list[PreferencePair]
    heldout: list[PreferencePair]
    counts: dict[str, float] = field(default_factory=dict)


def compute(cfg: Config, inputs: Inputs, ctx: StageContext) -> Result:
    pairs = _prepare_pairs(cfg, inputs, ctx)
    judged = {"onpolicy": pairs.onpolicy, "heldout": pairs.heldout,
              "onpolicy_gold": gold_judged_onpolicy(cfg.gold, pairs.onpolicy)}
    metrics, refreshed = dict(pairs.counts), []
    members = reward_members(inputs.proxy.path)
    for k, folder in enumerate(members):  # an ensemble's members each train further on the same fresh pairs
        tokenizer = load_tokenizer(folder)
        model = load_reward_model(str(folder), cfg.runtime.torch_dtype).to(cfg.runtime.torch_device)
        training = replace(cfg.training, seed=cfg.training.seed + k)
        prefix = "refresh/" if k == 0 else f"refresh/member_{k}/"
        own = {**accuracies(model, tokenizer, judged, training, "before"),
               **_continue_training(model, tokenizer, pairs, training, ctx, prefix),
               **accuracies(model, tokenizer, judged, training, "after")}
        metrics |= {prefix + key.removeprefix("refresh/"): value for key, value in own.items()}
        refreshed.append((model, tokenizer, own))
    save_ensemble(ctx.out / MODEL_DIR, [(model, tokenizer) for model, tokenizer, _ in refreshed])
    # An ensemble is promoted on its members' mean held-out accuracy, and has changed when any member did.
    before, after = (sum(own[f"refresh/heldout_accuracy_{when}"] for *_, own in refreshed) / len(refreshed)
                     for when in ("before", "after"))
    if len(refreshed) > 1:
        metrics |= {"refresh/ensemble/heldout_accuracy_before": before, "refresh/ensemble/heldout_accuracy_after": after}
    changed = any(own["refresh/best_epoch"] > 0 for *_, own in refreshed)
    promoted, reason = promotion(before, after, cfg.refresh.promotion_tolerance, changed=changed)
    metrics["refresh/promoted"] = float(promoted)
    write_json({"metrics": metrics, "promoted": promoted, "reason": reason}, ctx.out / METRICS_FILE)
    log.info("rm-refresh %d: on-policy accuracy %.3f -> %.3f, held-out %.3f -> %.3f; %s", cfg.iteration,
             metrics["refresh/onpolicy_accuracy_before"], metrics["refresh/onpolicy_accuracy_after"],
             metrics["refresh/heldout_accuracy_before"], metrics["refresh/heldout_accuracy_after"], reason)
    return Result(cfg.iteration, promoted, reason, metrics)


def _prepare_pairs(cfg: Config, inputs: Inputs, ctx: StageContext) -> _Pairs:
    """Fresh labelled pairs split by prompt into refresh-train (less a validation share) and on-policy-eval, the
    earlier refreshes' pairs, replayed old pairs and the held-out pairs; the fresh tables go into the artifact."""
    section, seed, data = cfg.refresh, refresh_seed(cfg.seed, cfg.iteration), inputs.data
    fresh = collect_fresh_pairs(cfg, inputs, ctx.scratch("export", _export_identity(cfg, inputs)))
    train_new, eval_new = split_by_prompt(fresh.records, section.on_policy_eval_fraction, seed)
    fit_new, validation = (split_by_prompt(train_new, section.validation_fraction, seed + 1)
                           if section.validation_fraction > 0 else (train_new, []))
    earlier = [pair for art in inputs.earlier for pair in read_pairs(art.path(art.result["train_pairs"]))]
    n_fresh = len(fit_new) + len(earlier)
    replay = (replay_sample(read_pairs(data.path(data.result["train_pairs"])), n_fresh, section.old_pairs_ratio, seed)
              if section.keep_old_pairs else [])
    write_parquet(train_new, PREFERENCE_PAIRS, ctx.out / TRAIN_FILE)
    write_parquet(eval_new, PREFERENCE_PAIRS, ctx.out / EVAL_FILE)
    write_parquet(fresh.quarantine, QUARANTINE, ctx.out / QUARANTINE_FILE)
    counts = {**fresh.counts, "refresh/n_new_pairs": float(len(fresh.records)),
              "refresh/n_train_new": float(len(fit_new)), "refresh/n_validation": float(len(validation)),
              "refresh/n_onpolicy_eval": float(len(eval_new)),
              "refresh/n_earlier_refresh_pairs": float(len(earlier)), "refresh/n_old_replayed": float(len(replay))}
    return _Pairs(to_pairs(fit_new) + earlier + replay, to_pairs(validation), to_pairs(eval_new),
                  read_pairs(data.path(data.result["heldout_pairs"])), counts)


def _export_identity(cfg: Config, inputs: Inputs) -> dict[str, object]:
    """What the exported pairs depend on (how they are sampled and validated, and the file format), and nothing
    else: the file people label stays where it is when the run is resumed with ``refresh.labels_file`` set (or
    with another training setting changed)."""
    return {"n_pairs": cfg.refresh.n_pairs, "export_format": cfg.refresh.export_format, "generation": cfg.generation,
            "prep": cfg.prep, "runtime": cfg.runtime, "seed": cfg.seed, "iteration": cfg.iteration,
            "policy": inputs.policy, "data": inputs.data}


def collect_fresh_pairs(cfg: Config, inputs: Inputs, export: Path) -> _Fresh:
    """Sample on-policy pairs and label them with ``refresh.annotator`` (file: import, or export and stop)."""
    section = cfg.refresh
    if section.annotator == "file" and cfg.labels_file is not None:
        return _imported(cfg, export)
    candidates, skipped = sample_candidates(cfg, inputs, export)
    if section.annotator == "file":
        exported = export_unlabelled(candidates, export / f"{UNLABELLED_STEM}.{section.export_format}")
        raise LabelsPendingError(
            f"rm-refresh iteration {cfg.iteration}: {len(candidates)} unlabelled on-policy pairs were exported to "
            f"{exported}. Fill its 'label' column with 'a' (reply_a is better) or 'b' (reply_b is better) for each "
            "row (instructions: tasks/labelling.py), save it as CSV or Parquet, and resume the run with "
            "refresh.labels_file=<the labelled file>", exported)
    prefers_a = build_annotator(cfg, inputs).label(candidates)
    source = f"{NAME}-{cfg.iteration}:{section.annotator}"
    judged = preference_rows(source, preference_pairs(candidates, prefers_a))
    records, rejected = validate_preferences(source, judged, cfg.prep)
    counts = {**_skip_counts(skipped, len(candidates) + len(skipped)),
              "refresh/label_a_fraction": sum(prefers_a) / len(prefers_a), "labels/rows_in": float(len(judged)),
              "labels/accepted": float(len(records)), "labels/quarantined": float(len(rejected))}
    return _Fresh(records, skipped + rejected, counts)


def sample_candidates(cfg: Config, inputs: Inputs, folder: Path) -> tuple[list[ReplyPair], list[Record]]:
    """Two replies of the current policy to each of ``refresh.n_pairs`` seeded PPO prompts, checked like any
    preference data *before* anyone labels them: identical or empty replies, exact repeats and the like are skipped
    with their reason (returned, and written to ``folder/sampling_quarantine.parquet``)."""
    prompts_file = inputs.data.path(inputs.data.result["ppo_prompts"])
    prompts = read_prompts(prompts_file)
    if not prompts:
        raise ValueError(f"PPO prompt table {prompts_file} is empty; rm-refresh samples its pairs from these prompts")
    seed = refresh_seed(cfg.seed, cfg.iteration)
    drawn = draw_prompts(prompts, cfg.refresh.n_pairs, random.Random(f"{NAME}:{seed}"))
    policy, tokenizer = load_frozen_lm(cfg.runtime, inputs.policy.path)
    sampled = sample_reply_pairs(policy, tokenizer, drawn, cfg.generation, seed)
    source = f"{NAME}-{cfg.iteration}:sampled"
    rows = [SourceRow(source, i, {PROMPT: p.prompt, CHOSEN: p.reply_a, REJECTED: p.reply_b})
            for i, p in enumerate(sampled)]
    records, skipped = validate_preferences(source, rows, cfg.prep)
    write_parquet(skipped, QUARANTINE, folder / SKIPPED_FILE)
    if not records:
        raise ValueError(f"none of the {len(sampled)} on-policy reply pairs is usable (reasons in "
                         f"{folder / SKIPPED_FILE}); a collapsed policy repeats itself: raise "
                         "ppo.generation.temperature or refresh.n_pairs")
    return [ReplyPair(str(r[PROMPT]), str(r[CHOSEN]), str(r[REJECTED])) for r in records], skipped


def _skip_counts(skipped: Sequence[Mapping[str, object]], n_sampled: int) -> dict[str, float]:
    by_reason = Counter(str(r[REASON]) for r in skipped)
    return {"refresh/n_sampled": float(n_sampled), "refresh/n_skipped": float(len(skipped)),
            "refresh/n_identical_skipped": float(by_reason[QuarantineReason.IDENTICAL_PAIR.value]),
            **{f"refresh/skipped/{reason}": float(n) for reason, n in sorted(by_reason.items())}}


def build_annotator(cfg: Config, inputs: Inputs) -> Annotator:
    """The configured in-process annotator: the simulated one (demo) or a reward-model judge."""
    section, seed = cfg.refresh, refresh_seed(cfg.seed, cfg.iteration)
    if section.annotator == "simulated":
        # The demo's human stand-in: its labels are the only thing training ever sees of gold.
        return PerPairAnnotator(SimulatedAnnotator(section.annotator_temperature, seed=seed))
    if section.annotator == "rm_judge":
        judge_dir = local_model(section.judge_model) if section.judge_model else inputs.judge.path
        judge = freeze(load_reward_model(judge_dir, cfg.runtime.torch_dtype).to(cfg.runtime.torch_device))
        return RewardModelJudge(judge, load_tokenizer(judge_dir), cfg.judge_max_length,
                                cfg.judge_batch_size, cfg.judge_max_tokens)
    raise ValueError(f"refresh.annotator={section.annotator!r} labels through files (tasks/labelling.py), "
                     "not in process")


def _imported(cfg: Config, folder: Path) -> _Fresh:
    """The labelled file of an earlier export, with the pairs that export skipped."""
    exported = folder / f"{UNLABELLED_STEM}.{cfg.refresh.export_format}"
    if not exported.is_file():
        raise FileNotFoundError(f"refresh.labels_file is set but no pairs were exported for iteration {cfg.iteration} "
                                f"of this policy (no {exported}); resume without refresh.labels_file to export them, "
                                "label that file, then resume with it")
    labels = import_labels(str(cfg.labels_file), str(exported), cfg.prep)
    skipped = read_parquet(folder / SKIPPED_FILE, QUARANTINE) if (folder / SKIPPED_FILE).is_file() else []
    counts = {**_skip_counts(skipped, labels.n_exported + len(skipped)), **labels.counts()}
    return _Fresh(labels.records, skipped + labels.quarantine, counts)


def accuracies(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
               judged: Mapping[str, Sequence[PreferencePair]], cfg: RewardTrainingConfig, when: str) -> dict[str, float]:
    """``refresh/<name>_{accuracy,loss,margin}_<when>`` of ``model`` for each non-empty named pair set."""
    metrics = {}
    for name, pairs in judged.items():
        if not pairs:
            continue
        result = evaluate_reward_model(model, tokenizer, encode_pairs(tokenizer, pairs, cfg.max_length,
                                                                    score_prefix(model, tokenizer)), cfg.batch_size,
                                       cfg.max_tokens_per_forward)
        metrics |= {f"refresh/{name}_accuracy_{when}": result.accuracy, f"refresh/{name}_loss_{when}": result.loss,
                    f"refresh/{name}_margin_{when}": result.margin_mean}
    return metrics


def _continue_training(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: _Pairs,
                       cfg: RewardTrainingConfig, ctx: StageContext, prefix: str = "refresh/") -> dict[str, float]:
    """Train in place on ``pairs.train``; returns ``refresh/train_steps`` and ``refresh/best_epoch``.

    With validation pairs the epoch with the lowest validation loss is kept (``cfg.select_best_epoch``) and the
    ``refresh/eval/*`` curve is theirs; without, it is the on-policy pairs' (which then only watch). Curves are
    logged under ``prefix`` (an ensemble member's own).
    """
    steps = cfg.epochs * math.ceil(len(pairs.train) / cfg.batch_size)
    ctx.tracker.flush_every = 10
    log.info("rm-refresh: %d training pairs, %d validation pairs, %d steps", len(pairs.train), len(pairs.validation),
             steps)
    result = train_reward_model(model, tokenizer, pairs.train, pairs.validation or pairs.onpolicy, cfg,
                                on_log=lambda step, m: ctx.tracker.log({f"{prefix}{k.removeprefix('rm/')}": v
                                                                        for k, v in m.items()}, step),
                                eval_every=max(1, steps // EVALS_PER_TRAINING))
    ctx.tracker.flush()
    best = result.best_epoch if result.best_epoch is not None else cfg.epochs
    return {"refresh/train_steps": float(steps), "refresh/best_epoch": float(best)}


def publish(cfg: Config, result: Result, pub: Publication) -> None:
    pub.log_metrics(result.metrics, step=cfg.iteration)
    pub.set_tags({"refresh.promotion": result.reason, "iteration": cfg.iteration})
    pub.log_files([result.train_pairs, result.eval_pairs, result.quarantine], "pairs")
    pub.log_files([result.metrics_file])
    ref = pub.register("reward_model", pub.names.reward_model, result.reward_model)
    pub.tag_model(ref.uri, {"refresh.promotion": result.reason,
                            **{f"eval.{k.removeprefix('refresh/')}": f"{v:.4g}" for k, v in result.metrics.items()
                               if k.endswith("_accuracy_after")}})
    if result.promoted:
        pub.set_alias(pub.names.reward_model, "champion", ref.version)


STAGE = Stage(NAME, compute, publish, Result)
rm_refresh_task = stage_task(STAGE, retries=1)
