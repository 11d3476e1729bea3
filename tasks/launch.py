"""Where a stage's training runs: in the stage's process, or on DeepSpeed workers the stage launches.

The reward-model and ppo-iteration stages build their training as one job (``tasks.training_jobs``) and hand it to
:func:`fit_reward_model` / :func:`train_ppo_job`. Without ``distributed.deepspeed_config`` these run the job here.
With it, the stage writes a :class:`DistributedJob` (the job as data, the DeepSpeed config), starts
``num_processes`` x ``num_nodes`` workers (``python -m tasks.distributed_train --job <file>``) with torchrun or the
deepspeed launcher, each running the same job, feeds the metrics rank 0 writes (one JSON line per step) to the
stage's MLflow callback while they run, and only then builds the stage's models and loads the trained weights into
them (the stage holds no model while its workers train): everything after the training (saving, registering,
samples, plots) is the same code either way.
"""

from __future__ import annotations

import gc
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

import torch
from safetensors.torch import load_model
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models.roles import load_reward_model
from rlhf_core.training.checkpoint import latest_checkpoint
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import PPORunResult, load_checkpoint_weights
from rlhf_core.training.reward_training import RewardEval, RewardTrainingResult
from tasks.config import DistributedSection
from tasks.training_jobs import (STAGES, Job, OnLog, PPOJob, RewardModelJob, job_from_data, job_to_data,
                                 run_ppo_job, run_reward_job)

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 10.0
"""How long the workers of a stage that ended early get between SIGTERM and SIGKILL."""
INITIAL_DIR = "initial"
"""reward-model: the folder of the job's workdir holding the initial model and its tokenizer."""
TRAINED_FILE, HISTORY_FILE = "trained.safetensors", "history.json"
"""reward-model: what rank 0 leaves in the workdir."""


@dataclass(frozen=True)
class DistributedJob:
    """A job handed to DeepSpeed workers, written as ``<workdir>/job.json``: the stage's training job as data
    (serialized once, rebuilt strictly by :meth:`training`), never a second config file."""

    stage: str
    """'ppo' or 'reward-model' (``tasks.training_jobs.STAGES``)."""
    workdir: str
    """Folder of the job: ``job.json``, ``metrics.jsonl`` (rank 0, one line per step) and the reward model's
    ``initial/`` folder and outputs."""
    deepspeed_config: str
    """Absolute path of the DeepSpeed JSON."""
    job: dict[str, Any]
    """The :class:`~tasks.training_jobs.PPOJob` or :class:`~tasks.training_jobs.RewardModelJob` as data."""

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

    def training(self) -> Job:
        """The training job, rebuilt as strictly as a config file (a bad key names this file)."""
        return job_from_data(self.job, self.stage, str(self.path))


# --------------------------------------------------------------------------------------------- stage side


def fit_reward_model(job: RewardModelJob, initial: Callable[[], PreTrainedModel], tokenizer: PreTrainedTokenizerBase,
                     distributed: DistributedSection | None, on_log: OnLog,
                     workdir: str | os.PathLike[str]) -> tuple[PreTrainedModel, RewardTrainingResult]:
    """(the trained reward model, its history): ``job`` run on the model ``initial()`` builds, here (``distributed``
    None) or on DeepSpeed workers.

    Launched, the stage builds the initial model (its fresh head drawn as in this process), saves it for the
    workers and drops it before they start, so it holds no model while they train; afterwards it rebuilds the
    model from that folder and loads the weights rank 0 saved.
    """
    if distributed is None:
        model = initial()
        return model, run_reward_job(job, model, tokenizer, on_log)
    folder = _fresh(workdir)
    _save_and_drop(initial(), folder / INITIAL_DIR)  # the only reference to the model: gone after this line
    tokenizer.save_pretrained(folder / INITIAL_DIR)
    launch(distributed, _job(distributed, folder, job), on_log)
    model = load_reward_model(str(folder / INITIAL_DIR), job.runtime.torch_dtype)
    load_model(model, str(folder / TRAINED_FILE))
    history = reward_history_from_json(json.loads((folder / HISTORY_FILE).read_text(encoding="utf-8")))
    return model.to(job.runtime.torch_device), history


