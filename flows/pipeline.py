"""The RLHF pipeline flow: data-prep -> [sft] -> reward-model -> best-of-n -> (ppo-iteration -> heldout-eval) x N.

best-of-n is the standard baseline: best-of-N sampling from the SFT policy under the proxy RM, scored by the
held-out RM and gold at its analytic KL; it is drawn on every evaluation's over-optimisation plot.

Every stage is a Prefect task with a cache key (config sections + input digests + code version) whose result
is persisted in the state directory: rerunning a finished run skips every stage, ``rlhf resume`` continues a
killed run from the first unfinished stage (and a PPO iteration from its last checkpoint).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

from flows.summary import build_summary, write_summary
from tasks.baseline_eval import best_of_n_task
from tasks.caching import cache_key_fn
from tasks.config import PipelineConfig, load_config
from tasks.evaluate import heldout_eval_task
from tasks.ppo import ppo_iteration_task
from tasks.reward_model import reward_model_task
from tasks.rm_refresh import rm_refresh_task
from tasks.stages import data_stage_task, sft_stage_task
from tasks.state import RunRecord, StateDir
from tasks.tracking import configure_tracking, log_file, pipeline_run
from tasks.typed_yaml import dump_config, flatten_for_params

#: Which config sections each stage reads (its cache key covers these, the seed, device and dtype).
STAGE_SECTIONS = {
    "data-prep": ("data",),
    "sft": ("data", "sft", "tracking"),
    "reward-model": ("sft", "reward_model", "tracking"),
    "best-of-n": ("data", "ppo.generation", "eval", "reward_model"),
    "ppo-iteration": ("ppo", "tracking"),
    "heldout-eval": ("data", "ppo", "eval", "reward_model", "tracking"),
    "rm-refresh": ("data", "ppo", "reward_model", "refresh", "tracking"),
}
STAGES = tuple(STAGE_SECTIONS)


def _cached(task: Any, stage: str, refresh: bool) -> Any:
    """The task with this pipeline's cache key; ``refresh`` forces a rerun and overwrites the cache."""
    return task.with_options(cache_key_fn=cache_key_fn(stage, STAGE_SECTIONS[stage]), persist_result=True,
                             refresh_cache=refresh)


class StageRunner:
    """Runs one stage task, records its status in the run record, and reports whether it was cached."""

    def __init__(self, state: StateDir, record: RunRecord, refresh: tuple[str, ...]) -> None:
        self.state, self.record, self.refresh = state, record, refresh

    def __call__(self, stage: str, label: str, task: Any, **kwargs: Any) -> Any:
        self.record.set_stage(label, "running")
        self.state.save_run(self.record)
        future_state = _cached(task, stage, stage in self.refresh or label in self.refresh)(
            **kwargs, return_state=True)
        try:
            result = future_state.result()
        except BaseException as error:
            self.record.set_stage(label, "failed", error=f"{type(error).__name__}: {error}")
            self.state.save_run(self.record)
            raise
        cached = future_state.name == "Cached"
        self.record.set_stage(label, "completed", result={"cached": cached})
        self.state.save_run(self.record)
        return result


