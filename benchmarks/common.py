"""What every benchmark shares: the machine description, peak memory, medians and the JSON result file."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (falls back to ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """CPU, cores, torch threads, RAM, library versions and the load average at the time of the call.

    The load average matters: timings taken while other jobs share the cores are slower and noisier.
    """
    load1, load5, load15 = os.getloadavg()
    return {
        "cpu_model": cpu_model(),
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "trl": _version("trl"),
        "accelerate": _version("accelerate"),
        "cuda_available": torch.cuda.is_available(),
        "load_average": {"1min": round(load1, 2), "5min": round(load5, 2), "15min": round(load15, 2)},
    }


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def rss_mib() -> float:
    """Current resident set size of this process, MiB."""
    return psutil.Process().memory_info().rss / 2**20


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (a float, for JSON)."""
    if not values:
        raise ValueError("median of an empty sequence; the benchmark produced no measurements")
    return float(statistics.median(values))


def default_out(name: str, smoke: bool) -> Path:
    """``benchmarks/results/<name>.json``; smoke runs go to ``<name>.smoke.json`` (git-ignored)."""
    return RESULTS / (f"{name}.smoke.json" if smoke else f"{name}.json")


def write_result(payload: dict[str, Any], out: Path) -> None:
    """Print ``payload`` as JSON and write it to ``out`` (atomically: a killed run leaves no half file)."""
    text = json.dumps(payload, indent=2, sort_keys=False)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(out)
