"""The temporary Prefect server of an `rlhf` command that has no server to report to (and the helpers every
server the commands start uses: a free local port, and an end tied to the process that started it).

Prefect would start one itself, in the command's process group: a signal to the group (`timeout`, a service
manager's stop, a cluster's time limit) then ended the server together with the command, and the command, stopping,
retried every report of how its runs ended against the dead server for half an hour
(``PREFECT_CLIENT_MAX_RETRIES``). This one runs in a session of its own, so the signal reaches the command but not
the server; the server stops when the command exits (``atexit``), and the kernel sends it SIGTERM when the command
dies without exiting (SIGKILL; ``PR_SET_PDEATHSIG``, Linux).

    python -m flows.prefect_server PORT    # what start_temporary_server runs: the API only, no UI, no services
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import subprocess
import sys
import time
import urllib.request

#: Tries at a free port: the port is probed free and then bound by the server, and another process may take it between.
PORT_TRIES = 3


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child process before it starts its work: ``sig`` to it when the thread that started it ends, the process
    that started it dying even by SIGKILL (Linux; elsewhere a clean exit still stops it)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def server_port(preferred: int) -> int:
    """``preferred`` when nothing listens on it, else a port the system picks."""
    import socket

    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is free
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def start_temporary_server(startup_timeout_s: float) -> str:
    """Start the server (from the main thread: the kernel's signal follows the thread that started it) on the
    database the current Prefect settings name; returns its API URL once it answers. RuntimeError (one line) when it
    does not within ``startup_timeout_s``, or exits by itself on every try."""
    deadline, process = time.monotonic() + startup_timeout_s, None
    for _ in range(PORT_TRIES):
        port = server_port(0)
        process = subprocess.Popen([sys.executable, "-m", "flows.prefect_server", str(port)],
                                   start_new_session=True, preexec_fn=die_with_parent)
        atexit.register(stop, process)
        url = f"http://127.0.0.1:{port}/api"
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        return url
            time.sleep(0.1)
        stop(process)
        if time.monotonic() >= deadline:
            break
    if process is not None and process.returncode not in (None, -signal.SIGTERM, -signal.SIGKILL):  # not stopped: ended
        raise RuntimeError(f"Prefect's temporary server exited with status {process.returncode} on each of "
                           f"{PORT_TRIES} ports (its error is above)")
    raise RuntimeError(f"Prefect's temporary server did not answer within {startup_timeout_s:g} s "
                       "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); on a busy machine start a persistent one "
                       "with `rlhf server` in another terminal")


def stop(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM, and SIGKILL after ``grace_s``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(port: int) -> None:
    import uvicorn
    from prefect.server.api.server import create_app

    uvicorn.run(create_app(ephemeral=True, final=True), host="127.0.0.1", port=port, log_level="error",
                lifespan="on")


if __name__ == "__main__":
    main(int(sys.argv[1]))
