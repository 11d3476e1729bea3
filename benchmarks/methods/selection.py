"""Selection rules for a tuning sweep, fixed in advance, checked against gold on the sweeps a state folder holds.

    .venv/bin/python -m benchmarks.methods.selection --state /tmp/tune2              # every completed PPO sweep
    .venv/bin/python -m benchmarks.methods.selection --state /tmp/tune2 --sweeps ID1 ID2   # these, as rounds 1, 2
    .venv/bin/python -m benchmarks.methods.selection --state /tmp/tune2 --method dpo   # DPO's rounds (one policy each)

Each completed sweep is one tuning round (oldest first). For every completed run of a round it reads the run's
``summary.json`` (per iteration: held-out, proxy and gold means and the mean per-sequence KL to the reference; its
seed's best-of-N points at the analytic KL ``log n - (n-1)/n``) and scores the run by each rule below. A rule reads
the held-out judge and KL only: never gold, never the proxy alone.

- ``A_final``: the final iteration's held-out mean (the protocol of ``benchmarks.methods.run``, ``--select heldout``).
- ``B_frontier_gain``: the final held-out mean minus the seed's best-of-N held-out frontier at the run's final KL
  (piecewise-linear over the best-of-N points; past the last point extrapolated linearly from the last two): the
  score of ``rlhf sweep --select frontier``; and
  ``B_frontier_gain_clamped``, where the frontier stays at its last (best-of-16) value past the last point.
- ``C_efficiency``: (final held-out mean - best-of-1 held-out mean) / sqrt(final KL).
- ``D_best_iteration``: the largest held-out mean over the run's iterations (the checkpoint one would promote).
- ``E_kl_budget`` (declared before round 4): the final held-out mean, a setting eligible only when its mean final
  KL over the seeds is at most ``KL_BUDGET``, best-of-64's analytic KL (log 64 - 63/64 = 3.17 nats): the furthest
  best-of-N point measured, past which the judge's and gold's best-of-N curves are flat. Its per-run score is A's;
  the budget acts on the choice (``rlhf sweep --select heldout --kl-budget 3.17``).
- ``ref_lowest_kl`` (a reference, not a rule declared in advance): minus the final KL. Past best-of-N's last point
  B is the held-out mean minus a linear function of KL, so this shows how much of B is its KL term alone.

As the sweep does, runs the held-out verdict does not pass (``heldout_status`` other than ``ok``) are left out of a
setting's score, and the setting with the best mean score over seeds is chosen. Gold is read only afterwards, to
evaluate the rules: per seed and pooled Spearman correlation of each rule's score with the final gold mean and with
the gold gap to best-of-N at the run's KL (gold minus the seed's best-of-N gold frontier, both variants), and the
gold mean of each rule's chosen setting beside the current rule's and gold's own best (``gold_best_setting``).
Prints JSON and writes ``benchmarks/results/methods_selection.json``. Reads the state folder only, writes nothing
there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import default_out, write_result
from benchmarks.methods.protocol import KL_BUDGET
from benchmarks.methods.tables import frontier, mean_se
from flows.sweep_plan import setting_label
from flows.sweep_report import over_kl_budget
from rlhf_core.evaluation.metrics import spearman
from tasks.run_store import RunStore
from tasks.run_store.sweeps import SweepRecord

#: Per iteration: name -> the key of the evaluation's metrics in a run's summary.
METRICS = {"heldout": "eval/heldout/mean", "proxy": "eval/proxy/mean", "kl": "eval/kl/mean", "gold": "eval/gold/mean"}
CURRENT = "A_final"
ITERATION = "ppo-iteration-"  # a run's iteration stages in its summary: ppo-iteration-1, -2, ...
#: What each rule's score is computed from (the judge and KL only).
RULES = {
    "A_final": "final held-out mean",
    "B_frontier_gain": "final held-out mean - best-of-N held-out frontier at the final KL (linear extrapolation)",
    "B_frontier_gain_clamped": "final held-out mean - best-of-N held-out frontier at the final KL (clamped at N max)",
    "C_efficiency": "(final held-out mean - best-of-1 held-out mean) / sqrt(final KL)",
    "D_best_iteration": "max over iterations of the held-out mean",
    "E_kl_budget": "final held-out mean; settings whose mean final KL is above best-of-64's (3.17 nats) not eligible",
    "ref_lowest_kl": "reference, not a declared rule: minus the final KL (what B's frontier term alone ranks by)",
}
#: Gold-side quantities a rule's score is compared with (evaluation only).
TARGETS = ("gold", "gold_gap", "gold_gap_clamped")


@dataclass(frozen=True)
class Run:
    """One completed run of a tuning round: what the rules and the evaluation need."""

    round: int
    run_id: str
    seed: int
    setting: str
    eligible: bool
    final_artifact: str
    iterations: list[dict[str, float]]
    best_of_n: list[dict[str, float]]

    @property
    def final(self) -> dict[str, float]:
        return self.iterations[-1]


def rule_scores(run: Run) -> dict[str, float]:
    """Every rule's score of ``run`` (held-out judge and KL only)."""
    held, kl = run.final["heldout"], run.final["kl"]
    sft = next(p for p in run.best_of_n if p["n"] == 1)["heldout"]
    return {"A_final": held,
            "B_frontier_gain": held - frontier(run.best_of_n, "heldout", kl, clamp=False),
            "B_frontier_gain_clamped": held - frontier(run.best_of_n, "heldout", kl, clamp=True),
            "C_efficiency": (held - sft) / math.sqrt(kl),
            "D_best_iteration": max(it["heldout"] for it in run.iterations),
            "E_kl_budget": held,
            "ref_lowest_kl": -kl}


