"""Where a stage's training runs: in the stage's process, or on DeepSpeed workers the stage launches.

The reward-model and ppo-iteration stages call :func:`fit_reward_model` / :func:`run_ppo_training` where they
used to call ``train_reward_model`` / ``train_ppo``. Without ``distributed.deepspeed_config`` these are those
calls. With it, the stage writes a :class:`DistributedJob` (inputs as files, the stage's settings as data), starts
``num_processes`` x ``num_nodes`` workers (``python -m tasks.distributed_train --job <file>``) with torchrun
or the deepspeed launcher, feeds the metrics rank 0 writes (one JSON line per step) to the stage's MLflow
callback while they run, and loads the trained weights back into the stage's models: everything after the
training (saving, registering, samples, plots) is the same code either way.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from safetensors.torch import load_model
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import PPOConfig, RewardTrainingConfig
from rlhf_core.training.checkpoint import latest_checkpoint
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import PPORunResult, load_checkpoint_weights, train_ppo
from rlhf_core.training.reward_training import PreferencePair, RewardEval, RewardTrainingResult, train_reward_model
from tasks.config import DistributedSection
from tasks.runtime import Runtime
from tasks.typed_yaml import config_to_dict

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
POLL_SECONDS = 1.0

OnLog = Callable[[int, dict[str, float]], None]


@dataclass(frozen=True)
class DistributedJob:
    """What the workers of one stage's training need; written as JSON next to its input files. The stage's own
    settings travel as data (serialised once, rebuilt strictly in the worker), never as a second config file."""

    stage: Literal["reward-model", "ppo"]
    workdir: str
    """Folder of the job: inputs, ``metrics.jsonl`` (rank 0, one line per step) and outputs."""
    deepspeed_config: str
    """Absolute path of the DeepSpeed JSON."""
    runtime: dict[str, Any]
    """The stage's :class:`tasks.runtime.Runtime` as data."""
    reward: dict[str, Any] | None = None
    """reward-model: ``model_dir`` (initial weights + tokenizer), ``pairs_file``, ``training`` (a
    RewardTrainingConfig as data), ``eval_every``; the workers write ``trained.safetensors``, ``history.json``."""
    ppo: dict[str, Any] | None = None
    """ppo: ``config`` (the PPO section as data), ``seed``, ``reference_dir``, ``reward_dir``, ``prompts_file``,
    ``n_updates``, ``checkpoint_dir``, ``init_from``; the workers leave their final checkpoint in ``checkpoint_dir``."""

    def write(self) -> Path:
        """``<workdir>/job.json``."""
        path = Path(self.workdir) / "job.json"
        path.write_text(json.dumps(asdict(self), indent=1), encoding="utf-8")
        return path

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> DistributedJob:
        """The job a stage wrote."""
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))


# --------------------------------------------------------------------------------------------- stage side


def fit_reward_model(distributed: DistributedSection | None, runtime: Runtime, model: PreTrainedModel,
                     tokenizer: PreTrainedTokenizerBase, train: Sequence[PreferencePair],
                     evaluate_on: Sequence[PreferencePair], cfg: RewardTrainingConfig, on_log: OnLog, eval_every: int,
                     workdir: str | os.PathLike[str]) -> RewardTrainingResult:
    """``train_reward_model`` here (``distributed`` None), or on DeepSpeed workers (then ``model`` gets their
    trained weights)."""
    if distributed is None:
        return train_reward_model(model, tokenizer, train, evaluate_on, cfg, on_log=on_log, eval_every=eval_every)
    folder = _fresh(workdir)
    model.save_pretrained(folder / "initial")
    tokenizer.save_pretrained(folder / "initial")
    pairs = {"train": [asdict(p) for p in train], "eval": [asdict(p) for p in evaluate_on]}
    (folder / "pairs.json").write_text(json.dumps(pairs), encoding="utf-8")
    job = _job(distributed, runtime, folder, "reward-model", reward={
        "model_dir": str(folder / "initial"), "pairs_file": str(folder / "pairs.json"),
        "training": config_to_dict(cfg), "eval_every": eval_every})
    launch(distributed, job, on_log)
    load_model(model, str(folder / "trained.safetensors"))
    return reward_history_from_json(json.loads((folder / "history.json").read_text(encoding="utf-8")))


