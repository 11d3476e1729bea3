"""`rlhf run`, `rlhf runs`, `rlhf stage` and `rlhf resume` from the command line (in process), on the tiny preset."""

from __future__ import annotations

import json
import time

import pytest

import tasks.sft
from flows.cli import main
from tasks.run_store import RunStore


def test_run_then_list_then_recompute_one_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["run", "--preset", "tiny", "--state-dir", state_dir, "ppo.iterations=1"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "\nsft " in out and "\nfinal " in out and "mlflow ui --backend-store-uri" in out
    store = RunStore(state_dir)
    (record,) = store.list_runs()
    summary = json.loads(store.summary_file(record.run_id).read_text())
    assert summary["run_id"] == record.run_id and summary["seconds"] > 0

    assert main(["runs", "--state-dir", state_dir]) == 0
    listing = capsys.readouterr().out
    assert record.run_id in listing and "completed" in listing

    assert main(["stage", "heldout-eval", "--run", "latest", "--state-dir", state_dir]) == 0
    after = store.load_run(record.run_id)
    changed = {label for label, entry in after.stages.items() if entry.key != record.stages[label].key}
    assert changed == {"heldout-eval-1"} and after.reruns == {"heldout-eval": 1}
    assert store.artifact("heldout-eval", after.stages["heldout-eval-1"].key).record.produced_by == record.run_id


def test_resume_can_amend_the_config_and_records_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["run", "--preset", "tiny", "--state-dir", state_dir, "ppo.iterations=1",
                 "refresh.enabled=false"]) == 0
    store = RunStore(state_dir)
    (record,) = store.list_runs()
    # One more iteration on a finished run: the first one is reused, the second continues from it.
    assert main(["resume", record.run_id, "--state-dir", state_dir, "--set", "ppo.iterations=2"]) == 0
    after = store.load_run(record.run_id)
    assert after.amendments[0]["overrides"] == ["ppo.iterations=2"]
    assert after.stages["ppo-iteration-1"].key == record.stages["ppo-iteration-1"].key
    assert after.stages["ppo-iteration-2"].status == "completed"
    assert (store.config_file(record.run_id).parent / "config.1.yaml").is_file()
    assert "iterations: 2" in store.config_file(record.run_id).read_text()


