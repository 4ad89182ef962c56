"""`jaxreshard cluster`: an emulated multi-host cluster on this machine (network namespaces,
shaped NICs, one Ray node each)."""

from __future__ import annotations

import argparse
import sys

from jaxreshard.cli._console import (
    CommandError,
    count,
    make_console,
    nonnegative_float,
    positive_float,
    write_json,
)


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
                write_json(args.json, c.to_json())
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
            clusters = [  # (a name with no state file and nothing left behind: no cluster)
                c
                for c in emu.status(args.name)
                if c.get("state") != "unknown" or c.get("namespaces")
            ]
            if args.json:
                write_json(args.json, {"clusters": clusters})
            for table in _cluster_tables(clusters):
                console.print(table)
            if not clusters:
                console.print(
                    f"no jaxreshard cluster named {args.name!r} on this machine"
                    if args.name
                    else "no jaxreshard clusters on this machine"
                )
        else:  # measure
            states = [c for c in emu.status(args.name) if c.get("state") != "unknown"]
            if not states:
                raise CommandError(
                    f"--name {args.name}: no such cluster on this machine; start it with "
                    f"`jaxreshard cluster up --name {args.name} ...` (`cluster status` lists them)"
                )
            (state,) = states
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
                write_json(args.json, r)
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


def add_cluster_parser(commands: argparse._SubParsersAction) -> None:
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
    up.add_argument("--hosts", type=count(1, 64), required=True, help="number of emulated hosts")
    up.add_argument(
        "--nic-gbps",
        type=positive_float,
        required=True,
        help="NIC rate per direction, GB/s (1e9 B/s)",
    )
    up.add_argument(
        "--latency-ms", type=nonnegative_float, default=0.0, help="one-way delay (netem), ms"
    )
    up.add_argument(
        "--cpus-per-host",
        type=count(1, 4096),
        default=None,
        help="pin each Ray node to K CPUs (taskset)",
    )
    up.add_argument(
        "--devices-per-host", type=count(1, 1024), default=1, help="fake CPU devices per host"
    )
    up.add_argument(
        "--object-store-mib", type=count(64, 2**24), default=1024, help="object store per node"
    )
    up.add_argument("--json", default=None, metavar="FILE", help="write jaxreshard-cluster/1")
    down = actions.add_parser("down", help="stop the Ray nodes, remove namespaces and links")
    down.add_argument("--all", action="store_true", help="every jaxreshard cluster here")
    status = actions.add_parser("status", help="the clusters, their NIC model and counters")
    status.add_argument("--json", default=None, metavar="FILE", help="write the status as JSON")
    measure = actions.add_parser("measure", help="a plain TCP transfer between two hosts")
    measure.add_argument("--src", type=count(0, 63), default=0, help="sending host (0)")
    measure.add_argument("--dst", type=count(0, 63), default=1, help="receiving host (1)")
    measure.add_argument("--mib", type=count(1, 2**16), default=64, help="MiB to send (64)")
    measure.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    for sub, default in (
        (up, DEFAULT_NAME),
        (down, DEFAULT_NAME),
        (status, None),
        (measure, DEFAULT_NAME),
    ):
        sub.add_argument("--name", default=default, help=f"the cluster's name ({default or 'all'})")
    cluster.set_defaults(run=_cluster)
