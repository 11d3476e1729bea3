"""The `rlhf` command line. One subcommand per job; `prep` runs data-prep alone.

Each subcommand registers itself with `_add_<name>(subparsers)` and sets a `handler(args) -> exit code`,
so demo / run / resume / stage / runs slot in beside `prep`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rlhf_core.data import DataError, DataPrepConfig, InputFormat

EXIT_DATA_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF with PPO as orchestrated stages.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_prep(subparsers)
    return parser


def _add_prep(subparsers: argparse._SubParsersAction) -> None:
    defaults = DataPrepConfig()
    prep = subparsers.add_parser(
        "prep", help="validate, dedupe and split preference data into Parquet tables",
        description="Read preference files (Parquet / JSONL / CSV; TRL, HH or chat format), quarantine bad rows "
        "with a reason, dedupe, split by prompt hash, and write Parquet tables under --out.",
    )
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="preference file(s): local paths or URIs")
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
    prep.set_defaults(handler=_run_prep)


def _run_prep(args: argparse.Namespace) -> int:
    from tasks.data_prep import run_data_prep  # deferred: keeps `rlhf --help` free of the prefect import

    try:
        config = DataPrepConfig(input_format=InputFormat(args.format), max_length=args.max_length,
                                max_quarantine_fraction=args.max_quarantine_fraction)
    except ValueError as err:
        raise DataError(f"invalid setting: {err}") from err
    result = run_data_prep(args.inputs, args.out, config, args.prompts, args.tokenizer)
    print(result.summary())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]), run the subcommand, return its exit code.

    DataError (bad input files or settings) prints one line on stderr and returns 2, without a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except DataError as err:
        message = " ".join(str(err).split())
        print(f"rlhf {args.command}: error: {message}", file=sys.stderr)
        return EXIT_DATA_ERROR


if __name__ == "__main__":
    sys.exit(main())
