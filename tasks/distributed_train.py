"""What every DeepSpeed training worker does before and around its job: ``python -m tasks.ppo_job --job <job.json>``
(or ``tasks.reward_job``) runs :func:`run_worker` with the job's class and its worker function.

A stage with ``distributed.deepspeed_config`` set writes the job and starts one worker per GPU with torchrun or the
deepspeed launcher (``tasks.launch``); run by hand, the same command joins a multi-node torchrun job. Every worker
joins the process group, rebuilds the stage's training job from the file (strictly, with the config's own builder)
and runs it with the function the in-process stage runs it with, with a DeepSpeed strategy; rank 0 writes what the
stage reads back: a JSON line of metrics per step (``metrics.jsonl``), then what the job's kind leaves (the trained
weights, or the final checkpoint). Workers never talk to MLflow: the stage process logs what rank 0 writes.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rlhf_core.distributed.deepspeed_config import load_deepspeed_config
from rlhf_core.distributed.zero import init_distributed
from tasks.launch import DistributedJob
from tasks.typed_yaml import build

J = TypeVar("J")


class MetricsWriter:
    """Appends ``{"step": .., "metrics": {..}}`` lines to a file (rank 0), flushed line by line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}}) + "\n")


def run_worker(kind: type[J], train: Callable[[DistributedJob, J, dict[str, Any], MetricsWriter | None, int], None],
               argv: list[str] | None = None) -> int:
    """Run one worker of a job of class ``kind`` with ``train``; returns the exit code."""
    parser = argparse.ArgumentParser(description="one DeepSpeed worker of a stage's training job")
    parser.add_argument("--job", required=True, help="job.json written by the stage (tasks/launch.py)")
    args, _ = parser.parse_known_args(argv)  # the deepspeed launcher adds --local_rank, also in the environment
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    rank, world_size = init_distributed()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}/{world_size}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    job = DistributedJob.read(args.job)
    training = training_job(job, kind)
    on_log = MetricsWriter(Path(job.workdir) / "metrics.jsonl") if rank == 0 else None
    train(job, training, load_deepspeed_config(job.deepspeed_config), on_log, world_size)
    return 0


def training_job(job: DistributedJob, kind: type[J]) -> J:
    """The stage's training job, rebuilt from ``job.json`` as strictly as a config file: a bad key or value is a
    one-line error naming it and the file."""
    return build(kind, dict(job.job), "job", {"job": str(job.path)})