def gold_targets(run: Run) -> dict[str, float]:
    """Gold of the final policy and its gap to the seed's best-of-N gold frontier at the run's KL (evaluation only)."""
    gold, kl = run.final["gold"], run.final["kl"]
    return {"gold": gold,
            "gold_gap": gold - frontier(run.best_of_n, "gold", kl, clamp=False),
            "gold_gap_clamped": gold - frontier(run.best_of_n, "gold", kl, clamp=True)}


def method_sweeps(store: RunStore, method: str) -> list[SweepRecord]:
    """Completed sweeps with completed runs, all of ``method``, oldest first."""
    chosen = []
    for path in sorted(store.layout.sweeps.glob("*/sweep.json")):
        record = store.load_sweep(path.parent.name)
        summaries = [_summary(store, c.run_id) for c in record.cells]
        done = [s for s in summaries if s is not None]
        if record.status == "completed" and done and all(s.get("method") == method for s in done):
            chosen.append(record)
    return sorted(chosen, key=lambda r: r.created)


def _summary(store: RunStore, run_id: str) -> dict[str, Any] | None:
    """A completed run's summary, else None (read only: no reconciling of run records)."""
    path = store.summary_file(run_id)
    if store.load_run(run_id).status != "completed" or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def load_round(store: RunStore, record: SweepRecord, number: int) -> list[Run]:
    """The completed runs of one sweep."""
    runs = []
    for cell in record.cells:
        summary = _summary(store, cell.run_id)
        if summary is None:
            continue
        last = final_policy_stage(summary["artifacts"])
        runs.append(Run(round=number, run_id=cell.run_id, seed=cell.seed, setting=setting_label(cell.setting),
                        eligible=summary.get("heldout_status", "ok") == "ok",
                        final_artifact=summary["artifacts"][last]["artifact"],
                        iterations=[{name: it[key] for name, key in METRICS.items()} for it in summary["iterations"]],
                        best_of_n=[{k: p[k] for k in ("n", "kl", "heldout", "gold")} for p in summary["best_of_n"]]))
    return runs


