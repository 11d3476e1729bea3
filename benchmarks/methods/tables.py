"""The methods report's tables: each method's mean, sd and standard error over seeds, paired per seed with best-of-16
and DPO and against the seed's best-of-N curve at the run's own KL; the gold-against-KL plot; and the tables of several
saved reports combined, over their seeds (``pool``) or over their methods (``join``). Reads rows and report files
only: `benchmarks/methods/run.py` runs the sweeps and makes the rows."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.methods.protocol import BEST_OF, PPO_FRACTION
from rlhf_core.evaluation.metrics import frontier_at


def frontier(points: Sequence[dict[str, float]], judge: str, kl: float, clamp: bool) -> float:
    """The best-of-N curve of ``judge`` at ``kl`` (``rlhf_core.evaluation.metrics.frontier_at``, the curve
    ``rlhf sweep --select frontier`` uses: linear between the n's, continued along the last segment past the last
    one, or held at its value there when ``clamp``)."""
    return frontier_at([(p["kl"], p[judge]) for p in points], kl, extrapolate=not clamp)


def mean_se(values: list[float]) -> dict[str, float]:
    """Mean, sample sd and standard error over seeds."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "se": sd / math.sqrt(len(values)), "n": len(values)}


#: The table's row of best-of-N from each seed's SFT policy (``aggregate``).
BEST_ROW = f"best-of-{BEST_OF}"
#: The key of the paired difference to the PPO target (``aggregate``).
TARGET = f"gold_minus_{PPO_FRACTION:g}x_ppo"


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: mean / sd / se over seeds of gold, held-out, KL; hacking counts; the paired gold difference to
    best-of-16 and to DPO at the same seed, and gold's and the held-out RM's difference to the seed's best-of-N curve
    at the run's KL. Every method but PPO, where PPO ran on each of its seeds: ``TARGET``, the paired difference gold -
    ``PPO_FRACTION`` x PPO's gold, and ``gold_over_ppo``, the ratio of the two gold means. Best-of-16 once per seed
    (from any method's run of that seed)."""
    ok = [r for r in rows if "failed" not in r]
    methods = list(dict.fromkeys(r["method"] for r in ok))
    best = {r["seed"]: r["best_of_16"] for r in ok}
    dpo = {r["seed"]: r["gold"] for r in ok if r["method"] == "dpo"}
    ppo = {r["seed"]: r["gold"] for r in ok if r["method"] == "ppo"}
    table: dict[str, Any] = {}
    for method in methods:
        group = [r for r in ok if r["method"] == method]
        entry = {key: mean_se([r[key] for r in group]) for key in ("gold", "heldout", "proxy", "kl", "length")}
        entry["hacking_gold"] = sum(r["status"] == "hacking" for r in group)
        entry["hacking_heldout"] = sum(r["heldout_status"] == "hacking" for r in group)
        entry["gold_minus_best_of_16"] = mean_se([r["gold"] - best[r["seed"]]["gold"] for r in group])
        for judge in ("gold", "heldout"):
            entry[f"{judge}_minus_best_of_n_at_kl"] = mean_se([r["minus_best_of_n_at_kl"][judge] for r in group])
        if method != "dpo" and all(r["seed"] in dpo for r in group):
            entry["gold_minus_dpo"] = mean_se([r["gold"] - dpo[r["seed"]] for r in group])
        if method != "ppo" and all(r["seed"] in ppo for r in group):
            entry[TARGET] = mean_se([r["gold"] - PPO_FRACTION * ppo[r["seed"]] for r in group])
            entry["gold_over_ppo"] = entry["gold"]["mean"] / statistics.fmean(ppo[r["seed"]] for r in group)
        table[method] = entry
    table[BEST_ROW] = {key: mean_se([b[key] for b in best.values()]) for key in ("gold", "heldout", "kl")}
    return table


def markdown(table: dict[str, Any]) -> str:
    """``aggregate``'s table as the Markdown table docs/results.md shows: mean over seeds (standard error) per method,
    the paired differences, and the hacking counts; a dash where a column does not apply."""
    def cell(entry: dict[str, Any], key: str, signed: bool = True, se: bool = True) -> str:
        if key not in entry:
            return "-"
        value = entry[key]
        number = f"{value['mean']:+.3f}" if signed else f"{value['mean']:.3f}"
        return f"{number} ({value['se']:.3f})" if se else number

    lines = [f"| method | final gold | held-out RM | KL | gold - {BEST_ROW} | gold - DPO | "
             f"gold - {PPO_FRACTION:g} x PPO (gold / PPO's) | gold - best-of-N at own KL | "
             f"held-out - best-of-N at own KL | hacking flagged (held-out / gold) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for method, entry in table.items():
        if method == BEST_ROW:
            continue
        n = entry["gold"]["n"]
        target = "-" if TARGET not in entry else f"{cell(entry, TARGET)}, {entry['gold_over_ppo']:.2f}"
        lines.append(f"| {method} | {cell(entry, 'gold', False)} | {cell(entry, 'heldout', False, False)} | "
                     f"{entry['kl']['mean']:.2f} ({entry['kl']['se']:.2f}) | {cell(entry, 'gold_minus_best_of_16')} | "
                     f"{cell(entry, 'gold_minus_dpo')} | {target} | {cell(entry, 'gold_minus_best_of_n_at_kl')} | "
                     f"{cell(entry, 'heldout_minus_best_of_n_at_kl')} | "
                     f"{entry['hacking_heldout']} / {entry['hacking_gold']} of {n} |")
    if BEST_ROW in table:
        best = table[BEST_ROW]
        lines.append(f"| {BEST_ROW} from SFT | {cell(best, 'gold', False)} | {cell(best, 'heldout', False, False)} | "
                     f"{best['kl']['mean']:.2f} | - | - | - | - | - | - |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Gold against KL to the SFT policy, one marker per run; best-of-16 per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [r for r in rows if "failed" not in r]
    for method in dict.fromkeys(r["method"] for r in ok):
        group = [r for r in ok if r["method"] == method]
        ax.scatter([r["kl"] for r in group], [r["gold"] for r in group], label=method, s=40)
    best = {r["seed"]: r["best_of_16"] for r in ok}
    ax.scatter([b["kl"] for b in best.values()], [b["gold"] for b in best.values()], label=BEST_ROW,
               marker="x", s=60, color="black")
    ax.set_xlabel("KL to the SFT policy (nats per reply)")
    ax.set_ylabel("gold score of the final policy")
    ax.set_title("Methods on the demo task, report seeds: gold vs KL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pool(paths: Sequence[Path]) -> dict[str, Any]:
    """The runs of several saved reports of the same settings on disjoint seeds (``report``'s files, or ``join``'s:
    a seed's methods reported in parts), and their table recomputed over all of them. Raises ``ValueError`` (one line
    naming the file) when a report is not a report, ran other settings, a preset or evaluation size of its own (by the
    names of the overrides, and by each run's resolved settings where its row records them: a preset may change
    between reports), or repeats a method's seed."""
    reports = _read_reports(paths, "pool", ("preset", "eval", "methods"), "the same settings", ("report", "join"))
    first = reports[0][1]
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[str, int], Path] = {}
    for path, payload in reports:
        for row in payload["runs"]:
            if (row["method"], row["seed"]) in seen:
                raise ValueError(f"{path}: {row['method']} seed {row['seed']} is also in "
                                 f"{seen[row['method'], row['seed']]}; pooled reports must not share a seed")
            seen[row["method"], row["seed"]] = path
            rows.append(row)
    for method in dict.fromkeys(r["method"] for r in rows):
        settings = {r["settings"]: r for r in rows if r["method"] == method and "settings" in r}
        if len(settings) > 1:
            a, b = list(settings.values())[:2]
            raise ValueError(f"{seen[method, b['seed']]}: {method} seed {b['seed']} ran other resolved settings than "
                             f"seed {a['seed']} in {seen[method, a['seed']]}; only reports of the same settings pool")
    return {"preset": first["preset"], "methods": first["methods"], "eval": first["eval"],
            "seeds": ",".join(str(s) for s in sorted({r["seed"] for r in rows})),
            "pooled_from": [{"file": str(path), "seeds": payload["seeds"]} for path, payload in reports],
            "runs": rows, "table": aggregate(rows)}


def join(paths: Sequence[Path]) -> dict[str, Any]:
    """The runs of several saved reports of different methods on the same seeds (methods reported at different times,
    into one state folder or into state folders whose seeds' shared stages came out the same), and one table over all
    of them, paired per seed. Raises ``ValueError`` (one line naming the file) when a report is not a report, ran
    another preset, evaluation size or seed set, repeats a method, or has another best-of-16 at a seed (not the same
    SFT policy, reward models and prompts: the rows would not pair)."""
    reports = _read_reports(paths, "join", ("preset", "eval", "seeds"), "the same seeds and evaluation")
    first = reports[0][1]
    rows: list[dict[str, Any]] = []
    methods: dict[str, Any] = {}
    owner: dict[str, Path] = {}
    best: dict[int, tuple[Path, dict[str, Any]]] = {}
    for path, payload in reports:
        for method, overrides in payload["methods"].items():
            if method in owner:
                raise ValueError(f"{path}: {method} is also in {owner[method]}; join takes each method once")
            owner[method], methods[method] = path, overrides
        for row in payload["runs"]:
            if "failed" not in row:
                seen_path, seen_best = best.setdefault(row["seed"], (path, row["best_of_16"]))
                if row["best_of_16"] != seen_best:
                    raise ValueError(f"{path}: seed {row['seed']}'s best-of-16 differs from {seen_path}'s; its runs "
                                     f"did not share a state folder's SFT policy, reward models and prompts")
            rows.append(row)
    return {"preset": first["preset"], "methods": methods, "eval": first["eval"], "seeds": first["seeds"],
            "joined_from": [{"file": str(path), "methods": list(payload["methods"])} for path, payload in reports],
            "runs": rows, "table": aggregate(rows)}


def _read_reports(paths: Sequence[Path], phase: str, same: tuple[str, ...], what: str,
                  phases: tuple[str, ...] = ("report",)) -> list[tuple[Path, dict[str, Any]]]:
    """Two or more saved methods reports (the files of the ``phases``) that agree on the ``same`` keys, read;
    ``ValueError`` (one line naming the file) otherwise."""
    if len(paths) < 2:
        raise ValueError(f"{phase} needs two or more report files")
    reports: list[tuple[Path, dict[str, Any]]] = []
    for path in paths:
        try:
            payload = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: not a readable report ({error})") from None
        if payload.get("phase") not in phases or "runs" not in payload:
            raise ValueError(f"{path}: not a methods report (phase {payload.get('phase')!r})")
        first_path, first = reports[0] if reports else (path, payload)
        for key in same:
            if payload.get(key) != first.get(key):
                raise ValueError(f"{path}: its {key} {payload.get(key)!r} differs from {first_path}'s "
                                 f"{first.get(key)!r}; only reports of {what} {phase}")
        reports.append((path, payload))
    return reports
