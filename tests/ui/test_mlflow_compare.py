"""Compare runs in the MLflow UI: two tiny runs that differ only in ``ppo.kl.coef``, side by side on a
real ``mlflow server``'s compare-runs page in headless Chromium, checked from the page's DOM against MlflowClient.

``RLHF_SAVE_SCREENSHOTS=1`` also copies the page's screenshot to docs/screenshots/mlflow-compare.png.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Run
from playwright.sync_api import Page, expect, sync_playwright

from tests.ui.mlflow_ui import (WAIT_MS, compare_url, format_metric, metric_cells, mlflow_server, param_rows,
                                rewind_metrics, row_cells, run_id_columns, run_rlhf, show_diff_only)

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")  # Debian's package (.ci/install); Playwright's own browser download is closed
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1600, "height": 1000}
EXPERIMENT = "rlhf-tiny"
KL_COEFS = ("0.05", "0.2")
#: The parent run's headline metrics (heldout-eval logs them there, step = iteration) the page must show.
HEADLINE_METRICS = ("eval/gold/mean", "eval/kl/mean")
DOC_SCREENSHOT = REPO / "docs" / "screenshots" / "mlflow-compare.png"

needs_chromium = pytest.mark.skipif(not CHROMIUM.is_file(),
                                    reason=f"no Chromium at {CHROMIUM}: `apt-get install chromium` (.ci/install does)")


@dataclass(frozen=True)
class ComparedRuns:
    """The state folder of the two pipeline runs and their MLflow parent runs, in KL_COEFS order."""

    state: Path
    parents: list[Run]


@pytest.fixture
def compared_runs(tmp_path: Path) -> ComparedRuns:
    """One tiny run per KL coefficient in one state folder (the second reuses every stage before PPO)."""
    state = tmp_path / "state"
    parents: list[Run] = []
    for coef in KL_COEFS:
        run_rlhf(state, f"ppo.kl.coef={coef}")
        # The client is made only now: opening a missing SQLite store would create it from this process.
        client = MlflowClient(tracking_uri=f"sqlite:///{state}/mlflow.db")
        seen = {run.info.run_id for run in parents}
        new = [run for run in pipeline_parents(client) if run.info.run_id not in seen]
        assert len(new) == 1, f"rlhf run ppo.kl.coef={coef} made {len(new)} new pipeline parent runs, not one"
        parents.append(new[0])
    return ComparedRuns(state, parents)


def pipeline_parents(client: MlflowClient) -> list[Run]:
    """The experiment's pipeline parent runs (tag ``rlhf.kind=pipeline``), not its per-stage child runs."""
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, f"the runs logged no MLflow experiment {EXPERIMENT!r}"
    return client.search_runs([experiment.experiment_id], "tags.`rlhf.kind` = 'pipeline'")


@pytest.fixture
def mlflow_ui(compared_runs: ComparedRuns) -> Iterator[str]:
    """The base URL of an ``mlflow server`` on the runs' store, stopped after the test."""
    with mlflow_server(compared_runs.state) as url:
        yield url


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    """A headless Chromium page on a fresh profile in tmp_path."""
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path / "chromium-profile", executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport=VIEWPORT)
        try:
            yield context.new_page()
        finally:
            context.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_chromium
def test_compare_page_shows_both_runs_their_kl_coef_and_headline_metrics(compared_runs, mlflow_ui, page, tmp_path):
    parents = compared_runs.parents
    for parent, coef in zip(parents, KL_COEFS):
        assert parent.data.params["ppo.kl.coef"] == coef
        missing = [key for key in HEADLINE_METRICS if key not in parent.data.metrics]
        assert not missing, f"parent run {parent.info.run_name!r} has no {missing} (heldout-eval logs them there)"
    run_ids = [parent.info.run_id for parent in parents]
    page.goto(compare_url(mlflow_ui, run_ids, sorted({parent.info.experiment_id for parent in parents})))

    columns = run_id_columns(page)
    names = row_cells(page, "Run details", "Run Name:")
    show_diff_only(page, "Parameters")
    params = param_rows(page)
    metrics = {key: metric_cells(page, key, len(parents)) for key in HEADLINE_METRICS}
    save_screenshot(page, tmp_path / "compare.png")

    assert columns == run_ids
    assert names == [parent.info.run_name for parent in parents]
    assert params["ppo.kl.coef"] == list(KL_COEFS)
    assert params == differing_params(parents), "the page's diff-only Parameters table differs from MLflow's"
    for key, shown in metrics.items():
        assert shown == [format_metric(parent.data.metrics[key]) for parent in parents], key
    if os.environ.get("RLHF_SAVE_SCREENSHOTS") == "1":
        DOC_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "compare.png", DOC_SCREENSHOT)


def differing_params(parents: list[Run]) -> dict[str, list[str]]:
    """Parameters whose values differ between the runs, as the page's diff-only table writes them ('' = unset;
    the page would pretty-print a value that parses as a JSON list or object, and none differs here)."""
    keys = sorted(set().union(*(parent.data.params for parent in parents)))
    values = {key: [parent.data.params.get(key, "") for parent in parents] for key in keys}
    return {key: row for key, row in values.items() if len(set(row)) > 1}


def save_screenshot(page: Page, path: Path) -> None:
    """The whole comparison in one image. The page scrolls inside <main>, so a full-page shot alone would show
    only the chart: the viewport grows to the content's height instead. MLflow's assistant panel, which opens by
    itself on a fresh profile and covers a quarter of the page, is closed first."""
    close = page.locator('[data-assistant-ui="true"]').get_by_role("button", name="Close")
    if close.count():
        close.click()
        expect(close).to_be_hidden(timeout=WAIT_MS)
    rewind_metrics(page)
    # The parallel-coordinates chart draws after the tables (a grey placeholder until then).
    expect(page.locator(".js-plotly-plot text.axis-title").first).to_be_visible(timeout=WAIT_MS)
    hidden = page.evaluate("() => { const main = document.querySelector('main'); "
                           "return main.scrollHeight - main.clientHeight; }")
    page.set_viewport_size({"width": VIEWPORT["width"], "height": min(VIEWPORT["height"] + hidden, 4000)})
    page.screenshot(path=path, full_page=True)


@pytest.mark.parametrize("value, shown", [
    (-2.2, "-2.2"), (-0.0073354, "-0.007"), (15.25, "15.25"), (16.0, "16"), (0.0, "0"), (0.0004567, "4.567e-4"),
    (-0.0004, "-4.000e-4"), (12.345, "12.35"), (123.45, "123.5"), (0.0025, "0.003"), (float("nan"), "NaN"),
])
def test_metric_values_are_formatted_as_the_ui_writes_them(value, shown):
    assert format_metric(value) == shown
