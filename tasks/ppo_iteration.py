"""The ppo-iteration stage: ``ppo.updates_per_iteration`` more PPO updates, and the policy they give.

Iteration k continues iteration k-1 from the final checkpoint in its resume state (weights, optimizer, KL
controller, prompt cursor, RNGs; score moments restart if the reward model changed), so the iterations together are
one continuous PPO run. The resume state is published beside the artifact, not in it (``RunStore.resume_state``):
publishing iteration k prunes those of iterations before the newest ``ppo.keep_resume_states``. While it runs,
iteration k checkpoints into the work folder of its own key: a killed iteration resumes from there, and only an
iteration with the same key (same config, same SFT policy, same reward model, same previous iteration, same code)
ever does; a new reward model or SFT policy gives a new key and a fresh start from iteration k-1. The artifact holds the policy in Hugging
Face layout (``policy/``, plus the value model's trained weights), a sample table and the training curves.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import save_model
from transformers import PreTrainedTokenizerBase

from rlhf_core.models.lora import plain_model
from rlhf_core.models.scoring import decode_rollout
from rlhf_core.models.sequences import left_pad
from rlhf_core.training.checkpoint import latest_checkpoint, trainable_view
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.rollout import generate
from rlhf_core.config import PPOConfig
from rlhf_core.ranges import KeptCount
from tasks.config import DistributedSection, PipelineConfig
from tasks.io import write_frame, write_json
from tasks.plots import save_figure, training_curves
from tasks.ppo_job import PPOJob, train_ppo_job
from tasks.run_store import Artifact, RunStore
from tasks.runtime import ModelInput, Runtime
from tasks.stage import Publication, Stage, StageContext, stage_task

log = logging.getLogger(__name__)

NAME = "ppo-iteration"
POLICY_DIR, CHECKPOINT_DIR, SAMPLES_FILE = "policy", "checkpoint", "samples.parquet"
CURVES_PNG, METRICS_FILE, VALUE_FILE = "ppo_curves.png", "metrics.json", "value_model.safetensors"
SAMPLE_PROMPTS = 32
CURVE_KEYS = ("ppo/scores/mean", "ppo/kl/mean", "ppo/kl/coef", "ppo/policy/entropy", "ppo/value/loss",
              "ppo/value/explained_variance", "ppo/response/length_mean", "ppo/policy/clipfrac")
"""Curves drawn in the artifact's plot and also logged to the pipeline's parent run."""


@dataclass(frozen=True)
class Config:
    ppo: PPOConfig
    """The PPO hyperparameters. ``total_updates`` is the whole run's (iterations x updates) when the learning rate
    decays linearly over it; a constant schedule never reads it, so it is this iteration's last update instead, which
    keeps earlier iterations' keys when a run is extended with more iterations."""
    updates_per_iteration: int
    checkpoint_every: int
    """Checkpoint every this many updates inside the iteration (0 = only its last)."""
    runtime: Runtime
    seed: int
    """Seeds the value head, a LoRA adapter's A and the sample table (prompt order and sampling: ``ppo.seed``)."""
    iteration: int
    """k: this stage runs updates (k-1)*U+1 .. k*U."""
    distributed: DistributedSection | None = None
    """DeepSpeed workers for the training (None: in this process)."""
    keep_resume_states: KeptCount = 2
    """``ppo.keep_resume_states``: finished iterations whose resume state is kept (pruned at publication)."""

    @classmethod
    def of(cls, config: PipelineConfig, iteration: int) -> Config:
        section = config.ppo
        total = section.total_updates if section.lr_schedule == "linear" else iteration * section.updates_per_iteration
        settings = {f.name: getattr(section, f.name) for f in fields(PPOConfig) if f.name != "total_updates"}
        # The estimator's whitening rule resolved: the default and the same choice made explicit share one key.
        core = PPOConfig(**{**settings, "whiten_advantages": section.whitens}, total_updates=total)
        distributed = config.distributed if config.distributed.runs(NAME) else None
        return cls(core, section.updates_per_iteration, section.checkpoint_every, Runtime.of(config), config.seed,
                   iteration, distributed, section.keep_resume_states)


@dataclass(frozen=True)
class Inputs:
    data: Artifact
    """data-prep: the PPO prompts."""
    reference: ModelInput
    """The SFT policy: the reference, and the policy's starting point."""
    reward: ModelInput
    """The proxy reward model of this iteration (the original, or the last promoted refresh)."""
    previous: Artifact | None = None
    """Iteration k-1 (None for the first)."""


@dataclass(frozen=True)
class Result:
    iteration: int
    steps_done: int
    metrics: dict[str, float]
    """The last update's ``ppo/*`` metrics."""
    policy: str = POLICY_DIR
    checkpoint: str = CHECKPOINT_DIR
    """The final checkpoint, in the iteration's resume state (:func:`resume_state_checkpoint`), not in the artifact."""
    samples: str = SAMPLES_FILE
    plot: str | None = None
    metrics_file: str = METRICS_FILE


def model_input(artifact: Artifact) -> ModelInput:
    """The policy of a ppo-iteration artifact."""
    return ModelInput(artifact, STAGE.result(artifact).policy)


