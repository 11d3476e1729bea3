"""The demo task: prompts, replies, the gold scorer and the data generators."""

from __future__ import annotations

import math
import random
import re
import statistics

import pytest

from rlhf_core.demo import (
    INTENTS,
    best_reply,
    generate_preference_pairs,
    generate_prompts,
    generate_sft_demonstrations,
    gold_breakdown,
    gold_score,
    message_of,
    parse_prompt,
    render_prompt,
    task_texts,
)
from rlhf_core.demo.gold import LONG_REPLY_WORDS

ORDER = "#48213"


def _prompt(message: str) -> str:
    return render_prompt(message)


# ---------------------------------------------------------------- prompts


def test_render_prompt_is_the_documented_template_and_inverts() -> None:
    assert render_prompt("My lamp arrived broken.") == "Customer: My lamp arrived broken.\nAgent:"
    assert message_of(render_prompt("My lamp arrived broken.")) == "My lamp arrived broken."


def test_generators_are_deterministic_for_a_seed() -> None:
    assert generate_prompts(50, seed=3) == generate_prompts(50, seed=3)
    assert generate_prompts(50, seed=3) != generate_prompts(50, seed=4)
    assert generate_preference_pairs(30, seed=3) == generate_preference_pairs(30, seed=3)
    assert generate_preference_pairs(30, seed=3) != generate_preference_pairs(30, seed=4)
    assert generate_sft_demonstrations(30, seed=3) == generate_sft_demonstrations(30, seed=3)
    assert generate_sft_demonstrations(30, seed=3) != generate_sft_demonstrations(30, seed=4)
    assert task_texts(3, 30) == task_texts(3, 30)
    assert task_texts(3, 30) != task_texts(4, 30)


def test_generators_do_not_touch_global_random_state() -> None:
    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate_preference_pairs(20, seed=0)
    generate_sft_demonstrations(20, seed=0)
    assert random.random() == expected


def test_sizes_are_configurable_and_negative_sizes_refused() -> None:
    assert len(generate_prompts(0, seed=0)) == 0
    assert len(generate_preference_pairs(17, seed=0)) == 17
    assert len(generate_sft_demonstrations(9, seed=0)) == 9
    with pytest.raises(ValueError, match="n must be >= 0"):
        generate_prompts(-1, seed=0)


def test_a_thousand_prompts_cover_every_intent_and_are_varied() -> None:
    records = generate_prompts(1000, seed=0)
    assert len({r.intent for r in records}) == len(INTENTS) >= 12
    assert {r.tone for r in records} == {"polite", "neutral", "angry"}
    assert len({r.message for r in records}) > 800
    assert all(r.prompt == render_prompt(r.message) for r in records)
    assert any(r.order and r.order in r.message for r in records)


def test_gold_recovers_the_hidden_intent_and_details_from_the_prompt_text() -> None:
    for r in generate_prompts(1000, seed=1):
        facts = parse_prompt(r.prompt)
        assert facts.intent == r.intent, r.message
        assert facts.orders == ({r.order} if r.order else set())
        assert facts.angry == (r.tone == "angry")


def test_vocabulary_is_small_and_replies_are_short() -> None:
    texts = task_texts(0, 2000)
    vocabulary = {re.sub(r"#\d+", "#N", w) for t in texts for w in t.split()}
    assert 150 < len(vocabulary) < 500
    lengths = [len(t.split("\nAgent:", 1)[1].split()) for t in texts]
    assert 15 <= statistics.median(lengths) <= 35
    assert all(t.split("\nAgent:", 1)[1].startswith(" ") for t in texts)


# ---------------------------------------------------------------- gold

GOOD_AND_BAD = [
    ("My lamp arrived broken.",
     " Hello! I'm sorry about this. I will send you a free replacement lamp right away. Take care!",
     " Check the website."),
    (f"Please cancel my order {ORDER}.",
     f" Hi there! I have cancelled your order. I have noted order {ORDER}. Have a great day!",
     " Hi there! I have upgraded your shipping to express for free. Have a great day!"),
    ("I forgot my password.",
     " Hello! I have sent a password reset link to your email. The email should reach you within 10 minutes.",
     " Hello! Please update the app to the latest version. You must have typed it wrong."),
    (f"I was charged twice for order {ORDER}.",
     " Sorry to hear that. I have reversed the extra charge. Thanks for your patience.",
     " I have added store credit to your account. Thanks for your patience."),
]


@pytest.mark.parametrize(("message", "good", "bad"), GOOD_AND_BAD)
def test_gold_ranks_a_good_reply_above_a_dismissive_or_wrong_action_one(message: str, good: str, bad: str) -> None:
    assert gold_score(_prompt(message), good) > gold_score(_prompt(message), bad) + 1.0


def test_gold_of_a_best_reply_is_the_sum_of_the_good_rules() -> None:
    prompt = _prompt(f"The kettle from order {ORDER} came damaged.")
    reply = (f" Hello! I'm sorry about this. I have emailed you a free return label."
             f" This should be sorted within 3 to 5 days. I have noted order {ORDER}. Take care!")
    # greeting 0.5 + empathy 1.0 + correct action 2.0 + info 0.5 + order 0.5 + closing 0.5
    assert gold_score(prompt, reply) == pytest.approx(5.0)
    rng = random.Random(0)
    for record in generate_prompts(200, seed=0):
        ceiling = 5.0 if record.order else 4.5
        assert gold_score(record.prompt, best_reply(rng, record)) == pytest.approx(ceiling), record.message