def incumbent_runs(store: RunStore, sweep_id: str, setting: str, number: int) -> list[Run]:
    """The completed runs of one setting of an earlier sweep, as runs of round ``number`` (labelled 'incumbent:
    <setting>'); a setting the sweep does not hold is refused in one line."""
    runs = [r for r in load_round(store, store.load_sweep(sweep_id), number) if r.setting == setting]
    if not runs:
        raise SystemExit(f"--incumbent: sweep {sweep_id} has no completed run of setting {setting!r}")
    return [dataclasses.replace(r, setting=f"incumbent: {setting}") for r in runs]


def final_policy_stage(artifacts: dict[str, Any]) -> str:
    """The stage of a run's final policy: its last PPO iteration, or 'dpo' for an offline DPO run (one policy)."""
    iterations = [k for k in artifacts if k.startswith(ITERATION)]
    return max(iterations, key=lambda k: int(k.removeprefix(ITERATION))) if iterations else "dpo"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _rho(runs: Sequence[Run], rule: str, target: str) -> float | None:
    """Spearman correlation over ``runs`` of a rule's score with a gold target (None when undefined)."""
    if len(runs) < 2:
        return None
    return _finite(spearman([rule_scores(r)[rule] for r in runs], [gold_targets(r)[target] for r in runs]))


