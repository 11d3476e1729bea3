"""Bytes on disk of a state folder after N ppo-iterations: today's retention (every iteration's optimizer state kept,
policies uploaded to MLflow) against ``ppo.keep_resume_states=1`` + ``tracking.model_storage=reference``.

    .venv/bin/python -m benchmarks.state_retention.run            # 3 iterations of the tiny word-level GPT-2
    .venv/bin/python -m benchmarks.state_retention.run --smoke    # 2 iterations

The stages run through the real runner (keys, claims, publication, MLflow on SQLite) as the pipeline runs them; the
models are the tests' tiny ones, so the bytes are small but the ratios are what a large model sees (the optimizer
state of AdamW is 2x the trainable weights; an upload is 1x the policy).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from benchmarks.common import default_out, machine, write_result
from tasks import ppo_iteration
from tasks.config import load_config
from tests.stage_harness import StageHarness, unique_names
from tests.tiny_models import save_ppo_inputs

PROMPTS = ["hello the cat", "why the dog ran", "how big is the sun", "q red box", "the moon sat on a mat",
           "a small star", "fast blue tree", "q slow dog"]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def run_chain(root: Path, iterations: int, keep: int, storage: str) -> dict[str, int]:
    """``iterations`` ppo-iterations in a fresh state folder; bytes per top-level folder (and the total)."""
    harness = StageHarness(root / "state", dataclasses.replace(unique_names("bench"), model_storage=storage))
    try:
        saved = save_ppo_inputs(root / "inputs", PROMPTS)
        config = load_config(preset="tiny", overrides=[
            "device=cpu", f"ppo.iterations={iterations}", "ppo.updates_per_iteration=1",
            "ppo.generation.max_new_tokens=4", f"ppo.keep_resume_states={keep}"])
        data = harness.artifact("data-prep", {"ppo_prompts.parquet": saved["prompts"]},
                                {"ppo_prompts": "ppo_prompts.parquet"})
        inputs = (data, harness.model("sft", saved["sft"]), harness.model("reward-model", saved["rm"]))
        previous = None
        for k in range(1, iterations + 1):
            previous = harness.run(ppo_iteration, f"ppo-iteration-{k}", ppo_iteration.Config.of(config, k),
                                   ppo_iteration.Inputs(*inputs, previous))
    finally:
        harness.close()
    state = harness.store.root
    parts = {name: folder_bytes(state / name) for name in ("artifacts", "resume", "mlartifacts", "work")}
    return {**parts, "total": folder_bytes(state)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    iterations = 2 if args.smoke else 3
    with tempfile.TemporaryDirectory() as scratch:
        kept = run_chain(Path(scratch) / "kept", iterations, iterations, "upload")
        pruned = run_chain(Path(scratch) / "pruned", iterations, 1, "reference")
    payload = {"smoke": args.smoke, "machine": machine(), "iterations": iterations,
               "keep_all_upload": kept, "keep_1_reference": pruned,
               "saved_bytes": kept["total"] - pruned["total"], "ratio_pruned_over_kept": pruned["total"] / kept["total"]}
    write_result(payload, args.out or default_out("state_retention", args.smoke))


if __name__ == "__main__":
    main()
