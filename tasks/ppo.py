"""The ppo-iteration stage: continue PPO for ``updates_per_iteration`` updates and register the policy.

Iteration k owns ``<out_dir>/iter_<k>/checkpoints``. It starts from iteration k-1's final checkpoint (weights,
optimizer, KL controller, prompt cursor, RNGs; passed in as ``init_checkpoint``, so it is part of the cache key),
making the iterations together one continuous PPO run; a killed iteration resumes from its own latest
checkpoint. Rerunning iteration k never sees a later iteration's state.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from prefect import task
from safetensors.torch import save_model
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlhf_core.models.lora import LoRACritic, lora_policy, plain_model
from rlhf_core.models.roles import Critic, ValueHead, load_policy, load_reward_model, make_reference
from rlhf_core.models.scoring import RewardModelScorer, decode_rollout
from rlhf_core.models.text import encode_prompt, pad_id
from rlhf_core.training.checkpoint import latest_checkpoint, trainable_view
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.rollout import generate, left_pad
from tasks.config import PipelineConfig
from tasks.launch import run_ppo_training
from tasks.retries import retry_on_transient_io
from tasks.io import atomic_write_dir, read_frame, write_frame, write_json
from tasks.plots import save_figure, training_curves
from tasks.runtime import device_of, dtype_of, local_model
from tasks.tracking import log_figure, log_file, log_metrics, log_params_flat, register_model_dir, stage_run
from tasks.typed_yaml import flatten_for_params

log = logging.getLogger(__name__)

CURVE_KEYS = ("ppo/scores/mean", "ppo/kl/mean", "ppo/kl/coef", "ppo/policy/entropy", "ppo/value/loss",
              "ppo/value/explained_variance", "ppo/response/length_mean", "ppo/policy/clipfrac")


@dataclass(frozen=True)
class PPOIterationResult:
    """What one PPO iteration produced (paths, URIs and numbers only: it is cached by Prefect)."""

    iteration: int
    policy_uri: str
    policy_version: int
    policy_dir: str
    steps_done: int
    checkpoint: str
    """The final checkpoint of this iteration: the next iteration starts from it."""
    metrics: dict[str, float]
    samples_path: str
    mlflow_run_id: str


def iteration_dir(out_dir: str | Path, iteration: int) -> Path:
    """``<out_dir>/iter_<k>``."""
    return Path(out_dir) / f"iter_{iteration:03d}"


def load_prompts(path: str, tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int) -> list[list[int]]:
    """Tokenized PPO prompts; prompts longer than the model can take next to its reply fail clearly."""
    frame = read_frame(path, ["prompt"])
    if frame.empty:
        raise ValueError(f"PPO prompt table {path} is empty; data-prep put no prompts in the PPO split")
    prompts = [encode_prompt(tokenizer, text) for text in frame["prompt"].tolist()]
    too_long = [i for i, ids in enumerate(prompts) if len(ids) > max_prompt_tokens]
    if too_long:
        raise ValueError(
            f"{len(too_long)} prompts in {path} (first: row {too_long[0]}) are longer than {max_prompt_tokens} "
            "tokens, which leaves no room for ppo.generation.max_new_tokens within the model's positions; "
            "raise data.prep.max_length filtering or lower max_new_tokens"
        )
    return prompts


def build_models(config: PipelineConfig, reference_dir: str, reward_dir: str, tokenizer: PreTrainedTokenizerBase) -> PPOModels:
    """Policy (starts as the reference), frozen reference, frozen RM scorer and the configured value model.

    With ``ppo.lora.enabled`` the policy is a LoRA adapter on the SFT weights, the reference is the same
    model with the adapter disabled, and a critic is a LoRA adapter on the scorer's reward model: two copies
    of base weights instead of four.
    """
    device, dtype, lora = device_of(config), dtype_of(config), config.ppo.lora
    policy = load_policy(reference_dir, dtype).to(device)
    hidden_size = policy.config.hidden_size
    reward_model = load_reward_model(reward_dir, dtype).to(device)
    rm_tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    scorer = RewardModelScorer(reward_model, tokenizer, rm_tokenizer, batch_size=config.ppo.micro_batch_size)
    policy, reference = lora_policy(policy, lora, config.seed) if lora.enabled else (policy, make_reference(policy))
    common = dict(policy=policy, reference=reference, scorer=scorer,
                  stop_token_ids=(tokenizer.eos_token_id,), pad_token_id=pad_id(tokenizer))
    if config.ppo.value_model == "critic":
        critic = LoRACritic(reward_model, lora, config.seed) if lora.enabled else Critic(reward_model)
        return PPOModels(**common, critic=critic.to(device))
    return PPOModels(**common, value_head=ValueHead(hidden_size, seed=config.seed).to(device))


def run_ppo_iteration(
    config: PipelineConfig,
    iteration: int,
    reference_uri: str,
    reward_model_uri: str,
    ppo_prompts: str,
    out_dir: str,
    parent_run_id: str,
    init_checkpoint: str | None = None,
) -> PPOIterationResult:
    """Run PPO updates ``(k-1)*U+1 .. k*U`` of the pipeline's run and register the resulting policy."""
    section = config.ppo
    target_steps = iteration * section.updates_per_iteration
    here = iteration_dir(out_dir, iteration)
    if iteration > 1 and (init_checkpoint is None or not Path(init_checkpoint).is_dir()):
        raise FileNotFoundError(
            f"iteration {iteration} continues iteration {iteration - 1} from its final checkpoint, but "
            f"{init_checkpoint!r} is not a checkpoint folder; rerun iteration {iteration - 1} (rlhf stage ppo-iteration)"
        )
    reference_dir, reward_dir = local_model(reference_uri), local_model(reward_model_uri)
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    models = build_models(config, reference_dir, reward_dir, tokenizer)
    positions = getattr(models.policy.config, "n_positions", None) or models.policy.config.max_position_embeddings
    prompts = load_prompts(ppo_prompts, tokenizer, positions - section.generation.max_new_tokens)
    with stage_run(f"ppo-iteration-{iteration}", parent_run_id, tags={"iteration": str(iteration)}) as run:
        run_id = run.info.run_id
        log_params_flat({k: v for k, v in flatten_for_params(config).items() if k.startswith("ppo.")} |
                        {"iteration": iteration, "reference_uri": reference_uri, "reward_model_uri": reward_model_uri})

        def on_log(step: int, metrics: dict[str, float]) -> None:
            log_metrics(metrics, step=step, run_id=run_id)
            log_metrics({k: metrics[k] for k in CURVE_KEYS}, step=step, run_id=parent_run_id)

        # In this process, or on DeepSpeed workers when distributed.deepspeed_config is set (tasks/launch.py).
        result = run_ppo_training(config, models, prompts, target_steps, here / "checkpoints", section.checkpoint_every,
                                  on_log, init_checkpoint, {"reference_dir": reference_dir, "reward_dir": reward_dir,
                                                            "prompts_file": ppo_prompts}, here / "distributed")
        policy_dir = atomic_write_dir(here / "policy", lambda tmp: _save_policy(models, tokenizer, tmp))
        ref = register_model_dir(policy_dir, config.tracking.policy_model, run_id)
        samples = _write_samples(models, tokenizer, prompts, config, here / "samples.parquet")
        log_file(samples, "samples", run_id=run_id)
        _log_curves(result.history, here / "ppo_curves.png", run_id)
        last = result.history[-1] if result.history else {}
        write_json({"iteration": iteration, "steps_done": len(result.history), "last": last}, here / "metrics.json")
    final = latest_checkpoint(here / "checkpoints")
    return PPOIterationResult(iteration, ref.uri, ref.version, str(policy_dir), len(result.history), str(final),
                              dict(last), str(samples), run_id)


