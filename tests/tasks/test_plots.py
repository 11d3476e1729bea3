"""Report figures: the right number of axes, lines and labels; PNGs written atomically."""

import numpy as np
import pytest
from matplotlib.figure import Figure

from tasks.plots import (
    PolicyPoint,
    length_distribution,
    loss_curve,
    overoptimisation_curve,
    save_figure,
    score_histograms,
    training_curves,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

HISTORY = [
    {"step": 0, "ppo/scores/mean": 0.1, "ppo/kl/mean": 0.0, "ppo/kl/coef": 0.05},
    {"step": 1, "ppo/scores/mean": 0.4, "ppo/kl/mean": 0.8, "ppo/kl/coef": 0.06},
    {"step": 2, "ppo/scores/mean": 0.7, "ppo/kl/mean": 1.5},  # coef missing on this step
]


def legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_training_curves_one_subplot_per_key():
    keys = ["ppo/scores/mean", "ppo/kl/mean", "ppo/kl/coef"]
    fig = training_curves(HISTORY, keys)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 3
    for ax, key in zip(fig.axes, keys):
        assert ax.get_title() == key
        assert ax.get_xlabel() == "step"
        assert len(ax.get_lines()) == 1
        assert legend_texts(ax) == [key]
    xs, ys = fig.axes[1].get_lines()[0].get_data()
    assert list(xs) == [0, 1, 2] and list(ys) == [0.0, 0.8, 1.5]
    # the step without a coefficient is skipped, not plotted as zero
    xs, ys = fig.axes[2].get_lines()[0].get_data()
    assert list(xs) == [0, 1] and list(ys) == [0.05, 0.06]


def test_training_curves_names_a_missing_key():
    with pytest.raises(ValueError, match="ppo/value/loss"):
        training_curves(HISTORY, ["ppo/value/loss"])


def test_score_histograms_overlay_one_bar_set_per_series():
    fig = score_histograms({"sft": [0.0, 1.0, 1.0, 2.0], "ppo": [1.0, 2.0, 3.0]}, title="Gold scores")
    [ax] = fig.axes
    assert len(ax.containers) == 2
    # shared bins: both bar sets have the same left edges
    lefts = [[bar.get_x() for bar in container] for container in ax.containers]
    assert lefts[0] == lefts[1]
    assert sum(bar.get_height() for bar in ax.containers[0]) == 4
    assert legend_texts(ax) == ["sft (n=4, mean=1)", "ppo (n=3, mean=2)"]
    assert ax.get_title() == "Gold scores"
    assert ax.get_xlabel() == "score" and ax.get_ylabel() == "count"


def test_score_histograms_reject_an_empty_series():
    with pytest.raises(ValueError, match="ppo"):
        score_histograms({"sft": [1.0], "ppo": []})


def test_length_distribution_has_one_bar_per_integer_length():
    fig = length_distribution({"sft": [3, 4, 4, 6], "ppo": [5, 6, 6, 6]})
    [ax] = fig.axes
    assert len(ax.containers) == 2
    assert len(ax.containers[0]) == 4  # lengths 3, 4, 5, 6
    heights = [bar.get_height() for bar in ax.containers[1]]
    assert heights == [0, 0, 1, 3]
    assert ax.get_xlabel() == "response length (tokens)"
    assert len(legend_texts(ax)) == 2


def test_overoptimisation_curve_lines_and_axis():
    points = [
        PolicyPoint(kl=0.0, proxy=0.0, heldout=0.0, gold=1.0, label="sft"),
        PolicyPoint(kl=2.0, proxy=1.0, heldout=0.5, gold=1.4, label="it 1"),
        PolicyPoint(kl=6.0, proxy=2.0, heldout=0.2, gold=1.1, label="it 2"),
    ]
    fig = overoptimisation_curve(points, best_of_n=[(1.19, 1.3), (0.0, 1.0)])
    [ax] = fig.axes
    assert len(ax.get_lines()) == 4
    assert legend_texts(ax) == ["proxy RM (optimised)", "held-out RM", "gold", "best-of-N (gold)"]
    assert "KL" in ax.get_xlabel() and "nats" in ax.get_xlabel()
    assert list(ax.get_lines()[2].get_ydata()) == [1.0, 1.4, 1.1]
    assert list(ax.get_lines()[3].get_xdata()) == [0.0, 1.19]  # sorted by KL
    assert [t.get_text() for t in ax.texts] == ["sft", "it 1", "it 2"]


def test_overoptimisation_curve_breaks_the_proxy_line_at_a_reward_model_refresh():
    points = [
        PolicyPoint(kl=0.0, proxy=0.5, heldout=0.0, gold=1.0, label="ref", rm_generation=1),
        PolicyPoint(kl=2.0, proxy=1.0, heldout=0.5, gold=1.4, label="it 1"),
        PolicyPoint(kl=4.0, proxy=2.0, heldout=0.6, gold=1.5, label="it 2"),
        PolicyPoint(kl=5.0, proxy=0.9, heldout=0.7, gold=1.7, label="it 3", rm_generation=1),
    ]
    [ax] = overoptimisation_curve(points).axes
    assert legend_texts(ax) == ["proxy RM (optimised)", "proxy RM after refresh 1", "held-out RM", "gold"]
    first, second, heldout, gold = ax.get_lines()
    assert list(first.get_xdata()) == [2.0, 4.0] and list(second.get_ydata()) == [0.5, 0.9]
    assert list(heldout.get_xdata()) == [0.0, 2.0, 4.0, 5.0]  # judged by one model throughout: one line
    assert list(gold.get_ydata()) == [1.0, 1.4, 1.5, 1.7]


def test_overoptimisation_curve_without_gold_has_two_lines():
    points = [PolicyPoint(kl=0.0, proxy=0.0, heldout=0.0), PolicyPoint(kl=1.0, proxy=1.0, heldout=0.6)]
    [ax] = overoptimisation_curve(points).axes
    assert len(ax.get_lines()) == 2
    assert "gold" not in legend_texts(ax)


def test_loss_curve_train_and_eval():
    fig = loss_curve([1, 2, 3, 4], [2.0, 1.5, 1.2, 1.0], eval_steps=[0, 4], eval_losses=[2.2, 1.1], title="SFT")
    [ax] = fig.axes
    assert len(ax.get_lines()) == 2
    assert legend_texts(ax) == ["train", "eval"]
    assert ax.get_title() == "SFT" and ax.get_xlabel() == "step" and ax.get_ylabel() == "loss"
    assert len(loss_curve(np.arange(3), np.ones(3)).axes[0].get_lines()) == 1
    with pytest.raises(ValueError, match="together"):
        loss_curve([1], [1.0], eval_steps=[1])


def test_save_figure_writes_png_atomically(tmp_path):
    fig = loss_curve([1, 2], [1.0, 0.5])
    target = tmp_path / "plots" / "loss.png"
    assert save_figure(fig, target) == target
    data = target.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert [p.name for p in target.parent.iterdir()] == ["loss.png"]  # no temp file left behind


def test_save_figure_closes_pyplot_figures(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    fig.add_subplot().plot([0, 1], [1, 0])
    save_figure(fig, tmp_path / "p.png")
    assert fig.number not in plt.get_fignums()


def test_save_figure_removes_the_temp_file_on_failure(tmp_path):
    fig = loss_curve([1, 2], [1.0, 0.5])

    def broken_savefig(*args, **kwargs):
        raise RuntimeError("disk full")

    fig.savefig = broken_savefig
    with pytest.raises(RuntimeError, match="disk full"):
        save_figure(fig, tmp_path / "loss.png")
    assert list(tmp_path.iterdir()) == []
