"""`rlhf demo | run | resume | stage | runs`: the pipeline from the command line (`schedule` and `server`: serving.py).

Prefect and MLflow are imported only after `prepare_environment` has pointed them at the state folder, so nothing
is written to the home directory and the temporary Prefect server keeps its SQLite there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flows.errors import EXIT_DATA_ERROR, EXIT_FAILED, user_errors
from flows.prefect_server import server_port, start_temporary_server

if TYPE_CHECKING:
    from tasks.run_store import RunRecord, RunStore

DEFAULT_STATE_DIR = ".rlhf_state"
SERVER_FILE = "server.json"
#: The API URL of the temporary Prefect server this command started (:func:`connect_prefect`), if it did.
TEMPORARY_API_URL: str | None = None
STAGES = ("data-prep", "sft", "reward-model", "best-of-n", "ppo-iteration", "heldout-eval", "rm-refresh", "dpo")
ITERATED = ("ppo-iteration", "heldout-eval", "rm-refresh")
#: Stages only one training method runs (``method``): asking to recompute one in a run of the other is refused.
METHOD_STAGES = {"ppo-iteration": "ppo", "rm-refresh": "ppo", "dpo": "dpo"}


def prepare_environment(state_dir: str) -> None:
    """Quiet Prefect, keep its home inside the state folder, keep MLflow offline, show our progress lines.

    When ``rlhf server`` runs for this state folder (and PREFECT_API_URL is unset), runs go to that server, so
    they show in its UI; otherwise Prefect starts a temporary server for the command.
    """
    from tasks.run_store.layout import Layout

    root = Path(state_dir).resolve()
    os.environ.setdefault("PREFECT_HOME", str(Layout(root).prefect_home))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary server gets 20 s by default, which a busy 2-core machine can miss; a busy server gets retries.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "10")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if "PREFECT_API_URL" not in os.environ:
        url = running_server(root)
        if url is not None:
            os.environ["PREFECT_API_URL"] = url
    from flows.logs import console_logging

    console_logging()


def running_server(state_dir: Path) -> str | None:
    """The API URL of the ``rlhf server`` of this state folder, when it runs and answers."""
    import json
    import urllib.request

    from tasks.run_store.layout import Layout

    info = Layout(state_dir).prefect_home / SERVER_FILE
    try:
        url = json.loads(info.read_text(encoding="utf-8"))["api_url"]
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return url if response.status == 200 else None
    except (OSError, ValueError, KeyError):
        return None


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
    resume = subparsers.add_parser("resume", help="continue a run: finished stages are reused, PPO continues from "
                                   "its last checkpoint; KEY=VALUE amends the run's config first")
    resume.add_argument("run_id", metavar="RUN_ID", help="a run id from `rlhf runs`, or 'latest'")
    resume.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="state folder (default .rlhf_state)")
    resume.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="settings to change before continuing, right after RUN_ID (e.g. refresh.labels_file=l.csv)")
    resume.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="set_overrides",
                        help="a setting to change before continuing (repeatable; anywhere on the line)")
    resume.set_defaults(handler=_resume)
    stage = subparsers.add_parser("stage", help="recompute one stage of a run (and everything that depends on it)")
    stage.add_argument("name", metavar="STAGE", help=f"one of {', '.join(STAGES)}; or one iteration of "
                       f"{', '.join(ITERATED)}, e.g. ppo-iteration-2")
    stage.add_argument("--run", required=True, metavar="RUN_ID", help="the run (or 'latest')")
    stage.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="state folder (default .rlhf_state)")
    stage.set_defaults(handler=_rerun_stage)
    runs = subparsers.add_parser("runs", help="list runs with their status (a killed run shows as crashed)")
    runs.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="state folder (default .rlhf_state)")
    runs.set_defaults(handler=_list_runs)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default=None, help="state folder (default: the config's, .rlhf_state)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. ppo.kl.coef=0.1 ppo.iterations=2")


def _run_demo(args: argparse.Namespace) -> int:
    return _start(None, "demo", [f"seed={args.seed}", *args.overrides], args.state_dir)


def _run_config(args: argparse.Namespace) -> int:
    return _start(args.config, args.preset, list(args.overrides), args.state_dir)


def _start(config_file: str | None, preset: str | None, overrides: list[str], state_dir: str | None) -> int:
    from tasks.preflight import resolve_config
    from tasks.typed_yaml import dump_config_text

    if state_dir is not None:
        overrides = [*overrides, f"state_dir={state_dir}"]
    config = resolve_config(config_file, preset, overrides)
    prepare_environment(config.state_dir)
    from tasks.tracking.setup import check_server, keep_credentials_out

    config = keep_credentials_out(config)
    check_server(os.environ.get("MLFLOW_TRACKING_URI") or config.tracking.tracking_uri)  # before a run exists
    from tasks.run_store import RunStore

    store = RunStore(config.state_dir).ensure()
    record = store.create_run(config.name, dump_config_text(config), preset=preset)
    print(f"run {record.run_id}: config {store.config_file(record.run_id)}", flush=True)
    return _execute(store, record.run_id)


def _execute(store: RunStore, run_id: str) -> int:
    from flows.pipeline import rlhf_pipeline
    from flows.summary import format_summary
    from tasks.preflight import resolve_config

    store.refuse_if_held(run_id)
    config = resolve_config(store.config_file(run_id))  # a file or device gone since the run started fails here
    from tasks.tracking.setup import check_server

    check_server(os.environ.get("MLFLOW_TRACKING_URI") or config.tracking.tracking_uri)
    connect_prefect(store)
    try:
        summary = rlhf_pipeline(run_id=run_id, state_dir=str(store.root))
    except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C, SIGTERM: Prefect's crash hook recorded the run
        print(f"rlhf: run {run_id} {stopped_by(stop)}; log: {store.log_file(run_id)}; continue with: rlhf resume "
              f"{run_id} --state-dir {store.root}", file=sys.stderr)
        raise
    except Exception as error:  # the traceback is in the run's log file and on the Prefect flow run
        line = failure_line(store, run_id, error)
        store.end_run(run_id, "failed", line)  # when the flow never started, no hook of Prefect's could say so
        print(line, file=sys.stderr)
        return EXIT_DATA_ERROR if isinstance(error, user_errors()) else EXIT_FAILED
    print(format_summary(summary))
    print(f"summary: {store.summary_file(run_id)}")
    print(mlflow_hint(store, summary))
    return 0


def stopped_by(stop: KeyboardInterrupt | SystemExit) -> str:
    """``stopped by Ctrl-C`` / ``stopped by SIGTERM`` (`flows.cli.exit_on_sigterm` exits 128 + the signal)."""
    if isinstance(stop, KeyboardInterrupt):
        return "stopped by Ctrl-C"
    try:
        return f"stopped by {signal.Signals(stop.code - 128).name}"
    except (TypeError, ValueError):  # not 128 + a signal: another exit
        return f"stopped (exit {stop.code})"


def failure_line(store: RunStore, run_id: str, error: BaseException) -> str:
    """``rlhf: run R failed in stage S: Cause; log: FILE; continue with: rlhf resume R --state-dir D``."""
    record = store.load_run(run_id)
    failed = [label for label, entry in record.stages.items() if entry.status == "failed"]
    where = f" in stage {failed[-1]}" if failed else ""
    cause = (record.stages[failed[-1]].error if failed else None) or f"{type(error).__name__}: {error}"
    if isinstance(error, TimeoutError):  # Prefect cancels the stage inside: its own error says only that
        cause = f"{type(error).__name__}: {error} (orchestration.stage_timeout_minutes)"
    cause = " ".join(cause.split())
    if len(cause) > 400:
        cause = cause[:399] + "…"
    if _is_connection_error(error):
        url = os.environ.get("PREFECT_API_URL")
        cause += (f" (the Prefect API at {url} did not answer: is its server running?)"
                  if url and url != TEMPORARY_API_URL else
                  " (Prefect's temporary server did not answer; on a busy machine start a persistent one with "
                  f"`rlhf server --state-dir {store.root}` in another terminal)")
    return (f"rlhf: run {run_id} failed{where}: {cause}; log: {store.log_file(run_id)}; continue with: "
            f"rlhf resume {run_id} --state-dir {store.root}")


def _is_connection_error(error: BaseException) -> bool:
    import httpx

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, (httpx.ConnectError, httpx.ConnectTimeout)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def connect_prefect(store: RunStore) -> None:
    """The Prefect API this command's flows report to, answering before the first flow starts: a real server
    (PREFECT_API_URL, or the state folder's `rlhf server`) as it is; otherwise a temporary server on the state
    folder's database, in a session of its own (``flows.prefect_server``: a signal to the command's process group
    leaves it to record how the runs ended, and it stops when the command exits)."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    global TEMPORARY_API_URL
    ensure_prefect_database(store)
    settings = get_current_settings()
    if settings.api.url:
        return
    TEMPORARY_API_URL = start_temporary_server(settings.server.ephemeral.startup_timeout_seconds)
    os.environ["PREFECT_API_URL"] = TEMPORARY_API_URL  # for this process's settings, and inherited by its workers
    refresh_global_settings_context()


