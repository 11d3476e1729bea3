"""The `rlhf` command line. One subcommand per job; `prep` runs data-prep alone (`prep --demo` on the
generated customer-support task), with its flags turned into config overrides and loaded by
``tasks.config.load_config`` like those of `rlhf run`.

Each subcommand registers itself with `_add_<name>(subparsers)` and sets a `handler(args) -> exit code`,
so demo / run / resume / stage / runs slot in beside `prep`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from flows.commands import add_pipeline_commands
from flows.errors import EXIT_DATA_ERROR, user_errors
from flows.serving import add_serving_commands
from flows.sweep_command import add_sweep_command
from rlhf_core.data import DataError, DataPrepConfig, InputFormat
from rlhf_core.demo.config import DemoDataConfig


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF with PPO as orchestrated stages.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_prep(subparsers)
    add_pipeline_commands(subparsers)
    add_serving_commands(subparsers)
    add_sweep_command(subparsers)
    return parser


def _add_prep(subparsers: argparse._SubParsersAction) -> None:
    # Flag defaults stay None: an unset flag leaves the config's default (tasks/config/), the single source.
    data, demo = DataPrepConfig(), DemoDataConfig()
    prep = subparsers.add_parser(
        "prep", help="validate, dedupe and split preference data into Parquet tables",
        description="Read preference files (Parquet / JSONL / CSV; TRL, HH or chat format), quarantine bad rows "
        "with a reason, dedupe, split by prompt hash, and write Parquet tables under --out. The flags are "
        "settings of the pipeline config (the key each sets is in its help) and are checked like "
        "`rlhf run` overrides; --set KEY=VALUE gives any other setting (e.g. data.prep.train_fraction).",
    )
    prep.add_argument("inputs", nargs="*", metavar="INPUT", help="preference file(s): local paths or URIs "
                      "(data.files)")
    prep.add_argument("--out", required=True, metavar="DIR", help="output directory for the Parquet tables")
    prep.add_argument("--format", metavar="FORMAT", help="input format: "
                      f"{', '.join(f.value for f in InputFormat)} (data.prep.input_format; default: "
                      f"{data.input_format.value}, detect per file)")
    prep.add_argument("--prompts", metavar="FILE", help="separate PPO prompts file, column 'prompt' "
                      "(data.prompts_file)")
    prep.add_argument("--max-quarantine-fraction", metavar="F", help="fail when more than this fraction of rows "
                      f"is quarantined (data.prep.max_quarantine_fraction; default {data.max_quarantine_fraction})")
    prep.add_argument("--max-length", metavar="N", help="longest prompt + response, in tokens with a tokenizer "
                      "(sft.base_model's or --tokenizer), else characters (data.prep.max_length; default: no limit)")
    prep.add_argument("--max-prompt-length", metavar="N", help="longest prompt, in max-length's unit; must be < "
                      "max-length (data.prep.max_prompt_length; default: no limit)")
    prep.add_argument("--tokenizer", metavar="NAME_OR_PATH",
                      help="tokenizer for token lengths and chat templates (local path or cached id); default: "
                      "sft.base_model's, as in `rlhf run` (--set sft.base_model=PATH), else lengths count characters")
    prep.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                      help="any other config setting, e.g. --set data.prep.heldout_fraction=0.2 (repeatable; "
                      "applied after the flags)")
    group = prep.add_argument_group("demo task", "generate the embedded customer-support task instead of reading "
                                    "files")
    group.add_argument("--demo", action="store_true", help="generate the demo task's data (no INPUT files; "
                       "data.source=demo)")
    group.add_argument("--seed", metavar="N", help="seed of the generated data (the config's seed; default 0)")
    group.add_argument("--pairs", metavar="N", help=f"preference pairs to generate (data.demo.n_pairs; "
                       f"default {demo.n_pairs})")
    group.add_argument("--sft-demos", metavar="N", help=f"SFT demonstrations to generate (data.demo.n_sft; "
                       f"default {demo.n_sft})")
    group.add_argument("--eval-prompts", metavar="N", help="evaluation prompts with hidden metadata to generate "
                       f"(data.demo.n_eval_prompts; default {demo.n_eval_prompts})")
    prep.set_defaults(handler=_run_prep)


#: prep flag -> the config key it sets (flag values go through the loader as text, exactly like overrides).
PREP_FLAGS = {"format": "data.prep.input_format", "max_length": "data.prep.max_length",
              "max_prompt_length": "data.prep.max_prompt_length",
              "max_quarantine_fraction": "data.prep.max_quarantine_fraction"}
DEMO_FLAGS = {"seed": "seed", "pairs": "data.demo.n_pairs", "sft_demos": "data.demo.n_sft",
              "eval_prompts": "data.demo.n_eval_prompts"}


def prep_overrides(args: argparse.Namespace) -> list[str]:
    """The ``KEY=VALUE`` overrides that the prep flags stand for, then the user's ``--set`` ones."""
    if args.demo:
        overrides = ["data.source=demo"]
    else:
        # prep runs no refresh stage, whose default simulated annotator would reject a files source
        overrides = ["data.source=files", f"data.files={json.dumps(list(args.inputs))}", "refresh.enabled=false"]
        if args.prompts is not None:
            overrides.append(f"data.prompts_file={json.dumps(args.prompts)}")
    flags = {**PREP_FLAGS, **DEMO_FLAGS}
    overrides += [f"{key}={getattr(args, name)}" for name, key in flags.items() if getattr(args, name) is not None]
    return overrides + list(args.overrides)


