"""ppo.offload_frozen: the frozen reference and reward model wait in host memory while the policy and value model
train, only where they share no weights with a trained model, and a run with it equals a run without it.

On a CPU-only machine host memory and the "accelerator" are the same device, so the tests replace the move
(:class:`FakeHostMove`): a parked network's parameters really lose their weights (empty tensors: any forward on them
fails) and coming home restores the very tensors that left. A run that used a parked network, or that trained while
one was home, fails or records it, and its results are compared bit for bit with the run without the knob.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.config import GenerationConfig, LoRAConfig, PPOConfig
from rlhf_core.models import offload
from rlhf_core.models.lora import LoRACritic, lora_policy
from rlhf_core.models.offload import OWNS_NO_WEIGHTS, SHARES_WEIGHTS, offload_plan, parked, scorer_networks
from rlhf_core.models.roles import Critic, ValueHead, disable_dropout, freeze, make_reference
from rlhf_core.models.scoring import RewardModelScorer, WeightedSum
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import train_ppo
from rlhf_core.training.ppo_step import frozen_offload
from tests.tiny_models import gpt2_config, word_tokenizer

PAD, BOS, EOS = 0, 1, 2
VOCAB = len(word_tokenizer())
LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0)
PROMPTS = [[BOS] + [random.Random(i).randrange(3, VOCAB) for _ in range(1 + i % 4)] for i in range(24)]
SETUPS = ("full", "lora_head", "lora_critic", "rule_critic_free")
PARK = torch.device("meta")
"""The park device the tests give: a marker for :class:`FakeHostMove` (nothing goes to the meta device)."""


class CountSeven:
    """A rule-based scorer: no network."""

    def __call__(self, rollout):
        return ((rollout.response_ids == 7) & rollout.response_mask).float().sum(dim=1)


def build(setup: str) -> PPOModels:
    """The PPO roles of one setup, the same weights every call."""
    torch.manual_seed(0)
    base = disable_dropout(GPT2LMHeadModel(gpt2_config(VOCAB)))
    reward_model = freeze(GPT2ForSequenceClassification(gpt2_config(VOCAB, num_labels=1)))
    scorer = RewardModelScorer(reward_model, word_tokenizer(), batch_size=4)
    if setup == "full":  # full fine-tuning: a reference copy, a critic copied from the reward model
        return PPOModels(base, make_reference(base), scorer, (EOS,), PAD, critic=Critic(reward_model))
    if setup == "lora_head":  # reference = the policy with its adapter off; value head on the policy
        policy, reference = lora_policy(base, LORA)
        return PPOModels(policy, reference, scorer, (EOS,), PAD, value_head=ValueHead(32))
    if setup == "lora_critic":  # ... and a critic that adapts the scorer's reward-model weights in place
        policy, reference = lora_policy(base, LORA)
        return PPOModels(policy, reference, scorer, (EOS,), PAD, critic=LoRACritic(reward_model, LORA))
    return PPOModels(base, make_reference(base), CountSeven(), (EOS,), PAD)  # rule scorer, critic-free


def config(setup: str, **overrides) -> PPOConfig:
    settings = {"rollout_batch_size": 8, "mini_batch_size": 4, "micro_batch_size": 2, "ppo_epochs": 2,
                "learning_rate": 3e-3, "value_learning_rate": 3e-3, "ref_refresh_every": 2, "seed": 3,
                "generation": GenerationConfig(max_new_tokens=6, batch_size=8)}
    if setup == "rule_critic_free":
        settings.update(advantage="grpo", samples_per_prompt=2)
    settings.update(overrides)
    return PPOConfig(**settings)


@pytest.mark.parametrize(("setup", "moved", "kept"), [
    ("full", ["reference", "reward model"], {}),
    ("lora_head", ["reward model"], {"reference": OWNS_NO_WEIGHTS}),
    ("lora_critic", [], {"reference": OWNS_NO_WEIGHTS, "reward model": SHARES_WEIGHTS}),
    ("rule_critic_free", ["reference"], {}),
])
def test_what_each_setup_offloads(setup: str, moved: list[str], kept: dict[str, str]):
    models = build(setup)
    plan = frozen_offload(models, config(setup, offload_frozen=True))
    assert list(plan.moved) == moved and plan.kept == kept
    networks = {"reference": models.reference, "reward model": getattr(models.scorer, "model", None)}
    assert all(plan.moved[role] is networks[role] for role in moved)
    assert frozen_offload(models, config(setup)).moved == {}  # the knob off: nothing moves


def test_sharing_is_read_from_the_tensors_not_the_objects():
    trained = nn.Linear(4, 4)
    same_storage = nn.Linear(4, 4)
    same_storage.weight = nn.Parameter(trained.weight.detach()[1:].clone().requires_grad_(False), False)
    assert offload_plan({"copy": same_storage}, [trained]).moved == {"copy": same_storage}  # a copy: movable
    same_storage.weight = nn.Parameter(trained.weight.detach()[1:], requires_grad=False)  # a view of its storage
    assert offload_plan({"view": same_storage}, [trained]).kept == {"view": SHARES_WEIGHTS}
    shared_buffer = nn.BatchNorm1d(4)
    trainee = nn.BatchNorm1d(4)
    trainee.running_mean = shared_buffer.running_mean
    assert offload_plan({"norm": shared_buffer}, [trainee]).kept == {"norm": SHARES_WEIGHTS}


def test_scorer_networks_of_sums_and_rules():
    rm = freeze(GPT2ForSequenceClassification(gpt2_config(VOCAB, num_labels=1)))
    scorer = RewardModelScorer(rm, word_tokenizer())
    assert scorer_networks(scorer) == {"reward model": rm}
    assert scorer_networks(CountSeven()) == {}
    assert scorer_networks(WeightedSum([(CountSeven(), 0.5), (scorer, 1.0)])) == {"reward model (part 1)": rm}


@dataclass
class FakeHostMove:
    """Stands in for moving to host memory on a CPU-only machine: a network parked on :data:`PARK` loses its weights
    for real (each parameter and buffer then holds an empty tensor, like ZeRO-3's released parameters: any forward
    on it fails), and coming home restores the very tensors that left. Records every move in ``events`` as
    'park <name>' / 'home <name>' (``names``: module id -> name)."""

    events: list[str] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    stash: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def __call__(self, module: nn.Module, device: torch.device) -> None:
        name = self.names.get(id(module), type(module).__name__)
        if device == PARK:
            self.events.append(f"park {name}")
            tensors = [*module.parameters(), *module.buffers()]
            self.stash[id(module)] = [(t, t.data) for t in tensors]
            for t in tensors:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            return
        self.events.append(f"home {name}")
        for tensor, data in self.stash.pop(id(module)):
            tensor.data = data


def held(module: nn.Module) -> str:
    """'held' when ``module`` has its weights, 'released' when it is parked."""
    return "held" if all(p.numel() for p in module.parameters()) else "released"


@pytest.fixture
def fake_host(monkeypatch: pytest.MonkeyPatch) -> FakeHostMove:
    spy = FakeHostMove()
    monkeypatch.setattr(offload, "HOST", PARK)
    monkeypatch.setattr(offload, "move", spy)
    return spy


def test_parked_releases_and_restores_the_same_tensors(fake_host: FakeHostMove):
    torch.manual_seed(0)
    model, other = GPT2LMHeadModel(gpt2_config(VOCAB)), GPT2LMHeadModel(gpt2_config(VOCAB))
    params = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with parked([model, other]):
        assert held(model) == held(other) == "released"
        with pytest.raises(RuntimeError):  # nothing can run on parked weights
            model(torch.tensor([[BOS, 5]]))
    assert held(model) == "held" and [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.raises(ValueError, match="boom"), parked([model]):
        raise ValueError("boom")
    assert held(model) == "held"  # back home after a failure too
    assert fake_host.events == ["park GPT2LMHeadModel"] * 2 + ["home GPT2LMHeadModel"] * 2 + [
        "park GPT2LMHeadModel", "home GPT2LMHeadModel"]


def test_the_real_move_keeps_parameters_and_ties():
    """``move`` (``Module.to``) swaps each parameter's storage: the same objects, ties kept, values kept."""
    model = GPT2LMHeadModel(gpt2_config(VOCAB))
    params, before = list(model.parameters()), {k: v.clone() for k, v in model.state_dict().items()}
    with parked([model]):
        assert {p.device for p in model.parameters()} == {offload.HOST}
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _record_phases(models: PPOModels, parked_roles: dict[str, nn.Module], spy: FakeHostMove) -> None:
    """Adds to ``spy.events``: each frozen network's forwards with the device its weights are on, and each training
    forward of the policy (under gradients) with whether the parked networks hold their weights."""
    spy.names.update({id(module): role for role, module in parked_roles.items()})
    for role, module in parked_roles.items():
        module.get_input_embeddings().register_forward_pre_hook(
            lambda m, args, role=role: spy.events.append(f"{role} forward, weights {held(m)}"))

    def on_policy_forward(m, args):
        if torch.is_grad_enabled():
            spy.events.append(_training_on(sorted({held(module) for module in parked_roles.values()})))

    models.policy.get_input_embeddings().register_forward_pre_hook(on_policy_forward)


