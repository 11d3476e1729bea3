"""Best-of-N measured past the pipeline's N = 16, and every tuning run's gold against it at the run's own KL.

    .venv/bin/python -m benchmarks.methods.frontier --state /tmp/tune2 --seeds 0,1,2 --n-max 64

The best-of-n stage samples 16 replies per evaluation prompt (analytic KL ``log N - (N-1)/N``: 1.84 nats at N = 16),
but tuned PPO ends at 1.5-4 nats, so a run's gap to best-of-N's gold curve was read off a line continued past the last
point. For each seed this samples ``--n-max`` replies per evaluation prompt from the seed's SFT policy (the artifacts
a run of that seed used: data-prep's evaluation prompts, the SFT policy, the proxy and the held-out RM), picks the
proxy's favourite of the first N for N = 1, 2, 4, ..., n_max, and scores it with the held-out RM and gold (the stage's
own sampling and scoring, ``tasks.best_of_n.sample_and_score``). N = 64 reaches 3.17 nats. Then every completed run of
the state folder is placed against its seed's measured curve at its final KL (linear between the points; a run past
the last point is counted apart, not extrapolated). Gold only evaluates here. Prints JSON and writes
``benchmarks/results/methods_frontier.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import default_out, machine, write_result
from rlhf_core.evaluation.best_of_n import best_of_n_curve, best_of_n_kl
from rlhf_core.evaluation.metrics import frontier_at
from tasks import best_of_n, reward_model, sft
from tasks.config import load_config
from tasks.judging import Judging, read_eval_prompts
from tasks.run_store import RunStore


def seed_inputs(store: RunStore, seed: int) -> tuple[Any, best_of_n.Inputs, list[dict[str, Any]]]:
    """(the data-prep artifact, the best-of-n stage's inputs, the stage's own points) of a completed run of ``seed``."""
    for record in store.list_runs(reconcile=False):
        summary_file = store.summary_file(record.run_id)
        if record.status != "completed" or not summary_file.is_file():
            continue
        summary = json.loads(summary_file.read_text())
        if summary["seed"] != seed:
            continue
        found = {stage: store.artifact(stage, record.stages[stage].key) for stage in ("data-prep", "sft", "reward-model")}
        rm = found["reward-model"]
        inputs = best_of_n.Inputs(found["data-prep"], sft.model_input(found["sft"]),
                                  reward_model.model_input(rm, "proxy"), reward_model.model_input(rm, "heldout"))
        return found["data-prep"], inputs, summary["best_of_n"]
    raise LookupError(f"no completed run of seed {seed} in {store.root}")


def measure(store: RunStore, seed: int, n_max: int, eval_prompts: int) -> dict[str, Any]:
    """The seed's best-of-N points for N = 1, 2, 4, ..., n_max, and the stage's own points (N <= 16) beside them."""
    config = load_config(preset="demo", overrides=[f"seed={seed}", f"eval.n_prompts={eval_prompts}",
                                                   f"data.demo.n_eval_prompts={eval_prompts}", "device=cpu"])
    ns = tuple(2 ** k for k in range(int(math.log2(n_max)) + 1))
    cfg = best_of_n.Config(Judging.of(config), ns)
    data, inputs, stage_points = seed_inputs(store, seed)
    prompts = read_eval_prompts(data.path(data.result["eval_prompts"]), eval_prompts)
    candidates, scores = best_of_n.sample_and_score(cfg, prompts, inputs, n_max)
    _, curve = best_of_n_curve(scores["proxy"], scores, ns)
    points = [{"n": p.n, "kl": p.kl, **{judge: p.means[judge] for judge in ("proxy", "heldout", "gold")}}
              for p in curve]
    return {"seed": seed, "prompts": len(prompts), "points": points, "stage_points": stage_points}


def place_runs(store: RunStore, curves: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every completed run of a measured seed: final gold and KL, and its gap to the measured gold curve there."""
    rows = []
    for record in store.list_runs(reconcile=False):
        summary_file = store.summary_file(record.run_id)
        if record.status != "completed" or not summary_file.is_file():
            continue
        summary = json.loads(summary_file.read_text())
        points = curves.get(summary["seed"])
        if points is None or not summary.get("iterations"):
            continue
        final = summary["iterations"][-1]
        kl, gold = final["eval/kl/mean"], final["eval/gold/mean"]
        inside = kl <= points[-1]["kl"]
        curve = [(p["kl"], p["gold"]) for p in points]
        rows.append({"run_id": record.run_id, "seed": summary["seed"], "method": summary.get("method", "ppo"),
                     "kl": kl, "gold": gold, "inside": inside,
                     "gap": gold - frontier_at(curve, kl, extrapolate=False) if inside else None})
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: runs inside the measured range, how many end below the curve, and the mean gap (sd)."""
    out = {}
    for method in sorted({r["method"] for r in rows}):
        group = [r for r in rows if r["method"] == method]
        gaps = [r["gap"] for r in group if r["inside"]]
        out[method] = {"runs": len(group), "inside": len(gaps), "below": sum(g < 0 for g in gaps),
                       "mean_gap": statistics.fmean(gaps) if gaps else None,
                       "sd_gap": statistics.stdev(gaps) if len(gaps) > 1 else None,
                       "past_last_point": len(group) - len(gaps)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state", type=Path, required=True, help="a state folder holding completed runs")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--n-max", type=int, default=64, help="a power of 2 (default 64: KL %.2f nats)"
                        % best_of_n_kl(64))
    parser.add_argument("--eval-prompts", type=int, default=256, help="evaluation prompts (the runs' own count)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.n_max < 1 or args.n_max & (args.n_max - 1):
        parser.error(f"--n-max must be a power of 2, got {args.n_max}")
    store = RunStore(args.state)
    seeds = [int(s) for s in args.seeds.split(",")]
    measured = [measure(store, seed, args.n_max, args.eval_prompts) for seed in seeds]
    rows = place_runs(store, {m["seed"]: m["points"] for m in measured})
    payload = {"machine": machine(), "state_dir": str(store.root), "n_max": args.n_max, "seeds": measured,
               "runs": rows, "by_method": summarise(rows)}
    write_result(payload, args.out or default_out("methods_frontier", smoke=False))


if __name__ == "__main__":
    main()
