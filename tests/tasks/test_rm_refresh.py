"""The rm-refresh stage and its file labelling round-trip, on tiny models with a planted rule.

A judge reward model learns the rule ("good" in a reply is better, "bad" is worse). The proxy PPO would use is
the judge with its score head negated: exactly wrong about the rule, so it orders every judged on-policy pair
the wrong way. Refreshing it on pairs of a (random) tiny policy labelled by the judge must fix that on
on-policy pairs it never trained on; promotion then follows the held-out accuracy.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.data import PPO_PROMPTS, PREFERENCE_PAIRS, DataError, prompt_id
from rlhf_core.demo import SimulatedAnnotator
from rlhf_core.evaluation.annotators import ReplyPair, RewardModelJudge
from rlhf_core.models.roles import load_reward_model
from rlhf_core.training.reward_training import PreferencePair, train_reward_model
from tasks import tracking
from tasks.config import ConfigError, PipelineConfig, load_config
from tasks.io import read_parquet, write_parquet
from tasks.labelling import export_unlabelled, import_labels
from tasks.reward_model import read_pairs
from tasks.refresh_pairs import LabelsPendingError, build_annotator, split_by_prompt
from tasks.rm_refresh import CHAMPION, RefreshResult, promotion, rm_refresh_task, run_rm_refresh
from tasks.state import StateDir
from tests.stage_tracking import module_tracking
from tests.tiny_models import WORDS, gpt2_config, word_tokenizer

FILLER = [w for w in WORDS if w not in ("good", "bad", "q")]


# --------------------------------------------------------------------------------------------- labelling


EXPORTED = [ReplyPair("q cat", " good dog", " bad tree"), ReplyPair("q sun", " red", " blue box"),
            ReplyPair("q why", " the mat", " a slow moon"), ReplyPair("q how", " fast\x00", " slow"),
            ReplyPair("q sat", " big", " small")]


def _fill(rows: list[dict], labels: list[object]) -> list[dict]:
    return [{**row, "label": label} for row, label in zip(rows, labels)]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_label_round_trip_applies_labels_to_the_exported_texts(tmp_path: Path, suffix: str) -> None:
    exported = export_unlabelled(EXPORTED, tmp_path / f"unlabelled{suffix}")
    frame = pd.read_csv(exported, keep_default_na=False) if suffix == ".csv" else pd.read_parquet(exported)
    assert list(frame.columns) == ["pair_id", "prompt", "reply_a", "reply_b", "label"]
    assert frame["pair_id"].tolist() == [p.pair_id for p in EXPORTED] and frame["label"].fillna("").eq("").all()
    frame["label"] = [" A", "b", "a", "a", "B"]
    frame.loc[0, "reply_a"] = " edited text is ignored"
    labelled = tmp_path / f"labelled{suffix}"
    frame.to_csv(labelled, index=False) if suffix == ".csv" else frame.to_parquet(labelled, index=False)
    result = import_labels(str(labelled), exported)
    assert result.pairs == [PreferencePair("q cat", " good dog", " bad tree"),
                            PreferencePair("q sun", " blue box", " red"),
                            PreferencePair("q why", " the mat", " a slow moon"),
                            PreferencePair("q sat", " small", " big")]
    # the 4th label is fine, but its pair fails the ordinary data validation (a NUL byte in a reply)
    assert [(q["source_row"], q["column"], q["reason"]) for q in result.quarantine] == [(3, "chosen",
                                                                                         "control_character")]
    assert result.rows_in == 5 == len(result.pairs) + len(result.quarantine)
    assert {r["pair_id"] for r in result.records} >= {EXPORTED[0].pair_id}  # chosen = reply_a keeps the export id


def test_bad_rows_are_quarantined_with_row_column_and_reason(tmp_path: Path) -> None:
    exported = export_unlabelled(EXPORTED, tmp_path / "unlabelled.csv")
    ids = [p.pair_id for p in EXPORTED]
    labelled = tmp_path / "labelled.csv"
    with open(labelled, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["pair_id", "label", "note"])
        writer.writerows([[ids[0], "a", ""], [ids[1], "", "skipped"], [ids[2], "1", ""], ["deadbeef", "a", ""],
                          ["", "b", ""], [ids[0], "b", "second opinion"], [ids[4], "a", "x", "extra field"],
                          [ids[4], "maybe", ""]])
    result = import_labels(str(labelled), exported)
    reasons = [(q["source_row"], q["column"], q["reason"]) for q in result.quarantine]
    assert reasons == [(1, "label", "missing_label"), (2, "label", "bad_label"), (3, "pair_id", "unknown_pair_id"),
                       (4, "pair_id", "missing_pair_id"), (5, "pair_id", "duplicate_label"),
                       (6, "*", "malformed_record"), (7, "label", "bad_label")]
    assert "first labelled at row 0" in result.quarantine[4]["detail"] and result.quarantine[1]["raw"] == "1"
    assert result.pairs == [PreferencePair("q cat", " good dog", " bad tree")]
    counts = result.counts()
    assert counts["labels/rows_in"] == 8 == counts["labels/accepted"] + counts["labels/quarantined"]
    assert counts["labels/quarantined/bad_label"] == 2 and counts["labels/not_returned"] == 1  # ids[3]


def test_missing_files_and_columns_say_what_to_do(tmp_path: Path) -> None:
    exported = export_unlabelled(EXPORTED, tmp_path / "unlabelled.csv")
    with pytest.raises(FileNotFoundError, match="labels file .*nope.csv does not exist"):
        import_labels(str(tmp_path / "nope.csv"), exported)
    pd.DataFrame({"pair_id": ["x"], "choice": ["a"]}).to_csv(tmp_path / "wrong.csv", index=False)
    with pytest.raises(DataError, match=r"lacks column\(s\) \['label'\]"):
        import_labels(str(tmp_path / "wrong.csv"), exported)
    with pytest.raises(ValueError, match="use a .csv or .parquet"):
        export_unlabelled(EXPORTED, tmp_path / "pairs.xlsx")
    with pytest.raises(ValueError, match="exported twice"):
        export_unlabelled(EXPORTED[:1] * 2, tmp_path / "twice.csv")


# --------------------------------------------------------------------------------------------- the stage


def planted_pairs(n: int, seed: int) -> list[PreferencePair]:
    """Chosen replies hold "good" and rejected ones "bad", among random filler words."""
    rng = random.Random(seed)

    def reply(marker: str) -> str:
        words = rng.sample(FILLER, rng.randint(2, 6))
        words.insert(rng.randint(0, len(words)), marker)
        return " " + " ".join(words)

    return [PreferencePair("q " + " ".join(rng.sample(FILLER, 3)), reply("good"), reply("bad")) for _ in range(n)]


def rule_heavy_policy(tokenizer: PreTrainedTokenizerFast, boost: float = 1.75) -> GPT2LMHeadModel:
    """A random tiny GPT whose replies are full of "good" and "bad" (each about 15% of tokens): a policy that
    went for the words its proxy reacts to, so most fresh pairs differ in exactly what the proxy gets wrong."""
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(gpt2_config(len(tokenizer), tie_word_embeddings=False))
    with torch.no_grad():
        policy.transformer.ln_f.bias[0] = 5.0  # a constant feature on every position ...
        policy.lm_head.weight[:, 0] = 0.0
        for word in ("good", "bad"):  # ... that only these two words read: +boost on their logits
            policy.lm_head.weight[tokenizer.convert_tokens_to_ids(word), 0] = boost / 5.0
    return policy


def _table(pairs: list[PreferencePair], path: Path) -> str:
    rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "margin": None, "source_file": "planted",
             "source_row": i, "pair_id": f"p{i}"} for i, p in enumerate(pairs)]
    return write_parquet(rows, PREFERENCE_PAIRS, path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("refresh-inputs")
    tokenizer = word_tokenizer()
    rule_heavy_policy(tokenizer).save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    torch.manual_seed(1)
    judge = GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1))
    train_reward_model(judge, tokenizer, planted_pairs(160, seed=1), [],
                       RewardTrainingConfig(epochs=4, batch_size=16, learning_rate=3e-3, max_length=64))
    for name, sign in (("judge", 1.0), ("proxy", -1.0)):
        with torch.no_grad():
            judge.score.weight.mul_(sign)  # the proxy is the judge turned upside down: wrong on every pair
        judge.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    heldout = planted_pairs(48, seed=2)
    prompts = ["q " + " ".join(random.Random(i).sample(FILLER, 3)) for i in range(80)]
    return SimpleNamespace(
        root=root, policy=str(root / "policy"), judge=str(root / "judge"), proxy=str(root / "proxy"),
        train=_table(planted_pairs(64, seed=3), root / "train_pairs.parquet"),
        heldout=_table(heldout, root / "heldout_pairs.parquet"),
        heldout_flipped=_table([PreferencePair(p.prompt, p.rejected, p.chosen) for p in heldout],
                               root / "heldout_flipped.parquet"),
        prompts=write_parquet([{"prompt": p, "prompt_id": prompt_id(p)} for p in prompts], PPO_PROMPTS,
                              root / "ppo_prompts.parquet"))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StateDir]:
    with module_tracking(tmp_path_factory.mktemp("refresh-mlflow")) as state:
        yield state


@pytest.fixture(scope="module")
def parent_id(store: StateDir) -> str:
    with tracking.pipeline_run("rm-refresh-test", "refresh") as run:
        return run.info.run_id


def refresh_config(name: str, *extra: str) -> PipelineConfig:
    return load_config(preset="tiny", overrides=[
        "device=cpu", "refresh.annotator=rm_judge", "refresh.n_pairs=144", "refresh.on_policy_eval_fraction=0.35",
        "refresh.epochs=6", "refresh.learning_rate=0.003", "refresh.keep_old_pairs=false",
        "reward_model.training.max_length=64", "reward_model.heldout.max_length=64",
        "ppo.generation.max_new_tokens=12", "ppo.generation.batch_size=48", f"tracking.reward_model={name}",
        *extra])


def _refresh(inputs: SimpleNamespace, parent_id: str, out: Path, config: PipelineConfig, proxy: str,
             heldout: str) -> RefreshResult:
    return run_rm_refresh(config, 1, inputs.policy, proxy, inputs.judge, inputs.train, heldout, inputs.prompts,
                          str(out), parent_id)


@pytest.fixture(scope="module")
def promoted(inputs: SimpleNamespace, parent_id: str, tmp_path_factory: pytest.TempPathFactory) -> RefreshResult:
    """Fresh pairs only (no replay); the judge is the default rm_judge: the held-out RM."""
    return _refresh(inputs, parent_id, tmp_path_factory.mktemp("refresh-out"), refresh_config("refresh-promoted"),
                    inputs.proxy, inputs.heldout)


def test_refresh_fixes_the_proxy_on_on_policy_pairs_it_never_saw(promoted: RefreshResult) -> None:
    m = promoted.metrics
    # measured: on-policy accuracy 0.000 -> 0.714 (49 eval pairs on unseen prompts), held-out 0.000 -> 0.875
    assert m["refresh/onpolicy_accuracy_before"] <= 0.05  # the upside-down proxy disagrees with every judge label
    assert m["refresh/onpolicy_accuracy_after"] >= 0.6  # 0.65-0.80 over judge seeds 0-3
    assert m["refresh/heldout_accuracy_after"] > m["refresh/heldout_accuracy_before"] + 0.5
    assert m["refresh/n_onpolicy_eval"] >= 15 and m["refresh/n_old_replayed"] == 0
    # every sampled pair is used or skipped with a reason (here: replies the policy ended at once)
    assert m["refresh/n_sampled"] == 144 == m["refresh/n_new_pairs"] + m["refresh/n_skipped"] + m["labels/quarantined"]
    assert m["refresh/skipped/empty_text"] == m["refresh/n_skipped"] > 0 and m["labels/quarantined"] == 0
    assert m["refresh/n_new_pairs"] == m["refresh/n_train_new"] + m["refresh/n_onpolicy_eval"]
    assert 0.2 < m["refresh/label_a_fraction"] < 0.8
    # data.source is 'demo' here, so the eval pairs are also judged by gold (a report, never a training label)
    assert {f"refresh/onpolicy_gold_{k}_{w}" for k in ("accuracy", "loss", "margin") for w in ("before", "after")} <= set(m)
    assert 0.0 <= m["refresh/onpolicy_gold_accuracy_before"] <= 1.0
    train = read_parquet(promoted.pairs_path, PREFERENCE_PAIRS)
    held = read_parquet(promoted.eval_pairs_path, PREFERENCE_PAIRS)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}  # eval prompts never trained on
    # the saved model is the one measured: the judge agrees with it on its own on-policy eval pairs
    model = load_reward_model(promoted.model_dir).eval()
    judge = RewardModelJudge(model, word_tokenizer(), max_length=64)
    assert sum(judge.label([ReplyPair(r["prompt"], r["chosen"], r["rejected"]) for r in held])) / len(held) == \
        pytest.approx(m["refresh/onpolicy_accuracy_after"], abs=1e-6)


def test_a_better_refresh_is_registered_and_becomes_champion(promoted: RefreshResult, parent_id: str) -> None:
    client = MlflowClient()
    assert promoted.promoted and promoted.new_version == 1
    assert promoted.reward_model_uri == promoted.candidate_uri == "models:/refresh-promoted/1"
    for alias in ("candidate", CHAMPION):
        assert int(client.get_model_version_by_alias("refresh-promoted", alias).version) == 1
    run = client.get_run(promoted.mlflow_run_id)
    assert run.info.run_name == "rm-refresh-1" and run.data.tags["mlflow.parentRunId"] == parent_id
    assert run.data.tags["refresh.promotion"].startswith("promoted")
    assert run.data.params["refresh.annotator"] == "rm_judge" and run.data.params["refresh.training.epochs"] == "6"
    assert run.data.metrics["refresh/onpolicy_accuracy_after"] == promoted.metrics["refresh/onpolicy_accuracy_after"]
    assert "refresh/eval/accuracy" in run.data.metrics  # the on-policy curve during training
    artifacts = {a.path for a in client.list_artifacts(promoted.mlflow_run_id, "pairs")}
    assert "pairs/refresh_train_pairs.parquet" in artifacts and "pairs/onpolicy_eval_pairs.parquet" in artifacts


def test_a_refresh_that_loses_held_out_accuracy_is_registered_but_not_promoted(
        inputs: SimpleNamespace, parent_id: str, tmp_path: Path) -> None:
    # held-out pairs that agree with the upside-down proxy: learning the judge's rule must lose them
    name = "refresh-kept"
    old = tracking.register_model_dir(inputs.proxy, name, parent_id, aliases=("candidate", CHAMPION))
    config = refresh_config(name, "refresh.keep_old_pairs=true", "refresh.old_pairs_ratio=0.5")
    result = _refresh(inputs, parent_id, tmp_path, config, old.uri, inputs.heldout_flipped)
    m = result.metrics
    # measured: held-out 1.000 -> 0.000, on-policy 0.000 -> 0.816 (44 old pairs replayed next to 88 fresh)
    assert m["refresh/heldout_accuracy_after"] < m["refresh/heldout_accuracy_before"]
    assert m["refresh/onpolicy_accuracy_after"] > m["refresh/onpolicy_accuracy_before"] + 0.5
    assert m["refresh/n_old_replayed"] == round(0.5 * m["refresh/n_train_new"]) and m["refresh/promoted"] == 0.0
    assert not result.promoted and "not promoted" in result.promotion_reason
    assert result.reward_model_uri == old.uri == f"models:/{name}/1" and result.candidate_uri == f"models:/{name}/2"
    client = MlflowClient()
    assert int(client.get_model_version_by_alias(name, CHAMPION).version) == 1
    assert int(client.get_model_version_by_alias(name, "candidate").version) == 2
    # The next refresh trains on these labels again even though this refresh was not promoted; this one
    # also holds a quarter of its fresh training prompts back to choose the epoch it keeps.
    validated = refresh_config(name, "refresh.keep_old_pairs=true", "refresh.old_pairs_ratio=0.5",
                               "refresh.validation_fraction=0.25")
    again = run_rm_refresh(validated, 2, inputs.policy, old.uri, inputs.judge, inputs.train, inputs.heldout_flipped,
                           inputs.prompts, str(tmp_path), parent_id, earlier_pairs=[result.pairs_path])
    n = again.metrics
    assert n["refresh/n_earlier_refresh_pairs"] == m["refresh/n_train_new"] > 0 and m["refresh/n_validation"] == 0
    wanted = round(0.5 * (n["refresh/n_train_new"] + n["refresh/n_earlier_refresh_pairs"]))
    assert n["refresh/n_old_replayed"] == min(wanted, len(read_pairs(inputs.train)))  # at most all old pairs
    fresh = n["refresh/n_train_new"] + n["refresh/n_validation"] + n["refresh/n_onpolicy_eval"]
    assert n["refresh/n_new_pairs"] == fresh
    assert n["refresh/n_validation"] >= 10 and n["refresh/best_epoch"] in range(7) and m["refresh/best_epoch"] == 6
    # validation pairs are saved with the refresh-train pairs: later refreshes train on every label
    saved = read_parquet(again.pairs_path, PREFERENCE_PAIRS)
    assert len(saved) == n["refresh/n_train_new"] + n["refresh/n_validation"]
    history = MlflowClient().get_metric_history(again.mlflow_run_id, "refresh/eval/loss")
    assert history[0].step == 0 and len(history) >= 7  # validation loss before training and after each epoch


def test_file_annotator_exports_then_trains_on_the_returned_labels(inputs: SimpleNamespace, parent_id: str,
                                                                  tmp_path: Path) -> None:
    config = refresh_config("refresh-file", "refresh.annotator=file")
    with pytest.raises(LabelsPendingError, match="refresh.labels_file=") as caught:
        run_rm_refresh(config, 2, inputs.policy, inputs.proxy, inputs.judge, inputs.train, inputs.heldout,
                       inputs.prompts, str(tmp_path), parent_id)
    exported = caught.value.exported_path
    assert exported == str(tmp_path / "iter_002" / "unlabelled_pairs.csv") and exported in str(caught.value)
    frame = pd.read_csv(exported, keep_default_na=False)
    assert len(frame) >= 60 and set(frame["label"]) == {""}
    # people label with the judge's preferences; two rows are left empty
    judge = RewardModelJudge(load_reward_model(inputs.judge).eval(), word_tokenizer(), max_length=64)
    pairs = [ReplyPair(*row) for row in frame[["prompt", "reply_a", "reply_b"]].itertuples(index=False)]
    frame["label"] = ["a" if a else "b" for a in judge.label(pairs)]
    frame.loc[[3, 7], "label"] = ""
    frame.to_csv(tmp_path / "labelled_2.csv", index=False)
    resumed = replace(config, refresh=replace(config.refresh, labels_file=str(tmp_path / "labelled_{iteration}.csv")))
    result = run_rm_refresh(resumed, 2, inputs.policy, inputs.proxy, inputs.judge, inputs.train, inputs.heldout,
                            inputs.prompts, str(tmp_path), parent_id)
    m = result.metrics  # measured: on-policy accuracy 0.000 -> 0.800 (45 eval pairs), held-out 0.000 -> 0.854
    assert m["labels/rows_in"] == len(frame) and m["labels/quarantined"] == m["labels/quarantined/missing_label"] == 2
    assert m["refresh/n_new_pairs"] == m["labels/accepted"] == len(frame) - 2
    assert m["refresh/n_sampled"] == 144 == len(frame) + m["refresh/n_skipped"]  # skipped before the export
    reasons = pd.read_parquet(result.quarantine_path)["reason"].value_counts().to_dict()
    assert reasons == {"missing_label": 2, **({"empty_text": m["refresh/n_skipped"]} if m["refresh/n_skipped"] else {})}
    assert m["refresh/onpolicy_accuracy_before"] <= 0.05 and m["refresh/onpolicy_accuracy_after"] >= 0.6
    assert result.promoted and result.reward_model_uri == "models:/refresh-file/1"


def test_the_file_annotator_without_an_export_and_the_annotator_choice(inputs: SimpleNamespace,
                                                                      tmp_path: Path) -> None:
    config = refresh_config("unused", "refresh.annotator=file", f"refresh.labels_file={tmp_path}/labels.csv")
    with pytest.raises(FileNotFoundError, match="exported no pairs at .*unlabelled_pairs.csv"):
        run_rm_refresh(config, 1, inputs.policy, inputs.proxy, inputs.judge, inputs.train, inputs.heldout,
                       inputs.prompts, str(tmp_path), "unused-parent")
    simulated = build_annotator(load_config(preset="tiny", overrides=["refresh.annotator_temperature=0.5"]), 1, "x")
    assert isinstance(simulated.labeller, SimulatedAnnotator) and simulated.labeller.temperature == 0.5
    assert rm_refresh_task.name == "rm-refresh" and rm_refresh_task.retries == 1


def test_promotion_rule() -> None:
    assert promotion(0.70, 0.70, 0.0)[0] and not promotion(0.70, 0.69, 0.0)[0]
    promoted, reason = promotion(0.70, 0.69, 0.02)
    assert promoted and "0.690 >= 0.680" in reason
    # best-epoch selection kept the weights from before training: nothing new to promote
    promoted, reason = promotion(0.70, 0.70, 0.02, changed=False)
    assert not promoted and "no epoch lowered the validation loss" in reason


def test_refresh_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="labels_file is read only with refresh.annotator='file'"):
        load_config(preset="tiny", overrides=["refresh.labels_file=x.csv"])
    with pytest.raises(ConfigError, match="on_policy_eval_fraction must be in"):
        load_config(preset="tiny", overrides=["refresh.on_policy_eval_fraction=1.0"])
    with pytest.raises(ConfigError, match="validation_fraction"):
        load_config(preset="tiny", overrides=["refresh.validation_fraction=1.0"])
    cfg = load_config(preset="tiny", overrides=["data.source=files", "data.files=[a.csv]", "refresh.annotator=file"])
    assert cfg.refresh.enabled  # user data can be refreshed by people or a judge, not by the demo's annotator
    with pytest.raises(ConfigError, match="refresh.annotator='simulated' needs data.source='demo'"):
        load_config(preset="tiny", overrides=["data.source=files", "data.files=[a.csv]"])


def test_split_by_prompt_keeps_each_prompt_on_one_side() -> None:
    records = [{"prompt": f"p{i % 7}", "chosen": f" c{i}", "rejected": " r"} for i in range(30)]
    train, held = split_by_prompt(records, 0.3, seed=4)
    assert len(train) + len(held) == 30 and {r["prompt"] for r in held} and {r["prompt"] for r in train}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert len({r["prompt"] for r in held}) == 2  # round(0.3 * 7)
    with pytest.raises(ValueError, match="at least 2 prompts"):
        split_by_prompt(records[:1], 0.3, seed=0)
