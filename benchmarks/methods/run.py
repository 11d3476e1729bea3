"""PPO, GRPO, RLOO, REINFORCE++ and DPO on the demo task, tuned and compared by one protocol, through `rlhf sweep`.

    .venv/bin/python -m benchmarks.methods.run tune --seeds 0,1,2        # choose each method's settings (hours)
    .venv/bin/python -m benchmarks.methods.run report                  # gold on seeds never looked at (~2 h)
    .venv/bin/python -m benchmarks.methods.run report --seeds 0 --preset tiny   # a smoke run of every method
    .venv/bin/python -m benchmarks.methods.run pool A.json B.json --out C.json  # one table over two reports' seeds
    .venv/bin/python -m benchmarks.methods.run join A.json B.json --out C.json  # one table over two reports' methods
    .venv/bin/python -m benchmarks.methods.run record --state-dir S --sweep ID --round 8 --note "..."  # one round

The protocol:

1. **Tune** (``tune``): each method's grids (``TUNING`` in ``benchmarks/methods/protocol.py``, with every other
   setting of the protocol) run as `rlhf sweep` on the tuning seeds, round after round: a round's grid sits on top of
   the settings the earlier rounds chose. The sweep names the winner by ``--select``, leaving out runs its verdict
   flags as hacking; gold is never read for this. Each rule was declared before the rounds it chose: PPO's rounds 1
   and 2 by ``heldout`` (the final held-out mean), round 3 by ``frontier`` (the held-out reward model's gain over
   best-of-N at the run's KL, best-of-N continued linearly past N = 16), and from round 4 on by ``heldout`` within a
   KL budget (``--kl-budget``, default best-of-64's KL, log 64 - 63/64 = 3.17 nats: settings whose mean final KL is
   above it are not eligible). How each rule ranked the settings against gold is in
   ``benchmarks/methods/selection.py`` and docs/results.md. The chosen settings are written to
   ``benchmarks/results/methods_tuning.json``.
2. **Report** (``report``): each method's chosen settings (``METHODS``, copied from the tuning result; the demo
   preset holds PPO's and DPO's) run on seeds that tuning never saw, with more evaluation prompts. Every run also
   computes best-of-N from its seed's SFT policy. Gold is read here for the first time: mean and standard error over
   seeds, and the paired difference to best-of-16 and to DPO at the same seed (the same SFT policy, prompts and
   judges), with its standard error; and gold's and the held-out judge's difference to the seed's best-of-N curve at
   the run's own KL (Gao et al.'s comparison at matched KL).

3. **Pool** (``pool``): the table recomputed over the runs of several saved reports (or joined reports) of the same
   settings on different seeds (each report's rows are kept whole; nothing is rerun). Refused when the reports ran
   different settings, presets or evaluation sizes, or share a seed.
   **Join** (``join``): the reports of different methods on the same seeds (``report --methods X``, run at different
   times into one state folder, or into state folders on machines that compute the seeds' shared stages alike) as
   one table, paired per seed. Refused when they ran other seeds, presets or evaluation sizes, share a method, or
   disagree on a seed's best-of-16 (then they did not share the SFT policy, reward models and prompts, and the rows
   would not pair).
4. **Record** (``record``): one tuning round, run as an `rlhf sweep` by hand (as rounds 6 on were), written as
   ``benchmarks/results/methods_round<N>_tuning.json`` (PPO's) or ``methods_<method>_round<N>_tuning.json`` from its
   state folder: the method, the sweep's command, its report and every run's judges at every iteration (gold among
   them, for the record: the sweep chose without it), beside the sweep's frontier plot. Nothing is rerun.

All runs share one state folder, so a seed's data, SFT policy, reward models and best-of-N are computed once. Prints
JSON, writes ``benchmarks/results/methods.json``, the gold-against-KL plot ``methods.png`` and the table as Markdown
``methods.md`` (the critic-free estimators against ``PPO_FRACTION`` x PPO's gold among its columns).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, default_out, machine, write_result
from benchmarks.methods.protocol import (BEST_OF, KL_BUDGET, METHODS, REPORT_EVAL_PROMPTS, REPORT_SEEDS,
                                         TUNE_EVAL_PROMPTS, TUNING, method_of, method_setting)
from benchmarks.methods.tables import aggregate, frontier, join, markdown, plot, pool


def sweep(preset: str, state: Path, seeds: str, grid: dict[str, list[str]], overrides: list[str],
          log: Path, select: str = "heldout", kl_budget: float | None = None, concurrency: int = 1) -> dict[str, Any]:
    """One `rlhf sweep` (``concurrency`` runs side by side, each in a worker process); its report
    (``sweep_report.json``)."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    command = [sys.executable, "-m", "flows.cli", "sweep", "--preset", preset, "--state-dir", str(state),
               "--seeds", seeds, "--select", select, "--concurrency", str(concurrency),
               *(["--kl-budget", str(kl_budget)] if kl_budget else []),
               *_grid_args(grid), *overrides]
    with log.open("w") as out:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    line = next((ln for ln in log.read_text().splitlines() if ln.startswith("report: ")), None)
    if line is None:
        raise RuntimeError(f"`rlhf sweep` ended with exit {code} and no report; see {log}")
    return json.loads(Path(line.removeprefix("report: ").strip()).with_suffix(".json").read_text())


