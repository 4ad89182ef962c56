"""The `jaxreshard` command line: `bench reshard`, `schedule` (in `_schedule_cli.py`), `profile`,
`cluster`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def make_console():
    """A rich console; off a terminal (logs, CI, pipes) wide enough for our tables."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def _bench_reshard(args: argparse.Namespace) -> int:
    from jaxreshard.bench._cases import load_cases
    from jaxreshard.bench._simulated import bench_cases, results_table
    from jaxreshard.comm import PlannerOptions
    from jaxreshard.comm._planner import check_strategy

    if args.address is not None and args.execute != "ray":
        raise ValueError(f"--address {args.address}: only with --execute ray (joins that cluster)")
    console = make_console()
    cluster, cases = load_cases(args.cases)
    if args.only:
        names = {c.name for c in cases}
        unknown = sorted(set(args.only) - names)
        if unknown:
            raise ValueError(f"--only {unknown}: no such case; the file has {sorted(names)}")
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
    failed = []
    if args.execute:
        failed = _execute_cases(args, cases, cluster, results, console)
    if args.out:
        _write_json(args.out, results)
        console.print(f"wrote {args.out}")
    return 1 if invalid or failed else 0


def _execute_cases(args, cases, cluster, results, console) -> list[str]:
    from rich.progress import track

    from jaxreshard.bench import _executed as ex

    scaled = [ex.scale_case(c, args.scale) for c in cases]
    runtime = None
    if args.execute == "local":
        _cpu_devices(ex.devices_needed(scaled))
        run = lambda case: ex.run_local(case, args.repeats)
    else:
        from jaxreshard.runtime._ray import RayRuntime

        num_hosts, per_host = ex.ray_shape(scaled)
        links = {k: v for k, v in cluster.items() if k != "devices_per_host"}
        if args.emulate_network is not None:  # the model of the NICs the transfers wait for
            links["inter_host_gbytes_per_s"] = args.emulate_network
        if args.address is not None:
            # The cluster's own NIC model (see [Note: cluster description]) wins over the case
            # file's; only what it does not describe (links inside a host) comes from the file.
            links = {k: v for k, v in links.items() if k == "intra_host_gbytes_per_s"}
            where = f"joining Ray at {args.address}: {num_hosts} host actors x {per_host} devices"
            options = dict(address=args.address)
        else:
            where = f"starting Ray: {num_hosts} host actors x {per_host} devices"
            options = dict(object_store_memory=args.object_store_mib * 2**20)
        with console.status(where):
            runtime = RayRuntime(
                num_hosts=num_hosts,
                devices_per_host=per_host,
                cluster_links=links,
                timeout_s=args.timeout,
                emulate_network_gbps=args.emulate_network,
                transport=args.transport,
                **options,
            )
        results["cluster_model"] = runtime.cluster.link_summary()
        results["address"] = args.address
        if runtime.description is not None:
            results["cluster_description"] = runtime.description
        run = lambda case: ex.run_ray(runtime, case, args.repeats)
    try:
        results["memcpy_gbytes_per_s"] = ex.memcpy_gbytes_per_s()
        results["scale"] = args.scale
        results["emulate_network_gbps"] = args.emulate_network
        by_name = {c["name"]: c for c in results["cases"]}
        for case in track(scaled, description=f"executing ({args.execute})", console=console):
            record = run(case)
            record.update(shape=list(case.shape), bytes=ex.dst_bytes(case))
            by_name[case.name]["executed"] = record
    finally:
        if runtime is not None:
            runtime.shutdown()
    console.print(ex.executed_table(results))
    return [c["name"] for c in results["cases"] if not c["executed"]["correct"]]


