"""The CUDA path in one command: bf16 PPO steps on a Qwen2.5-0.5B shape, real offload moves, the chunked vocabulary,
decode speed, MFU and peak memory per phase next to the memory calculator's prediction.

    python3 -m benchmarks.gpu_check.run --out gpu_check.json     # one CUDA GPU, about 5 minutes
    .venv/bin/python -m benchmarks.gpu_check.run --smoke          # a tiny shape on CPU (the test suite runs this)

It needs torch, transformers, peft and psutil only (no MLflow, Prefect or DeepSpeed): a GPU machine with those runs
it from a checkout as is. Weights are random, built from the shape's numbers (``benchmarks/memory/shapes.py``
MODELS): speed and memory do not depend on their values. Every section runs even when another fails; a failure is
recorded with its traceback under ``errors`` and the command exits 1, so one short GPU lease shows everything that
breaks.

Sections (``--only`` picks some):

- ``matmul_peak``: bf16 ``torch.mm`` FLOP/s at 8192^3 (mean of 10 after 3 warm-ups), the denominator of MFU.
- ``ppo``: four setups, ``lora_head`` and ``lora_critic`` (bf16 weights, fp32 adapters) and ``full_head`` and
  ``full_critic`` (fp32 weights and AdamW), every forward under bf16 autocast (``ppo.autocast: bf16``). Each runs
  one warm-up PPO step, then one measured step in its two phases: experience (rollout, old / reference log-probs,
  values, reward) and update (``ppo_epochs`` of mini-batches and optimizer steps). Per phase: seconds and peak GPU
  memory, beside :mod:`benchmarks.memory.calculator`'s prediction (experience: the larger of its rollout and scoring
  phases; update: the larger of training and the optimizer step). Training MFU counts PaLM's model FLOPs on real
  tokens (``benchmarks/mfu/run.py``): 6 per trained weight and token, 4 per frozen weight under LoRA (no weight
  gradient).
- ``offload``: ``full_critic`` from the same weights and seed, two PPO steps, without ``ppo.offload_frozen``
  twice (the control) and with it once (the reference and reward model really move to host memory and back), under
  torch's deterministic algorithms: every trained parameter must be bit-identical; the update phase's peak memory.
- ``vocab``: log-probs, entropies and gradients over a 151,936-token vocabulary, chunked
  (``rlhf_core.models.roles.vocab_outputs``) against one unchunked pass, and the peak memory of each.
- ``decode``: tokens/s of plain ``model.generate``, our dynamic-cache rollout and the static-cache rollout
  (``ppo.generation.cache: static``; its decode step compiled with torch.compile on CUDA), bf16 weights, no stop
  token; the static path's first call (the compile) timed apart, and each path's sampling log-probs against a full
  forward over the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.common import default_out, machine, write_result
from benchmarks.gpu_check.setups import FULL, SETUPS, SMOKE, Scale, build, ppo_config, prompts, qwen2_config
from benchmarks.memory.calculator import phases
from benchmarks.memory.shapes import RunShape
from benchmarks.mfu.run import training_flops

if TYPE_CHECKING:
    from rlhf_core.config import PPOConfig
    from rlhf_core.training.experience import Experience, PPOModels
    from rlhf_core.training.ppo_step import PPOState
    from rlhf_core.training.strategy import Strategy

SECTIONS = ("matmul_peak", "ppo", "offload", "vocab", "decode")
GIB = 2**30


@contextlib.contextmanager
def phase(device: torch.device, into: dict[str, Any], name: str) -> Iterator[None]:
    """Time the block (synchronised) and, on CUDA, its peak allocated memory in GiB, into ``into[name]``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize()
    into[name] = {"seconds": time.perf_counter() - started,
                  "peak_gib": torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None}


def matmul_peak(scale: Scale, device: torch.device) -> dict[str, Any]:
    """bf16 (CPU: fp32) square matmul FLOP/s: the mean of 10 calls after 3 warm-ups."""
    n, dtype = scale.matmul, torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    with phase(device, record := {}, "mm"):
        for _ in range(10):
            a @ b
    return {"n": n, "dtype": str(dtype), "flops": 10 * 2 * n**3 / record["mm"]["seconds"]}