def tune(args: argparse.Namespace, state: Path, logs: Path) -> dict[str, Any]:
    """Each method's rounds; returns {method: {"settings": [...], "rounds": [reports]}}. A round that names no winner
    (each setting flagged by its held-out verdict or over the KL budget) adds nothing: the next round runs on the
    settings before it (RLOO's round 2 re-tunes round 1's key beside another). When the last round names none the
    method has no settings: ``settings`` is None and ``stopped`` says why."""
    budget = f" or over the KL budget ({args.kl_budget:g} nats)" if args.kl_budget else ""
    none = f"no eligible setting: each was flagged by its held-out verdict{budget}"
    chosen: dict[str, Any] = {}
    for method in args.methods:
        spec, rounds = TUNING[method], []
        settings = dict(item.split("=", 1) for item in spec["fixed"])
        for r, grid in enumerate(spec["rounds"], 1):
            shared = [f"{k}={v}" for k, v in settings.items() if k not in grid]  # the round's grid decides its keys
            report = sweep(args.preset, state, args.seeds, grid, [*shared, *args.eval],
                           logs / f"tune-{method}-round{r}.log", args.select, args.kl_budget, args.concurrency)
            rounds.append(report)
            if report["winner"] is not None:
                settings.update(item.split("=", 1) for item in report["winner"].split(" "))
            print(json.dumps({"method": method, "round": r, "winner": report["winner"],
                              **({} if report["winner"] else {"none": none})}), file=sys.stderr, flush=True)
        if rounds and rounds[-1]["winner"] is None:
            chosen[method] = {"settings": None, "rounds": rounds, "stopped": f"round {len(rounds)}: {none}"}
        else:
            chosen[method] = {"settings": [f"{k}={v}" for k, v in settings.items()], "rounds": rounds}
    return chosen


