"""Production on one machine, without Docker (infra/local-production.sh): PostgreSQL in a temporary folder, an MLflow
server and a Prefect server on it; three tiny pipelines with different settings run against both at once on one
state folder, and what they wrote is read back from PostgreSQL itself. Every process the script started is gone
after its `stop`."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tasks.run_store import RunStore

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "infra" / "local-production.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not glob.glob("/usr/lib/postgresql/*/bin/pg_ctl") and not os.environ.get("PG_BIN"),
                       reason="no PostgreSQL server binaries here (Debian: postgresql-15; or set PG_BIN)"),
    pytest.mark.skipif(importlib.util.find_spec("psycopg2") is None or importlib.util.find_spec("asyncpg") is None,
                       reason="the postgres extra is not installed (pip install -e '.[postgres]')"),
]


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_three_runs_at_once_and_a_retry_on_postgres_backed_mlflow_and_prefect_servers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg2
    from mlflow import MlflowClient

    pg, mlflow_port, prefect_port = free_ports(3)
    env = {**os.environ, "PG_PORT": str(pg), "MLFLOW_PORT": str(mlflow_port), "PREFECT_PORT": str(prefect_port)}
    # PostgreSQL runs as the postgres user when the tests run as root: its folder must not sit under a private one
    stack = Path(tempfile.mkdtemp(prefix="rlhf-pg-"))
    stack.chmod(0o755)
    started = subprocess.run(["bash", str(SCRIPT), "start", str(stack)], env=env, capture_output=True, text=True,
                             timeout=300)
    pids = [int(p.read_text()) for p in (stack / "run").glob("*.pid")]
    try:
        assert started.returncode == 0, started.stderr
        exports = dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines())
        assert exports == {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
                           "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api"}
        run_env = {**os.environ, **exports, "PYTHONPATH": str(REPO)}
        # three runs with different settings at once on one state folder: the shared stages are computed once
        runs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--state-dir",
                                  str(tmp_path / "state"), "ppo.iterations=1", "refresh.enabled=false",
                                  f"ppo.kl.coef={coef}"], env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for coef in (0.05, 0.1, 0.2)]
        outputs = [run.communicate(timeout=1200) for run in runs]
        assert [run.returncode for run in runs] == [0, 0, 0], [err[-2000:] for _, err in outputs]
        records = RunStore(tmp_path / "state").list_runs()
        assert len(records) == 3
        for label in ("data-prep", "sft", "reward-model"):
            assert len({r.stages[label].key for r in records}) == 1
            assert sum(err.count(f"{label}: computing artifact") for _, err in outputs) == 1
        assert len({r.stages["ppo-iteration-1"].key for r in records}) == 3

        client = MlflowClient(exports["MLFLOW_TRACKING_URI"])
        experiments = [e.experiment_id for e in client.search_experiments()]
        for record in records:
            (parent,) = client.search_runs(experiments, f"tags.`rlhf.run_id` = '{record.run_id}' and "
                                                        "tags.`rlhf.kind` = 'pipeline'")
            assert parent.info.status == "FINISHED" and "eval/gold/mean" in parent.data.metrics
            with psycopg2.connect(host="127.0.0.1", port=pg, user="postgres", dbname="mlflow") as db:
                with db.cursor() as cur:
                    cur.execute("SELECT count(*) FROM metrics WHERE run_uuid = %s", (parent.info.run_id,))
                    assert cur.fetchone()[0] > 0
                    cur.execute("SELECT DISTINCT v.name FROM model_version_tags t JOIN model_versions v ON t.name = "
                                "v.name AND t.version = v.version WHERE t.key = 'rlhf.run_id' AND t.value = %s",
                                (record.run_id,))
                    assert {"rlhf-tiny-policy", "rlhf-tiny-reward-model"} <= {row[0] for row in cur.fetchall()}
        with psycopg2.connect(host="127.0.0.1", port=pg, user="postgres", dbname="mlflow") as db, db.cursor() as cur:
            cur.execute("SELECT alias FROM registered_model_aliases WHERE name = 'rlhf-tiny-policy'")
            assert "candidate" in {row[0] for row in cur.fetchall()}
        with psycopg2.connect(host="127.0.0.1", port=pg, user="postgres", dbname="prefect") as db, db.cursor() as cur:
            cur.execute("SELECT name, state_type FROM flow_run")
            assert sorted(cur.fetchall()) == sorted((r.run_id, "COMPLETED") for r in records)

        # A stage fails (in this process, as a worker's flow run fails), then `prefect flow-run retry` in another
        # process continues the same rlhf run and the same flow run on these servers.
        failed = _failed_run(tmp_path / "retry", exports, monkeypatch)
        retried = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", failed.prefect_flow_run_id,
                                  "--entrypoint", "flows/pipeline.py:rlhf_pipeline"], cwd=REPO, env=run_env,
                                 capture_output=True, text=True, timeout=900)
        assert retried.returncode == 0, retried.stdout[-3000:] + retried.stderr[-3000:]
        (record,) = RunStore(tmp_path / "retry").list_runs()
        assert record.run_id == failed.run_id and record.status == "completed"
        assert record.prefect_flow_run_id == failed.prefect_flow_run_id
        with psycopg2.connect(host="127.0.0.1", port=pg, user="postgres", dbname="prefect") as db, db.cursor() as cur:
            cur.execute("SELECT name, state_type, run_count FROM flow_run WHERE id = %s", (record.prefect_flow_run_id,))
            name, state, attempts = cur.fetchone()
            assert (name, state) == (record.run_id, "COMPLETED") and attempts >= 2

        # The MLflow server killed mid-run (during SFT) and started again by the script (`start` brings back what
        # died). Curves wait for it in the stage's sender; a synchronous call (a param, a registration) that meets
        # the outage fails the stage once its bounded retries (1 + 2 + 4 s) are spent, in one line naming
        # `rlhf resume`, which then finishes the same run: either way every value reaches the restarted server.
        err = tmp_path / "outage.err"
        with err.open("w") as sink:
            outage = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--state-dir",
                                       str(tmp_path / "outage"), "ppo.iterations=1", "refresh.enabled=false",
                                       "tracking.experiment=rlhf-outage"], env=run_env, stdout=subprocess.DEVNULL,
                                      stderr=sink)
        deadline = time.monotonic() + 600
        while "sft: computing artifact" not in err.read_text() and outage.poll() is None:
            assert time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.5)
        killed = int((stack / "run" / "mlflow.pid").read_text())
        os.killpg(killed, signal.SIGKILL)
        while alive(killed):
            time.sleep(0.2)
        time.sleep(5)
        again = subprocess.run(["bash", str(SCRIPT), "start", str(stack)], env=env, capture_output=True, text=True,
                               timeout=300)
        assert again.returncode == 0, again.stderr
        if outage.wait(timeout=900) != 0:
            (line,) = [ln for ln in err.read_text().splitlines() if ln.startswith("rlhf: run ")]
            assert "MlflowException" in line and "continue with: rlhf resume" in line, line
            (record,) = RunStore(tmp_path / "outage").list_runs()
            resumed = subprocess.run([sys.executable, "-m", "flows.cli", "resume", record.run_id, "--state-dir",
                                      str(tmp_path / "outage")], env=run_env, capture_output=True, text=True,
                                     timeout=900)
            assert resumed.returncode == 0, resumed.stderr[-3000:]
        (record,) = RunStore(tmp_path / "outage").list_runs()
        assert record.status == "completed"
        experiment = client.get_experiment_by_name("rlhf-outage").experiment_id
        (parent,) = client.search_runs([experiment], f"tags.`rlhf.run_id` = '{record.run_id}' and "
                                                     "tags.`rlhf.kind` = 'pipeline'")
        assert "eval/gold/mean" in parent.data.metrics
        (sft,) = client.search_runs([experiment], f"tags.`rlhf.run_id` = '{record.run_id}' and "
                                                  "tags.`rlhf.stage` = 'sft'")
        assert "sft/final_eval_loss" in sft.data.metrics
    finally:
        pids += [int(p.read_text()) for p in (stack / "run").glob("*.pid")]  # a server the test restarted
        stopped = subprocess.run(["bash", str(SCRIPT), "stop", str(stack)], env=env, capture_output=True, text=True,
                                 timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert pids and not any(alive(pid) for pid in pids)
    assert not (stack / "pgdata" / "postmaster.pid").exists()
    shutil.rmtree(stack)


def flush_prefect_workers() -> None:
    """Deliver and stop this process's Prefect event and log workers while the server they write to is up.

    A worker keeps the API address it started with: one started here (when this is the session's first flow run in
    process) would go on sending every later test's events to this stack after its servers are stopped, and the
    harness's drain at the end of the session would wait on them for ever. The next flow run starts fresh ones."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=120, at_exit=False)


