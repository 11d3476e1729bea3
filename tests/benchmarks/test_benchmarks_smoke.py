"""Each benchmark script runs end to end with --smoke in a fresh process and writes the JSON it promises.

Timings are not asserted (speed belongs in benchmarks/, not in timed tests); the structure and the sanity
of the numbers are: positive times that add up, a ratio that is the quotient of the two sides, and so on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # long tests: in the slow run (`pytest -q -m slow`; CI runs both)

REPO = Path(__file__).resolve().parents[2]
MACHINE_KEYS = {"cpu_model", "logical_cores", "torch_threads", "ram_gib", "torch", "transformers", "trl",
                "load_average"}


def run_smoke(module: str, out: Path) -> dict:
    """``python -m module --smoke --threads 1 --out out`` (one thread: tiny ops on a shared machine otherwise
    wait for both cores at every step) and the JSON it wrote."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1"}
    command = [sys.executable, "-m", module, "--smoke", "--threads", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] is True
    assert MACHINE_KEYS <= result["machine"].keys()
    return result


def test_ppo_vs_trl_smoke(tmp_path: Path):
    result = run_smoke("benchmarks.ppo_vs_trl.run", tmp_path / "ppo_vs_trl.json")
    assert {"settings", "unmatched", "summary", "comparison", "runs", "fixture"} <= result.keys()
    for side in ("ours", "trl"):
        summary = result["summary"][side]
        for key in ("median_total_s", "median_generation_s", "median_scoring_s", "median_training_s",
                    "tokens_per_s", "peak_rss_mib", "reward_gain_per_update_mean"):
            assert summary[key] == summary[key], f"{side} {key} is NaN"
        assert summary["median_total_s"] > 0 and summary["peak_rss_mib"] > 100
        (run,) = result["runs"][side]
        assert len(run["updates"]) == result["settings"]["updates"] and run["torch_threads"] == 1
        for update in run["updates"]:
            parts = update["generation_s"] + update["scoring_s"] + update["training_s"] + update["other_s"]
            assert parts == pytest.approx(update["total_s"])
            assert min(update["generation_s"], update["scoring_s"], update["training_s"]) > 0
    comparison = result["comparison"]
    ours, trl = result["summary"]["ours"], result["summary"]["trl"]
    assert comparison["ratio_ours_over_trl"]["total_s"] == pytest.approx(ours["median_total_s"] / trl["median_total_s"])
    assert comparison["speedup_trl_over_ours"] == pytest.approx(1 / comparison["ratio_ours_over_trl"]["total_s"])


def test_generation_smoke(tmp_path: Path):
    result = run_smoke("benchmarks.generation.run", tmp_path / "generation.json")
    for mode in ("fixed_length", "with_stop"):
        timings = result["modes"][mode]
        for name in ("ours", "ours_static", "hf_generate", "hf_generate_scores"):
            assert timings[name]["median_tokens_per_s"] > 0
        assert timings["ratio_ours_over_hf_generate"] == pytest.approx(
            timings["ours"]["median_tokens_per_s"] / timings["hf_generate"]["median_tokens_per_s"])
        assert timings["ratio_static_over_dynamic"] == pytest.approx(
            timings["ours_static"]["median_tokens_per_s"] / timings["ours"]["median_tokens_per_s"])
    # Without a stop token every generator produces exactly batch x max_new_tokens positions.
    fixed = result["modes"]["fixed_length"]
    expected = result["setup"]["batch"] * result["setup"]["max_new_tokens"]
    names = ("ours", "ours_static", "hf_generate", "hf_generate_scores")
    assert {fixed[name]["positions_mean"] for name in names} == {expected}


def test_mfu_smoke(tmp_path: Path):
    result = run_smoke("benchmarks.mfu.run", tmp_path / "mfu.json")
    peak = result["matmul_peak"]
    assert peak["best_flops"] == max(size["best_flops"] for size in peak["sizes"]) >= peak["median_flops"] > 0
    (update,) = result["training"]["updates"]
    assert update["achieved_flops"] == pytest.approx(update["model_flops"] / update["training_s"])
    assert result["mfu_vs_best_matmul"] == pytest.approx(result["achieved_flops"] / result["matmul_peak"]["best_flops"])
    assert 0 < update["real_tokens"] <= update["padded_positions"]
    assert "6 * N" in result["formula"]


def test_gpu_check_smoke(tmp_path: Path):
    """The GPU check runs every section on CPU (a tiny Qwen2 shape) and records no failure; what it compares holds
    here too: offload changes no parameter (and the control agrees with itself), the chunked vocabulary equals one
    pass, and both decode paths' log-probs match a full forward."""
    result = run_smoke("benchmarks.gpu_check.run", tmp_path / "gpu_check.json")
    assert result["errors"] == {} and result["complete"] is True
    results = result["results"]
    for setup in ("lora_head", "lora_critic", "full_head", "full_critic"):
        ppo = results[f"ppo/{setup}"]
        assert ppo["training_mfu"] > 0 and ppo["generated_tokens_per_s"] > 0
        assert set(ppo["predicted_gib"]) == {"between_steps", "experience", "update"}
    assert results["ppo/full_critic"]["trainable_parameters"] > results["ppo/full_head"]["trainable_parameters"]
    assert results["offload"]["control_bit_identical"] and results["offload"]["bit_identical"]
    assert results["vocab"]["rows"] > results["vocab"]["rows_per_chunk"]  # the check really chunks
    assert max(results["vocab"]["max_abs_diff"].values()) < 1e-4
    decode = results["decode"]
    assert decode["static_over_dynamic"] == pytest.approx(
        decode["ours_static"]["tokens_per_s"] / decode["ours_dynamic"]["tokens_per_s"])
    assert max(gap["max"] for gap in decode["logprob_vs_recomputation"].values()) < 0.05
