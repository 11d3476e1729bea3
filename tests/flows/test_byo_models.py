"""Bring your own models, through configuration alone: the whole tiny pipeline with a Llama-style policy of its own
tokenizer (no pad token: it pads with eos), a 2-label BERT classifier as the proxy reward model (a fresh scalar head,
its own WordPiece tokenizer, scored at its [CLS]) and the SFT policy as the held-out one."""

from __future__ import annotations

import math

from transformers import AutoTokenizer

from flows.cli import main
from rlhf_core.models.roles import load_reward_model
from tasks import rm_refresh
from tasks.run_store import RunStore
from tests import model_families

STAGES = ["data-prep", "sft", "reward-model", "best-of-n", "ppo-iteration-1", "heldout-eval-1", "rm-refresh-1",
          "ppo-iteration-2", "heldout-eval-2"]


def test_a_llama_policy_and_a_bert_reward_model_run_the_whole_pipeline(tmp_path, mlflow_store, capsys):
    policy = model_families.save_policy("llama", tmp_path / "llama", stop_probability=0.1)
    bert = model_families.save_reward_model("bert", tmp_path / "bert", num_labels=2)
    state = tmp_path / "state"
    assert main(["run", "--preset", "tiny", "--state-dir", str(state), "refresh.n_pairs=16",
                 f"sft.base_model={policy}", f"reward_model.init={bert}", "reward_model.heldout_init=sft",
                 "ppo.value_model=head", "tracking.experiment=byo"]) == 0
    store = RunStore(state)
    (record,) = store.list_runs(reconcile=False)
    assert record.status == "completed" and list(record.stages) == STAGES
    rm = store.artifact("reward-model", record.stages["reward-model"].key)
    proxy, held = (load_reward_model(str(rm.path(rm.result[role]))) for role in ("proxy", "heldout"))
    assert type(proxy).__name__ == "BertForSequenceClassification" and proxy.config.num_labels == 1
    assert type(held).__name__ == "LlamaForSequenceClassification"
    assert AutoTokenizer.from_pretrained(rm.path(rm.result["proxy"])).cls_token == "[CLS]"
    sft = store.artifact("sft", record.stages["sft"].key)
    tokenizer = AutoTokenizer.from_pretrained(sft.path(sft.result["model"]))
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"  # the fallback, saved with the policy
    refresh = store.artifact("rm-refresh", record.stages["rm-refresh-1"].key)  # the simulated annotator's pairs
    assert type(load_reward_model(str(rm_refresh.model_input(refresh).path))).__name__ == "BertForSequenceClassification"
    evaluation = store.artifact("heldout-eval", record.stages["heldout-eval-2"].key).result["metrics"]
    proxy_scores = [v for k, v in evaluation.items() if "proxy" in k]
    assert proxy_scores and all(math.isfinite(v) for v in proxy_scores)
