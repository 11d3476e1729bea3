"""`rlhf schedule | server`: the pipeline served on a cron schedule by a Prefect deployment, and the persistent local
Prefect server that schedules (and any `rlhf` command on the same state folder) use."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from flows.commands import DEFAULT_STATE_DIR, SERVER_FILE, ensure_prefect_database, prepare_environment, running_server
from flows.prefect_server import die_with_parent, server_port, stop


def add_serving_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register schedule and server."""
    schedule = subparsers.add_parser(
        "schedule", help="run the pipeline on a cron schedule (a Prefect deployment)",
        description="Register a Prefect deployment that starts `rlhf run --preset P --config F KEY=VALUE...` on "
        "CRON, one run at a time. The config is resolved and checked now, exactly as `rlhf run` resolves it, and "
        "again by every scheduled run (so edits to F reach the next run). Without --pool this process serves "
        "the deployment and runs the flows itself (keep it running); with --pool a Prefect worker of that pool "
        "runs them. Needs a Prefect server: `rlhf server`, or PREFECT_API_URL.")
    schedule.add_argument("--cron", required=True, help='cron expression, e.g. "0 3 * * *" (03:00 every day)')
    schedule.add_argument("--timezone", default="UTC", help="timezone of the cron expression (default UTC)")
    schedule.add_argument("--config", metavar="FILE", help="YAML config (merged over --preset)")
    schedule.add_argument("--preset", default="demo", help="preset under infra/presets (default demo)")
    schedule.add_argument("--name", default="rlhf-nightly", help="deployment name (default rlhf-nightly)")
    schedule.add_argument("--pool", metavar="POOL", help="Prefect work pool whose workers run the flows (e.g. "
                          "rlhf-pool of the compose stack); default: serve from this process")
    schedule.add_argument("--state-dir", default=None, help="state folder, as seen by the process that runs the "
                          "flows (default: the config's, .rlhf_state)")
    schedule.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                          help="config overrides, e.g. ppo.kl.coef=0.1 orchestration.stage_timeout_minutes=240")
    schedule.set_defaults(handler=_schedule)
    server = subparsers.add_parser(
        "server", help="a persistent local Prefect server for this state folder (recommended for schedules)",
        description="Start `prefect server start` on 127.0.0.1 with its database in the state folder and keep it "
        "running. `rlhf` commands on the same state folder find it and use it (their runs show in its UI); "
        "other programs need PREFECT_API_URL, which it prints.")
    server.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="state folder (default .rlhf_state)")
    server.add_argument("--port", type=int, default=4200, help="port (default 4200; a free one when taken)")
    server.set_defaults(handler=_server)


def schedule_parameters(args: argparse.Namespace) -> tuple[dict, str]:
    """The deployment's parameters for ``rlhf schedule`` (paths made absolute: the flow may run elsewhere), and
    the resolved config's name; the config is resolved now as ``rlhf run`` would, so mistakes fail here."""
    from tasks.config import ConfigError
    from tasks.preflight import resolve_config
    from tasks.tracking.setup import without_credentials

    config_file = str(Path(args.config).resolve()) if args.config else None
    overrides = list(args.overrides)
    config = resolve_config(config_file, args.preset, overrides + ([f"state_dir={args.state_dir}"] if args.state_dir
                                                                 else []))
    if config.tracking.tracking_uri and without_credentials(config.tracking.tracking_uri)[1] is not None:
        raise ConfigError("tracking.tracking_uri holds a user and password, which the deployment would keep in "
                          "Prefect's database: drop them from the URI and set MLFLOW_TRACKING_USERNAME / "
                          "MLFLOW_TRACKING_PASSWORD where the flows run")
    if args.pool:  # a worker runs the flows in its own folder: relative paths would name other files there
        overrides += absolute_path_overrides(config)
    return ({"preset": args.preset, "config_file": config_file, "overrides": overrides,
             "state_dir": str(Path(config.state_dir).resolve())}, config.name)


def absolute_path_overrides(config: object) -> list[str]:
    """``KEY=VALUE`` overrides that make every relative file or model path of ``config`` absolute (from here)."""
    import json

    from tasks.run_store.keys import relative_paths

    changed = []
    for key, value in relative_paths(config).items():
        absolute = ([str(Path(v).resolve()) for v in value] if isinstance(value, (list, tuple))
                    else str(Path(value).resolve()))
        changed.append(f"{key}={json.dumps(absolute)}")
    return changed


