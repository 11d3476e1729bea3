"""The scheduled deployment and the infra files point at code and presets that exist."""

from __future__ import annotations

import inspect
from pathlib import Path

import yaml

from flows.deployments import pipeline_deployment
from flows.pipeline import rlhf_pipeline
from tasks.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_deployment_has_the_schedule_the_config_layers_and_one_run_at_a_time():
    deployment = pipeline_deployment("tiny", overrides=["ppo.kl.coef=0.1"], cron="0 3 * * *")
    assert deployment.parameters == {"preset": "tiny", "config_file": None, "overrides": ["ppo.kl.coef=0.1"],
                                     "state_dir": ".rlhf_state"}
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == "0 3 * * *"
    assert deployment.concurrency_limit == 1
    assert deployment.entrypoint.endswith("flows/pipeline.py:rlhf_pipeline") or deployment.flow_name == "rlhf-pipeline"


def test_prefect_yaml_entrypoint_and_config_exist():
    spec = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    (deployment,) = spec["deployments"]
    module, function = deployment["entrypoint"].split(":")
    assert f"def {function}(" in (ROOT / module).read_text()
    parameters = deployment["parameters"]
    config_file = parameters["config_file"] and str(ROOT / parameters["config_file"])
    load_config(config_file, parameters["preset"], parameters["overrides"])  # resolved as `rlhf run` resolves it
    assert set(parameters) <= set(inspect.signature(rlhf_pipeline.fn).parameters)
    assert deployment["schedules"][0]["cron"] == "0 3 * * *"


def test_compose_runs_prefect_mlflow_and_postgres():
    services = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())["services"]
    assert {"postgres", "prefect", "mlflow", "worker"} <= set(services)
    assert "postgresql" in services["mlflow"]["command"]
    assert services["prefect"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql")
