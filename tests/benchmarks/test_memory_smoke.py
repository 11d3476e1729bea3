"""The memory benchmark runs end to end on tiny models (``--smoke``) and reports consistent numbers.

Tiny models measure nothing about the 60% target (importing torch dominates their RSS); this checks the
script, its JSON and the analytic byte counts, which do not depend on the size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_memory_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory.run", "--smoke", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout) == result  # printed and written
    assert result["smoke"] and {"cpu_model", "logical_cores", "ram_gib"} <= set(result["machine"])
    summary = result["summary"]
    full, head, critic = summary["full"], summary["lora_head"], summary["lora_critic"]
    free = summary["critic_free"]
    for setup in (full, head, critic, free):
        assert setup["peak_rss_mib"] >= setup["rss_after_imports_mib"] > 0
        # AdamW keeps two float32 moments per trainable parameter: the analytic count is what torch allocated
        assert setup["measured_optimizer_state_mib"] == pytest.approx(setup["analytic_mib"]["optimizer_state"])
    # four models, two trained in full: policy and critic are as large as the reference and the reward model
    assert full["parameters_trainable"] * 2 == full["parameters_distinct"]
    # one copy of the policy's base and one of the reward model's, however many roles use them
    assert head["parameters_distinct"] < 0.6 * full["parameters_distinct"]
    assert critic["parameters_trainable"] < 0.5 * full["parameters_trainable"]
    # a critic-free estimator builds no value model: three models, the policy alone trained
    assert free["parameters_distinct"] == pytest.approx(0.75 * full["parameters_distinct"], rel=1e-3)
    assert free["parameters_trainable"] == pytest.approx(0.5 * full["parameters_trainable"], rel=1e-3)
    ratios = result["ratio_over_full"]
    assert ratios["lora_head"]["analytic_total"] < 0.6 and ratios["lora_critic"]["analytic_total"] < 0.6
