"""The reward-model stage: the proxy reward model PPO optimises, and the held-out one only evaluation sees.

The proxy learns the train pairs and is evaluated on the held-out pairs; the held-out reward model learns the
held-out pairs (which the proxy never saw) and is evaluated on a sample of the train pairs. Both start from
``reward_model.init`` ('sft': the SFT policy's backbone with a fresh scalar head; 'scratch'; or a reward model)
with their own seeds. The artifact holds ``proxy/`` and ``heldout/`` (model + tokenizer), the loss and score plots
and ``metrics.json``; publishing registers both (alias ``candidate``; ``champion`` when the name has none yet).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.evaluation.metrics import pairwise_agreement, spearman
from rlhf_core.models.lm import ModelSize, build_reward_model, config_for_tokenizer
from rlhf_core.models.roles import fuse_activations, load_reward_model, sequence_scores
from rlhf_core.models.text import pad_id, right_pad
from rlhf_core.training.reward_training import PreferencePair, RewardTrainingResult, encode_pairs
from tasks.config import DistributedSection, PipelineConfig, RewardModelSection
from tasks.io import read_pairs, write_json
from tasks.launch import fit_reward_model
from tasks.plots import loss_curve, save_figure, score_histograms
from tasks.run_store import Artifact
from tasks.runtime import ModelInput, Runtime, local_model
from tasks.stage import Publication, Stage, StageContext, stage_task
from tasks.typed_yaml import flatten_for_params

log = logging.getLogger(__name__)

NAME = "reward-model"
ROLES = ("proxy", "heldout")
METRICS_FILE = "metrics.json"
SCORES_PNG = "rm_proxy_heldout_scores.png"
MAX_CROSS_EVAL_PAIRS = 1000
"""The held-out RM is evaluated on at most this many train pairs (a seeded sample): enough for a stable
accuracy, and it keeps the stage's second evaluation cheap on large datasets."""
EVALS_PER_TRAINING = 4
"""Evaluations during each training (plus the final one): the points of the eval line on the loss plot."""
FLUSH_EVERY = 10
"""Per-step metrics go to MLflow in one batch every this many steps."""


@dataclass(frozen=True)
class Config:
    """What the reward-model stage is given."""

    reward_model: RewardModelSection
    """init, and the proxy's and held-out model's training settings."""
    runtime: Runtime
    model_size: str | ModelSize | None = None
    """Shape of a reward model built from scratch (``sft.model_size``; only with init 'scratch')."""
    distributed: DistributedSection | None = None
    """DeepSpeed workers for the training (None: in this process)."""

    @classmethod
    def of(cls, config: PipelineConfig) -> Config:
        section = config.reward_model
        return cls(section, Runtime.of(config), config.sft.model_size if section.init == "scratch" else None,
                   config.distributed if config.distributed.runs(NAME) else None)


@dataclass(frozen=True)
class Inputs:
    data: Artifact
    """data-prep: train and held-out pairs."""
    sft: ModelInput | None
    """The SFT policy: backbone ('sft') or tokenizer and shape ('scratch'); None when init is a reward model."""

    @classmethod
    def of(cls, cfg: Config, data: Artifact, sft: ModelInput) -> Inputs:
        return cls(data, sft if cfg.reward_model.init in ("sft", "scratch") else None)


@dataclass(frozen=True)
class Result:
    proxy: str
    heldout: str
    metrics: dict[str, float]
    """``rm/{proxy,heldout}/eval/*`` (on data the model never saw), ``rm/{proxy,heldout}/train/*``, ``rm/cross/*``."""
    plots: list[str] = field(default_factory=list)
    metrics_file: str = METRICS_FILE
    counts: dict[str, int] = field(default_factory=dict)
    """Pairs trained and evaluated on."""


