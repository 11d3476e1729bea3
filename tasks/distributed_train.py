"""Entry point of DeepSpeed training workers: ``python -m tasks.distributed_train --job <workdir>/job.json``.

A stage with ``distributed.deepspeed_config`` set writes the job and starts one worker per GPU with torchrun
or the deepspeed launcher (tasks/launch.py); run by hand, the same command joins a multi-node torchrun job.
Every worker rebuilds the stage's settings from the job (strictly, with the config's own builder), builds the same
models and data from the job's files, runs the same ``rlhf_core`` training function as the in-process stage with a
DeepSpeed strategy, and rank 0 writes what the stage reads back: a JSON line of metrics per step
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


from rlhf_core.config import PPOConfig, RewardTrainingConfig
from rlhf_core.distributed.deepspeed_config import load_deepspeed_config
from rlhf_core.distributed.zero import DeepSpeedFactory, init_distributed, partitioned_loading
from rlhf_core.models.roles import load_reward_model
from rlhf_core.training.ppo_loop import train_ppo
from rlhf_core.training.reward_training import train_reward_model
from rlhf_core.data.records import PreferencePair
from tasks.io import read_prompts
from tasks.launch import DistributedJob, reward_history_to_json
from tasks.models import build_ppo_models, config_max_positions, load_tokenizer, tokenize_prompts
from tasks.runtime import Runtime
from tasks.typed_yaml import build

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
    runtime = job_settings(Runtime, job.runtime, "runtime", job)
    deepspeed_config = load_deepspeed_config(job.deepspeed_config)
    if job.stage == "reward-model":
        train_reward(job, runtime, deepspeed_config, rank, world_size)
    elif job.stage == "ppo":
        train_policy(job, runtime, deepspeed_config, rank)
    else:
        raise ValueError(f"{args.job}: unknown stage {job.stage!r}; expected 'reward-model' or 'ppo'")
    return 0


def job_settings(cls: type, data: dict[str, Any], name: str, job: DistributedJob) -> Any:
    """Settings dataclass ``cls`` rebuilt from the job's data, as strictly as ``load_config``; a bad key is reported
    as coming from the job file."""
    return build(cls, dict(data), name, {name: str(Path(job.workdir) / "job.json")})


def train_reward(job: DistributedJob, runtime: Runtime, deepspeed_config: dict[str, Any], rank: int,
                 world_size: int) -> None:
    """train_reward_model on this rank's share of every batch; rank 0 saves the weights and the history."""
    spec, folder = job.reward, Path(job.workdir)
    cfg = job_settings(RewardTrainingConfig, spec["training"], "reward_model.training", job)
    tokenizer = load_tokenizer(spec["model_dir"])
    with partitioned_loading(deepspeed_config, spec["model_dir"], runtime.torch_dtype) as partitioned:
        model = load_reward_model(spec["model_dir"], runtime.torch_dtype)  # ZeRO-3: each rank holds its shard only
    model = model if partitioned else model.to(runtime.torch_device)
    pairs = json.loads(Path(spec["pairs_file"]).read_text(encoding="utf-8"))
    share = math.ceil(cfg.batch_size / world_size)  # pairs per process and step; micro_batch_size of them per forward
    factory = DeepSpeedFactory(deepspeed_config, micro_batch_size=min(share, cfg.micro_batch_size or share))
    on_log = MetricsWriter(folder / "metrics.jsonl") if rank == 0 else None
    result = train_reward_model(model, tokenizer, [PreferencePair(**p) for p in pairs["train"]],
                                [PreferencePair(**p) for p in pairs["eval"]], cfg, on_log=on_log,
                                eval_every=int(spec["eval_every"]), make_strategy=factory)
    factory.built[-1].save_weights(model, folder / "trained.safetensors")
    if rank == 0:
        (folder / "history.json").write_text(json.dumps(reward_history_to_json(result)), encoding="utf-8")


def train_policy(job: DistributedJob, runtime: Runtime, deepspeed_config: dict[str, Any], rank: int) -> None:
    """train_ppo with each rank generating its share of every rollout batch; checkpoints go where the stage reads."""
    spec = job.ppo
    config = job_settings(PPOConfig, spec["config"], "ppo", job)
    tokenizer = load_tokenizer(spec["reference_dir"])
    models = build_ppo_models(config, runtime, int(spec["seed"]), spec["reference_dir"], spec["reward_dir"], tokenizer,
                              lambda folder: partitioned_loading(deepspeed_config, folder, runtime.torch_dtype))
    prompts = tokenize_prompts(read_prompts(spec["prompts_file"]), spec["prompts_file"], tokenizer,
                               config_max_positions(spec["reference_dir"]) - config.generation.max_new_tokens)
    writer = MetricsWriter(Path(job.workdir) / "metrics.jsonl") if rank == 0 else None
    train_ppo(models, prompts, config, int(spec["n_updates"]), checkpoint_dir=spec["checkpoint_dir"],
              checkpoint_every=int(spec["checkpoint_every"]),
              on_step=(lambda stats: writer(stats.step, stats.to_metrics())) if writer is not None else None,
              init_from=spec["init_from"], make_strategy=DeepSpeedFactory(deepspeed_config, config.micro_batch_size))


if __name__ == "__main__":
    raise SystemExit(main())
