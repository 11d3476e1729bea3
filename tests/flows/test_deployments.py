"""The scheduled deployment `rlhf schedule` builds (infra/prefect.yaml and the compose stack: tests/infra)."""

from __future__ import annotations

from flows.deployments import pipeline_deployment


def test_deployment_has_the_schedule_the_config_layers_and_one_run_at_a_time():
    deployment = pipeline_deployment("tiny", overrides=["ppo.kl.coef=0.1"], cron="0 3 * * *")
    assert deployment.parameters == {"preset": "tiny", "config_file": None, "overrides": ["ppo.kl.coef=0.1"],
                                     "state_dir": ".rlhf_state"}
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == "0 3 * * *"
    assert deployment.concurrency_limit == 1
    assert deployment.entrypoint.endswith("flows/pipeline.py:rlhf_pipeline") or deployment.flow_name == "rlhf-pipeline"