def _training_on(states: list[str]) -> str:
    return "train" + (f", frozen {'/'.join(states)}" if states else "")


def _squeezed(events: list[str]) -> list[str]:
    """Runs of the same event as one."""
    return [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]


def _results(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """Every metric but the wall-clock times."""
    return [{k: v for k, v in step.items() if not k.startswith("time/")} for step in history]


def _weights(models: PPOModels) -> dict[str, torch.Tensor]:
    named = {"policy": models.policy, "reference": models.reference}
    if models.value_model is not None:
        named["value"] = models.value_model
    return {f"{role}.{k}": v.clone() for role, m in named.items() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("setup", SETUPS)
def test_offload_parks_only_while_training_and_changes_nothing(setup: str, fake_host: FakeHostMove):
    without = build(setup)
    expected = train_ppo(without, PROMPTS, config(setup), 3).history  # reference refreshed after step 2

    models = build(setup)
    parked_roles = frozen_offload(models, config(setup, offload_frozen=True)).moved
    _record_phases(models, parked_roles, fake_host)
    result = train_ppo(models, PROMPTS, config(setup, offload_frozen=True), 3)

    assert _results(result.history) == _results(expected)  # every metric of every step, bit for bit
    after, reference = _weights(models), _weights(without)
    assert after.keys() == reference.keys() and all(torch.equal(after[k], reference[k]) for k in after)
    roles = list(parked_roles)
    rollout = [f"{role} forward, weights held" for role in ("reference", "reward model") if role in roles]
    one_step = [*rollout, *(f"park {r}" for r in roles), _training_on(["released"] if roles else []),
                *(f"home {r}" for r in roles)]
    assert _squeezed(fake_host.events) == _squeezed(one_step * 3)
    assert not fake_host.stash  # everything came back


def test_resume_with_offload_equals_the_uninterrupted_run(tmp_path: Path, fake_host: FakeHostMove):
    expected = train_ppo(build("full"), PROMPTS, config("full"), 4).history  # reference refreshed at 2 and 4
    train_ppo(build("full"), PROMPTS, config("full", offload_frozen=True), 2, checkpoint_dir=tmp_path,
              checkpoint_every=2)
    resumed = train_ppo(build("full"), PROMPTS, config("full", offload_frozen=True), 4, checkpoint_dir=tmp_path,
                        checkpoint_every=2)
    assert resumed.resumed_from_step == 2
    assert _results(resumed.history) == _results(expected)
    assert fake_host.events.count("park GPT2LMHeadModel") == 4 and not fake_host.stash


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parked_frees_cuda_memory_and_restores_values():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(VOCAB, n_embd=256, n_layer=4)).cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    held = torch.cuda.memory_allocated()
    with parked([model]):
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert torch.cuda.memory_allocated() < held - sum(p.numel() * p.element_size() for p in model.parameters()) // 2
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
