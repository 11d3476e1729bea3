"""Sweep records: ``sweeps/<sweep_id>/sweep.json``, plain JSON naming the ordinary runs a sweep is made of.

A sweep is a grid of settings x seeds. Each cell is an ordinary run (its own record, config, summary, lock), created
with the sweep so that ``rlhf sweep --resume`` finds every one of them, finished or not. The sweep's record holds
what it was asked (preset, file, overrides, grid, seeds, selection metric) and which run each cell is; its status
and report are written by whoever holds its lock.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.run_store.locks import now_iso

SweepStatus = Literal["running", "completed", "failed"]
SWEEP_STATUSES = ("running", "completed", "failed")


@dataclass
class SweepCell:
    """One run of the sweep: a setting of the grid at one seed."""

    setting: dict[str, str]
    """Grid key -> the value of this setting, as override text (``{'ppo.kl.coef': '0.1'}``)."""
    seed: int
    run_id: str


@dataclass
class SweepRecord:
    """One sweep."""

    sweep_id: str
    preset: str | None
    config_file: str | None
    """The YAML config every run starts from (absolute path), or None."""
    overrides: list[str]
    """``KEY=VALUE`` overrides every run shares."""
    grid: dict[str, list[str]]
    """Grid key -> its values (override text), in the order given."""
    seeds: list[int]
    select: str
    """The metric that names the winner (never a gold one)."""
    cells: list[SweepCell] = field(default_factory=list)
    concurrency: int = 1
    """Runs at a time."""
    kl_budget: float | None = None
    """Settings whose mean final KL (nats per reply) is above it are not eligible to win (None: no budget)."""
    created: str = field(default_factory=now_iso)
    status: SweepStatus = "running"
    error: str | None = None
    ended: str | None = None
    prefect_flow_run_id: str | None = None
    mlflow_run_id: str | None = None
    """The sweep's MLflow parent run: each cell's own parent run is nested under it."""

    def settings(self) -> list[dict[str, str]]:
        """The grid's settings in order (each once)."""
        seen: list[dict[str, str]] = []
        for cell in self.cells:
            if cell.setting not in seen:
                seen.append(cell.setting)
        return seen

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepRecord:
        cells = [SweepCell(**cell) for cell in data.pop("cells", [])]
        record = cls(**data, cells=cells)
        if record.status not in SWEEP_STATUSES:
            raise ValueError(f"unknown status {record.status!r}")
        return record
