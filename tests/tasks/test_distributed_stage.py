"""A stage's training switched to DeepSpeed workers by config alone (tasks/launch.py, tasks/ppo_job.py,
tasks/reward_job.py, tasks/distributed_train.py).

The slow tests launch ``torchrun`` with 2 CPU workers (gloo) exactly as a stage does, and check what the stage
gets back: the reward model's weights and curve equal the in-process training's (within float tolerance),
and PPO leaves a DeepSpeed checkpoint whose weights and history land in the stage's models.
"""

from __future__ import annotations

import json
import socket
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.training.checkpoint import DEEPSPEED_DIR, latest_checkpoint
from tasks import launch as launch_module
from tasks import ppo_job as ppo_job_module
from tasks import ppo_iteration, reward_model
from tasks.config import ConfigError, DistributedSection, PipelineConfig, load_config
from tasks.distributed_train import training_job
from tasks.launch import DistributedJob, _MetricsFollower, launch_command
from tasks.ppo_job import PPOJob, run_ppo_job, train_ppo_job
from tasks.reward_job import RewardModelJob, fit_reward_model
from tests.distributed.zero_cases import preference_pairs
from tests.tiny_models import gpt2_config, save_ppo_inputs, word_tokenizer

PROMPTS = ["hello the cat", "why the dog ran", "how big is the sun", "q red box", "the moon sat on a mat",
           "a small star", "fast blue tree", "q slow dog"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pipeline_config(*overrides: str) -> PipelineConfig:
    return load_config(preset="tiny", overrides=[
        "device=cpu", "ppo.micro_batch_size=2", "distributed.deepspeed_config=infra/deepspeed/zero2.json",
        "distributed.num_processes=2", f"distributed.master_port={_free_port()}", *overrides])


class _Launched(Exception):
    """Raised by the stand-in launcher: the job is written, no worker starts."""


@pytest.fixture
def written_jobs(monkeypatch: pytest.MonkeyPatch) -> list[DistributedJob]:
    """Jobs the stage side writes; ``launch`` writes the job file and stops instead of starting workers."""
    jobs: list[DistributedJob] = []

    def write_only(section: DistributedSection, job: DistributedJob, on_log: object) -> None:
        job.write()
        jobs.append(job)
        raise _Launched

    monkeypatch.setattr(launch_module, "launch", write_only)
    return jobs


# --------------------------------------------------------------------------------------------- fast


def test_torchrun_command_starts_the_worker_module_on_every_process(tmp_path: Path) -> None:
    section = DistributedSection(deepspeed_config="x.json", num_processes=4, num_nodes=2, master_addr="10.0.0.1",
                                 master_port=29600)
    command = launch_command(section, DistributedJob("ppo", str(tmp_path), "x.json", "tasks.ppo_job", {}), node_rank=1)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
            "--master-port=29600"} <= set(command)
    assert command[-4:] == ["-m", "tasks.ppo_job", "--job", str(tmp_path / "job.json")]


