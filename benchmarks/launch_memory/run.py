"""The stage process's memory while its DeepSpeed workers train (the stage holds no model meanwhile).

    .venv/bin/python -m benchmarks.launch_memory.run            # ~43M-parameter GPT-2 reward model (~3-5 min)
    .venv/bin/python -m benchmarks.launch_memory.run --smoke    # a tiny one (~1 min: the workers' start dominates)

A fresh process (this script run with ``--stage``) plays the reward-model stage: it calls
``tasks.reward_job.fit_reward_model`` with ``distributed`` set (ZeRO-2, 2 CPU workers, gloo, torchrun), exactly as
``tasks/reward_model.py`` does, while a thread samples its resident set size (``/proc/self/status`` VmRSS, every
0.1 s) and the phase it is in: ``imports`` (torch + transformers + deepspeed-free stage code loaded), ``build``
(the initial model built, saved for the workers and dropped), ``workers`` (the launch, until every worker ended),
``after`` (the model rebuilt from ``initial/`` with the trained weights). Two runs in fresh processes:
``after`` (the stage as it is) and ``before`` (the same call, but the builder keeps a reference to the model it
built, as the stage did before this change when it kept its models, in host memory, through the launch).

glibc's malloc raises its mmap threshold after the first large free, after which freed tensors stay in its heap
and RSS keeps counting them; as in ``benchmarks/memory``, the stage runs with the threshold pinned
(``MALLOC_MMAP_THRESHOLD_``) so RSS tracks live memory (``--malloc default`` measures glibc's default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, default_out, machine, median, write_result

SIZE = {"n_positions": 64, "n_embd": 768, "n_layer": 6, "n_head": 12}
"""~43M parameters (blocks), 170 MB of float32 weights: far above what the imports cost, so weights dominate."""
SMOKE_SIZE = {"n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 2}
PAIRS, SMOKE_PAIRS = 16, 8
MMAP_THRESHOLD = 128 * 1024
SAMPLE_SECONDS = 0.1


def vm_rss_mib() -> float:
    """This process's resident set size now, MiB (``/proc/self/status`` VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmRSS line (not Linux?)")


class Sampler(threading.Thread):
    """Samples VmRSS every ``SAMPLE_SECONDS`` into the current phase's list."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.phase, self.samples, self.running = "imports", {}, True

    def run(self) -> None:
        while self.running:
            self.samples.setdefault(self.phase, []).append(vm_rss_mib())
            time.sleep(SAMPLE_SECONDS)

    def enter(self, phase: str) -> None:
        self.samples.setdefault(self.phase, []).append(vm_rss_mib())
        self.phase = phase


def stage(size: dict[str, int], n_pairs: int, workdir: Path, hold: bool) -> dict[str, Any]:
    """The reward-model stage's training call with 2 DeepSpeed workers, its RSS sampled by phase; ``hold``: the
    initial model stays referenced through the launch (the behaviour before this change)."""
    sampler = Sampler()
    sampler.start()
    import torch
    from transformers import GPT2ForSequenceClassification

    from rlhf_core.config import RewardTrainingConfig
    from tasks import launch as launch_module
    from tasks.config import DistributedSection
    from tasks.runtime import Runtime
    from tasks import reward_job
    from tasks.reward_job import RewardModelJob
    from tests.distributed.zero_cases import preference_pairs
    from tests.tiny_models import gpt2_config, word_tokenizer

    tokenizer = word_tokenizer()
    config = gpt2_config(len(tokenizer), num_labels=1, **size)
    sampler.enter("build")
    n_params, held = [], []

    def initial() -> GPT2ForSequenceClassification:
        torch.manual_seed(0)
        model = GPT2ForSequenceClassification(config)
        n_params.append(sum(p.numel() for p in model.parameters()))
        if hold:
            held.append(model)
        return model

    real_launch = launch_module.launch

    def launch(*args: Any, **kwargs: Any) -> None:
        sampler.enter("workers")
        real_launch(*args, **kwargs)
        sampler.enter("after")

    launch_module.launch = launch
    distributed = DistributedSection(deepspeed_config=str(REPO / "infra" / "deepspeed" / "zero2.json"),
                                     num_processes=2)
    training = RewardTrainingConfig(epochs=1, batch_size=8, micro_batch_size=4, learning_rate=1e-4, max_length=32)
    started = time.monotonic()
    job = RewardModelJob(training, Runtime("cpu", "float32"), tuple(preference_pairs(n_pairs, 0)),
                         tuple(preference_pairs(4, 1)), eval_every=1)
    model, history = reward_job.fit_reward_model(job, initial, tokenizer, distributed, lambda step, metrics: None,
                                                    workdir)
    seconds = time.monotonic() - started
    sampler.enter("done")
    sampler.running = False
    sampler.join()
    phases = sampler.samples
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "n_params": n_params[0], "model_mib": model_bytes / 2**20, "train_steps": len(history.train_loss),
        "seconds": seconds,
        "rss_mib": {
            "after_imports": phases["imports"][-1],
            "peak_before_launch": max(phases["imports"] + phases["build"]),
            "workers_median": median(phases["workers"]), "workers_max": max(phases["workers"]),
            "workers_samples": len(phases["workers"]),
            "after_workers_max": max(phases["after"]),
        },
    }


def run_stage(smoke: bool, malloc: str, hold: bool) -> dict[str, Any]:
    """One stage process (this script with ``--stage``); its record."""
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "stage.json"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
        if malloc == "pinned":
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        command = [sys.executable, "-m", "benchmarks.launch_memory.run", "--stage", str(record),
                   *(["--smoke"] if smoke else []), *(["--hold"] if hold else [])]
        subprocess.run(command, cwd=REPO, env=env, check=True)
        return json.loads(record.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model")
    parser.add_argument("--threads", type=int, default=None, help="unused: the workers' torch picks its own")
    parser.add_argument("--malloc", choices=("pinned", "default"), default="pinned")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--stage", type=Path, default=None, help=argparse.SUPPRESS)  # internal: the stage process
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)  # internal: the 'before' run
    args = parser.parse_args()
    size, n_pairs = (SMOKE_SIZE, SMOKE_PAIRS) if args.smoke else (SIZE, PAIRS)
    if args.stage is not None:
        with tempfile.TemporaryDirectory() as tmp:
            args.stage.write_text(json.dumps(stage(size, n_pairs, Path(tmp), args.hold)))
        return
    started = machine()
    runs = {name: run_stage(args.smoke, args.malloc, hold=name == "before") for name in ("after", "before")}
    after, before = runs["after"]["rss_mib"], runs["before"]["rss_mib"]
    payload = {
        "benchmark": "launch_memory", "smoke": args.smoke, "malloc": args.malloc, "model_size": size, **runs,
        "model_mib": runs["after"]["model_mib"],
        "saved_while_workers_train_mib": before["workers_median"] - after["workers_median"],
        "after_workers_over_imports_mib": after["workers_max"] - after["after_imports"],
        "machine": started,
    }
    write_result(payload, args.out or default_out("launch_memory", args.smoke))


if __name__ == "__main__":
    main()
