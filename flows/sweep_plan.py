"""What ``rlhf sweep`` will run, decided and checked before any run exists: the grid, the seeds, the cells (one ordinary
run per setting and seed) and the metric that names the winner.

Refused in one line, before anything is created: an unknown key or an invalid value (as ``rlhf run`` refuses it), a
key given twice, ``seed`` in the grid (``--seeds`` says them), a key that enters no stage (runs differing only there
would compute the same things), and any selection metric that reads gold, which only evaluates.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_core.evaluation.metrics import frontier_at
from tasks.config import ConfigError, PipelineConfig
from tasks.preflight import resolve_config
from tasks.run_store import SweepCell
from tasks.run_store.keys import canonical
from tasks.typed_yaml import one_line

#: A sweep's runs share PPO iterations and branch from them (the same iteration 1, another refresh or KL after it;
#: later sweeps too), and each run's publication prunes its chain's older resume states: so unless the sweep sets it,
#: its runs keep every iteration's state (retention only: the artifact keys, and so the cache, are the same).
KEEP_STATES = "ppo.keep_resume_states"

NOT_IN_GRID = {"seed": "give seeds with --seeds (e.g. --seeds 0,1,2)",
               "state_dir": "a sweep's runs share one state folder: give it with --state-dir"}


@dataclass(frozen=True)
class Selector:
    """A score of a run's final policy that ``--select`` may rank settings by (higher is better)."""

    name: str
    score: Callable[[Mapping[str, Any]], float | None]
    """The score from a run's summary (``iterations[-1]``: the last evaluation's metrics; ``best_of_n``: its seed's
    best-of-N points); None where the summary lacks what it needs."""
    description: str


def final_metric(key: str) -> Callable[[Mapping[str, Any]], float | None]:
    """The score that is one metric of the last evaluation."""
    return lambda summary: summary["iterations"][-1].get(key)


def heldout_frontier_gain(summary: Mapping[str, Any]) -> float | None:
    """The final held-out mean minus the seed's best-of-N held-out curve at the final KL (``frontier_at``: linear,
    continued past best-of-N's largest n); None without a best-of-N curve."""
    final = summary["iterations"][-1]
    points = [(p["kl"], p["heldout"]) for p in summary.get("best_of_n") or [] if p.get("heldout") is not None]
    if len(points) < 2 or final.get("eval/heldout/mean") is None or final.get("eval/kl/mean") is None:
        return None
    return final["eval/heldout/mean"] - frontier_at(points, final["eval/kl/mean"])


SELECTORS = {s.name: s for s in (
    Selector("heldout", final_metric("eval/heldout/mean"),
             "the held-out reward model's mean score of the final policy's replies"),
    Selector("frontier", heldout_frontier_gain,
             "the held-out reward model's gain over best-of-N from the SFT policy at the same KL"),
    Selector("heldout_win_rate", final_metric("eval/win_rate/heldout"),
             "how often the held-out reward model prefers the final policy's reply to the SFT policy's"),
    Selector("proxy", final_metric("eval/proxy/mean"),
             "the proxy reward model's mean score (what PPO optimised: easy to hack)"),
)}
DEFAULT_SELECT = "heldout"


def selector(name: str) -> Selector:
    """The ``--select`` metric; ConfigError in one line for gold (evaluation only) or an unknown name."""
    if "gold" in name.lower():
        raise ConfigError(f"--select {name}: gold is evaluation-only and never chooses settings (not even through the "
                          f"hacking verdict); select on the held-out reward model: {', '.join(SELECTORS)}")
    if name not in SELECTORS:
        raise ConfigError(f"--select {name!r} is not a metric a sweep selects on; choose one of {', '.join(SELECTORS)}")
    return SELECTORS[name]


def split_values(text: str) -> list[str]:
    """``'0.1,0.2'`` -> ['0.1', '0.2']; commas inside brackets or quotes stay (``'[1,2],[3]'`` -> two values)."""
    values, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    values.append("".join(current).strip())
    return values


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``--grid KEY=V1,V2`` items -> {key: [values]}, in the order given."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        values = split_values(text) if sep else []
        if not key or not values or any(not v for v in values):
            raise ConfigError(f"--grid {one_line(item)!r}: write KEY=V1,V2[,...] (e.g. --grid ppo.kl.coef=0.02,0.05)")
        if key in grid:
            raise ConfigError(f"--grid gives {key} twice; list all its values in one --grid {key}=...")
        if key in NOT_IN_GRID:
            raise ConfigError(f"--grid {key}: {NOT_IN_GRID[key]}")
        if len(set(values)) != len(values):
            raise ConfigError(f"--grid {key} lists a value twice ({one_line(text)}); each setting runs once")
        grid[key] = values
    if not grid:
        raise ConfigError("give at least one --grid KEY=V1,V2 (the settings to compare)")
    return grid


