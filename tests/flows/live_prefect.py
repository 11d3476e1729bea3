"""For tests against a real Prefect server: processes started in their own sessions (and every descendant seen,
so that a test can prove none is left), and a small client of the server's REST API.

The client is plain httpx on the server's URL: the test session's own Prefect settings (a test harness) must not
decide where it looks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
FINAL_STATES = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
T = TypeVar("T")


def clean_env(**extra: str) -> dict[str, str]:
    """The user's environment without the test session's Prefect and MLflow settings, one torch thread; a process
    started with it writes every thread's Python stack to its log on SIGABRT (how `stop` shows a hang)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MLFLOW_DISABLE_TELEMETRY="true", PYTHONFAULTHANDLER="1",
               **extra)
    return env


def rlhf(*args: str) -> list[str]:
    """The `rlhf` command line of this checkout."""
    return [sys.executable, "-m", "flows.cli", *args]


def wait_for(what: str, check: Callable[[], T | None], timeout: float, interval: float = 1.0,
             explain: Callable[[], str] = lambda: "") -> T:
    """Poll ``check`` until it returns something other than None (or False); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{explain()}")
        time.sleep(interval)


class Processes:
    """The processes a test started, each the leader of its own session; ``stop`` signals one, ``kill_all`` ends
    every one left (whole sessions, and descendants that left them), ``leftovers`` lists what still runs."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: dict[str, subprocess.Popen] = {}
        self.seen: set[psutil.Process] = set()

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        """Start ``argv`` with its output in ``<logs>/<name>.log``."""
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "wb") as out:
            process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        self.started[name] = process
        self.seen.add(psutil.Process(process.pid))
        return process

    def output(self, name: str) -> str:
        """What a process wrote so far (stdout and stderr)."""
        path = self.logs / f"{name}.log"
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""

    def log(self, name: str, chars: int = 4000) -> str:
        """The end of a process's output, headed by its name (for failure messages)."""
        return f"--- {name} output (last {chars} chars) ---\n{self.output(name)[-chars:]}"

    def logs_of_all(self) -> str:
        return "\n".join(self.log(name) for name in self.started)

    def running(self, name: str) -> bool:
        """True while process ``name`` runs (noting its descendants); a failure with every output otherwise."""
        process = self.started[name]
        assert process.poll() is None, f"{name} exited ({process.returncode})\n{self.logs_of_all()}"
        self.note_descendants()
        return True

    def note_descendants(self) -> None:
        """Remember every current descendant of the started processes (a later check needs them)."""
        for process in list(self.seen):
            try:
                self.seen.update(process.children(recursive=True))
            except psutil.Error:
                continue

    def stop(self, name: str, sig: signal.Signals, timeout: float = 300) -> int:
        """Send ``sig`` to the process alone (as a user would) and wait for its exit code. (A served schedule pauses
        itself and shuts its runner down first, within `serving.STOP_GRACE_S`.) A process still there after
        ``timeout`` gets SIGABRT, and the failure shows its threads' stacks."""
        self.note_descendants()
        process = self.started[name]
        process.send_signal(sig)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER (clean_env): every thread's stack to its log
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            raise AssertionError(f"{name} did not exit within {timeout} s of {sig.name}; its stacks then:\n"
                                 f"{self.log(name, chars=20000)}") from None

    def kill_all(self) -> None:
        """SIGKILL every session started here and every descendant seen; reap the started processes."""
        self.note_descendants()
        for process in self.started.values():
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for process in self.seen | set(self._in_our_sessions()):
            try:
                process.kill()
            except psutil.Error:
                pass
        for process in self.started.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def leftovers(self) -> list[psutil.Process]:
        """Processes started here, their descendants seen, or members of their sessions, still running."""
        candidates = self.seen | set(self._in_our_sessions())
        return [p for p in candidates if _alive(p)]

    def _in_our_sessions(self) -> list[psutil.Process]:
        sessions = {process.pid for process in self.started.values()}
        found = []
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) in sessions:
                    found.append(process)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        return found


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


RETRY_STATUSES = (429, 502, 503)
RETRY_WAITS = (1.0, 2.0, 4.0, 8.0)
"""Seconds between tries, as Prefect's client backs off (``PREFECT_CLIENT_MAX_RETRIES`` = 5 tries by default)."""


class PrefectApi:
    """The few calls of a Prefect server's REST API (``.../api``) the tests need."""

    def __init__(self, api_url: str) -> None:
        self.http = httpx.Client(base_url=api_url.rstrip("/") + "/", timeout=30)

    def close(self) -> None:
        self.http.close()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        response = self._send("POST", path, json=body)
        response.raise_for_status()
        return response.json()

    def _get(self, path: str) -> Any:
        response = self._send("GET", path)
        response.raise_for_status()
        return response.json()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request, retried on the statuses Prefect's own client retries (429, 502, 503): the server answers 503
        when its database is busy (SQLite locked on a loaded machine) and rolls the request back."""
        for wait in (*RETRY_WAITS, None):
            response = self.http.request(method, path, **kwargs)
            if response.status_code not in RETRY_STATUSES or wait is None:
                return response
            time.sleep(wait)
        raise AssertionError("unreachable")

    def deployment(self, flow: str, name: str) -> dict[str, Any] | None:
        """The deployment ``flow/name``, or None while it does not exist."""
        response = self._send("GET", f"deployments/name/{flow}/{name}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def deployment_by_id(self, deployment_id: str) -> dict[str, Any]:
        return self._get(f"deployments/{deployment_id}")

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        return self._get(f"flow_runs/{flow_run_id}")

    def flow_runs(self, deployment_id: str) -> list[dict[str, Any]]:
        """Every flow run of the deployment, scheduled ones included, by expected start time."""
        return self._post("flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}},
                                               "sort": "EXPECTED_START_TIME_ASC"})

    def create_flow_run(self, deployment_id: str) -> dict[str, Any]:
        """A flow run of the deployment now, with its own parameters (the UI's "Quick run")."""
        return self._post(f"deployments/{deployment_id}/create_flow_run", {})

    def artifacts(self, flow_run_id: str) -> list[dict[str, Any]]:
        return self._post("artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})

    def log_messages(self, flow_run_id: str) -> list[str]:
        """Every log message the flow run sent, oldest first."""
        messages: list[str] = []
        while True:
            page = self._post("logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                              "sort": "TIMESTAMP_ASC", "offset": len(messages), "limit": 200})
            messages += [entry["message"] for entry in page]
            if len(page) < 200:
                return messages


def state_type(flow_run: dict[str, Any]) -> str | None:
    state = flow_run.get("state") or {}
    return state.get("type")