def _run_prep(args: argparse.Namespace) -> int:
    # deferred: keeps `rlhf --help` free of the prefect and torch imports
    from tasks import data_prep
    from tasks.config import load_config

    _check_prep_sources(args)
    config = load_config(None, None, prep_overrides(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the pipeline's slice: lengths count sft.base_model's tokens (or --tokenizer's) exactly as in `rlhf run`
    result = data_prep.prepare(data_prep.Config.of(config, args.tokenizer), out)
    print(data_prep.summary(result, out))
    return 0


def _check_prep_sources(args: argparse.Namespace) -> None:
    """Either INPUT files or --demo; file-only options do not combine with --demo."""
    if not args.demo and not args.inputs:
        raise DataError("give preference file(s) as INPUT, or --demo to generate the demo task's data")
    if args.demo:
        clashes = [name for name, value in (("INPUT", args.inputs), ("--prompts", args.prompts)) if value]
        clashes += ["--format"] if args.format not in (None, InputFormat.AUTO.value) else []
        if clashes:
            raise DataError(f"--demo generates its own data; drop {', '.join(clashes)} or drop --demo")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]), run the subcommand, return its exit code.

    User errors (bad input files, unknown or invalid config settings, unknown run ids) print one line on
    stderr and return 2, without a traceback.
    """
    args = build_parser().parse_args(argv)
    exit_on_sigterm()
    try:
        return args.handler(args)
    except user_errors() as err:
        message = " ".join(str(err).split())
        print(f"rlhf {args.command}: error: {message}", file=sys.stderr)
        return EXIT_DATA_ERROR


def exit_on_sigterm() -> None:
    """SIGTERM (`kill`, `timeout`, a service manager, a cluster's scheduler) ends the command as an exception does:
    ``finally`` blocks and exit handlers run, so a stage's workers and Prefect's temporary server end with it
    (exit status 143). Prefect turns SIGTERM into an exception inside a flow and then sends it again to the handler
    it found; with the default one the process died on the spot and left the temporary server running. A handler
    someone else installed (a test runner's, say) is kept."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(number: int, frame: object) -> None:
    raise SystemExit(128 + number)


if __name__ == "__main__":
    sys.exit(main())
