"""`rlhf sweep`'s grid parsing, selection rule and report, on hand-made run summaries."""

from __future__ import annotations

import math

import pytest

from flows.sweep_plan import parse_grid, parse_seeds, plan_cells, selector, split_values
from flows.sweep_report import build_report, report_markdown, report_text, winner_metrics
from tasks.config import ConfigError


def test_grid_values_split_on_top_level_commas_only() -> None:
    assert split_values("0.1,0.2, 3e-4") == ["0.1", "0.2", "3e-4"]
    assert split_values("[1,2],[3]") == ["[1,2]", "[3]"]
    assert split_values('"a,b",c') == ['"a,b"', "c"]
    assert parse_grid(["ppo.kl.coef=0.1,0.2", "ppo.lam=1.0"]) == {"ppo.kl.coef": ["0.1", "0.2"], "ppo.lam": ["1.0"]}
    assert parse_seeds("3,4,5") == [3, 4, 5]


@pytest.mark.parametrize("name", ["gold", "eval/gold/mean", "win_rate_gold", "GOLD"])
def test_gold_is_never_a_selection_metric(name: str) -> None:
    with pytest.raises(ConfigError, match="gold is evaluation-only and never chooses settings"):
        selector(name)


def summary(seed: int, heldout: float, gold: float, kl: float, heldout_status: str = "ok",
            status: str = "ok") -> dict:
    final = {"eval/proxy/mean": heldout + 1, "eval/heldout/mean": heldout, "eval/gold/mean": gold, "eval/kl/mean": kl,
             "eval/length/mean": 30.0, "eval/win_rate/heldout": 0.5}
    best = [{"n": n, "kl": math.log(n) - (n - 1) / n, "proxy": 1.0 + n / 16, "heldout": 0.5 + n / 32,
             "gold": 1.0 + seed + n / 16} for n in (1, 16)]
    return {"seed": seed, "status": status, "heldout_status": heldout_status, "iterations": [final], "best_of_n": best}


def cell(setting: str, seed: int, done: dict | None, run_id: str) -> dict:
    key, value = setting.split("=")
    return {"setting": {key: value}, "seed": seed, "run_id": run_id,
            "status": "completed" if done else "failed", "summary": done}


def test_the_winner_is_chosen_on_the_heldout_rm_leaving_out_runs_its_verdict_does_not_pass() -> None:
    """Setting a: held-out 1.0 and 3.0, but the 3.0 run is flagged by the held-out verdict -> 1.0 counts.
    Setting b: held-out 2.0 and 1.6 -> 1.8 wins, although a's gold (5.0) is far higher: gold never chooses.
    Setting d: held-out 9.0, but its held-out verdict warns (say, KL past the budget): not eligible."""
    cells = [cell("k=a", 0, summary(0, 1.0, 5.0, 2.0), "r1"),
             cell("k=a", 1, summary(1, 3.0, 5.0, 4.0, heldout_status="hacking"), "r2"),
             cell("k=b", 0, summary(0, 2.0, 1.0, 1.0, status="hacking"), "r3"),
             cell("k=b", 1, summary(1, 1.6, 1.0, 3.0), "r4"),
             cell("k=c", 0, None, "r5"),
             cell("k=d", 0, summary(0, 9.0, 1.0, 30.0, heldout_status="warn"), "r6")]
    report = build_report("S", selector("heldout"), cells)
    rows = {r["setting"]: r for r in report["settings"]}
    assert report["winner"] == "k=b" and report["failed"] == ["r5"]
    assert rows["k=a"]["select"] == (1.0, 0.0) and rows["k=a"]["heldout"][0] == pytest.approx(2.0)
    assert rows["k=a"]["heldout"][1] == pytest.approx(math.sqrt(2))  # sample sd of 1.0 and 3.0
    assert rows["k=b"]["select"][0] == pytest.approx(1.8) and rows["k=b"]["kl"] == (2.0, pytest.approx(math.sqrt(2)))
    assert (rows["k=a"]["hacking_heldout"], rows["k=a"]["hacking_gold"]) == (1, 0)
    assert (rows["k=b"]["hacking_heldout"], rows["k=b"]["hacking_gold"]) == (0, 1)
    assert rows["k=c"]["completed"] == 0 and rows["k=c"]["select"] is None and rows["k=c"]["heldout"] is None
    assert rows["k=d"]["select"] is None and rows["k=d"]["warn_heldout"] == 1
    # best-of-N: each seed's points once, averaged: gold at n=16 is (1 + 0 + 1) and (1 + 1 + 1) -> 2.5
    best16 = report["best_of_n"][-1]
    assert best16["n"] == 16 and best16["gold"] == (2.5, pytest.approx(math.sqrt(0.5))) and best16["seeds"] == 2
    assert winner_metrics(report)["sweep/winner/heldout"] == pytest.approx(1.8)
    markdown, text = report_markdown(report), report_text(report)
    assert "`k=b` **(winner)**" in markdown and "| `k=a` | 2/2 |" in markdown and "1 / 0 | 0 |" in markdown
    assert "rlhf sweep --resume S" in markdown and "winner by heldout" in text and "k=b" in text.splitlines()[-2]


