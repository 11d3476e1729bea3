"""Scheduled deployments of the pipeline flow (Prefect work pools put them on the right machines)."""

from __future__ import annotations

from prefect.deployments.runner import RunnerDeployment

from flows.pipeline import rlhf_pipeline


def pipeline_deployment(config_path: str, name: str = "rlhf-nightly", cron: str | None = "0 3 * * *",
                        work_pool: str | None = None) -> RunnerDeployment:
    """A deployment that starts a new pipeline run with ``config_path`` on ``cron`` (UTC).

    ``work_pool`` names a Prefect work pool (e.g. a GPU pool, see infra/prefect.yaml); without one the
    deployment is served by the process that calls ``serve``.
    """
    return rlhf_pipeline.to_deployment(
        name=name, cron=cron, parameters={"config_path": config_path}, work_pool_name=work_pool,
        description="data-prep -> sft -> reward-model -> (ppo-iteration -> heldout-eval) x N", tags=["rlhf"],
    )
