"""Scheduled deployments of the pipeline flow (Prefect work pools put them on the right machines)."""

from __future__ import annotations

from collections.abc import Sequence

from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.schedules import Cron

from flows.pipeline import DEFAULT_STATE_DIR, rlhf_pipeline


def pipeline_deployment(preset: str | None = "demo", config_file: str | None = None, overrides: Sequence[str] = (),
                        name: str = "rlhf-nightly", cron: str | None = "0 3 * * *", timezone: str = "UTC",
                        work_pool: str | None = None, state_dir: str = DEFAULT_STATE_DIR) -> RunnerDeployment:
    """A deployment that starts a new pipeline run on ``cron`` (in ``timezone``), its config resolved from
    ``preset`` + ``config_file`` + ``overrides`` exactly as ``rlhf run --preset P --config F KEY=VALUE...``
    resolves it (``rlhf schedule`` builds it so).

    Each flow run is one rlhf run (its id derived from the flow run), so a retry of a failed flow run continues that
    rlhf run. One run at a time (concurrency limit 1; a run due while one is running waits). ``work_pool`` names a
    Prefect work pool whose workers run the flows; without one the deployment is served by the process that calls
    ``serve``. The entrypoint is the module path, so a worker finds the flow wherever the package is installed.
    """
    parameters = {"preset": preset, "config_file": config_file, "overrides": list(overrides), "state_dir": state_dir}
    schedule = Cron(cron, timezone=timezone) if cron else None
    return rlhf_pipeline.to_deployment(
        name=name, schedules=[schedule] if schedule else None, parameters=parameters, work_pool_name=work_pool,
        concurrency_limit=1, entrypoint_type=EntrypointType.MODULE_PATH,
        description="data-prep -> sft -> reward-model -> best-of-n -> (ppo-iteration -> heldout-eval -> "
                    "[rm-refresh]) x N",
        tags=["rlhf"],
    )
