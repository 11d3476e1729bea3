"""What the MLflow UI test needs around the browser: the `rlhf` and `mlflow` processes it starts (each stopped
with its whole process group), the compare-runs URL, and the page's tables read back as plain values."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import Locator, Page, expect
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from flows.commands import server_port

BIN = Path(sys.executable).parent  # the virtual environment's scripts: rlhf, mlflow
#: How long a page wait may take: the first load on a busy 2-core machine takes ~10 s.
WAIT_MS = 60_000


def cli_env(state: Path) -> dict[str, str]:
    """The test session's environment without its MLflow store (the CLI then uses ``<state>/mlflow.db``), with
    Prefect's home in the test's folder and one thread per process (a 2-core CI machine runs several)."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(MLFLOW_DISABLE_TELEMETRY="true", PREFECT_HOME=str(state.parent / "prefect"), OMP_NUM_THREADS="1")
    return env


def stop_group(process: subprocess.Popen) -> None:
    """Stop a process started with ``start_new_session`` and everything it started (Prefect's temporary server,
    uvicorn workers): SIGTERM to its group, then SIGKILL to whatever is left after 10 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # the group is gone
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    process.wait()


def run_rlhf(state: Path, *overrides: str, timeout: float = 150) -> None:
    """``rlhf run --preset tiny --state-dir <state> <overrides>``; fails the test with the output's tail."""
    log = state.parent / f"rlhf-run-{'-'.join(overrides)}.log"
    with log.open("w") as out:
        process = subprocess.Popen([str(BIN / "rlhf"), "run", "--preset", "tiny", "--state-dir", str(state),
                                    *overrides], env=cli_env(state), cwd=state.parent, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_group(process)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        verdict = f"exited {code}" if code is not None else f"ran past {timeout:.0f} s"
        raise AssertionError(f"rlhf run {' '.join(overrides)} {verdict} (full output: {log}):\n{tail}")


@contextmanager
def mlflow_server(state: Path, timeout: float = 90) -> Iterator[str]:
    """A real ``mlflow server`` on the run store's SQLite file; yields its base URL once ``/health`` answers.
    No artifact options: the store recorded absolute ``file://`` artifact locations under ``<state>/mlartifacts``.
    One worker: the default four cost a 2-core machine seconds at start and nothing here needs them."""
    port = server_port(0)  # one the system picks
    log = state.parent / "mlflow-server.log"
    with log.open("w") as out:
        process = subprocess.Popen([str(BIN / "mlflow"), "server", "--backend-store-uri",
                                    f"sqlite:///{state}/mlflow.db", "--host", "127.0.0.1", "--port", str(port),
                                    "--workers", "1"], env=cli_env(state), cwd=state.parent, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, process, log, timeout)
        yield url
    finally:
        stop_group(process)


def wait_for_health(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    """Block until the server answers ``/health``; fail with its log if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"mlflow server exited {process.returncode} before answering /health:\n"
                                 f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"mlflow server did not answer {url}/health within {timeout:.0f} s (log: {log})")


def compare_url(base: str, run_ids: Sequence[str], experiment_ids: Sequence[str]) -> str:
    """The UI's compare-runs page (``Routes.getCompareRunPageRoute`` in MLflow's JS bundle): JSON lists in a
    hash route; the columns follow ``run_ids``' order."""
    return f"{base}/#/compare-runs?runs={json.dumps(list(run_ids))}&experiments={json.dumps(list(experiment_ids))}"


def format_metric(value: float) -> str:
    """A metric value as the compare page writes it (``Utils.formatMetric`` in MLflow's JS bundle): 3 decimals
    below 10, 2 below 100, then 1; exponent notation below 0.001; JavaScript's number-to-text."""
    if math.isnan(value):
        return "NaN"
    if value == 0:
        return "0"
    if abs(value) < 1e-3:
        mantissa, exponent = f"{value:.3e}".split("e")
        return f"{mantissa}e{int(exponent):+d}"  # JavaScript writes 1.234e-4 where Python writes 1.234e-04
    scale = 1000 if abs(value) < 10 else 100 if abs(value) < 100 else 10
    rounded = math.floor(value * scale + 0.5) / scale  # Math.round: halves go up, not to even
    return str(int(rounded)) if rounded.is_integer() else repr(rounded)


def run_id_columns(page: Page) -> list[str]:
    """The run ids heading the compare tables, left to right; waits for the runs to load."""
    links = section(page, "Run details").locator("thead a")
    expect(links.first).to_be_visible(timeout=WAIT_MS)
    return [text.strip() for text in links.all_inner_texts()]


def row_cells(page: Page, title: str, header: str) -> list[str]:
    """The cells of one row of a compare table ("Run details", "Parameters", "Tags") in run-column order."""
    cells = section(page, title).locator("tr").filter(has=page.locator("th", has_text=header)).locator("td")
    expect(cells.first).to_be_visible(timeout=WAIT_MS)
    return [text.strip() for text in cells.all_inner_texts()]


def show_diff_only(page: Page, title: str) -> None:
    """Turn on a table's "Show diff only" switch (Parameters, Metrics, Tags)."""
    switch = page.get_by_role("switch", name=f"{title} - Show diff only")
    switch.click(timeout=WAIT_MS)
    expect(switch).to_be_checked(timeout=WAIT_MS)


def param_rows(page: Page) -> dict[str, list[str]]:
    """Every row the Parameters table shows: name -> values in run-column order."""
    rows = section(page, "Parameters").locator("tbody tr")
    expect(rows.first).to_be_visible(timeout=WAIT_MS)
    return {row.locator("th").inner_text().strip(): [t.strip() for t in row.locator("td").all_inner_texts()]
            for row in rows.all()}


def section(page: Page, title: str) -> Locator:
    """One collapsible section of the compare page ("Run details", "Parameters", ...), by its header."""
    header = page.locator(".du-bois-light-collapse-header").filter(has_text=re.compile(f"^{re.escape(title)}$"))
    return page.locator(".du-bois-light-collapse-item").filter(has=header)


# The Metrics table is two react-virtualized grids of 45-px rows in a 300-px window, names and values: only rows
# near each grid's scroll position are in the DOM, and a row's `top` pairs a name with its values. MLflow 3.17
# syncs the names grid to the values grid one scroll event late, so the two are scrolled on their own: each poll
# moves the names grid a window on (back to the top after the bottom) until it shows the row, then brings the
# values grid to that row. null means "poll again".
_METRIC_GRIDS_JS = """
  const toggle = document.querySelector('[aria-label="Metrics - Show diff only"]');
  const section = toggle && toggle.closest('.du-bois-light-collapse-item');
  const [names, values] = section ? section.querySelectorAll('.ReactVirtualized__Grid') : [];
"""
_METRIC_ROW_JS = "([key, runs]) => {" + _METRIC_GRIDS_JS + """
  if (!values) return null;
  const link = [...names.querySelectorAll('a')].find(a => a.textContent.trim() === key);
  if (!link) {
    const atEnd = names.scrollTop + names.clientHeight >= names.scrollHeight - 1;
    names.scrollTop = atEnd ? 0 : names.scrollTop + names.clientHeight;
    return null;
  }
  const top = link.parentElement.style.top;
  const cells = [...values.querySelectorAll('.ReactVirtualized__Grid__innerScrollContainer > div')]
    .filter(cell => cell.style.top === top)
    .sort((a, b) => parseFloat(a.style.left) - parseFloat(b.style.left));
  if (cells.length === runs) return cells.map(cell => cell.textContent.trim());
  values.scrollTop = parseFloat(top);
  return null;
}"""

# Both Metrics grids back to the first row: the values grid first, then (a poll later, once its late sync of the
# names grid is done) the names grid.
_REWIND_METRICS_JS = "() => {" + _METRIC_GRIDS_JS + """
  if (!values) return false;
  if (values.scrollTop !== 0) { values.scrollTop = 0; return false; }
  if (names.scrollTop !== 0) { names.scrollTop = 0; return false; }
  return true;
}"""


def metric_cells(page: Page, key: str, runs: int) -> list[str]:
    """The values the Metrics table shows for ``key`` in its ``runs`` run columns, left to right."""
    try:
        return page.wait_for_function(_METRIC_ROW_JS, arg=[key, runs], polling=200, timeout=WAIT_MS).json_value()
    except PlaywrightTimeout:
        raise AssertionError(f"the compare page's Metrics table shows no row {key!r}") from None


def rewind_metrics(page: Page) -> None:
    """Scroll the Metrics table back to its first rows (metric_cells may have scrolled it)."""
    page.wait_for_function(_REWIND_METRICS_JS, polling=200, timeout=WAIT_MS)