def test_deepspeed_launcher_command_reads_the_hostfile(tmp_path: Path) -> None:
    section = DistributedSection(deepspeed_config="x.json", launcher="deepspeed", num_nodes=2, hostfile="hosts",
                                 master_port=29600)
    job = DistributedJob("reward-model", str(tmp_path), "x.json", "tasks.reward_job", {})
    command = launch_command(section, job)
    assert command[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert "--hostfile=hosts" in command and "--num_nodes=2" in command
    assert "--num_gpus=1" in command  # processes per node: the runner starts them on every node itself
    assert "--master_addr=127.0.0.1" in command and "--master_port=29600" in command
    assert "--no_ssh_check" not in command  # several nodes: the runner checks it can reach them before starting
    one_host = launch_command(DistributedSection(deepspeed_config="x.json", launcher="deepspeed", hostfile="hosts",
                                                 num_processes=2), job, port=29601)
    assert {"--num_nodes=1", "--num_gpus=2", "--no_ssh_check", "--master_port=29601"} <= set(one_host)
    assert command[-4:] == ["--module", "tasks.reward_job", "--job", str(tmp_path / "job.json")]


@pytest.mark.parametrize(("override", "message"), [
    ("distributed.num_processes=2", "need distributed.deepspeed_config"),
    ("distributed.hostfile=hosts", "launcher='deepspeed'"),
    ("distributed.stages=[sft]", "choose one of"),
])
def test_bad_distributed_settings_name_the_fix(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(preset="tiny", overrides=[override])


def test_in_process_by_default() -> None:
    config = load_config(preset="tiny")
    assert not config.distributed.runs("reward-model") and not config.distributed.runs("ppo-iteration")
    assert reward_model.Config.of(config).distributed is None and ppo_iteration.Config.of(config, 1).distributed is None
    launched = pipeline_config()
    assert launched.distributed.runs("ppo-iteration")
    assert ppo_iteration.Config.of(launched, 1).distributed == launched.distributed
    only_rm = pipeline_config("distributed.stages=[reward-model]")
    assert not only_rm.distributed.runs("ppo-iteration") and ppo_iteration.Config.of(only_rm, 1).distributed is None
    assert reward_model.Config.of(only_rm).distributed == only_rm.distributed


def test_ppo_job_carries_the_stage_settings_as_data_and_the_worker_rebuilds_them(
        tmp_path: Path, written_jobs: list[DistributedJob], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ppo_iteration.Config.of(pipeline_config("ppo.kl.coef=0.125"), 1)
    saved = save_ppo_inputs(tmp_path, PROMPTS)
    built = []
    monkeypatch.setattr(ppo_job_module, "build_ppo_models", lambda *args, **kwargs: built.append(1))
    job = PPOJob(cfg.ppo, cfg.runtime, 7, saved["sft"], saved["rm"], saved["prompts"], 2,
                 str(tmp_path / "checkpoints"), checkpoint_every=1)
    with pytest.raises(_Launched):  # the stage builds no model before its workers have ended
        train_ppo_job(job, cfg.distributed, lambda step, metrics: None, tmp_path / "job")
    assert built == []
    written = json.loads((tmp_path / "job" / "job.json").read_text())
    assert written["stage"] == "ppo" and written["job"]["config"]["kl"]["coef"] == 0.125
    assert written["worker"] == "tasks.ppo_job"  # the workers run the job's own module
    assert written["job"]["config"]["total_updates"] == cfg.ppo.total_updates  # the slice's, not re-derived
    assert {k: written["job"][k] for k in ("seed", "n_updates", "checkpoint_every", "init_from", "reference_dir")} == {
        "seed": 7, "n_updates": 2, "checkpoint_every": 1, "init_from": None, "reference_dir": saved["sft"]}
    assert written["job"]["runtime"] == {"device": "cpu", "dtype": "float32"}
    assert written["deepspeed_config"] == str(Path("infra/deepspeed/zero2.json").resolve())
    assert not list((tmp_path / "job").glob("*.yaml"))  # the settings travel in the job, not as a second file
    read = DistributedJob.read(tmp_path / "job" / "job.json")
    assert read == written_jobs[0]
    assert training_job(read, PPOJob) == job  # what the workers run is what the stage built
    read.job["config"]["kl"]["coeff"] = 0.1
    with pytest.raises(ConfigError, match=r"'job\.config\.kl\.coeff' \(from .*/job/job\.json\)"):
        training_job(read, PPOJob)


def test_a_prompt_table_the_workers_would_refuse_fails_before_any_worker_starts(
        tmp_path: Path, written_jobs: list[DistributedJob]) -> None:
    cfg = ppo_iteration.Config.of(pipeline_config("ppo.generation.max_new_tokens=60"), 1)
    saved = save_ppo_inputs(tmp_path, [" ".join(["the"] * 40)])
    job = PPOJob(cfg.ppo, cfg.runtime, 7, saved["sft"], saved["rm"], saved["prompts"], 2, str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="longer than .* tokens"):
        train_ppo_job(job, cfg.distributed, lambda step, metrics: None, tmp_path / "job")
    assert written_jobs == []


def test_reward_job_carries_the_training_settings_and_the_pairs(tmp_path: Path,
                                                                written_jobs: list[DistributedJob]) -> None:
    config = pipeline_config("reward_model.training.learning_rate=0.02")
    cfg = reward_model.Config.of(config)
    train, evaluate_on = preference_pairs(6, 0), preference_pairs(2, 1)
    built = []

    def initial() -> GPT2ForSequenceClassification:
        model = reward_model_to_train()
        built.append(weakref.ref(model))
        return model

    job = RewardModelJob(cfg.reward_model.training, cfg.runtime, tuple(train), tuple(evaluate_on), eval_every=3)
    with pytest.raises(_Launched):
        fit_reward_model(job, initial, word_tokenizer(), cfg.distributed, lambda step, metrics: None, tmp_path / "rm")
    (written,) = written_jobs
    assert len(built) == 1 and built[0]() is None  # saved for the workers, then dropped before they started
    assert written.stage == "reward-model" and written.worker == "tasks.reward_job" and written.job["eval_every"] == 3
    assert written.job["training"]["learning_rate"] == 0.02
    assert (len(written.job["train"]), len(written.job["evaluate_on"])) == (6, 2)
    assert written.job["train"][0]["chosen"] == train[0].chosen
    assert training_job(DistributedJob.read(written.path), RewardModelJob) == job
    assert (tmp_path / "rm" / "initial" / "config.json").is_file()  # the initial weights, with the tokenizer
    assert (tmp_path / "rm" / "initial" / "tokenizer.json").is_file()


def test_metrics_follower_passes_only_complete_lines(tmp_path: Path) -> None:
    path, seen = tmp_path / "metrics.jsonl", []
    follower = _MetricsFollower(path, lambda step, metrics: seen.append((step, metrics)))
    follower.poll()  # no file yet
    path.write_text(json.dumps({"step": 1, "metrics": {"a": 1.0}}) + "\n" + '{"step": 2, "met')
    follower.poll()
    assert seen == [(1, {"a": 1.0})]
    with open(path, "a") as handle:
        handle.write('rics": {"a": 2.0}}\n')
    follower.poll()
    assert seen == [(1, {"a": 1.0}), (2, {"a": 2.0})]


# --------------------------------------------------------------------------------------------- launched


def reward_model_to_train() -> GPT2ForSequenceClassification:
    torch.manual_seed(3)
    return GPT2ForSequenceClassification(gpt2_config(len(word_tokenizer()), num_labels=1))


def deepspeed_config(name: str, folder: Path) -> str:
    """infra/deepspeed/zero2.json, or zero3_offload.json keeping torch's AdamW (DeepSpeedCPUAdam is a C++ op
    compiled on first use, minutes on a cold machine: the test is about ZeRO-3's partitioning, not a compiler)."""
    if name == "zero2":
        return "infra/deepspeed/zero2.json"
    config = json.loads(Path("infra/deepspeed/zero3_offload.json").read_text())
    path = folder / "zero3.json"
    path.write_text(json.dumps({**config, "zero_force_ds_cpu_optimizer": False}))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_reward_model_training_on_two_torchrun_workers_matches_in_process(tmp_path: Path, zero: str) -> None:
    """ZeRO-3: the workers load the reward model partitioned (zero.partitioned_loading); the result is the same."""
    cfg = reward_model.Config.of(pipeline_config(f"distributed.deepspeed_config={deepspeed_config(zero, tmp_path)}"))
    training = cfg.reward_model.training
    train, evaluate_on = preference_pairs(40, 0), preference_pairs(8, 1)
    local_log, launched_log = [], []
    job = RewardModelJob(training, cfg.runtime, tuple(train), tuple(evaluate_on), eval_every=2)
    one, local = fit_reward_model(job, reward_model_to_train, word_tokenizer(), None,
                                  lambda s, m: local_log.append((s, m)), tmp_path / "unused")
    two, launched = fit_reward_model(job, reward_model_to_train, word_tokenizer(), cfg.distributed,
                                     lambda s, m: launched_log.append((s, m)), tmp_path / "rm")

    assert (tmp_path / "rm" / "job.json").is_file() and not (tmp_path / "unused").exists()
    assert launched.train_loss == pytest.approx(local.train_loss, abs=1e-5)
    assert launched.final_eval.accuracy == pytest.approx(local.final_eval.accuracy)
    assert [s for s, _ in launched_log] == [s for s, _ in local_log]  # rank 0's metrics reached the stage
    assert launched_log[-1][1]["rm/eval/loss"] == pytest.approx(local_log[-1][1]["rm/eval/loss"], abs=1e-5)
    start, trained = reward_model_to_train().state_dict(), two.state_dict()
    moved = sum(float(((one.state_dict()[k] - start[k]) ** 2).sum()) for k in start) ** 0.5
    apart = sum(float(((one.state_dict()[k] - trained[k]) ** 2).sum()) for k in start) ** 0.5
    # The stage's model holds the workers' weights (not its untrained start: that would be apart == moved). Adam
    # turns float noise in near-zero gradients into up-to-lr steps, so the gradient norms are the tight check.
    assert moved > 1e-2 and apart / moved < 1e-2
    launched_norms = [m["rm/train/grad_norm"] for _, m in launched_log if "rm/train/grad_norm" in m]
    assert launched_norms == pytest.approx([m["rm/train/grad_norm"] for _, m in local_log if "rm/train/grad_norm" in m],
                                           rel=1e-4)


@pytest.mark.slow
def test_the_deepspeed_launcher_starts_the_workers_of_a_one_host_hostfile(tmp_path: Path) -> None:
    """The real ``deepspeed.launcher.runner`` command of :func:`launch_command` with ``localhost slots=2``: it
    starts both workers here (one active host: no ssh), and the stage gets what the in-process training gives."""
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    cfg = reward_model.Config.of(pipeline_config("distributed.launcher=deepspeed",
                                                 f"distributed.hostfile={tmp_path / 'hostfile'}"))
    train, evaluate_on, steps = preference_pairs(16, 0), preference_pairs(4, 1), []
    job = RewardModelJob(cfg.reward_model.training, cfg.runtime, tuple(train), tuple(evaluate_on), eval_every=1)
    _, local = fit_reward_model(job, reward_model_to_train, word_tokenizer(), None, lambda s, m: None,
                                tmp_path / "unused")
    _, launched = fit_reward_model(job, reward_model_to_train, word_tokenizer(), cfg.distributed,
                                   lambda s, m: steps.append(s), tmp_path / "rm")
    assert steps and steps == sorted(steps)  # rank 0's metric lines reached the stage
    assert launched.train_loss == pytest.approx(local.train_loss, abs=1e-5)
    assert launched.final_eval.loss == pytest.approx(local.final_eval.loss, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_ppo_on_two_torchrun_workers_hands_back_a_deepspeed_checkpoint(tmp_path: Path, zero: str) -> None:
    """ZeRO-3 (with a critic): the workers load the policy and the critic's reward model partitioned, the reference
    and the scorer whole, each on its own."""
    saved = save_ppo_inputs(tmp_path, PROMPTS)
    config = pipeline_config(f"distributed.deepspeed_config={deepspeed_config(zero, tmp_path)}",
                             *(["ppo.value_model=critic"] if zero == "zero3" else []))
    cfg = ppo_iteration.Config.of(config, 1)
    job = PPOJob(cfg.ppo, cfg.runtime, cfg.seed, saved["sft"], saved["rm"], saved["prompts"], 2,
                 str(tmp_path / "checkpoints"), checkpoint_every=1)
    logged = []
    models, result = train_ppo_job(job, cfg.distributed, lambda step, metrics: logged.append(step),
                                   tmp_path / "distributed")

    final = latest_checkpoint(tmp_path / "checkpoints")
    assert final.name == "step_000002"
    assert (final / DEEPSPEED_DIR / "engine0").is_dir() and (final / DEEPSPEED_DIR / "engine1").is_dir()
    assert logged == [1, 2] and len(result.history) == 2
    assert result.history[0]["ppo/policy/ratio_mean"] == pytest.approx(1.0, abs=0.05)
    weights = load_file(str(final / "policy.safetensors"))
    assert torch.equal(models.policy.state_dict()["transformer.h.0.mlp.c_fc.weight"],
                       weights["transformer.h.0.mlp.c_fc.weight"])  # the stage's policy is the trained one
    start = GPT2LMHeadModel.from_pretrained(tmp_path / "sft").state_dict()["transformer.h.0.mlp.c_fc.weight"]
    assert not torch.equal(weights["transformer.h.0.mlp.c_fc.weight"], start)
    # Its optimizer state is DeepSpeed's shards: resuming it in one process fails with what to do.
    with pytest.raises(FileNotFoundError, match="same distributed settings"):
        run_ppo_job(replace(job, n_updates=3))
