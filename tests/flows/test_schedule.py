"""`rlhf schedule` and `rlhf server`: the config a scheduled run records, the one-line refusals, and (slow) a real
Prefect server and a served schedule that fires, runs the pipeline, and runs it again from cache."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import psutil
import pytest
from transformers import GPT2Config

from flows import commands, serving
from flows.cli import build_parser, main
from flows.pipeline import rlhf_pipeline
from tasks.run_store import RunRecord, RunStore
from tests.flows.live_prefect import (FINAL_STATES, PrefectApi, Processes, clean_env, rlhf, state_type,
                                      wait_for)
from tests.tiny_models import word_tokenizer

OVERRIDES = ["ppo.iterations=1", "refresh.enabled=false"]
TIMEZONE = "Asia/Kolkata"
HEADLINE = ("eval/gold/mean", "eval/kl/mean", "eval/heldout/mean", "eval/proxy/mean", "eval/win_rate/gold")


@pytest.fixture
def restored_environ() -> Iterator[None]:
    """The CLI's `prepare_environment` sets variables and logging for its process; give the session them back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# --------------------------------------------------------------------------------------------- in process


def test_a_scheduled_run_records_the_config_rlhf_run_records(tmp_path, monkeypatch, restored_environ):
    monkeypatch.chdir(tmp_path)
    Path("my.yaml").write_text("ppo:\n  kl:\n    coef: 0.07\ndata:\n  demo:\n    n_pairs: 120\n", encoding="utf-8")
    state = tmp_path / "state"
    arguments = ["--preset", "tiny", "--config", "my.yaml", "--state-dir", str(state), *OVERRIDES]

    # `rlhf run` records its config before the flow starts; the flow itself is not needed here.
    monkeypatch.setattr(commands, "_execute", lambda store, run_id: 0)
    assert main(["run", *arguments]) == 0
    (by_run,) = RunStore(state).list_runs(reconcile=False)

    args = build_parser().parse_args(["schedule", "--cron", "0 3 * * *", *arguments])
    parameters, name = serving.schedule_parameters(args)
    assert parameters == {"preset": "tiny", "config_file": str(tmp_path / "my.yaml"), "overrides": OVERRIDES,
                          "state_dir": str(state)}
    assert name == "tiny"
    # What a flow run of the deployment records: the flow resolves the parameters itself (stages left out).
    monkeypatch.setattr("flows.pipeline.execute", lambda config, store, run: {})
    rlhf_pipeline.fn(**parameters)
    (by_schedule,) = [r for r in RunStore(state).list_runs(reconcile=False) if r.run_id != by_run.run_id]

    store = RunStore(state)
    recorded_by_run = store.config_file(by_run.run_id).read_text(encoding="utf-8")
    assert "coef: 0.07" in recorded_by_run and "n_pairs: 120" in recorded_by_run and "iterations: 1" in recorded_by_run
    assert store.config_file(by_schedule.run_id).read_text(encoding="utf-8") == recorded_by_run
    assert by_schedule.preset == by_run.preset == "tiny"


def test_a_schedule_for_a_work_pool_names_files_by_absolute_paths(tmp_path, monkeypatch):
    """A worker runs the flow in its own folder: relative file settings become absolute where `rlhf schedule` ran;
    a model id that is no local path (and every setting of a served schedule) stays as given."""
    monkeypatch.chdir(tmp_path)
    Path("pairs.jsonl").write_text("{}\n", encoding="utf-8")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # a hub id must be cached (checked before scheduling)
    snapshot = tmp_path / "hub" / "models--org--tiny-gpt2" / "snapshots" / ("0" * 40)
    GPT2Config(n_embd=32, n_layer=1, n_head=2).save_pretrained(snapshot)
    word_tokenizer().save_pretrained(snapshot)  # a policy comes with its tokenizer (checked before scheduling too)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    given = ["data.source=files", 'data.files=["pairs.jsonl"]', "refresh.enabled=false", "sft.base_model=org/tiny-gpt2"]
    for pool, expected in ((None, given), ("rlhf-pool", [*given, f'data.files=["{tmp_path / "pairs.jsonl"}"]'])):
        args = build_parser().parse_args(["schedule", "--cron", "0 3 * * *", "--preset", "tiny", "--state-dir",
                                          "state", *(["--pool", pool] if pool else []), *given])
        parameters, _ = serving.schedule_parameters(args)
        assert parameters["overrides"] == expected and parameters["state_dir"] == str(tmp_path / "state")