def ensure_prefect_database(store: RunStore) -> None:
    """Create the temporary server's database under the state folder's init lock: two runs starting at once on a
    fresh folder would otherwise race on its migrations. A real server (PREFECT_API_URL) owns its own."""
    from prefect.server.database import provide_database_interface
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return
    url = settings.server.database.connection_url.get_secret_value()
    with store.initializing():
        if url.startswith("sqlite") and Path(url.split(":///", 1)[1]).is_file():
            return  # created already; the server itself migrates an existing database when it starts
        asyncio.run(provide_database_interface().create_db())


def mlflow_hint(store: RunStore, summary: dict) -> str:
    """Where to look at the run: its page on the tracking server, or the command that serves the local store on a
    free port and the run's page there."""
    from tasks import tracking

    run_id = summary.get("mlflow_run_id")
    if summary.get("mlflow_url"):
        return f"MLflow run: {summary['mlflow_url']}"
    port = server_port(5000)
    base = f"http://127.0.0.1:{port}"
    url = tracking.run_url(run_id, base) if run_id else base
    runs = url.split("/runs/", 1)[0] + "/runs?workflowType=machine_learning" if run_id else base
    return ("look at it in the MLflow UI:\n"
            f"  .venv/bin/mlflow ui --backend-store-uri sqlite:///{store.layout.mlflow_db} --port {port}\n"
            f"  then open {url}\n"
            f"  (all runs of the experiment, to select and compare: {runs})")