def train_ppo_job(job: PPOJob, distributed: DistributedSection | None, on_log: OnLog,
                  workdir: str | os.PathLike[str]) -> tuple[PPOModels, PPORunResult]:
    """(the trained models, the run's history): ``job`` run here (``distributed`` None), or on DeepSpeed workers,
    each building the same models and prompts from the job's folders and files.

    Launched, the stage builds no model until the workers have ended; then it builds them and loads the weights of
    the workers' final checkpoint.
    """
    if distributed is None:
        return run_ppo_job(job, on_log)
    job.prompts(job.tokenizer())  # a prompt table the workers would refuse fails here, before any worker starts
    launch(distributed, _job(distributed, _fresh(workdir), job), on_log)
    final = latest_checkpoint(job.checkpoint_dir)
    if final is None:
        raise RuntimeError(f"the PPO workers finished without a checkpoint in {job.checkpoint_dir}; see their log above")
    models = job.models(job.tokenizer())
    state = load_checkpoint_weights(models, job.config, final)
    return models, PPORunResult(history=list(state["history"]))


def _save_and_drop(model: PreTrainedModel, folder: Path) -> None:
    """Save ``model`` (Hugging Face layout) and free it: the caller passed its only reference, which ends with this
    call; the collector and the accelerator's cache then give its memory back before the workers start."""
    model.save_pretrained(folder)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fresh(workdir: str | os.PathLike[str]) -> Path:
    folder = Path(workdir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").unlink(missing_ok=True)
    return folder


def _job(distributed: DistributedSection, folder: Path, job: Job) -> DistributedJob:
    ds_config = Path(distributed.deepspeed_config).resolve()
    if not ds_config.is_file():
        raise FileNotFoundError(f"distributed.deepspeed_config {distributed.deepspeed_config!r} does not exist "
                                f"(looked in {ds_config}); see infra/deepspeed/")
    return DistributedJob(STAGES[type(job)], str(folder), str(ds_config), job_to_data(job))


# --------------------------------------------------------------------------------------------- launching


def launch_command(section: DistributedSection, job_file: Path, node_rank: int = 0,
                   port: int | None = None) -> list[str]:
    """The command line that starts every worker of ``job_file``: on node ``node_rank`` for torchrun (run once per
    node), on every node of the hostfile for the deepspeed launcher (``num_processes`` per node); ``port``: the
    rendezvous port (``section.master_port`` when None; one of them must be set)."""
    port = port or section.master_port
    if port is None:
        raise ValueError("launch_command needs a rendezvous port: distributed.master_port or one chosen (free_port)")
    worker = ["-m", "tasks.distributed_train", "--job", str(job_file)]
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
    return [*command, "--module", "tasks.distributed_train", "--job", str(job_file)]


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
    job_file = job.write()
    port = section.master_port or free_port()
    command = launch_command(section, job_file, port=port)
    if section.launcher == "torchrun" and section.num_nodes > 1:
        for node in range(1, section.num_nodes):
            log.info("start node %d with: %s", node, " ".join(launch_command(section, job_file, node, port)))
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


def reward_history_to_json(result: RewardTrainingResult) -> dict[str, Any]:
    """A training history as plain data (the workers' ``history.json``)."""
    return {"train_loss": result.train_loss, "train_accuracy": result.train_accuracy, "n_truncated": result.n_truncated,
            "seconds": result.seconds, "evals": [[step, asdict(evaluation)] for step, evaluation in result.evals]}


def reward_history_from_json(data: dict[str, Any]) -> RewardTrainingResult:
    """Inverse of :func:`reward_history_to_json`."""
    return RewardTrainingResult(train_loss=list(data["train_loss"]), train_accuracy=list(data["train_accuracy"]),
                                evals=[(int(step), RewardEval(**values)) for step, values in data["evals"]],
                                n_truncated=int(data["n_truncated"]), seconds=float(data["seconds"]))
