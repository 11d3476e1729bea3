"""The models every benchmark runs on, built locally and cached: tokenizer, policy, reward model, prompts.

Nothing is downloaded. A byte-level BPE is trained on the demo task's text, a GPT-2 policy is built from a
config (and optionally given a short SFT on demonstrations so it answers and stops like a real seed policy),
a reward model of the same shape is initialised from the policy's backbone (and optionally trained on
preference pairs), and prompts are drawn from the demo task. The result lands in
``benchmarks/.cache/<spec hash>/`` so alternating benchmark processes load identical weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CACHE = Path(__file__).resolve().parent / ".cache"


@dataclass(frozen=True)
class FixtureSpec:
    """Everything that determines the cached models; its hash names the cache folder."""

    vocab_size: int = 1000
    """BPE vocabulary (the demo task's text saturates near 1000 tokens)."""
    n_layer: int = 4
    """Transformer blocks of the policy and of the reward model."""
    n_embd: int = 256
    """Hidden width (4 x 256: ~3.5M parameters with a 1000-token vocabulary)."""
    n_head: int = 4
    """Attention heads."""
    n_positions: int = 256
    """Longest prompt + response."""
    sft_demonstrations: int = 0
    """Demonstrations for one SFT epoch of the policy (0 = keep the random initialisation)."""
    rm_pairs: int = 0
    """Preference pairs for one epoch of reward-model training (0 = random score head on the policy's backbone)."""
    n_prompts: int = 256
    """Prompts drawn from the demo task for rollouts."""
    prompt_max_tokens: int = 48
    """Prompts longer than this keep their last tokens (where the question and ``Agent:`` are)."""
    seed: int = 0
    """Seeds the text, the weights and the prompts."""

    def key(self) -> str:
        """Short stable hash of the spec."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Fixture:
    """Paths of a built fixture."""

    root: Path

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def policy_dir(self) -> Path:
        return self.root / "policy"

    @property
    def reward_dir(self) -> Path:
        return self.root / "reward"

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The trained tokenizer, left padding (prompts are left-padded on both sides of every comparison)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        tokenizer.padding_side = "left"
        return tokenizer

    def prompts(self) -> list[list[int]]:
        """Token ids of the prompts, in a fixed order."""
        return json.loads((self.root / "prompts.json").read_text())

    def info(self) -> dict:
        """Parameter counts, SFT / RM results and build time recorded when the fixture was built."""
        return json.loads((self.root / "info.json").read_text())


def build_fixture(spec: FixtureSpec, cache: Path = CACHE) -> Fixture:
    """Build (or reuse) the fixture for ``spec``. Deterministic for a spec; safe to call from several processes
    one after another (a half-built folder is never visible under the final name)."""
    final = cache / spec.key()
    if (final / "info.json").exists():
        return Fixture(final)
    work = cache / f"{spec.key()}.building"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    info = _build(spec, work)
    (work / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    return Fixture(final)


def _build(spec: FixtureSpec, out: Path) -> dict:
    """Train the tokenizer, build (and optionally train) the policy and the reward model, draw the prompts."""
    # Imported here so that reading a spec or a built fixture stays cheap (the benchmark drivers only do that).
    import torch

    from rlhf_core.demo.generator import task_texts
    from rlhf_core.demo.prompts import generate_prompts
    from rlhf_core.models.lm import (ModelSize, build_causal_lm, build_reward_model, config_for_tokenizer,
                                     count_parameters)
    from rlhf_core.models.text import encode_prompt, keep_tail
    from rlhf_core.models.tokenizer import train_bpe_tokenizer

    torch.manual_seed(spec.seed)
    tokenizer = train_bpe_tokenizer(task_texts(spec.seed, 3000), spec.vocab_size, model_max_length=spec.n_positions)
    config = config_for_tokenizer(tokenizer, ModelSize(spec.n_layer, spec.n_embd, spec.n_head, spec.n_positions))
    policy = build_causal_lm(config, seed=spec.seed)
    info: dict = {"spec": asdict(spec), "policy_parameters": count_parameters(policy)}
    if spec.sft_demonstrations:
        info["sft"] = _sft(policy, tokenizer, spec)
    reward = build_reward_model(config, seed=spec.seed + 1)
    # The reward model starts from the policy's backbone (as in the demo pipeline) with a fresh score head.
    reward.transformer.load_state_dict(policy.transformer.state_dict())
    if spec.rm_pairs:
        info["reward_model"] = _train_reward(reward, tokenizer, spec)
    info["reward_parameters"] = count_parameters(reward)
    prompts = [keep_tail(encode_prompt(tokenizer, r.prompt), spec.prompt_max_tokens)[0]
               for r in generate_prompts(spec.n_prompts, spec.seed + 2)]
    info["prompt_tokens_mean"] = sum(map(len, prompts)) / len(prompts)
    for name, model in (("policy", policy), ("reward", reward)):
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    tokenizer.save_pretrained(out / "tokenizer")
    (out / "prompts.json").write_text(json.dumps(prompts))
    return info


def _sft(policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, spec: FixtureSpec) -> dict:
    """One epoch of SFT on demo demonstrations (64 held out); the held-out loss before and after."""
    from rlhf_core.demo.generator import generate_sft_demonstrations
    from rlhf_core.training.sft import train_sft
    from rlhf_core.config import SFTConfig

    demos = [(d["prompt"], d["reply"]) for d in generate_sft_demonstrations(spec.sft_demonstrations + 64, spec.seed)]
    config = SFTConfig(epochs=1, batch_size=32, micro_batch_size=32, learning_rate=2e-3, warmup_steps=10,
                       max_length=min(128, spec.n_positions),
                       eval_every=0, log_every=0, seed=spec.seed)
    result = train_sft(policy, tokenizer, demos[64:], demos[:64], config)
    return {"eval_loss_before": result.initial_eval_loss, "eval_loss_after": result.final_eval_loss,
            "seconds": result.seconds}


def _train_reward(reward: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, spec: FixtureSpec) -> dict:
    """One epoch of Bradley-Terry training on demo preference pairs (128 held out); held-out accuracy."""
    from rlhf_core.config import RewardTrainingConfig
    from rlhf_core.demo.generator import generate_preference_pairs
    from rlhf_core.training.reward_training import train_reward_model
    from rlhf_core.data.records import PreferencePair

    rows = generate_preference_pairs(spec.rm_pairs + 128, spec.seed)
    pairs = [PreferencePair(r["prompt"], r["chosen"], r["rejected"]) for r in rows]
    config = RewardTrainingConfig(epochs=1, batch_size=32, learning_rate=5e-4, max_length=min(128, spec.n_positions),
                                  seed=spec.seed)
    evaluation = train_reward_model(reward, tokenizer, pairs[128:], pairs[:128], config)
    final = evaluation.final_eval
    return {"heldout_accuracy": final.accuracy, "score_std": final.score_std, "seconds": evaluation.seconds}