def correlations(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Per rule and gold target: Spearman per seed, its mean over seeds, and pooled over ``runs``."""
    seeds = sorted({r.seed for r in runs})
    out: dict[str, dict[str, Any]] = {}
    for rule in RULES:
        out[rule] = {}
        for target in TARGETS:
            per_seed = {str(s): _rho([r for r in runs if r.seed == s], rule, target) for s in seeds}
            defined = [v for v in per_seed.values() if v is not None]
            out[rule][target] = {"per_seed": per_seed, "mean_per_seed": statistics.fmean(defined) if defined else None,
                                 "pooled": _rho(runs, rule, target), "runs": len(runs)}
    return out


def choose(runs: Sequence[Run], rule: str) -> dict[str, Any]:
    """Per seed ranking of the settings by ``rule`` (best first); the setting with the best mean score over its
    eligible runs (the sweep's protocol with the rule's score in place of the final held-out mean). Rule E leaves
    out the settings whose mean final KL is above ``KL_BUDGET``."""
    score = {r.run_id: rule_scores(r)[rule] for r in runs}
    ranking = {str(s): [r.setting for r in sorted((r for r in runs if r.seed == s), key=lambda r: -score[r.run_id])]
               for s in sorted({r.seed for r in runs})}
    means = {name: statistics.fmean(score[r.run_id] for r in runs if r.setting == name and r.eligible)
             for name in dict.fromkeys(r.setting for r in runs)
             if any(r.setting == name and r.eligible for r in runs)}
    budgeted = rule == "E_kl_budget"
    over_budget = [name for name in means if budgeted and over_kl_budget(
        statistics.fmean(r.final["kl"] for r in runs if r.setting == name), KL_BUDGET)]
    candidates = {name: m for name, m in means.items() if name not in over_budget}
    chosen = max(candidates, key=candidates.__getitem__) if candidates else None
    return {"chosen": chosen, "mean_score": means, "per_seed_ranking": ranking,
            **({"over_kl_budget": over_budget} if budgeted else {})}


def setting_table(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Per setting: mean / sd / se over seeds of the final held-out, proxy, KL, gold and gold gaps (the check against
    the sweep's report), and gold at the iteration ``D_best_iteration`` promotes."""
    table = {}
    for name in dict.fromkeys(r.setting for r in runs):
        group = [r for r in runs if r.setting == name]
        row = {key: mean_se([r.final[key] for r in group]) for key in METRICS}
        row |= {key: mean_se([gold_targets(r)[key] for r in group]) for key in TARGETS[1:]}
        row["gold_at_best_heldout_iteration"] = mean_se([max(r.iterations, key=lambda it: it["heldout"])["gold"]
                                                         for r in group])
        row["eligible_runs"] = sum(r.eligible for r in group)
        table[name] = row
    return table


def evaluate_round(runs: Sequence[Run]) -> dict[str, Any]:
    """Each rule's choice of the round, the gold of its choice against the current rule's, and its correlations."""
    table = setting_table(runs)
    choices = {rule: choose(runs, rule) for rule in RULES}
    current = choices[CURRENT]["chosen"]
    gold_best = max(table, key=lambda name: table[name]["gold"]["mean"])
    for rule, choice in choices.items():
        row = table.get(choice["chosen"]) if choice["chosen"] else None
        choice["gold_of_chosen"] = row["gold"]["mean"] if row else None
        choice["gold_gap_clamped_of_chosen"] = row["gold_gap_clamped"]["mean"] if row else None
        choice["gold_minus_current_choice"] = (row["gold"]["mean"] - table[current]["gold"]["mean"]
                                               if row and current else None)
        if rule == "D_best_iteration" and row:
            choice["gold_of_chosen_promoted_checkpoint"] = row["gold_at_best_heldout_iteration"]["mean"]
    return {"settings": table, "gold_best_setting": gold_best, "rules": choices,
            "correlations": correlations(runs)}


def run_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """The reconstruction: every run with its iterations, its seed's best-of-N points, rule scores and gold targets."""
    return [{"round": r.round, "seed": r.seed, "setting": r.setting, "run_id": r.run_id, "eligible": r.eligible,
             "final_artifact": r.final_artifact, "iterations": r.iterations, "best_of_n": r.best_of_n,
             "scores": rule_scores(r), "gold_targets": gold_targets(r)} for r in runs]


def distinct(runs: Sequence[Run]) -> list[Run]:
    """One run per final artifact (a later round's cell that reuses an earlier run's computation counts once)."""
    return list({r.final_artifact: r for r in runs}.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state", type=Path, required=True, help="the state folder the tuning sweeps ran in")
    parser.add_argument("--sweeps", nargs="+", default=None,
                        help="sweep ids, one per round in order (default: every completed sweep of --method)")
    parser.add_argument("--method", default="ppo", help="the method whose completed sweeps are the rounds")
    parser.add_argument("--incumbent", nargs=2, metavar=("SWEEP_ID", "SETTING"), default=None,
                        help="a setting of an earlier sweep (its label, e.g. 'ppo.kl.coef=0.2 ppo.learning_rate=1e-4') "
                        "that competes in the last round: the preset a round tries to improve on")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    store = RunStore(args.state)
    records = [store.load_sweep(s) for s in args.sweeps] if args.sweeps else method_sweeps(store, args.method)
    rounds = [load_round(store, record, number) for number, record in enumerate(records, 1)]
    if args.incumbent:
        rounds[-1] = incumbent_runs(store, *args.incumbent, len(rounds)) + rounds[-1]
    everything = [r for runs in rounds for r in runs]
    payload: dict[str, Any] = {
        "state_dir": str(store.root), "rules": RULES, "current_rule": CURRENT,
        "caveat": "gold of these runs was seen before: a validation of rules declared in advance, not a clean test",
        "rounds": [{"round": n, "sweep_id": record.sweep_id, "grid": record.grid, "seeds": record.seeds,
                    "runs": len(runs), **evaluate_round(runs)}
                   for n, (record, runs) in enumerate(zip(records, rounds, strict=True), 1)],
        "all_rounds": {"runs": len(everything), "correlations": correlations(everything)},
        "all_rounds_distinct": {"runs": len(distinct(everything)), "correlations": correlations(distinct(everything))},
        "runs": run_rows(everything),
    }
    name = "methods_selection" if args.method == "ppo" else f"methods_selection_{args.method}"
    write_result(payload, args.out or default_out(name, smoke=False))


if __name__ == "__main__":
    main()
