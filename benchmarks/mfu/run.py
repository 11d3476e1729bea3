"""Measured matmul FLOP/s of this machine, and the model-FLOPs utilisation (MFU) of our PPO training phase.

    .venv/bin/python -m benchmarks.mfu.run            # 8 x 512 GPT-2 policy + critic (~26M parameters each)
    .venv/bin/python -m benchmarks.mfu.run --smoke    # tiny model, small matmul

Peak: the best (and median) rate of square fp32 ``torch.mm`` calls of sizes 512, 1024 and 2048, each
repeated after a warm-up, 2 n^3 FLOPs each, with the same torch thread count as the PPO run; the best
size counts.

Model FLOPs of the training phase (``ppo_update``: ``ppo_epochs`` passes, forward + backward of the policy
and of the critic), counted on REAL tokens only (padding and packing filler are not useful work), per
sequence of length ``T`` and per trained model, PaLM's appendix-B convention:

    FLOPs(sequence) = T * (6 * N + 12 * n_layer * d_model * T)

``N`` = weights that take part in a matmul per token (every Linear / Conv1D weight of the blocks, plus the
LM head for the policy or the score head for the critic; embedding lookups are not matmuls). ``6N`` = forward
``2N`` + backward ``4N``; ``12 * n_layer * d_model * T`` = attention scores and weighted values (``Q K^T``
and ``A V``, forward and backward). Achieved FLOP/s = FLOPs / training-phase wall time; MFU = achieved /
measured peak.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import default_out, machine, median, peak_rss_mib, write_result
from benchmarks.fixtures import FixtureSpec, build_fixture
from benchmarks.ppo_vs_trl.settings import Settings, ours_config


def matmul_rate(n: int, repeats: int) -> dict[str, float]:
    """FLOP/s of an ``n x n`` fp32 matmul: best and median of ``repeats`` timed calls after two warm-ups."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    for _ in range(2):
        torch.mm(a, b, out=out)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b, out=out)
        rates.append(2 * n**3 / (time.perf_counter() - started))
    return {"n": n, "repeats": repeats, "best_flops": max(rates), "median_flops": median(rates)}


def matmul_peak(sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """The machine's fp32 matmul FLOP/s: the best over ``sizes`` of each size's best and median rate.

    Several sizes because on a shared machine a long matmul (2048: ~0.3 s on one core) is always cut by
    the scheduler, while a short one (512: ~5 ms) often runs a whole time slice alone.
    """
    by_size = [matmul_rate(n, repeats) for n in sizes]
    return {"sizes": by_size, "best_flops": max(r["best_flops"] for r in by_size),
            "median_flops": max(r["median_flops"] for r in by_size)}


def matmul_weights(model: torch.nn.Module, extra: torch.nn.Module) -> int:
    """``N``: weights of every Linear / Conv1D in ``model`` plus ``extra`` (the LM head or the score head).

    Linear layers that wrap other weights (LoRA) are not expected here: the benchmark trains full models.
    """
    from transformers.pytorch_utils import Conv1D

    heads = {id(extra)}
    total = extra.weight.numel()
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)) and id(module) not in heads:
            total += module.weight.numel()
    return total


def training_flops(lengths: list[int], n_weights: int, n_layer: int, d_model: int, epochs: int) -> float:
    """Model FLOPs of ``epochs`` forward + backward passes of one model over sequences of ``lengths``."""
    return epochs * sum(t * (6 * n_weights + 12 * n_layer * d_model * t) for t in lengths)


