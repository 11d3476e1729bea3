"""The calculator's predicted peak next to the measured CPU peak RSS, for small GPT-2s that run in a minute.

    .venv/bin/python -m benchmarks.memory.predict            # ~5M-parameter GPT-2s, 5 setups + vocabulary probes
    .venv/bin/python -m benchmarks.memory.predict --smoke    # tiny models (checks the script, not the formulas)

Each setup runs one PPO step in a fresh process (``benchmarks/memory/worker.py``, glibc's mmap threshold pinned so
RSS tracks live memory, as in ``run.py``); the calculator predicts the same setup as a ``RunShape`` in float32
without autocast (the worker's precision) with torch AdamW. What CPU RSS can confirm: the sum of what is alive at
the peak, above the RSS after imports (torch + transformers, ~400 MiB, subtracted). What it cannot: which phase
peaked (``ru_maxrss`` is one high-water mark; the prediction's peak phase is reported), bf16 or CUDA effects
(autocast, the caching allocator, NCCL buffers, fragmentation), DeepSpeed's buffers. The vocabulary probes run
``roles.vocab_outputs`` alone on one and two chunks and compare bytes per logit with the formula.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, default_out, machine, write_result
from benchmarks.memory.calculator import (
    PPO_PHASES,
    RunShape,
    phases,
    roles,
    vocab_bytes,
)
from benchmarks.memory.run import run_worker
from benchmarks.memory.shapes import gpt2_shape

SIZE = {"vocab_size": 8192, "n_positions": 256, "n_embd": 256, "n_layer": 4, "n_head": 4}
"""~5.3M parameters per model (21 MB fp32): four copies + AdamW ~210 MB, activations of a micro-batch ~150 MB."""
SMOKE_SIZE = {"vocab_size": 512, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 2}
PPO = {"rollout_batch_size": 16, "mini_batch_size": 8, "micro_batch_size": 8, "ppo_epochs": 1,
       "max_new_tokens": 64, "prompt_tokens": 96, "steps": 1}
"""Micro-batches of 8 x ~160 tokens: activations comparable to the weights, so both terms are tested."""
SMOKE_PPO = {**PPO, "rollout_batch_size": 8, "mini_batch_size": 4, "micro_batch_size": 4, "max_new_tokens": 8,
             "prompt_tokens": 8}
SETUPS = (("full", False), ("full", True), ("critic_free", False), ("lora_head", False), ("lora_critic", False))
"""(worker setup, gradient checkpointing)."""
VOCAB_PROBES = ((32768, 2048, True), (32768, 4096, True), (32768, 2048, False), (32768, 6144, False))
"""(V, rows, with gradients and entropy): one chunk of 2^26 logits (V 32768 -> 2048 rows), then two or three."""
LORA_RANK = 16


def run_shape(setup: str, checkpointing: bool, ppo: dict[str, int]) -> RunShape:
    """The worker's setup as the calculator sees it: fp32, no autocast, torch AdamW, unfused GELU."""
    return RunShape(prompt_length=ppo["prompt_tokens"] - 1, response_length=ppo["max_new_tokens"],
                    micro_batch=ppo["micro_batch_size"], generation_batch=ppo["rollout_batch_size"],
                    rollout_batch=ppo["rollout_batch_size"],
                    weight_bytes=4, autocast=False, lora_rank=LORA_RANK if setup.startswith("lora") else 0,
                    gradient_checkpointing=checkpointing, optimizer="torch", zero_stage=0,
                    value_model={"full": "critic", "critic_free": "none", "lora_head": "head",
                                 "lora_critic": "critic"}[setup], fused_gelu=False)