def _save_policy(models: PPOModels, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """A plain Hugging Face policy (a LoRA adapter is merged into a copy of the weights) + the value model's
    trained weights (a LoRA critic: its adapter and head; the base is the proxy reward model)."""
    plain_model(models.policy).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    value = models.value_head if models.value_head is not None else models.critic
    save_model(trainable_view(value), str(folder / "value_model.safetensors"))


@torch.no_grad()
def _write_samples(models: PPOModels, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
                   config: PipelineConfig, path: Path, n: int = 32) -> Path:
    """A small generation table (prompt, response, score, stopped) for browsing in the MLflow UI."""
    device = next(models.policy.parameters()).device
    ids, mask = left_pad(prompts[:n], models.pad_token_id)
    rollout = generate(models.policy, ids.to(device), mask.to(device), config.ppo.generation,
                       models.stop_token_ids, models.pad_token_id, torch.Generator().manual_seed(config.seed))
    texts, replies = decode_rollout(rollout, tokenizer)
    frame = pd.DataFrame({"prompt": texts, "response": replies, "score": models.scorer(rollout).cpu().tolist(),
                          "stopped": rollout.stopped.cpu().tolist(),
                          "length": rollout.response_mask.sum(1).cpu().tolist()})
    return Path(write_frame(frame, path))


def _log_curves(history: list[dict[str, float]], path: Path, run_id: str) -> None:
    if not history:
        return
    rows = [{"step": i + 1, **h} for i, h in enumerate(history)]
    figure = training_curves(rows, CURVE_KEYS, title="PPO training")
    log_figure(figure, "plots/ppo_curves.png", run_id=run_id)
    save_figure(figure, path)


def reset_iteration(out_dir: str | Path, iteration: int) -> None:
    """Forget an iteration's checkpoints so it reruns from the previous iteration (``rlhf stage``)."""
    shutil.rmtree(iteration_dir(out_dir, iteration), ignore_errors=True)


ppo_iteration_task = task(name="ppo-iteration", retries=1, retry_delay_seconds=5,
                          retry_condition_fn=retry_on_transient_io)(run_ppo_iteration)