def test_bad_override_and_stage_names_are_one_clear_line(tmp_path, capsys):
    assert main(["run", "--preset", "tiny", "--state-dir", str(tmp_path), "ppo.ppo.clip_rang=0.3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown setting 'ppo.ppo'" in err[0]
    assert main(["stage", "ppo-iteration-0", "--run", "latest", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown stage 'ppo-iteration-0'" in err[0]
    assert main(["resume", "nope", "--state-dir", str(tmp_path)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


def test_a_stage_that_runs_past_its_timeout_fails_in_one_line_and_resumes(tmp_path, monkeypatch, capsys):
    """The operator's rerun path: one line (stage, cause, log file, resume command), the traceback in the log, then
    `rlhf resume` with the limit lifted finishes the same run."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    real = tasks.sft.read_demonstrations

    def hung(*args, **kwargs):  # sft hangs while reading its data (a stuck node, a dead file system)
        time.sleep(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(tasks.sft, "read_demonstrations", hung)
    state_dir = str(tmp_path / "state")
    started = time.monotonic()
    assert main(["run", "--preset", "tiny", "--state-dir", state_dir, "ppo.iterations=1", "refresh.enabled=false",
                 "orchestration.stage_timeout_minutes=0.1"]) == 1
    assert time.monotonic() - started < 100
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    (line,) = err
    store = RunStore(state_dir)
    (record,) = store.list_runs()
    assert record.status == "failed" and f"run {record.run_id} failed in stage sft: TaskRunTimeoutError" in line
    assert "(orchestration.stage_timeout_minutes)" in line and f"log: {store.log_file(record.run_id)}" in line
    assert line.endswith(f"continue with: rlhf resume {record.run_id} --state-dir {store.root}")
    log = store.log_file(record.run_id).read_text()
    assert "Traceback (most recent call last)" in log and "TaskRunTimeoutError" in log
    assert "data-prep: computing artifact" in log  # the attempt's progress lines, for the operator

    monkeypatch.setattr(tasks.sft, "read_demonstrations", real)
    assert main(["resume", record.run_id, "orchestration.stage_timeout_minutes=null", "--state-dir", state_dir]) == 0
    assert store.load_run(record.run_id).status == "completed"


def test_the_ui_hint_links_the_run_on_a_free_port(tmp_path):
    import socket

    from flows.commands import server_port, mlflow_hint

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        assert server_port(busy) != busy
    summary = {"mlflow_run_id": "abc", "mlflow_url": "http://mlflow:5000/#/experiments/3/runs/abc"}
    assert mlflow_hint(RunStore(tmp_path), summary) == "MLflow run: http://mlflow:5000/#/experiments/3/runs/abc"


def test_an_unreachable_prefect_server_is_one_line_naming_it(tmp_path):
    """No traceback when Prefect cannot be reached: the URL, the resume command, and the run marked failed."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(PREFECT_API_URL=f"http://127.0.0.1:{port}/api", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    state = tmp_path / "state"
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--state-dir", str(state)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"the Prefect API at http://127.0.0.1:{port}/api did not answer" in line and "rlhf resume" in line
    (record,) = RunStore(state).list_runs()
    assert record.status == "failed"


def test_a_diverging_ppo_run_stops_in_one_line_and_registers_nothing_non_finite(tmp_path, monkeypatch, capsys):
    """ppo.learning_rate=1e3 turns the policy to NaN within a step: the step is refused before the optimizer
    applies it, the stage fails naming the step and the quantity, and no PPO policy is saved, registered,
    evaluated or promoted."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["run", "--preset", "tiny", "--state-dir", state_dir, "ppo.learning_rate=1e3"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "failed in stage ppo-iteration-1: NonFiniteError: PPO step 1: " in line
    assert "is nan" in line and "Lower ppo.learning_rate" in line
    store = RunStore(state_dir)
    (record,) = store.list_runs()
    assert record.status == "failed" and "heldout-eval-1" not in record.stages
    assert store.artifact("ppo-iteration", record.stages["ppo-iteration-1"].key) is None
    versions = MlflowClient().search_model_versions("name='rlhf-tiny-policy'")
    assert [v.tags["rlhf.stage"] for v in versions] == ["sft"]


@pytest.mark.parametrize("override, stage, message", [
    ("sft.learning_rate=1e4", "sft", "NonFiniteError: SFT step "),
    ("reward_model.training.learning_rate=1e8", "reward-model", "NonFiniteError: reward-model step "),
])
def test_sft_and_reward_model_training_stop_on_non_finite_values(override, stage, message, tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["run", "--preset", "tiny", "--state-dir", state_dir, "ppo.iterations=1", override]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"failed in stage {stage}: {message}" in line and "training stopped before applying it" in line
    (record,) = RunStore(state_dir).list_runs()
    assert RunStore(state_dir).artifact(stage, record.stages[stage].key) is None  # nothing published


def test_the_console_holds_the_projects_own_lines_and_the_run_log_the_libraries(tmp_path):
    """`rlhf run` on the console: our log lines on stderr, the results table on stdout, and no library's warning on
    either (a deprecation, DeepSpeed's accelerator note printed on every machine without a GPU); those go to the
    run's log file."""
    import importlib.util
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--state-dir", str(state),
                           "ppo.iterations=1", "refresh.enabled=false"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = re.compile(r"^\d\d:\d\d:\d\d (rlhf_core|tasks|flows)(\.\w+)*: ")
    assert [line for line in done.stderr.splitlines() if not ours.match(line)] == []
    assert not re.search(r"warn", done.stdout, re.IGNORECASE), done.stdout
    (record,) = RunStore(state).list_runs()
    if importlib.util.find_spec("deepspeed") is not None:
        assert "Setting accelerator to CPU" in RunStore(state).log_file(record.run_id).read_text()


def test_sigterm_becomes_an_exit_that_names_it_and_another_handler_is_kept(monkeypatch):
    import signal

    from flows import cli
    from flows.commands import stopped_by

    installed = {}
    monkeypatch.setattr(signal, "signal", lambda number, handler: installed.__setitem__(number, handler))
    monkeypatch.setattr(signal, "getsignal", lambda number: signal.SIG_DFL)
    cli.exit_on_sigterm()
    with pytest.raises(SystemExit) as stop:
        installed[signal.SIGTERM](signal.SIGTERM, None)
    assert stop.value.code == 143 and stopped_by(stop.value) == "stopped by SIGTERM"
    assert stopped_by(KeyboardInterrupt()) == "stopped by Ctrl-C" and stopped_by(SystemExit(3)) == "stopped (exit 3)"

    installed.clear()  # a handler someone else installed (a test runner's, a service's) is not replaced
    monkeypatch.setattr(signal, "getsignal", lambda number: print)
    cli.exit_on_sigterm()
    assert installed == {}
