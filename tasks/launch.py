"""Launching a stage's training on DeepSpeed workers, whatever the training is.

A stage with ``distributed.deepspeed_config`` set hands its training job (``tasks.ppo_job.PPOJob``,
``tasks.reward_job.RewardModelJob``) to :func:`launch_job`: it writes a :class:`DistributedJob` (the job as data,
the DeepSpeed config) as ``job.json``, starts ``num_processes`` x ``num_nodes`` workers running the job's own module
(``python -m tasks.ppo_job --job <file>``, ``tasks.reward_job``: each rebuilds the job and runs it through
``tasks.distributed_train``) with torchrun or the deepspeed launcher, and feeds the metrics rank 0 writes (one JSON
line per step) to the stage's MLflow callback while they run. The stage holds no model while its workers train;
what it does afterwards (saving, registering, samples, plots) is the same code as when it trains in its own process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.config import DistributedSection
from tasks.typed_yaml import config_to_dict

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 10.0
"""How long the workers of a stage that ended early get between SIGTERM and SIGKILL."""

OnLog = Callable[[int, dict[str, float]], None]


@dataclass(frozen=True)
class DistributedJob:
    """A job handed to DeepSpeed workers, written as ``<workdir>/job.json``: the stage's training job as data
    (serialized once, rebuilt strictly by the worker), never a second config file."""

    stage: str
    """'ppo' or 'reward-model': which kind of job ``job`` is (for messages)."""
    workdir: str
    """Folder of the job: ``job.json``, ``metrics.jsonl`` (rank 0, one line per step) and what the job's kind keeps
    there (the reward model's ``initial/`` folder and outputs)."""
    deepspeed_config: str
    """Absolute path of the DeepSpeed JSON."""
    worker: str
    """The module every worker runs (``python -m <worker> --job <job.json>``): the job's own."""
    job: dict[str, Any]
    """The training job as data (``typed_yaml.config_to_dict``)."""

    @property
    def path(self) -> Path:
        return Path(self.workdir) / "job.json"

    def write(self) -> Path:
        """``<workdir>/job.json``."""
        self.path.write_text(json.dumps(asdict(self), indent=1), encoding="utf-8")
        return self.path

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> DistributedJob:
        """The job a stage wrote."""
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))


def launch_job(distributed: DistributedSection, workdir: str | os.PathLike[str], job: Any,
               on_log: OnLog | None) -> None:
    """Run ``job`` (a training job dataclass: its ``kind``, and its module is the workers' entry point) on the
    workers of ``distributed`` to the end, from the folder ``workdir`` (created; its old metrics dropped)."""
    ds_config = Path(distributed.deepspeed_config).resolve()
    if not ds_config.is_file():
        raise FileNotFoundError(f"distributed.deepspeed_config {distributed.deepspeed_config!r} does not exist "
                                f"(looked in {ds_config}); see infra/deepspeed/")
    folder = fresh_workdir(workdir)
    launch(distributed, DistributedJob(job.kind, str(folder), str(ds_config), type(job).__module__,
                                       config_to_dict(job)), on_log)


def fresh_workdir(workdir: str | os.PathLike[str]) -> Path:
    """``workdir`` resolved and created, without the metrics of an earlier launch."""
    folder = Path(workdir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").unlink(missing_ok=True)
    return folder


# --------------------------------------------------------------------------------------------- launching


def launch_command(section: DistributedSection, job: DistributedJob, node_rank: int = 0,
                   port: int | None = None) -> list[str]:
    """The command line that starts every worker of ``job`` (written as ``job.path``): on node ``node_rank`` for
    torchrun (run once per node), on every node of the hostfile for the deepspeed launcher (``num_processes`` per
    node); ``port``: the rendezvous port (``section.master_port`` when None; one of them must be set)."""
    port = port or section.master_port
    if port is None:
        raise ValueError("launch_command needs a rendezvous port: distributed.master_port or one chosen (free_port)")
    worker = ["-m", job.worker, "--job", str(job.path)]
    if section.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={section.num_processes}",
                f"--nnodes={section.num_nodes}", f"--node-rank={node_rank}", f"--master-addr={section.master_addr}",
                f"--master-port={port}", *worker]
    # DeepSpeed's runner starts every node itself (pdsh over ssh to the hostfile's first num_nodes hosts, each with
    # num_gpus processes); with one active host it starts them locally.
    command = [sys.executable, "-m", "deepspeed.launcher.runner", f"--master_addr={section.master_addr}",
               f"--master_port={port}", f"--num_nodes={section.num_nodes}", f"--num_gpus={section.num_processes}"]
    if section.hostfile is not None:
        command.append(f"--hostfile={section.hostfile}")
    if section.num_nodes == 1:  # one host starts locally; the runner's ssh check of a hostfile's host is moot
        command.append("--no_ssh_check")
    return [*command, "--module", job.worker, "--job", str(job.path)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it): a launch's own rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def launch(section: DistributedSection, job: DistributedJob, on_log: OnLog | None) -> None:
    """Run the workers of ``job`` to the end, passing rank 0's metric lines to ``on_log`` as they appear.

    The launcher and every worker run in a process group of their own: when the stage leaves before they end (an
    error, a cancelled or timed-out run, Ctrl-C), the whole group gets SIGTERM, then SIGKILL after
    ``STOP_GRACE_SECONDS``, so no worker keeps holding a device or the rendezvous port for the retry.
    """
    job.write()
    port = section.master_port or free_port()
    command = launch_command(section, job, port=port)
    if section.launcher == "torchrun" and section.num_nodes > 1:
        for node in range(1, section.num_nodes):
            log.info("start node %d with: %s", node, " ".join(launch_command(section, job, node, port)))
    log.info("launching %s training on %d process(es): %s", job.stage, section.num_processes * section.num_nodes,
             " ".join(command))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    metrics = Path(job.workdir) / "metrics.jsonl"
    follower = _MetricsFollower(metrics, on_log)
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        while process.poll() is None:
            time.sleep(POLL_SECONDS)
            follower.poll()
        follower.poll()
    finally:
        stop_group(process)
    if process.returncode != 0:
        raise RuntimeError(f"{job.stage} workers exited with code {process.returncode} (command: {' '.join(command)}); "
                           f"their output is above; the job and its inputs are in {job.workdir}")


def stop_group(process: subprocess.Popen) -> None:
    """End ``process``'s whole process group (the launcher and its workers): SIGTERM, then SIGKILL to whatever is
    left after ``STOP_GRACE_SECONDS``. Also after a clean exit: a worker the launcher left behind is ended too."""
    try:
        group = os.getpgid(process.pid)
    except ProcessLookupError:  # reaped already: its group id is the pid (start_new_session)
        group = process.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break  # nothing left in the group
        if _group_ended(process, group, STOP_GRACE_SECONDS):
            break
    process.wait()


def _group_ended(process: subprocess.Popen, group: int, seconds: float) -> bool:
    """Whether the process group is empty within ``seconds``, reaping the launcher as it exits (a zombie is still
    a member)."""
    deadline = time.monotonic() + seconds
    while True:
        process.poll()
        if not _group_alive(group):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


class _MetricsFollower:
    """Reads the complete lines appended to rank 0's ``metrics.jsonl`` since the last poll."""

    def __init__(self, path: Path, on_log: OnLog | None) -> None:
        self.path, self.on_log, self.offset = path, on_log, 0

    def poll(self) -> None:
        if self.on_log is None or not self.path.exists():
            return
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        for line in complete.decode("utf-8").splitlines():
            record = json.loads(line)
            self.on_log(int(record["step"]), record["metrics"])