def model_input(artifact: Artifact, role: str) -> ModelInput:
    """The proxy (``role='proxy'``) or held-out reward model of a reward-model artifact."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return ModelInput(artifact, getattr(STAGE.result(artifact), role))


@dataclass(frozen=True)
class _Fitted:
    model: PreTrainedModel
    history: RewardTrainingResult
    metrics: dict[str, float]


def compute(cfg: Config, inputs: Inputs, ctx: StageContext) -> Result:
    section, data = cfg.reward_model, inputs.data
    train, heldout = read_pairs(data.path(data.result["train_pairs"])), read_pairs(data.path(data.result["heldout_pairs"]))
    init_dir, tokenizer = resolve_init(section.init, inputs.sft)
    cross_sample = _sample(train, MAX_CROSS_EVAL_PAIRS, section.heldout.seed)
    ctx.tracker.flush_every = FLUSH_EVERY
    proxy = _fit("proxy", _init_model(cfg, init_dir, tokenizer, section.training.seed), tokenizer, train, heldout,
                 section.training, cfg, ctx)
    held = _fit("heldout", _init_model(cfg, init_dir, tokenizer, section.heldout.seed), tokenizer, heldout,
                cross_sample, section.heldout, cfg, ctx)
    cross, proxy_scores = _cross_metrics(proxy.model, held.model, tokenizer, heldout, section.training.max_length)
    metrics = {**proxy.metrics, **held.metrics, **cross}
    plots = _plots(ctx.out, proxy.history, held.history, proxy_scores)
    for role, fitted in (("proxy", proxy), ("heldout", held)):
        fitted.model.save_pretrained(ctx.out / role)
        tokenizer.save_pretrained(ctx.out / role)
    write_json({"metrics": metrics}, ctx.out / METRICS_FILE)
    log.info("reward-model: proxy held-out accuracy %.3f, held-out RM accuracy %.3f on train pairs",
             metrics["rm/proxy/eval/accuracy"], metrics["rm/heldout/eval/accuracy"])
    counts = {"n_train_pairs": len(train), "n_heldout_pairs": len(heldout), "n_cross_eval_pairs": len(cross_sample)}
    return Result("proxy", "heldout", metrics, plots, METRICS_FILE, counts)


def _sample(pairs: Sequence[PreferencePair], limit: int, seed: int) -> list[PreferencePair]:
    """All pairs, or a seeded sample of ``limit`` of them."""
    return list(pairs) if len(pairs) <= limit else random.Random(seed).sample(list(pairs), limit)


def resolve_init(init: str, sft: ModelInput | None) -> tuple[str | None, PreTrainedTokenizerBase]:
    """(local folder of the initial weights or None for 'scratch', tokenizer) for ``reward_model.init``.

    'sft' and 'scratch' take the tokenizer from the SFT policy; a path or ``models:/`` URI of an existing
    reward model brings its own.
    """
    if init in ("sft", "scratch"):
        if sft is None:
            raise ValueError(f"reward_model.init={init!r} needs the SFT policy")
        return (sft.path if init == "sft" else None), _load_tokenizer(sft.path, "the SFT policy")
    init_dir = local_model(init)
    return init_dir, _load_tokenizer(init_dir, "reward_model.init")


def _load_tokenizer(path: str, setting: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{setting}: no tokenizer can be loaded from {path!r} ({err}); give a folder saved with "
                         "save_pretrained (model + tokenizer)") from err


def _init_model(cfg: Config, init_dir: str | None, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A 1-output sequence classifier on the configured device: SFT backbone + fresh head, fresh, or loaded."""
    torch.manual_seed(seed)  # the fresh score head (and a scratch model) differ per seed, reproducibly
    init, dtype = cfg.reward_model.init, cfg.runtime.torch_dtype
    if init == "scratch":
        model = build_reward_model(config_for_tokenizer(tokenizer, cfg.model_size), seed).to(dtype)
    elif init == "sft":
        model = fuse_activations(AutoModelForSequenceClassification.from_pretrained(
            init_dir, num_labels=1, dtype=dtype, pad_token_id=pad_id(tokenizer)))
    else:
        model = load_reward_model(init_dir, dtype)
    # The head reads the last real token by looking for padding; the tokenizer's pad id must be the model's.
    model.config.pad_token_id = pad_id(tokenizer)
    return model.to(cfg.runtime.torch_device)