def parse_seeds(text: str) -> list[int]:
    """``'0,1,2'`` -> [0, 1, 2] (distinct integers >= 0)."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {one_line(text)!r}: write whole numbers separated by commas, e.g. --seeds 0,1,2") \
            from None
    if any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {one_line(text)!r}: each seed once, each >= 0")
    return seeds


@dataclass(frozen=True)
class CellPlan:
    """One run to create: a setting of the grid at a seed, with its resolved config."""

    setting: dict[str, str]
    seed: int
    overrides: list[str]
    """What the run is resolved from after the preset and file: the shared overrides, the setting, the seed."""
    config: PipelineConfig


def plan_cells(config_file: str | None, preset: str | None, overrides: Sequence[str], grid: Mapping[str, list[str]],
               seeds: Sequence[int]) -> list[CellPlan]:
    """Every cell, seed by seed (a seed's shared stages are computed by its first cell and reused by the others),
    each config resolved as ``rlhf run`` would (a bad key or value is refused here, naming the cell's override).
    :func:`refuse_inert_keys` is the next check (it imports the flow, so it comes after Prefect is configured)."""
    shared = {item.partition("=")[0].strip() for item in overrides}
    both = sorted(shared & set(grid))
    if both:
        raise ConfigError(f"{', '.join(both)} given both as --grid and as KEY=VALUE; keep it in --grid only")
    if "seed" in shared:
        raise ConfigError("seed given as KEY=VALUE; a sweep's seeds are --seeds (e.g. --seeds 0,1,2)")
    keys = list(grid)
    cells = []
    for seed in seeds:
        for values in itertools.product(*(grid[k] for k in keys)):
            setting = dict(zip(keys, values, strict=True))
            cell_overrides = [*overrides, *(f"{k}={v}" for k, v in setting.items()), f"seed={seed}"]
            config = resolve_config(config_file, preset, cell_overrides)
            if KEEP_STATES not in shared | set(grid) and config.ppo.keep_resume_states < config.ppo.iterations:
                cell_overrides.append(f"{KEEP_STATES}={config.ppo.iterations}")
                config = resolve_config(config_file, preset, cell_overrides)
            cells.append(CellPlan(setting, seed, cell_overrides, config))
    return cells


def launch_order(cells: Sequence[SweepCell]) -> list[SweepCell]:
    """``cells`` (in plan order, seed by seed) in the order their runs start: the first of every seed, then the second
    of every seed, and so on. Runs side by side are then of different seeds while there are as many seeds as slots,
    so none waits for a run of its own seed to compute the stages they share (in plan order, the second slot went to
    a run that waited for the first to finish SFT and the reward models, or every iteration a longer run continues)."""
    rank: dict[int, int] = {}
    positions = []
    for index, cell in enumerate(cells):
        positions.append((rank.get(cell.seed, 0), index))
        rank[cell.seed] = rank.get(cell.seed, 0) + 1
    return [cells[index] for _, index in sorted(positions)]


def refuse_inert_keys(cells: Sequence[CellPlan]) -> None:
    """ConfigError for a grid key none of whose values changes any stage's config slice (at the first seed, the other
    keys at their first values): runs that differ only there would compute the same things."""
    first_seed, keys = cells[0].seed, list(cells[0].setting)
    for key in keys:
        others = {k: v for k, v in cells[0].setting.items() if k != key}
        varying = [c for c in cells if c.seed == first_seed and all(c.setting[k] == v for k, v in others.items())]
        slices = [stage_slices(c.config) for c in varying]
        if len(slices) > 1 and all(s == slices[0] for s in slices[1:]):
            raise ConfigError(f"--grid {key}: it enters no stage (every stage gets the same settings whatever its "
                              "value, so the runs would compute the same things); sweep a setting a stage reads")


def stage_slices(config: PipelineConfig) -> dict[str, Any]:
    """Every stage's config slice that ``config`` runs, by label, in the canonical form its artifact key hashes: two
    configs with equal slices compute the same things (the state folder, tracking and retention enter none)."""
    from flows.pipeline import stage_configs  # the flow knows which stages run

    return {label: canonical(slice_) for label, slice_ in stage_configs(config).items()}


def setting_label(setting: Mapping[str, str]) -> str:
    """``ppo.kl.coef=0.1 ppo.learning_rate=3e-4``: how a setting is named in tables, plots and MLflow."""
    return " ".join(f"{k}={v}" for k, v in setting.items())


def absolute_config(config_file: str | None) -> str | None:
    """The config file as an absolute path (a resumed sweep may run from another folder)."""
    return str(Path(config_file).resolve()) if config_file else None
