"""Linux network namespaces, a bridge, veth pairs and `tc` shaping, by the `ip`/`tc` commands.

[Note: emulated network]
An emulated host is a network namespace `jrs-<cluster>-h<i>` whose only interface (`eth0`) is
one end of a veth pair; the other end, `jrs-<cluster>-h<i>` in the root namespace, is a port of
the bridge `jrs-<cluster>-br`. The root namespace holds the bridge's own address (`.1`), so a
driver process here reaches every host; the namespaces have no default route, so nothing in them
can reach any address but the bridge's /24. A host's NIC is shaped in both directions by a token
bucket (`tbf`) at the NIC rate: on `eth0` inside the namespace (everything the host sends) and on
the bridge-side end (everything it receives), so each host's total send and total receive are
each limited, full duplex, as the cluster model assumes. An optional one-way delay is a `netem`
qdisc above the sending side's token bucket (so a message between two hosts is delayed once).

Everything this module makes carries the prefix `jrs-<cluster>-`; it only ever deletes names that
carry it. Why the commands and not pyroute2: see the README's design section ("Emulated cluster").
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

PREFIX = "jrs-"
NAME_RULE = re.compile(r"[a-z][a-z0-9]{0,6}")  # the whole name: use `fullmatch`
SUBNET_BASE = "10.213.0.0/16"  # clusters take one /24 of it each, never routed anywhere
COMMAND_TIMEOUT_S = 30.0

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21


class ClusterUnavailable(RuntimeError):
    """This machine or process cannot make an emulated cluster (privileges or tools missing)."""


def check_name(name: str) -> str:
    """Return `name` if it is a valid cluster name; raise `ValueError` naming the rule."""
    # (`fullmatch`: `re.match` with `$` took "ab\n", since `$` matches before a final newline.)
    if not isinstance(name, str) or not NAME_RULE.fullmatch(name):
        raise ValueError(
            f"cluster name {name!r}: must be 1-7 lowercase letters or digits, starting with a "
            "letter (it becomes part of interface names, which Linux limits to 15 characters), "
            "e.g. --name emu"
        )
    return name


def names(cluster: str) -> tuple[str, str]:
    """The bridge of `cluster` and the prefix every name it owns starts with."""
    return f"{PREFIX}{cluster}-br", f"{PREFIX}{cluster}-"


def host_names(cluster: str, node: str) -> tuple[str, str]:
    """(network namespace, bridge-side veth) of node `node` (`head` or `h<i>`)."""
    link = f"{PREFIX}{cluster}-{'hd' if node == 'head' else node}"
    return f"{PREFIX}{cluster}-{node}", link


# -- preflight -----------------------------------------------------------------------------------


def missing_requirements() -> str | None:
    """One paragraph saying exactly what this process lacks to build a cluster, or None."""
    problems = []
    tools = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if tools:
        problems.append(
            f"the {' and '.join(f'`{t}`' for t in tools)} command{'s' if len(tools) > 1 else ''} "
            "of iproute2 (not on PATH): install iproute2, e.g. `apt-get install -y iproute2` "
            "(Debian/Ubuntu) or `dnf install -y iproute iproute-tc` (Fedora)"
        )
    caps = _effective_capabilities()
    lacking = [
        f"{name} ({why})"
        for bit, name, why in (
            (_CAP_NET_ADMIN, "CAP_NET_ADMIN", "links, addresses and tc qdiscs"),
            (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN", "`ip netns add` mounts the namespace"),
        )
        if not caps >> bit & 1
    ]
    if lacking:
        problems.append(
            f"the capabilit{'ies' if len(lacking) > 1 else 'y'} {' and '.join(lacking)} "
            f"(this process runs as uid {os.getuid()} without them): run as root, e.g. "
            "`sudo jaxreshard cluster up ...`, or in a container started with "
            "`--cap-add NET_ADMIN --cap-add SYS_ADMIN` (or `--privileged`)"
        )
    if not problems:
        return None
    return (
        "An emulated cluster needs network namespaces, veth links and tc qdiscs, and this "
        "machine lacks " + "; and ".join(problems) + ". Nothing was changed."
    )


def _effective_capabilities() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def require() -> None:
    """Raise `ClusterUnavailable` with `missing_requirements()`'s paragraph if anything lacks."""
    problem = missing_requirements()
    if problem:
        raise ClusterUnavailable(problem)


# -- commands ------------------------------------------------------------------------------------


