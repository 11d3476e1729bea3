"""The training cases of test_zero.py, run the same way in one process and in each of N spawned processes.

Each case builds its tiny models from a seed, so every process starts from the same weights; the PPO cases
read one pre-built rollout batch from disk (the parent builds it), so every run updates on the same batch.
"""

from __future__ import annotations

import json
import logging
import os
import random
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.config import GenerationConfig, LoRAConfig, PPOConfig, RewardTrainingConfig
from rlhf_core.models.lora import lora_policy
from rlhf_core.models.roles import Critic, ValueHead, disable_dropout, freeze, make_reference
from rlhf_core.ppo.rewards import RunningMoments
from rlhf_core.training.experience import Experience, PPOModels, collect_experience
from rlhf_core.training.ppo_loop import train_ppo
from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_step, ppo_update, prepare_training
from rlhf_core.training.reward_training import train_reward_model
from rlhf_core.data.records import PreferencePair
from rlhf_core.training.strategy import StrategyFactory
from tests.tiny_models import WORDS, gpt2_config, word_tokenizer

PAD, BOS, EOS, VOCAB = 0, 1, 2, 24
KL_COEF = 0.05

INFRA = Path(__file__).resolve().parents[2] / "infra" / "deepspeed"
ZERO2: dict[str, Any] = json.loads((INFRA / "zero2.json").read_text())
# The shipped config, except that offloading the optimizer normally runs DeepSpeedCPUAdam, a C++ op compiled on
# first use (minutes on a cold machine): the test keeps torch's AdamW, so it measures ZeRO-3's partitioning and
# offload, not a compiler.
ZERO3_OFFLOAD: dict[str, Any] = {**json.loads((INFRA / "zero3_offload.json").read_text()),
                                 "zero_force_ds_cpu_optimizer": False}
CASES = {"zero2": (ZERO2, "head"), "zero3_offload": (ZERO3_OFFLOAD, "critic"), "zero2_lora": (ZERO2, "lora")}
"""name: (DeepSpeed config, value model). ``lora``: LoRA policy, adapter-disabled reference, value head, and
the reward model trained with an adapter (ZeRO-3 refuses LoRA: frozen weights in a trained model)."""


# --------------------------------------------------------------------------------------------- reward model