def measure_training(spec: FixtureSpec, s: Settings, updates: int) -> dict[str, Any]:
    """Run ``updates`` PPO updates (collect + train) of our PPO on the fixture; time each training phase."""
    from rlhf_core.models.roles import Critic, load_policy, load_reward_model, make_reference
    from rlhf_core.models.scoring import RewardModelScorer
    from rlhf_core.training.experience import PPOModels, collect_experience
    from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_update, prepare_training

    fixture = build_fixture(spec)
    tokenizer = fixture.tokenizer()
    policy = load_policy(str(fixture.policy_dir))
    reward = load_reward_model(str(fixture.reward_dir))
    critic = Critic(reward)
    scorer = RewardModelScorer(reward, tokenizer, batch_size=s.micro_batch_size)
    models = PPOModels(policy, make_reference(policy), scorer, (tokenizer.eos_token_id,), tokenizer.pad_token_id,
                       critic=critic)
    config = ours_config(s, seed=0)
    models, strategy = prepare_training(models, config)
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
    n_policy = matmul_weights(policy, policy.get_output_embeddings())
    n_critic = matmul_weights(critic.model, critic.model.score)
    prompts = fixture.prompts()
    records = []
    for k in range(updates):
        batch = prompts[k * s.rollout_batch_size : (k + 1) * s.rollout_batch_size]
        experience, _, _, _ = collect_experience(models, batch, config, s.kl_coef, state.generator,
                                                 state.score_moments)
        started = time.perf_counter()
        ppo_update(models, strategy, experience, config, s.kl_coef, state.generator)
        seconds = time.perf_counter() - started
        lengths = experience.rollout.attention_mask.sum(dim=1).tolist()
        flops = sum(training_flops(lengths, n, spec.n_layer, spec.n_embd, s.ppo_epochs) for n in (n_policy, n_critic))
        records.append({"training_s": seconds, "model_flops": flops, "achieved_flops": flops / seconds,
                        "real_tokens": sum(lengths), "padded_positions": experience.rollout.attention_mask.numel()})
    return {"policy_matmul_weights": n_policy, "critic_matmul_weights": n_critic,
            "policy_parameters": fixture.info()["policy_parameters"], "updates": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, one update, small matmul")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/mfu.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        spec = FixtureSpec(vocab_size=400, n_layer=2, n_embd=64, n_head=4, n_positions=128, n_prompts=16,
                           prompt_max_tokens=24)
        s = Settings(fixture=spec, rollout_batch_size=8, micro_batch_size=8, max_new_tokens=8, ppo_epochs=1)
        sizes, repeats, updates = (128, 256), 3, 1
    else:
        spec = FixtureSpec(n_layer=8, n_embd=512, n_head=8, n_prompts=96)
        s = Settings(fixture=spec)
        sizes, repeats, updates = (512, 1024, 2048), 10, 2
    before = machine()
    peak = matmul_peak(sizes, repeats)
    training = measure_training(spec, s, updates)
    steady = training["updates"][1:] or training["updates"]
    achieved = median([u["achieved_flops"] for u in steady])
    payload = {
        "benchmark": "mfu",
        "smoke": args.smoke,
        "command": " ".join([".venv/bin/python -m benchmarks.mfu.run", *sys.argv[1:]]),
        "machine": before,
        "load_average_at_end": machine()["load_average"],
        "formula": "per trained model and sequence of T real tokens: T * (6 * N + 12 * n_layer * d_model * T); "
                   "N = matmul weights (blocks + LM head / score head); policy + critic, x ppo_epochs",
        "model": {"n_layer": spec.n_layer, "n_embd": spec.n_embd, "n_head": spec.n_head, "vocab": spec.vocab_size},
        "ppo": {"rollout_batch_size": s.rollout_batch_size, "micro_batch_size": s.micro_batch_size,
                "max_new_tokens": s.max_new_tokens, "ppo_epochs": s.ppo_epochs},
        "matmul_peak": peak,
        "training": training,
        "achieved_flops": achieved,
        "mfu_vs_best_matmul": achieved / peak["best_flops"],
        "mfu_vs_median_matmul": achieved / peak["median_flops"],
        "peak_rss_mib": peak_rss_mib(),
    }
    write_result(payload, args.out or default_out("mfu", args.smoke))


if __name__ == "__main__":
    main()