def compare(setup: str, checkpointing: bool, size: dict[str, int], ppo: dict[str, int],
            measured: dict[str, Any]) -> dict[str, Any]:
    """Predicted phases and peak next to the measured peak RSS above imports (MiB), and the weights after build."""
    shape, run = gpt2_shape(size), run_shape(setup, checkpointing, ppo)
    predicted = phases(shape, run)
    peak_phase = max(PPO_PHASES, key=lambda p: predicted[p]["peak"])
    r = roles(shape, run)
    weights = r.frozen + r.policy.weights + r.value.weights
    above = measured["peak_rss_mib"] - measured["rss_after_imports_mib"]
    built = measured["rss_after_build_mib"] - measured["rss_after_imports_mib"]
    mib = 2 ** 20
    return {
        "setup": setup, "gradient_checkpointing": checkpointing,
        "predicted_mib": {name: {k: v / mib for k, v in parts.items()} for name, parts in predicted.items()},
        "predicted_peak_phase": peak_phase,
        "predicted_peak_mib": predicted[peak_phase]["peak"] / mib,
        "measured_peak_above_imports_mib": above,
        "peak_measured_over_predicted": above / (predicted[peak_phase]["peak"] / mib),
        "predicted_weights_mib": weights / mib,
        "measured_after_build_mib": built,
        "weights_measured_over_predicted": built / (weights / mib),
        "step_s": measured["step_s"],
    }


def vocab_probe(vocab: int, rows: int, grad: bool) -> dict[str, Any]:
    """``vocab_outputs`` alone in a fresh process (float32, h 64): peak RSS above the inputs, per logit of a chunk."""
    command = [sys.executable, "-m", "benchmarks.memory.predict", "--probe", json.dumps([vocab, rows, grad])]
    env = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vocabulary probe {vocab}x{rows} failed:\n{done.stderr[-3000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    shape = gpt2_shape({"vocab_size": vocab, "n_embd": 64, "n_layer": 1, "n_head": 1, "n_positions": 1})
    chunk_logits = min(rows, (1 << 26) // vocab) * vocab
    predicted = vocab_bytes(shape, RunShape(weight_bytes=4, autocast=False), rows, grad) / chunk_logits
    return {"vocab": vocab, "rows": rows, "grad_and_entropy": grad, "chunks": -(-rows * vocab // chunk_logits),
            "measured_bytes_per_chunk_logit": measured["peak_above_bytes"] / chunk_logits,
            "predicted_bytes_per_chunk_logit": predicted}


def _probe(vocab: int, rows: int, grad: bool) -> None:
    import psutil
    import torch

    from rlhf_core.models.roles import vocab_outputs

    torch.manual_seed(0)
    head = torch.nn.Linear(64, vocab, bias=False)
    hidden, tokens = torch.randn(rows, 64, requires_grad=grad), torch.randint(0, vocab, (rows,))
    before = psutil.Process().memory_info().rss
    with torch.set_grad_enabled(grad):
        logprobs, entropy = vocab_outputs(head, hidden, tokens, 1.0, grad)
        if grad:
            (logprobs.sum() + entropy.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_above_bytes": peak - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny models, no vocabulary probes")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/memory_predict.json)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        _probe(*json.loads(args.probe))
        return
    size, ppo = (SMOKE_SIZE, SMOKE_PPO) if args.smoke else (SIZE, PPO)
    started, before = time.perf_counter(), machine()
    results = []
    with tempfile.TemporaryDirectory(prefix="memory-predict-") as tmp:
        for index, (setup, checkpointing) in enumerate(SETUPS):
            measured = run_worker(setup, size, {**ppo, "gradient_checkpointing": checkpointing}, Path(tmp), index,
                                  "pinned")
            results.append(compare(setup, checkpointing, size, ppo, measured))
    probes = [] if args.smoke else [vocab_probe(*probe) for probe in VOCAB_PROBES]
    payload = {
        "benchmark": "memory_predict",
        "smoke": args.smoke,
        "command": " ".join([".venv/bin/python -m benchmarks.memory.predict", *sys.argv[1:]]),
        "machine": before,
        "load_average_at_end": machine()["load_average"],
        "wall_s": time.perf_counter() - started,
        "model_size": size, "ppo": ppo, "lora_rank": LORA_RANK,
        "malloc": "MALLOC_MMAP_THRESHOLD_=131072",
        "setups": results,
        "vocabulary_probes": probes,
    }
    write_result(payload, args.out or default_out("memory_predict", args.smoke))


if __name__ == "__main__":
    main()
