"""The `jaxreshard` command line: `bench reshard`, `schedule`, `profile`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def make_console():
    """A rich console; off a terminal (logs, CI, pipes) wide enough for our tables."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def _bench_reshard(args: argparse.Namespace) -> int:
    from jaxreshard._bench import bench_cases, results_table
    from jaxreshard._cases import load_cases
    from jaxreshard.comm import PlannerOptions
    from jaxreshard.comm._planner import check_strategy

    console = make_console()
    cluster, cases = load_cases(args.cases)
    if args.only:
        names = {c.name for c in cases}
        unknown = sorted(set(args.only) - names)
        if unknown:
            raise SystemExit(f"--only {unknown}: no such case; the file has {sorted(names)}")
        cases = [c for c in cases if c.name in args.only]
    strategies = tuple(check_strategy(s, "--strategies") for s in args.strategies)
    options = PlannerOptions(seed=args.seed)
    with console.status("planning") as status:
        results = bench_cases(
            cases,
            cluster=cluster,
            strategies=strategies,
            options=options,
            dump_plans=Path(args.dump_plans) if args.dump_plans else None,
            progress=lambda text: status.update(f"planning {text}"),
        )
    console.print(results_table(results))
    invalid = [
        (c["name"], s)
        for c in results["cases"]
        for s, r in c["results"].items()
        if not r.get("valid", True)
    ]
    if invalid:
        console.print(f"[red]invalid plans: {invalid}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        console.print(f"wrote {args.out}")
    return 1 if invalid else 0


def build_parser() -> argparse.ArgumentParser:
    from jaxreshard.comm._planner import STRATEGY_NAMES

    parser = argparse.ArgumentParser(
        prog="jaxreshard",
        description="Pipeline-parallel JAX across device meshes with optimised resharding.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    reshard = bench_kinds.add_parser(
        "reshard",
        help="plan every resharding case with every strategy and simulate it on the cluster",
    )
    reshard.add_argument(
        "--cases",
        default=None,
        help="case file (jaxreshard-reshard-cases/1); default: the shipped paper cases",
    )
    reshard.add_argument("--out", default=None, help="write jaxreshard-reshard-results/1 JSON")
    reshard.add_argument(
        "--dump-plans",
        default=None,
        metavar="DIR",
        help="write every plan as DIR/<case>.<strategy>.json",
    )
    reshard.add_argument(
        "--strategies",
        nargs="+",
        default=list(STRATEGY_NAMES),
        metavar="NAME",
        help=f"subset of {', '.join(STRATEGY_NAMES)}",
    )
    reshard.add_argument("--only", nargs="+", metavar="CASE", help="run only these cases")
    reshard.add_argument("--seed", type=int, default=0, help="seed of the greedy balancer")
    reshard.set_defaults(run=_bench_reshard)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"jaxreshard {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
