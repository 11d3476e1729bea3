"""The run summary: SFT policy vs final policy on every scorer, as ``summary.json`` and a printed table, with the
lineage of the run (which artifact each stage used, which model versions it registered)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tasks import heldout_eval, rm_refresh

if TYPE_CHECKING:
    from tasks.config import PipelineConfig
    from tasks.run_store import Artifact, RunRecord


@dataclass
class Outcome:
    """The artifacts one pass of the pipeline used, in order."""

    data: Artifact
    sft: Artifact
    reward_model: Artifact
    best_of_n: Artifact
    ppo: list[Artifact] = field(default_factory=list)
    evals: list[Artifact] = field(default_factory=list)
    refreshes: list[Artifact] = field(default_factory=list)
    dpo: Artifact | None = None
    """The dpo stage's artifact (``method: dpo``; its evaluation is ``evals[0]``)."""


#: summary key -> (metric of the final policy, metric of the reference = SFT policy)
SCORES = {
    "proxy": ("eval/proxy/mean", "eval/reference/proxy/mean"),
    "heldout": ("eval/heldout/mean", "eval/reference/heldout/mean"),
    "gold": ("eval/gold/mean", "eval/reference/gold/mean"),
    "kl": ("eval/kl/mean", None),
    "length": ("eval/length/mean", "eval/reference/length/mean"),
}


def _policy_row(metrics: dict[str, float], which: int) -> dict[str, float | None]:
    row: dict[str, float | None] = {}
    for name, keys in SCORES.items():
        key = keys[which]
        row[name] = 0.0 if key is None else metrics.get(key)
    return row


