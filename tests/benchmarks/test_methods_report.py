"""The methods report's rows and table from runs' summaries: each run against its seed's best-of-N curve at the run's
own KL, and the paired differences over seeds, checked against numbers worked by hand."""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Sequence
from pathlib import Path

import pytest

from benchmarks.methods.protocol import KL_BUDGET
from benchmarks.methods.run import _run_row
from benchmarks.methods.tables import aggregate, markdown

#: One seed's best-of-N points (n, KL, gold, held-out): best-of-16's KL rounded to 1.84 so the slopes are easy.
BEST_OF_N = [(1, 0.0, 0.3, 0.1), (8, 1.2, 1.8, 0.5), (16, 1.84, 2.0, 0.6)]


def _summary(state: Path, run_id: str, *, gold: float, heldout: float, kl: float,
             kl_coef: float = 0.1) -> dict[str, object]:
    final = {"eval/gold/mean": gold, "eval/heldout/mean": heldout, "eval/proxy/mean": 1.0, "eval/kl/mean": kl,
             "eval/length/mean": 30.0, "eval/win_rate/gold": 0.6, "eval/reference/gold/mean": 0.3}
    summary = {"status": "ok", "heldout_status": "ok", "seconds": 60.0, "iterations": [final],
               "best_of_n": [{"n": n, "kl": k, "gold": g, "heldout": h, "proxy": 1.5} for n, k, g, h in BEST_OF_N]}
    folder = state / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    # each run in a state folder of its own, with its own retention: neither is a setting of what the run computes
    (folder / "config.yaml").write_text(f"name: demo\nseed: {run_id[-1]}\nstate_dir: {folder}\nppo:\n"
                                        f"  keep_resume_states: {int(run_id[-1]) + 1}\n  kl:\n    coef: {kl_coef}\n")
    return {"seed": int(run_id[-1]), "run_id": run_id, "status": "completed"}


def test_a_run_is_measured_against_best_of_n_at_its_own_kl(tmp_path: Path):
    # past best-of-16 (KL 2.48): the last segment continued, gold 2.0 + (0.2 / 0.64) x 0.64 = 2.2, held-out 0.7
    far = _run_row(tmp_path, _summary(tmp_path, "far0", gold=2.3, heldout=0.65, kl=2.48))
    assert far["minus_best_of_n_at_kl"]["gold"] == pytest.approx(0.1)
    assert far["minus_best_of_n_at_kl"]["heldout"] == pytest.approx(-0.05)
    # between n = 1 and n = 8 (KL 0.6, half-way): gold 0.3 + 1.5 / 2 = 1.05, held-out 0.1 + 0.4 / 2 = 0.3
    near = _run_row(tmp_path, _summary(tmp_path, "near1", gold=1.25, heldout=0.2, kl=0.6))
    assert near["minus_best_of_n_at_kl"]["gold"] == pytest.approx(0.2)
    assert near["minus_best_of_n_at_kl"]["heldout"] == pytest.approx(-0.1)
    assert far["best_of_16"] == {"gold": 2.0, "heldout": 0.6, "proxy": 1.5, "kl": 1.84}


def test_the_table_averages_the_matched_kl_differences_over_seeds(tmp_path: Path):
    rows = [{"method": "ppo", **_run_row(tmp_path, _summary(tmp_path, "ppo0", gold=2.3, heldout=0.65, kl=2.48))},
            # KL 1.52, half-way between n = 8 and 16: gold curve 1.9, held-out 0.55
            {"method": "ppo", **_run_row(tmp_path, _summary(tmp_path, "ppo1", gold=1.7, heldout=0.75, kl=1.52))}]
    ppo = aggregate(rows)["ppo"]
    # gold: +0.1 and -0.2, mean -0.05, sd 0.3 / sqrt(2), se 0.15; held-out: -0.05 and +0.2, mean 0.075, se 0.125
    assert ppo["gold_minus_best_of_n_at_kl"]["mean"] == pytest.approx(-0.05)
    assert ppo["gold_minus_best_of_n_at_kl"]["sd"] == pytest.approx(0.3 / math.sqrt(2))
    assert ppo["gold_minus_best_of_n_at_kl"]["se"] == pytest.approx(0.15)
    assert ppo["heldout_minus_best_of_n_at_kl"]["mean"] == pytest.approx(0.075)
    assert ppo["heldout_minus_best_of_n_at_kl"]["se"] == pytest.approx(0.125)
    # against best-of-16 itself (gold 2.0 on both seeds): +0.3 and -0.3
    assert ppo["gold_minus_best_of_16"]["mean"] == pytest.approx(0.0)
    assert ppo["gold_minus_best_of_16"]["se"] == pytest.approx(0.3)


