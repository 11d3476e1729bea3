"""The `rlhf` command line. One subcommand per job; `prep` runs data-prep alone (`prep --demo` on the
generated customer-support task).

Each subcommand registers itself with `_add_<name>(subparsers)` and sets a `handler(args) -> exit code`,
so demo / run / resume / stage / runs slot in beside `prep`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flows.commands import add_pipeline_commands
from rlhf_core.data import DataError, DataPrepConfig, InputFormat

if TYPE_CHECKING:
    from tasks.demo_data import DemoDataResult

EXIT_DATA_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF with PPO as orchestrated stages.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_prep(subparsers)
    add_pipeline_commands(subparsers)
    return parser


def _add_prep(subparsers: argparse._SubParsersAction) -> None:
    defaults = DataPrepConfig()
    prep = subparsers.add_parser(
        "prep", help="validate, dedupe and split preference data into Parquet tables",
        description="Read preference files (Parquet / JSONL / CSV; TRL, HH or chat format), quarantine bad rows "
        "with a reason, dedupe, split by prompt hash, and write Parquet tables under --out.",
    )
    prep.add_argument("inputs", nargs="*", metavar="INPUT", help="preference file(s): local paths or URIs")
    prep.add_argument("--out", required=True, metavar="DIR", help="output directory for the Parquet tables")
    prep.add_argument("--format", choices=[f.value for f in InputFormat], default=defaults.input_format.value,
                      help="input format (default: detect per file)")
    prep.add_argument("--prompts", metavar="FILE", help="separate PPO prompts file (column 'prompt')")
    prep.add_argument("--max-quarantine-fraction", type=float, default=defaults.max_quarantine_fraction,
                      metavar="F", help="fail when more than this fraction of rows is quarantined")
    prep.add_argument("--max-length", type=int, default=defaults.max_length, metavar="N",
                      help="longest prompt + response (characters, or tokens with --tokenizer)")
    prep.add_argument("--tokenizer", metavar="NAME_OR_PATH",
                      help="tokenizer for token lengths and chat templates (local path or cached id)")
    _add_demo_options(prep)
    prep.set_defaults(handler=_run_prep)


def _add_demo_options(prep: argparse.ArgumentParser) -> None:
    # Defaults stay None (= DemoDataConfig's own), so building the parser never imports the stage.
    demo = prep.add_argument_group("demo task", "generate the embedded customer-support task instead of reading files")
    demo.add_argument("--demo", action="store_true", help="generate the demo task's data (no INPUT files)")
    demo.add_argument("--seed", type=int, metavar="N", help="seed of the generated data (default 0)")
    demo.add_argument("--pairs", type=int, metavar="N", help="preference pairs to generate (default 4000)")
    demo.add_argument("--sft-demos", type=int, metavar="N", help="SFT demonstrations to generate (default 4000)")
    demo.add_argument("--eval-prompts", type=int, metavar="N",
                      help="evaluation prompts with hidden metadata to generate (default 256)")


def _run_prep(args: argparse.Namespace) -> int:
    from tasks.data_prep import run_data_prep  # deferred: keeps `rlhf --help` free of the prefect import

    _check_prep_sources(args)
    try:
        config = DataPrepConfig(input_format=InputFormat(args.format), max_length=args.max_length,
                                max_quarantine_fraction=args.max_quarantine_fraction)
    except ValueError as err:
        raise DataError(f"invalid setting: {err}") from err
    if args.demo:
        result = _run_demo_prep(args, config)
    else:
        result = run_data_prep(args.inputs, args.out, config, args.prompts, args.tokenizer)
    print(result.summary())
    return 0


def _check_prep_sources(args: argparse.Namespace) -> None:
    """Either INPUT files or --demo; file-only options do not combine with --demo."""
    if not args.demo and not args.inputs:
        raise DataError("give preference file(s) as INPUT, or --demo to generate the demo task's data")
    if args.demo:
        clashes = [name for name, value in (("INPUT", args.inputs), ("--prompts", args.prompts),
                                            ("--tokenizer", args.tokenizer)) if value]
        clashes += ["--format"] if args.format != InputFormat.AUTO.value else []
        if clashes:
            raise DataError(f"--demo generates its own data; drop {', '.join(clashes)} or drop --demo")


def _run_demo_prep(args: argparse.Namespace, config: DataPrepConfig) -> DemoDataResult:
    from tasks.demo_data import DemoDataConfig, run_demo_data_prep

    given = {"seed": args.seed, "pairs": args.pairs, "sft_demos": args.sft_demos, "eval_prompts": args.eval_prompts}
    try:
        demo = DemoDataConfig(**{name: value for name, value in given.items() if value is not None})
    except ValueError as err:
        raise DataError(f"invalid setting: {err}") from err
    return run_demo_data_prep(args.out, demo, config)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]), run the subcommand, return its exit code.

    User errors (bad input files, unknown or invalid config settings, unknown run ids) print one line on
    stderr and return 2, without a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except _user_errors() as err:
        message = " ".join(str(err).split())
        print(f"rlhf {args.command}: error: {message}", file=sys.stderr)
        return EXIT_DATA_ERROR


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix (imported only when one is raised, to keep `--help` fast)."""
    from tasks.config import ConfigError
    from tasks.state import StateError

    return (DataError, ConfigError, StateError)


if __name__ == "__main__":
    sys.exit(main())
