"""The ``rlhf-sweep`` flow: a sweep's runs (``flows.sweep_plan`` made them) run as tasks and compared in one report.

One Prefect flow run per sweep, named by the sweep id; its runs are tasks (``sweep-run``, ``concurrency`` at a time),
each run's pipeline a subflow (``rlhf-pipeline``, named by the run id). One MLflow parent run holds the sweep's report,
plot and winner, with every run's own parent run nested under it (tag ``rlhf.sweep_id``, ``flows.pipeline``).

Every path continues the same sweep: ``rlhf sweep --resume`` and a Prefect retry of the flow run keep completed runs
and continue the others where they stopped (a PPO iteration from its last checkpoint), as ``rlhf resume`` would.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext
from prefect.runtime import flow_run as current_flow_run
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

from flows.logs import run_logging
from flows.pipeline import rlhf_pipeline
from flows.prefect_server import die_with_parent
from flows.sweep_plan import launch_order, selector, setting_label
from flows.sweep_report import build_report, report_markdown, winner_metrics
from tasks import tracking
from tasks.config import load_config
from tasks.io import write_json
from tasks.plots import save_figure, sweep_frontier
from tasks.run_store import RunStore, SweepRecord

log = logging.getLogger(__name__)

REPORT_MD, REPORT_JSON, PLOT_PNG, LOG_FILE = "sweep_report.md", "sweep_report.json", "sweep_frontier.png", "sweep.log"


@task(name="sweep-run", task_run_name="{label}", persist_result=False, result_serializer="json")
def sweep_run_task(label: str, run_id: str, state_dir: str) -> str:
    """One run of the sweep continued to its end as a subflow (what ``rlhf resume`` does), unless it completed."""
    store = RunStore(state_dir)
    record = store.reconcile(store.load_run(run_id))
    if record.status == "completed" and store.summary_file(run_id).is_file():
        log.info("sweep: %s completed already (run %s)", label, run_id)
        return "completed"
    rlhf_pipeline(run_id=run_id, state_dir=state_dir)
    return "completed"


def _flow_run_name() -> str:
    return str(current_flow_run.parameters["sweep_id"])


@flow(name="rlhf-sweep", flow_run_name=_flow_run_name, persist_result=False, result_serializer="json", log_prints=True)
def rlhf_sweep_flow(sweep_id: str, state_dir: str) -> dict[str, Any]:
    """Run (or continue) sweep ``sweep_id`` under ``state_dir``: its runs, then its report."""
    store = RunStore(state_dir).ensure()
    with (store.hold_sweep(sweep_id, f"Prefect flow run {current_flow_run.id}") as sweep,
          run_logging(store.sweep_file(sweep_id, LOG_FILE))):
        record = sweep.record
        record.prefect_flow_run_id = str(current_flow_run.id) if current_flow_run.id else record.prefect_flow_run_id
        sweep.set_status("running")
        config = load_config(store.config_file(record.cells[0].run_id))
        tracking.configure_tracking(store, config.tracking.tracking_uri)
        with tracking.sweep_run(config.tracking.experiment, sweep_id, _title(record), _params(record)) as mlflow_id:
            record.mlflow_run_id = mlflow_id
            sweep.save()
            report = _report(store, record, _run_cells(record, state_dir))
            _publish(store, record, report, mlflow_id)
        failed = report["failed"]
        sweep.set_status("failed" if failed else "completed",
                         f"runs not completed: {', '.join(failed)}" if failed else None)
    return report


def rlhf_sweep(sweep_id: str, state_dir: str) -> dict[str, Any]:
    """The sweep's flow run, with the task runner of its ``concurrency`` (:func:`runs_runner`). Worker processes, when
    there are any, report to this process's Prefect API (:func:`shared_api`), not to temporary servers of their own."""
    runner = runs_runner(RunStore(state_dir).load_sweep(sweep_id).concurrency)
    with shared_api() if isinstance(runner, ProcessPoolTaskRunner) else contextlib.nullcontext():
        return rlhf_sweep_flow.with_options(task_runner=runner)(sweep_id=sweep_id, state_dir=state_dir)


@contextmanager
def shared_api() -> Iterator[None]:
    """``PREFECT_API_URL`` set, while inside, to the API this process talks to, so that the worker processes it
    starts inherit it: with a temporary server (no ``PREFECT_API_URL``) each would otherwise start a server of its
    own on the same database."""
    from prefect.client.orchestration import get_client

    previous = os.environ.get("PREFECT_API_URL")
    with get_client(sync_client=True) as client:  # starts the temporary server when there is none yet
        os.environ["PREFECT_API_URL"] = str(client.api_url).rstrip("/")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous


def runs_runner(concurrency: int) -> ThreadPoolTaskRunner | ProcessPoolTaskRunner:
    """One run at a time in this process's main thread (:func:`_run_cells` calls the task there; the runner is
    unused); or ``concurrency`` worker processes, a run in each. Never in another thread: a signal (SIGTERM, Ctrl-C)
    reaches the main thread only, and a run in a worker thread went on computing after the sweep had stopped. Never
    threads side by side either: loading a model is not thread-safe (transformers creates it on the meta device by
    patching torch for the whole process), and two runs in threads crashed with "Cannot copy out of meta tensor"."""
    return (ThreadPoolTaskRunner(max_workers=1) if concurrency == 1 else
            RunsProcessPool(max_workers=concurrency, initializer=detach_worker))


