"""The methods benchmark's report phase end to end on the tiny preset: PPO and DPO on one seed through `rlhf sweep`,
sharing the seed's stages, with each run's numbers, the paired differences and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import REPO
from tests.flows.test_kill_resume import rlhf_env


@pytest.mark.slow
def test_the_report_phase_compares_methods_on_one_seed(tmp_path: Path):
    out = tmp_path / "methods.json"
    command = [sys.executable, "-m", "benchmarks.methods.run", "report", "--preset", "tiny", "--seeds", "0",
               "--methods", "ppo", "dpo", "--state-dir", str(tmp_path / "state"), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=rlhf_env(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["method"], r["seed"]) for r in result["runs"]] == [("ppo", 0), ("dpo", 0)]
    ppo, dpo = result["runs"]
    assert ppo["best_of_16"] == dpo["best_of_16"]  # one best-of-16 per seed: the shared stage, computed once
    assert ppo["settings"] != dpo["settings"] and len(ppo["settings"]) == 16  # what each run's stages compute
    table = result["table"]
    assert set(table) == {"ppo", "dpo", "best-of-16"}
    assert table["ppo"]["gold"]["mean"] == pytest.approx(ppo["gold"])
    assert table["ppo"]["gold_minus_dpo"]["mean"] == pytest.approx(ppo["gold"] - dpo["gold"])
    assert table["dpo"]["gold_minus_best_of_16"]["mean"] == pytest.approx(dpo["gold"] - dpo["best_of_16"]["gold"])
    assert "gold_minus_dpo" not in table["dpo"]
    assert table["ppo"]["gold_minus_best_of_n_at_kl"]["mean"] == pytest.approx(ppo["minus_best_of_n_at_kl"]["gold"])
    assert out.with_suffix(".png").stat().st_size > 0
    rows = out.with_suffix(".md").read_text().splitlines()  # header, rule, PPO, DPO, best-of-16
    assert [row.split(" | ")[0] for row in rows[2:]] == ["| ppo", "| dpo", "| best-of-16 from SFT"]
    assert rows[3].split(" | ")[6] == f"{table['dpo']['gold_minus_0.9x_ppo']['mean']:+.3f} (0.000), " \
        f"{table['dpo']['gold_over_ppo']:.2f}"
