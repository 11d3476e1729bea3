"""The RLHF pipeline flow: data-prep -> sft -> reward-model -> best-of-n -> (ppo-iteration -> heldout-eval ->
[rm-refresh]) x N; with ``method: dpo`` the offline dpo stage and one heldout-eval instead of the PPO loop.

One run has one id everywhere: the Prefect flow run's name, the MLflow parent run's tag, the lineage tags of the
model versions it registers, its record in the state folder. ``rlhf run`` creates the run and passes its id; a
deployment's flow run (scheduled, or started in the UI) derives the id from the flow run itself, so a Prefect retry
of that flow run (the UI button, ``prefect flow-run retry``) continues the same rlhf run instead of starting another.
The flow holds the run's lock while it works (a second ``rlhf resume`` is refused), and the run's status is written
by the flow (running, completed) and by Prefect's failure and crash hooks (failed, crashed); a run killed without a
word is found by ``rlhf runs`` (its lock is free) and marked crashed there.

Every stage goes through the run store (tasks/stage.py): a stage whose artifact exists is reused, so rerunning a
finished run, resuming a killed one, or starting a new run of the same config only computes what is missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from prefect import Task, flow
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext
from prefect.runtime import flow_run as current_flow_run

from flows.logs import run_logging
from flows.summary import Outcome, build_summary, running_markdown, summary_markdown
from tasks import best_of_n, data_prep, dpo, heldout_eval, ppo_iteration, reward_model, rm_refresh, sft, tracking
from tasks.config import PipelineConfig, changed_settings, load_config
from tasks.preflight import resolve_config
from tasks.run_store import ActiveRun, RunStore, new_run_id
from tasks.run_store.keys import code_version
from tasks.runtime import ModelInput
from tasks.stage import RunContext
from tasks.tracking.runs import log_file, pipeline_run
from tasks.tracking.setup import configure_tracking, keep_credentials_out
from tasks.typed_yaml import dump_config_text, flatten_for_params

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = ".rlhf_state"


def run_stages(config: PipelineConfig, run_context: RunContext) -> Outcome:
    """Every stage of the pipeline, each a Prefect task run named by its label (and failed by Prefect when it
    runs past ``orchestration.stage_timeout_minutes``)."""
    timed = _timed(config)
    data = timed(data_prep.data_prep_task)("data-prep", data_prep.Config.of(config), data_prep.Inputs(), run_context)
    sft_art = timed(sft.sft_task)("sft", sft.Config.of(config), sft.Inputs(data), run_context)
    reference = sft.model_input(sft_art)
    rm_cfg = reward_model.Config.of(config)
    rm_art = timed(reward_model.reward_model_task)("reward-model", rm_cfg,
                                                   reward_model.Inputs.of(rm_cfg, data, reference), run_context)
    proxy, heldout = reward_model.model_input(rm_art, "proxy"), reward_model.model_input(rm_art, "heldout")
    baseline = timed(best_of_n.best_of_n_task)("best-of-n", best_of_n.Config.of(config),
                                               best_of_n.Inputs(data, reference, proxy, heldout), run_context)
    outcome = Outcome(data, sft_art, rm_art, baseline)
    if config.method == "dpo":
        return run_dpo(config, run_context, outcome, reference, proxy, heldout)
    rm_generation, previous = 0, None
    for k in range(1, config.ppo.iterations + 1):
        ppo = timed(ppo_iteration.ppo_iteration_task)(
            f"ppo-iteration-{k}", ppo_iteration.Config.of(config, k),
            ppo_iteration.Inputs(data, reference, proxy, previous), run_context)
        policy = ppo_iteration.model_input(ppo)
        evaluation = timed(heldout_eval.heldout_eval_task)(
            f"heldout-eval-{k}", heldout_eval.Config.of(config, k, rm_generation),
            heldout_eval.Inputs(data, policy, reference, proxy, heldout, baseline, tuple(outcome.evals)), run_context)
        outcome.ppo.append(ppo)
        outcome.evals.append(evaluation)
        # the held-out RM's verdict: gold only evaluates, it never decides what trains next
        status = heldout_eval.STAGE.result(evaluation).heldout_status
        if k < config.ppo.iterations and should_refresh(config, k, status):
            refresh_cfg = rm_refresh.Config.of(config, k)
            refreshed = timed(rm_refresh.rm_refresh_task)(
                f"rm-refresh-{k}", refresh_cfg,
                rm_refresh.Inputs.of(refresh_cfg, data, policy, proxy, heldout, outcome.refreshes), run_context)
            outcome.refreshes.append(refreshed)
            if rm_refresh.STAGE.result(refreshed).promoted:
                # Proxy scores of different reward models are not comparable: the hacking detector's window
                # restarts at the new generation (the plot keeps every iteration).
                proxy, rm_generation = rm_refresh.model_input(refreshed), rm_generation + 1
        previous = ppo
    return outcome


def run_dpo(config: PipelineConfig, run_context: RunContext, outcome: Outcome, reference: ModelInput, proxy: ModelInput,
            heldout: ModelInput) -> Outcome:
    """The offline method: dpo on the reward-model training pairs, then the heldout-eval a PPO iteration's policy
    gets (as iteration 1: the hacking detector, the best-of-n baseline, promotion to champion). No rm-refresh: DPO
    never samples from the policy, so there are no fresh replies to label and no later iteration to train."""
    timed = _timed(config)
    trained = timed(dpo.dpo_task)("dpo", dpo.Config.of(config), dpo.Inputs(outcome.data, reference), run_context)
    evaluation = timed(heldout_eval.heldout_eval_task)(
        "heldout-eval-1", heldout_eval.Config.of(config, 1, 0),
        heldout_eval.Inputs(outcome.data, dpo.model_input(trained), reference, proxy, heldout, outcome.best_of_n),
        run_context)
    outcome.dpo = trained
    outcome.evals.append(evaluation)
    return outcome


def stage_configs(config: PipelineConfig) -> dict[str, Any]:
    """The config slice each stage ``run_stages`` may run is given, by label (rm-refresh only when refresh is on): what
    enters their artifact keys. Two configs with equal slices compute the same things (``rlhf sweep`` refuses a grid
    key that moves none of them)."""
    slices: dict[str, Any] = {"data-prep": data_prep.Config.of(config), "sft": sft.Config.of(config),
                              "reward-model": reward_model.Config.of(config), "best-of-n": best_of_n.Config.of(config)}
    if config.method == "dpo":
        return {**slices, "dpo": dpo.Config.of(config), "heldout-eval-1": heldout_eval.Config.of(config, 1, 0)}
    for k in range(1, config.ppo.iterations + 1):
        slices[f"ppo-iteration-{k}"] = ppo_iteration.Config.of(config, k)
        slices[f"heldout-eval-{k}"] = heldout_eval.Config.of(config, k, 0)
        if config.refresh.enabled and k < config.ppo.iterations:
            slices[f"rm-refresh-{k}"] = rm_refresh.Config.of(config, k)
    return slices


def _timed(config: PipelineConfig) -> Callable[[Task], Task]:
    """A stage task failed by Prefect when it runs past ``orchestration.stage_timeout_minutes`` (if set)."""
    limit = config.orchestration.stage_timeout_minutes
    return lambda stage_task: stage_task.with_options(timeout_seconds=limit * 60) if limit else stage_task


def should_refresh(config: PipelineConfig, iteration: int, status: str) -> bool:
    """Refresh the proxy RM every ``refresh.every_k`` iterations, or when evaluation's held-out verdict (``status``)
    flags hacking."""
    section = config.refresh
    if not section.enabled:
        return False
    scheduled = section.every_k > 0 and iteration % section.every_k == 0
    return scheduled or (section.on_hacking and status == "hacking")


# --------------------------------------------------------------------------------------------- identity


def prefect_run_id() -> str:
    """The rlhf run id of a flow run started without one: its creation time and its id, so every attempt of the
    same flow run (a retry) names the same rlhf run."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return new_run_id()
    created = context.flow_run.created or datetime.now(timezone.utc)
    return new_run_id(created, context.flow_run.id.hex[:6])


