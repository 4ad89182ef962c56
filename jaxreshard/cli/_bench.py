"""`jaxreshard bench reshard`: plan (and with `--execute`, run) the paper's resharding cases with
every strategy."""

from __future__ import annotations

import argparse

from jaxreshard.cli._console import (
    CommandError,
    check_outputs,
    count,
    cpu_devices,
    make_console,
    normalized,
    positive_float,
    write_json,
)


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """Register `jaxreshard bench reshard`."""
    from jaxreshard.comm._planner import STRATEGY_NAMES

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
        "--scale",
        type=count(1, 4096),
        default=None,
        help="with --execute: divide every dim by this (default 2)",
    )
    reshard.add_argument(
        "--repeats",
        type=count(1, 10_000),
        default=None,
        help="with --execute: timed runs per case (median reported)",
    )
    reshard.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help="with --execute ray: seconds any wait may take",
    )
    reshard.add_argument(
        "--emulate-network",
        type=positive_float,
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
        default=None,
        help="with --execute ray: how slices travel between hosts (auto: tcp on CPU)",
    )
    reshard.add_argument(
        "--object-store-mib",
        type=count(64, 2**24),
        default=None,
        help="with --execute ray: object store of each emulated node, in MiB",
    )
    reshard.set_defaults(run=_bench_reshard)


# The options of `--execute` and their defaults (given without it, an option would be ignored).
EXECUTE_OPTIONS = {
    "scale": 2,
    "repeats": 3,
    "timeout": 300.0,
    "emulate_network": None,
    "transport": "auto",
    "object_store_mib": 2048,
}


def _bench_reshard(args: argparse.Namespace) -> int:
    from jaxreshard.bench._cases import load_cases
    from jaxreshard.bench._simulated import bench_cases, results_table
    from jaxreshard.comm import PlannerOptions
    from jaxreshard.comm._planner import check_strategy

    if args.address is not None and args.execute != "ray":
        raise CommandError(
            f"--address {args.address}: only with --execute ray (joins that cluster)"
        )
    if args.address is not None:
        from jaxreshard.runtime.ray._options import check_init_options

        try:
            check_init_options(args.address, {})
        except ValueError as e:
            raise CommandError(str(e).replace("init(address=", "--address (", 1)) from None
    given = [k for k in EXECUTE_OPTIONS if getattr(args, k) is not None]
    if args.execute is None and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise CommandError(f"{flags}: only with --execute local|ray (they set how cases run)")
    if args.execute == "local":
        for key in ("timeout", "emulate_network", "transport", "object_store_mib"):
            if getattr(args, key) is not None:
                flag = "--" + key.replace("_", "-")
                raise CommandError(f"{flag}: only with --execute ray, not --execute local")
    for key, default in EXECUTE_OPTIONS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    check_outputs(args, {"out": None}, folders=("dump_plans",))
    console = make_console()
    cluster, cases = load_cases(args.cases)
    if args.only:
        names = {c.name for c in cases}
        unknown = sorted(set(args.only) - names)
        if unknown:
            raise CommandError(f"--only {unknown}: no such case; the file has {sorted(names)}")
        cases = [c for c in cases if c.name in args.only]
    strategies = tuple(check_strategy(s, "--strategies") for s in args.strategies)
    options = PlannerOptions(seed=args.seed)
    with console.status("planning") as status:
        results = bench_cases(
            cases,
            cluster=cluster,
            strategies=strategies,
            options=options,
            dump_plans=normalized(args.dump_plans) if args.dump_plans else None,
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
        write_json(args.out, results)
        console.print(f"wrote {args.out}")
    return 1 if invalid or failed else 0


def _execute_cases(args, cases, cluster, results, console) -> list[str]:
    from rich.progress import track

    from jaxreshard.bench import _executed as ex

    scaled = [ex.scale_case(c, args.scale) for c in cases]
    _check_memory(scaled, args.scale, ex.dst_bytes)
    runtime = None
    if args.execute == "local":
        cpu_devices(ex.devices_needed(scaled), "the cases")
        run = lambda case: ex.run_local(case, args.repeats)
    else:
        from jaxreshard.runtime.ray._runtime import RayRuntime

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


def _check_memory(cases, scale: int, nbytes) -> None:
    """Refuse, before anything is allocated, a case whose arrays (the source, the result and
    the baseline's result: about three copies) do not fit this machine's available memory."""
    from jaxreshard._machine import available_memory_bytes, format_bytes

    available = available_memory_bytes()
    if available is None:
        return
    for case in cases:
        need = 3 * nbytes(case)
        if need > available:
            raise CommandError(
                f"--execute: case {case.name!r} of shape {list(case.shape)} (after --scale "
                f"{scale}) needs ~{format_bytes(need)} (source, result and baseline), but this "
                f"machine has {format_bytes(available)} available; use a larger --scale or --only "
                "other cases"
            )
