"""``rlhf sweep``: plan and create a sweep (every run resolved and checked first), or find one to resume; then run
its flow (``flows.sweep``) and print its report.

    rlhf sweep --preset demo --grid ppo.kl.coef=0.02,0.05 --grid ppo.learning_rate=1e-4,3e-4 --seeds 0,1,2
    rlhf sweep --resume SWEEP_ID
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import TYPE_CHECKING

from flows.errors import EXIT_FAILED, user_errors

if TYPE_CHECKING:
    from tasks.run_store import RunStore


def add_sweep_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``rlhf sweep``."""
    from flows.sweep_plan import DEFAULT_SELECT, SELECTORS

    sweep = subparsers.add_parser(
        "sweep", help="run a grid of settings x seeds as ordinary runs and compare them",
        description="Run the cross product of every --grid and --seeds as ordinary rlhf runs in one state folder (a "
        "seed's data, SFT policy and reward models are computed once and shared), then print a table per setting "
        "(mean and sd over seeds of the final policy's proxy, held-out RM, KL, hacking flags, and gold where the "
        "task has it) and name the winner by --select, on the held-out reward model: gold only evaluates. The whole "
        "grid is checked before any run starts.")
    sweep.add_argument("--preset", default="demo", help="preset under infra/presets (default demo)")
    sweep.add_argument("--config", metavar="FILE", help="YAML config (merged over --preset)")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                       help="a setting and its values (repeatable: the grid is their cross product)")
    sweep.add_argument("--seeds", default="0", help="seeds, comma-separated (default 0)")
    sweep.add_argument("--select", default=DEFAULT_SELECT,
                       help=f"what names the winner: {', '.join(SELECTORS)} (default {DEFAULT_SELECT}); never gold")
    sweep.add_argument("--kl-budget", type=float, default=None, metavar="NATS",
                       help="settings whose mean final KL to the reference is above NATS (per reply) are not "
                       "eligible to win: compare at a stated distance from the SFT policy (default: no budget)")
    sweep.add_argument("--concurrency", type=int, default=1,
                       help="runs at a time, each in a worker process of its own (default 1: one after another, in "
                       "this process)")
    sweep.add_argument("--resume", metavar="SWEEP_ID", help="continue a sweep as it was created ('latest' works)")
    sweep.add_argument("--state-dir", default=None, help="state folder (default: the config's, .rlhf_state)")
    sweep.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings every run of the sweep shares")
    sweep.set_defaults(handler=run_sweep_command)


def run_sweep_command(args: argparse.Namespace) -> int:
    """Create the sweep (or load it, ``--resume``), run it, print its report; exit 0 when every run completed."""
    from flows.commands import DEFAULT_STATE_DIR, connect_prefect, prepare_environment, stopped_by
    from tasks.config import ConfigError

    if args.concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.kl_budget is not None and not (args.kl_budget > 0 and math.isfinite(args.kl_budget)):
        raise ConfigError(f"--kl-budget must be a positive number of nats, got {args.kl_budget}")
    if args.resume:
        if args.grid or args.overrides or args.config or args.kl_budget is not None:
            raise ConfigError("--resume continues a sweep as it was created; drop --grid, --config, --kl-budget and "
                              "KEY=VALUE")
        state_dir = args.state_dir or DEFAULT_STATE_DIR
        prepare_environment(state_dir)
        from tasks.run_store import RunStore

        store = RunStore(state_dir).ensure()
        sweep_id = store.load_sweep(args.resume).sweep_id
        store.refuse_sweep_if_held(sweep_id)
        print(f"resuming sweep {sweep_id}", flush=True)
    else:
        store, sweep_id = create_sweep(args)
    connect_prefect(store)
    from flows.sweep import REPORT_MD, rlhf_sweep
    from flows.sweep_report import report_text

    try:
        report = rlhf_sweep(sweep_id=sweep_id, state_dir=str(store.root))
    except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C, SIGTERM: the runs in flight were stopped too
        line = (f"rlhf: sweep {sweep_id} {stopped_by(stop)}; log: {store.sweep_file(sweep_id, 'sweep.log')}; "
                f"continue with: rlhf sweep --resume {sweep_id} --state-dir {store.root}")
        store.end_sweep(sweep_id, "failed", line)
        print(line, file=sys.stderr)
        raise
    except Exception as error:  # the traceback is in the sweep's log file and on its Prefect flow run
        if isinstance(error, user_errors()):  # a busy sweep, a damaged record: one line, exit 2
            raise
        line = (f"rlhf: sweep {sweep_id} stopped: {type(error).__name__}: {' '.join(str(error).split())[:400]}; "
                f"log: {store.sweep_file(sweep_id, 'sweep.log')}; continue with: rlhf sweep --resume {sweep_id} "
                f"--state-dir {store.root}")
        store.end_sweep(sweep_id, "failed", line)
        print(line, file=sys.stderr)
        return EXIT_FAILED
    print(report_text(report))
    print(f"report: {store.sweep_file(sweep_id, REPORT_MD)}")
    return EXIT_FAILED if report["failed"] else 0


def create_sweep(args: argparse.Namespace) -> tuple[RunStore, str]:
    """Every run planned and resolved (a mistake is refused here, before anything exists), then the sweep's record
    and its runs; returns the store and the sweep id."""
    from flows.commands import prepare_environment
    from flows.sweep_plan import absolute_config, parse_grid, parse_seeds, plan_cells, refuse_inert_keys, selector

    select = selector(args.select)
    grid, seeds = parse_grid(args.grid), parse_seeds(args.seeds)
    overrides = [*args.overrides, *([f"state_dir={args.state_dir}"] if args.state_dir else [])]
    cells = plan_cells(args.config, args.preset, overrides, grid, seeds)
    state_dir = cells[0].config.state_dir
    prepare_environment(state_dir)
    refuse_inert_keys(cells)
    from tasks.run_store import RunStore, SweepCell, SweepRecord, new_run_id
    from tasks.tracking.setup import check_server, keep_credentials_out
    from tasks.typed_yaml import dump_config_text

    check_server(os.environ.get("MLFLOW_TRACKING_URI") or cells[0].config.tracking.tracking_uri)
    store = RunStore(state_dir).ensure()
    record = store.create_sweep(SweepRecord(new_run_id(), args.preset, absolute_config(args.config),
                                            list(args.overrides), grid, seeds, select.name,
                                            concurrency=args.concurrency, kl_budget=args.kl_budget))
    with store.hold_sweep(record.sweep_id, "rlhf sweep (creating its runs)") as sweep:
        for cell in cells:
            config = keep_credentials_out(cell.config)
            run = store.create_run(config.name, dump_config_text(config), preset=args.preset, sweep_id=record.sweep_id)
            sweep.record.cells.append(SweepCell(cell.setting, cell.seed, run.run_id))
        sweep.save()
    print(f"sweep {record.sweep_id}: {len(cells)} runs ({len(cells) // len(seeds)} settings x {len(seeds)} seeds) in "
          f"{store.root}", flush=True)
    return store, record.sweep_id