def report(args: argparse.Namespace, state: Path, logs: Path) -> dict[str, Any]:
    """Each method's chosen settings on the report seeds; every run's final numbers and its seed's best-of-N."""
    rows = []
    for method in args.methods:
        key, value = method_setting(method)
        overrides = [o for o in METHODS[method] if not o.startswith(f"{key}=")]
        result = sweep(args.preset, state, args.seeds, {key: [value]}, [*overrides, *args.eval],
                       logs / f"report-{method}.log", concurrency=args.concurrency)
        for run in result["runs"]:
            rows.append({"method": method, **_run_row(state, run)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"runs": rows, "table": aggregate(rows)}


#: A run's per-iteration evaluation in a round's record (the summary's ``eval/<name>``).
ROUND_JUDGES = ("heldout/mean", "kl/mean", "proxy/mean", "gold/mean", "length/mean")


def record(state: Path, sweep_id: str, round_: int, note: str) -> dict[str, Any]:
    """One tuning round from the state folder of the `rlhf sweep` that ran it: the method it tuned (read from the
    sweep's settings), the sweep's command line (rebuilt from its record), its report (``sweep_report.json``: the
    settings' table and the winner) and, per run, every iteration's judges, its verdicts and its seed's best-of-16.
    Raises ``ValueError`` (one line) when the sweep is unknown or has no report yet. ``commit`` is this checkout's:
    record a round from the checkout that ran it."""
    folder = state / "sweeps" / sweep_id
    if not (folder / "sweep.json").is_file():
        raise ValueError(f"no sweep {sweep_id} in {state} (no {folder / 'sweep.json'})")
    if not (folder / "sweep_report.json").is_file():
        raise ValueError(f"sweep {sweep_id} has no report yet; finish it with `rlhf sweep --resume {sweep_id} "
                         f"--state-dir {state}`")
    sweep = json.loads((folder / "sweep.json").read_text())
    report = json.loads((folder / "sweep_report.json").read_text())
    runs = []
    for run in report["runs"]:
        row = {"setting": run["setting"], "seed": run["seed"], "run_id": run["run_id"]}
        if (summary := _summary(state, run)) is None:
            runs.append({**row, "failed": run["status"]})
            continue
        runs.append({**row, "iterations": [{name: it[f"eval/{name}"] for name in ROUND_JUDGES}
                                           for it in summary["iterations"]],
                     "heldout_status": summary.get("heldout_status"), "status": summary["status"],
                     "best_of_16": _best_of_16(summary)})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {"method": sweep_method(sweep), "round": round_, "commit": commit.stdout.strip() or None,
            "preset": sweep["preset"], "command": sweep_command(sweep), "note": note, "report": report, "runs": runs}


def sweep_method(sweep: dict[str, Any]) -> str:
    """The method a sweep's runs train (a name of ``METHODS``), from its overrides and its grid's single values."""
    return method_of([*sweep["overrides"], *(f"{k}={v[0]}" for k, v in sweep["grid"].items() if len(v) == 1)])


def sweep_command(sweep: dict[str, Any]) -> str:
    """The `rlhf sweep` command line a sweep's record (``sweep.json``) was started with, shell-quoted."""
    source = ["--config", sweep["config_file"]] if sweep.get("config_file") else ["--preset", sweep["preset"]]
    budget = ["--kl-budget", repr(sweep["kl_budget"])] if sweep.get("kl_budget") else []  # exact: it pastes back
    return shlex.join(["rlhf", "sweep", *source, "--seeds", ",".join(str(s) for s in sweep["seeds"]),
                       "--select", sweep["select"], *budget, "--concurrency", str(sweep.get("concurrency", 1)),
                       *_grid_args(sweep["grid"]), *sweep["overrides"]])


def _grid_args(grid: dict[str, list[str]]) -> list[str]:
    """``rlhf sweep``'s ``--grid KEY=V1,V2`` arguments for a grid."""
    return [arg for key, values in grid.items() for arg in ("--grid", f"{key}={','.join(values)}")]


def _summary(state: Path, run: dict[str, Any]) -> dict[str, Any] | None:
    """A sweep run's ``summary.json``; None when the sweep records it as not completed or it wrote none."""
    summary_file = state / "runs" / run["run_id"] / "summary.json"
    if run["status"] != "completed" or not summary_file.is_file():
        return None
    return json.loads(summary_file.read_text())


def _best_of_16(summary: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in summary["best_of_n"] if p["n"] == BEST_OF)


def _run_row(state: Path, run: dict[str, Any]) -> dict[str, Any]:
    """A run's final gold, held-out, proxy, KL, verdicts and its seed's best-of-16, from its summary."""
    if (summary := _summary(state, run)) is None:
        return {"seed": run["seed"], "run_id": run["run_id"], "failed": run["status"]}
    final, best = summary["iterations"][-1], _best_of_16(summary)
    kl = final["eval/kl/mean"]
    return {"seed": run["seed"], "run_id": run["run_id"], "gold": final["eval/gold/mean"],
            "heldout": final["eval/heldout/mean"], "proxy": final["eval/proxy/mean"], "kl": kl,
            "length": final["eval/length/mean"], "win_rate_gold": final["eval/win_rate/gold"],
            "gold_sft": final["eval/reference/gold/mean"], "status": summary["status"],
            "heldout_status": summary.get("heldout_status"), "seconds": summary.get("seconds"),
            "settings": settings_digest(state / "runs" / run["run_id"] / "config.yaml"),
            "best_of_16": {k: best[k] for k in ("gold", "heldout", "proxy", "kl")},
            # the score minus the seed's best-of-N curve at the run's own KL (Gao et al.'s matched-KL comparison)
            "minus_best_of_n_at_kl": {judge: final[f"eval/{judge}/mean"]
                                      - frontier(summary["best_of_n"], judge, kl, clamp=False)
                                      for judge in ("gold", "heldout")}}


def settings_digest(config_file: Path) -> str:
    """What a run's stages compute, whatever its seed: a digest of every stage's config slice with the seed set to 0
    (``stage_slices``: what enters the artifact keys, the slices ``rlhf sweep`` compares to refuse an inert grid key;
    the state folder, tracking and retention enter none). Runs of one method in pooled reports must agree on it."""
    from flows.sweep_plan import stage_slices
    from tasks.config import load_config

    text = json.dumps(stage_slices(load_config(config_file, None, ["seed=0"])), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", choices=["tune", "report", "pool", "join", "record"])
    parser.add_argument("reports", nargs="*", type=Path, help="pool, join: the saved report files")
    parser.add_argument("--seeds", default=None,
                        help=f"comma-separated (default: 0,1,2 to tune, {REPORT_SEEDS} to report)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--select", default="heldout", help="the sweep's rule for tuning rounds (default heldout)")
    parser.add_argument("--kl-budget", type=float, default=KL_BUDGET,
                        help=f"tuning rounds: settings whose mean KL is above it are not eligible (default "
                        f"{KL_BUDGET:.2f}, best-of-64's KL; 0 = none)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="runs side by side in each sweep (worker processes; mind the cores: each run's torch "
                             "threads are OMP_NUM_THREADS)")
    parser.add_argument("--state-dir", type=Path, default=None, help="shared state folder (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help=f"evaluation prompts per run (default {TUNE_EVAL_PROMPTS} to tune, "
                             f"{REPORT_EVAL_PROMPTS} to report; another preset keeps its own)")
    parser.add_argument("--sweep", default=None, help="record: the sweep id of the round (in --state-dir)")
    parser.add_argument("--round", type=int, default=None, help="record: the round's number (TUNING's order)")
    parser.add_argument("--note", default="", help="record: what the round was and how it was run")
    args = parser.parse_args(argv)
    if args.phase == "record":
        if args.state_dir is None or args.sweep is None or args.round is None:
            parser.error("record needs --state-dir, --sweep and --round")
        try:
            payload = record(args.state_dir, args.sweep, args.round, args.note)
        except ValueError as error:
            parser.exit(2, f"run.py record: {error}\n")
        # PPO's rounds keep the names they were first written under; another method's carry its name
        name = "methods" if payload["method"] == "ppo" else f"methods_{payload['method']}"
        out = args.out or default_out(f"{name}_round{args.round}_tuning", smoke=payload["preset"] != "demo")
        write_result(payload, out)
        plot_file = args.state_dir / "sweeps" / args.sweep / "sweep_frontier.png"
        if plot_file.is_file():
            shutil.copyfile(plot_file, out.with_suffix(".png"))
        return
    if args.phase in ("pool", "join"):
        try:
            combined = pool(args.reports) if args.phase == "pool" else join(args.reports)
        except ValueError as error:
            parser.exit(2, f"run.py {args.phase}: {error}\n")
        payload = {"machine": machine(), "phase": args.phase, **combined}
        name = "methods_pooled" if args.phase == "pool" else "methods_joined"
        out = args.out or default_out(name, smoke=payload["preset"] != "demo")
        _write_report(payload, out)
        return
    if args.reports:
        parser.error(f"report files are read by pool and join only, not by {args.phase}")
    args.seeds = args.seeds or ("0,1,2" if args.phase == "tune" else REPORT_SEEDS)
    smoke = args.preset != "demo"
    prompts = args.eval_prompts or (TUNE_EVAL_PROMPTS if args.phase == "tune" else REPORT_EVAL_PROMPTS)
    args.eval = [] if smoke and args.eval_prompts is None else [f"data.demo.n_eval_prompts={prompts}",
                                                                 f"eval.n_prompts={prompts}"]
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="rlhf-methods-"))
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"machine": machine(), "preset": args.preset, "phase": args.phase, "seeds": args.seeds,
                               "state_dir": str(state)}
    if args.phase == "tune":
        payload |= {"tuning": TUNING, "eval": args.eval, "chosen": tune(args, state, logs)}
        write_result(payload, args.out or default_out("methods_tuning", smoke))
        return
    payload |= {"methods": {m: METHODS[m] for m in args.methods}, "eval": args.eval, **report(args, state, logs)}
    _write_report(payload, out=args.out or default_out("methods", smoke))


def _write_report(payload: dict[str, Any], out: Path) -> None:
    """A report's (or pooled or joined reports') JSON, with its gold-against-KL plot (``.png``) and its table as
    Markdown (``.md``) beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(payload["runs"], out.with_suffix(".png"))
    out.with_suffix(".md").write_text(markdown(payload["table"]))
    write_result(payload, out)


if __name__ == "__main__":
    main()