def model_flops(models: PPOModels, lengths: list[int], scale: Scale, epochs: int) -> float:
    """PaLM's model FLOPs of ``epochs`` forward + backward passes of the trained models over ``lengths`` tokens:
    ``benchmarks/mfu/run.py``'s count (6 per weight and token, plus attention) over the trained matmul weights, and
    4 per frozen one (LoRA's base: no weight gradient)."""
    total = 0.0
    for module in (models.policy, models.critic):
        if module is None:
            continue
        linears = [sub.weight for sub in module.modules() if isinstance(sub, torch.nn.Linear)]
        trained = sum(w.numel() for w in linears if w.requires_grad)
        frozen = sum(w.numel() for w in linears if not w.requires_grad)
        total += training_flops(lengths, trained, scale.shape.layers, scale.shape.hidden, epochs)
        total += epochs * 4 * frozen * sum(lengths)
    return total


def predicted(setup: str, scale: Scale, config: PPOConfig) -> dict[str, float]:
    """The memory calculator's GiB per phase for this setup (one GPU, torch AdamW, no checkpointing)."""
    run = RunShape(prompt_length=scale.prompt_tokens, response_length=scale.new_tokens,
                   micro_batch=scale.micro_batch, generation_batch=scale.rollout_batch,
                   rollout_batch=scale.rollout_batch, weight_bytes=2 if setup.startswith("lora") else 4,
                   autocast=True, lora_rank=scale.lora_rank if setup.startswith("lora") else 0,
                   gradient_checkpointing=False, optimizer="torch", zero_stage=0, gpus=1,
                   value_model="head" if setup.endswith("head") else "critic",
                   offload_frozen=config.offload_frozen)
    peaks = {name: parts["peak"] / GIB for name, parts in phases(scale.shape, run).items()}
    return {"between_steps": peaks["load"], "experience": max(peaks["rollout"], peaks["scoring"]),
            "update": max(peaks["training"], peaks["optimizer_step"])}


def measured_step(models: PPOModels, strategy: Strategy, config: PPOConfig, state: PPOState,
                  batch: list[list[int]], device: torch.device) -> tuple[dict[str, Any], Experience]:
    """One PPO step as ``ppo_step`` runs it, timed and measured in its two phases (``strategy``: as
    :func:`rlhf_core.training.ppo_step.prepare_training` returns it)."""
    from rlhf_core.models.offload import parked
    from rlhf_core.training.experience import collect_experience
    from rlhf_core.training.ppo_step import frozen_offload, ppo_update

    record: dict[str, Any] = {}
    kl_coef = state.kl_controller.coef
    with phase(device, record, "experience"):
        experience, stats, t_generation, _ = collect_experience(models, batch, config, kl_coef, state.generator,
                                                                state.score_moments)
    record["experience"]["generation_seconds"] = t_generation
    with phase(device, record, "update"), parked(list(frozen_offload(models, config).moved.values())):
        ppo_update(models, strategy, experience, config, kl_coef, state.generator)
    return record, experience


def ppo_setup(setup: str, scale: Scale, device: torch.device, peak_flops: float | None) -> dict[str, Any]:
    """Build one setup, run a warm-up step and a measured one; seconds, GiB, tokens/s and MFU."""
    from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_step, prepare_training

    models = build(setup, scale, device)
    config = ppo_config(setup, scale)
    models, strategy = prepare_training(models, config)
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
    ppo_step(models, strategy, state, prompts(scale, scale.rollout_batch, seed=1), config)
    steady_gib = torch.cuda.memory_allocated() / GIB if device.type == "cuda" else None
    record, experience = measured_step(models, strategy, config, state,
                                       prompts(scale, scale.rollout_batch, seed=2), device)
    lengths = experience.rollout.attention_mask.sum(dim=1).tolist()
    flops = model_flops(models, lengths, scale, config.ppo_epochs)
    generated = int(experience.rollout.response_mask.sum())
    out = {
        "trainable_parameters": sum(p.numel() for group in strategy.optimizer.param_groups for p in group["params"]),
        "measured": {"between_steps": {"allocated_gib": steady_gib}, **record},
        "predicted_gib": predicted(setup, scale, config),
        "generated_tokens_per_s": generated / record["experience"]["generation_seconds"],
        "training_model_flops": flops,
        "training_flops_per_s": flops / record["update"]["seconds"],
    }
    out["training_mfu"] = out["training_flops_per_s"] / peak_flops if peak_flops else None
    del models, strategy, state, experience
    _free(device)
    return out