@flow(name="rlhf-pipeline", log_prints=True)
def rlhf_pipeline(config_path: str, run_id: str | None = None, refresh: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run (or resume) pipeline run ``run_id`` with the config at ``config_path``.

    Without ``run_id`` (a scheduled deployment) a new run is created and the resolved config recorded in it.
    """
    config = load_config(config_path)
    state = StateDir(config.state_dir).ensure()
    if run_id is None:
        record = state.new_run(config.name)
        config_path = record.config_path = dump_config(config, state.run_dir(record.run_id) / "config.yaml")
        state.save_run(record)
        run_id = record.run_id
    record = state.load_run(run_id)
    run_dir = state.run_dir(run_id)
    configure_tracking(state, config.tracking.tracking_uri)
    started = time.monotonic()
    with pipeline_run(config.tracking.experiment, f"{config.name}-{run_id}", flatten_for_params(config),
                      {"rlhf.run_id": run_id}, run_id=record.mlflow_run_id) as parent:
        record.mlflow_run_id, record.status = parent.info.run_id, "running"
        state.save_run(record)
        log_file(config_path, "config")
        runner = StageRunner(state, record, refresh)
        summary = _stages(config, runner, run_dir, parent.info.run_id)
        summary.update(run_id=run_id, seconds=time.monotonic() - started, mlflow_run_id=parent.info.run_id)
        record.summary_path = write_summary(summary, run_dir / "summary.json")
        log_file(record.summary_path, "summary")
    record.status = "completed"
    state.save_run(record)
    return summary


def _stages(config: PipelineConfig, run: Callable[..., Any], run_dir: Path, parent: str) -> dict[str, Any]:
    data = run("data-prep", "data-prep", data_stage_task, config=config, out_dir=str(run_dir / "data"),
               parent_run_id=parent)
    sft = run("sft", "sft", sft_stage_task, config=config, data=data, out_dir=str(run_dir / "sft"),
              parent_run_id=parent)
    rm = run("reward-model", "reward-model", reward_model_task, config=config, train_pairs=data.train_pairs,
             heldout_pairs=data.heldout_pairs, sft_model=sft.model_uri, out_dir=str(run_dir / "reward_model"),
             parent_run_id=parent)
    baseline = run("best-of-n", "best-of-n", best_of_n_task, config=config, sft_uri=sft.model_uri,
                   proxy_rm_uri=rm.proxy_uri, heldout_rm_uri=rm.heldout_uri, eval_prompts=data.eval_prompts,
                   out_dir=str(run_dir / "best_of_n"), parent_run_id=parent)
    history: list[dict[str, float]] = []
    checkpoint, evals, refreshes, reward_model, rm_generation = None, [], [], rm.proxy_uri, 0
    for k in range(1, config.ppo.iterations + 1):
        ppo = run("ppo-iteration", f"ppo-iteration-{k}", ppo_iteration_task, config=config, iteration=k,
                  reference_uri=sft.model_uri, reward_model_uri=reward_model, ppo_prompts=data.ppo_prompts,
                  out_dir=str(run_dir / "ppo"), parent_run_id=parent, init_checkpoint=checkpoint)
        checkpoint = ppo.checkpoint
        evaluation = run("heldout-eval", f"heldout-eval-{k}", heldout_eval_task, config=config,
                         policy_uri=ppo.policy_uri, reference_uri=sft.model_uri, proxy_rm_uri=reward_model,
                         heldout_rm_uri=rm.heldout_uri, eval_prompts=data.eval_prompts,
                         out_dir=str(run_dir / "eval" / f"iter_{k:03d}"), parent_run_id=parent, iteration=k,
                         history=list(history), policy_version=ppo.policy_version,
                         best_of_n=list(baseline.points), rm_generation=rm_generation)
        history.append(dict(evaluation.metrics))
        evals.append(evaluation)
        if k < config.ppo.iterations and should_refresh(config, k, evaluation.status):
            refreshed = run("rm-refresh", f"rm-refresh-{k}", rm_refresh_task, config=config, iteration=k,
                            policy_uri=ppo.policy_uri, proxy_rm_uri=reward_model, heldout_rm_uri=rm.heldout_uri,
                            train_pairs=data.train_pairs, heldout_pairs=data.heldout_pairs,
                            ppo_prompts=data.ppo_prompts, out_dir=str(run_dir / "rm_refresh"), parent_run_id=parent,
                            earlier_pairs=[r.pairs_path for r in refreshes])
            refreshes.append(refreshed)
            if refreshed.reward_model_uri != reward_model:
                # Proxy scores of different reward models are not comparable: the hacking detector's window
                # restarts at the new generation (the plot keeps every iteration).
                reward_model, rm_generation = refreshed.reward_model_uri, rm_generation + 1
    return build_summary(config, data, sft, rm, evals, baseline.points, refreshes)


def should_refresh(config: PipelineConfig, iteration: int, status: str) -> bool:
    """Refresh the proxy RM every ``refresh.every_k`` iterations, or when evaluation flags hacking."""
    section = config.refresh
    if not section.enabled:
        return False
    scheduled = section.every_k > 0 and iteration % section.every_k == 0
    return scheduled or (section.on_hacking and status == "hacking")


def run_pipeline(config_path: str, run_id: str, refresh: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the flow with Prefect results persisted under the run's state directory (survives the process)."""
    config = load_config(config_path)
    storage = StateDir(config.state_dir).ensure().prefect / "results"
    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: str(storage)}):
        return rlhf_pipeline(config_path, run_id, refresh)
