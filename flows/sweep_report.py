"""A sweep's report: one row per setting (mean and sd over its seeds of the final policy's proxy, held-out, KL and,
where the task has it, gold; how many runs each verdict flags), the best-of-N baseline of the same seeds, and the
winner by ``--select``.

The winner is chosen on the held-out reward model only: runs its verdict does not pass are left out of their
setting's score (``hacking``, and ``warn``: KL past ``eval.kl_budget``, length blow-up or repetition, which would
also stop the policy's promotion), a setting with none left is not eligible, and gold never enters the choice,
neither as a metric nor through the gold-judged verdict. Gold is reported beside it, for evaluation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from flows.sweep_plan import Selector, setting_label

#: Columns of a setting's row: name -> the key in the final evaluation's metrics.
COLUMNS = {"proxy": "eval/proxy/mean", "heldout": "eval/heldout/mean", "gold": "eval/gold/mean",
           "kl": "eval/kl/mean", "length": "eval/length/mean"}


def mean_sd(values: Sequence[float]) -> tuple[float, float] | None:
    """(mean, sample sd) of ``values`` (sd 0 for one value); None for none."""
    if not values:
        return None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def build_report(sweep_id: str, select: Selector, cells: Sequence[Mapping[str, Any]],
                 kl_budget: float | None = None) -> dict[str, Any]:
    """The report from each cell's ``{"setting", "seed", "run_id", "status", "summary"}`` (summary None unless the run
    completed). With ``kl_budget`` (``rlhf sweep --kl-budget``), a setting whose mean final KL over its seeds is above
    it is not eligible: the choice is made at a stated distance from the SFT policy, as methods are compared with
    best-of-N at matched KL."""
    labels = list(dict.fromkeys(setting_label(c["setting"]) for c in cells))
    rows = [_row(label, [c for c in cells if setting_label(c["setting"]) == label], select) for label in labels]
    for row in rows:
        row["over_kl_budget"] = over_kl_budget(row["kl"][0] if row["kl"] is not None else None, kl_budget)
    eligible = [r for r in rows if r["select"] is not None and not r["over_kl_budget"]]
    winner = max(eligible, key=lambda r: r["select"][0])["setting"] if eligible else None
    done = [c["summary"] for c in cells if c["summary"] is not None]
    return {"sweep_id": sweep_id, "select": select.name, "select_description": select.description,
            "kl_budget": kl_budget, "winner": winner, "settings": rows, "best_of_n": _best_of_n(done),
            "runs": [{k: c[k] for k in ("setting", "seed", "run_id", "status")} for c in cells],
            "failed": [c["run_id"] for c in cells if c["status"] != "completed"]}


def over_kl_budget(mean_kl: float | None, kl_budget: float | None) -> bool:
    """Whether a setting whose mean final KL over its seeds is ``mean_kl`` is out of the choice under ``kl_budget``
    (no budget, or no KL measured: never)."""
    return kl_budget is not None and mean_kl is not None and mean_kl > kl_budget


def _row(label: str, cells: Sequence[Mapping[str, Any]], select: Selector) -> dict[str, Any]:
    done = [c["summary"] for c in cells if c["summary"] is not None]
    finals = [s["iterations"][-1] for s in done]
    row: dict[str, Any] = {"setting": label, "seeds": [c["seed"] for c in cells], "completed": len(done)}
    for name, key in COLUMNS.items():
        row[name] = mean_sd([f[key] for f in finals if f.get(key) is not None])
    row["hacking_heldout"] = sum(s.get("heldout_status") == "hacking" for s in done)
    row["warn_heldout"] = sum(s.get("heldout_status") == "warn" for s in done)
    row["hacking_gold"] = sum(s["status"] == "hacking" and _judged_by_gold(s) for s in done)
    kept = [s for s in done if s.get("heldout_status", "ok") == "ok"]
    row["select"] = mean_sd([v for v in map(select.score, kept) if v is not None])
    return row


def _judged_by_gold(summary: Mapping[str, Any]) -> bool:
    return summary["iterations"][-1].get("eval/gold/mean") is not None


def _best_of_n(summaries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The best-of-N points averaged over seeds (each seed's baseline counted once, whatever its settings)."""
    by_seed = {s["seed"]: s["best_of_n"] for s in summaries if s.get("best_of_n")}
    points = []
    for n in sorted({p["n"] for seed_points in by_seed.values() for p in seed_points}):
        at_n = [p for seed_points in by_seed.values() for p in seed_points if p["n"] == n]
        point = {"n": n, "kl": statistics.fmean(p["kl"] for p in at_n), "seeds": len(at_n)}
        for judge in ("proxy", "heldout", "gold"):
            point[judge] = mean_sd([p[judge] for p in at_n if p.get(judge) is not None])
        points.append(point)
    return points