def _cluster(args: argparse.Namespace) -> int:
    from jaxreshard import cluster as emu

    console = make_console()
    try:
        if args.action == "up":
            with console.status(f"starting {args.hosts} emulated hosts and their Ray nodes"):
                c = emu.up(
                    args.hosts,
                    args.nic_gbps,
                    latency_ms=args.latency_ms,
                    cpus_per_host=args.cpus_per_host,
                    devices_per_host=args.devices_per_host,
                    name=args.name,
                    object_store_mib=args.object_store_mib,
                )
            console.print(f"cluster {c.name} is up: {c.describe()}", highlight=False)
            console.print(
                f"join it with --address {c.address} (jaxreshard.init(backend='ray', "
                f"address='{c.address}')); stop it with jaxreshard cluster down --name {c.name}",
                highlight=False,
            )
            if args.json:
                _write_json(args.json, c.to_json())
                console.print(f"wrote {args.json}")
        elif args.action == "down":
            removed = emu.down_all() if args.all else {args.name: emu.down(args.name)}
            for name, what in removed.items():
                console.print(
                    f"cluster {name}: removed {len(what['namespaces'])} namespaces, "
                    f"{len(what['links'])} links"
                    + (
                        f"; pids that would not stop: {what['stuck_pids']}"
                        if what["stuck_pids"]
                        else ""
                    ),
                    highlight=False,
                )
            if not removed:
                console.print("no jaxreshard clusters on this machine")
        elif args.action == "status":
            clusters = emu.status(args.name)
            if args.json:
                _write_json(args.json, {"clusters": clusters})
            for table in _cluster_tables(clusters):
                console.print(table)
            if not clusters:
                console.print("no jaxreshard clusters on this machine")
        else:  # measure
            (state,) = emu.status(args.name)
            described = emu.EmulatedCluster.from_json(state)
            r = emu.measure_tcp(described, args.src, args.dst, args.mib * 2**20)
            console.print(
                f"TCP h{args.src} -> h{args.dst}: {r['bytes'] / 2**20:.0f} MiB in "
                f"{r['seconds']:.3f} s = {r['gbytes_per_s']:.4f} GB/s"
                + (
                    f" ({r['of_nic']:.2f}x the NIC's {described.nic_gbps:g})"
                    if "of_nic" in r
                    else ""
                ),
                highlight=False,
            )
            if args.json:
                _write_json(args.json, r)
    except emu.ClusterUnavailable as e:
        print(f"jaxreshard cluster {args.action}: {e}", file=sys.stderr)
        return 3
    except (RuntimeError, TimeoutError) as e:  # a step failed; `up` removed what it made
        print(f"jaxreshard cluster {args.action}: error: {e}", file=sys.stderr)
        return 1
    return 0


def _cluster_tables(clusters: list[dict]) -> list:
    from rich.table import Table

    tables = []
    for c in clusters:
        if c.get("state") == "unknown":
            table = Table(title=f"cluster {c['name']}: no state file; leftovers {c['namespaces']}")
            tables.append(table)
            continue
        links = c["planner_links"]
        table = Table(
            title=f"cluster {c['name']} ({c['state']}), head {c['address']}; NIC "
            f"{c['nic_gbps']:g} GB/s per direction, +{c['latency_ms']:g} ms one way; planner "
            f"model: {links.get('inter_host_gbytes_per_s', '-')} GB/s, latency "
            f"{links['latency_s'] * 1e3:g} ms; {c['devices_per_host']} devices per host"
        )
        for column in ("node", "netns", "ip", "cpus", "raylet", "sent MiB", "recv MiB", "drops"):
            table.add_column(column, justify="left" if column in ("node", "netns") else "right")
        for n in c["nodes"]:
            drops = n.get("sent_dropped", 0) + n.get("received_dropped", 0)
            table.add_row(
                n["name"],
                n["netns"] if n["netns_up"] else f"[red]{n['netns']} (gone)",
                n["ip"],
                ",".join(map(str, n["cpus"])) if n["cpus"] else "any",
                "up" if n["raylet"] else "[red]down",
                f"{n['sent_bytes'] / 2**20:.1f}" if "sent_bytes" in n else "-",
                f"{n['received_bytes'] / 2**20:.1f}" if "received_bytes" in n else "-",
                str(drops) if "sent_bytes" in n else "-",
            )
        tables.append(table)
    return tables


