"""Pipeline adapters for the data and SFT stages: map the PipelineConfig onto the stage functions, log the
results to a nested MLflow run, register the SFT policy, and return paths and URIs only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from prefect import task

from tasks.config import PipelineConfig
from tasks.data_prep import run_data_prep
from tasks.retries import retry_on_transient_io
from tasks.demo_data import run_demo_data_prep
from tasks.io import read_frame, write_frame
from tasks.sft import run_sft
from tasks.tracking import log_file, log_metrics, log_params_flat, register_model_dir, stage_run
from tasks.typed_yaml import flatten_for_params


@dataclass(frozen=True)
class DataStageResult:
    """Tables for the later stages. ``sft_*`` are None for user data (SFT then needs a base model)."""

    train_pairs: str
    heldout_pairs: str
    ppo_prompts: str
    quarantine: str
    eval_prompts: str
    """The fixed evaluation prompt set (demo: with hidden metadata; user data: held-out prompts)."""
    sft_train: str | None
    sft_eval: str | None
    metrics: dict[str, float] = field(default_factory=dict)


def _params(config: PipelineConfig, prefix: str) -> dict[str, str]:
    return {k: v for k, v in flatten_for_params(config).items() if k.startswith(prefix)}


def run_data_stage(config: PipelineConfig, out_dir: str, parent_run_id: str) -> DataStageResult:
    """Generate the demo task or read the user's files; validate, dedupe, split; log counts to MLflow."""
    data = config.data
    with stage_run("data-prep", parent_run_id) as run:
        log_params_flat(_params(config, "data."))
        if data.source == "demo":
            demo = run_demo_data_prep(out_dir, data.demo, data.prep, config.seed)
            prep, sft_train, sft_eval, eval_prompts = demo.prep, demo.sft_train, demo.sft_eval, demo.eval_prompts
            metrics = prep.counts.as_metrics() | demo.counts.as_metrics()
        else:
            prep = run_data_prep(list(data.files), out_dir, data.prep, data.prompts_file)
            sft_train = sft_eval = None
            eval_prompts = _heldout_prompts(prep.heldout_pairs, Path(out_dir) / "eval_prompts.parquet")
            metrics = prep.counts.as_metrics()
        log_metrics(metrics, run_id=run.info.run_id)
        log_file(prep.counts_json, "data", run_id=run.info.run_id)
        log_file(prep.quarantine, "data", run_id=run.info.run_id)
    return DataStageResult(prep.train_pairs, prep.heldout_pairs, prep.ppo_prompts, prep.quarantine, eval_prompts,
                           sft_train, sft_eval, metrics)


def _heldout_prompts(heldout_pairs: str, path: Path) -> str:
    """Distinct prompts of the held-out pairs: the evaluation set for user data."""
    frame = read_frame(heldout_pairs, ["prompt"])[["prompt"]].drop_duplicates().reset_index(drop=True)
    if frame.empty:
        raise ValueError(f"{heldout_pairs} has no held-out pairs, so there is nothing to evaluate on; "
                         "raise data.prep.heldout_fraction")
    return write_frame(frame, path)


@dataclass(frozen=True)
class SFTOutput:
    """The policy every later stage starts from (and the PPO reference)."""

    model_uri: str
    model_dir: str
    trained: bool
    metrics: dict[str, float] = field(default_factory=dict)


def run_sft_stage(config: PipelineConfig, data: DataStageResult, out_dir: str, parent_run_id: str) -> SFTOutput:
    """Fine-tune (or only load) the policy, log loss curves and the gold report, register it as a candidate."""
    section = config.sft
    if data.sft_train is None and section.base_model is None:
        raise ValueError("user data has no SFT demonstrations: set sft.base_model to the policy to start from "
                         "(a Hugging Face id or a local folder)")
    with stage_run("sft", parent_run_id) as run:
        log_params_flat(_params(config, "sft."))
        if data.sft_train is None:  # user data: load the base model only
            ref = register_model_dir(section.base_model, config.tracking.policy_model, run.info.run_id) \
                if Path(section.base_model).is_dir() else None
            return SFTOutput(ref.uri if ref else section.base_model, section.base_model, False)
        result = run_sft(out_dir, data.sft_train, data.sft_eval, section, seed=config.seed,
                         generation=config.ppo.generation, n_eval_prompts=min(64, config.eval.n_prompts),
                         pairs_path=data.train_pairs,
                         eval_prompts_path=data.eval_prompts if config.data.source == "demo" else None)
        _log_sft(result, run.info.run_id)
        ref = register_model_dir(result.model_dir, config.tracking.policy_model, run.info.run_id)
    return SFTOutput(ref.uri, result.model_dir, result.trained, dict(result.metrics))


def _log_sft(result, run_id: str) -> None:
    log_metrics(result.metrics, run_id=run_id)
    if result.loss_curve_json:
        curve = json.loads(Path(result.loss_curve_json).read_text())
        for step, loss in zip(curve.get("train_steps", range(1, len(curve["train_losses"]) + 1)),
                              curve["train_losses"], strict=False):
            log_metrics({"sft/train_loss": loss}, step=int(step), run_id=run_id)
    for path in (result.loss_curve_json, result.loss_plot_png, result.samples_json, result.metrics_json):
        if path:
            log_file(path, "sft", run_id=run_id)


data_stage_task = task(name="data-prep", retries=2, retry_delay_seconds=5,
                       retry_condition_fn=retry_on_transient_io)(run_data_stage)
sft_stage_task = task(name="sft", retries=1, retry_delay_seconds=5,
                      retry_condition_fn=retry_on_transient_io)(run_sft_stage)
