"""`rlhf sweep` on the tiny preset: 2 settings x 2 seeds as ordinary runs that share each seed's stages, one report
(console, markdown, Prefect artifact, MLflow), the MLflow grouping, refusals before anything exists, and --resume
after a kill."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.cli import main
from flows.sweep import REPORT_JSON, REPORT_MD
from tasks.run_store import RunStore
from tests.flows.live_prefect import wait_for
from tests.flows.test_kill_resume import rlhf, rlhf_env

pytestmark = pytest.mark.slow  # long tests: in the slow run (`pytest -q -m slow`; CI runs both)

GRID = ["--grid", "ppo.kl.coef=0.02,0.2"]
SHARED = ["ppo.iterations=2", "refresh.enabled=false"]
SHARED_STAGES = ("data-prep", "sft", "reward-model", "best-of-n")


def test_a_sweep_runs_its_grid_as_ordinary_runs_sharing_each_seeds_stages(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["sweep", "--preset", "tiny", *GRID, "--seeds", "0,1", "--state-dir", state_dir, *SHARED]) == 0
    out = capsys.readouterr().out
    store = RunStore(state_dir)
    (sweep_dir,) = list((Path(state_dir) / "sweeps").iterdir())
    sweep = store.load_sweep(sweep_dir.name)
    assert sweep.status == "completed" and len(sweep.cells) == 4
    assert [(c.setting["ppo.kl.coef"], c.seed) for c in sweep.cells] == [("0.02", 0), ("0.2", 0), ("0.02", 1),
                                                                          ("0.2", 1)]

    runs = {c.run_id: store.load_run(c.run_id) for c in sweep.cells}
    assert all(r.status == "completed" and r.sweep_id == sweep.sweep_id for r in runs.values())
    # Each seed's shared stages are computed by its first run and reused by the second: computed once per seed.
    computed = Counter(label for r in runs.values() for label, e in r.stages.items() if e.cached_from is None)
    assert all(computed[label] == 2 for label in SHARED_STAGES), computed
    for seed in (0, 1):
        first, second = (runs[c.run_id] for c in sweep.cells if c.seed == seed)
        for label in SHARED_STAGES:
            assert first.stages[label].key == second.stages[label].key
            assert second.stages[label].cached_from == first.run_id
        assert first.stages["ppo-iteration-1"].key != second.stages["ppo-iteration-1"].key

    # The report: one row per setting, means over seeds from the runs' own summaries; the winner by held-out only.
    report = json.loads((sweep_dir / REPORT_JSON).read_text())
    rows = {r["setting"]: r for r in report["settings"]}
    assert list(rows) == ["ppo.kl.coef=0.02", "ppo.kl.coef=0.2"] and report["failed"] == []
    for label, row in rows.items():
        finals = [json.loads(store.summary_file(c.run_id).read_text())["iterations"][-1] for c in sweep.cells
                  if f"ppo.kl.coef={c.setting['ppo.kl.coef']}" == label]
        heldout = [f["eval/heldout/mean"] for f in finals]
        assert row["heldout"][0] == pytest.approx(sum(heldout) / 2) and row["completed"] == 2
        assert row["gold"][0] == pytest.approx(sum(f["eval/gold/mean"] for f in finals) / 2)
    eligible = {k: r for k, r in rows.items() if r["select"] is not None}
    assert report["winner"] == max(eligible, key=lambda k: eligible[k]["select"][0])
    assert [p["n"] for p in report["best_of_n"]] == [1, 2, 4, 8, 16]
    assert "winner by heldout" in out and "ppo.kl.coef=0.02" in out and "best-of-16" in out
    markdown = (sweep_dir / REPORT_MD).read_text()
    assert "| setting | runs |" in markdown and f"`{report['winner']}` **(winner)**" in markdown
    assert (sweep_dir / "sweep_frontier.png").read_bytes().startswith(b"\x89PNG")

    # MLflow: one parent run for the sweep with the report, every run's parent nested under it.
    client = MlflowClient()
    parent = client.get_run(sweep.mlflow_run_id)
    assert parent.data.tags["rlhf.kind"] == "sweep" and parent.data.tags["rlhf.sweep.winner"] == report["winner"]
    assert parent.data.params["sweep.grid.ppo.kl.coef"] == "0.02,0.2" and parent.data.params["sweep.seeds"] == "0,1"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {REPORT_MD, REPORT_JSON,
                                                                          "sweep_frontier.png"}
    for run in runs.values():
        tags = client.get_run(run.mlflow_run_id).data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id and tags["rlhf.sweep_id"] == sweep.sweep_id
    # Prefect: the sweep's flow run carries the report as its markdown artifact.
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        artifact = prefect.read_latest_artifacts(limit=50)
        assert any(a.key == "rlhf-sweep-report" and sweep.sweep_id in (a.data or "") for a in artifact)
        flow_run = prefect.read_flow_run(sweep.prefect_flow_run_id)
        assert flow_run.name == sweep.sweep_id and flow_run.state.is_completed()


def test_runs_side_by_side_each_get_a_process_and_keep_the_sweeps_lineage(tmp_path, monkeypatch):
    """``--concurrency 2``: the two runs of a seed go to two worker processes (building models is not thread-safe),
    share the seed's stages as one after another would, and stay subflows of the sweep's flow run and nested MLflow
    runs under its parent run."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    state_dir = str(tmp_path / "state")
    assert main(["sweep", "--preset", "tiny", *GRID, "--seeds", "0", "--concurrency", "2", "--state-dir", state_dir,
                 *SHARED]) == 0
    store = RunStore(state_dir)
    sweep = store.load_sweep("latest")
    runs = [store.load_run(c.run_id) for c in sweep.cells]
    assert sweep.status == "completed" and [r.status for r in runs] == ["completed", "completed"]
    for label in SHARED_STAGES:  # computed by one run, reused by the other (whichever got there first)
        assert runs[0].stages[label].key == runs[1].stages[label].key
        assert sorted(r.stages[label].cached_from is None for r in runs) == [False, True], label
    client = MlflowClient()
    assert all(client.get_run(r.mlflow_run_id).data.tags["mlflow.parentRunId"] == sweep.mlflow_run_id for r in runs)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        for run in runs:
            flow_run = prefect.read_flow_run(run.prefect_flow_run_id)
            assert flow_run.state.is_completed() and flow_run.parent_task_run_id is not None
            assert str(prefect.read_task_run(flow_run.parent_task_run_id).flow_run_id) == sweep.prefect_flow_run_id