def _load(state_dir: str, run_id: str) -> tuple[RunStore, RunRecord]:
    prepare_environment(state_dir)
    from tasks.run_store import RunStore

    store = RunStore(state_dir).ensure()
    return store, store.load_run(run_id)


def _resume(args: argparse.Namespace) -> int:
    store, record = _load(args.state_dir, args.run_id)
    store.refuse_if_held(record.run_id)
    overrides = [*args.overrides, *args.set_overrides]
    if overrides:
        amend_config(store, record.run_id, overrides)
    print(f"resuming run {record.run_id} (status {record.status})", flush=True)
    return _execute(store, record.run_id)


def amend_config(store: RunStore, run_id: str, overrides: list[str]) -> None:
    """Apply ``overrides`` to the run's recorded config (kept as config.<n>.yaml) and note them in the record."""
    from tasks.preflight import resolve_config
    from tasks.run_store.locks import now_iso
    from tasks.typed_yaml import dump_config_text

    from tasks.tracking.setup import keep_credentials_out

    config = keep_credentials_out(resolve_config(store.config_file(run_id), None, overrides))
    with store.hold(run_id, "rlhf resume (amending the config)") as run:
        store.replace_config(run_id, dump_config_text(config))
        run.record.amendments.append({"time": now_iso(), "overrides": overrides})
        run.save()
    print(f"run {run_id}: config amended with {' '.join(overrides)}", flush=True)


