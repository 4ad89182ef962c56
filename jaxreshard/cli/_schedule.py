"""`jaxreshard schedule`: build (or import), check, simulate and draw a pipeline schedule.

`jaxreshard schedule NAME --stages P --micro-batches M [--virtual-stages V] ...` builds a
registered schedule; `jaxreshard schedule compare ...` prints the comparison table;
`jaxreshard schedule import FILE ...` reads torch's compute-only CSV (or a
`jaxreshard-schedule/1` or `/2` JSON timeline), checks it and simulates it as soon as possible
in its order. Every form writes the same outputs (`--json`, `--csv`, `--plot`, `--trace`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jaxreshard.cli._console import (
    PLOT_SUFFIXES,
    CommandError,
    check_outputs,
    count,
    floats,
    make_console,
    normalized,
    write_json,
    write_text,
)

COST_FLAGS = ("forward", "backward", "weight_grad", "comm", "apply")
COST_DEFAULTS = {"forward": 1.0, "backward": 2.0, "comm": 0.0, "apply": 0.0}

# A picture of a bigger schedule is unreadable and slow to draw (the trace has no limit).
MAX_PLOT_ACTIONS = 5_000  # (20,000 took 41-50 s to draw)
MAX_PLOT_RANKS = 128


def add_schedule_parser(commands: argparse._SubParsersAction) -> None:
    """Register `jaxreshard schedule` on the CLI's subcommands."""
    from jaxreshard.pipeline import SCHEDULE_NAMES

    schedule = commands.add_parser(
        "schedule",
        help="build, check and simulate a pipeline schedule ('compare' them all; 'import' a CSV)",
        description="Build, check and simulate a pipeline schedule under a cost model. Costs "
        "take one number, or one per chunk (model stage; with one chunk per rank, per stage) "
        "as a comma list; --comm one per chunk boundary. 'compare' prints every schedule "
        "under the same per-stage costs; 'import FILE' reads torch's compute-only CSV (one "
        "row per rank, cells like 2F0, 1I3, 0W1, 0B2) or a jaxreshard-schedule JSON.",
    )
    schedule.add_argument(
        "name",
        metavar="NAME",
        help=f"{', '.join(SCHEDULE_NAMES)}, 'compare' for the comparison table, or 'import'",
    )
    schedule.add_argument(
        "file", nargs="?", default=None, metavar="FILE", help="with import: the CSV or JSON"
    )
    # (bounded only below here: a count too large is refused with the schedule's estimate)
    schedule.add_argument(
        "--stages", type=count(1, 10**15), default=None, help="number of ranks (stages) p"
    )
    schedule.add_argument(
        "--micro-batches", type=count(1, 10**15), default=None, help="micro-batches m"
    )
    schedule.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="chunks (model stages) per rank: 1 for gpipe/1f1b/eager_1f1b/zb_h1, 2 (default) "
        "for interleaved_1f1b and eager_interleaved_1f1b (any v), zbv and dualpipev (only 2); "
        "with compare, the interleaved rows' v",
    )
    schedule.add_argument(
        "--weight-delay",
        action="store_true",
        help="split each backward into B and W and delay the Ws",
    )
    # (None: the default below, or an imported timeline's own costs)
    schedule.add_argument("--forward", type=floats, default=None, help="forward time (1)")
    schedule.add_argument("--backward", type=floats, default=None, help="whole backward time (2)")
    schedule.add_argument(
        "--weight-grad",
        type=floats,
        default=None,
        help="weight-gradient part of the backward (default: half)",
    )
    schedule.add_argument("--comm", type=floats, default=None, help="transfer time (0)")
    schedule.add_argument(
        "--apply",
        type=floats,
        default=None,
        help="apply-gradient time; > 0 adds the optimizer step (A)",
    )
    schedule.add_argument(
        "--no-overlap",
        action="store_true",
        help="transfers block their sending and receiving ranks (one chunk per rank only)",
    )
    schedule.add_argument(
        "--json", default=None, metavar="OUT", help="write jaxreshard-schedule/2 JSON"
    )
    schedule.add_argument(
        "--csv", default=None, metavar="OUT.csv", help="write torch's compute-only CSV"
    )
    schedule.add_argument(
        "--csv-overlap-pairs",
        action="store_true",
        help="with --csv: write fused forward/backward pairs as torch's (..;..)OVERLAP_F_B",
    )
    schedule.add_argument("--plot", default=None, metavar="PNG", help="write the timeline PNG")
    schedule.add_argument(
        "--trace", default=None, metavar="TRACE", help="write a Chrome trace (Perfetto)"
    )
    schedule.set_defaults(run=run_schedule)


