"""Reward-model training and a PPO update under DeepSpeed ZeRO on 2 processes (gloo, CPU) match one process.

Same global batches, split between the processes: the reward model sees the same 21 pairs in batches of 8
(the short last batch splits 3 / 2), the PPO update the same rollout batch, shuffles and micro-batches. ZeRO-2
trains a policy with a value head, ZeRO-3 with CPU offload of parameters and optimizer a policy and a critic,
ZeRO-2 again a LoRA policy (reference = adapter disabled) with a value head and a reward model with an adapter.
What may differ is float summation order (gradients summed over ranks, bucketed reductions), so weights are
compared relative to how far training moved them. Adam turns a gradient near its eps (1e-8) into a step of
~lr whatever its exact value, so a weight whose gradient is ~1e-9 can differ by a fraction of lr (seen: 2e-4
at lr 3e-3 on one reward-model weight); Adam also hides a wrong gradient scale, so gradient norms, which are
reported before clipping, are compared too.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("deepspeed", reason="DeepSpeed is the 'distributed' extra (.ci/install installs it)")

from tests.distributed.zero_cases import (  # noqa: E402
    CASES, PPO_CONFIG, RM_CONFIG, build_experience, ppo_models, rm_model, train_rm, update_ppo, worker,
)

WORLD_SIZE = 2
RELATIVE_TOL = 1e-3
"""Max ||w_2proc - w_1proc|| / ||w_1proc - w_start|| over all weights."""
LOSS_TOL = 1e-5
WORKER_TIMEOUT_SECONDS = 900
"""Every case on 2 processes takes ~4 minutes here; a hang fails the module instead of the whole CI run."""

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    """(one-process results, two-process results) of every case."""
    folder = tmp_path_factory.mktemp("zero")
    build_experience(folder)
    workers = mp.start_processes(worker, args=(WORLD_SIZE, _free_port(), str(folder)), nprocs=WORLD_SIZE,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + WORKER_TIMEOUT_SECONDS
    while not workers.join(timeout=5):  # raises when a worker fails
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail(f"the {WORLD_SIZE} DeepSpeed workers did not finish in {WORKER_TIMEOUT_SECONDS} s (killed)")
    distributed = torch.load(folder / "distributed.pt", weights_only=False)
    local = {"rm": train_rm(None), "rm_lora": train_rm(None, lora=True)}
    for name, (_, value_model) in CASES.items():
        local[f"{name}/ppo"] = update_ppo(None, value_model, folder)
    local["warmup"] = update_ppo(None, "head", folder, train_policy=False)
    return local, distributed


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def relative_diff(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """||two - one|| / ||one - start|| over all weights: the disagreement as a share of the distance trained."""
    def norm(a, b):
        return sum(float(((a[k].float() - b[k].float()) ** 2).sum()) for k in a) ** 0.5

    moved = norm(one, start)
    assert moved > 1e-3  # training moved the weights: the comparison is not trivially true
    return norm(two, one) / moved


@pytest.mark.parametrize("case", sorted(CASES))
def test_reward_model_training_matches_one_process(runs, case):
    local, distributed = runs
    one, two = local["rm_lora" if CASES[case][1] == "lora" else "rm"], distributed[f"{case}/rm"]
    assert len(two["loss"]) == len(one["loss"]) == 3
    assert two["loss"] == pytest.approx(one["loss"], abs=LOSS_TOL)
    assert two["accuracy"] == pytest.approx(one["accuracy"], abs=1e-9)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=LOSS_TOL)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    assert relative_diff(one["weights"], two["weights"], rm_model().state_dict()) < RELATIVE_TOL
    assert max_diff(one["weights"], two["weights"]) < RM_CONFIG.learning_rate / 10


@pytest.mark.parametrize("case", sorted(CASES))
def test_ppo_update_matches_one_process(runs, case):
    local, distributed = runs
    one, two = local[f"{case}/ppo"], distributed[f"{case}/ppo"]
    start = ppo_models(CASES[case][1])
    value_start = start.value_model.state_dict()
    assert relative_diff(one["policy"], two["policy"], start.policy.state_dict()) < RELATIVE_TOL
    assert relative_diff(one["value"], two["value"], value_start) < RELATIVE_TOL
    assert max_diff(one["policy"], two["policy"]) < PPO_CONFIG.learning_rate / 10
    for name in ("policy_loss", "value_loss", "entropy", "approx_kl", "ratio_mean", "policy_grad_norm",
                 "value_grad_norm", "learning_rate", "clipfrac"):
        assert getattr(two["stats"], name) == pytest.approx(getattr(one["stats"], name), rel=1e-4, abs=1e-6), name
    if CASES[case][1] == "lora":  # B starts at 0: only B gets a gradient in the first step, below the clip
        assert one["stats"].policy_grad_norm > 0.05
    else:
        assert one["stats"].policy_grad_norm > 0.5  # clipping (max_grad_norm 0.5) was active and had to match


def test_a_critic_warmup_update_under_zero2_steps_the_value_head_alone(runs):
    """ppo.critic_warmup_updates under DeepSpeed: the policy's engine is not stepped (its weights are the start's,
    exactly), the value head's moves as in one process."""
    local, distributed = runs
    one, two = local["warmup"], distributed["zero2/warmup"]
    start = ppo_models("head")
    assert max_diff(two["policy"], {k: v.float() for k, v in start.policy.state_dict().items()}) == 0.0
    assert max_diff(one["policy"], two["policy"]) == 0.0
    assert relative_diff(one["value"], two["value"], start.value_model.state_dict()) < RELATIVE_TOL
    assert two["stats"].critic_warmup == 1.0 and two["stats"].policy_grad_norm == 0.0
    assert two["stats"].value_loss == pytest.approx(one["stats"].value_loss, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_ppo_step_gathers_the_whole_batch_on_every_rank(runs, case):
    """Each rank generated 8 rollouts (ZeRO-3: with the gathered policy); all ranks then agree on the
    16-rollout batch, the shuffling generator and the updated weights."""
    _, distributed = runs
    ranks = distributed[f"{case}/step_ranks"]
    assert len(ranks) == WORLD_SIZE
    (stats0, generator0, weight0), (stats1, generator1, weight1) = ranks
    assert stats0 == stats1  # rollout statistics over the whole gathered batch
    assert torch.equal(generator0, generator1)
    assert torch.equal(weight0, weight1)
    update = distributed[f"{case}/step"].update
    assert update.ratio_mean == pytest.approx(1.0, abs=1e-6)  # one mini-batch: old log-probs are the policy's
    assert update.clipfrac == 0.0


def test_resumed_zero3_run_ends_where_the_uninterrupted_one_does(runs, tmp_path_factory):
    """DeepSpeed checkpoints: ZeRO shards per engine + whole weights; a resumed run repeats the straight one."""
    _, distributed = runs
    resume = distributed["resume"]
    assert resume["resumed_from"] == 1
    # The manifest that a resume verifies covers the ZeRO shards too, not only the safetensors files.
    assert any(name.startswith("deepspeed/engine0/") for name in resume["sealed"]), resume["sealed"]
    assert {"policy.safetensors", "state.json", "rng.safetensors"} <= set(resume["sealed"])
    assert len(resume["straight"]) == len(resume["resumed"]) == 2
    for straight, resumed in zip(resume["straight"], resume["resumed"], strict=True):
        untimed = {k: v for k, v in straight.items() if not k.startswith("time/")}
        assert {k: resumed[k] for k in untimed} == pytest.approx(untimed, rel=1e-6, abs=1e-9)


def test_zero3_trained_models_are_partitioned_as_they_load(runs):
    """A worker loads the policy and the reward model it trains inside ``zero.partitioned_loading``: under ZeRO-3
    each rank holds only shards right after ``from_pretrained`` (never the full weights), and training from there
    matches one process (the cases above); under ZeRO-2 they load whole."""
    _, distributed = runs
    sharded = [distributed["zero3_offload/rm"]["partitioned"], *distributed["zero3_offload/partitioned"]]
    assert len(sharded) == 5  # the reward model; the policy and critic of the update, and of the whole step
    for held in sharded:
        assert held["partitioned_elements"] > 0.9 * held["full"]
        assert held["held"] < 0.1 * held["full"], held
    whole = [distributed["zero2/rm"]["partitioned"], *distributed["zero2/partitioned"]]
    assert len(whole) == 3 and all(h["held"] == h["full"] and h["partitioned_elements"] == 0 for h in whole)
