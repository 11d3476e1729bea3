"""Scheduled deployments of the pipeline flow (Prefect work pools put them on the right machines)."""

from __future__ import annotations

from collections.abc import Sequence

from prefect.deployments.runner import RunnerDeployment

from flows.pipeline import DEFAULT_STATE_DIR, rlhf_pipeline


def pipeline_deployment(preset: str | None = "demo", config_file: str | None = None, overrides: Sequence[str] = (),
                        name: str = "rlhf-nightly", cron: str | None = "0 3 * * *", work_pool: str | None = None,
                        state_dir: str = DEFAULT_STATE_DIR) -> RunnerDeployment:
    """A deployment that starts a new pipeline run on ``cron`` (UTC), its config resolved from ``preset`` +
    ``config_file`` + ``overrides`` exactly as ``rlhf run --preset P --config F KEY=VALUE...`` resolves it.

    Each flow run is one rlhf run (its id derived from the flow run), so a retry of a failed flow run continues that
    rlhf run. One run at a time (concurrency limit 1). ``work_pool`` names a Prefect work pool (e.g. a GPU pool, see
    infra/prefect.yaml); without one the deployment is served by the process that calls ``serve``.
    """
    parameters = {"preset": preset, "config_file": config_file, "overrides": list(overrides), "state_dir": state_dir}
    return rlhf_pipeline.to_deployment(
        name=name, cron=cron, parameters=parameters, work_pool_name=work_pool, concurrency_limit=1,
        description="data-prep -> sft -> reward-model -> best-of-n -> (ppo-iteration -> heldout-eval -> [rm-refresh]) x N",
        tags=["rlhf"],
    )