def run_ppo_training(config: PPOConfig, runtime: Runtime, seed: int, distributed: DistributedSection | None,
                     models: PPOModels, prompts: Sequence[Sequence[int]], n_updates: int, checkpoint_dir: Path,
                     on_log: OnLog, init_from: str | None, inputs: dict[str, str],
                     workdir: str | os.PathLike[str], checkpoint_every: int = 0) -> PPORunResult:
    """``train_ppo`` here (``distributed`` None), or on DeepSpeed workers (then ``models`` get the weights of their
    final checkpoint). ``inputs``: ``reference_dir``, ``reward_dir`` (local model folders) and ``prompts_file``,
    from which each worker builds the same models and prompts as the stage did."""
    if distributed is None:
        return train_ppo(models, prompts, config, n_updates, checkpoint_dir=checkpoint_dir,
                         checkpoint_every=checkpoint_every,
                         on_step=lambda s: on_log(s.step, s.to_metrics()), init_from=init_from)
    folder = _fresh(workdir)
    job = _job(distributed, runtime, folder, "ppo", ppo={
        **inputs, "config": config_to_dict(config), "seed": seed, "n_updates": n_updates,
        "checkpoint_dir": str(Path(checkpoint_dir).resolve()), "checkpoint_every": checkpoint_every,
        "init_from": init_from})
    launch(distributed, job, on_log)
    final = latest_checkpoint(checkpoint_dir)
    if final is None:
        raise RuntimeError(f"the PPO workers finished without a checkpoint in {checkpoint_dir}; see their log above")
    state = load_checkpoint_weights(models, config, final)
    return PPORunResult(history=list(state["history"]))


def _fresh(workdir: str | os.PathLike[str]) -> Path:
    folder = Path(workdir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").unlink(missing_ok=True)
    return folder


def _job(distributed: DistributedSection, runtime: Runtime, folder: Path, stage: Literal["reward-model", "ppo"],
         **inputs: Any) -> DistributedJob:
    ds_config = Path(distributed.deepspeed_config).resolve()
    if not ds_config.is_file():
        raise FileNotFoundError(f"distributed.deepspeed_config {distributed.deepspeed_config!r} does not exist "
                                f"(looked in {ds_config}); see infra/deepspeed/")
    return DistributedJob(stage, str(folder), str(ds_config), config_to_dict(runtime), **inputs)


# --------------------------------------------------------------------------------------------- launching


def launch_command(section: DistributedSection, job_file: Path, node_rank: int = 0) -> list[str]:
    """The command line that starts every worker of ``job_file`` (on this node, for torchrun)."""
    worker = ["-m", "tasks.distributed_train", "--job", str(job_file)]
    if section.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={section.num_processes}",
                f"--nnodes={section.num_nodes}", f"--node-rank={node_rank}", f"--master-addr={section.master_addr}",
                f"--master-port={section.master_port}", *worker]
    command = [sys.executable, "-m", "deepspeed.launcher.runner", f"--master_addr={section.master_addr}",
               f"--master_port={section.master_port}", f"--num_nodes={section.num_nodes}"]
    if section.hostfile is not None:
        command.append(f"--hostfile={section.hostfile}")
    if section.num_nodes == 1:
        command.append(f"--num_gpus={section.num_processes}")
    return [*command, "--module", "tasks.distributed_train", "--job", str(job_file)]


def launch(section: DistributedSection, job: DistributedJob, on_log: OnLog | None) -> None:
    """Run the workers of ``job`` to the end, passing rank 0's metric lines to ``on_log`` as they appear."""
    job_file = job.write()
    command = launch_command(section, job_file)
    if section.launcher == "torchrun" and section.num_nodes > 1:
        for node in range(1, section.num_nodes):
            log.info("start node %d with: %s", node, " ".join(launch_command(section, job_file, node)))
    log.info("launching %s training on %d process(es): %s", job.stage, section.num_processes * section.num_nodes,
             " ".join(command))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    metrics = Path(job.workdir) / "metrics.jsonl"
    follower = _MetricsFollower(metrics, on_log)
    with subprocess.Popen(command, env=env) as process:
        while process.poll() is None:
            time.sleep(POLL_SECONDS)
            follower.poll()
    follower.poll()
    if process.returncode != 0:
        raise RuntimeError(f"{job.stage} workers exited with code {process.returncode} (command: {' '.join(command)}); "
                           f"their output is above; the job and its inputs are in {job.workdir}")


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
