"""`kill -9` in the middle of a PPO iteration, then `rlhf resume`: same final metrics as an uninterrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

OVERRIDES = ["ppo.iterations=2", "ppo.updates_per_iteration=4", "ppo.checkpoint_every=1"]


def rlhf_env() -> dict[str, str]:
    """The user's environment without the test session's MLflow/Prefect settings: each run uses its state dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return env


def rlhf(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


def summary_of(state: Path) -> dict:
    (run,) = list((state / "runs").iterdir())
    return json.loads((run / "summary.json").read_text())


def wait_for_mid_iteration_checkpoint(state: Path, process: subprocess.Popen, timeout: float = 600) -> str:
    """Block until iteration 2 has written a checkpoint before its last step (in its key's work folder: iteration
    1's is cleared when it is published); returns its name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for latest in state.glob("work/ppo-iteration/*/checkpoints/latest"):
            name = latest.read_text().strip()
            if name in ("step_000005", "step_000006"):
                return name
        if process.poll() is not None:
            pytest.fail(f"the run ended (exit {process.returncode}) before it could be killed mid-iteration")
        time.sleep(0.02)
    pytest.fail("no mid-iteration checkpoint appeared")


@pytest.mark.slow
def test_kill_9_during_ppo_then_resume_matches_the_uninterrupted_run(tmp_path: Path):
    env = rlhf_env()
    straight = tmp_path / "straight"
    subprocess.run(rlhf("run", "--preset", "tiny", "--state-dir", str(straight), *OVERRIDES), env=env,
                   check=True, capture_output=True, cwd=tmp_path, timeout=900)

    killed = tmp_path / "killed"
    process = subprocess.Popen(rlhf("run", "--preset", "tiny", "--state-dir", str(killed), *OVERRIDES), env=env,
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        checkpoint = wait_for_mid_iteration_checkpoint(killed, process)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the run and its temporary Prefect server
        process.wait()
    assert not list(killed.glob("runs/*/summary.json"))
    # Killed without a word: `rlhf runs` finds its lock free and marks it crashed, here and in Prefect.
    listing = subprocess.run(rlhf("runs", "--state-dir", str(killed)), env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=600)
    assert listing.returncode == 0 and " crashed " in listing.stdout, listing.stdout + listing.stderr[-2000:]
    (record,) = [json.loads(p.read_text()) for p in killed.glob("runs/*/run.json")]
    assert record["status"] == "crashed" and record["prefect_flow_run_id"]
    read_state = ("import sys\nfrom prefect.client.orchestration import get_client\n"
                  "with get_client(sync_client=True) as c:\n    print(c.read_flow_run(sys.argv[1]).state.type.value)")
    prefect_state = subprocess.run([sys.executable, "-c", read_state, record["prefect_flow_run_id"]],
                                   env={**env, "PREFECT_HOME": str(killed / "prefect")}, cwd=tmp_path,
                                   capture_output=True, text=True, timeout=600)
    assert prefect_state.stdout.strip() == "CRASHED", prefect_state.stderr[-2000:]

    resumed = subprocess.run(rlhf("resume", "latest", "--state-dir", str(killed)), env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(next(killed.glob("runs/*/run.json")).read_text())["status"] == "completed"
    # It continued inside iteration 2 from the checkpoint seen before the kill (or one written just after it).
    match = re.search(r"resumed PPO from \S*work/ppo-iteration/\w+/checkpoints/(step_\d+)", resumed.stderr)
    assert match and checkpoint <= match.group(1) < "step_000008", resumed.stderr[-3000:]
    expected, actual = summary_of(straight), summary_of(killed)
    assert actual["policies"] == expected["policies"]
    assert [i["eval/gold/mean"] for i in actual["iterations"]] == [i["eval/gold/mean"] for i in expected["iterations"]]
    # The same artifacts by key, bit for bit: the resumed iteration's weights, optimizer state and samples are
    # identical (its JSON records hold wall-clock timings, which differ).
    assert {k: v["artifact"] for k, v in actual["artifacts"].items()} == \
        {k: v["artifact"] for k, v in expected["artifacts"].items()}
    for label in ("ppo-iteration-2",):
        key = actual["artifacts"][label]["artifact"]
        straight_files = json.loads((straight / "artifacts" / key / "record.json").read_text())["files"]
        killed_files = json.loads((killed / "artifacts" / key / "record.json").read_text())["files"]
        def weights(files: dict) -> dict[str, str]:
            return {f: m["sha256"] for f, m in files.items() if f.endswith((".safetensors", ".parquet"))}
        assert len(weights(straight_files)) >= 3 and weights(straight_files) == weights(killed_files)
        # The final checkpoint (what iteration 3 would continue from) is resume state beside the artifact.
        resumed = [{str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in (root / "resume" / key).rglob("*") if p.suffix == ".safetensors"}
                   for root in (straight, killed)]
        assert len(resumed[0]) >= 2 and resumed[0] == resumed[1]


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [False, True], ids=["process", "process-group"])
def test_sigterm_during_ppo_stops_the_run_and_its_prefect_server_in_one_line_then_resume_completes(tmp_path: Path,
                                                                                                  to_group: bool):
    """SIGTERM to the `rlhf run` process alone (`kill`) or to its process group (`timeout`, a service manager's
    stop, a cluster's time limit): status 143, a line that says how to continue, the run recorded crashed, and
    nothing left behind. Prefect re-sends the signal to the handler it found (with Python's default one the process
    used to die on the spot and leave Prefect's temporary server running); and Prefect's own temporary server, in
    the command's group, died with a group signal and left the command retrying its reports for half an hour."""
    import psutil

    env, state = rlhf_env(), tmp_path / "state"
    err = tmp_path / "stderr.txt"
    process = subprocess.Popen(rlhf("run", "--preset", "tiny", "--state-dir", str(state), *OVERRIDES), env=env,
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err.open("w"), start_new_session=True)
    try:
        wait_for_mid_iteration_checkpoint(state, process)
        children = psutil.Process(process.pid).children(recursive=True)
        (server,) = [c for c in children if "flows.prefect_server" in " ".join(c.cmdline())]  # temporary server
        assert os.getpgid(server.pid) != process.pid  # out of the group's signals: it records how the run ended
        if to_group:
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    stderr = err.read_text()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    (record,) = [json.loads(p.read_text()) for p in state.glob("runs/*/run.json")]
    assert f"rlhf: run {record['run_id']} stopped by SIGTERM" in stderr and "continue with: rlhf resume" in stderr
    assert record["status"] == "crashed"
    time.sleep(5)  # the server's own exit, after its SIGTERM
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    resumed = subprocess.run(rlhf("resume", "latest", "--state-dir", str(state)), env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(next(state.glob("runs/*/run.json")).read_text())["status"] == "completed"
