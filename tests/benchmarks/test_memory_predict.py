"""The predicted-vs-measured memory benchmark runs end to end on tiny models (``--smoke``) and reports, per setup,
the calculator's prediction for the same setup next to the worker's measurement.

Tiny models measure nothing about the formulas (the import baseline's noise is larger than their weights); this
checks the script, its JSON and that the prediction is the calculator's for the worker's setup.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.memory.calculator import phases, roles
from benchmarks.memory.predict import SETUPS, SMOKE_PPO, SMOKE_SIZE, run_shape
from benchmarks.memory.shapes import gpt2_shape

REPO = Path(__file__).resolve().parents[2]


def test_worker_setups_map_to_run_shapes() -> None:
    shape = gpt2_shape(SMOKE_SIZE)
    full, free = run_shape("full", False, SMOKE_PPO), run_shape("critic_free", False, SMOKE_PPO)
    head, critic = run_shape("lora_head", False, SMOKE_PPO), run_shape("lora_critic", False, SMOKE_PPO)
    # four fp32 models (reference and scorer frozen: 4 bytes each), policy and critic trained with AdamW:
    # 4 (weights) + 4 (gradients) + 8 (two moments)
    psi_p, psi_r = roles(shape, full).policy.weights // 4, roles(shape, full).value.weights // 4
    assert phases(shape, full)["training"]["weights_and_states"] == 4 * (psi_p + psi_r) + 16 * (psi_p + psi_r)
    assert roles(shape, free).value.training == 0 and phases(shape, free)["training"]["critic_activations"] == 0
    assert head.lora_rank and critic.lora_rank and head.value_model == "head" and critic.value_model == "critic"
    assert run_shape("full", True, SMOKE_PPO).gradient_checkpointing


@pytest.mark.slow
def test_memory_predict_smoke(tmp_path: Path) -> None:
    out = tmp_path / "memory_predict.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory.predict", "--smoke", "--out", str(out)],
                          cwd=REPO, check=False, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout) == result
    assert [(r["setup"], r["gradient_checkpointing"]) for r in result["setups"]] == list(SETUPS)
    for record in result["setups"]:
        assert record["measured_peak_above_imports_mib"] > 0 and record["predicted_peak_mib"] > 0
        assert record["peak_measured_over_predicted"] == pytest.approx(
            record["measured_peak_above_imports_mib"] / record["predicted_peak_mib"])
