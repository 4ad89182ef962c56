"""A plain TCP transfer between two emulated hosts: what their shaped link really carries.

`measure_tcp` starts a receiver in one host's namespace and a sender in another's (this module
run with `ip netns exec ... python -m jaxreshard.cluster._tcp`); the receiver times the bytes
from the connection to the last byte and prints the result as JSON.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

_BLOCK = 1 << 20


def measure_tcp(
    cluster: Any, src: int = 0, dst: int = 1, nbytes: int = 16 * 2**20, timeout_s: float = 120.0
) -> dict[str, float]:
    """Send `nbytes` over TCP from host `src` to host `dst` of `cluster` (an `EmulatedCluster`);
    return `{"bytes", "seconds", "gbytes_per_s", "of_nic"}` as the receiver measured them."""
    hosts = cluster.hosts
    for flag, h in (("src", src), ("dst", dst)):
        if not 0 <= h < len(hosts):
            raise ValueError(f"measure_tcp({flag}={h}): the cluster has hosts 0..{len(hosts) - 1}")
    if src == dst:
        raise ValueError(f"measure_tcp(src={src}, dst={dst}): pick two different hosts")
    here = [sys.executable, "-m", "jaxreshard.cluster._tcp"]
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", hosts[dst].netns, *here, "recv", hosts[dst].ip, str(nbytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = receiver.stdout.readline() if receiver.stdout else ""
        if not line.startswith("port "):
            raise RuntimeError(f"TCP receiver on {hosts[dst].name} did not start: {line!r}")
        port = line.split()[1]
        sender = [*here, "send", hosts[dst].ip, port, str(nbytes)]
        subprocess.run(
            ["ip", "netns", "exec", hosts[src].netns, *sender],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        out, err = receiver.communicate(timeout=timeout_s)
    except BaseException:
        receiver.kill()
        receiver.wait()
        raise
    if receiver.returncode != 0:
        raise RuntimeError(f"TCP receiver on {hosts[dst].name} failed: {err.strip()}")
    result = json.loads(out)
    if cluster.nic_gbps:
        result["of_nic"] = result["gbytes_per_s"] / cluster.nic_gbps
    return result


def _receive(ip: str, nbytes: int) -> None:
    with socket.socket() as server:
        server.bind((ip, 0))
        server.listen(1)
        server.settimeout(60.0)
        print(f"port {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60.0)
            buffer = bytearray(_BLOCK)
            got, start = 0, time.perf_counter()
            while got < nbytes:
                n = conn.recv_into(buffer)
                if n == 0:
                    break
                got += n
            seconds = time.perf_counter() - start
            conn.sendall(b"k")
    print(json.dumps({"bytes": got, "seconds": seconds, "gbytes_per_s": got / seconds / 1e9}))


def _send(ip: str, port: int, nbytes: int) -> None:
    block = b"\0" * _BLOCK
    with socket.create_connection((ip, port), timeout=60.0) as conn:
        left = nbytes
        while left > 0:
            conn.sendall(block[: min(left, _BLOCK)])
            left -= _BLOCK
        conn.recv(1)  # the receiver has everything


if __name__ == "__main__":
    mode, address, *rest = sys.argv[1:]
    if mode == "recv":
        _receive(address, int(rest[0]))
    else:
        _send(address, int(rest[0]), int(rest[1]))