def flow_run_name() -> str:
    """The flow run is named by the rlhf run id."""
    return current_flow_run.parameters.get("run_id") or prefect_run_id()


def _mark(status: str):
    def hook(flow: Any, flow_run: Any, state: Any) -> None:
        store = RunStore(flow_run.parameters.get("state_dir") or DEFAULT_STATE_DIR)
        run_id = flow_run.parameters.get("run_id") or flow_run.name
        if not store.exists(run_id):
            return  # it failed before the run existed (bad parameters)
        message = (state.message or status).splitlines()[0] if state is not None else status
        store.end_run(run_id, status, message)

    hook.__name__ = f"mark_{status}"
    return hook


# --------------------------------------------------------------------------------------------- the flow


# Prefect writes a failed flow run's exception as a result even with persistence off: as JSON, never a pickle.
@flow(name="rlhf-pipeline", flow_run_name=flow_run_name, persist_result=False, result_serializer="json",
      log_prints=True,
      on_failure=[_mark("failed")], on_crashed=[_mark("crashed")], on_cancellation=[_mark("failed")])
def rlhf_pipeline(run_id: str | None = None, state_dir: str = DEFAULT_STATE_DIR, preset: str | None = None,
                  config_file: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run (or continue) pipeline run ``run_id`` under ``state_dir``.

    Without ``run_id`` (a deployment) the id comes from the flow run; the first attempt resolves the config from
    ``preset`` + ``config_file`` + ``overrides`` exactly as ``rlhf run`` does and records it, later attempts (a
    Prefect retry) continue with the recorded config.
    """
    store = RunStore(state_dir).ensure()
    run_id = run_id or prefect_run_id()
    if not store.exists(run_id):
        # as `rlhf run --state-dir D` does: the recorded config says where the run lives
        config = keep_credentials_out(resolve_config(config_file, preset,
                                                     [*(overrides or []), f"state_dir={state_dir}"]))
        store.create_run(config.name, dump_config_text(config), run_id, preset)
    flow_run_id = str(current_flow_run.id) if current_flow_run.id else None
    with (store.hold(run_id, f"Prefect flow run {flow_run_id}" if flow_run_id else "rlhf pipeline") as run,
          run_logging(store.log_file(run_id))):
        run.record.prefect_flow_run_id = flow_run_id or run.record.prefect_flow_run_id
        run.set_status("running")
        config = load_config(store.config_file(run_id))
        summary = execute(config, store, run)
        run.set_status("completed")
    return summary


def execute(config: PipelineConfig, store: RunStore, run: ActiveRun) -> dict[str, Any]:
    """The stages inside the run's MLflow parent run, then the summary.

    The parent is what runs are compared by: its name and ``rlhf.changed`` tag say what the run changed from its
    preset; heldout-eval logs the headline metrics into it per iteration; its description is the summary table.
    """
    configure_tracking(store, config.tracking.tracking_uri)
    started = time.monotonic()
    changes = changed_settings(config, run.record.preset)
    title = run_title(config.name, changes, run.run_id)
    tags = {"rlhf.name": config.name, "rlhf.preset": run.record.preset or "none", "rlhf.code_version": code_version(),
            "rlhf.changed": " ".join(f"{k}={v}" for k, v in changes.items()) or "none",
            **sweep_tags(store, run.record.sweep_id)}
    with pipeline_run(config.tracking.experiment, run.run_id, title, flatten_for_params(config), tags,
                      amended=bool(run.record.amendments)) as parent:
        run.record.mlflow_run_id = parent
        run.save()
        tracking.set_run_name(parent, title)  # an amended config renames it
        tracking.set_description(parent, running_markdown(run.run_id, run.record.preset, changes))
        log_file(parent, store.config_file(run.run_id))  # at the root: the compare page lists top-level files
        outcome = run_stages(config, RunContext(store, run, parent, config.tracking))
        summary = build_summary(config, outcome, run.record)
        summary.update(run_id=run.run_id, seconds=time.monotonic() - started, mlflow_run_id=parent,
                       mlflow_url=tracking.run_url(parent), preset=run.record.preset, changed=changes)
        path = store.write_summary(run.run_id, summary)
        log_file(parent, path)
        tracking.set_tags(parent, {"eval.promoted": str(summary["promoted"])})  # eval.status: heldout-eval's
        tracking.set_description(parent, summary_markdown(summary))
    publish_summary_artifact(summary)
    return summary


def sweep_tags(store: RunStore, sweep_id: str | None) -> dict[str, str]:
    """A sweep's run: its id, and its MLflow parent run nested under the sweep's (the compare page groups them)."""
    if sweep_id is None:
        return {}
    parent = store.load_sweep(sweep_id).mlflow_run_id
    return {tracking.SWEEP_TAG: sweep_id, **({tracking.PARENT_TAG: parent} if parent else {})}


def run_title(name: str, changes: dict[str, str], run_id: str) -> str:
    """The MLflow run name: what the run changed from its preset first (the UI cuts long names), then the
    preset's name and the end of the run id: 'ppo.kl.coef=0.2 · tiny · 8606d2'."""
    changed = " ".join(f"{k}={v}" for k, v in changes.items() if k != "name")
    if len(changed) > 60:
        changed = changed[:59] + "…"
    return " · ".join(part for part in (changed, name, run_id.rsplit("-", 1)[-1]) if part)


def publish_summary_artifact(summary: dict[str, Any]) -> None:
    """The summary as a markdown artifact of the Prefect flow run (its Artifacts tab)."""
    if FlowRunContext.get() is None:
        return
    create_markdown_artifact(summary_markdown(summary), key="rlhf-summary",
                             description=f"rlhf run {summary['run_id']}: results and lineage")
