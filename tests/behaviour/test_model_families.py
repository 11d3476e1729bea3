"""Bring your own Hugging Face models: tiny BERT, GPT-2, Llama and GPT-NeoX checkpoints, each with its own
tokenizer, go through causality detection, packed scoring, reward-model training, cross-tokenizer scoring and a PPO
step; a BERT folder is refused as a policy."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig, PPOConfig, RewardTrainingConfig
from rlhf_core.models import packing
from rlhf_core.models.families import attention_is_causal, probe_causal, score_prefix
from rlhf_core.models.roles import (Critic, ValueHead, freeze, init_reward_model, load_policy, load_reward_model,
                                    make_reference, sequence_scores)
from rlhf_core.models.scoring import RewardModelScorer
from rlhf_core.models.sequences import Rollout, left_pad
from rlhf_core.models.text import encode_pair, encode_prompt, pad_id, right_pad
from rlhf_core.models.tokenizer import resolve_special_tokens
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_step, prepare_training
from rlhf_core.training.reward_training import train_reward_model
from rlhf_core.data.records import PreferencePair
from tests.model_families import (BASE_CLASSES, DECODERS, FAMILIES, POLICY_CLASSES, REWARD_CLASSES, config,
                                  save_base_model, save_policy, save_reward_model)

pytestmark = pytest.mark.usefixtures("single_thread")

FILLER = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "red", "blue", "big", "small", "tree", "box"]
#: (prompt, reply) texts of very different lengths: padded batches of them are mostly padding.
TEXTS = [
    ("q the cat sat on the mat", " the fast dog ran on the mat good good and the slow cat sat in the box"),
    ("q why", " bad"),
    ("q how big is the sun", " a small tree"),
    ("hello", " good"),
    ("q the dog", " the red box is good and the blue star is bad"),
    ("q how fast is a star", " slow"),
]
#: Init std of reward models whose scores are compared: at the usual 0.02 a random BERT gives every input nearly
#: the same score (about -8e-4 +- 5e-5), too close for a 1e-5 comparison to tell a wrong input from a right one.
SPREAD = 0.1


def own_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``folder``, with eos / bos / pad filled in the way the stages do."""
    return resolve_special_tokens(AutoTokenizer.from_pretrained(folder))


