"""benchmarks/methods/frontier.py's summary of runs against the measured best-of-N curve, on hand-made rows."""

from __future__ import annotations

import pytest

from benchmarks.methods.frontier import main, summarise


def test_runs_past_the_last_point_are_counted_apart_not_extrapolated():
    rows = [{"method": "ppo", "inside": True, "gap": -0.5}, {"method": "ppo", "inside": True, "gap": 0.1},
            {"method": "ppo", "inside": False, "gap": None}, {"method": "dpo", "inside": True, "gap": -0.2}]
    summary = summarise(rows)
    assert summary["ppo"] == {"runs": 3, "inside": 2, "below": 1, "mean_gap": pytest.approx(-0.2),
                              "sd_gap": pytest.approx(0.6 / 2 ** 0.5), "past_last_point": 1}
    assert summary["dpo"]["mean_gap"] == pytest.approx(-0.2) and summary["dpo"]["sd_gap"] is None


def test_n_max_must_be_a_power_of_two(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--state", str(tmp_path), "--n-max", "48"])
    assert "--n-max must be a power of 2, got 48" in capsys.readouterr().err