def test_one_apology_beats_none_but_four_apologies_lose_to_one() -> None:
    prompt = _prompt(f"This is ridiculous! Order {ORDER} is missing, the tracking says delivered.")
    action = " I have asked the carrier to trace your package. Take care!"
    none = gold_score(prompt, " Hello!" + action)
    one = gold_score(prompt, " Hello! I'm sorry about this." + action)
    four = gold_score(prompt, " Hello! I'm sorry about this. So sorry for the trouble. We apologize for this."
                              " Sorry to hear that." + action)
    assert one > none
    assert four < one
    assert four < none


def test_padding_past_the_comfortable_length_costs_gold() -> None:
    prompt = _prompt("My radio is late and still not here.")
    base = " Hi there! So sorry for the trouble. I have opened a trace with the carrier. Have a great day!"
    padding = (" We value every customer and always do our best. Our team works very hard every single day."
               " Customer happiness is very important to us. We are proud of the service we give.")
    padded = base.replace(" Have a great day!", padding + " Have a great day!")
    assert len(padded.split()) > LONG_REPLY_WORDS
    assert gold_score(prompt, padded) < gold_score(prompt, base)


def test_repeating_a_sentence_and_quoting_the_wrong_order_cost_gold() -> None:
    prompt = _prompt(f"Please refund order {ORDER}.")
    base = " Hello! I will refund the full amount today. Take care!"
    repeated = " Hello! I will refund the full amount today. I will refund the full amount today. Take care!"
    assert gold_score(prompt, repeated) < gold_score(prompt, base)
    assert gold_score(prompt, base + f" I have noted order {ORDER}.") > gold_score(prompt, base)
    assert gold_score(prompt, base + " I have noted order #11111.") < gold_score(prompt, base)


@pytest.mark.parametrize("reply", ["", "   ", "asdf qwer zxcv", "!!!???", "sorry " * 200, "\x00\n\t#", "é" * 50])
def test_gold_is_finite_on_arbitrary_text(reply: str) -> None:
    for prompt in (_prompt("My lamp arrived broken."), "", "garbage without a customer"):
        assert math.isfinite(gold_score(prompt, reply))


def test_gold_punishes_empty_and_garbage_replies_below_a_plain_helpful_one() -> None:
    prompt = _prompt("My lamp arrived broken.")
    helpful = gold_score(prompt, " I have emailed you a free return label.")
    assert gold_score(prompt, "") < 0 < helpful
    assert gold_score(prompt, " lamp the the the broken label hello") < helpful
    assert gold_breakdown(prompt, " asdf qwer zxcv ghjk lkjh poiu")["incoherent"] == pytest.approx(-2.0)


# ---------------------------------------------------------------- data sets


def test_preference_rows_carry_text_only_and_never_gold() -> None:
    rows = generate_preference_pairs(200, seed=0)
    for row in rows:
        assert set(row) == {"prompt", "chosen", "rejected"}
        assert row["chosen"] != row["rejected"]
        assert row["prompt"].startswith("Customer: ") and row["prompt"].endswith("\nAgent:")
        assert row["chosen"].startswith(" ") and row["rejected"].startswith(" ")
        assert all(isinstance(value, str) for value in row.values())


def test_generated_replies_are_made_only_of_phrase_book_sentences() -> None:
    for row in generate_preference_pairs(300, seed=2):
        assert gold_breakdown(row["prompt"], row["chosen"])["incoherent"] == 0.0
        assert gold_breakdown(row["prompt"], row["rejected"])["incoherent"] == 0.0


def test_sft_demonstrations_are_imperfect_and_spread_out() -> None:
    rows = generate_sft_demonstrations(2000, seed=0)
    scores = [gold_score(r["prompt"], r["reply"]) for r in rows]
    q10, q50, q90 = (statistics.quantiles(scores, n=10)[i] for i in (0, 4, 8))
    # Measured (seed 0, 5000 rows): mean 0.99, std 2.80, q10 -3.0, q50 1.5, q90 4.5; best replies: mean 4.69.
    assert statistics.mean(scores) < 2.0
    assert statistics.pstdev(scores) > 2.0
    assert q10 < -1.0 < q50 < 3.0 < q90
    records = generate_prompts(500, seed=0)
    rng = random.Random(0)
    best = statistics.mean(gold_score(r.prompt, best_reply(rng, r)) for r in records)
    assert best > statistics.mean(scores) + 3.0


def test_gold_judged_pairs_follow_gold_and_drop_ties() -> None:
    from rlhf_core.evaluation.demo_eval import gold_judged
    from rlhf_core.data.records import PreferencePair

    prompt = render_prompt("My order #12345 arrived damaged.")
    good = "Hello! I'm sorry about this. I have shipped a new package to you. Take care!"
    bad = "Check the website."
    assert gold_score(prompt, good) > gold_score(prompt, bad)
    pairs = [PreferencePair(prompt, bad, good), PreferencePair(prompt, good, bad), PreferencePair(prompt, bad, bad)]
    judged = gold_judged(pairs)
    assert [(p.chosen, p.rejected) for p in judged] == [(good, bad), (good, bad)]  # swapped, kept, tie dropped
