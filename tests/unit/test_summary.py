"""The summary table the CLI prints."""

from flows.summary import format_summary


def test_format_summary_rows_and_missing_values():
    summary = {
        "policies": {"sft": {"proxy": 1.0, "heldout": 0.5, "gold": None, "kl": 0.0, "length": 30.0},
                     "final": {"proxy": 2.25, "heldout": 0.75, "gold": None, "kl": 4.5, "length": 31.0}},
        "status": "warn", "reasons": ["KL 12.0 is over the budget 10.0"], "promoted": False,
        "run_id": "r1", "seconds": 12.3,
    }
    lines = format_summary(summary).splitlines()
    assert lines[0].split() == ["policy", "proxy", "heldout", "gold", "kl", "length"]
    assert lines[1].split() == ["sft", "1.000", "0.500", "-", "0.000", "30.000"]
    assert lines[2].split() == ["final", "2.250", "0.750", "-", "4.500", "31.000"]
    assert lines[3] == "status: warn (KL 12.0 is over the budget 10.0)"
    assert "promoted to champion: False" in lines[4]


def test_format_summary_has_a_line_per_refresh():
    refresh = {"iteration": 2, "promoted": False, "refresh/onpolicy_accuracy_before": 0.5,
               "refresh/onpolicy_accuracy_after": 0.625, "refresh/heldout_accuracy_before": 0.75,
               "refresh/heldout_accuracy_after": 0.7, "refresh/onpolicy_gold_accuracy_before": 0.6,
               "refresh/onpolicy_gold_accuracy_after": 0.65}
    summary = {"policies": {}, "status": "ok", "reasons": [], "promoted": True, "refreshes": [refresh]}
    line = format_summary(summary).splitlines()[1]
    assert line == ("rm-refresh after iteration 2: on-policy accuracy 0.500 -> 0.625 (gold-judged 0.600 -> 0.650), "
                    "held-out 0.750 -> 0.700, not promoted")