def offload(scale: Scale, device: torch.device) -> dict[str, Any]:
    """full_critic with and without ``ppo.offload_frozen``: two PPO steps each from the same weights and seed, with
    torch's deterministic algorithms (atomics in some CUDA backward kernels differ run to run otherwise); the
    resident run twice is the control that the comparison can come out equal at all."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):  # cuDNN's and the fused attention backwards are not deterministic
            runs, finals = _offload_runs(scale, device)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return {**runs, "parameters_compared": len(finals["resident"]),
            "control_bit_identical": _same(finals["resident"], finals["resident_again"]),
            "bit_identical": _same(finals["resident"], finals["parked"])}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _offload_runs(scale: Scale, device: torch.device) -> tuple[dict[str, Any], dict[str, list[torch.Tensor]]]:
    from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_step, prepare_training

    runs: dict[str, Any] = {}
    finals: dict[str, list[torch.Tensor]] = {}
    for name, parked_frozen in (("resident", False), ("resident_again", False), ("parked", True)):
        models = build("full_critic", scale, device)
        config = ppo_config("full_critic", scale, offload_frozen=parked_frozen)
        models, strategy = prepare_training(models, config)
        state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
        ppo_step(models, strategy, state, prompts(scale, scale.rollout_batch, seed=1), config)
        record, _ = measured_step(models, strategy, config, state,
                                  prompts(scale, scale.rollout_batch, seed=2), device)
        homes = {name: str(next(module.parameters()).device)
                 for name, module in (("reference", models.reference), ("reward model", models.scorer.model))}
        runs[name] = {"update": record["update"], "devices_after": homes}
        finals[name] = [p.detach().cpu() for p in (*models.policy.parameters(), *models.critic.parameters())]
        del models, strategy, state
        _free(device)
    return runs, finals


def vocab(scale: Scale, device: torch.device) -> dict[str, Any]:
    """Chunked against unchunked log-probs, entropies and gradients over the full vocabulary (float32)."""
    from rlhf_core.models import roles

    torch.manual_seed(0)
    head = torch.nn.Linear(scale.shape.hidden, scale.shape.vocab, bias=False, device=device)
    hidden = torch.randn(scale.vocab_rows, scale.shape.hidden, device=device)
    tokens = torch.randint(0, scale.shape.vocab, (scale.vocab_rows,), device=device)
    results, record = {}, {}
    chunked = scale.vocab_chunk or roles.VOCAB_CHUNK_ELEMENTS
    for name, chunk in (("chunked", chunked), ("whole", scale.vocab_rows * scale.shape.vocab)):
        head.zero_grad()
        x = hidden.clone().requires_grad_(True)
        saved, roles.VOCAB_CHUNK_ELEMENTS = roles.VOCAB_CHUNK_ELEMENTS, chunk
        try:
            with phase(device, record, name):
                logprobs, entropy = roles.vocab_outputs(head, x, tokens, 0.7, True)
                (logprobs.sum() + entropy.sum()).backward()
        finally:
            roles.VOCAB_CHUNK_ELEMENTS = saved
        results[name] = (logprobs.detach(), entropy.detach(), x.grad, head.weight.grad.clone())
    diffs = [float((a - b).abs().max()) for a, b in zip(results["chunked"], results["whole"], strict=True)]
    return {"rows": scale.vocab_rows, "vocab": scale.shape.vocab,
            "rows_per_chunk": max(1, chunked // scale.shape.vocab),
            "max_abs_diff": dict(zip(("logprobs", "entropy", "hidden_grad", "head_grad"), diffs, strict=True)),
            "peak_gib": {name: record[name]["peak_gib"] for name in record},
            "seconds": {name: record[name]["seconds"] for name in record}}


def decode(scale: Scale, device: torch.device, repeats: int) -> dict[str, Any]:
    """Tokens/s of HF generate, our dynamic and our static (compiled on CUDA) rollout, bf16 weights, no stop."""
    from transformers import Qwen2ForCausalLM

    from benchmarks.generation.run import hf, ours
    from rlhf_core.models.sequences import left_pad

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_config(scale.shape)).to(torch.bfloat16).eval()
    ids, mask = (t.to(device) for t in left_pad(prompts(scale, scale.rollout_batch, seed=3), 0))
    calls: dict[str, Callable[[int], int]] = {
        "hf_generate": lambda seed: hf(model, ids, mask, scale.new_tokens, 1.0, [], 0, seed),
        "ours_dynamic": lambda seed: ours(model, ids, mask, scale.new_tokens, 1.0, [], 0, seed),
        "ours_static": lambda seed: ours(model, ids, mask, scale.new_tokens, 1.0, [], 0, seed, cache="static"),
    }
    out: dict[str, Any] = {"batch": ids.shape[0], "prompt_width": ids.shape[1], "new_tokens": scale.new_tokens}
    for name, call in calls.items():
        with phase(device, first := {}, "first"):
            call(1000)
        times = []
        for seed in range(repeats):
            with phase(device, timed := {}, "call"):
                positions = call(seed)
            times.append(timed["call"]["seconds"])
        out[name] = {"first_call_s": first["first"]["seconds"], "median_s": sorted(times)[len(times) // 2],
                     "tokens_per_s": positions / sorted(times)[len(times) // 2], "peak_gib": timed["call"]["peak_gib"]}
    out["static_over_dynamic"] = out["ours_static"]["tokens_per_s"] / out["ours_dynamic"]["tokens_per_s"]
    out["static_over_hf_generate"] = out["ours_static"]["tokens_per_s"] / out["hf_generate"]["tokens_per_s"]
    out["logprob_vs_recomputation"] = {cache: _logprob_gap(model, ids, mask, scale, cache)
                                       for cache in ("dynamic", "static")}
    return out


def _logprob_gap(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, scale: Scale,
                 cache: str) -> dict[str, float]:
    """How far the sampling log-probs of one rollout are from a full forward over the same tokens (the PPO ratio's
    denominator against its numerator at the first mini-batch), max and mean absolute gap. With random weights the
    next-token distribution is nearly flat over 152k tokens, so two paths' samples part at the first rounding
    difference; their log-probs must still match the recomputation equally well."""
    from rlhf_core.config import GenerationConfig
    from rlhf_core.models.roles import policy_forward
    from rlhf_core.training.rollout import generate

    rollout = generate(model, ids, mask, GenerationConfig(max_new_tokens=scale.new_tokens, cache=cache), [], 0,
                       torch.Generator().manual_seed(7))
    with torch.no_grad():
        recomputed = policy_forward(model, rollout.input_ids, rollout.attention_mask, ids.shape[1], 1.0).logprobs
    gap = (recomputed - rollout.logprobs)[rollout.response_mask].abs()
    return {"max": float(gap.max()), "mean": float(gap.mean())}


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_sections(names: list[str], scale: Scale, device: torch.device, repeats: int,
                 save: Callable[[dict, dict], None]) -> tuple[dict, dict]:
    """Each section in turn; a failure is recorded and the next section runs. ``save`` gets the results so far
    after each section, so a run stopped at a time limit still leaves what it measured."""
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def attempt(name: str, work: Callable[[], Any]) -> None:
        started = time.perf_counter()
        try:
            results[name] = work()
        except Exception:  # noqa: BLE001 (every section runs; the failure is the result)
            errors[name] = traceback.format_exc(limit=12)
            _free(device)
        print(f"gpu_check: {name} {'failed' if name in errors else 'done'} in {time.perf_counter() - started:.1f}s",
              file=sys.stderr, flush=True)
        save(results, errors)

    if "matmul_peak" in names:
        attempt("matmul_peak", lambda: matmul_peak(scale, device))
    peak = results.get("matmul_peak", {}).get("flops")
    if "ppo" in names:
        for setup in SETUPS:
            attempt(f"ppo/{setup}", lambda setup=setup: ppo_setup(setup, scale, device, peak))
    if "offload" in names:
        attempt("offload", lambda: offload(scale, device))
    if "vocab" in names:
        attempt("vocab", lambda: vocab(scale, device))
    if "decode" in names:
        attempt("decode", lambda: decode(scale, device, repeats))
    return results, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on CPU")
    parser.add_argument("--only", help=f"comma-separated sections of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/gpu_check.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.only.split(",") if args.only else list(SECTIONS)
    if unknown := set(names) - set(SECTIONS):
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the offload check
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --smoke for the CPU check")
    device = torch.device("cpu" if args.smoke else "cuda")
    scale = SMOKE if args.smoke else FULL
    started = time.perf_counter()
    out = args.out or default_out("gpu_check", args.smoke)
    payload = {
        "benchmark": "gpu_check",
        "smoke": args.smoke,
        "command": " ".join(["python -m benchmarks.gpu_check.run", *sys.argv[1:]]),
        "machine": machine(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "scale": {**{k: v for k, v in vars(scale).items() if k != "shape"}, "shape": vars(scale.shape)},
    }

    def save(results: dict[str, Any], errors: dict[str, str], final: bool = False) -> None:
        payload.update(seconds=time.perf_counter() - started, complete=final, results=results, errors=errors)
        if final:
            write_result(payload, out)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(payload, indent=2) + "\n")

    results, errors = run_sections(names, scale, device, 1 if args.smoke else 3, save)
    save(results, errors, final=True)
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