def test_the_critic_free_target_is_paired_per_seed_with_ppo_and_shown_in_the_markdown_table(tmp_path: Path):
    rows = [{"method": method, **_run_row(tmp_path, _summary(tmp_path, f"{method}{seed}", gold=gold, heldout=0.6,
                                                               kl=1.84))}
            for method, seed, gold in [("ppo", 0, 2.0), ("ppo", 1, 1.5), ("rloo", 0, 1.9), ("rloo", 1, 1.2)]]
    table = aggregate(rows)
    # gold - 0.9 x PPO per seed: 1.9 - 1.8 = +0.1 and 1.2 - 1.35 = -0.15; mean -0.025, sd 0.25 / sqrt(2), se 0.125
    assert table["rloo"]["gold_minus_0.9x_ppo"]["mean"] == pytest.approx(-0.025)
    assert table["rloo"]["gold_minus_0.9x_ppo"]["se"] == pytest.approx(0.125)
    assert table["rloo"]["gold_over_ppo"] == pytest.approx(1.55 / 1.75)
    assert "gold_minus_0.9x_ppo" not in table["ppo"] and "gold_minus_dpo" not in table["rloo"]
    lines = markdown(table).splitlines()
    assert len(lines) == 5 and lines[0].count("|") == lines[2].count("|") == 11
    # PPO 1.75 (se 0.25), at best-of-16's KL and gold 2.0 on both seeds: -0.25 (0.25) from it; no target of its own
    assert lines[2].startswith("| ppo | 1.750 (0.250) | 0.600 | 1.84 (0.00) | -0.250 (0.250) | - | - |")
    assert lines[3].startswith("| rloo | 1.550 (0.350) | 0.600 | 1.84 (0.00) | -0.450 (0.350) | - | "
                               "-0.025 (0.125), 0.89 |")
    assert lines[3].endswith("| 0 / 0 of 2 |")
    assert lines[4] == "| best-of-16 from SFT | 2.000 (0.000) | 0.600 | 1.84 | - | - | - | - | - | - |"


def _report(path: Path, rows: list[dict[str, object]], *, seeds: str, **over: object) -> Path:
    payload = {"phase": "report", "preset": "demo", "seeds": seeds, "eval": ["eval.n_prompts=512"],
               "methods": {"ppo": []}, "runs": rows, "table": {}, **over}
    path.write_text(json.dumps(payload))
    return path


def test_pool_recomputes_the_table_over_the_seeds_of_two_reports(tmp_path: Path, capsys):
    from benchmarks.methods.run import main

    # seed 0 in one report, seed 1 in the other: the same two runs as the table test above, so the same numbers
    ppo0 = {"method": "ppo", **_run_row(tmp_path, _summary(tmp_path, "ppo0", gold=2.3, heldout=0.65, kl=2.48))}
    ppo1 = {"method": "ppo", **_run_row(tmp_path, _summary(tmp_path, "ppo1", gold=1.7, heldout=0.75, kl=1.52))}
    a = _report(tmp_path / "a.json", [ppo0], seeds="0")
    b = _report(tmp_path / "b.json", [ppo1], seeds="1")
    out = tmp_path / "pooled.json"
    main(["pool", str(a), str(b), "--out", str(out)])
    pooled = json.loads(out.read_text())
    assert pooled["seeds"] == "0,1"
    assert ppo0["settings"] == ppo1["settings"]  # the seed, the state folder and retention are not settings
    assert [p["seeds"] for p in pooled["pooled_from"]] == ["0", "1"]
    ppo = pooled["table"]["ppo"]
    assert ppo["gold"]["n"] == 2
    assert ppo["gold"]["mean"] == pytest.approx(2.0)
    assert ppo["gold_minus_best_of_n_at_kl"]["mean"] == pytest.approx(-0.05)
    assert ppo["gold_minus_best_of_n_at_kl"]["se"] == pytest.approx(0.15)
    assert ppo["gold_minus_best_of_16"]["se"] == pytest.approx(0.3)
    assert out.with_suffix(".png").is_file()
    capsys.readouterr()