def _add_cluster_parser(commands: argparse._SubParsersAction) -> None:
    from jaxreshard.cluster._emulated import DEFAULT_NAME

    cluster = commands.add_parser(
        "cluster",
        help="an emulated cluster on this machine: network namespaces with shaped NICs, one "
        "Ray node each (needs root)",
        description="Hosts as Linux network namespaces on one bridge, each NIC shaped in both "
        "directions with tc, one Ray node per host; the driver joins with --address.",
    )
    actions = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="make the hosts and start their Ray nodes")
    up.add_argument("--hosts", type=int, required=True, help="number of emulated hosts")
    up.add_argument(
        "--nic-gbps", type=float, required=True, help="NIC rate per direction, GB/s (1e9 B/s)"
    )
    up.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay (netem), ms")
    up.add_argument(
        "--cpus-per-host", type=int, default=None, help="pin each Ray node to K CPUs (taskset)"
    )
    up.add_argument("--devices-per-host", type=int, default=1, help="fake CPU devices per host")
    up.add_argument("--object-store-mib", type=int, default=1024, help="object store per node")
    up.add_argument("--json", default=None, metavar="FILE", help="write jaxreshard-cluster/1")
    down = actions.add_parser("down", help="stop the Ray nodes, remove namespaces and links")
    down.add_argument("--all", action="store_true", help="every jaxreshard cluster here")
    status = actions.add_parser("status", help="the clusters, their NIC model and counters")
    status.add_argument("--json", default=None, metavar="FILE", help="write the status as JSON")
    measure = actions.add_parser("measure", help="a plain TCP transfer between two hosts")
    measure.add_argument("--src", type=int, default=0, help="sending host (0)")
    measure.add_argument("--dst", type=int, default=1, help="receiving host (1)")
    measure.add_argument("--mib", type=int, default=64, help="MiB to send (64)")
    measure.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    for sub, default in (
        (up, DEFAULT_NAME),
        (down, DEFAULT_NAME),
        (status, None),
        (measure, DEFAULT_NAME),
    ):
        sub.add_argument("--name", default=default, help=f"the cluster's name ({default or 'all'})")
    cluster.set_defaults(run=_cluster)


def _profile(args: argparse.Namespace) -> int:
    from jaxreshard import profiler

    overrides: dict[str, dict[str, object]] = {"model": {}, "run": {}, "pipeline": {}}
    for dest, value in vars(args).items():
        if value is not None and dest.startswith(("model__", "run__", "pipeline__")):
            table, key = dest.split("__", 1)
            overrides[table][key] = value
    pc = profiler.load_profile_config(args.model, args.config, overrides)
    _cpu_devices(profiler.devices_needed(pc))
    console = make_console()
    cache = _compile_cache(args.compile_cache)
    if cache:
        console.print(f"XLA compile cache: {cache} (--compile-cache off to compile afresh)")
    progress = not args.no_progress
    if args.compare_schedules or args.compare_resharding:
        kinds = [k for k in ("schedules", "resharding") if getattr(args, f"compare_{k}")]
        results = {}
        for kind in kinds:
            variants = (
                profiler.schedule_variants(pc)
                if kind == "schedules"
                else profiler.resharding_variants(pc)
            )
            title = (
                f"{pc.model} {pc.preset}: {kind} compared, {pc.num_stages} stages x "
                f"{pc.pipeline.num_micro_batches} micro-batches, {pc.run.steps} steps each "
                "(interleaved); speedup over the first row"
            )
            rows = profiler.compare(
                pc,
                variants,
                bound=pc.pipeline.backend != "ray",
                console=console,
                progress=progress,
                title=title,
                measure_placement=kind == "schedules" and profiler.measures_placement(pc),
            )
            results[kind] = profiler.compare_json(pc, kind, rows)
        if args.json:
            _write_json(args.json, results[kinds[0]] if len(kinds) == 1 else results)
            console.print(f"wrote {args.json}")
        return 0
    profiler.run_profile(
        pc,
        bound=args.bound,
        console=console,
        progress=progress,
        json_path=args.json,
        trace_path=args.trace,
        plot_path=args.plot,
    )
    return 0


