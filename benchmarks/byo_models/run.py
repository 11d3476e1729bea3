"""A BERT encoder reward model with its own WordPiece tokenizer against the default reward model.

    .venv/bin/python benchmarks/byo_models/run.py                  # two `rlhf demo` runs, one at a time (~6 min)
    .venv/bin/python benchmarks/byo_models/run.py --learning-rates 1e-4   # and an encoder run at 1e-4

Everything goes through configuration alone, in one state folder (default ``/tmp/byo_state``, so nothing in the
repository changes):

1. ``rlhf demo --seed N``: the default run, whose proxy reward model is the SFT policy with a fresh scalar head.
2. The demo text: the train pairs of that run's data-prep artifact (found through the run store). A WordPiece
   tokenizer (``tokenizers``, lowercase, specials ``[PAD] [UNK] [CLS] [SEP] [MASK]``) is trained on its prompts
   and replies, and a ``BertForSequenceClassification`` of about the demo RM's size (4 layers x 128, 4 heads,
   intermediate 512) with ``num_labels=2`` (so the pipeline must give it a fresh scalar head) is built from a
   config with random weights; both are saved with ``save_pretrained``.
3. ``rlhf demo --seed N reward_model.init=<that folder> reward_model.heldout_init=sft``: the same run with the
   encoder as the proxy RM. ``heldout_init`` must be named: unset it follows ``init``, and the held-out judge
   would be an encoder too; ``sft`` keeps it the default run's (its accuracy must come out the same).

Each run's ``summary.json`` gives the RM accuracies, cross-RM agreement, gold / held-out / proxy scores and KL;
``/usr/bin/time`` its wall time and peak RSS. Prints JSON and writes ``benchmarks/results/byo_models.json``.
Wall times are of computed runs only in a fresh state folder: run again on the same one, every stage is reused
(each row's ``reused`` lists the stages that were; the encoder run always reuses data-prep and SFT).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable as it is under `python -m`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import REPO, default_out, machine, write_result

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tasks.run_store import Artifact

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB_SIZE = 2000
"""About twice the policy's 1000 BPE tokens: WordPiece splits less aggressively and lowercases."""
ENCODER = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512,
           "max_position_embeddings": 512, "num_labels": 2}
"""The demo policy's shape (4 x 128, 4 heads); 2 labels so that the pipeline has to replace the head."""
RM_METRICS = ("rm/proxy/eval/accuracy", "rm/heldout/eval/accuracy", "rm/cross/agreement", "rm/cross/spearman")
BEST_OF = 16


def run_demo(label: str, seed: int, state: Path, overrides: list[str]) -> dict[str, Any]:
    """One ``rlhf demo`` run (1 torch thread); its summary, wall time and peak RSS, or why it failed."""
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log, rss_file = logs / f"{label}.log", logs / f"{label}.rss"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_HOME": str(state / f"prefect-{label}")}
    command = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), sys.executable, "-m", "flows.cli", "demo",
               "--seed", str(seed), "--state-dir", str(state), *overrides]
    print(f"{label}: {' '.join(command[5:])}", file=sys.stderr, flush=True)
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(command, check=False, cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - started
    if code != 0:
        tail = log.read_text().splitlines()[-30:]
        return {"label": label, "overrides": overrides, "failed": f"exit {code}; see {log}", "log_tail": tail}
    line = next(x for x in log.read_text().splitlines() if x.startswith("summary: "))
    summary = json.loads(Path(line.removeprefix("summary: ").strip()).read_text())
    return {"label": label, "overrides": overrides, "summary": summary, "wall_s": round(wall, 1),
            "peak_rss_mib": round(int(rss_file.read_text().split()[-1]) / 1024, 1), "log": str(log)}


def stage_artifact(state: Path, run_id: str, label: str) -> Artifact:
    """The artifact a run's stage used, asked of the run store (which alone knows the state folder's layout)."""
    from tasks.run_store import RunStore

    store = RunStore(state)
    entry = store.load_run(run_id).stages[label]
    artifact = store.artifact(entry.stage, entry.key)
    if artifact is None:
        raise RuntimeError(f"run {run_id}: stage {label} names artifact {entry.stage}/{entry.key}, which is gone")
    return artifact


def demo_texts(state: Path, run_id: str) -> list[str]:
    """Prompts, chosen and rejected replies of the run's data-prep train pairs."""
    from rlhf_core.data.schema import CHOSEN, PREFERENCE_PAIRS, PROMPT, REJECTED
    from tasks.io import read_parquet

    artifact = stage_artifact(state, run_id, "data-prep")
    rows = read_parquet(artifact.path(artifact.result["train_pairs"]), PREFERENCE_PAIRS)
    return [str(row[column]) for row in rows for column in (PROMPT, CHOSEN, REJECTED)]


def train_wordpiece(texts: list[str]) -> PreTrainedTokenizerBase:
    """A lowercase WordPiece tokenizer of ``VOCAB_SIZE`` tokens trained on ``texts`` by ``tokenizers``, the same
    vocabulary on every call.

    The trainer numbers the ``##`` pieces it creates in hash-map order, which differs per process, and breaks ties
    between equally frequent merges by those numbers (huggingface/tokenizers#1794): two trainings on the same text
    gave vocabularies 250 of 2000 tokens apart, and encoder RMs that differed by 0.33 in final gold. Handing it
    every ``##`` piece of the text up front, in sorted order, fixes the numbering; the final tokenizer is rebuilt
    from the trained vocabulary with only the five real special tokens.
    """
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    trainer = BertWordPieceTokenizer(lowercase=True)
    backend = trainer._tokenizer
    pieces = {char for text in texts
              for word, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(text))
              for char in word[1:]}
    fixed = SPECIALS + [f"##{char}" for char in sorted(pieces)]
    trainer.train_from_iterator(texts, vocab_size=VOCAB_SIZE, special_tokens=fixed, show_progress=False)
    wordpiece = BertWordPieceTokenizer(vocab=trainer.get_vocab(), lowercase=True)
    return BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, do_lower_case=True, unk_token="[UNK]",
                             sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
                             model_max_length=ENCODER["max_position_embeddings"])


