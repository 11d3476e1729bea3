"""infra/prefect.yaml: both deployments run the pipeline flow with a config `rlhf run` would accept, on the pool the
compose worker polls, in the worker's own environment; the compose one where the worker image has the code and the
state volume, the local one in the repository it was deployed from."""

from __future__ import annotations

import ast

import pytest
from prefect.utilities.templating import apply_values

from tasks.config import load_config
from tests.infra.infra_files import ROOT, compose, deployments, dockerfile, pull_directory, workdir

COMPOSE_DEPLOYMENT, LOCAL_DEPLOYMENT = "rlhf-nightly", "rlhf-nightly-local"


def flow_parameters(entrypoint: str) -> set[str]:
    """The parameter names of the flow function an entrypoint ``path.py:function`` names (read, not imported)."""
    path, function = entrypoint.split(":")
    tree = ast.parse((ROOT / path).read_text())
    (definition,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function]
    return {argument.arg for argument in definition.args.args + definition.args.kwonlyargs}


def test_the_deployments_are_one_for_the_compose_stack_and_one_for_a_local_server():
    assert set(deployments()) == {COMPOSE_DEPLOYMENT, LOCAL_DEPLOYMENT}


@pytest.mark.parametrize("name", [COMPOSE_DEPLOYMENT, LOCAL_DEPLOYMENT])
def test_deployment_runs_the_pipeline_nightly_one_at_a_time_with_a_config_rlhf_run_accepts(name):
    deployment = deployments()[name]
    parameters = deployment["parameters"]
    assert set(parameters) == {"preset", "config_file", "overrides", "state_dir"}
    assert set(parameters) <= flow_parameters(deployment["entrypoint"])
    config_file = parameters["config_file"] and str(ROOT / parameters["config_file"])
    load_config(config_file, parameters["preset"], parameters["overrides"])  # resolved as `rlhf run` resolves it
    assert deployment["concurrency_limit"] == 1
    assert [schedule["cron"] for schedule in deployment["schedules"]] == ["0 3 * * *"]


def worker_pools() -> set[str]:
    """Every pool the compose worker's command names (the one it creates, the one it polls)."""
    command = compose()["services"]["worker"]["command"].split()
    named = [command[i + 1] for i, word in enumerate(command[:-1]) if word in {"--pool", "-p", "create", "inspect"}]
    return set(named)


@pytest.mark.parametrize("name", [COMPOSE_DEPLOYMENT, LOCAL_DEPLOYMENT])
def test_deployment_goes_to_the_pool_the_compose_worker_creates_and_polls(name):
    assert worker_pools() == {"rlhf-pool"}
    assert deployments()[name]["work_pool"]["name"] == "rlhf-pool"


@pytest.mark.parametrize("name", [COMPOSE_DEPLOYMENT, LOCAL_DEPLOYMENT])
def test_flow_runs_see_the_workers_environment(name):
    environment = deployments()[name]["work_pool"].get("job_variables", {}).get("env", {})
    assert not {"MLFLOW_TRACKING_URI", "PREFECT_API_URL"} & set(environment), environment


def test_compose_deployment_runs_the_image_code_and_writes_to_the_state_volume():
    deployment = deployments()[COMPOSE_DEPLOYMENT]
    worker = compose()["services"]["worker"]
    image_root = workdir(dockerfile(ROOT / worker["build"]["dockerfile"]))
    # No placeholder: the directory is the same wherever `prefect deploy` and the worker run.
    assert apply_values(pull_directory(deployment), {}) == image_root
    mounts = dict(volume.split(":")[1::-1] for volume in worker["volumes"])  # target -> source
    state_dir = deployment["parameters"]["state_dir"]
    assert state_dir in mounts, f"the worker mounts nothing at {state_dir}"
    assert mounts[state_dir] in compose()["volumes"], "the state must be on a named volume"


def test_local_deployment_runs_in_the_repository_it_was_deployed_from(monkeypatch):
    deployment = deployments()[LOCAL_DEPLOYMENT]
    monkeypatch.setenv("PWD", "/srv/checkouts/rlhf")
    # `prefect deploy` fills the pull step from its own environment (and keeps what it cannot fill).
    assert apply_values(pull_directory(deployment), {}, remove_notset=False) == "/srv/checkouts/rlhf"
    monkeypatch.delenv("PWD")
    assert apply_values(pull_directory(deployment), {}, remove_notset=False) == "{{ $PWD }}"
    # A relative state folder lands in that directory, where `rlhf run` and `rlhf runs` look by default.
    assert deployment["parameters"]["state_dir"] == load_config().state_dir