def run(args: Sequence[str], *, check: bool = True, what: str = "") -> str:
    """Run one `ip`/`tc` command; on failure raise naming the command and its error output."""
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"`{' '.join(args)}` did not finish within {COMMAND_TIMEOUT_S:g} s"
            f"{f' ({what})' if what else ''}"
        ) from None
    if check and done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(args)}` failed{f' ({what})' if what else ''}: "
            f"{(done.stderr or done.stdout).strip() or f'exit status {done.returncode}'}"
        )
    return done.stdout


def namespaces(prefix: str) -> list[str]:
    """Network namespaces whose name starts with `prefix` (none where iproute2 is missing:
    nothing of ours can have made one there)."""
    if shutil.which("ip") is None:
        return []
    out = run(["ip", "netns", "list"], check=False)
    return sorted(
        line.split()[0] for line in out.splitlines() if line.split() and line.startswith(prefix)
    )


def links(prefix: str) -> list[str]:
    """Interfaces of the root namespace whose name starts with `prefix` (none without
    iproute2, as `namespaces`)."""
    if shutil.which("ip") is None:
        return []
    out = run(["ip", "-o", "link", "show"], check=False)
    found = []
    for line in out.splitlines():
        parts = line.split(": ", 2)
        if len(parts) >= 2:
            name = parts[1].split("@", 1)[0]
            if name.startswith(prefix):
                found.append(name)
    return sorted(found)


def pids_in(namespace: str) -> list[int]:
    """Processes running in `namespace` (all of them started there by us)."""
    out = run(["ip", "netns", "pids", namespace], check=False)
    return sorted(int(p) for p in out.split() if p.isdigit())


# -- building ------------------------------------------------------------------------------------


def pick_subnet(taken: Sequence[str] = ()) -> ipaddress.IPv4Network:
    """The first /24 of `SUBNET_BASE` that overlaps no route or address of the root namespace
    (and none of `taken`)."""
    used = [ipaddress.ip_network(t) for t in taken]
    for line in run(["ip", "-4", "route", "show", "table", "all"], check=False).splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unicast") and len(line.split()) > 1:
            word = line.split()[1]
        try:
            used.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue  # "default" and the like: no prefix to avoid
    for subnet in list(ipaddress.ip_network(SUBNET_BASE).subnets(new_prefix=24))[1:255]:
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise RuntimeError(f"no free /24 left in {SUBNET_BASE} for another emulated cluster")


def make_bridge(cluster: str, address: str) -> None:
    bridge, _ = names(cluster)
    run(["ip", "link", "add", bridge, "type", "bridge"], what=f"bridge of cluster {cluster}")
    run(["ip", "addr", "add", address, "dev", bridge])
    run(["ip", "link", "set", bridge, "up"])


@dataclasses.dataclass(frozen=True)
class Shaping:
    """One NIC's model: rate per direction (GB/s, 1e9 bytes) and one-way delay (ms)."""

    gbytes_per_s: float | None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        rate = self.gbytes_per_s
        # tc takes whole bits per second (a kbit/s at the least) and whole microseconds.
        if rate is not None and not (isinstance(rate, (int, float)) and 1e-5 <= rate <= 1e4):
            raise ValueError(
                f"--nic-gbps {rate!r}: must be a number of GB/s from 1e-05 (10 kB/s) to 10000"
            )
        delay = self.delay_ms
        if not (isinstance(delay, (int, float)) and 0 <= delay <= 1e5):
            raise ValueError(f"--latency-ms {delay!r}: must be a number of ms from 0 to 100000")


def make_host(cluster: str, node: str, address: str, shaping: Shaping) -> None:
    """Namespace + veth pair on the bridge + addresses + shaping, for node `node`."""
    bridge, _ = names(cluster)
    netns, link = host_names(cluster, node)
    run(["ip", "netns", "add", netns], what=f"namespace of {node}")
    run(["ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns])
    run(["ip", "link", "set", link, "master", bridge, "up"])
    inside = ["ip", "-n", netns]
    run([*inside, "addr", "add", address, "dev", "eth0"])
    run([*inside, "link", "set", "eth0", "up"])
    run([*inside, "link", "set", "lo", "up"])
    if shaping.gbytes_per_s is not None:
        # The host receives through the bridge-side end; it sends through its own eth0.
        _shape(["tc"], link, shaping.gbytes_per_s, 0.0)
        _shape(["tc", "-n", netns], "eth0", shaping.gbytes_per_s, shaping.delay_ms)
    elif shaping.delay_ms:
        _delay(["tc", "-n", netns], "eth0", shaping.delay_ms, None, "root")


def _shape(tc: list[str], dev: str, gbytes_per_s: float, delay_ms: float) -> None:
    bytes_per_s = gbytes_per_s * 1e9
    # A bucket of 2 ms of traffic (at least 128 KiB, so GSO packets of 64 KiB pass whole) and a
    # queue of 50 ms: TCP keeps the link busy without a long standing queue.
    burst = max(128 * 1024, int(bytes_per_s * 0.002))
    tbf = ["tbf", "rate", f"{int(bytes_per_s * 8)}bit", "burst", str(burst), "latency", "50ms"]
    if delay_ms:
        _delay(tc, dev, delay_ms, bytes_per_s, "root handle 1:")
        run([*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
    else:
        run([*tc, "qdisc", "add", "dev", dev, "root", *tbf])


def _delay(tc: list[str], dev: str, delay_ms: float, bytes_per_s: float | None, where: str) -> None:
    # netem holds a delay's worth of packets: room for twice the bandwidth-delay product.
    packets = 10_000 if bytes_per_s is None else int(2 * bytes_per_s * delay_ms / 1e3 / 1500)
    netem = ["netem", "delay", f"{delay_ms:g}ms", "limit", str(max(10_000, packets))]
    try:
        run([*tc, "qdisc", "add", "dev", dev, *where.split(), *netem])
    except RuntimeError as e:
        if "unknown" not in str(e):
            raise
        raise ClusterUnavailable(
            f"--latency-ms {delay_ms:g} needs the netem qdisc, which this kernel lacks "
            "(CONFIG_NET_SCH_NETEM; where it is a module, `modprobe sch_netem` loads it). "
            "Run without --latency-ms, or on a kernel with netem."
        ) from None


def qdisc_stats(cluster: str, node: str) -> dict[str, int]:
    """Bytes and drops through a host's two token buckets (`sent`: host egress)."""
    netns, link = host_names(cluster, node)
    out = {}
    for key, tc in (
        ("sent", ["tc", "-n", netns, "-s", "qdisc", "show", "dev", "eth0"]),
        ("received", ["tc", "-s", "qdisc", "show", "dev", link]),
    ):
        text = run(tc, check=False)
        sent = re.findall(r"Sent (\d+) bytes .*?dropped (\d+)", text)
        if sent:
            out[f"{key}_bytes"] = max(int(b) for b, _ in sent)
            out[f"{key}_dropped"] = sum(int(d) for _, d in sent)
    return out


# -- tearing down --------------------------------------------------------------------------------


def stop_processes(find: Callable[[], list[int]], timeout_s: float = 10.0) -> list[int]:
    """SIGTERM every process `find()` lists, SIGKILL what is left after `timeout_s`; return the
    pids that would not die (normally none)."""
    pids = find()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = [p for p in find() if _alive(p)]
            if not pids:
                return []
            time.sleep(0.1)
    return pids


def processes_under(folder: str) -> list[int]:
    """Processes of this (root) namespace that a Ray node with temp dir `folder` started: Ray's
    processes whose command line names `folder`, and all their descendants (Ray's agents rename
    themselves)."""
    parents: dict[int, int] = {}
    roots = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
            if folder.encode() in command and b"/ray/" in command:
                roots.add(pid)
            with open(f"/proc/{pid}/stat") as f:
                parents[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(roots), set(roots)
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return sorted(p for p in found if p != os.getpid())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # zombies are gone already
    except OSError:
        return False


def teardown(cluster: str) -> dict[str, list[str]]:
    """Stop every process in `cluster`'s namespaces, delete the namespaces and every link of
    the cluster (qdiscs go with their links); return what was removed. Idempotent."""
    _, prefix = names(cluster)
    removed: dict[str, list[str]] = {"namespaces": [], "links": [], "stuck_pids": []}
    for netns in namespaces(prefix):
        stuck = stop_processes(lambda netns=netns: pids_in(netns))
        removed["stuck_pids"] += [str(p) for p in stuck]
        run(["ip", "netns", "del", netns], check=False)
        removed["namespaces"].append(netns)
    for link in links(prefix):  # veth ends whose namespace is gone already went with it
        run(["ip", "link", "del", link], check=False)
        removed["links"].append(link)
    return removed
