"""Entry point of DeepSpeed training workers: ``python -m tasks.distributed_train --job <workdir>/job.json``.

A stage with ``distributed.deepspeed_config`` set writes the job and starts one worker per GPU with torchrun
or the deepspeed launcher (tasks/launch.py); run by hand, the same command joins a multi-node torchrun job.
Every worker rebuilds the stage's training job from the file (strictly, with the config's own builder) and runs it
with the function the in-process stage runs it with (``tasks.training_jobs``), with a DeepSpeed strategy; rank 0 writes what the stage reads back: a JSON line of metrics per step
(``metrics.jsonl``), then the trained weights (reward model) or the final checkpoint (PPO). Workers never talk to
MLflow: the stage process logs what rank 0 writes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

from rlhf_core.distributed.deepspeed_config import load_deepspeed_config
from rlhf_core.distributed.zero import DeepSpeedFactory, init_distributed, partitioned_loading
from rlhf_core.models.roles import load_reward_model
from tasks.launch import HISTORY_FILE, INITIAL_DIR, TRAINED_FILE, DistributedJob, reward_history_to_json
from tasks.models import load_tokenizer
from tasks.training_jobs import PPOJob, RewardModelJob, run_ppo_job, run_reward_job

log = logging.getLogger("tasks.distributed_train")


class MetricsWriter:
    """Appends ``{"step": .., "metrics": {..}}`` lines to a file (rank 0), flushed line by line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}}) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run one worker of a job; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m tasks.distributed_train", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="job.json written by the stage (tasks/launch.py)")
    args, _ = parser.parse_known_args(argv)  # the deepspeed launcher adds --local_rank, also in the environment
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    rank, world_size = init_distributed()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}/{world_size}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    job = DistributedJob.read(args.job)
    training = job.training()
    deepspeed_config = load_deepspeed_config(job.deepspeed_config)
    on_log = MetricsWriter(Path(job.workdir) / "metrics.jsonl") if rank == 0 else None
    if isinstance(training, PPOJob):
        # Each rank generates its share of every rollout batch; checkpoints go where the stage reads them.
        run_ppo_job(training, on_log, DeepSpeedFactory(deepspeed_config, training.config.micro_batch_size),
                    lambda folder: partitioned_loading(deepspeed_config, folder, training.runtime.torch_dtype))
    else:
        train_reward(job, training, deepspeed_config, on_log, world_size)
    return 0


def train_reward(job: DistributedJob, training: RewardModelJob, deepspeed_config: dict[str, Any],
                 on_log: MetricsWriter | None, world_size: int) -> None:
    """The reward-model job on this rank's share of every batch; rank 0 (the one with ``on_log``) saves the weights
    and the history."""
    folder, runtime, cfg = Path(job.workdir), training.runtime, training.training
    initial = folder / INITIAL_DIR
    with partitioned_loading(deepspeed_config, str(initial), runtime.torch_dtype) as partitioned:
        model = load_reward_model(str(initial), runtime.torch_dtype)  # ZeRO-3: each rank holds its shard only
    model = model if partitioned else model.to(runtime.torch_device)
    share = math.ceil(cfg.batch_size / world_size)  # pairs per process and step; micro_batch_size of them per forward
    factory = DeepSpeedFactory(deepspeed_config, micro_batch_size=min(share, cfg.micro_batch_size or share))
    result = run_reward_job(training, model, load_tokenizer(initial), on_log, factory)
    factory.built[-1].save_weights(model, folder / TRAINED_FILE)
    if on_log is not None:
        (folder / HISTORY_FILE).write_text(json.dumps(reward_history_to_json(result)), encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