@pytest.mark.parametrize(("args", "message"), [
    (["--grid", "ppo.kl.coef=0.1,0.2", "--select", "gold"], "gold is evaluation-only and never chooses settings"),
    (["--grid", "ppo.kl.coef=0.1,0.2", "--select", "win_rate_gold"], "gold is evaluation-only"),
    (["--grid", "ppo.kl.cof=0.1,0.2"], "unknown setting 'ppo.kl.cof'"),
    (["--grid", "ppo.kl.coef=0.1,-1"], "bad value -1 for 'ppo.kl.coef'"),
    (["--grid", "ppo.keep_checkpoints=1,3"], "--grid ppo.keep_checkpoints: it enters no stage"),
    (["--grid", "tracking.experiment=a,b"], "--grid tracking.experiment: it enters no stage"),
    (["--grid", "seed=0,1"], "give seeds with --seeds"),
    (["--grid", "ppo.kl.coef=0.1", "ppo.kl.coef=0.2"], "given both as --grid and as KEY=VALUE"),
    (["--grid", "ppo.kl.coef"], "write KEY=V1,V2"),
    (["--grid", "ppo.kl.coef=0.1,0.1"], "lists a value twice"),
    (["--grid", "ppo.kl.coef=0.1", "--seeds", "0,x"], "--seeds '0,x'"),
    (["--grid", "ppo.kl.coef=0.1,0.2", "--kl-budget", "0"], "--kl-budget must be a positive number of nats"),
    (["--grid", "ppo.kl.coef=0.1,0.2", "--kl-budget", "inf"], "--kl-budget must be a positive number of nats"),
])
def test_a_bad_sweep_is_refused_in_one_line_before_any_run_exists(tmp_path, capsys, args, message):
    state_dir = tmp_path / "state"
    assert main(["sweep", "--preset", "tiny", "--state-dir", str(state_dir), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not list(state_dir.glob("runs/*")) and not list(state_dir.glob("sweeps/*"))


def still_running(process: subprocess.Popen, predicate) -> bool:
    """``predicate()``, failing the test when the sweep ended before it became true (nothing left to kill)."""
    if process.poll() is not None and not predicate():
        pytest.fail(f"the sweep ended (exit {process.returncode}) before it could be killed")
    return predicate()


@pytest.mark.slow
def test_a_killed_sweep_resumes_keeping_finished_runs_and_continuing_the_rest(tmp_path: Path):
    env, state = rlhf_env(), tmp_path / "state"
    command = rlhf("sweep", "--preset", "tiny", *GRID, "--seeds", "0", "--state-dir", str(state), *SHARED,
                   "ppo.checkpoint_every=1")
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:  # killed while the second run trains: the first is complete, the second has a checkpoint
        ready = lambda: (len(list(state.glob("runs/*/summary.json"))) == 1  # noqa: E731
                         and any(state.glob("work/ppo-iteration/*/checkpoints/latest")))
        wait_for("the first run complete and the second checkpointed", lambda: still_running(process, ready),
                 timeout=600, interval=0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    store = RunStore(state)
    (sweep_dir,) = list((state / "sweeps").iterdir())
    sweep = store.load_sweep(sweep_dir.name)
    first, second = sweep.cells
    done = store.summary_file(first.run_id)
    before = done.stat().st_mtime_ns
    assert not store.summary_file(second.run_id).exists()

    resumed = subprocess.run(rlhf("sweep", "--resume", sweep.sweep_id, "--state-dir", str(state)), env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resuming sweep {sweep.sweep_id}" in resumed.stdout and "winner by heldout" in resumed.stdout
    after = store.load_sweep(sweep.sweep_id)
    assert after.status == "completed" and [c.run_id for c in after.cells] == [first.run_id, second.run_id]
    assert done.stat().st_mtime_ns == before  # the finished run was kept, not run again
    second_run = store.load_run(second.run_id)
    assert second_run.status == "completed"
    assert "continuing PPO from" in store.log_file(second.run_id).read_text() or \
        "resumed PPO from" in store.log_file(second.run_id).read_text()
    report = json.loads((sweep_dir / REPORT_JSON).read_text())
    assert report["failed"] == [] and all(r["completed"] == 1 for r in report["settings"])


@pytest.mark.parametrize(("concurrency", "to_group"), [(2, False), (2, True), (1, True)],
                         ids=["side-by-side-process", "side-by-side-process-group", "one-at-a-time-process-group"])
def test_sigterm_stops_a_sweep_leaving_no_process_and_it_resumes(tmp_path: Path, concurrency: int, to_group: bool):
    """SIGTERM to the sweep's process alone (`kill`) or to its process group (`timeout`, a service manager's stop, a
    cluster's time limit; Ctrl-C in a terminal reaches the group too): its runs stop instead of finishing, whether in
    worker processes or in its own thread, and nothing of the sweep outlives it, not even its Prefect server."""
    import psutil

    env, state = rlhf_env(), tmp_path / "state"
    command = rlhf("sweep", "--preset", "tiny", *GRID, "--seeds", "0", "--concurrency", str(concurrency),
                   "--state-dir", str(state), *SHARED)
    err = tmp_path / "stderr.txt"
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err.open("w"),
                               start_new_session=True)
    try:
        started = lambda: any('"data-prep"' in f.read_text() for f in state.glob("runs/*/run.json"))  # noqa: E731
        wait_for("a run of the sweep to start its stages", lambda: still_running(process, started), timeout=300,
                 interval=0.2)
        workers = psutil.Process(process.pid).children(recursive=True)
        # the temporary Prefect server, and two worker processes (with their helpers) side by side
        assert len(workers) >= (3 if concurrency == 2 else 1)
        if to_group:
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 128 + signal.SIGTERM, err.read_text()[-3000:]
        stderr = err.read_text()
        assert " stopped by SIGTERM; " in stderr and "continue with: rlhf sweep --resume" in stderr
        wait_for("every process of the sweep to end", lambda: not [w for w in workers if w.is_running() and
                                                                   w.status() != psutil.STATUS_ZOMBIE],
                 timeout=15, explain=lambda: str([w.cmdline()[:4] for w in workers if w.is_running()]))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    store = RunStore(state)
    (sweep_dir,) = list((state / "sweeps").iterdir())
    assert not any(store.summary_file(c.run_id).exists() for c in store.load_sweep(sweep_dir.name).cells)

    resumed = subprocess.run(rlhf("sweep", "--resume", sweep_dir.name, "--state-dir", str(state)), env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert store.load_sweep(sweep_dir.name).status == "completed"
