"""The `jaxreshard` command line: its parser and `main`, the one place where a command's failure
becomes a message (see [Note: one error path] in `_console.py`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from jaxreshard.cli._bench import add_bench_parser
from jaxreshard.cli._cluster import add_cluster_parser
from jaxreshard.cli._console import print_error
from jaxreshard.cli._profile import add_profile_parser
from jaxreshard.cli._schedule import add_schedule_parser


class _Parser(argparse.ArgumentParser):
    """argparse, with its refusals as one line (the usage is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(models: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser of every command (`bench`, `schedule`, `profile`, `cluster`); `models`: the
    user's models (references) that `profile` takes beside the built-in ones."""
    parser = _Parser(
        prog="jaxreshard",
        description="Pipeline-parallel JAX across device meshes with optimised resharding.",
        epilog="Errors are one line; set JAXRESHARD_TRACEBACK=1 to also print where they came "
        "from.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_bench_parser(commands)
    add_schedule_parser(commands)
    add_profile_parser(commands, models)
    add_cluster_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code (0 on success; see [Note: one error path])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    models: list[str] = []
    if len(argv) >= 2 and argv[0] == "profile" and not argv[1].startswith("-"):
        from jaxreshard.models import MODEL_NAMES, get_model

        if argv[1] not in MODEL_NAMES:  # the user's own model: its flags come from its config
            models.append(argv[1])
    try:
        if models:
            from jaxreshard.profiler._config import check_model_fields

            check_model_fields(get_model(models[0]))
        parser = build_parser(models)
    except Exception as e:
        return print_error(f"profile {models[0]}" if models else (argv[0] if argv else ""), e)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own one-line usage error (exit code 2)
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"jaxreshard {_command(args)}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        return print_error(_command(args), e)


def _command(args: argparse.Namespace) -> str:
    """The command as argparse names it in its own errors (`profile gpt`, `cluster up`)."""
    sub = next(
        (getattr(args, k) for k in ("model", "bench", "action") if getattr(args, k, None)), None
    )
    return f"{args.command} {sub}" if sub else args.command


if __name__ == "__main__":
    sys.exit(main())
