"""infra/docker-compose.yml: valid Compose, services that wait for each other's health, restart, reach each other by
name, keep their state on declared volumes, and send nothing home.

No Docker engine is needed: the file is read as data (and checked by `docker compose config` where the plugin is).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import metadata, resources
from urllib.parse import urlsplit

import jsonschema
import pytest

from tests.infra.infra_files import COMPOSE_FILE, INFRA, compose, dockerfile

#: Who waits for whom; each waits until the other's healthcheck passes.
DEPENDENCIES = {"postgres": set(), "prefect": {"postgres"}, "mlflow": {"postgres"}, "worker": {"prefect", "mlflow"}}


def compose_schema() -> dict | None:
    """The Compose Specification schema that check-jsonschema ships (None when it is not installed)."""
    try:
        schema = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    except ModuleNotFoundError:
        return None
    return json.loads(schema.read_text()) if schema.is_file() else None


def test_compose_file_follows_the_compose_specification():
    schema = compose_schema()
    if schema is None:
        pytest.skip("the Compose Specification schema comes with check-jsonschema: pip install check-jsonschema")
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{'/'.join(map(str, error.absolute_path)) or '<top>'}: {error.message}"
              for error in validator.iter_errors(compose())]
    assert not errors, "\n".join(errors)


def test_docker_compose_config_accepts_the_file():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode:
        pytest.skip("no Docker Compose plugin here (`docker compose version` fails)")
    result = subprocess.run([docker, "compose", "-f", str(COMPOSE_FILE), "config", "-q"], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_services_start_once_what_they_depend_on_is_healthy():
    services = compose()["services"]
    assert set(services) == set(DEPENDENCIES)
    for name, service in services.items():
        depends_on = service.get("depends_on", {})
        assert isinstance(depends_on, dict), f"{name}: a depends_on list waits only for the containers to start"
        assert set(depends_on) == DEPENDENCIES[name], name
        for target, how in depends_on.items():
            assert how.get("condition") == "service_healthy", f"{name} -> {target}"
            check = services[target].get("healthcheck", {})
            assert check.get("test") and not check.get("disable"), f"{target} has no healthcheck for {name} to wait on"


def test_every_service_restarts_after_a_crash_or_reboot():
    for name, service in compose()["services"].items():
        assert service.get("restart") in {"unless-stopped", "always"}, name


def listening_ports() -> dict[str, int]:
    """The port each server listens on inside the stack, read from its command or its published port."""
    services = compose()["services"]
    mlflow_port = re.search(r"--port (\d+)", services["mlflow"]["command"])
    prefect_port = services["prefect"]["ports"][0].split(":")[-1]
    worker_port = 8080  # PREFECT_WORKER_WEBSERVER_PORT's default, where --with-healthcheck serves /health
    return {"mlflow": int(mlflow_port[1]), "prefect": int(prefect_port), "worker": worker_port}


@pytest.mark.parametrize(("service", "probe"), [
    ("postgres", "pg_isready"),
    ("prefect", "http://127.0.0.1:{port}/api/health"),
    ("mlflow", "http://127.0.0.1:{port}/health"),
    ("worker", "http://127.0.0.1:{port}/health"),  # served by `prefect worker start --with-healthcheck`
])
def test_healthchecks_ask_each_server_its_health_endpoint(service, probe):
    services = compose()["services"]
    test = " ".join(services[service]["healthcheck"]["test"])
    assert probe.format(port=listening_ports().get(service)) in test
    if service == "worker":
        assert "--with-healthcheck" in services["worker"]["command"]


def test_volumes_are_declared_and_bind_mounts_exist():
    spec = compose()
    for name, service in spec["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (INFRA / source).exists(), f"{name}: bind mount {source} is missing"
            else:
                assert source in spec.get("volumes", {}), f"{name}: named volume {source} is not declared"


def test_worker_reaches_prefect_and_mlflow_by_service_name():
    from mlflow.server.security_utils import is_allowed_host_header

    services = compose()["services"]
    environment = services["worker"]["environment"]
    ports = listening_ports()
    for variable, service, path in [("PREFECT_API_URL", "prefect", "/api"), ("MLFLOW_TRACKING_URI", "mlflow", "")]:
        url = urlsplit(environment[variable])
        assert (url.hostname, url.port, url.path) == (service, ports[service], path), variable
    # MLflow refuses (403) a Host header outside its allowed hosts, and the default allows no service names.
    allowed = services["mlflow"]["environment"]["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert is_allowed_host_header(allowed, urlsplit(environment["MLFLOW_TRACKING_URI"]).netloc)
    assert is_allowed_host_header(allowed, f"localhost:{ports['mlflow']}")  # the UI on the host itself


def test_both_servers_keep_their_data_in_postgres_databases_that_exist():
    services = compose()["services"]
    created = {services["postgres"]["environment"]["POSTGRES_DB"]}
    for script in (INFRA / "initdb").glob("*.sql"):
        created |= set(re.findall(r"CREATE DATABASE (\w+)", script.read_text(), flags=re.IGNORECASE))
    prefect_url = services["prefect"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    mlflow_url = re.search(r"--backend-store-uri (\S+)", services["mlflow"]["command"])[1]
    for url in (prefect_url, mlflow_url):
        parts = urlsplit(url)
        assert parts.scheme.startswith("postgresql") and parts.hostname == "postgres", url
        assert parts.path.lstrip("/") in created, f"{url}: no initdb script creates this database"


def test_mlflow_image_has_the_postgres_driver_and_installs_nothing_at_start():
    mlflow = compose()["services"]["mlflow"]
    assert "pip install" not in mlflow["command"]
    instructions = dockerfile(INFRA / mlflow["build"]["context"] / mlflow["build"]["dockerfile"])
    assert any(item.keyword == "RUN" and "psycopg2-binary" in item.arguments for item in instructions)
    base = next(item.arguments for item in instructions if item.keyword == "FROM")
    assert base == "ghcr.io/mlflow/mlflow:v${MLFLOW_VERSION}"


def test_server_images_run_the_versions_the_clients_use():
    prefect_image = compose()["services"]["prefect"]["image"]
    assert prefect_image == f"prefecthq/prefect:{metadata.version('prefect')}-python3.11"
    mlflow = compose()["services"]["mlflow"]
    instructions = dockerfile(INFRA / mlflow["build"]["context"] / mlflow["build"]["dockerfile"])
    server = next(item.arguments.split("=")[1] for item in instructions if item.arguments.startswith("MLFLOW_VERSION="))
    assert server.split(".")[0] == metadata.version("mlflow").split(".")[0], "MLflow client and server majors differ"


def test_nothing_phones_home_and_logs_are_at_info():
    services = compose()["services"]
    for name in ("mlflow", "worker"):  # every service that runs MLflow or the pipeline
        assert services[name]["environment"]["MLFLOW_DISABLE_TELEMETRY"] == "true", name
    assert services["prefect"]["environment"]["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    for name in ("prefect", "worker"):
        assert services[name]["environment"]["PREFECT_LOGGING_LEVEL"] == "INFO", name
