"""SFT on (prompt, reply) demonstrations, and the small-model builders it trains.

The learning test uses a synthetic task: "Q: {name} asks the color of the {fruit}?" -> " A: the {fruit} is
{color}." Held-out prompts are (name, fruit) combinations never seen in training, so the model must copy the
fruit and look up its colour rather than memorise whole prompts.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rlhf_core.models.lm import (
    PRESETS,
    build_causal_lm,
    build_reward_model,
    config_for_tokenizer,
    count_parameters,
    set_dropout,
    tiny_gpt_config,
)
from rlhf_core.models.tokenizer import train_bpe_tokenizer
from rlhf_core.training.sft import (IGNORE_INDEX, SFTResult, collate, encode_examples, eval_loss, reply_token_loss,
                                    train_sft)
from rlhf_core.config import SFTConfig
from rlhf_core.training.sft import _train_step  # the accumulation logic itself is what is tested
from rlhf_core.training.strategy import LocalStrategy

pytestmark = pytest.mark.usefixtures("single_thread")

NAMES = ["Ann", "Bob", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo"]
COLORS = {"apple": "red", "banana": "yellow", "lime": "green", "plum": "purple",
          "orange": "orange", "cherry": "red", "kiwi": "brown", "grape": "green"}


def color_task() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """80 demonstrations: 60 for training, 20 held out (unseen name/fruit combinations)."""
    pairs = [(name, fruit) for name in NAMES for fruit in COLORS]
    random.Random(0).shuffle(pairs)
    examples = [(f"Q: {n} asks the color of the {f}?", f" A: the {f} is {COLORS[f]}.") for n, f in pairs]
    return examples[:60], examples[60:]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    train, held_out = color_task()
    return train_bpe_tokenizer([p + r for p, r in train + held_out], vocab_size=400)


@pytest.fixture(scope="module")
def trained(tokenizer: PreTrainedTokenizerFast) -> tuple[torch.nn.Module, SFTResult, list[tuple[int, dict]]]:
    train, held_out = color_task()
    model = build_causal_lm(config_for_tokenizer(tokenizer, "tiny"), seed=0)
    logs: list[tuple[int, dict]] = []
    config = SFTConfig(epochs=50, batch_size=16, learning_rate=3e-3, max_length=48, eval_every=50, log_every=0)
    result = train_sft(model, tokenizer, train, held_out, config, on_log=lambda s, m: logs.append((s, m)))
    return model, result, logs


# ---- reply-only labels --------------------------------------------------------------------------------


def test_labels_cover_exactly_reply_and_eos(tokenizer: PreTrainedTokenizerFast) -> None:
    examples = [("Q: hi?", " A: yo."), ("Q: Ann, Bob and Cara ask the color?", " A: red.")]
    p0, r0 = tokenizer("Q: hi?").input_ids, tokenizer(" A: yo.").input_ids
    p1, r1 = tokenizer("Q: Ann, Bob and Cara ask the color?").input_ids, tokenizer(" A: red.").input_ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    batch = collate(encode_examples(tokenizer, examples, max_length=64), pad)
    length = max(len(p0) + len(r0), len(p1) + len(r1)) + 1
    pad0 = length - len(p0) - len(r0) - 1
    assert pad0 > 0  # the first row really is padded
    assert batch.input_ids[0].tolist() == p0 + r0 + [eos] + [pad] * pad0
    assert batch.labels[0].tolist() == [IGNORE_INDEX] * len(p0) + r0 + [eos] + [IGNORE_INDEX] * pad0
    assert batch.attention_mask[0].tolist() == [1] * (length - pad0) + [0] * pad0
    assert batch.labels[1].tolist() == [IGNORE_INDEX] * len(p1) + r1 + [eos]
    assert batch.attention_mask[1].tolist() == [1] * length


def test_label_mask_on_a_hand_written_example() -> None:
    class Stub:  # a tokenizer that maps each character to its code: ids are readable by hand
        eos_token_id = 2

        def __call__(self, texts, add_special_tokens=False):
            return type("Enc", (), {"input_ids": [[ord(c) for c in t] for t in texts]})

    batch = collate(encode_examples(Stub(), [("ab", " c"), ("a", "d")], max_length=8), pad_token_id=0)
    assert batch.input_ids.tolist() == [[97, 98, 32, 99, 2], [97, 100, 2, 0, 0]]
    assert batch.labels.tolist() == [[-100, -100, 32, 99, 2], [-100, 100, 2, -100, -100]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


def test_truncation_keeps_prompt_end_and_reply_start() -> None:
    class Stub:
        eos_token_id = 2

        def __call__(self, texts, add_special_tokens=False):
            return type("Enc", (), {"input_ids": [[ord(c) for c in t] for t in texts]})

    (fit, cut, long_reply) = encode_examples(Stub(), [("ab", "c"), ("abcd", "e"), ("a", "wxyz")], max_length=4)
    assert (fit.input_ids, fit.truncated) == ([97, 98, 99, 2], False)
    assert (cut.input_ids, cut.labels, cut.truncated) == ([99, 100, 101, 2], [-100, -100, 101, 2], True)
    assert (long_reply.input_ids, long_reply.labels) == ([97, 119, 120, 121], [-100, 119, 120, 121])


def test_loss_of_an_example_does_not_depend_on_its_batch(tokenizer: PreTrainedTokenizerFast) -> None:
    model = build_causal_lm(config_for_tokenizer(tokenizer, "tiny"), seed=1).eval()
    short, long = ("Q: hi?", " A: yo."), ("Q: Ann asks the color of the plum?", " A: the plum is purple.")
    alone = eval_loss(model, tokenizer, [short])
    encoded = encode_examples(tokenizer, [short, long], max_length=64)
    with torch.no_grad():
        loss_sum, count = reply_token_loss(model, collate(encoded, tokenizer.pad_token_id))
        long_sum, long_count = reply_token_loss(model, collate(encoded[1:], tokenizer.pad_token_id))
    assert count - long_count == len(tokenizer(" A: yo.").input_ids) + 1
    assert (float(loss_sum) - float(long_sum)) / (count - long_count) == pytest.approx(alone, rel=1e-4)


# ---- the training loop --------------------------------------------------------------------------------


def test_micro_batching_gives_the_same_gradient(tokenizer: PreTrainedTokenizerFast) -> None:
    train, _ = color_task()
    encoded = encode_examples(tokenizer, train[:6], max_length=48)  # rows of different lengths
    updates = []
    for micro in (6, 4, 1):
        model = build_causal_lm(config_for_tokenizer(tokenizer, "tiny"), seed=2)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        # Plain SGD with lr 1 makes the weight change equal to minus the gradient.
        sgd = LocalStrategy(torch.optim.SGD(model.parameters(), lr=1.0), None, math.inf)
        config = SFTConfig(batch_size=6, micro_batch_size=micro, max_grad_norm=math.inf)
        loss, _ = _train_step(model, sgd, encoded, config, tokenizer.pad_token_id)
        updates.append((loss, before - torch.cat([p.detach().flatten() for p in model.parameters()])))
    assert updates[0][1].abs().sum() > 0
    for loss, grad in updates[1:]:
        assert loss == pytest.approx(updates[0][0], rel=1e-5)
        torch.testing.assert_close(grad, updates[0][1], rtol=1e-4, atol=1e-6)


def test_warmup_then_linear_decay(tokenizer: PreTrainedTokenizerFast) -> None:
    train, held_out = color_task()
    model = build_causal_lm(config_for_tokenizer(tokenizer, "tiny"), seed=0)
    logs: list[tuple[int, dict]] = []
    config = SFTConfig(epochs=1, batch_size=1, micro_batch_size=1, learning_rate=0.1, warmup_steps=2, eval_every=0,
                       log_every=0)
    train_sft(model, tokenizer, train[:4], held_out[:1], config, on_log=lambda s, m: logs.append((s, m)))
    lrs = [m["sft/lr"] for _, m in logs if "sft/lr" in m]
    # warmup 1/2, 2/2; then (4 - step) / (4 - 2) for steps 2 and 3 (0-based)
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.05])


def test_dropout_override_is_restored(tokenizer: PreTrainedTokenizerFast) -> None:
    train, held_out = color_task()
    model = build_causal_lm(config_for_tokenizer(tokenizer, "tiny", dropout=0.1), seed=0)
    train_sft(model, tokenizer, train[:2], held_out[:1], SFTConfig(epochs=1, dropout=0.3, log_every=0))
    rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == {0.1}
    assert not model.training


def test_sft_lowers_held_out_loss(trained) -> None:
    _, result, logs = trained
    steps = 50 * 4  # 60 demonstrations in batches of 16 -> 4 steps per epoch
    assert len(result.train_losses) == steps
    assert result.eval_steps[0] == 0 and result.eval_steps[-1] == steps
    assert result.final_eval_loss < 0.7 * result.initial_eval_loss
    assert result.final_eval_loss < 0.3  # measured ~0.04 from ~5.9
    assert [s for s, m in logs if "sft/eval_loss" in m] == list(result.eval_steps)
    assert sum(result.train_losses[-10:]) < sum(result.train_losses[:10])


def test_greedy_replies_follow_the_pattern_and_stop(trained, tokenizer: PreTrainedTokenizerFast) -> None:
    model, _, _ = trained
    _, held_out = color_task()
    tokenizer.padding_side = "left"  # generation continues from the prompt's last token
    inputs = tokenizer([p for p, _ in held_out], return_tensors="pt", padding=True)
    tokenizer.padding_side = "right"
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    correct = stopped = 0
    for (_, reply), row in zip(held_out, out[:, inputs.input_ids.shape[1]:].tolist()):
        if tokenizer.eos_token_id in row:
            stopped += 1
            correct += tokenizer.decode(row[: row.index(tokenizer.eos_token_id)]) == reply
    assert stopped >= 18, f"only {stopped}/20 replies emitted eos"
    assert correct >= 16, f"only {correct}/20 held-out replies match the pattern"


def test_config_rejects_micro_batch_larger_than_batch() -> None:
    with pytest.raises(ValueError, match="micro_batch_size"):
        SFTConfig(batch_size=4, micro_batch_size=8)


# ---- model builders -----------------------------------------------------------------------------------


def test_presets_have_the_documented_sizes() -> None:
    def params(name: str, vocab: int) -> int:
        s = PRESETS[name]
        return count_parameters(build_causal_lm(tiny_gpt_config(vocab, s.n_layer, s.n_embd, s.n_head,
                                                                 s.n_positions, 0, 1, 2)))

    assert 50_000 < params("tiny", 400) < 150_000
    assert 1_000_000 < params("demo", 2000) < 3_000_000


def test_config_rejects_pad_equal_to_eos() -> None:
    with pytest.raises(ValueError, match="distinct"):
        tiny_gpt_config(300, 1, 16, 2, 32, pad_token_id=2, bos_token_id=1, eos_token_id=2)


def test_reward_model_scores_the_last_real_token(tokenizer: PreTrainedTokenizerFast) -> None:
    rm = build_reward_model(config_for_tokenizer(tokenizer, "tiny"), seed=0).eval()
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tokenizer.pad_token_id
    short = tokenizer("Q: hi? A: yo.").input_ids
    long = tokenizer("Q: Ann asks the color of the plum? A: purple.").input_ids
    padded = short + [tokenizer.pad_token_id] * (len(long) - len(short))
    batch = torch.tensor([padded, long])  # (B, T)
    with torch.no_grad():
        scores = rm(input_ids=batch, attention_mask=(batch != tokenizer.pad_token_id).long()).logits  # (B, 1)
        alone = rm(input_ids=torch.tensor([short])).logits
    assert scores.shape == (2, 1)
    torch.testing.assert_close(scores[0], alone[0], rtol=1e-4, atol=1e-5)


def test_set_dropout_changes_every_dropout_module(tokenizer: PreTrainedTokenizerFast) -> None:
    model = build_causal_lm(config_for_tokenizer(tokenizer, "tiny", dropout=0.2))
    set_dropout(model, 0.0)
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}