def _failed_run(state: Path, servers: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """A tiny pipeline run in this process against ``servers`` whose heldout-eval stage fails once; its record."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import tasks.stage
    from flows.pipeline import rlhf_pipeline
    from tasks.tracking import setup as tracking_setup

    real = tasks.stage.run_stage

    def failing(stage, label, *args, **kwargs):
        if label == "heldout-eval-1":
            raise RuntimeError(f"{label}: injected failure")
        return real(stage, label, *args, **kwargs)

    monkeypatch.setattr(tasks.stage, "run_stage", failing)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", servers["MLFLOW_TRACKING_URI"])
    monkeypatch.setattr(tracking_setup, "_store", tracking_setup._store)  # restored after the test
    monkeypatch.setattr(tracking_setup, "_own_uri", tracking_setup._own_uri)
    with temporary_settings(updates={PREFECT_API_URL: servers["PREFECT_API_URL"]}):
        try:
            with pytest.raises(RuntimeError, match="injected failure"):
                rlhf_pipeline(state_dir=str(state), preset="tiny",
                              overrides=["ppo.iterations=1", "refresh.enabled=false"])
        finally:
            flush_prefect_workers()
    monkeypatch.setattr(tasks.stage, "run_stage", real)
    (record,) = RunStore(state).list_runs()
    assert record.status == "failed" and "injected failure" in record.error
    return record
