"""Tracking outages are bounded: an unreachable server fails a run in seconds and in one line before it exists;
a real ``mlflow server`` killed mid-stage does not stop training, and gets every value once it is back.

No timings are asserted: the order of events shows that logging never waited on the server (every value of the
outage is logged before the server is started again; had ``log`` blocked, the test would hang to its timeout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from flows.cli import main
from flows.commands import server_port
from tasks.tracking.runs import StageTracker
from tasks.tracking.setup import TrackingUnavailable

BIN = Path(sys.executable).parent


def _start_server(db: Path, artifacts: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    with log.open("a") as out:
        process = subprocess.Popen([str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{db}",
                                    "--default-artifact-root", artifacts.as_uri(), "--host", "127.0.0.1",
                                    "--port", str(port), "--workers", "1"],
                                   env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, f"mlflow server exited {process.returncode}:\n{log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"mlflow server did not answer /health in 120 s:\n{log.read_text()[-2000:]}")


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the server and its uvicorn worker, without a goodbye
    except ProcessLookupError:
        pass
    process.wait()


@pytest.fixture
def tracking_uri():
    previous = mlflow.get_tracking_uri()
    yield
    mlflow.set_tracking_uri(previous)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_server_killed_mid_stage_gets_every_value_once_it_is_back(tmp_path: Path, tracking_uri,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast inside the sender; it retries itself
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    db, artifacts, log = tmp_path / "mlflow.db", tmp_path / "artifacts", tmp_path / "server.log"
    port = server_port(0)
    url = f"http://127.0.0.1:{port}"
    server = _start_server(db, artifacts, port, log)
    try:
        mlflow.set_tracking_uri(url)
        client = MlflowClient(url)
        experiment = client.create_experiment("outage")
        parent = client.create_run(experiment).info.run_id
        stage = client.create_run(experiment).info.run_id
        tracker = StageTracker(stage, parent, tmp_path / "metrics.jsonl")
        for step in range(5):
            tracker.log({"ppo/loss": float(step), "ppo/kl": 0.1 * step}, step, to_parent=["ppo/kl"])
        tracker.flush()
        assert len(client.get_metric_history(stage, "ppo/loss")) == 5

        _kill(server)
        for step in range(5, 25):  # training goes on: every call returns while nothing answers
            tracker.log({"ppo/loss": float(step), "ppo/kl": 0.1 * step}, step, to_parent=["ppo/kl"])
        assert tracker._sender.queued > 0  # waiting for the server, not lost
        with pytest.raises(TrackingUnavailable, match=r"has not taken \d+ metric values for 2 s.*metrics.jsonl"):
            tracker._sender.drain(2, tracker.record)  # a stage end that gives up says where the values are

        server = _start_server(db, artifacts, port, log)  # back, on the same address and store
        tracker.flush()
        losses = client.get_metric_history(stage, "ppo/loss")
        assert sorted((m.step, m.value) for m in losses) == [(s, float(s)) for s in range(25)]
        assert sorted(m.step for m in client.get_metric_history(parent, "ppo/kl")) == list(range(25))
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 25
    finally:
        _kill(server)


def test_an_unreachable_server_refuses_the_run_in_one_line_before_it_exists(tmp_path: Path, tracking_uri,
                                                                             capsys: pytest.CaptureFixture[str],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    port = server_port(0)  # nothing listens there
    state = tmp_path / "state"
    code = main(["run", "--preset", "tiny", "--state-dir", str(state), f"tracking.tracking_uri=http://127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (f"rlhf run: error: MLflow tracking server http://127.0.0.1:{port} is not reachable (ConnectionError "
                   "within 5 s); start it, or unset MLFLOW_TRACKING_URI / tracking.tracking_uri to track into the "
                   "state folder")
    assert not (state / "runs").exists() or not any((state / "runs").iterdir())