def _compile_cache(where: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache (identical stage programs, e.g. of schedule
    variants or of the previous run, then load instead of compiling)."""
    import os

    import jax

    if where == "off":
        return None
    if where is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(base, "jaxreshard", "xla")
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where


def _cpu_devices(n: int) -> None:
    """Give JAX's CPU backend `n` devices (before it starts) when it is the platform."""
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") and n > jax.config.jax_num_cpu_devices:
        # JAX already started (a library caller): keep what it has.
        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", n)


def _add_profile_parser(commands: argparse._SubParsersAction) -> None:
    import dataclasses

    from jaxreshard.models import MODEL_NAMES, get_model
    from jaxreshard.profiler import RunConfig
    from jaxreshard.runtime._config import PipelineConfig

    profile = commands.add_parser(
        "profile",
        help="train GPT or U-Transformer as a pipeline and profile it end to end",
        description="Train a model on synthetic data with parallelize and report step time, "
        "throughput, per-stage compute/blocked/bubble, and every boundary tensor's transfer.",
    )
    models = profile.add_subparsers(dest="model", required=True, metavar="MODEL")
    for name in MODEL_NAMES:
        spec = get_model(name)
        sub = models.add_parser(
            name,
            help=f"profile {name} (presets: {', '.join(spec.presets)})",
            description=f"Profile {name} training. Settings come from defaults < --preset < "
            "--config FILE.toml ([model], [run], [pipeline] tables) < flags.",
        )
        sub.add_argument("--config", default=None, metavar="FILE.toml", help="profile config")
        out = sub.add_argument_group("outputs and comparisons")
        out.add_argument("--json", default=None, metavar="OUT", help="write the profile JSON")
        out.add_argument("--trace", default=None, metavar="TRACE.json", help="Chrome trace")
        out.add_argument("--plot", default=None, metavar="PNG", help="measured timeline PNG")
        out.add_argument(
            "--compare-schedules",
            action="store_true",
            help="1f1b vs eager_1f1b vs eager_1f1b + weight delay vs zb_h1, with the "
            "signal-only bound",
        )
        out.add_argument(
            "--compare-resharding",
            action="store_true",
            help="send_recv vs allgather vs broadcast resharding, with the signal-only bound",
        )
        out.add_argument(
            "--bound",
            action="store_true",
            help="also time signal-only steps (the bound with free transfers; local backend)",
        )
        out.add_argument("--no-progress", action="store_true", help="no progress bar")
        out.add_argument(
            "--compile-cache",
            default=None,
            metavar="DIR|off",
            help="JAX's persistent compilation cache (default ~/.cache/jaxreshard/xla)",
        )
        model_group = sub.add_argument_group(f"[model] ({name})")
        model_group.add_argument(
            "--preset",
            dest="model__preset",
            default=None,
            metavar="NAME",
            help=", ".join(spec.presets),
        )
        for f in dataclasses.fields(spec.config_type):
            _field_flag(model_group, "model", f.name, f"{name} config field")
        run_group = sub.add_argument_group("[run]")
        for f in dataclasses.fields(RunConfig):
            _field_flag(run_group, "run", f.name, f"RunConfig.{f.name}")
        pipe_group = sub.add_argument_group("[pipeline] (PipelineConfig fields)")
        for f in dataclasses.fields(PipelineConfig):
            if f.name == "emulate_network_gbps":
                pipe_group.add_argument(
                    "--emulate-network",
                    "--emulate-network-gbps",
                    dest="pipeline__emulate_network_gbps",
                    default=None,
                    metavar="GBPS",
                    help="delay every transfer between hosts as a NIC of GBPS gigabytes/s "
                    "would (the paper's 10 Gbit/s is 1.25); each stage is its own host unless "
                    "--devices-per-host says otherwise",
                )
                continue
            _field_flag(pipe_group, "pipeline", f.name, f"PipelineConfig.{f.name}")
        sub.set_defaults(run=_profile)


def _field_flag(group: argparse._ArgumentGroup, table: str, name: str, what: str) -> None:
    flag = "--" + name.replace("_", "-")
    dest = f"{table}__{name}"
    if name in ("weight_delay",):
        group.add_argument(
            flag, dest=dest, default=None, action=argparse.BooleanOptionalAction, help=what
        )
        return
    group.add_argument(flag, dest=dest, default=None, metavar="V", help=what)


def _write_json(path: str, data: object) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1))


def build_parser() -> argparse.ArgumentParser:
    from jaxreshard._schedule_cli import add_schedule_parser
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
    reshard.add_argument(
        "--execute",
        choices=("local", "ray"),
        default=None,
        help="also run every case for real on this runtime and check it",
    )
    reshard.add_argument(
        "--scale", type=int, default=2, help="with --execute: divide every dim by this (default 2)"
    )
    reshard.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="with --execute: timed runs per case (median reported)",
    )
    reshard.add_argument(
        "--timeout", type=float, default=300.0, help="with --execute ray: seconds any wait may take"
    )
    reshard.add_argument(
        "--emulate-network",
        type=float,
        default=None,
        metavar="GBPS",
        help="with --execute ray: give every host an emulated NIC of GBPS GB/s (transfers wait "
        "for it; no CPU burned)",
    )
    reshard.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="with --execute ray: join this Ray cluster (HOST:PORT, e.g. of `jaxreshard "
        "cluster up`) instead of starting one; the planner uses the cluster's NIC model",
    )
    reshard.add_argument(
        "--transport",
        choices=("auto", "tcp", "object_store"),
        default="auto",
        help="with --execute ray: how slices travel between hosts (auto: tcp on CPU)",
    )
    reshard.add_argument(
        "--object-store-mib",
        type=int,
        default=2048,
        help="with --execute ray: object store of each emulated node, in MiB",
    )
    reshard.set_defaults(run=_bench_reshard)

    add_schedule_parser(commands)
    _add_profile_parser(commands)
    _add_cluster_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as e:  # includes ScheduleError
        print(f"jaxreshard {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