def build_summary(config: PipelineConfig, outcome: Outcome, record: RunRecord) -> dict[str, Any]:
    """``{"policies": {"sft": {...}, "final": {...}}, "status", "iterations", "models", "artifacts", ...}``."""
    evals = [heldout_eval.STAGE.result(a) for a in outcome.evals]
    last = evals[-1]
    models = {label: dict(entry.models) for label, entry in record.stages.items() if entry.models}
    refreshes = []
    for artifact in outcome.refreshes:
        result = rm_refresh.STAGE.result(artifact)
        label = f"rm-refresh-{result.iteration}"
        refreshes.append({"iteration": result.iteration, "promoted": result.promoted, "reason": result.reason,
                          "reward_model_uri": models.get(label, {}).get("reward_model"), **result.metrics})
    return {
        "name": config.name,
        "seed": config.seed,
        "method": config.method,
        "policies": {"sft": _policy_row(last.metrics, 1), "final": _policy_row(last.metrics, 0)},
        "status": last.status,
        "reasons": list(last.reasons),
        "promoted": bool(last.promote),
        "heldout_status": last.heldout_status,
        "iterations": [{"iteration": e.iteration, "status": e.status, "heldout_status": e.heldout_status, **e.metrics}
                       for e in evals],
        "best_of_n": [dict(point) for point in outcome.best_of_n.result["points"]],
        "refreshes": refreshes,
        "reward_model": dict(outcome.reward_model.result["metrics"]),
        "sft": dict(outcome.sft.result["metrics"]),
        **({"dpo": dict(outcome.dpo.result["metrics"])} if outcome.dpo is not None else {}),
        "data": dict(outcome.data.result["metrics"]),
        "models": models,
        "artifacts": {label: {"artifact": f"{entry.stage}/{entry.key}", "cached_from": entry.cached_from}
                      for label, entry in record.stages.items()},
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The table the CLI prints: one row per policy, one column per scorer."""
    columns = list(SCORES)
    lines = [f"{'policy':<8}" + "".join(f"{c:>10}" for c in columns)]
    for name, row in summary["policies"].items():
        cells = "".join(f"{row[c]:>10.3f}" if row.get(c) is not None else f"{'-':>10}" for c in columns)
        lines.append(f"{name:<8}{cells}")
    if summary.get("dpo"):
        lines.append(dpo_line(summary["dpo"]))
    lines += [refresh_line(r) for r in summary.get("refreshes", [])]
    lines.append(f"status: {summary['status']}" + (f" ({'; '.join(summary['reasons'])})" if summary["reasons"] else ""))
    cached = [label for label, a in summary.get("artifacts", {}).items() if a.get("cached_from")]
    if cached:
        lines.append(f"reused from earlier runs: {', '.join(cached)}")
    lines.append(f"run {summary.get('run_id', '?')} in {summary.get('seconds', 0.0):.0f}s; "
                 f"final policy promoted to champion: {summary['promoted']}")
    return "\n".join(lines)


def refresh_line(refresh: dict[str, Any]) -> str:
    """``rm-refresh after iteration k: on-policy accuracy a -> b (gold-judged c -> d), held-out e -> f, promoted``."""
    def change(name: str) -> str:
        before, after = refresh.get(f"refresh/{name}_accuracy_before"), refresh.get(f"refresh/{name}_accuracy_after")
        return f"{before:.3f} -> {after:.3f}" if before is not None and after is not None else "-"

    gold = f" (gold-judged {change('onpolicy_gold')})" if "refresh/onpolicy_gold_accuracy_after" in refresh else ""
    return (f"rm-refresh after iteration {refresh.get('iteration', '?')}: on-policy accuracy {change('onpolicy')}{gold}, "
            f"held-out {change('heldout')}, {'promoted' if refresh['promoted'] else 'not promoted'}")


def dpo_line(metrics: dict[str, float]) -> str:
    """``final policy: dpo, N steps; implicit-reward accuracy on held-out pairs a -> b, on training pairs c``."""
    def value(key: str) -> str:
        return f"{metrics[key]:.3f}" if key in metrics else "-"

    return (f"final policy: dpo, {int(metrics.get('dpo/steps', 0))} steps; implicit-reward accuracy on held-out pairs "
            f"{value('dpo/eval_initial/rewards/accuracy')} -> {value('dpo/eval/rewards/accuracy')}, on training pairs "
            f"{value('dpo/train_eval/rewards/accuracy')}")


def running_markdown(run_id: str, preset: str | None, changes: dict[str, str]) -> str:
    """The parent run's description while it runs."""
    return f"**rlhf run {run_id}** (running)\n\n" + _changes_markdown(preset, changes)


def _changes_markdown(preset: str | None, changes: dict[str, str]) -> str:
    base = f"preset `{preset}`" if preset else "the code defaults"
    if not changes:
        return f"Config: {base}, unchanged.\n"
    return f"Config: {base}, with " + ", ".join(f"`{k}={v}`" for k, v in changes.items()) + ".\n"


def summary_markdown(summary: dict[str, Any]) -> str:
    """The summary for people: the MLflow parent run's description and the Prefect flow run's artifact."""
    columns = list(SCORES)
    lines = [f"**rlhf run {summary.get('run_id', '?')}**: {summary['status']}"
             + (f" ({'; '.join(summary['reasons'])})" if summary["reasons"] else ""), "",
             _changes_markdown(summary.get("preset"), summary.get("changed") or {}), "",
             "| policy | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, row in summary["policies"].items():
        cells = [f"{row[c]:.3f}" if row.get(c) is not None else "-" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    if summary.get("dpo"):
        lines.append(f"- {dpo_line(summary['dpo'])}")
    lines += [f"- {refresh_line(r)}" for r in summary.get("refreshes", [])]
    lines.append(f"- final policy promoted to champion: {summary['promoted']}")
    cached = {label: a["cached_from"] for label, a in summary.get("artifacts", {}).items() if a.get("cached_from")}
    if cached:
        lines.append("- reused from earlier runs: " + ", ".join(f"{label} (run {run})"
                                                                 for label, run in cached.items()))
    if summary.get("mlflow_url"):
        lines.append(f"- MLflow: [{summary['mlflow_run_id']}]({summary['mlflow_url']})")
    elif summary.get("mlflow_run_id"):
        lines.append(f"- MLflow parent run: {summary['mlflow_run_id']}")
    lines.append(f"- {summary.get('seconds', 0.0):.0f}s")
    return "\n".join(lines) + "\n"