def test_schedule_without_a_server_is_refused_in_one_line(tmp_path, monkeypatch, capsys, restored_environ):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    state = tmp_path / "state"
    assert main(["schedule", "--cron", "* * * * *", "--preset", "tiny", "--state-dir", str(state)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("rlhf schedule: error: ") and f"rlhf server --state-dir {state}" in err[0]
    assert "PREFECT_API_URL" in err[0]


def test_schedule_refuses_a_bad_setting_before_anything_else(tmp_path, monkeypatch, capsys, restored_environ):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    state = tmp_path / "state"
    assert main(["schedule", "--cron", "* * * * *", "--preset", "tiny", "--state-dir", str(state),
                 "ppo.kl.coef=abc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ppo.kl.coef" in err[0] and "abc" in err[0], err
    assert "server" not in err[0]  # the setting is checked first, before looking for a server
    assert not state.exists()


# --------------------------------------------------------------------------------------------- real server


@pytest.fixture
def processes(tmp_path) -> Iterator[Processes]:
    """Processes the test starts; whatever is left of them is killed afterwards, even when the test failed."""
    started = Processes(tmp_path / "logs")
    yield started
    started.kill_all()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_served_schedule_fires_at_its_minute_and_reuses_every_stage_of_an_earlier_run(tmp_path, processes):
    state = tmp_path / "state"
    url = start_server(processes, state)
    api = PrefectApi(url)
    try:
        # Due once, at a minute in Kolkata time (UTC+05:30): a schedule read in UTC would miss it by half an hour.
        due = next_minute(lead_seconds=45)
        local = due.astimezone(ZoneInfo(TIMEZONE))
        cron = f"{local.minute} {local.hour} * * *"
        # The runner polls every 10 s by default; 2 s starts the quick run sooner.
        processes.start("schedule", rlhf("schedule", "--cron", cron, "--timezone", TIMEZONE, "--preset",
                                                  "tiny", "--state-dir", str(state), "--name", "t", *OVERRIDES),
                                 clean_env(PREFECT_RUNNER_POLL_FREQUENCY="2"), tmp_path)
        deployed = wait_for("the deployment", lambda: processes.running("schedule") and api.deployment(
            "rlhf-pipeline", "t"), timeout=90, explain=processes.logs_of_all)
        assert deployed["schedules"][0]["schedule"] == {"cron": cron, "timezone": TIMEZONE, "day_or": True}
        assert deployed["global_concurrency_limit"]["limit"] == 1 and deployed["paused"] is False

        # "Quick run" in the UI, while the schedule waits for its minute: it computes every stage.
        quick_id = api.create_flow_run(deployed["id"])["id"]
        quick = finished_run(processes, lambda: [api.flow_run(quick_id)])
        computed = check_run(state, api, quick)
        assert computed.stages and not any(entry.cached_from for entry in computed.stages.values())
        assert "data-prep: computing artifact" in processes.output("schedule")  # progress reaches the console

        # The scheduled run, on unchanged inputs, reuses every stage of the quick run and is complete in MLflow.
        scheduled = finished_run(processes, lambda: [
            run for run in api.flow_runs(deployed["id"]) if run["auto_scheduled"]][:1], timeout=due_in(due) + 150)
        assert datetime.fromisoformat(scheduled["expected_start_time"]) == due
        nightly = check_run(state, api, scheduled)
        assert nightly.run_id != computed.run_id
        assert {label: e.cached_from for label, e in nightly.stages.items()} == dict.fromkeys(computed.stages,
                                                                                              computed.run_id)
        tags = parent_run(state, nightly).data.tags
        assert {k: v for k, v in tags.items() if k.startswith("rlhf.cached_from.")} == {
            f"rlhf.cached_from.{label}": computed.run_id for label in computed.stages}

        # Ctrl-C stops serving and pauses the schedule.
        assert processes.stop("schedule", signal.SIGINT) == 0, processes.log("schedule")
        assert api.deployment_by_id(deployed["id"])["paused"] is True
    finally:
        api.close()
    # SIGTERM stops the server, its Prefect server with it (a child: `leftovers` knows it), and removes the file
    # that points to it.
    assert processes.stop("server", signal.SIGTERM) == 128 + signal.SIGTERM
    assert not (state / "prefect" / commands.SERVER_FILE).exists()
    wait_for("every started process to end", lambda: not processes.leftovers(), timeout=30,
             explain=lambda: f"left: {processes.leftovers()}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_mid_run_pauses_the_schedule_cancels_the_run_and_exits_within_the_bound(tmp_path, processes):
    state = tmp_path / "state"
    api = PrefectApi(start_server(processes, state))
    try:
        processes.start("schedule", rlhf("schedule", "--cron", "0 3 1 1 *", "--preset", "tiny", "--state-dir",
                                          str(state), "--name", "t", *OVERRIDES),
                        clean_env(PREFECT_RUNNER_POLL_FREQUENCY="2"), tmp_path)
        deployed = wait_for("the deployment", lambda: processes.running("schedule") and api.deployment(
            "rlhf-pipeline", "t"), timeout=90, explain=processes.logs_of_all)
        quick_id = api.create_flow_run(deployed["id"])["id"]
        wait_for("the quick run to start", lambda: processes.running("schedule") and state_type(
            api.flow_run(quick_id)) == "RUNNING", timeout=150, interval=1, explain=processes.logs_of_all)

        in_flight = psutil.Process(processes.started["schedule"].pid).children(recursive=True)
        assert in_flight, processes.logs_of_all()

        # SIGTERM (a service manager's stop): the schedule is paused, the run in flight cancelled and its process
        # ended, and `rlhf schedule` exits 0 within its bound, however long Prefect's own teardown would take.
        assert processes.stop("schedule", signal.SIGTERM, timeout=serving.STOP_GRACE_S + 30) == 0
        assert "stopping: pausing the schedule" in processes.output("schedule")
        assert not [p for p in in_flight if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert api.deployment_by_id(deployed["id"])["paused"] is True
        wait_for("the run in flight to be cancelled", lambda: state_type(api.flow_run(quick_id)) == "CANCELLED",
                 timeout=60, explain=lambda: f"{api.flow_run(quick_id)['state']}\n{processes.logs_of_all()}")
    finally:
        api.close()
    assert processes.stop("server", signal.SIGTERM) == 128 + signal.SIGTERM
    wait_for("every started process to end", lambda: not processes.leftovers(), timeout=30,
             explain=lambda: f"left: {processes.leftovers()}")


def start_server(processes: Processes, state: Path) -> str:
    """Start `rlhf server` for ``state`` on a free port; its API URL once it answers."""
    server = processes.start("server", rlhf("server", "--state-dir", str(state), "--port",
                                            str(commands.server_port(4311))), clean_env(), state.parent)
    server_file = state / "prefect" / commands.SERVER_FILE
    url = wait_for("the Prefect server to answer",
                   lambda: processes.running("server") and server_file.is_file() and commands.running_server(state),
                   timeout=150, explain=processes.logs_of_all)
    assert json.loads(server_file.read_text())["pid"] != server.pid  # `prefect server start`, a child process
    return url


def next_minute(lead_seconds: float) -> datetime:
    """The first whole minute (UTC) at least ``lead_seconds`` from now."""
    earliest = datetime.now(timezone.utc) + timedelta(seconds=lead_seconds)
    return earliest.replace(second=0, microsecond=0) + timedelta(minutes=1)


def due_in(when: datetime) -> float:
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def finished_run(processes: Processes, runs: Callable[[], list[dict]], timeout: float = 150) -> dict:
    """The flow run ``runs()`` returns, once it is final (while `rlhf schedule` serves); it must be COMPLETED."""

    def final() -> dict | None:
        processes.running("schedule")
        return next((run for run in runs() if state_type(run) in FINAL_STATES), None)

    flow_run = wait_for("a flow run of the deployment to finish", final, timeout=timeout, interval=2,
                        explain=processes.logs_of_all)
    assert state_type(flow_run) == "COMPLETED", f"{flow_run['state']}\n{processes.logs_of_all()}"
    return flow_run


def check_run(state: Path, api: PrefectApi, flow_run: dict) -> RunRecord:
    """The rlhf run of a completed flow run: its record, MLflow parent, Prefect artifact and Prefect logs."""
    (record,) = [r for r in RunStore(state).list_runs() if r.prefect_flow_run_id == flow_run["id"]]
    assert record.status == "completed"
    assert flow_run["name"] == record.run_id and record.run_id.endswith(flow_run["id"].replace("-", "")[:6])
    assert RunStore(state).log_file(record.run_id).is_file()

    client = mlflow_client(state)
    parent = parent_run(state, record)
    assert parent.info.status == "FINISHED"
    for metric in HEADLINE:
        (point,) = client.get_metric_history(parent.info.run_id, metric)
        assert point.step == 1 and math.isfinite(point.value), metric
    assert parent.data.tags["eval.status"] and parent.data.tags["rlhf.preset"] == "tiny"
    changed = dict(item.split("=", 1) for item in parent.data.tags["rlhf.changed"].split())
    assert changed.keys() == {"ppo.iterations", "refresh.enabled"} and changed["ppo.iterations"] == "1"

    (artifact,) = [a for a in api.artifacts(flow_run["id"]) if a["key"] == "rlhf-summary"]
    assert artifact["type"] == "markdown" and record.run_id in artifact["description"]

    # Our log lines reach the flow run's log page: one per stage. They are sent in batches, and the last batch
    # may land just after the flow run is final.
    def stage_lines() -> list[str] | None:
        lines = [m for m in api.log_messages(flow_run["id"])
                 if ": computing artifact " in m or ": reusing artifact " in m]
        return lines if len(lines) >= len(record.stages) else None

    lines = wait_for("one log line per stage on the flow run", stage_lines, timeout=30,
                     explain=lambda: "\n".join(api.log_messages(flow_run["id"])))
    assert sorted(line.split(":", 1)[0] for line in lines) == sorted(record.stages)
    return record


def parent_run(state: Path, record: RunRecord):
    """The MLflow parent run of ``record`` (found by its tags, and the one its record names)."""
    client = mlflow_client(state)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (parent,) = client.search_runs(experiments, f"tags.`rlhf.run_id` = '{record.run_id}' and "
                                                "tags.`rlhf.kind` = 'pipeline'")
    assert parent.info.run_id == record.mlflow_run_id
    return parent


def mlflow_client(state: Path):
    """A client of the state folder's MLflow store (not the test session's)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{state}/mlflow.db")
