"""The dpo stage (``method: dpo``): the offline alternative to the PPO iterations.

The policy starts as the SFT policy and learns the reward-model training pairs (data-prep's ``train_pairs``) with
DPO or IPO (``rlhf_core.training.dpo``), held to the SFT policy as its frozen reference; the held-out pairs measure
its implicit-reward accuracy before and after. No reward model is read here: the proxy that PPO would chase only
judges the result, in heldout-eval, next to the held-out RM, gold, the hacking detector and the best-of-n baseline,
exactly like a PPO iteration's policy. While it trains, the stage checkpoints into its key's work folder
(``dpo.checkpoint_every``), so a killed stage resumes where it stopped. The artifact holds the policy in Hugging Face
layout (``policy/``), the curves (``dpo_curves.json``, ``dpo_curves.png``) and ``metrics.json``; publishing
registers the policy as a version of the run's policy model, like the SFT and PPO policies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from transformers import PreTrainedModel

from rlhf_core.models.roles import load_policy
from rlhf_core.training.dpo import DPOResult, train_dpo
from tasks.config import DPOSection, PipelineConfig
from tasks.io import read_pairs, write_json
from tasks.models import load_tokenizer, max_positions
from tasks.plots import save_figure, training_curves
from tasks.run_store import Artifact
from tasks.runtime import ModelInput, Runtime
from tasks.stage import Publication, Stage, StageContext, stage_task

log = logging.getLogger(__name__)

NAME = "dpo"
POLICY_DIR, CURVES_JSON, CURVES_PNG, METRICS_FILE = "policy", "dpo_curves.json", "dpo_curves.png", "metrics.json"
CURVE_KEYS = ("dpo/loss", "dpo/rewards/accuracy", "dpo/rewards/margin", "dpo/rewards/chosen", "dpo/rewards/rejected")
"""Curves drawn in the artifact's plot and also logged to the pipeline's parent run."""
FLUSH_EVERY = 10
"""Per-step metrics go to MLflow in one batch every this many steps."""


@dataclass(frozen=True)
class Config:
    """What the dpo stage is given."""

    dpo: DPOSection
    """The DPO / IPO hyperparameters and the checkpoint interval."""
    runtime: Runtime

    @classmethod
    def of(cls, config: PipelineConfig) -> Config:
        return cls(config.dpo, Runtime.of(config))


@dataclass(frozen=True)
class Inputs:
    data: Artifact
    """data-prep: the reward-model training pairs (trained on) and the held-out pairs (measured only)."""
    reference: ModelInput
    """The SFT policy: the policy's starting point and its frozen reference."""


@dataclass(frozen=True)
class Result:
    steps_done: int
    metrics: dict[str, float]
    """The last step's ``dpo/*``, ``dpo/eval/*`` before (``dpo/eval_initial/*``) and after training on the held-out
    pairs, ``dpo/train_eval/*`` on the training pairs after training, and counts and seconds."""
    policy: str = POLICY_DIR
    curves: str = CURVES_JSON
    plot: str | None = None
    metrics_file: str = METRICS_FILE
    counts: dict[str, int] = field(default_factory=dict)
    """Pairs trained on and measured on."""


def model_input(artifact: Artifact) -> ModelInput:
    """The policy of a dpo artifact, as heldout-eval's input."""
    return ModelInput(artifact, STAGE.result(artifact).policy)


def compute(cfg: Config, inputs: Inputs, ctx: StageContext) -> Result:
    data = inputs.data
    train = read_pairs(data.path(data.result["train_pairs"]))
    heldout = read_pairs(data.path(data.result["heldout_pairs"]))
    policy = load_policy(inputs.reference.path, cfg.runtime.torch_dtype).to(cfg.runtime.torch_device)
    tokenizer = load_tokenizer(inputs.reference.path)
    log.info("dpo: %s loss, beta %g, %d train pairs, %d held-out pairs", cfg.dpo.loss, cfg.dpo.beta, len(train),
             len(heldout))
    ctx.tracker.flush_every = FLUSH_EVERY
    history = train_dpo(policy, tokenizer, train, _fit_to_model(cfg.dpo, policy), heldout,
                        on_log=lambda step, metrics: ctx.tracker.log(metrics, step, to_parent=CURVE_KEYS),
                        checkpoint_dir=ctx.work / "checkpoints", checkpoint_every=cfg.dpo.checkpoint_every)
    ctx.tracker.flush()
    policy.save_pretrained(ctx.out / POLICY_DIR)
    tokenizer.save_pretrained(ctx.out / POLICY_DIR)
    metrics = final_metrics(history)
    write_json({"train_metrics": list(history.train_metrics), "eval_steps": list(history.eval_steps),
                "eval_metrics": list(history.eval_metrics)}, ctx.out / CURVES_JSON)
    rows = [{"step": i + 1, **m} for i, m in enumerate(history.train_metrics)]
    save_figure(training_curves(rows, CURVE_KEYS, title=f"DPO training ({cfg.dpo.loss} loss)"), ctx.out / CURVES_PNG)
    write_json({"metrics": metrics}, ctx.out / METRICS_FILE)
    log.info("dpo: implicit-reward accuracy on the held-out pairs %.3f -> %.3f, on the training pairs %.3f",
             metrics.get("dpo/eval_initial/rewards/accuracy", float("nan")),
             metrics.get("dpo/eval/rewards/accuracy", float("nan")), metrics["dpo/train_eval/rewards/accuracy"])
    counts = {"n_train_pairs": len(train), "n_heldout_pairs": len(heldout), "n_truncated": history.n_truncated}
    return Result(len(history.train_metrics), metrics, plot=CURVES_PNG, counts=counts)


def final_metrics(history: DPOResult) -> dict[str, float]:
    """The last step's metrics, the held-out pairs before and after, the training pairs after, steps and seconds."""
    metrics = {**history.train_metrics[-1], **history.final_train, "dpo/steps": float(len(history.train_metrics)),
               "dpo/seconds": history.seconds}
    if history.eval_metrics:
        metrics |= {k.replace("dpo/eval/", "dpo/eval_initial/"): v for k, v in history.eval_metrics[0].items()}
        metrics |= history.eval_metrics[-1]
    return metrics


def _fit_to_model(section: DPOSection, model: PreTrainedModel) -> DPOSection:
    """The section with ``max_length`` cut to the model's positions."""
    positions = max_positions(model)
    return section if section.max_length <= positions else replace(section, max_length=positions)


def publish(cfg: Config, result: Result, pub: Publication) -> None:
    pub.log_params({**{f"inputs.{k}": v for k, v in result.counts.items()}})
    pub.log_metrics(result.metrics, step=result.steps_done)
    pub.log_files([result.curves, result.metrics_file], "dpo")
    if result.plot:
        pub.log_files([result.plot], "plots")
    pub.register("policy", pub.names.policy_model, result.policy)


STAGE = Stage(NAME, compute, publish, Result)
dpo_task = stage_task(STAGE, retries=1)