def preference_pairs(n: int, seed: int) -> list[PreferencePair]:
    """Pairs where the chosen reply holds more 'good' than the rejected one (learnable in a few steps)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = " ".join(rng.choice(WORDS[6:]) for _ in range(3))
        filler = [rng.choice(WORDS[4:]) for _ in range(4)]
        pairs.append(PreferencePair(prompt, " ".join(["good"] * 2 + filler), " ".join(["bad"] * 2 + filler)))
    return pairs


RM_CONFIG = RewardTrainingConfig(epochs=1, batch_size=8, learning_rate=3e-3, max_length=32, center_rewards_coef=0.01)
LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0)


def train_rm(make_strategy: StrategyFactory | None, lora: bool = False, folder: Path | None = None) -> dict[str, Any]:
    """21 pairs in batches of 8: the last batch (5 pairs) splits 3 / 2 over two processes. With ``lora`` an
    adapter trains and is merged at the end, so the weights compared are plain ones. ``folder``: the model is
    loaded from ``folder/rm`` (saved by :func:`build_experience`) as the stage's workers load it, partitioned
    under ZeRO-3; ``partitioned`` then says whether it came out of loading partitioned."""
    model, partitioned = (rm_model(), None) if folder is None else load_partitioned(
        make_strategy, lambda: GPT2ForSequenceClassification.from_pretrained(folder / "rm"), folder / "rm")
    grad_norms: list[float] = []

    def on_log(step: int, metrics: dict[str, float]) -> None:
        if "rm/train/grad_norm" in metrics:
            grad_norms.append(metrics["rm/train/grad_norm"])

    result = train_reward_model(model, word_tokenizer(), preference_pairs(21, 0), preference_pairs(6, 1),
                                replace(RM_CONFIG, lora=LORA) if lora else RM_CONFIG,
                                on_log=on_log, make_strategy=make_strategy)
    return {"loss": result.train_loss, "accuracy": result.train_accuracy, "eval_loss": result.final_eval.loss,
            "grad_norm": grad_norms, "weights": _weights(model, make_strategy), "partitioned": partitioned}


def load_partitioned(make_strategy: Any, load: Any, folder: Path) -> tuple[Any, dict[str, int]]:
    """``load()`` inside ``zero.partitioned_loading`` (the factory's config), and how much of the model this rank
    holds right after it: ``held`` elements of ``full`` (ZeRO-3: its shards only; ``full`` counts ds_numel)."""
    from rlhf_core.distributed.zero import partitioned_loading

    with partitioned_loading(make_strategy.config, folder, torch.float32):
        model = load()
    params = list(model.parameters())
    full = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    return model, {"held": sum(p.numel() for p in params), "full": full,
                   "partitioned_elements": sum(int(p.ds_numel) for p in params if _is_partitioned(p))}


def _is_partitioned(param: torch.Tensor) -> bool:
    from rlhf_core.distributed.zero import is_partitioned

    return is_partitioned(param)


def rm_model() -> GPT2ForSequenceClassification:
    """The reward model every run starts from."""
    torch.manual_seed(3)
    return GPT2ForSequenceClassification(gpt2_config(len(word_tokenizer()), num_labels=1))


# --------------------------------------------------------------------------------------------- PPO


class CountSeven:
    """Score = number of token 7 in the response."""

    def __call__(self, rollout):
        return ((rollout.response_ids == 7) & rollout.response_mask).float().sum(dim=1)


PROMPTS = [[BOS] + [random.Random(i).randrange(3, VOCAB) for _ in range(2 + i % 3)] for i in range(16)]
PPO_CONFIG = PPOConfig(rollout_batch_size=16, mini_batch_size=8, micro_batch_size=2, ppo_epochs=2,
                       learning_rate=1e-3, value_learning_rate=1e-3, max_grad_norm=0.5, lr_schedule="linear",
                       total_updates=2, generation=GenerationConfig(max_new_tokens=6, temperature=0.7, batch_size=8))
DISTRIBUTED_PPO_CONFIG = replace(PPO_CONFIG, micro_batch_size=1)
"""What the 2 processes run: micro-batches of 1 where one process runs micro-batches of 2 (a memory knob: the
update must not change)."""


def ppo_models(value_model: str, make_strategy: Any = None, folder: Path | None = None) -> PPOModels:
    """Tiny policy, its frozen reference, a counting scorer and a value head or a critic; ``lora``: a LoRA
    policy whose reference is the same weights with the adapter disabled, and a value head. ``folder``: the
    policy is loaded from ``folder/policy`` (the same weights) as a worker loads it, partitioned under ZeRO-3,
    and the reference is loaded on its own (``PARTITIONED`` records how much of the policy this rank held)."""
    if folder is not None:
        saved = folder / "policy"
        policy, held = load_partitioned(make_strategy, lambda: disable_dropout(GPT2LMHeadModel.from_pretrained(saved)),
                                        saved)
        PARTITIONED.append(held)
        reference = freeze(GPT2LMHeadModel.from_pretrained(saved))
    else:
        torch.manual_seed(0)
        policy = disable_dropout(GPT2LMHeadModel(gpt2_config(VOCAB)))
        policy, reference = lora_policy(policy, LORA) if value_model == "lora" else (policy, make_reference(policy))
    common = dict(policy=policy, reference=reference, scorer=CountSeven(), stop_token_ids=(EOS,), pad_token_id=PAD)
    if value_model in ("head", "lora"):
        return PPOModels(**common, value_head=ValueHead(32))
    if folder is not None:  # the critic's own reward model, loaded as the worker loads it (ZeRO-3: partitioned)
        saved = folder / "critic"
        model, held = load_partitioned(make_strategy, lambda: GPT2ForSequenceClassification.from_pretrained(saved),
                                       saved)
        PARTITIONED.append(held)
        return PPOModels(**common, critic=Critic(model, copy_weights=False))
    torch.manual_seed(1)
    return PPOModels(**common, critic=Critic(GPT2ForSequenceClassification(gpt2_config(VOCAB, num_labels=1))))


PARTITIONED: list[dict[str, int]] = []
"""What :func:`ppo_models` loading from a folder held of each policy (and critic) right after loading, in order."""


def build_experience(path: Path) -> None:
    """The rollout batch every run updates on, generated once in one process; the start policy and reward model
    also saved (``policy/``, ``rm/``) for the runs that load them as the stage's workers do."""
    start = ppo_models("critic")
    start.policy.save_pretrained(path / "policy")
    start.critic.model.save_pretrained(path / "critic")
    rm_model().save_pretrained(path / "rm")
    for value_model in ("head", "critic", "lora"):
        experience, _, _, _ = collect_experience(ppo_models(value_model), PROMPTS, PPO_CONFIG, KL_COEF,
                                                 torch.Generator().manual_seed(0), RunningMoments())
        torch.save(experience, path / f"experience_{value_model}.pt")


def update_ppo(make_strategy: StrategyFactory | None, value_model: str, folder: Path,
               config: PPOConfig = PPO_CONFIG, load: bool = False, train_policy: bool = True) -> dict[str, Any]:
    """One ppo_update (2 epochs x 2 mini-batches of 8; in micro-batches of 2 in one process, of 1 on each of 2
    processes) on the saved batch; ``load``: the policy loaded from ``folder`` (:func:`ppo_models`);
    ``train_policy=False``: a critic warm-up update (the value model alone)."""
    experience: Experience = torch.load(folder / f"experience_{value_model}.pt", weights_only=False)
    start = ppo_models(value_model, make_strategy, folder if load else None)
    models, strategy = prepare_training(start, config, make_strategy)
    stats = ppo_update(models, strategy, experience, config, KL_COEF, torch.Generator().manual_seed(5), train_policy)
    return {"stats": stats, "policy": _state(strategy, models.policy), "value": _state(strategy, models.value_model)}


def sharded_ppo_step(make_strategy: StrategyFactory, value_model: str, folder: Path | None = None) -> dict[str, Any]:
    """A whole ppo_step: each process generates and scores 8 of the 16 rollouts; one epoch, one mini-batch
    (``folder``: the policy loaded from there, :func:`ppo_models`)."""
    config = PPOConfig(rollout_batch_size=16, mini_batch_size=16, micro_batch_size=4, ppo_epochs=1,
                       generation=GenerationConfig(max_new_tokens=6, temperature=0.7, batch_size=8))
    models, strategy = prepare_training(ppo_models(value_model, make_strategy, folder), config, make_strategy)
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
    stats = ppo_step(models, strategy, state, PROMPTS, config)
    return {"stats": stats, "generator": state.generator.get_state(), "policy": _state(strategy, models.policy)}


RESUME_CONFIG = PPOConfig(rollout_batch_size=8, mini_batch_size=8, micro_batch_size=2, ppo_epochs=1,
                          learning_rate=1e-3, value_learning_rate=1e-3, ref_refresh_every=1,
                          generation=GenerationConfig(max_new_tokens=6, temperature=0.7, batch_size=4))


def interrupted_and_straight_runs(make_strategy: StrategyFactory, folder: Path) -> dict[str, Any]:
    """train_ppo for 2 updates, and for 1 update then (fresh models and engines) resumed to 2."""
    straight = train_ppo(ppo_models("critic"), PROMPTS, RESUME_CONFIG, 2, checkpoint_dir=folder / "straight",
                         make_strategy=make_strategy)
    train_ppo(ppo_models("critic"), PROMPTS, RESUME_CONFIG, 1, checkpoint_dir=folder / "resumed",
              make_strategy=make_strategy)
    resumed = train_ppo(ppo_models("critic"), PROMPTS, RESUME_CONFIG, 2, checkpoint_dir=folder / "resumed",
                        make_strategy=make_strategy)
    sealed = json.loads((folder / "resumed" / "step_000002" / "manifest.json").read_text())["files"]
    return {"straight": straight.history, "resumed": resumed.history, "resumed_from": resumed.resumed_from_step,
            "sealed": sorted(sealed)}


def _state(strategy, module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().float() for k, v in strategy.full_state_dict(module).items()}


def _weights(model, make_strategy) -> dict[str, torch.Tensor]:
    """The reward model's weights after training (ZeRO-3: gathered from the shards)."""
    if make_strategy is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _state(make_strategy.built[-1], model)


# --------------------------------------------------------------------------------------------- spawned


def worker(rank: int, world_size: int, port: int, folder: str) -> None:
    """One of ``world_size`` processes: every case under DeepSpeed; rank 0 saves the results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's notes on DeepSpeed's collective calls
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    from rlhf_core.distributed.zero import DeepSpeedFactory, init_distributed

    init_distributed()
    out: dict[str, Any] = {}
    for name, (ds_config, value_model) in CASES.items():
        load = value_model != "lora"  # loaded as the stage's workers load them (ZeRO-3: partitioned as they load)
        rm = DeepSpeedFactory(ds_config, micro_batch_size=-(-RM_CONFIG.batch_size // world_size))
        out[f"{name}/rm"] = train_rm(rm, lora=value_model == "lora", folder=Path(folder) if load else None)
        ppo = DeepSpeedFactory(ds_config, micro_batch_size=DISTRIBUTED_PPO_CONFIG.micro_batch_size)
        out[f"{name}/ppo"] = update_ppo(ppo, value_model, Path(folder), DISTRIBUTED_PPO_CONFIG, load=load)
        step = sharded_ppo_step(DeepSpeedFactory(ds_config, micro_batch_size=4), value_model,
                                Path(folder) if load else None)
        out[f"{name}/partitioned"] = list(PARTITIONED)
        PARTITIONED.clear()
        out[f"{name}/step"] = step["stats"]
        out[f"{name}/step_ranks"] = _all_ranks(step)
    warmup = DeepSpeedFactory(ZERO2, micro_batch_size=DISTRIBUTED_PPO_CONFIG.micro_batch_size)
    out["zero2/warmup"] = update_ppo(warmup, "head", Path(folder), DISTRIBUTED_PPO_CONFIG, load=True,
                                     train_policy=False)
    resume = DeepSpeedFactory(ZERO3_OFFLOAD, micro_batch_size=RESUME_CONFIG.micro_batch_size)
    out["resume"] = interrupted_and_straight_runs(resume, Path(folder))
    if rank == 0:
        torch.save(out, Path(folder) / "distributed.pt")


def _all_ranks(step: dict[str, Any]) -> list[Any]:
    import torch.distributed as dist

    policy = step["policy"]
    trained = next((k for k in sorted(policy) if "lora_B" in k), "transformer.h.0.attn.c_attn.weight")
    mine = (step["stats"].rollout, step["generator"], policy[trained])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered
