"""PPO, GRPO, RLOO, REINFORCE++, DPO and best-of-16 on the demo task, side by side.

    .venv/bin/python -m benchmarks.methods.run --seeds 0 1 2            # ~50 min, one run at a time
    .venv/bin/python -m benchmarks.methods.run --seeds 0 --preset tiny  # a smoke run of every method (~3 min)

Every run is ``rlhf demo --seed N`` (or ``rlhf run --preset P``) with one method's settings, all sharing one state
folder, so a seed's data, SFT policy, reward models and best-of-N baseline are computed once and every method of
that seed starts from the same SFT policy and is judged by the same held-out reward model and gold scorer. Each
run's ``summary.json`` gives the final policy's gold, held-out score, KL to the SFT policy and gold win rate;
``/usr/bin/time`` gives its wall time and peak RSS (of a run whose shared stages were cached: the method's own
stages). Best-of-16 is the baseline every run computes. Prints JSON, writes ``benchmarks/results/methods.json``
and draws gold against KL (the over-optimisation plot's axes) to ``benchmarks/results/methods.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, default_out, machine, write_result

METHODS: dict[str, list[str]] = {
    "ppo": [],
    "grpo": ["ppo.advantage=grpo", "ppo.samples_per_prompt=4", "ppo.whiten_advantages=false"],
    "rloo": ["ppo.advantage=rloo", "ppo.samples_per_prompt=4", "ppo.whiten_advantages=false"],
    "reinforce_pp": ["ppo.advantage=reinforce_pp"],
    "dpo": ["method=dpo"],
}
"""Each method's settings on top of the preset: the same rollouts per update (64 in the demo), learning rate and KL
leash (k1 in the reward, coef 0.05) as PPO; GRPO and RLOO sample 4 replies per prompt (16 prompts per update). DPO
trains offline on the reward model's training pairs (the preset's ``dpo`` section)."""
BEST_OF = 16


def _command(preset: str, seed: int, state: Path, overrides: list[str]) -> list[str]:
    cli = [sys.executable, "-m", "flows.cli"]
    if preset == "demo":
        return [*cli, "demo", "--seed", str(seed), "--state-dir", str(state), *overrides]
    return [*cli, "run", "--preset", preset, "--state-dir", str(state), f"seed={seed}", *overrides]


def run_one(method: str, seed: int, preset: str, state: Path, logs: Path) -> dict[str, Any]:
    """One pipeline run; its summary's headline numbers, wall time and peak RSS."""
    log = logs / f"{method}-seed{seed}.log"
    rss_file = logs / f"{method}-seed{seed}.rss"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_HOME": str(state / f"prefect-{method}-{seed}")}
    command = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *_command(preset, seed, state, METHODS[method])]
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - started
    if code != 0:
        return {"method": method, "seed": seed, "failed": f"exit {code}; see {log}"}
    run_line = next(line for line in log.read_text().splitlines() if line.startswith("summary: "))
    summary = json.loads(Path(run_line.removeprefix("summary: ").strip()).read_text())
    final = summary["policies"]["final"]
    sft = summary["policies"]["sft"]
    last = summary["iterations"][-1]
    best = next(row for row in summary["best_of_n"] if row["n"] == BEST_OF)
    return {
        "method": method, "seed": seed, "run_id": summary["run_id"], "status": summary["status"],
        "gold": final["gold"], "heldout": final["heldout"], "kl": final["kl"], "proxy": final["proxy"],
        "gold_sft": sft["gold"], "win_rate_gold": last["eval/win_rate/gold"],
        "best_of_16": {"gold": best["gold"], "heldout": best["heldout"], "kl": best["kl"]},
        "wall_s": round(wall, 1), "peak_rss_mib": round(int(rss_file.read_text().split()[-1]) / 1024, 1),
    }


def aggregate(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean and standard deviation over seeds per method, and best-of-16 from the PPO runs' baselines."""
    table: dict[str, dict[str, float]] = {}
    ok = [r for r in rows if "failed" not in r]
    groups = {m: [r for r in ok if r["method"] == m] for m in dict.fromkeys(r["method"] for r in ok)}
    groups[f"best-of-{BEST_OF}"] = [r["best_of_16"] for r in ok if r["method"] == "ppo"]
    for method, group in groups.items():
        if not group:
            continue
        row = {"seeds": len(group)}
        for key in ("gold", "heldout", "kl", "win_rate_gold", "wall_s", "peak_rss_mib"):
            if key not in group[0]:
                continue  # best-of-N has no training run of its own
            values = [g[key] for g in group]
            row[key] = statistics.fmean(values)
            row[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        table[method] = row
    return table


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Gold against KL to the SFT policy, one marker per run; best-of-16 as the baseline."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [r for r in rows if "failed" not in r]
    for method in dict.fromkeys(r["method"] for r in ok):
        group = [r for r in ok if r["method"] == method]
        ax.scatter([r["kl"] for r in group], [r["gold"] for r in group], label=method, s=40)
    best = [r["best_of_16"] for r in ok if r["method"] == "ppo"]
    ax.scatter([b["kl"] for b in best], [b["gold"] for b in best], label=f"best-of-{BEST_OF}", marker="x", s=60)
    sft = [r["gold_sft"] for r in ok if r["method"] == "ppo"]
    if sft:
        ax.axhline(statistics.fmean(sft), color="grey", linestyle=":", label="SFT (mean)")
    ax.set_xlabel("KL to the SFT policy (nats per reply)")
    ax.set_ylabel("gold score of the final policy")
    ax.set_title("Methods on the demo task: gold vs KL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs at a time after a seed's first (1 torch thread each; they share one SQLite store)")
    parser.add_argument("--state-dir", type=Path, default=None, help="shared state folder (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    smoke = args.preset != "demo"
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="rlhf-methods-"))
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        # The first method of a seed computes the shared stages alone; the others then reuse them, in parallel.
        first, *rest = args.methods
        rows.append(run_one(first, seed, args.preset, state, logs))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        with ThreadPoolExecutor(args.parallel) as pool:
            for row in pool.map(lambda m, s=seed: run_one(m, s, args.preset, state, logs), rest):
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    out = args.out or default_out("methods", smoke)
    plot(rows, out.with_suffix(".png"))
    write_result({"machine": machine(), "preset": args.preset, "methods": {m: METHODS[m] for m in args.methods},
                  "runs": rows, "table": aggregate(rows), "state_dir": str(state)}, out)


if __name__ == "__main__":
    main()