def detach_worker() -> None:
    """In each worker process, before its first run: a session of its own, so that a signal to the sweep's process
    group (Ctrl-C in a terminal, `timeout`, a service manager's stop) reaches the sweep alone, which then stops each
    worker once (:class:`RunsProcessPool`; a second SIGTERM landing in a worker's clean-up left MLflow's SQLite
    database locked for the others); and SIGKILL when the sweep's process dies without stopping it (as a SIGKILL to
    the group did before). The kernel ties that SIGKILL to the thread that started the worker: Prefect's pool starts
    them from its resolver threads, which live until the pool has shut down, after its workers."""
    os.setsid()
    die_with_parent(signal.SIGKILL)


#: Seconds a stopped sweep's worker processes get between SIGTERM and SIGKILL.
WORKER_STOP_GRACE_S = 60.0


class RunsProcessPool(ProcessPoolTaskRunner):
    """Prefect's process pool, stopped with the sweep. A sweep stopped by a signal (SIGTERM, which Prefect turns into
    an exception in the sweep's process, or Ctrl-C) would otherwise wait for the runs in flight to finish (the pool's
    shutdown waits for running work: half an hour and more in the demo's sweeps); here each worker gets SIGTERM, so
    its run stops as `rlhf run` stops (recorded, resumable with ``rlhf sweep --resume``), and SIGKILL after
    ``WORKER_STOP_GRACE_S``."""

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self._stop_workers()
        super().__exit__(exc_type, exc_value, traceback)

    def _stop_workers(self) -> None:
        import threading

        workers = list(getattr(self._executor, "_processes", {}).values())  # the stdlib pool's own processes
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.terminate()

        def kill_survivors() -> None:
            for worker in workers:
                with contextlib.suppress(Exception):
                    if worker.is_alive():
                        worker.kill()

        killer = threading.Timer(WORKER_STOP_GRACE_S, kill_survivors)
        killer.daemon = True
        killer.start()


def _run_cells(record: SweepRecord, state_dir: str) -> dict[str, str]:
    """Each run's task, submitted in :func:`~flows.sweep_plan.launch_order` (a seed's first run computes what the
    others reuse, while runs of other seeds use the other slots); a run that fails is recorded (its own record and log
    say why) and the others go on. At ``concurrency`` 1 each run is called here, in this thread
    (:func:`runs_runner`)."""
    calls = [(f"{setting_label(cell.setting)} seed={cell.seed}", cell.run_id, state_dir)
             for cell in launch_order(record.cells)]
    if record.concurrency == 1:
        results = {call[1]: functools.partial(sweep_run_task, *call) for call in calls}
    else:
        futures = {call[1]: sweep_run_task.submit(*call) for call in calls}
        results = {run_id: future.result for run_id, future in futures.items()}
    statuses = {}
    for run_id, result in results.items():
        try:
            statuses[run_id] = result()
        except Exception as error:  # the run's record, log and Prefect subflow hold the details
            statuses[run_id] = "failed"
            log.warning("sweep %s: run %s failed: %s", record.sweep_id, run_id, " ".join(str(error).split())[:300])
    return statuses


def _title(record: SweepRecord) -> str:
    return f"sweep {' x '.join(record.grid)} · {len(record.seeds)} seeds · {record.sweep_id.rsplit('-', 1)[-1]}"


def _params(record: SweepRecord) -> dict[str, str]:
    return {"sweep.preset": record.preset or "none", "sweep.config_file": record.config_file or "none",
            "sweep.seeds": ",".join(map(str, record.seeds)), "sweep.select": record.select,
            "sweep.kl_budget": "none" if record.kl_budget is None else f"{record.kl_budget:g}",
            "sweep.overrides": " ".join(record.overrides) or "none", "sweep.concurrency": str(record.concurrency),
            **{f"sweep.grid.{key}": ",".join(values) for key, values in record.grid.items()}}


def _report(store: RunStore, record: SweepRecord, statuses: Mapping[str, str]) -> dict[str, Any]:
    """The report over every run of the sweep (one that did not complete counts as missing)."""
    cells = []
    for cell in record.cells:
        run = store.load_run(cell.run_id)
        summary_file = store.summary_file(cell.run_id)
        done = run.status == "completed" and summary_file.is_file()
        cells.append({"setting": cell.setting, "seed": cell.seed, "run_id": cell.run_id,
                      "status": "completed" if done else statuses.get(cell.run_id, run.status),
                      "summary": json.loads(summary_file.read_text(encoding="utf-8")) if done else None})
    return build_report(record.sweep_id, selector(record.select), cells, record.kl_budget)


def _publish(store: RunStore, record: SweepRecord, report: dict[str, Any], mlflow_id: str) -> None:
    """The report as files beside the sweep's record, on its MLflow run (description, files, tags, the winner's
    means) and as the Prefect flow run's markdown artifact."""
    markdown = report_markdown(report)
    md, data, plot = (store.sweep_file(record.sweep_id, name) for name in (REPORT_MD, REPORT_JSON, PLOT_PNG))
    md.write_text(markdown, encoding="utf-8")
    write_json(report, data)
    save_figure(sweep_frontier(report["settings"], report["best_of_n"],
                               title=f"sweep {record.sweep_id}: final policies against KL"), plot)
    for path in (md, data, plot):
        tracking.log_file(mlflow_id, path)
    tracking.set_description(mlflow_id, markdown)
    tracking.set_tags(mlflow_id, {"rlhf.sweep.winner": report["winner"] or "none",
                                  "rlhf.sweep.runs": str(len(record.cells)),
                                  "rlhf.sweep.failed": str(len(report["failed"]))})
    tracking.log_metrics(mlflow_id, winner_metrics(report))
    if FlowRunContext.get() is not None:
        create_markdown_artifact(markdown, key="rlhf-sweep-report", description=f"rlhf sweep {record.sweep_id}")
    log.info("sweep %s: winner by %s: %s", record.sweep_id, report["select"], report["winner"] or "none")
