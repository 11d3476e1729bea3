"""Launch hygiene: the workers of a stage run in a process group of their own that ends with the stage (SIGTERM,
then SIGKILL), a one-node launch picks a free rendezvous port each time, so a retry never collides with the
workers of the attempt before it."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks import launch as launch_module
from tasks.config import DistributedSection, load_config
from tasks.launch import DistributedJob, free_port, launch, launch_command
from tasks.typed_yaml import ConfigError

#: A stand-in for torchrun: starts a "worker" (a grandchild in the same process group) that may ignore SIGTERM,
#: writes both pids, logs one metrics line, then either waits (a training that would run on) or exits at once,
#: leaving its worker behind.
LAUNCHER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    workdir, ignore_term, exit_now = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
    worker = ("import signal, time\\n"
              + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if ignore_term else "")
              + "time.sleep(120)\\n")
    child = subprocess.Popen([sys.executable, "-c", worker])
    with open(os.path.join(workdir, "pids"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 1, "metrics": {"loss": 1.0}}) + "\\n")
    if not exit_now:
        time.sleep(120)
""")


class _Stop(Exception):
    """What a stage raising mid-training looks like to launch()."""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for its parent to reap it has ended
        return stat.read().split()[2] != "Z"


def run_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ignore_term: bool, exit_now: bool,
                 on_log) -> tuple[list[int], float]:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    monkeypatch.setattr(launch_module, "launch_command",
                        lambda section, job_file, node_rank=0, port=None:
                        [sys.executable, str(script), str(tmp_path), str(int(ignore_term)), str(int(exit_now))])
    monkeypatch.setattr(launch_module, "POLL_SECONDS", 0.1)
    monkeypatch.setattr(launch_module, "STOP_GRACE_SECONDS", 1.0)
    section = DistributedSection(deepspeed_config="x.json")
    started = time.monotonic()
    try:
        launch(section, DistributedJob("ppo", str(tmp_path), "x.json", "tasks.ppo_job", {}), on_log)
    except _Stop:
        pass
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    return pids, time.monotonic() - started


def stop(step: int, metrics: dict[str, float]) -> None:
    raise _Stop


@pytest.mark.parametrize("ignore_term", [False, True], ids=["terminates", "ignores-sigterm"])
def test_a_stage_that_fails_mid_training_takes_its_workers_with_it(tmp_path, monkeypatch, ignore_term):
    (launcher, worker), _ = run_launcher(tmp_path, monkeypatch, ignore_term, exit_now=False, on_log=stop)
    deadline = time.monotonic() + 5
    while (alive(launcher) or alive(worker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(launcher) and not alive(worker)  # SIGTERM, or SIGKILL after the grace time


def test_a_worker_the_launcher_leaves_behind_is_ended_too(tmp_path, monkeypatch):
    seen = []
    (launcher, worker), _ = run_launcher(tmp_path, monkeypatch, False, exit_now=True,
                                         on_log=lambda step, metrics: seen.append(step))
    assert seen == [1]  # the launcher's metrics still reached the stage
    deadline = time.monotonic() + 5
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker)


def test_one_node_launches_pick_a_free_port_each_time_and_several_nodes_must_name_one(tmp_path):
    section = DistributedSection(deepspeed_config="x.json", num_processes=2)
    assert section.master_port is None
    port = free_port()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # nothing listens there
    job = DistributedJob("ppo", str(tmp_path), "x.json", "tasks.ppo_job", {})
    assert f"--master-port={port}" in launch_command(section, job, port=port)
    with pytest.raises(ValueError, match="needs a rendezvous port"):
        launch_command(section, job)
    fixed = DistributedSection(deepspeed_config="x.json", master_port=29600)
    assert "--master-port=29600" in launch_command(fixed, job)
    with pytest.raises(ConfigError, match=r"num_nodes > 1 needs distributed.master_port") as info:
        load_config(preset="tiny", overrides=["distributed.deepspeed_config=x.json", "distributed.num_nodes=2"])
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"launcher=deepspeed needs distributed.hostfile") as info:
        load_config(preset="tiny", overrides=["distributed.deepspeed_config=x.json", "distributed.num_nodes=2",
                                              "distributed.launcher=deepspeed", "distributed.master_port=29500"])
    assert "\n" not in str(info.value)
