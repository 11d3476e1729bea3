"""Peak memory of one PPO step: four full models vs LoRA-shared models (target: LoRA <= 60% of full).

    .venv/bin/python -m benchmarks.memory.run            # ~29M-parameter GPT-2s, 3 setups x 2 runs (~12 min)
    .venv/bin/python -m benchmarks.memory.run --smoke    # tiny models, 1 run each (~1 min)

Each setup runs in a fresh process (``benchmarks/memory/worker.py``) that builds its models, runs one PPO step
(rollout + scoring + ``ppo_epochs`` of updates) and reports its peak RSS (``ru_maxrss``); runs alternate
between setups so load drifts hit all alike. Next to the measurement, the bytes of weights (shared tensors
counted once), gradients and AdamW state are computed from the parameter counts. Prints JSON and writes
``benchmarks/results/memory.json`` with the machine description.

glibc's malloc raises its mmap threshold after the first large free, after which freed tensors stay in the
heap and the RSS high-water mark counts fragmentation too (it varies with allocation order, not with what is
alive). Workers therefore pin the threshold (``MALLOC_MMAP_THRESHOLD_``) so RSS tracks live memory;
``--malloc default`` measures with glibc's default behaviour instead.

- ``full``: policy + reference copy + critic (a copy of the RM) + RM: four models, two of them trained in full.
- ``lora_head``: LoRA policy, reference = adapter disabled (same weights), value head, RM: two base copies.
- ``lora_critic``: LoRA policy, adapter-disabled reference, critic = LoRA on the RM's shared weights, RM.
- ``critic_free``: ``full`` without the critic (``ppo.advantage=grpo``, 2 replies per prompt; the same rollouts):
  what a critic-free estimator saves (no value model is built, trained or given optimizer state).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, default_out, machine, median, write_result

SETUPS = ("full", "lora_head", "lora_critic", "critic_free")
TARGET_RATIO = 0.6
SIZE = {"vocab_size": 8192, "n_positions": 256, "n_embd": 512, "n_layer": 8, "n_head": 8}
"""~29.5M parameters (25.2M in the blocks, 4.3M embeddings): 118 MB of float32 weights per copy, far above
the ~400 MiB that importing torch + transformers costs, so the weights dominate the difference."""
SMOKE_SIZE = {"vocab_size": 512, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 2}
PPO = {"rollout_batch_size": 16, "mini_batch_size": 8, "micro_batch_size": 4, "ppo_epochs": 2,
       "max_new_tokens": 32, "prompt_tokens": 48, "steps": 1}
"""Micro-batches of 4 (as in infra/presets/gpu-7b.yaml): activations of 4 x ~80 tokens stay below the weights."""
SMOKE_PPO = {**PPO, "rollout_batch_size": 8, "mini_batch_size": 8, "micro_batch_size": 4, "ppo_epochs": 1,
             "max_new_tokens": 8, "prompt_tokens": 8}
LORA_RANK = 16
MMAP_THRESHOLD = 128 * 1024
"""Bytes; glibc's initial threshold, kept fixed: every tensor above it is its own mapping, unmapped when freed."""


def run_worker(setup: str, size: dict[str, int], ppo: dict[str, int], workdir: Path, index: int,
               malloc: str) -> dict[str, Any]:
    """One fresh process for one setup; returns its JSON record."""
    out = workdir / f"{setup}-{index}.json"
    command = [sys.executable, "-m", "benchmarks.memory.worker", "--setup", setup, "--size", json.dumps(size),
               "--ppo", json.dumps(ppo), "--lora-rank", str(LORA_RANK), "--out", str(out)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if malloc == "pinned":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"memory worker '{setup}' failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median peak RSS over the runs of one setup, the part above the import baseline, and the analytic bytes."""
    peak = median([r["peak_rss_mib"] for r in runs])
    baseline = median([r["rss_after_imports_mib"] for r in runs])
    analytic = runs[0]["analytic_bytes"]
    return {
        "peak_rss_mib": peak,
        "rss_after_imports_mib": baseline,
        "peak_above_imports_mib": peak - baseline,
        "analytic_mib": {k: v / 2**20 for k, v in analytic.items() if not k.startswith("parameters")},
        "parameters_distinct": analytic["parameters_distinct"],
        "parameters_trainable": analytic["parameters_trainable"],
        "measured_optimizer_state_mib": runs[0]["measured_optimizer_state_bytes"] / 2**20,
        "step_s": median([r["step_s"] for r in runs]),
    }


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each setup over ``full``: peak RSS, peak above the import baseline, analytic weights+grads+Adam (the 60%
    target is LoRA's)."""
    full = summary["full"]
    out: dict[str, Any] = {}
    for setup in SETUPS[1:]:
        mine = summary[setup]
        out[setup] = {
            "peak_rss": mine["peak_rss_mib"] / full["peak_rss_mib"],
            "peak_above_imports": mine["peak_above_imports_mib"] / full["peak_above_imports_mib"],
            "analytic_total": mine["analytic_mib"]["total"] / full["analytic_mib"]["total"],
        }
        if setup.startswith("lora"):
            out[setup]["target_met"] = out[setup]["peak_rss"] <= TARGET_RATIO
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny models, one run per setup")
    parser.add_argument("--repeats", type=int, help="fresh processes per setup (default 2; smoke 1)")
    parser.add_argument("--malloc", choices=("pinned", "default"), default="pinned",
                        help="glibc mmap threshold pinned (RSS = live memory, the default) or glibc's default")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/memory.json)")
    args = parser.parse_args()
    size, ppo = (SMOKE_SIZE, SMOKE_PPO) if args.smoke else (SIZE, PPO)
    repeats = args.repeats or (1 if args.smoke else 2)
    started, before = time.perf_counter(), machine()
    runs: dict[str, list[dict[str, Any]]] = {setup: [] for setup in SETUPS}
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        for index in range(repeats):
            for setup in SETUPS:
                runs[setup].append(run_worker(setup, size, ppo, Path(tmp), index, args.malloc))
    summary = {setup: summarise(runs[setup]) for setup in SETUPS}
    payload = {
        "benchmark": "memory",
        "smoke": args.smoke,
        "command": " ".join([".venv/bin/python -m benchmarks.memory.run", *sys.argv[1:]]),
        "machine": before,
        "load_average_at_end": machine()["load_average"],
        "wall_s": time.perf_counter() - started,
        "model_size": size,
        "ppo": ppo,
        "lora_rank": LORA_RANK,
        "malloc": args.malloc if args.malloc == "default" else f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}",
        "target": f"peak RSS of a LoRA setup <= {TARGET_RATIO:.0%} of the four-full-models setup",
        "summary": summary,
        "ratio_over_full": ratios(summary),
        "runs": runs,
    }
    name = "memory" if args.malloc == "pinned" else "memory_malloc_default"
    write_result(payload, args.out or default_out(name, args.smoke))


if __name__ == "__main__":
    main()