def test_frontier_selection_scores_the_heldout_gain_over_best_of_n_at_the_runs_kl() -> None:
    """Best-of-N held-out (0.53 at KL 0, 1.0 at KL log 16 - 15/16 = 1.835; slope 0.256 per nat). Setting a: held-out
    1.2 at KL 1.0 -> the curve there is 0.786, gain 0.414. Setting b: held-out 1.5 at KL 6.0 -> the curve continued
    is 2.066, gain -0.566. ``heldout`` picks b, ``frontier`` picks a; a run without best-of-N has no score."""
    cells = [cell("k=a", 0, summary(0, 1.2, 1.0, 1.0), "r1"), cell("k=b", 0, summary(0, 1.5, 1.0, 6.0), "r2")]
    kl16, low, high = math.log(16) - 15 / 16, 0.5 + 1 / 32, 0.5 + 16 / 32
    slope = (high - low) / kl16
    assert build_report("S", selector("heldout"), cells)["winner"] == "k=b"
    report = build_report("S", selector("frontier"), cells)
    rows = {r["setting"]: r for r in report["settings"]}
    assert report["winner"] == "k=a" and rows["k=a"]["select"][0] == pytest.approx(1.2 - (low + slope * 1.0))
    assert rows["k=b"]["select"][0] == pytest.approx(1.5 - (high + slope * (6.0 - kl16)))
    assert rows["k=a"]["select"][0] == pytest.approx(0.414, abs=1e-3)
    no_curve = {**summary(0, 1.2, 1.0, 1.0), "best_of_n": []}
    assert build_report("S", selector("frontier"), [cell("k=a", 0, no_curve, "r3")])["winner"] is None


def test_a_kl_budget_leaves_out_settings_whose_mean_kl_is_above_it() -> None:
    """Setting a: held-out 2.0 at KL 4.0 and 1.0 at KL 2.0 (mean 1.5 at KL 3.0). Setting b: held-out 1.2 at KL 1.0 and
    1.4 at KL 1.5 (1.3 at 1.25). Setting c: held-out 3.0 at KL 5.0. Without a budget c wins; with 3.17 nats
    (best-of-64's KL) c is out (5.0) and a is in (3.0: the mean counts, not a run's 4.0), so a wins; with 2.5 only b
    is left."""
    cells = [cell("k=a", 0, summary(0, 2.0, 1.0, 4.0), "r1"), cell("k=a", 1, summary(1, 1.0, 1.0, 2.0), "r2"),
             cell("k=b", 0, summary(0, 1.2, 1.0, 1.0), "r3"), cell("k=b", 1, summary(1, 1.4, 1.0, 1.5), "r4"),
             cell("k=c", 0, summary(0, 3.0, 9.0, 5.0), "r5")]
    assert build_report("S", selector("heldout"), cells)["winner"] == "k=c"
    report = build_report("S", selector("heldout"), cells, kl_budget=math.log(64) - 63 / 64)
    rows = {r["setting"]: r for r in report["settings"]}
    assert report["winner"] == "k=a" and report["kl_budget"] == pytest.approx(3.175, abs=1e-3)
    assert [rows[f"k={k}"]["over_kl_budget"] for k in "abc"] == [False, False, True]
    assert rows["k=c"]["select"] == (3.0, 0.0)  # its score is shown; it is not eligible
    assert build_report("S", selector("heldout"), cells, kl_budget=2.5)["winner"] == "k=b"
    markdown, text = report_markdown(report), report_text(report)
    assert "`k=c` (over the KL budget)" in markdown and "mean KL is above 3.17451 nats are not eligible" in markdown
    assert "not eligible): k=a" in text


def test_no_eligible_setting_names_no_winner() -> None:
    cells = [cell("k=a", 0, summary(0, 1.0, 1.0, 1.0, heldout_status="hacking"), "r1")]
    report = build_report("S", selector("heldout"), cells)
    assert report["winner"] is None and winner_metrics(report) == {}
    assert "none (no eligible run)" in report_markdown(report)