def _fit(role: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, train: Sequence[PreferencePair],
         evaluate_on: Sequence[PreferencePair], training: RewardTrainingConfig, cfg: Config,
         ctx: StageContext) -> _Fitted:
    """Train one reward model, log its curve under ``rm/<role>/``, and return its final metrics."""
    steps = training.epochs * math.ceil(len(train) / training.batch_size)
    log.info("reward-model %s: %d train pairs, %d eval pairs, %d steps", role, len(train), len(evaluate_on), steps)

    def on_log(step: int, metrics: Mapping[str, float]) -> None:
        ctx.tracker.log({f"rm/{role}/{k.removeprefix('rm/')}": v for k, v in metrics.items()}, step)
        if "rm/eval/accuracy" in metrics:
            log.info("reward-model %s step %d: eval accuracy %.3f, loss %.4f, margin %.3f", role, step,
                     metrics["rm/eval/accuracy"], metrics["rm/eval/loss"], metrics["rm/eval/margin_mean"])
        elif step % FLUSH_EVERY == 0:
            log.info("reward-model %s step %d: train loss %.4f", role, step, metrics["rm/train/loss"])

    history = fit_reward_model(cfg.distributed, cfg.runtime, model, tokenizer, train, evaluate_on, training, on_log,
                               max(1, steps // EVALS_PER_TRAINING), ctx.work / "distributed" / role)
    ctx.tracker.flush()
    metrics = {f"rm/{role}/eval/{k}": float(v) for k, v in asdict(history.final_eval).items()}
    metrics |= {f"rm/{role}/train/final_loss": history.train_loss[-1], f"rm/{role}/train/steps": float(steps),
                f"rm/{role}/train/seconds": history.seconds, f"rm/{role}/train/n_truncated": float(history.n_truncated)}
    return _Fitted(model.eval(), history, metrics)


@torch.no_grad()
def pair_scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[PreferencePair],
                max_length: int, batch_size: int = 64) -> tuple[list[float], list[float]]:
    """Scores of every chosen and every rejected reply, in pair order: ((N,), (N,)) as lists."""
    encoded = encode_pairs(tokenizer, pairs, max_length)
    device, chosen, rejected = next(model.parameters()).device, [], []
    for start in range(0, len(pairs), batch_size):
        c, r = encoded.chosen[start:start + batch_size], encoded.rejected[start:start + batch_size]
        ids, mask = right_pad(c + r, pad_id(tokenizer))  # (2B, T)
        scores = sequence_scores(model, ids.to(device), mask.to(device)).float().cpu().tolist()
        chosen += scores[:len(c)]
        rejected += scores[len(c):]
    return chosen, rejected


def _cross_metrics(proxy: PreTrainedModel, heldout: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                   pairs: Sequence[PreferencePair], max_length: int) -> tuple[dict[str, float], dict[str, list]]:
    """How far the proxy agrees with the held-out RM on the held-out pairs (unseen by the proxy).

    ``rm/cross/agreement``: share of pairs both RMs order the same way, a pair either ties counting half (the
    accuracy tie rule); ``rm/cross/spearman``: rank correlation of their scores over all replies. Also returns the
    proxy's scores for the histogram.
    """
    p_chosen, p_rejected = pair_scores(proxy, tokenizer, pairs, max_length)
    h_chosen, h_rejected = pair_scores(heldout, tokenizer, pairs, max_length)
    p_margin = torch.tensor(p_chosen, dtype=torch.float64) - torch.tensor(p_rejected, dtype=torch.float64)
    h_margin = torch.tensor(h_chosen, dtype=torch.float64) - torch.tensor(h_rejected, dtype=torch.float64)
    metrics = {"rm/cross/agreement": pairwise_agreement(p_margin, h_margin),
               "rm/cross/spearman": float(spearman(p_chosen + p_rejected, h_chosen + h_rejected))}
    return metrics, {"chosen": p_chosen, "rejected": p_rejected}


def _plots(out: Path, proxy: RewardTrainingResult, heldout: RewardTrainingResult,
           proxy_scores: Mapping[str, Sequence[float]]) -> list[str]:
    """Loss curves of both RMs and the proxy's score histogram on the held-out pairs, as PNGs under ``out``."""
    names = []
    for role, history, evaluated_on in (("proxy", proxy, "held-out pairs"), ("heldout", heldout, "train pairs")):
        eval_steps = [step for step, _ in history.evals]
        fig = loss_curve(range(1, len(history.train_loss) + 1), history.train_loss, eval_steps,
                         [e.loss for _, e in history.evals], title=f"{role} reward model (eval on {evaluated_on})")
        save_figure(fig, out / f"rm_{role}_loss.png")
        names.append(f"rm_{role}_loss.png")
    save_figure(score_histograms(proxy_scores, title="Proxy RM scores on held-out pairs", xlabel="proxy score"),
                out / SCORES_PNG)
    return [*names, SCORES_PNG]


def publish(cfg: Config, artifact: Artifact, pub: Publication) -> None:
    result = STAGE.result(artifact)
    pub.log_params({**flatten_for_params(cfg), **{f"inputs.{k}": v for k, v in result.counts.items()}})
    pub.log_metrics(result.metrics)
    pub.log_files(result.plots, "plots")
    pub.log_files([result.metrics_file])
    for role, name in (("proxy", pub.names.reward_model), ("heldout", pub.names.heldout_reward_model)):
        ref = pub.register(role, name, getattr(result, role))
        prefix = f"rm/{role}/eval/"
        pub.tag_model(ref.uri, {f"eval.{k.removeprefix(prefix)}": f"{v:.4g}" for k, v in result.metrics.items()
                                if k.startswith(prefix)})
        if pub.alias_version(name, "champion") is None:  # the first RM is the champion that refreshes must match
            pub.set_alias(name, "champion", ref.version)


STAGE = Stage(NAME, compute, publish, Result)
reward_model_task = stage_task(STAGE, retries=1, retry_delay_seconds=2)
