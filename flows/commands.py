"""`rlhf demo | run | resume | stage | runs`: the pipeline from the command line.

Prefect and MLflow are imported only after `prepare_environment` has pointed them at the state directory,
so nothing is written to the home directory and the temporary Prefect server keeps its SQLite there.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

DEFAULT_STATE_DIR = ".rlhf_state"
PROGRESS_LOGGERS = ("rlhf_core", "tasks", "flows")


def prepare_environment(state_dir: str) -> None:
    """Quiet Prefect, keep its home inside the state dir, and show our progress lines (rate, ETA)."""
    root = Path(state_dir).resolve()
    os.environ.setdefault("PREFECT_HOME", str(root / "prefect"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary server gets 20 s by default, which a busy 2-core machine can miss.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Our own progress lines carry rate and ETA; library progress bars for millisecond copies are noise.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in PROGRESS_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)


def add_pipeline_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register demo, run, resume, stage and runs."""
    demo = subparsers.add_parser("demo", help="the whole pipeline on the embedded customer-support task")
    demo.add_argument("--seed", type=int, default=0, help="seed of data, models and sampling (default 0)")
    _common(demo)
    demo.set_defaults(handler=_run_demo)
    run = subparsers.add_parser("run", help="run the pipeline with a config file")
    run.add_argument("--config", metavar="FILE", help="YAML config (merged over --preset)")
    run.add_argument("--preset", default="demo", help="preset under infra/presets (default demo)")
    _common(run)
    run.set_defaults(handler=_run_config)
    resume = subparsers.add_parser("resume", help="continue a run: finished stages are skipped, PPO restarts "
                                   "from its last checkpoint")
    resume.add_argument("run_id", metavar="RUN_ID", help="a run id from `rlhf runs`, or 'latest'")
    resume.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="state directory (default .rlhf_state)")
    resume.set_defaults(handler=_resume)
    stage = subparsers.add_parser("stage", help="rerun one stage of a past run with its recorded inputs")
    stage.add_argument("name", choices=["data-prep", "sft", "reward-model", "best-of-n", "ppo-iteration",
                                        "heldout-eval", "rm-refresh"])
    stage.add_argument("--run", required=True, metavar="RUN_ID", help="the run (or 'latest')")
    stage.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="state directory (default .rlhf_state)")
    stage.set_defaults(handler=_rerun_stage)
    runs = subparsers.add_parser("runs", help="list runs with their status")
    runs.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="state directory (default .rlhf_state)")
    runs.set_defaults(handler=_list_runs)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default=None, help="state directory (default: the config's, .rlhf_state)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. ppo.kl.coef=0.1 ppo.iterations=2")


def _run_demo(args: argparse.Namespace) -> int:
    return _start(None, "demo", [f"seed={args.seed}", *args.overrides], args.state_dir)


def _run_config(args: argparse.Namespace) -> int:
    return _start(args.config, args.preset, list(args.overrides), args.state_dir)


def _start(config_file: str | None, preset: str | None, overrides: list[str], state_dir: str | None) -> int:
    from tasks.config import load_config
    from tasks.typed_yaml import dump_config

    if state_dir is not None:
        overrides = [*overrides, f"state_dir={state_dir}"]
    config = load_config(config_file, preset, overrides)
    prepare_environment(config.state_dir)
    from tasks.state import StateDir

    state = StateDir(config.state_dir).ensure()
    record = state.new_run(config.name)
    record.config_path = dump_config(config, state.run_dir(record.run_id) / "config.yaml")
    state.save_run(record)
    print(f"run {record.run_id}: config {record.config_path}", flush=True)
    return _execute(state, record.run_id, record.config_path, ())


def _execute(state, run_id: str, config_path: str, refresh: tuple[str, ...]) -> int:
    from flows.pipeline import run_pipeline
    from flows.summary import format_summary

    try:
        summary = run_pipeline(config_path, run_id, refresh)
    except BaseException:
        record = state.load_run(run_id)
        record.status = "failed"
        state.save_run(record)
        print(f"run {run_id} failed; fix the cause and continue with: rlhf resume {run_id} "
              f"--state-dir {state.root}", file=sys.stderr)
        raise
    print(format_summary(summary))
    print(f"summary: {state.run_dir(run_id) / 'summary.json'}")
    print(_mlflow_hint(state, summary.get("mlflow_run_id")))
    return 0


def _mlflow_hint(state, mlflow_run_id: str | None) -> str:
    return ("look at it in the MLflow UI:\n"
            f"  .venv/bin/mlflow ui --backend-store-uri {state.mlflow_uri} --port 5000\n"
            f"  then open http://127.0.0.1:5000 (experiment runs; parent run {mlflow_run_id}, one nested run per stage)")


def _load(state_dir: str, run_id: str):
    prepare_environment(state_dir)
    from tasks.state import StateDir

    state = StateDir(state_dir)
    return state, state.load_run(run_id)


def _resume(args: argparse.Namespace) -> int:
    state, record = _load(args.state_dir, args.run_id)
    print(f"resuming run {record.run_id} (status {record.status})", flush=True)
    return _execute(state, record.run_id, record.config_path, ())


def _rerun_stage(args: argparse.Namespace) -> int:
    state, record = _load(args.state_dir, args.run)
    if args.name == "ppo-iteration":  # a fresh rerun must not resume from the old checkpoints
        shutil.rmtree(state.run_dir(record.run_id) / "ppo", ignore_errors=True)
    print(f"rerunning {args.name} of run {record.run_id}; later stages rerun only if their inputs change",
          flush=True)
    return _execute(state, record.run_id, record.config_path, (args.name,))


def _list_runs(args: argparse.Namespace) -> int:
    prepare_environment(args.state_dir)
    from tasks.state import StateDir

    runs = StateDir(args.state_dir).list_runs()
    if not runs:
        print(f"no runs in {Path(args.state_dir).resolve()}")
        return 0
    width = max(len("name"), *(len(record.name) for record in runs)) + 2
    print(f"{'run id':<32}{'name':<{width}}{'status':<11}{'stages done':<13}created")
    for record in runs:
        done = sum(1 for s in record.stages.values() if s.status == "completed")
        print(f"{record.run_id:<32}{record.name:<{width}}{record.status:<11}{done:<13}{record.created}")
    return 0
