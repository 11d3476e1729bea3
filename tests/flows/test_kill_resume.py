"""`kill -9` in the middle of a PPO iteration, then `rlhf resume`: same final metrics as an uninterrupted run."""

from __future__ import annotations

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
    """Block until iteration 2 has written a checkpoint before its last step; returns its name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for latest in state.glob("runs/*/ppo/iter_002/checkpoints/latest"):
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

    resumed = subprocess.run(rlhf("resume", "latest", "--state-dir", str(killed)), env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # It continued inside iteration 2 from the checkpoint seen before the kill (or one written just after it).
    match = re.search(r"resumed PPO from \S*iter_002/checkpoints/(step_\d+)", resumed.stderr)
    assert match and checkpoint <= match.group(1) < "step_000008", resumed.stderr[-3000:]
    expected, actual = summary_of(straight), summary_of(killed)
    assert actual["policies"] == expected["policies"]
    assert [i["eval/gold/mean"] for i in actual["iterations"]] == [i["eval/gold/mean"] for i in expected["iterations"]]