def _cell(value: tuple[float, float] | None, seeds: int) -> str:
    if value is None:
        return "-"
    mean, sd = value
    return f"{mean:.3f} ({sd:.3f})" if seeds > 1 else f"{mean:.3f}"


def report_markdown(report: Mapping[str, Any]) -> str:
    """The report as markdown: the Prefect artifact, the MLflow parent run's description and ``sweep_report.md``."""
    rows = report["settings"]
    has_gold = any(r["gold"] is not None for r in rows)
    columns = ["proxy", "heldout", *(["gold"] if has_gold else []), "kl", "length"]
    lines = [f"**rlhf sweep {report['sweep_id']}**: winner by `{report['select']}` ({report['select_description']}; "
             "runs the held-out RM's verdict does not pass are left out" + _budget_clause(report)
             + ("; gold is reported, never selected on" if has_gold else "") + "): "
             + (f"`{report['winner']}`" if report["winner"] else "none (no eligible run)"), "",
             "Means over seeds (sd) of the final policy. Hacking: runs flagged by the held-out RM's verdict"
             + (" / by gold's" if has_gold else "") + "; warn: the held-out verdict's warnings (KL budget, length, "
             "repetition).", "",
             "| setting | runs | " + " | ".join(columns) + " | hacking | warn | select |",
             "|---|---:|" + "---:|" * (len(columns) + 3)]
    for r in rows:
        hacking = f"{r['hacking_heldout']}" + (f" / {r['hacking_gold']}" if has_gold else "")
        cells = [_cell(r[c], r["completed"]) for c in columns]
        mark = (" **(winner)**" if r["setting"] == report["winner"]
                else " (over the KL budget)" if r.get("over_kl_budget") else "")
        lines.append(f"| `{r['setting']}`{mark} | {r['completed']}/{len(r['seeds'])} | " + " | ".join(cells)
                     + f" | {hacking} | {r['warn_heldout']} | {_cell(r['select'], r['completed'])} |")
    if report["best_of_n"]:
        judges = ["proxy", "heldout", *(["gold"] if has_gold else [])]
        lines += ["", "Best-of-N from the SFT policy (the frontier to beat), means over seeds:", "",
                  "| N | KL | " + " | ".join(judges) + " |", "|---:|---:|" + "---:|" * len(judges)]
        for p in report["best_of_n"]:
            lines.append(f"| {p['n']} | {p['kl']:.2f} | " + " | ".join(_cell(p[j], p["seeds"]) for j in judges) + " |")
    if report["failed"]:
        lines += ["", f"Not completed: {', '.join(report['failed'])} (continue with `rlhf sweep --resume "
                      f"{report['sweep_id']}`)."]
    return "\n".join(lines) + "\n"


def report_text(report: Mapping[str, Any]) -> str:
    """The console table."""
    rows = report["settings"]
    has_gold = any(r["gold"] is not None for r in rows)
    columns = ["proxy", "heldout", *(["gold"] if has_gold else []), "kl"]
    width = max(len("setting"), *(len(r["setting"]) for r in rows)) + 2
    lines = [f"{'setting':<{width}}{'runs':>6}" + "".join(f"{c:>17}" for c in columns) + f"{'hacking':>10}"]
    for r in rows:
        cells = "".join(f"{_cell(r[c], r['completed']):>17}" for c in columns)
        hacking = f"{r['hacking_heldout']}" + (f"/{r['hacking_gold']}" if has_gold else "")
        lines.append(f"{r['setting']:<{width}}{r['completed']:>3}/{len(r['seeds']):<2}{cells}{hacking:>10}")
    best = next((p for p in reversed(report["best_of_n"])), None)
    if best is not None:
        shown = "  ".join(f"{j} {_cell(best[j], best['seeds'])}" for j in ("proxy", "heldout", "gold")
                          if best[j] is not None)
        lines.append(f"best-of-{best['n']} (KL {best['kl']:.2f}): {shown}")
    lines.append(f"winner by {report['select']} (held-out RM only; runs its verdict does not pass left out"
                 f"{_budget_clause(report)}): {report['winner'] or 'none'}")
    if report["failed"]:
        lines.append(f"not completed: {', '.join(report['failed'])}; continue with: rlhf sweep --resume "
                     f"{report['sweep_id']}")
    return "\n".join(lines)


def _budget_clause(report: Mapping[str, Any]) -> str:
    budget = report.get("kl_budget")
    return "" if budget is None else f"; settings whose mean KL is above {budget:g} nats are not eligible"


def winner_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """``sweep/winner/<column>`` means of the winning setting (for the sweep's MLflow run)."""
    row = next((r for r in report["settings"] if r["setting"] == report["winner"]), None)
    if row is None:
        return {}
    return {f"sweep/winner/{name}": row[name][0] for name in COLUMNS
            if row[name] is not None and math.isfinite(row[name][0])}