def build_encoder(texts: list[str], folder: Path, seed: int) -> dict[str, Any]:
    """A WordPiece tokenizer trained on ``texts`` and a random-weight BERT classifier, saved to ``folder``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = train_wordpiece(texts)
    config = BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ENCODER)
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    tokens = sum(len(ids) for ids in encoded)
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    return {"folder": str(folder), "vocab_size": len(tokenizer), "vocab_sha256": hashlib.sha256(vocab).hexdigest(),
            "parameters": model.num_parameters(), "config": ENCODER, "texts": len(texts),
            "tokens_per_text_mean": round(tokens / len(texts), 1),
            "unk_rate": round(sum(ids.count(tokenizer.unk_token_id) for ids in encoded) / tokens, 5)}


def rm_parameters(state: Path, run_id: str) -> dict[str, int]:
    """Parameters of the trained proxy and held-out reward models, counted from their saved weights."""
    from safetensors.torch import load_file

    from tasks.reward_model import ROLES, model_input

    artifact = stage_artifact(state, run_id, "reward-model")
    return {role: sum(tensor.numel() for file in Path(model_input(artifact, role).path).glob("*.safetensors")
                      for tensor in load_file(str(file)).values()) for role in ROLES}


def headline(row: dict[str, Any], state: Path) -> dict[str, Any]:
    """The numbers the comparison reads, from one run's summary."""
    if "failed" in row:
        return row
    summary = row["summary"]
    sft, final = summary["policies"]["sft"], summary["policies"]["final"]
    best = next(point for point in summary["best_of_n"] if point["n"] == BEST_OF)
    return {
        "label": row["label"], "overrides": row["overrides"], "run_id": summary["run_id"], "status": summary["status"],
        "reasons": summary["reasons"], **{key: summary["reward_model"].get(key) for key in RM_METRICS},
        "rm_parameters": rm_parameters(state, summary["run_id"]),
        "gold_sft": sft["gold"], "gold": final["gold"], "heldout_sft": sft["heldout"], "heldout": final["heldout"],
        "proxy_sft": sft["proxy"], "proxy": final["proxy"], "kl": final["kl"],
        "win_rate_gold": summary["iterations"][-1].get("eval/win_rate/gold"),
        "gold_by_iteration": [it.get("eval/gold/mean") for it in summary["iterations"]],
        "best_of_16": {"gold": best["gold"], "heldout": best["heldout"], "kl": best["kl"]},
        "reused": [label for label, a in summary["artifacts"].items() if a.get("cached_from")],
        "run_seconds": round(summary["seconds"], 1), "wall_s": row["wall_s"], "peak_rss_mib": row["peak_rss_mib"],
        "log": row["log"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rates", type=float, nargs="*", default=[],
                        help="extra encoder runs at these reward_model.training.learning_rate values (the first "
                             "encoder run always keeps the preset's 5e-4)")
    parser.add_argument("--state-dir", type=Path, default=Path("/tmp/byo_state"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    state = args.state_dir.absolute()
    start_machine = machine()
    default = run_demo("default", args.seed, state, [])
    if "failed" in default:
        raise SystemExit(f"the default run failed: {default['failed']}\n" + "\n".join(default["log_tail"]))
    encoder = build_encoder(demo_texts(state, default["summary"]["run_id"]), state / "encoder-rm", args.seed)
    print(json.dumps({"encoder": encoder}), file=sys.stderr, flush=True)
    base = [f"reward_model.init={encoder['folder']}", "reward_model.heldout_init=sft"]
    runs = [default, run_demo("encoder", args.seed, state, base)]
    for rate in args.learning_rates:
        runs.append(run_demo(f"encoder-lr{rate:g}", args.seed, state,
                             [*base, f"reward_model.training.learning_rate={rate:g}"]))
    rows = [headline(row, state) for row in runs]
    write_result({"machine": start_machine, "machine_end": machine(), "seed": args.seed, "encoder": encoder,
                  "runs": rows, "state_dir": str(state)}, args.out or default_out("byo_models", False))


if __name__ == "__main__":
    main()