def _rerun_stage(args: argparse.Namespace) -> int:
    from tasks.config import ConfigError

    name = args.name
    if name not in STAGES and not re.fullmatch(rf"({'|'.join(ITERATED)})-[1-9][0-9]*", name):
        raise ConfigError(f"unknown stage {name!r}; choose one of {', '.join(STAGES)}, or one iteration such as "
                          "ppo-iteration-2")
    store, record = _load(args.state_dir, args.run)
    store.refuse_if_held(record.run_id)
    _refuse_other_method(store, record.run_id, name)
    with store.hold(record.run_id, f"rlhf stage {name}") as run:
        run.record.reruns[name] = run.record.reruns.get(name, 0) + 1
        run.save()
    print(f"recomputing {name} of run {record.run_id}: it gets a new artifact key, so every later stage that depends "
          "on it reruns too (a PPO iteration starts fresh from the previous one)", flush=True)
    return _execute(store, record.run_id)


def _refuse_other_method(store: RunStore, run_id: str, name: str) -> None:
    """ConfigError when stage ``name`` belongs to the training method this run does not use (``method``)."""
    from tasks.config import ConfigError, load_config

    stage = re.sub(r"-[0-9]+$", "", name)
    method = load_config(store.config_file(run_id)).method
    wanted = METHOD_STAGES.get(stage, method)
    if wanted != method:
        raise ConfigError(f"run {run_id} trains with method={method}, which has no {stage} stage; recompute one of its "
                          f"own stages, or start a run with method={wanted} (it reuses this run's data-prep, sft, "
                          "reward-model and best-of-n)")


def _list_runs(args: argparse.Namespace) -> int:
    prepare_environment(args.state_dir)
    from tasks.run_store import RunStore

    store = RunStore(args.state_dir)
    listed = store.list_runs(reconcile=False)
    runs = [store.reconcile(record) for record in listed]
    if not runs:
        print(f"no runs in {store.root}")
        return 0
    crashed = [now for was, now in zip(listed, runs) if was.status == "running" and now.status == "crashed"]
    if crashed:
        close_crashed(store, crashed)
    width = max(len("name"), *(len(record.name) for record in runs)) + 2
    print(f"{'run id':<24}{'name':<{width}}{'status':<11}{'stages done':<13}created")
    for record in runs:
        done = sum(1 for s in record.stages.values() if s.status == "completed")
        print(f"{record.run_id:<24}{record.name:<{width}}{record.status:<11}{done:<13}{record.created}")
    return 0


def close_crashed(store: RunStore, records: list[RunRecord]) -> None:
    """Mark runs found crashed as Crashed in Prefect and KILLED in MLflow, as far as those can be reached."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Crashed

    from tasks import tracking
    from tasks.config import load_config

    with get_client(sync_client=True) as client:
        for record in (r for r in records if r.prefect_flow_run_id):
            try:
                state = client.read_flow_run(record.prefect_flow_run_id).state
            except ObjectNotFound:  # the run's Prefect server keeps other records (another PREFECT_API_URL)
                continue
            if state is not None and not state.is_final():
                client.set_flow_run_state(record.prefect_flow_run_id, Crashed(message=record.error), force=True)
    for record in records:
        config = load_config(store.config_file(record.run_id))
        tracking.configure_tracking(store, config.tracking.tracking_uri)
        for run_id in [record.mlflow_run_id, *(s.mlflow_run_id for s in record.stages.values() if s.status == "running")]:
            if run_id:
                tracking.end_run(run_id, "KILLED")