def scored_batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Each of TEXTS as the reward model reads it: its prefix ([CLS] for an encoder), prompt, reply, eos."""
    prefix = score_prefix(model, tokenizer)
    return [prefix + encode_pair(tokenizer, prompt, reply) for prompt, reply in TEXTS]


@torch.no_grad()
def hf_score(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """The classifier's own forward on one unpadded row: what Hugging Face says the score is. -> (1,)."""
    return model(input_ids=torch.tensor([ids])).logits[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_causality_is_read_from_the_model_and_decides_packing(family: str):
    decoder = family in DECODERS
    for classes in (REWARD_CLASSES, BASE_CLASSES, POLICY_CLASSES):
        model = classes[family](config(family, num_labels=1))
        assert attention_is_causal(model) is decoder, type(model).__name__
        assert probe_causal(model) is decoder, type(model).__name__
        # Packed sequences stay apart only under causal attention: an encoder must run padded.
        assert packing.supports_packing(model) is decoder, type(model).__name__


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_scores_equal_each_row_scored_alone(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model = load_reward_model(save_reward_model(family, tmp_path / "rm", initializer_range=SPREAD))
    tokenizer = own_tokenizer(str(tmp_path / "rm"))
    rows = scored_batch(model, tokenizer)
    if family not in DECODERS:
        assert all(row[0] == tokenizer.cls_token_id for row in rows)  # BERT's head reads position 0
    ids, mask = right_pad(rows, pad_id(tokenizer))
    alone = torch.cat([hf_score(model, row) for row in rows])
    assert alone.std() > 1e-3  # the rows score differently: a mixed-up row would show
    with torch.no_grad():
        batched = sequence_scores(model, ids, mask)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    if family in DECODERS:
        assert packing.pack(ids, mask) is not None  # the batch above went through the packed forward
        monkeypatch.setattr(packing, "PACK_MIN_SAVING", 1.0)  # now nothing saves enough: padded forward
        assert packing.pack(ids, mask) is None
        with torch.no_grad():
            padded = sequence_scores(model, ids, mask)
        torch.testing.assert_close(padded, batched, atol=1e-5, rtol=0)


def good_bad_pairs(n: int, seed: int) -> list[PreferencePair]:
    """The chosen reply has 'good' where the rejected one has 'bad'; the rest is the same filler."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = "q " + " ".join(rng.choice(FILLER) for _ in range(rng.randint(1, 3)))
        words = [rng.choice(FILLER) for _ in range(rng.randint(2, 4))]
        spot = rng.randint(0, len(words))
        chosen, rejected = (" " + " ".join(words[:spot] + [word] + words[spot:]) for word in ("good", "bad"))
        pairs.append(PreferencePair(prompt, chosen, rejected))
    return pairs


@pytest.mark.parametrize("family", FAMILIES)
def test_reward_model_learns_with_its_own_tokenizer(family: str, tmp_path: Path):
    folder = save_reward_model(family, tmp_path / "rm")
    tokenizer = own_tokenizer(folder)
    train, held_out = good_bad_pairs(32, seed=0), good_bad_pairs(16, seed=1)
    settings = dict(batch_size=8, max_length=64, learning_rate=1e-3)
    # learning_rate=0: the same pass that only measures, so "before" is read exactly as "after" is.
    model = load_reward_model(folder)
    before = train_reward_model(model, tokenizer, train, held_out,
                                RewardTrainingConfig(epochs=1, **{**settings, "learning_rate": 0.0})).final_eval
    result = train_reward_model(model, tokenizer, train, held_out, RewardTrainingConfig(epochs=8, **settings))
    after = result.final_eval
    print(f"{family}: held-out accuracy {before.accuracy:.2f} -> {after.accuracy:.2f}, loss {before.loss:.3f} -> "
          f"{after.loss:.3f}, margin {after.margin_mean:.3f}")
    assert after.accuracy > 0.8, f"{family}: held-out accuracy {before.accuracy:.2f} -> {after.accuracy:.2f}"
    assert after.loss < min(before.loss, 0.3) and after.margin_mean > 1.0


@pytest.mark.parametrize(("family", "source"),
                         [(family, "base") for family in FAMILIES] + [("bert", "two_labels"), ("gpt2", "two_labels")])
def test_reward_model_from_a_base_or_two_label_checkpoint_gets_a_fresh_scalar_head(
    family: str, source: str, tmp_path: Path
):
    if source == "base":
        folder = save_base_model(family, tmp_path / "base")
        saved = BASE_CLASSES[family].from_pretrained(folder)
    else:
        folder = save_reward_model(family, tmp_path / "two", num_labels=2)
        saved = REWARD_CLASSES[family].from_pretrained(folder).base_model
    model, fresh_head = init_reward_model(folder, seed=0, dtype=torch.float32)
    assert fresh_head and model.config.num_labels == 1
    tokenizer = own_tokenizer(folder)
    ids, mask = right_pad(scored_batch(model, tokenizer), pad_id(tokenizer))
    with torch.no_grad():
        scores = sequence_scores(model, ids, mask)
    assert scores.shape == (len(TEXTS),) and torch.isfinite(scores).all()
    # The backbone is the checkpoint's, only the head is new: drawn from the seed, so a rerun starts the same.
    kept = model.base_model.state_dict()
    for name, weight in saved.state_dict().items():
        assert torch.equal(kept[name], weight), name
    assert heads_equal(model, init_reward_model(folder, seed=0)[0])
    assert not heads_equal(model, init_reward_model(folder, seed=1)[0])


def heads_equal(a: PreTrainedModel, b: PreTrainedModel) -> bool:
    """Whether two sequence classifiers have the same weights outside their backbones."""
    backbone = {f"{a.base_model_prefix}.{name}" for name in a.base_model.state_dict()}
    other = b.state_dict()
    return all(torch.equal(weight, other[name]) for name, weight in a.state_dict().items() if name not in backbone)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_one_output_classifier_keeps_its_head(family: str, tmp_path: Path):
    folder = save_reward_model(family, tmp_path / "rm", seed=3)
    saved = REWARD_CLASSES[family].from_pretrained(folder).state_dict()
    for model in (load_reward_model(folder), init_reward_model(folder, seed=0)[0]):
        loaded = model.state_dict()
        assert saved.keys() == loaded.keys()
        assert all(torch.equal(loaded[name], weight) for name, weight in saved.items())
    assert init_reward_model(folder, seed=0)[1] is False  # not a fresh head


@pytest.mark.parametrize("checkpoint", ["masked_lm", "base"])
def test_a_bert_folder_is_refused_as_a_policy(checkpoint: str, tmp_path: Path):
    save = save_policy if checkpoint == "masked_lm" else save_base_model
    folder = save("bert", tmp_path / "bert")
    with pytest.raises(ValueError, match="causal") as refused:
        load_policy(folder)
    assert "\n" not in str(refused.value)


def handmade_rollout(tokenizer: PreTrainedTokenizerBase, texts: list[tuple[str, str, bool]]) -> Rollout:
    """A rollout of the given (prompt, reply, stopped) texts in the policy's ids: prompts left-padded, replies
    right-padded, eos ending the replies that stopped (pad may be eos: only the masks say which is which)."""
    pad = pad_id(tokenizer)
    query_ids, query_mask = left_pad([encode_prompt(tokenizer, prompt) for prompt, _, _ in texts], pad)
    replies = [encode_pair(tokenizer, "", reply, add_eos=stopped) for _, reply, stopped in texts]
    response_ids, response_mask = right_pad(replies, pad)
    return Rollout(query_ids, query_mask, response_ids, response_mask.bool(),
                   logprobs=torch.zeros(response_ids.shape), stopped=torch.tensor([s for _, _, s in texts]))


def test_an_encoder_reward_model_scores_a_decoder_policys_text(tmp_path: Path):
    policy_tokenizer = own_tokenizer(save_policy("gpt2", tmp_path / "policy"))
    assert policy_tokenizer.pad_token_id == policy_tokenizer.eos_token_id  # GPT-2 has no pad of its own
    rm_folder = save_reward_model("bert", tmp_path / "rm", seed=2, initializer_range=SPREAD)
    rm, rm_tokenizer = load_reward_model(rm_folder), own_tokenizer(rm_folder)
    texts = [("q the cat sat", " good dog", True), ("q why is the moon so slow", " the red box is bad", False),
             ("q how big is the sun", " big", True), ("hello", " a small tree and a big moon", False)]
    scorer = RewardModelScorer(rm, policy_tokenizer, rm_tokenizer)
    assert scorer.retokenize
    scores = scorer(handmade_rollout(policy_tokenizer, texts))
    cls, sep = rm_tokenizer.cls_token_id, rm_tokenizer.sep_token_id
    for row, (prompt, reply, stopped) in enumerate(texts):
        ids = [cls] + encode_pair(rm_tokenizer, prompt, reply, add_eos=False) + ([sep] if stopped else [])
        torch.testing.assert_close(scores[row : row + 1], hf_score(rm, ids), atol=1e-5, rtol=0)


class Recording:
    """A scorer that keeps every rollout it scores (to inspect what ``ppo_step`` generated)."""

    def __init__(self, scorer: RewardModelScorer) -> None:
        self.scorer = scorer
        self.rollouts: list[Rollout] = []

    def __call__(self, rollout: Rollout) -> torch.Tensor:
        self.rollouts.append(rollout)
        return self.scorer(rollout)

    def identity(self) -> str:
        return self.scorer.identity()


PPO_PROMPTS = ["q the cat sat", "q why", "q how big is the sun", "hello", "q the dog ran", "q a red box",
               "q how fast is a star", "q why is the moon so slow"]


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("reward", ["same_family_critic", "bert_value_head"])
def test_ppo_step_with_each_decoder_policy(family: str, reward: str, tmp_path: Path):
    policy_folder = save_policy(family, tmp_path / "policy", stop_probability=0.15)
    tokenizer = own_tokenizer(policy_folder)
    policy = load_policy(policy_folder)
    if reward == "same_family_critic":
        rm_folder = save_reward_model(family, tmp_path / "rm", seed=1)
        rm = load_reward_model(rm_folder)
        value = dict(critic=Critic(rm))
    else:
        rm_folder = save_reward_model("bert", tmp_path / "rm", seed=1)
        rm = load_reward_model(rm_folder)
        value = dict(value_head=ValueHead(policy.config.hidden_size))
    scorer = Recording(RewardModelScorer(freeze(rm), tokenizer, own_tokenizer(rm_folder)))
    models = PPOModels(policy, make_reference(policy), scorer, (tokenizer.eos_token_id,), pad_id(tokenizer), **value)
    config = PPOConfig(rollout_batch_size=8, mini_batch_size=8, micro_batch_size=4, ppo_epochs=1,
                       learning_rate=1e-3, value_learning_rate=1e-3,
                       generation=GenerationConfig(max_new_tokens=6, batch_size=8))
    models, strategy = prepare_training(models, config)
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in policy.parameters()]
    value_before = [p.detach().clone() for p in models.value_parameters()]

    stats = ppo_step(models, strategy, state, [encode_prompt(tokenizer, p) for p in PPO_PROMPTS], config)

    for name in ("policy_loss", "value_loss", "policy_grad_norm", "value_grad_norm"):
        assert math.isfinite(getattr(stats.update, name)), name
    assert math.isfinite(stats.rollout.score_mean)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(value_before, models.value_parameters(), strict=True))
    (rollout,) = scorer.rollouts
    eos = tokenizer.eos_token_id
    if family in ("gpt2", "llama"):
        assert pad_id(tokenizer) == eos  # no pad of their own: padding is the stop token's id
    assert rollout.stopped.any() and (~rollout.response_mask).any()  # stops followed by padding
    assert stats.rollout.stop_rate == pytest.approx(float(rollout.stopped.float().mean()))
    for row in range(rollout.response_ids.shape[0]):
        real = rollout.response_ids[row][rollout.response_mask[row]]
        # The stop token is the last real token of a stopped reply, and nowhere before it, even when pad == eos.
        assert bool(rollout.stopped[row]) == (real[-1].item() == eos)
        assert (real[:-1] != eos).all()


@pytest.mark.parametrize("family", ["bert", "gpt_neox"])
def test_a_lora_reward_model_of_another_family_trains_its_adapter_and_its_whole_head(family: str, tmp_path: Path):
    """The default adapter targets of BERT and GPT-NeoX fit their layers; the head (BERT's classifier on the
    pooled [CLS]) trains in full, outside the adapter, and the merged model is a plain classifier again."""
    from rlhf_core.config import LoRAConfig

    folder = save_reward_model(family, tmp_path / "rm")
    tokenizer, model = own_tokenizer(folder), load_reward_model(folder)
    head_name = "classifier" if family == "bert" else "score"
    head_before = getattr(model, head_name).weight.detach().clone()
    backbone_before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith(head_name)}
    result = train_reward_model(model, tokenizer, good_bad_pairs(32, seed=0), good_bad_pairs(16, seed=1),
                                RewardTrainingConfig(epochs=8, batch_size=8, max_length=64, learning_rate=3e-3,
                                                     lora=LoRAConfig(enabled=True, rank=4, alpha=8.0)))
    assert type(model) is REWARD_CLASSES[family] and not any("lora" in n for n, _ in model.named_parameters())
    assert not torch.equal(getattr(model, head_name).weight, head_before)
    moved = [n for n, p in model.named_parameters() if n in backbone_before and not torch.equal(p, backbone_before[n])]
    assert moved, "the merged adapter changes the adapted backbone layers"
    assert result.final_eval.accuracy > 0.8


def test_a_bf16_encoder_reward_model_keeps_its_head_in_float32_while_it_trains(tmp_path: Path):
    """bf16 weights, no autocast: BERT's classifier is held in float32 (its input cast on the way in), so its small
    updates do not round away; it is saved back in bf16 with the rest. (Read at the last step, before that cast:
    four Adam steps of 5e-5 can round back to the starting bf16 value when the head returns to bf16.)"""
    folder = save_reward_model("bert", tmp_path / "rm")
    tokenizer, model = own_tokenizer(folder), load_reward_model(folder, torch.bfloat16)
    before = model.classifier.weight.detach().float().clone()
    trained = {}

    def on_log(step: int, metrics: dict[str, float]) -> None:
        trained.update(dtype=model.classifier.weight.dtype, weight=model.classifier.weight.detach().clone())

    train_reward_model(model, tokenizer, good_bad_pairs(16, seed=0), good_bad_pairs(8, seed=1),
                       RewardTrainingConfig(epochs=2, batch_size=8, max_length=64, learning_rate=5e-5), on_log=on_log)
    after = trained["weight"]
    assert trained["dtype"] == torch.float32 and model.classifier.weight.dtype == torch.bfloat16
    large = before.abs() >= 2 ** -6  # where one bf16 step is larger than an Adam step of 5e-5
    assert bool((after[large] != before[large]).all())


def test_a_critic_is_refused_for_an_encoder_or_a_reward_model_of_another_vocabulary(tmp_path: Path):
    from tasks.ppo_models import check_critic

    policy_tok = own_tokenizer(save_policy("gpt2", tmp_path / "policy"))
    bert = save_reward_model("bert", tmp_path / "bert")
    with pytest.raises(ValueError, match=r"BertForSequenceClassification \(bidirectional encoder\) has no per-token "
                                         r"linear 'score' head .* use ppo.value_model='head'"):
        check_critic(load_reward_model(bert), policy_tok, own_tokenizer(bert))
    llama = save_reward_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"another vocabulary than the policy's .* use ppo.value_model=head"):
        check_critic(load_reward_model(llama), policy_tok, own_tokenizer(llama))
    gpt2 = save_reward_model("gpt2", tmp_path / "gpt2")
    check_critic(load_reward_model(gpt2), policy_tok, own_tokenizer(gpt2))  # same family, same tokenizer: accepted