def resume_state_checkpoint(store: RunStore, artifact: Artifact) -> Path:
    """The final checkpoint of a ppo-iteration artifact, which the next iteration continues from; ResumeStateError
    in one line when ``ppo.keep_resume_states`` pruned it."""
    iteration = int(artifact.result["iteration"])
    remedy = (f"redo the iterations from one whose state is kept (`rlhf stage ppo-iteration-1 --run RUN_ID` always can: "
              f"iteration 1 starts from the SFT policy), with ppo.keep_resume_states high enough to keep iteration "
              f"{iteration}'s state")
    return store.resume_state(artifact, STAGE.result(artifact).checkpoint, remedy)


def compute(cfg: Config, inputs: Inputs, ctx: StageContext) -> Result:
    target_steps = cfg.iteration * cfg.updates_per_iteration
    init_from = None
    if inputs.previous is not None:
        init_from = str(resume_state_checkpoint(ctx.store, inputs.previous))
    elif cfg.iteration > 1:
        raise ValueError(f"iteration {cfg.iteration} continues iteration {cfg.iteration - 1}, which was not given")
    prompts_file = inputs.data.path(inputs.data.result["ppo_prompts"])
    job = PPOJob(cfg.ppo, cfg.runtime, cfg.seed, inputs.reference.path, inputs.reward.path, str(prompts_file),
                 target_steps, str((ctx.work / "checkpoints").resolve()), cfg.checkpoint_every, init_from)

    def on_log(step: int, metrics: dict[str, float]) -> None:
        ctx.tracker.log(metrics, step, to_parent=CURVE_KEYS)

    # In this process, or on DeepSpeed workers when distributed.deepspeed_config is set (tasks/ppo_job.py): then the
    # models are built only after the workers end, from their final checkpoint.
    models, result = train_ppo_job(job, cfg.distributed, on_log, ctx.work / "distributed")
    tokenizer = job.tokenizer()
    ctx.resume.mkdir(parents=True, exist_ok=True)
    shutil.move(str(latest_checkpoint(job.checkpoint_dir)), ctx.resume / CHECKPOINT_DIR)
    _save_policy(models, tokenizer, ctx.out / POLICY_DIR)
    _write_samples(models, tokenizer, job.prompts(tokenizer), cfg, ctx.out / SAMPLES_FILE)
    plot = _plot_curves(result.history, ctx.out / CURVES_PNG)
    last = result.history[-1] if result.history else {}
    write_json({"iteration": cfg.iteration, "steps_done": len(result.history), "last": last}, ctx.out / METRICS_FILE)
    return Result(cfg.iteration, len(result.history), dict(last), plot=plot)


def _save_policy(models: PPOModels, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """A plain Hugging Face policy (a LoRA adapter is merged into a copy of the weights) + the value model's
    trained weights when there is one (a LoRA critic: its adapter and head; the base is the proxy reward model)."""
    plain_model(models.policy).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if models.value_model is not None:
        save_model(trainable_view(models.value_model), str(folder / VALUE_FILE))


@torch.no_grad()
def _write_samples(models: PPOModels, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], cfg: Config,
                   path: Path) -> str:
    """A small generation table (prompt, response, score, stopped) for browsing in the MLflow UI."""
    device = next(models.policy.parameters()).device
    ids, mask = left_pad(prompts[:SAMPLE_PROMPTS], models.pad_token_id)
    rollout = generate(models.policy, ids.to(device), mask.to(device), cfg.ppo.generation, models.stop_token_ids,
                       models.pad_token_id, torch.Generator().manual_seed(cfg.seed))
    texts, replies = decode_rollout(rollout, tokenizer)
    frame = pd.DataFrame({"prompt": texts, "response": replies, "score": models.scorer(rollout).cpu().tolist(),
                          "stopped": rollout.stopped.cpu().tolist(),
                          "length": rollout.response_mask.sum(1).cpu().tolist()})
    return write_frame(frame, path)


def _plot_curves(history: list[dict[str, float]], path: Path) -> str | None:
    if not history:
        return None
    rows = [{"step": i + 1, **h} for i, h in enumerate(history)]
    save_figure(training_curves(rows, CURVE_KEYS, title="PPO training"), path)
    return path.name


def publish(cfg: Config, result: Result, pub: Publication) -> None:
    pub.log_metrics(result.metrics, step=result.steps_done)
    pub.log_files([result.samples, result.metrics_file], "samples")
    if result.plot:
        pub.log_files([result.plot], "plots")
    pub.set_tags({"iteration": cfg.iteration})
    pub.register("policy", pub.names.policy_model, result.policy, usage={"generation": asdict(cfg.ppo.generation)})
    # Only once this iteration is published: a failed iteration k leaves k-1's state for its retry.
    pub.run_context.store.prune_resume_states(pub.artifact, cfg.keep_resume_states, "previous", "ppo.keep_resume_states")


STAGE = Stage(NAME, compute, publish, Result)
ppo_iteration_task = stage_task(STAGE, retries=1)
