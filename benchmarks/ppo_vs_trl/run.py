"""This project's PPO step vs TRL 1.12's PPOTrainer on the same models, prompts and hyperparameters.

    .venv/bin/python -m benchmarks.ppo_vs_trl.run --threads 1                  # ~3.5M params: 3 runs per side
    .venv/bin/python -m benchmarks.ppo_vs_trl.run --threads 1 --preset small   # ~0.5M params (the 2x target's scale)
    .venv/bin/python -m benchmarks.ppo_vs_trl.run --smoke                      # tiny models, 1 run per side

Runs alternate ours, TRL, ours, TRL ... each in a fresh process (run k of each side uses seed k), so slow
drifts in machine load hit both sides alike. Prints JSON and writes ``benchmarks/results/ppo_vs_trl.json``:
per-update wall time split into generation / scoring / training / other (medians over every update but each
run's first), response tokens per second, peak RSS, the reward-model score per update and its gain per update
(least-squares slope, per seed), and the ratio ours / TRL. ``--preset small`` writes ``ppo_vs_trl_small.json``.
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
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, default_out, machine, median, write_result
from benchmarks.fixtures import build_fixture
from benchmarks.ppo_vs_trl.settings import PRESETS, UNMATCHED, Settings, describe

PHASES = ("total_s", "generation_s", "scoring_s", "training_s", "other_s")
SIDES = ("ours", "trl")


def run_worker(side: str, seed: int, settings_file: Path, workdir: Path) -> dict[str, Any]:
    """One fresh process of one side; returns its JSON record."""
    out = workdir / f"{side}-{seed}.json"
    command = [sys.executable, "-m", "benchmarks.ppo_vs_trl.worker", "--side", side, "--seed", str(seed),
               "--settings", str(settings_file), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**_env(), "TRL_EXPERIMENTAL_SILENCE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{side} run with seed {seed} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def _env() -> dict[str, str]:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` against 0, 1, 2 ... (reward gain per update)."""
    n = len(values)
    if n < 2:
        return 0.0
    x_mean, y_mean = (n - 1) / 2, sum(values) / n
    num = sum((x - x_mean) * (y - y_mean) for x, y in enumerate(values))
    return num / sum((x - x_mean) ** 2 for x in range(n))


def standard_error(values: list[float]) -> float | None:
    """Standard error of the mean of ``values`` (None for fewer than two)."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / len(values) ** 0.5


def summarise_side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every update of every run except each run's first (warm-up), and the reward curves."""
    steady = [u for run in runs for u in run["updates"][1:]] or [u for run in runs for u in run["updates"]]
    summary: dict[str, Any] = {f"median_{k}": median([u[k] for u in steady]) for k in PHASES}
    summary["first_update_total_s"] = median([run["updates"][0]["total_s"] for run in runs])
    summary["tokens_per_s"] = median([u["response_tokens"] / u["total_s"] for u in steady])
    summary["response_tokens_mean"] = sum(u["response_tokens"] for u in steady) / len(steady)
    summary["peak_rss_mib"] = median([run["peak_rss_mib"] for run in runs])
    summary["rss_after_load_mib"] = median([run["rss_after_load_mib"] for run in runs])
    curves = {str(run["seed"]): [u["rm_score_mean"] for u in run["updates"]] for run in runs}
    gains = {seed: slope(curve) for seed, curve in curves.items()}
    summary["rm_score_per_update"] = curves
    summary["reward_gain_per_update"] = gains
    summary["reward_gain_per_update_mean"] = sum(gains.values()) / len(gains)
    summary["reward_gain_per_update_sem"] = standard_error(list(gains.values()))
    summary["stop_rate_last_update"] = median([run["updates"][-1]["stop_rate"] for run in runs])
    summary["kl_last_update"] = median([run["updates"][-1]["kl_mean"] for run in runs])
    return summary


def compare(ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """Ratios ours / TRL of the median phase times (below 1 = ours faster) and the speed targets (ours 2x)."""
    ratios = {k: ours[f"median_{k}"] / trl[f"median_{k}"] if trl[f"median_{k}"] else None for k in PHASES}
    speedup = trl["median_total_s"] / ours["median_total_s"]
    return {
        "ratio_ours_over_trl": ratios,
        "speedup_trl_over_ours": speedup,
        "tokens_per_s_ratio_ours_over_trl": ours["tokens_per_s"] / trl["tokens_per_s"],
        "peak_rss_ratio_ours_over_trl": ours["peak_rss_mib"] / trl["peak_rss_mib"],
        "target_2x_faster_met": speedup >= 2.0,
        "reward_gain_not_worse": ours["reward_gain_per_update_mean"] >= trl["reward_gain_per_update_mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 updates, one run per side")
    parser.add_argument("--preset", choices=("default", "small"), default="default", help="model scale")
    parser.add_argument("--repeats", type=int, help="runs per side (default 3; smoke 1)")
    parser.add_argument("--updates", type=int, help="PPO updates per run (default 6; smoke 2)")
    parser.add_argument("--threads", type=int, help="torch threads of every run (default: torch's own choice)")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/ppo_vs_trl.json)")
    args = parser.parse_args()
    preset = "smoke" if args.smoke else args.preset
    settings = PRESETS[preset]()
    chosen = (("repeats", args.repeats), ("updates", args.updates), ("threads", args.threads))
    overrides = {k: v for k, v in chosen if v is not None}
    settings = Settings(**{**settings.__dict__, **overrides})
    started = time.perf_counter()
    before = machine()
    fixture = build_fixture(settings.fixture)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="ppo-vs-trl-") as tmp:
        settings_file = Path(tmp) / "settings.json"
        settings_file.write_text(json.dumps(describe(settings)))
        for seed in range(settings.repeats):
            for side in SIDES:
                runs[side].append(run_worker(side, seed, settings_file, Path(tmp)))
    summary = {side: summarise_side(runs[side]) for side in SIDES}
    payload = {
        "benchmark": "ppo_vs_trl",
        "smoke": args.smoke,
        "preset": preset,
        "command": " ".join([".venv/bin/python -m benchmarks.ppo_vs_trl.run", *sys.argv[1:]]),
        "machine": before,
        "load_average_at_end": machine()["load_average"],
        "wall_s": time.perf_counter() - started,
        "settings": describe(settings),
        "fixture": fixture.info(),
        "unmatched": UNMATCHED,
        "summary": summary,
        "comparison": compare(summary["ours"], summary["trl"]),
        "runs": runs,
    }
    name = "ppo_vs_trl" if preset in ("default", "smoke") else f"ppo_vs_trl_{preset}"
    write_result(payload, args.out or default_out(name, args.smoke))


if __name__ == "__main__":
    main()