def run_schedule(args: argparse.Namespace) -> int:
    """The `jaxreshard schedule` command."""
    check_outputs(args, {"json": None, "csv": (".csv",), "plot": PLOT_SUFFIXES, "trace": None})
    console = make_console()
    file_costs = None
    if args.name == "import":
        schedule, file_costs = _import(args)
    else:
        if args.file is not None:
            raise CommandError(
                f"FILE={args.file!r} is only read by 'import' (jaxreshard schedule import FILE)"
            )
        for flag, value in (("--stages", args.stages), ("--micro-batches", args.micro_batches)):
            if value is None:
                raise CommandError(f"{flag} is required with NAME={args.name!r}")
        if args.name == "compare":
            return _compare(args, console)
        schedule = _build(args)
    overlap = not args.no_overlap
    if file_costs is not None and all(getattr(args, k) is None for k in COST_FLAGS):
        costs = file_costs  # the timeline's own (a flag replaces them all)
        console.print("costs: the file's", highlight=False)
    else:
        costs = _costs(args, schedule.num_chunks)
    if args.apply:
        schedule = schedule.with_apply()
    from jaxreshard.pipeline import check_schedule, simulate
    from jaxreshard.pipeline._visualize import format_timeline, plot_timeline, to_chrome_trace

    check_schedule(schedule, blocking=True if not overlap else None)
    num_actions = sum(map(len, schedule.actions))
    if args.plot and (num_actions > MAX_PLOT_ACTIONS or schedule.num_stages > MAX_PLOT_RANKS):
        raise CommandError(
            f"--plot {args.plot}: the schedule has {num_actions:,} actions on "
            f"{schedule.num_stages} ranks; a picture shows at most {MAX_PLOT_ACTIONS:,} actions "
            f"on {MAX_PLOT_RANKS} ranks; use --trace (Perfetto opens any size) or fewer "
            "stages / micro-batches"
        )
    timeline = simulate(schedule, costs, overlap=overlap)
    console.print(schedule.describe(), highlight=False)
    console.print(format_timeline(timeline), highlight=False, soft_wrap=True)
    word = "stage" if schedule.virtual_stages == 1 else "rank (chunk-micro-batches)"
    console.print(
        f"makespan {timeline.makespan:.6g}, bubble fraction {timeline.bubble_fraction:.1%}, "
        f"peak activations per {word} {list(timeline.peak_activations)}, "
        f"overlap {'on' if overlap else 'off'}",
        highlight=False,
    )
    if args.json:
        write_json(args.json, timeline.to_json())
        console.print(f"wrote {args.json}")
    if args.csv:
        from jaxreshard.pipeline import schedule_to_csv

        write_text(args.csv, schedule_to_csv(schedule, overlap_pairs=args.csv_overlap_pairs))
        console.print(f"wrote {args.csv}")
    if args.trace:
        write_json(args.trace, to_chrome_trace(timeline))
        console.print(f"wrote {args.trace} (open in https://ui.perfetto.dev; 1 unit = 1 ms)")
    if args.plot:
        plot_timeline(timeline, normalized(args.plot))
        console.print(f"wrote {args.plot}")
    return 0


def _costs(args: argparse.Namespace, num_chunks: int) -> Any:
    from jaxreshard.pipeline import Costs

    given = {k: getattr(args, k) for k in COST_FLAGS if getattr(args, k) is not None}
    return Costs.make(num_chunks, **{**COST_DEFAULTS, **given})


def _build(args: argparse.Namespace) -> Any:
    from jaxreshard.pipeline import build_schedule
    from jaxreshard.pipeline._limits import check_counts
    from jaxreshard.pipeline._schedules import check_schedule_name, check_virtual_stages

    check_schedule_name(args.name, "NAME")
    v = check_virtual_stages(args.name, args.virtual_stages, "--virtual-stages")
    kinds = 3 if args.weight_delay or args.name in ("zb_h1", "zbv", "dualpipev") else 2
    check_counts(
        f"--stages {args.stages} x --virtual-stages {v} x --micro-batches {args.micro_batches}",
        args.stages * v,
        args.micro_batches,
        kinds,
        "use fewer stages or micro-batches",
    )
    return build_schedule(
        args.name,
        args.stages,
        args.micro_batches,
        virtual_stages=v,
        weight_delay=args.weight_delay,
        costs=_costs(args, args.stages * v),
        overlap=not args.no_overlap,
    )


def _import(args: argparse.Namespace) -> Any:
    from jaxreshard.pipeline import read_csv
    from jaxreshard.pipeline._formats import read_json_with_costs

    if args.file is None:
        raise ValueError("import needs FILE: jaxreshard schedule import FILE.csv --forward ...")
    path = Path(args.file)
    costs = None
    if path.suffix.lower() == ".json":
        schedule, costs = read_json_with_costs(path, blocking=args.no_overlap)
    else:
        schedule = read_csv(path, blocking=args.no_overlap)
    for flag, value, have in (
        ("--stages", args.stages, schedule.num_stages),
        ("--micro-batches", args.micro_batches, schedule.num_micro_batches),
        ("--virtual-stages", args.virtual_stages, schedule.virtual_stages),
    ):
        if value is not None and value != have:
            raise ValueError(f"{flag}={value}, but {path} has {have}; leave it out with import")
    if args.weight_delay:
        raise ValueError("--weight-delay: an imported schedule keeps its own order; leave it out")
    return schedule, costs


def _compare(args: argparse.Namespace, console: Any) -> int:
    from jaxreshard.pipeline._compare import compare_json, compare_schedules, compare_table

    p, m = args.stages, args.micro_batches
    v = 2 if args.virtual_stages is None else args.virtual_stages
    costs = _costs(args, p)
    rows = compare_schedules(p, m, costs, virtual_stages=v)
    title = (
        f"Schedules, {p} stages x {m} micro-batches, costs {costs.to_json()} per stage "
        f"(simulated; overlap on unless noted; v > 1: each stage cut in v chunks, every chunk "
        "boundary between ranks costs comm; peak in stage-micro-batches)"
    )
    console.print(compare_table(rows, title))
    if args.json:
        write_json(args.json, compare_json(p, m, costs, rows))
        console.print(f"wrote {args.json}")
    return 0