@pytest.mark.parametrize("clash, message", [
    ({"seeds": "0"}, "ppo seed 0 is also in"),
    ({"seeds": "1", "eval": ["eval.n_prompts=256"]}, "its eval"),
    ({"seeds": "1", "methods": {"ppo": ["ppo.kl.coef=0.2"]}}, "its methods"),
    ({"seeds": "1", "phase": "tune"}, "not a methods report"),
    ({"seeds": "1", "kl_coef": 0.2}, "ran other resolved settings than seed 0"),
])
def test_pool_refuses_reports_that_do_not_pool_in_one_line(tmp_path: Path, capsys, clash, message):
    from benchmarks.methods.run import main

    ppo0 = {"method": "ppo", **_run_row(tmp_path, _summary(tmp_path, "ppo0", gold=2.3, heldout=0.65, kl=2.48))}
    a = _report(tmp_path / "a.json", [ppo0], seeds="0")
    # the same preset and overrides by name, but a run whose resolved settings differ (the preset changed between)
    other = _run_row(tmp_path, _summary(tmp_path, "ppo1", gold=2.3, heldout=0.65, kl=2.48,
                                        kl_coef=clash.pop("kl_coef", 0.1)))
    b = _report(tmp_path / "b.json", [ppo0 if clash["seeds"] == "0" else {"method": "ppo", **other}], **clash)
    with pytest.raises(SystemExit) as exit_info:
        main(["pool", str(a), str(b), "--out", str(tmp_path / "pooled.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and str(b) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "pooled.json").exists()


def test_pool_refuses_fewer_than_two_reports(tmp_path: Path, capsys):
    from benchmarks.methods.run import main

    with pytest.raises(SystemExit) as exit_info:
        main(["pool", str(_report(tmp_path / "a.json", [], seeds="0"))])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "run.py pool: pool needs two or more report files"


def _one_seed_reports(tmp_path: Path, dpo_best_gold: float = 2.0, **dpo_over: object) -> tuple[Path, Path]:
    """PPO's and DPO's reports of seed 0, as two `report --methods X` runs into one state folder write them."""
    ppo0 = {"method": "ppo", **_run_row(tmp_path, _summary(tmp_path, "ppo0", gold=2.3, heldout=0.65, kl=2.48))}
    dpo0 = {"method": "dpo", **_run_row(tmp_path, _summary(tmp_path, "dpo0", gold=1.9, heldout=0.5, kl=1.2))}
    dpo0["best_of_16"] = {**dpo0["best_of_16"], "gold": dpo_best_gold}
    a = _report(tmp_path / "a.json", [ppo0], seeds="0")
    b = _report(tmp_path / "b.json", [dpo0], **{"seeds": "0", "methods": {"dpo": ["method=dpo"]}, **dpo_over})
    return a, b


def test_join_pairs_the_methods_of_two_reports_on_the_same_seeds(tmp_path: Path, capsys):
    from benchmarks.methods.run import main

    a, b = _one_seed_reports(tmp_path)
    out = tmp_path / "joined.json"
    main(["join", str(a), str(b), "--out", str(out)])
    joined = json.loads(out.read_text())
    assert (joined["phase"], joined["seeds"], list(joined["methods"])) == ("join", "0", ["ppo", "dpo"])
    assert [j["methods"] for j in joined["joined_from"]] == [["ppo"], ["dpo"]]
    # PPO's gold 2.3 against DPO's 1.9 at the same seed, and both against the seed's best-of-16 (2.0)
    assert joined["table"]["ppo"]["gold_minus_dpo"]["mean"] == pytest.approx(0.4)
    assert joined["table"]["ppo"]["gold_minus_best_of_16"]["mean"] == pytest.approx(0.3)
    assert joined["table"]["dpo"]["gold_minus_best_of_16"]["mean"] == pytest.approx(-0.1)
    assert out.with_suffix(".png").is_file()
    assert out.with_suffix(".md").read_text().splitlines()[3].startswith("| dpo | 1.900 (0.000) |")
    capsys.readouterr()


def test_pool_takes_joined_reports_of_disjoint_seeds(tmp_path: Path, capsys):
    """A seed's methods reported in two parts and joined, for two seeds: the pooled table pairs each seed's PPO and
    DPO as one report of both seeds would."""
    from benchmarks.methods.run import main

    joined = []
    for seed, (ppo_gold, dpo_gold) in enumerate([(2.3, 1.9), (1.7, 1.6)]):
        folder = tmp_path / f"seed{seed}"
        folder.mkdir()
        ppo = {"method": "ppo", **_run_row(folder, _summary(folder, f"ppo{seed}", gold=ppo_gold, heldout=0.6, kl=2.0))}
        dpo = {"method": "dpo", **_run_row(folder, _summary(folder, f"dpo{seed}", gold=dpo_gold, heldout=0.5, kl=1.2))}
        a = _report(folder / "ppo.json", [ppo], seeds=str(seed))
        b = _report(folder / "dpo.json", [dpo], seeds=str(seed), methods={"dpo": ["method=dpo"]})
        main(["join", str(a), str(b), "--out", str(folder / "joined.json")])
        joined.append(str(folder / "joined.json"))
    out = tmp_path / "pooled.json"
    main(["pool", *joined, "--out", str(out)])
    pooled = json.loads(out.read_text())
    assert (pooled["seeds"], sorted(pooled["methods"])) == ("0,1", ["dpo", "ppo"])
    # PPO - DPO per seed: +0.4 and +0.1, mean 0.25, sd 0.3 / sqrt(2), se 0.15; PPO - best-of-16 (2.0): +0.3, -0.3
    assert pooled["table"]["ppo"]["gold_minus_dpo"]["mean"] == pytest.approx(0.25)
    assert pooled["table"]["ppo"]["gold_minus_dpo"]["se"] == pytest.approx(0.15)
    assert pooled["table"]["ppo"]["gold_minus_best_of_16"]["mean"] == pytest.approx(0.0)
    # a tuning record is still not a report
    (tmp_path / "tune.json").write_text(json.dumps({"phase": "tune", "runs": []}))
    with pytest.raises(SystemExit):
        main(["pool", joined[0], str(tmp_path / "tune.json"), "--out", str(tmp_path / "x.json")])
    assert "not a methods report (phase 'tune')" in capsys.readouterr().err


@pytest.mark.parametrize("dpo_best_gold, over, message", [
    (2.0, {"methods": {"ppo": []}}, "ppo is also in"),
    (2.0, {"seeds": "1"}, "its seeds '1' differs"),
    (2.0, {"eval": ["eval.n_prompts=256"]}, "its eval"),
    (2.1, {}, "seed 0's best-of-16 differs from"),
])
def test_join_refuses_reports_that_do_not_pair_in_one_line(tmp_path: Path, capsys, dpo_best_gold, over, message):
    from benchmarks.methods.run import main

    a, b = _one_seed_reports(tmp_path, dpo_best_gold, **over)
    with pytest.raises(SystemExit) as exit_info:
        main(["join", str(a), str(b), "--out", str(tmp_path / "joined.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py join: ") and message in err and str(b) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "joined.json").exists()


def _round_state(state: Path, *, finished: bool = True, overrides: Sequence[str] = ()) -> None:
    """A tuning round's sweep folder as `rlhf sweep` leaves it: two settings on seed 0, one run failed."""
    folder = state / "sweeps" / "S1"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({
        "sweep_id": "S1", "preset": "demo", "config_file": None, "seeds": [0], "select": "heldout",
        "concurrency": 2, "kl_budget": KL_BUDGET, "grid": {"ppo": ['{"rollout_batch_size":64}', '{"a":1}']},
        "overrides": ["eval.n_prompts=256", *overrides]}))
    runs = [{"run_id": "r3", "seed": 0, "setting": {"ppo": '{"rollout_batch_size":64}'}, "status": "completed"},
            {"run_id": "r4", "seed": 0, "setting": {"ppo": '{"a":1}'}, "status": "crashed"}]
    if finished:
        (folder / "sweep_report.json").write_text(json.dumps({"winner": "ppo=x", "runs": runs}))
        (folder / "sweep_frontier.png").write_bytes(b"png")
    (state / "runs" / "r3").mkdir(parents=True)
    iteration = {"eval/heldout/mean": 0.5, "eval/kl/mean": 2.0, "eval/proxy/mean": 1.0, "eval/gold/mean": 1.5,
                 "eval/length/mean": 30.0, "eval/win_rate/gold": 0.6}
    (state / "runs" / "r3" / "summary.json").write_text(json.dumps({
        "status": "ok", "heldout_status": "warn", "iterations": [iteration, {**iteration, "eval/kl/mean": 2.5}],
        "best_of_n": [{"n": 1, "kl": 0.0, "gold": 0.3}, {"n": 16, "kl": 1.84, "gold": 2.0}]}))


def test_record_writes_one_tuning_round_from_its_sweep(tmp_path: Path, capsys):
    from benchmarks.methods.run import main

    _round_state(tmp_path)
    out = tmp_path / "round.json"
    main(["record", "--state-dir", str(tmp_path), "--sweep", "S1", "--round", "5", "--note", "n", "--out", str(out)])
    payload = json.loads(out.read_text())
    # the command as it was typed, quoted for a shell: the JSON grid values survive a copy and paste, and the KL
    # budget (best-of-64's, 3.17451...) is written whole
    assert payload["command"] == ("rlhf sweep --preset demo --seeds 0 --select heldout "
                                  "--kl-budget 3.1745080833596715 --concurrency 2 "
                                  "--grid 'ppo={\"rollout_batch_size\":64},{\"a\":1}' eval.n_prompts=256")
    words = shlex.split(payload["command"])
    assert float(words[words.index("--kl-budget") + 1]) == KL_BUDGET
    assert (payload["method"], payload["round"], payload["note"], payload["report"]["winner"]) == ("ppo", 5, "n",
                                                                                                   "ppo=x")
    ok, failed = payload["runs"]
    assert [it["kl/mean"] for it in ok["iterations"]] == [2.0, 2.5]
    assert ok["iterations"][0] == {"heldout/mean": 0.5, "kl/mean": 2.0, "proxy/mean": 1.0, "gold/mean": 1.5,
                                   "length/mean": 30.0}
    assert (ok["status"], ok["heldout_status"], ok["best_of_16"]["gold"]) == ("ok", "warn", 2.0)
    assert failed == {"setting": {"ppo": '{"a":1}'}, "seed": 0, "run_id": "r4", "failed": "crashed"}
    assert out.with_suffix(".png").read_bytes() == b"png"
    capsys.readouterr()


@pytest.mark.parametrize("overrides, method", [
    (["ppo.advantage=rloo", "ppo.samples_per_prompt=4"], "rloo"),
    (["ppo.advantage=reinforce_pp"], "reinforce_pp"),
    (["method=dpo"], "dpo"),
])
def test_record_names_the_method_a_round_tuned_and_its_file(tmp_path: Path, monkeypatch, capsys, overrides, method):
    from benchmarks.methods import run

    _round_state(tmp_path / "state", overrides=overrides)
    # without --out the file lands in benchmarks/results: here a temporary one
    monkeypatch.setattr(run, "default_out", lambda name, smoke: tmp_path / f"{name}.json")
    run.main(["record", "--state-dir", str(tmp_path / "state"), "--sweep", "S1", "--round", "1"])
    payload = json.loads((tmp_path / f"methods_{method}_round1_tuning.json").read_text())
    assert payload["method"] == method and payload["command"].endswith(" ".join(overrides))
    assert (tmp_path / f"methods_{method}_round1_tuning.png").read_bytes() == b"png"
    capsys.readouterr()


def test_each_method_is_named_back_from_its_settings_and_from_its_report_setting_alone():
    from benchmarks.methods.protocol import METHODS, method_of, method_setting

    assert method_setting("ppo") == ("ppo.advantage", "gae") and method_setting("dpo") == ("method", "dpo")
    for method, settings in METHODS.items():
        key, value = method_setting(method)
        assert method_of(settings) == method and method_of([f"{key}={value}"]) == method
    # a DPO run keeps the default estimator's key; PPO's runs set neither key
    assert method_of(["method=dpo", "ppo.advantage=gae"]) == "dpo" and method_of(["ppo.kl.coef=0.1"]) == "ppo"
    with pytest.raises(ValueError, match="no method of the benchmark uses ppo.advantage=sequence"):
        method_of(["ppo.advantage=sequence"])


@pytest.mark.parametrize("sweep_id, finished, message", [
    ("S2", True, "no sweep S2 in"),
    ("S1", False, "has no report yet; finish it with `rlhf sweep --resume S1"),
])
def test_record_refuses_a_sweep_without_a_report_in_one_line(tmp_path: Path, capsys, sweep_id, finished, message):
    from benchmarks.methods.run import main

    _round_state(tmp_path, finished=finished)
    with pytest.raises(SystemExit) as exit_info:
        main(["record", "--state-dir", str(tmp_path), "--sweep", sweep_id, "--round", "1",
              "--out", str(tmp_path / "round.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "round.json").exists()


def test_tune_carries_winners_into_later_rounds_and_a_round_without_one_adds_nothing(tmp_path: Path, monkeypatch,
                                                                                      capsys):
    from benchmarks.methods import run

    monkeypatch.setattr(run, "TUNING", {
        "ppo": {"fixed": [], "rounds": [{"ppo.kl.coef": ["0.1", "0.2"]}, {"ppo.iterations": ["3", "4"]}]},
        "rloo": {"fixed": ["ppo.advantage=rloo"], "rounds": [
            {"ppo.learning_rate": ["5e-5", "1e-4"]},
            {"ppo.learning_rate": ["5e-5", "1e-4"], "ppo.iterations": ["3", "4"]}]},
        "grpo": {"fixed": ["ppo.advantage=grpo"], "rounds": [{"ppo.learning_rate": ["5e-5", "1e-4"]}]},
    })
    winners = iter(["ppo.kl.coef=0.1", "ppo.iterations=4", None, "ppo.learning_rate=5e-5 ppo.iterations=3", None])
    calls = []

    def fake_sweep(preset, state, seeds, grid, overrides, log, select, kl_budget, concurrency):
        calls.append((grid, overrides, log.name))
        return {"winner": next(winners)}

    monkeypatch.setattr(run, "sweep", fake_sweep)
    args = argparse.Namespace(methods=["ppo", "rloo", "grpo"], preset="demo", seeds="0,1,2",
                              eval=["eval.n_prompts=256"], select="heldout", kl_budget=KL_BUDGET, concurrency=3)
    chosen = run.tune(args, tmp_path, tmp_path)
    # round 2 runs on round 1's winner; the round's own key is never also an override
    assert calls[1] == ({"ppo.iterations": ["3", "4"]}, ["ppo.kl.coef=0.1", "eval.n_prompts=256"],
                        "tune-ppo-round2.log")
    assert chosen["ppo"]["settings"] == ["ppo.kl.coef=0.1", "ppo.iterations=4"]
    # rloo's round 1 names no winner: round 2 runs on the fixed settings alone and its winner is the choice
    assert calls[3][1:] == (["ppo.advantage=rloo", "eval.n_prompts=256"], "tune-rloo-round2.log")
    assert chosen["rloo"]["settings"] == ["ppo.advantage=rloo", "ppo.learning_rate=5e-5", "ppo.iterations=3"]
    assert len(chosen["rloo"]["rounds"]) == 2 and "stopped" not in chosen["rloo"]
    # grpo's last round names none: no settings, and the entry says why
    assert chosen["grpo"]["settings"] is None and len(calls) == 5
    assert chosen["grpo"]["stopped"] == ("round 1: no eligible setting: each was flagged by its held-out verdict or "
                                         "over the KL budget (3.17451 nats)")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["winner"] is None for line in lines] == [False, False, True, False, True]
    assert lines[2]["none"].startswith("no eligible setting")