def _schedule(args: argparse.Namespace) -> int:
    from tasks.config import ConfigError

    parameters, name = schedule_parameters(args)
    prepare_environment(parameters["state_dir"])
    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigError("a schedule needs a Prefect server that keeps running: start `rlhf server --state-dir "
                          f"{parameters['state_dir']}` in another terminal (or set PREFECT_API_URL)")
    from flows.deployments import pipeline_deployment

    deployment = pipeline_deployment(parameters["preset"], parameters["config_file"], parameters["overrides"],
                                     name=args.name, cron=args.cron, timezone=args.timezone, work_pool=args.pool,
                                     state_dir=parameters["state_dir"])
    when = f"on cron {args.cron!r} ({args.timezone})"
    if args.pool:
        deployment_id = deployment.apply()
        print(f"deployment rlhf-pipeline/{args.name} ({deployment_id}) runs {name} {when} on work pool {args.pool}; "
              f"a worker runs it: prefect worker start --pool {args.pool}", flush=True)
        return 0
    print(f"serving rlhf-pipeline/{args.name}: {name} {when}, one run at a time; results under "
          f"{parameters['state_dir']}. Keep this process running (Ctrl-C stops and pauses the schedule).", flush=True)
    try:
        return asyncio.run(serve_until_stopped(deployment))
    except KeyboardInterrupt:  # Ctrl-C before serving began: nothing was served, the deployment stays as registered
        return 130


#: Seconds a stop may take after SIGINT or SIGTERM: pausing the schedule, cancelling runs in flight and Prefect's
#: runner teardown. Past it the process exits anyway (the schedule is paused first).
STOP_GRACE_S = 90.0


async def serve_until_stopped(deployment: object, grace_s: float = STOP_GRACE_S) -> int:
    """Serve ``deployment`` until SIGINT or SIGTERM, then stop within ``grace_s`` seconds: pause its schedule first
    (the one thing a stop must do), cancel runs in flight, shut Prefect's runner down; return 0. Prefect's own
    handling (``prefect.serve``) left the process inside its runner's teardown for over five minutes at times, so
    the signals are ours and the stop is bounded: a watchdog ends the process when the teardown (or the interpreter's
    exit after it) outlasts ``grace_s``. A second signal exits at once."""
    from prefect.client.orchestration import get_client
    from prefect.runner import Runner

    runner = Runner(pause_on_shutdown=False, limit=None)
    deployment_id = await runner.aadd_deployment(deployment)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    serving = asyncio.create_task(runner.start())
    await asyncio.sleep(0)  # start() installs its own SIGTERM handler before it first waits; ours replace it

    paused = threading.Event()

    def give_up(reason: str) -> None:
        if paused.is_set():
            _exit_now(0, f"{reason}; exiting (the schedule is paused)")
        _exit_now(1, f"{reason}; exiting with the schedule NOT paused: pause deployment {deployment_id} in the "
                     "Prefect UI or with `prefect deployment pause`")

    def on_signal(number: int) -> None:
        name = signal.Signals(number).name
        if stop.is_set():
            give_up(f"{name} again")
        stop.set()
        watchdog = threading.Timer(grace_s, give_up, args=(f"the stop took over {grace_s:.0f} s after {name}",))
        watchdog.daemon = True  # it must not keep a clean exit waiting
        watchdog.start()

    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, on_signal, number)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not stop.is_set():  # the runner ended by itself: its error, if any, is the command's
        stopped.cancel()
        serving.result()
        return 0
    print("stopping: pausing the schedule, cancelling runs in flight", flush=True)
    async with get_client() as client:
        await client.pause_deployment(deployment_id)
    paused.set()
    await runner.astop()
    await serving
    _end_children()
    return 0


def _end_children(grace_s: float = 10.0) -> None:
    """Terminate the flow runs this process started that are still running (Prefect's cancellation signals them, but
    a run can miss it: its SIGTERM handler raises an exception that is lost when it lands inside a callback), then
    kill what outlives ``grace_s``. An rlhf run ended this way resumes with `rlhf resume`."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _exit_now(code: int, message: str) -> None:
    """End the process from any thread, skipping teardown that hangs (output flushed first)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _server(args: argparse.Namespace) -> int:
    """Run the Prefect server in the foreground, its database and a server.json (its URL) in the state folder."""
    import json
    import subprocess

    from tasks.run_store import RunStore, StateError
    from tasks.run_store.layout import Layout

    root = Path(args.state_dir).resolve()
    running = running_server(root)
    if running is not None:
        raise StateError(f"a Prefect server for {root} runs already: {running} "
                         f"(pid {json.loads((Layout(root).prefect_home / SERVER_FILE).read_text())['pid']})")
    os.environ.pop("PREFECT_API_URL", None)  # this process creates the server's database, it is no client
    prepare_environment(str(root))
    store = RunStore(root).ensure()
    ensure_prefect_database(store)
    port = server_port(args.port)
    url = f"http://127.0.0.1:{port}/api"
    info = store.layout.prefect_home / SERVER_FILE
    process = None
    try:
        # the UI asks the API at PREFECT_UI_API_URL, which otherwise stays on the default port
        env = {**os.environ, "PREFECT_UI_API_URL": url, "PREFECT_SERVER_API_PORT": str(port)}
        process = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                    "--port", str(port)], env=env, preexec_fn=die_with_parent)
        info.write_text(json.dumps({"api_url": url, "pid": process.pid}) + "\n", encoding="utf-8")
        print(f"Prefect server for {root}: UI http://127.0.0.1:{port}; rlhf commands on this state folder use it."
              f"\nOther programs: export PREFECT_API_URL={url}", flush=True)
        return process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        info.unlink(missing_ok=True)
        if process is not None:
            stop(process, grace_s=30)
