"""Figures for the run reports: training curves, score and length histograms, the over-optimisation plot.

Every function builds a ``matplotlib.figure.Figure`` on the Agg canvas directly (no pyplot, so no global
figure registry to leak and no GUI backend), labels its axes, titles and legends it, and returns it.
:func:`save_figure` writes a PNG atomically. Nothing here talks to MLflow: the caller logs the files.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: Inches per subplot row / figure width.
_ROW_HEIGHT, _WIDTH = 2.6, 7.0


def _new_figure(rows: int = 1, height: float | None = None) -> tuple[Figure, list]:
    """A figure on an Agg canvas with ``rows`` stacked axes."""
    fig = Figure(figsize=(_WIDTH, height or max(3.5, _ROW_HEIGHT * rows)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    return fig, list(axes)


def training_curves(
    history: Sequence[Mapping[str, float]],
    keys: Sequence[str],
    step_key: str = "step",
    title: str = "Training curves",
) -> Figure:
    """One subplot per metric key, value against step.

    ``history`` holds one dict of metrics per logged step (e.g. ``PPOStats.to_metrics()`` plus ``"step"``);
    x is ``row[step_key]`` when present, else the row index. Rows that lack a key are skipped for that key.
    """
    if not keys:
        raise ValueError("training_curves needs at least one metric key, e.g. 'ppo/scores/mean'")
    available = sorted({k for row in history for k in row})
    missing = [k for k in keys if k not in available]
    if missing:
        raise ValueError(f"training_curves: no step logged {missing}; logged keys are {available}")
    fig, axes = _new_figure(len(keys))
    for ax, key in zip(axes, keys):
        points = [(row.get(step_key, i), row[key]) for i, row in enumerate(history) if key in row]
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=key)
        ax.set_title(key)
        ax.set_xlabel(step_key if any(step_key in row for row in history) else "logged step")
        ax.set_ylabel(key.rsplit("/", 1)[-1])
        ax.legend(loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return fig


def _overlaid_histograms(
    named_values: Mapping[str, Sequence[float]], title: str, xlabel: str, integer_bins: bool
) -> Figure:
    """One axes, one semi-transparent histogram per name on shared bins, legend with n and mean."""
    if not named_values:
        raise ValueError(f"{title!r}: nothing to plot; pass at least one named series")
    arrays = {name: np.asarray(values, dtype=float).reshape(-1) for name, values in named_values.items()}
    empty = [name for name, arr in arrays.items() if arr.size == 0]
    if empty:
        raise ValueError(f"{title!r}: series {empty} hold no values; drop them or evaluate some replies")
    pooled = np.concatenate(list(arrays.values()))
    lo, hi = float(pooled.min()), float(pooled.max())
    if integer_bins:
        bins = np.arange(math.floor(lo), math.floor(hi) + 2) - 0.5
        if len(bins) > 61:  # wide length ranges: group integers so bars stay visible
            bins = np.linspace(lo - 0.5, hi + 0.5, 61)
    else:
        bins = np.histogram_bin_edges(pooled, bins=30, range=(lo, hi) if hi > lo else (lo - 0.5, lo + 0.5))
    fig, (ax,) = _new_figure(1)
    for name, arr in arrays.items():
        ax.hist(arr, bins=bins, alpha=0.5, label=f"{name} (n={arr.size}, mean={arr.mean():.3g})")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    ax.legend(loc="best")
    return fig


def score_histograms(
    named_scores: Mapping[str, Sequence[float]], title: str = "Score distribution", xlabel: str = "score"
) -> Figure:
    """Overlaid histograms of several score sets on shared bins, e.g. ``{"sft": gold, "ppo": gold}``."""
    return _overlaid_histograms(named_scores, title, xlabel, integer_bins=False)


def length_distribution(
    named_lengths: Mapping[str, Sequence[int]], title: str = "Response length"
) -> Figure:
    """Overlaid histograms of response lengths (tokens), one bar per length while the range is small."""
    return _overlaid_histograms(named_lengths, title, "response length (tokens)", integer_bins=True)


@dataclass(frozen=True, kw_only=True)
class PolicyPoint:
    """One policy checkpoint on the over-optimisation plot."""

    kl: float
    """Mean per-sequence KL(policy || reference), nats."""
    proxy: float
    """Mean score from the reward model PPO optimised."""
    heldout: float
    """Mean score from the held-out reward model."""
    gold: float | None = None
    """Mean gold score, when the task has a gold scorer."""
    label: str = ""
    """Annotation next to the point, e.g. ``"it 3"``."""
    rm_generation: int = 0
    """Which proxy RM scored ``proxy``: 0 = the first, k = after the k-th promoted refresh. Proxy scores of
    different reward models are on different scales, so each generation gets its own proxy line."""


def overoptimisation_curve(
    points: Sequence[PolicyPoint],
    best_of_n: Sequence[tuple[float, float]] | None = None,
    title: str = "Reward over-optimisation",
    best_of_n_judge: str = "gold",
    best_of_n_proxy: Sequence[tuple[float, float]] | None = None,
) -> Figure:
    """Scores against KL to the reference (Gao et al. 2022), one line per judge.

    x is KL in nats, not sqrt(KL) as in the paper: the PPO KL budget and ``best_of_n_kl`` are stated in
    nats, so the reader can compare them directly. Points are joined in the given (training) order.
    Lines: proxy RM, held-out RM, gold (when every point has gold), and the optional best-of-N baseline
    ``[(kl, gold), ...]`` (its KL from ``rlhf_core.evaluation.metrics.best_of_n_kl``). Proxy up while held-out or
    gold bends down is the signature of reward hacking. After a reward-model refresh the proxy line breaks:
    points of each :attr:`PolicyPoint.rm_generation` form their own dashed-on proxy line (labelled "proxy RM
    after refresh k"), while held-out and gold, judged by the same models throughout, stay one line. ``best_of_n_judge`` names the judge of the
    ``best_of_n`` series in the legend ('held-out RM' when the task has no gold); ``best_of_n_proxy`` adds the
    best-of-N proxy scores ``[(kl, proxy), ...]`` as a dashed line in the proxy line's colour.
    """
    if not points and not best_of_n and not best_of_n_proxy:
        raise ValueError("overoptimisation_curve needs policy points or a best-of-N series")
    fig, (ax,) = _new_figure(1, height=4.5)
    if points:
        kls = [p.kl for p in points]
        for generation in sorted({p.rm_generation for p in points}):
            same = [p for p in points if p.rm_generation == generation]
            name = "proxy RM (optimised)" if generation == 0 else f"proxy RM after refresh {generation}"
            ax.plot([p.kl for p in same], [p.proxy for p in same], marker="o", color="C0",
                    linestyle="-" if generation == 0 else (0, (4, 1 + generation)), label=name)
        ax.plot(kls, [p.heldout for p in points], marker="s", label="held-out RM")
        if all(p.gold is not None for p in points):
            ax.plot(kls, [p.gold for p in points], marker="^", color="black", label="gold")
        for p in points:
            if p.label:
                ax.annotate(p.label, (p.kl, p.proxy), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if best_of_n:
        bon_kl, bon_gold = zip(*sorted(best_of_n))
        ax.plot(bon_kl, bon_gold, linestyle="--", marker="x", color="gray", label=f"best-of-N ({best_of_n_judge})")
    if best_of_n_proxy:
        bon_kl, bon_proxy = zip(*sorted(best_of_n_proxy))
        ax.plot(bon_kl, bon_proxy, linestyle="--", marker="x", color="C0", label="best-of-N (proxy RM)")
    ax.set_title(title)
    ax.set_xlabel("KL(policy || reference), nats per reply")
    ax.set_ylabel("mean score")
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    return fig


def loss_curve(
    steps: Sequence[float],
    train_losses: Sequence[float],
    eval_steps: Sequence[float] | None = None,
    eval_losses: Sequence[float] | None = None,
    title: str = "Loss",
) -> Figure:
    """Training loss per step, with evaluation losses as a second marked line when given."""
    if len(steps) != len(train_losses):
        raise ValueError(f"loss_curve: {len(steps)} steps but {len(train_losses)} train losses")
    n_eval = 0 if eval_steps is None else len(eval_steps)
    if (eval_steps is None) != (eval_losses is None) or n_eval != (0 if eval_losses is None else len(eval_losses)):
        raise ValueError("loss_curve: pass eval_steps and eval_losses together, equally long")
    fig, (ax,) = _new_figure(1)
    ax.plot(steps, train_losses, label="train")
    if n_eval:
        ax.plot(eval_steps, eval_losses, marker="o", label="eval")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    return fig


def sweep_frontier(settings: Sequence[Mapping[str, object]], best_of_n: Sequence[Mapping[str, object]],
                   title: str = "Sweep: score against KL") -> Figure:
    """One panel per judge (held-out RM, and gold where present): each setting's final policy (mean over seeds, with
    the seeds' sd as error bars) against its KL to the SFT policy, beside the best-of-N curve of the same seeds.

    ``settings``: rows with ``setting`` and ``(mean, sd)`` or None under ``kl``, ``heldout``, ``gold``;
    ``best_of_n``: points with ``n``, ``kl`` and ``(mean, sd)`` or None per judge.
    """
    judges = [j for j in ("heldout", "gold") if any(row.get(j) is not None for row in settings)]
    fig, axes = _new_figure(len(judges) or 1)
    for ax, judge in zip(axes, judges or ["heldout"]):
        curve = [(p["kl"], p[judge][0]) for p in best_of_n if p.get(judge) is not None]
        if curve:
            ax.plot([x for x, _ in curve], [y for _, y in curve], color="grey", marker="x", linestyle="--",
                    label="best-of-N from SFT")
            for point, (x, y) in zip((p for p in best_of_n if p.get(judge) is not None), curve):
                ax.annotate(f"N={point['n']}", (x, y), textcoords="offset points", xytext=(3, -10), fontsize=7,
                            color="grey")
        for i, row in enumerate(settings):
            score, kl = row.get(judge), row.get("kl")
            if score is None or kl is None:
                continue
            ax.errorbar(kl[0], score[0], xerr=kl[1], yerr=score[1], marker="o", capsize=3, color=f"C{i % 10}",
                        label=str(row["setting"]))
        ax.set_xlabel("KL to the SFT policy (nats per reply)")
        ax.set_ylabel(f"{'held-out RM' if judge == 'heldout' else 'gold'} score of the final policy")
        ax.grid(alpha=0.3)
    axes[0].set_title(title)
    axes[0].legend(fontsize=7, loc="best")
    return fig


def save_figure(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` as a PNG at ``path`` atomically (temp file in the same folder, then rename), then close it.

    Readers never see a half-written file. Closing drops the figure from pyplot's registry when pyplot made
    it; figures from this module are not registered and are freed once unreferenced.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            fig.savefig(handle, format="png", dpi=100)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        pyplot = sys.modules.get("matplotlib.pyplot")  # only close via pyplot if someone already loaded it
        if pyplot is not None:
            pyplot.close(fig)
    return target
