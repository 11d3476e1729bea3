"""The scheduled deployment and the infra files point at code and presets that exist."""

from __future__ import annotations

from pathlib import Path

import yaml

from flows.deployments import pipeline_deployment
from tasks.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_deployment_has_the_schedule_and_the_config():
    deployment = pipeline_deployment("infra/presets/demo.yaml", cron="0 3 * * *")
    assert deployment.parameters == {"config_path": "infra/presets/demo.yaml"}
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == "0 3 * * *"
    assert deployment.entrypoint.endswith("flows/pipeline.py:rlhf_pipeline") or deployment.flow_name == "rlhf-pipeline"


def test_prefect_yaml_entrypoint_and_config_exist():
    spec = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    (deployment,) = spec["deployments"]
    module, function = deployment["entrypoint"].split(":")
    assert f"def {function}(" in (ROOT / module).read_text()
    load_config(str(ROOT / deployment["parameters"]["config_path"]))
    assert deployment["schedules"][0]["cron"] == "0 3 * * *"


def test_compose_runs_prefect_mlflow_and_postgres():
    services = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())["services"]
    assert {"postgres", "prefect", "mlflow", "worker"} <= set(services)
    assert "postgresql" in services["mlflow"]["command"]
    assert services["prefect"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql")