def test_a_sweeps_runs_keep_every_iterations_resume_state_unless_the_sweep_says_otherwise() -> None:
    """Runs of a sweep branch from iterations they share (the same iteration 1, then another KL or refresh), so a
    sibling publishing its iteration 3 must not prune the state another run continues from. Retention is not part
    of an artifact key: the runs still share every cached stage with plain runs of the same settings."""
    from tasks import ppo_iteration
    from tasks.preflight import resolve_config
    from tasks.run_store.keys import canonical

    grid = {"ppo.kl.coef": ["0.05", "0.1"]}
    cells = plan_cells(None, "tiny", ["ppo.iterations=3"], grid, [0])
    assert [c.config.ppo.keep_resume_states for c in cells] == [3, 3]
    plain = resolve_config(None, "tiny", ["ppo.iterations=3", "ppo.kl.coef=0.05", "seed=0"])
    assert plain.ppo.keep_resume_states == 2
    assert canonical(ppo_iteration.Config.of(cells[0].config, 2)) == canonical(ppo_iteration.Config.of(plain, 2))
    told = plan_cells(None, "tiny", ["ppo.iterations=3", "ppo.keep_resume_states=1"], grid, [0])
    assert [c.config.ppo.keep_resume_states for c in told] == [1, 1]


def test_runs_side_by_side_go_to_worker_processes_never_threads():
    """Loading models is not thread-safe (tests/flows/test_sweep.py runs two runs side by side end to end); each
    worker starts in a session of its own, so that a signal to the sweep's group reaches the sweep alone."""
    from prefect.task_runners import ProcessPoolTaskRunner

    from flows.sweep import detach_worker, runs_runner

    runner = runs_runner(2)
    assert isinstance(runner, ProcessPoolTaskRunner) and runner._max_workers == 2
    assert runner._initializer is detach_worker and runner.duplicate()._initializer is detach_worker


def test_a_sweep_at_concurrency_one_calls_its_runs_in_its_own_thread(monkeypatch):
    """One run at a time runs in the sweep's (main) thread, where a signal lands, never in a worker thread (which
    went on computing a run after the sweep had stopped)."""
    import threading

    import flows.sweep as sweep_flow
    from tasks.run_store import SweepCell, SweepRecord

    calls = []

    def run(label: str, run_id: str, state_dir: str) -> str:
        calls.append((run_id, threading.current_thread() is threading.main_thread()))
        if run_id == "ra1":
            raise RuntimeError("this run fails; the others go on")
        return "completed"

    monkeypatch.setattr(sweep_flow, "sweep_run_task", run)
    cells = [SweepCell({"k": v}, seed, f"r{v}{seed}") for seed in (0, 1) for v in ("a", "b")]
    record = SweepRecord("s", None, None, [], {"k": ["a", "b"]}, [0, 1], "heldout", cells, concurrency=1)
    statuses = sweep_flow._run_cells(record, "unused")
    assert statuses == {"ra0": "completed", "ra1": "failed", "rb0": "completed", "rb1": "completed"}
    assert calls == [("ra0", True), ("ra1", True), ("rb0", True), ("rb1", True)]  # seed by seed, first runs first


def test_runs_start_in_turn_over_the_seeds_so_runs_side_by_side_do_not_wait_on_each_other(monkeypatch) -> None:
    """In plan order (seed by seed) two slots would hold two runs of one seed, the second waiting while the first
    computes the stages they share; the launch order takes every seed's first run, then every seed's second."""
    import flows.sweep as sweep_flow
    from flows.sweep_plan import launch_order
    from tasks.run_store import SweepCell, SweepRecord

    cells = [SweepCell({"ppo.iterations": value}, seed, f"run-{value}-{seed}")
             for seed in (0, 1, 2) for value in ("3", "5")]
    assert [c.run_id for c in launch_order(cells)] == ["run-3-0", "run-3-1", "run-3-2", "run-5-0", "run-5-1",
                                                       "run-5-2"]
    one_seed = [c for c in cells if c.seed == 1]
    assert launch_order(one_seed) == one_seed
    assert launch_order(cells[:3]) == [cells[0], cells[2], cells[1]]  # seed 0 twice, seed 1 once

    submitted = []

    class Finished:
        def result(self) -> str:
            return "completed"

    class Task:
        def submit(self, label: str, run_id: str, state_dir: str) -> Finished:
            submitted.append(run_id)
            return Finished()

    monkeypatch.setattr(sweep_flow, "sweep_run_task", Task())
    record = SweepRecord("sweep-1", "tiny", None, [], {"ppo.iterations": ["3", "5"]}, [0, 1, 2], "heldout",
                         cells=cells, concurrency=2)
    statuses = sweep_flow._run_cells(record, "unused")
    assert submitted == [c.run_id for c in launch_order(cells)]
    assert statuses == {c.run_id: "completed" for c in cells}
