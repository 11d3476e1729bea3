"""Rollout tokens per second: ``rlhf_core.training.rollout.generate`` vs plain ``model.generate`` on the same
model and batch.

    .venv/bin/python -m benchmarks.generation.run            # the ppo_vs_trl policy, 32 prompts x 48 tokens
    .venv/bin/python -m benchmarks.generation.run --smoke    # a tiny random model

Same prompts (left-padded), same sampling settings (temperature 0.7, no top-k / top-p), fp32, no gradients.
Generators, timed alternately in one process after a warm-up call each:

- ``ours``: ``rlhf_core.training.rollout.generate`` (dynamic KV cache; returns the ids AND the sampling log-probs);
- ``ours_static``: the same with ``generation.cache: static`` (a preallocated StaticCache; on CUDA its decode step
  is compiled); ``--compile-cpu`` also compiles it on CPU, to measure whether that helps there;
- ``hf_generate``: ``model.generate(do_sample=True)``, ids only;
- ``hf_generate_scores``: the same with ``output_scores=True, return_dict_in_generate=True``, which is how
  TRL's PPOTrainer gets its old log-probs.

Two modes: ``fixed_length`` (no stop token, every row generates ``max_new_tokens``: identical work on every
side) and ``with_stop`` (eos stops a row; generation ends when every row has stopped, so the number of steps
depends on the samples; rates count generated positions, batch x steps).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import default_out, machine, median, peak_rss_mib, write_result
from benchmarks.fixtures import build_fixture
from benchmarks.ppo_vs_trl.settings import Settings

GENERATORS = ("ours", "ours_static", "hf_generate", "hf_generate_scores")


def ours(model, ids, mask, max_new_tokens: int, temperature: float, stop: list[int], pad: int, seed: int,
         cache: str = "dynamic") -> int:
    """Generated positions (batch x steps) of one call of our rollout generator."""
    from rlhf_core.config import GenerationConfig
    from rlhf_core.training.rollout import generate

    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=ids.shape[0],
                              cache=cache)
    rollout = generate(model, ids, mask, config, stop, pad, torch.Generator().manual_seed(seed))
    return rollout.response_ids.numel()


def hf(model, ids, mask, max_new_tokens: int, temperature: float, stop: list[int], pad: int, seed: int,
       scores: bool = False) -> int:
    """Generated positions of one ``model.generate`` call (optionally returning the per-step scores)."""
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                              max_new_tokens=max_new_tokens, eos_token_id=stop[0] if stop else None,
                              pad_token_id=pad, output_scores=scores, return_dict_in_generate=scores)
    # generate() fills unset fields from the model's own generation config, eos included: without a stop
    # token that one has to be cleared too, or rows would still stop at eos.
    default_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=config)
    finally:
        model.generation_config.eos_token_id = default_eos
    sequences = out.sequences if scores else out
    return sequences[:, ids.shape[1]:].numel()


def time_mode(model, ids, mask, s: Settings, stop: list[int], pad: int, repeats: int) -> dict[str, Any]:
    """Alternate the generators ``repeats`` times (after one warm-up call each); medians per generator."""
    calls = {
        "ours": lambda seed: ours(model, ids, mask, s.max_new_tokens, s.temperature, stop, pad, seed),
        "ours_static": lambda seed: ours(model, ids, mask, s.max_new_tokens, s.temperature, stop, pad, seed,
                                         cache="static"),
        "hf_generate": lambda seed: hf(model, ids, mask, s.max_new_tokens, s.temperature, stop, pad, seed),
        "hf_generate_scores": lambda seed: hf(model, ids, mask, s.max_new_tokens, s.temperature, stop, pad, seed,
                                              scores=True),
    }
    for call in calls.values():
        call(10_000)
    seconds: dict[str, list[float]] = {name: [] for name in GENERATORS}
    positions: dict[str, list[int]] = {name: [] for name in GENERATORS}
    for seed in range(repeats):
        for name in GENERATORS:
            started = time.perf_counter()
            positions[name].append(calls[name](seed))
            seconds[name].append(time.perf_counter() - started)
    result: dict[str, Any] = {}
    for name in GENERATORS:
        rates = [p / t for p, t in zip(positions[name], seconds[name], strict=True)]
        result[name] = {"median_s": median(seconds[name]), "median_tokens_per_s": median(rates),
                        "positions_mean": sum(positions[name]) / repeats}
    result["ratio_ours_over_hf_generate"] = (result["ours"]["median_tokens_per_s"]
                                             / result["hf_generate"]["median_tokens_per_s"])
    result["ratio_static_over_dynamic"] = (result["ours_static"]["median_tokens_per_s"]
                                           / result["ours"]["median_tokens_per_s"])
    result["ratio_static_over_hf_generate"] = (result["ours_static"]["median_tokens_per_s"]
                                               / result["hf_generate"]["median_tokens_per_s"])
    result["ratio_ours_over_hf_generate_scores"] = (result["ours"]["median_tokens_per_s"]
                                                    / result["hf_generate_scores"]["median_tokens_per_s"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 2 repeats")
    parser.add_argument("--repeats", type=int, help="timed calls per generator and mode (default 7; smoke 2)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--compile-cpu", action="store_true", help="compile the static decode step on CPU too")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/generation.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from rlhf_core.training import rollout

    if args.compile_cpu:
        rollout.COMPILED_DEVICES = rollout.COMPILED_DEVICES | {"cpu"}
    from benchmarks.ppo_vs_trl.settings import smoke_settings
    from rlhf_core.models.roles import load_policy
    from rlhf_core.models.sequences import left_pad

    s = smoke_settings() if args.smoke else Settings()
    repeats = args.repeats or (2 if args.smoke else 7)
    before = machine()
    fixture = build_fixture(s.fixture)
    tokenizer = fixture.tokenizer()
    model = load_policy(str(fixture.policy_dir)).eval()
    ids, mask = left_pad(fixture.prompts()[: s.rollout_batch_size], tokenizer.pad_token_id)
    pad = tokenizer.pad_token_id
    modes = {
        "fixed_length": time_mode(model, ids, mask, s, [], pad, repeats),
        "with_stop": time_mode(model, ids, mask, s, [tokenizer.eos_token_id], pad, repeats),
    }
    payload = {
        "benchmark": "generation",
        "smoke": args.smoke,
        "command": " ".join([".venv/bin/python -m benchmarks.generation.run", *sys.argv[1:]]),
        "machine": before,
        "load_average_at_end": machine()["load_average"],
        "setup": {"batch": s.rollout_batch_size, "max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                  "prompt_width": ids.shape[1], "repeats": repeats, "static_compiled_on": sorted(rollout.COMPILED_DEVICES),
                  "policy_parameters": fixture.info()["policy_parameters"], "fixture": fixture.info()["spec"]},
        "modes": modes,
        "peak_rss_mib": peak_rss_mib(),
    }
    write_result(payload, args.out or default_out("generation", args.smoke))


if __name__ == "__main__":
    main()
