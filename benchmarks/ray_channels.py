"""Boundary tensors between two Ray nodes: our actor-call path against Ray Compiled Graphs.

Issue 12 asks whether Ray Compiled Graphs (`ray.dag.InputNode`, `experimental_compile`, shared
memory channels) should carry the per-step action graph of the Ray runtime. This program measures,
on a local Ray cluster of two nodes (one per emulated host, each with its own object store,
as `jaxreshard/runtime/ray/_start.py:_start_local_nodes` makes them; one threaded actor pinned to
each by a custom resource), float32 numpy arrays of 64 KiB to 32 MiB moved from actor A to
actor B by:

- `actor_put_ref` (ours today, `ObjectStoreTransport`): A `ray.put`s the array and calls
  `B.deliver.remote(key, [ref])`; B's waiting thread wakes, `ray.get`s it and copies it into a
  warm destination buffer.
- `actor_arg`: the array itself is the argument of the deliver call. Ray inlines arguments up
  to 100 KiB in the call; larger ones it puts into the object store itself, and B's worker pulls
  them before the method runs. `actor_arg_inline_<limit>` repeats it on a cluster started with
  that limit (`max_direct_call_object_size`) raised to about 1 MiB.
- `actor_socket`: the same actors, threads and mailbox, but the bytes go over a TCP connection
  that A and B opened to each other at start (a header and the raw buffer; a reader thread in B
  reads it into a staging buffer, the waiting thread copies it into the destination).
- `compiled_graph`: an edge `A.cg_produce -> B.cg_consume` of a compiled DAG (B copies into a
  warm buffer too).

Latency is one way, from A's start (before `ray.put` / before `cg_produce` returns) to B having
the array in its buffer, one transfer at a time (both actors read the machine's one monotonic
clock); throughput is a stream of N transfers with nothing waited for between them. Then one step
of a 2-stage 1F1B schedule with 4 micro-batches (~1 ms of numpy "compute" per F or B action) runs
through the actor paths, a compiled DAG of per-micro-batch nodes and, for reference, two threads
of this process. Probes record what compiled graphs do on application errors, `ray.get`
timeouts, actor death and teardown, whether `with_tensor_transport` works without torch, and
whether `ray.put(x, _owner=B)` (the receiver owning the object) still exists. Each part runs in
its own guarded section: a part that fails, or kills a node, is recorded and the cluster is
replaced. Prints tables; writes JSON with --out.

    python benchmarks/ray_channels.py --out benchmarks/results/ray_channels_2026-11-23.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import pickle
import platform
import queue
import re
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

SIZES = (64 * 2**10, 2**20, 8 * 2**20, 32 * 2**20)
ACTOR_MODES = ("actor_put_ref", "actor_arg", "actor_socket")
WAIT_S = 60.0  # every wait in this program ends by then, naming what it waited for
ACTION_S = 1e-3  # simulated compute per F or B action

# The 1F1B order of a 2-stage pipeline with 4 micro-batches, per stage.
ONE_F_ONE_B = {
    0: (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)),
    1: (("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)),
}
NUM_MICRO_BATCHES = 4
_HEADER = "!IQ"  # the socket path: key length, array bytes (a str: actors pickle by value)


def _human(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 2**10} KiB"


def _spread(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {
        "median": statistics.median(ordered),
        "p25": q[0],
        "p75": q[2],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


class Compute:
    """About `seconds` of numpy work in one ufunc call, which releases the GIL for its whole
    length as an XLA computation does (many short calls would serialise threads on the GIL).
    float64 `sin` costs ~10 ns an element here, so the arrays stay in cache."""

    def __init__(self, seconds: float = ACTION_S):
        size = 1 << 12
        for _ in range(3):  # converge on the size that takes `seconds`
            self._src = np.random.default_rng(1).random(size)
            self._dst = np.empty_like(self._src)
            took = statistics.median(self() for _ in range(9))
            size = max(1 << 10, round(size * seconds / took))
        self._src = np.random.default_rng(1).random(size)
        self._dst = np.empty_like(self._src)

    def __call__(self) -> float:
        start = time.perf_counter()
        np.sin(self._src, out=self._dst)
        return time.perf_counter() - start


class Host:
    """A host actor reduced to its transfer path: threaded, with a mailbox like
    `ObjectStoreTransport`'s, cached source arrays and warm destination buffers."""

    def __init__(self, index: int):
        self.index = index
        self.peer: Any = None
        self._cond = threading.Condition()
        self._mailbox: dict[Any, tuple[str, Any]] = {}
        self._acks: set[Any] = set()
        self._arrays: dict[int, np.ndarray] = {}
        self._buffers: dict[int, np.ndarray] = {}
        self._compute = Compute()
        self._pool = ThreadPoolExecutor(1)  # sends leave the stage thread, as in the runtime
        self._staging: dict[int, list[np.ndarray]] = {}  # free receive buffers of the socket path

    # -- setup ---------------------------------------------------------------------------------

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def set_peer(self, peer: Any) -> None:
        self.peer = peer

    def ping(self) -> int:
        return self.index

    def pid(self) -> int:
        return os.getpid()

    def collect(self) -> int:
        return gc.collect()

    def put_for_peer(self) -> str:
        """Try `ray.put` with the receiver as the object's owner."""
        try:
            ray.get(ray.put(self._array(2**16), _owner=self.peer), timeout=WAIT_S)
            return "ok"
        except Exception as e:
            return f"{type(e).__name__}: {_first_line(e)}"

    def _array(self, nbytes: int) -> np.ndarray:
        if nbytes not in self._arrays:
            self._arrays[nbytes] = np.random.default_rng(nbytes).random(nbytes // 4, np.float32)
        return self._arrays[nbytes]

    def _buffer(self, nbytes: int) -> np.ndarray:
        if nbytes not in self._buffers:
            self._buffers[nbytes] = np.zeros(nbytes // 4, np.float32)
        return self._buffers[nbytes]

    # -- the actor-call paths ------------------------------------------------------------------

    def deliver(self, key: Any, boxed: list[Any]) -> None:
        """A peer hands over a reference (the runtime's `HostActor.deliver`)."""
        with self._cond:
            self._mailbox[key] = ("ref", boxed[0])
            self._cond.notify_all()

    def deliver_value(self, key: Any, value: np.ndarray) -> None:
        """A peer hands over the array itself, as the call's argument."""
        with self._cond:
            self._mailbox[key] = ("value", value)
            self._cond.notify_all()

    def ack(self, key: Any) -> None:
        with self._cond:
            self._acks.add(key)
            self._cond.notify_all()

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"host {self.index} waited {WAIT_S:g} s for {what}")
                self._cond.wait(left)

    def _send(self, key: Any, x: np.ndarray, mode: str) -> None:
        if mode == "actor_put_ref":
            self.peer.deliver.remote(key, [ray.put(x)])
        elif mode == "actor_arg":
            self.peer.deliver_value.remote(key, x)
        elif mode == "actor_socket":
            self._socket_send(key, x)
        else:
            raise ValueError(f"mode={mode!r}: choose one of {ACTOR_MODES}")

    def _receive(self, key: Any, into: np.ndarray) -> None:
        self._wait_for(lambda: key in self._mailbox, f"transfer {key}")
        with self._cond:
            kind, item = self._mailbox.pop(key)
        value = ray.get(item, timeout=WAIT_S) if kind == "ref" else item
        np.copyto(into, value)
        if kind == "staged":
            with self._cond:
                self._staging.setdefault(item.nbytes, []).append(item)

    # -- bytes over a TCP connection between the two actors (path 3) ---------------------------
    # The actors stay as they are (threads, mailbox, deadlines); only the bytes bypass Ray: a
    # header (key, size) and the raw buffer, read by a thread straight into a staging buffer.

    def listen(self) -> tuple[str, int]:
        server = socket.create_server((ray.util.get_node_ip_address(), 0))

        def accept() -> None:
            while True:
                conn, _ = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._socket_reader, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return server.getsockname()[:2]

    def connect(self, address: tuple[str, int]) -> None:
        self._socket = socket.create_connection(tuple(address), timeout=WAIT_S)
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socket_lock = threading.Lock()

    def _socket_send(self, key: Any, x: np.ndarray) -> None:
        name = pickle.dumps(key)
        with self._socket_lock:
            self._socket.sendall(struct.pack(_HEADER, len(name), x.nbytes) + name)
            self._socket.sendall(memoryview(x).cast("B"))

    def _socket_reader(self, conn: socket.socket) -> None:
        def read_into(view: memoryview) -> None:
            while view.nbytes:
                n = conn.recv_into(view)
                if not n:
                    raise ConnectionError("peer closed the connection")
                view = view[n:]

        header = bytearray(struct.calcsize(_HEADER))
        while True:
            read_into(memoryview(header))
            name_len, nbytes = struct.unpack(_HEADER, header)
            name = bytearray(name_len)
            read_into(memoryview(name))
            with self._cond:
                free = self._staging.get(nbytes)
                staged = free.pop() if free else np.empty(nbytes // 4, np.float32)
            read_into(memoryview(staged).cast("B"))
            with self._cond:
                self._mailbox[pickle.loads(name)] = ("staged", staged)
                self._cond.notify_all()

    def send_series(
        self, tag: str, count: int, nbytes: int, mode: str, wait_ack: bool
    ) -> list[float]:
        """Send `count` arrays; return each one's start time (before `ray.put`)."""
        x = self._array(nbytes)
        starts = []
        for i in range(count):
            starts.append(time.monotonic())
            self._send((tag, i), x, mode)
            if wait_ack:
                self._wait_for(lambda i=i: (tag, i) in self._acks, f"the ack of {(tag, i)}")
        return starts

    def recv_series(self, tag: str, count: int, nbytes: int, ack: bool) -> list[float]:
        """Receive `count` arrays into a warm buffer; return when each one was there."""
        buffer = self._buffer(nbytes)
        done = []
        for i in range(count):
            self._receive((tag, i), buffer)
            done.append(time.monotonic())
            if ack:
                self.peer.ack.remote((tag, i))
        return done

    def pipe_step(self, stage: int, step: int, nbytes: int, mode: str) -> list[float]:
        """Run this stage's 1F1B actions for one step; return the compute time of each."""
        x, buffer = self._array(nbytes), self._buffer(nbytes)
        computed, sends = [], []
        for kind, mb in ONE_F_ONE_B[stage]:
            if stage == 0 and kind == "F":
                computed.append(self._compute())
                sends.append(self._pool.submit(self._send, (step, "act", mb), x, mode))
            elif stage == 0:  # B: wait for the gradient, then compute
                self._receive((step, "grad", mb), buffer)
                computed.append(self._compute())
            elif kind == "F":  # stage 1: wait for the activation, then compute
                self._receive((step, "act", mb), buffer)
                computed.append(self._compute())
            else:
                computed.append(self._compute())
                sends.append(self._pool.submit(self._send, (step, "grad", mb), x, mode))
        for future in sends:
            future.result(timeout=WAIT_S)
        return computed

    # -- compiled-graph nodes -------------------------------------------------------------------

    def cg_produce(self, request: tuple[int, str]) -> tuple[float, np.ndarray, str]:
        nbytes, probe = request
        return time.monotonic(), self._array(nbytes), probe

    def cg_consume(self, message: tuple[float, np.ndarray, str]) -> tuple[float, float]:
        start, x, probe = message
        if probe == "raise":
            del x, message
            raise ValueError("probe: consume raised on purpose")
        if probe == "sleep":
            time.sleep(2.0)
        if probe == "die":
            os._exit(1)
        np.copyto(self._buffer(x.nbytes), x)
        del x, message  # the array is a view of the channel's buffer: let it go at once
        return start, time.monotonic()

    def cg_forward_first(self, request: tuple[int, int], mb: int) -> np.ndarray:
        self._compute()
        return self._array(request[0])

    def cg_forward_last(self, activation: np.ndarray) -> int:
        np.copyto(self._buffer(activation.nbytes), activation)
        nbytes = activation.nbytes
        del activation
        self._compute()
        return nbytes

    def cg_backward_last(self, nbytes: int) -> np.ndarray:
        self._compute()
        return self._array(nbytes)

    def cg_backward_first(self, gradient: np.ndarray, mb: int) -> int:
        np.copyto(self._buffer(gradient.nbytes), gradient)
        del gradient
        self._compute()
        return mb


# -- the cluster ---------------------------------------------------------------------------------


class LocalCluster:
    """Two Ray nodes on this machine, each with its own object store (as `_start_local_nodes`
    does), and this process connected to them as the driver."""

    def __init__(self, object_store_bytes: int, system_config: dict[str, Any] | None = None):
        from ray.cluster_utils import Cluster

        head: dict[str, Any] = {
            "num_cpus": 1,
            "num_gpus": 0,
            "object_store_memory": object_store_bytes,
            "resources": {"bench_host_0": 1},
            "include_dashboard": False,
        }
        if system_config:
            head["_system_config"] = system_config
        self.nodes = Cluster(initialize_head=True, head_node_args=head)
        try:
            self.nodes.add_node(
                num_cpus=1,
                num_gpus=0,
                object_store_memory=object_store_bytes,
                resources={"bench_host_1": 1},
            )
            self.nodes.wait_for_nodes()
            ray.init(address=self.nodes.address, logging_level=logging.WARNING)
        except BaseException:
            self.close()
            raise

    def dead_nodes(self) -> int:
        return sum(not n["Alive"] for n in ray.nodes())

    def raylet_crashes(self) -> list[str]:
        """The fatal checks in this cluster's raylet logs (a crash takes its node down)."""
        logs = self.nodes.head_node.get_logs_dir_path()
        found = []
        for name in sorted(os.listdir(logs)):
            if name.startswith("raylet") and name.endswith(".out"):
                with open(os.path.join(logs, name), errors="replace") as f:
                    found += [f"{name}: {ln.strip()[:400]}" for ln in f if "Check failed" in ln]
        return found

    def close(self) -> None:
        nodes = [self.nodes.head_node, *self.nodes.worker_nodes]
        _OUR_PIDS.update(
            info.process.pid
            for node in nodes
            if node is not None
            for infos in node.all_processes.values()
            for info in infos
        )
        ray.shutdown()
        self.nodes.shutdown()
        _OUR_PIDS.add(os.getpid())
        _remove_channel_semaphores()


# Compiled graphs' channels make POSIX named semaphores, /dev/shm/sem.{hdr,obj}<pid>-<n>, named
# after the process that made them (a raylet or an actor's worker); processes killed by a forced
# teardown or a crash never unlink theirs. This program removes those of its own processes.
_OUR_PIDS: set[int] = set()
_SEMAPHORES = "/dev/shm"


def _remove_channel_semaphores() -> int:
    deadline = time.monotonic() + 5.0
    gone = {os.getpid()}
    for pid in _OUR_PIDS - gone:
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        if not os.path.exists(f"/proc/{pid}"):
            gone.add(pid)
    removed = 0
    if not os.path.isdir(_SEMAPHORES):
        return removed
    for name in os.listdir(_SEMAPHORES):
        match = re.fullmatch(r"sem\.(?:hdr|obj)(\d+)-\d+", name)
        if match and int(match.group(1)) in gone:
            try:
                os.unlink(os.path.join(_SEMAPHORES, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def make_pair() -> tuple[Any, Any]:
    """Actors A (node 0) and B (node 1), threaded like the runtime's host actors."""
    remote = ray.remote(Host)
    a, b = (
        remote.options(num_cpus=0, max_concurrency=16, resources={f"bench_host_{h}": 0.01}).remote(
            h
        )
        for h in (0, 1)
    )
    ray.get([a.set_peer.remote(b), b.set_peer.remote(a)], timeout=WAIT_S)
    addresses = ray.get([a.listen.remote(), b.listen.remote()], timeout=WAIT_S)
    ray.get([a.connect.remote(addresses[1]), b.connect.remote(addresses[0])], timeout=WAIT_S)
    nodes = ray.get([a.node_id.remote(), b.node_id.remote()], timeout=WAIT_S)
    assert nodes[0] != nodes[1], "A and B must sit on different Ray nodes"
    _OUR_PIDS.update(ray.get([a.pid.remote(), b.pid.remote()], timeout=WAIT_S))
    return a, b


def kill_pair(pair: Sequence[Any]) -> None:
    for actor in pair:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            logging.getLogger(__name__).debug("actor already gone")


# -- point-to-point transfers ----------------------------------------------------------------------


def stream_count(nbytes: int) -> int:
    return 32 if nbytes <= 2**20 else (16 if nbytes <= 8 * 2**20 else 8)


def actor_transfers(a: Any, b: Any, mode: str, nbytes: int, reps: int, repeats: int) -> dict:
    def run(tag: str, count: int, wait_ack: bool) -> tuple[list[float], list[float]]:
        done = b.recv_series.remote(tag, count, nbytes, wait_ack)
        starts = a.send_series.remote(tag, count, nbytes, mode, wait_ack)
        return ray.get(starts, timeout=WAIT_S), ray.get(done, timeout=WAIT_S)

    run(f"{mode}-{nbytes}-warm", 3, True)
    starts, done = run(f"{mode}-{nbytes}-lat", reps, True)
    latency = [(d - s) * 1e3 for s, d in zip(starts, done)]
    rates = []
    count = stream_count(nbytes)
    for r in range(repeats):
        starts, done = run(f"{mode}-{nbytes}-tput{r}", count, False)
        rates.append(count * nbytes / (done[-1] - starts[0]) / 1e9)
    return {"latency_ms": _spread(latency), "throughput_gbps": _spread(rates), "stream": count}


def compiled_transfers(dag: Any, nbytes: int, reps: int, repeats: int) -> dict:
    for _ in range(3):  # warm-up; the first one also grows the channel's buffer to fit
        ray.get(dag.execute((nbytes, "")), timeout=WAIT_S)
    latency = []
    for _ in range(reps):
        start, done = ray.get(dag.execute((nbytes, "")), timeout=WAIT_S)
        latency.append((done - start) * 1e3)
    rates = []
    count = stream_count(nbytes)
    for _ in range(repeats):
        refs = [dag.execute((nbytes, "")) for _ in range(count)]
        marks = [ray.get(ref, timeout=WAIT_S) for ref in refs]
        rates.append(count * nbytes / (marks[-1][1] - marks[0][0]) / 1e9)
    return {"latency_ms": _spread(latency), "throughput_gbps": _spread(rates), "stream": count}


def copy_reference(nbytes: int, reps: int) -> dict:
    """A warm in-process copy of the same array: the floor of any path."""
    x = np.random.default_rng(0).random(nbytes // 4, np.float32)
    y = np.zeros_like(x)
    times = []
    for _ in range(reps + 3):
        start = time.perf_counter()
        np.copyto(y, x)
        times.append(time.perf_counter() - start)
    times = times[3:]
    return {
        "latency_ms": _spread([t * 1e3 for t in times]),
        "throughput_gbps": _spread([nbytes / t / 1e9 for t in times]),
        "stream": 1,
    }


# -- compiled graphs -----------------------------------------------------------------------------


def describe_channels(dag: Any, names: dict[int, str]) -> list[dict]:
    """Each DAG edge's channel classes, read from the compiled DAG's (private) fields."""
    edges = []
    for task in dag.idx_to_task.values():
        node = task.dag_node
        label = names.get(id(node), type(node).__name__)
        for channel in task.output_channels:
            inner = getattr(channel, "_channel_dict", {}) or {}
            edges.append(
                {
                    "from": label,
                    "channel": type(channel).__name__,
                    "inner": sorted({type(c).__name__ for c in inner.values()}),
                }
            )
    return edges


def execution_schedule(dag: Any, labels: dict[tuple[str, int], str]) -> dict[str, list[str]]:
    """The order each actor's loop runs its nodes in (COMPUTE operations only)."""
    out = {}
    for actor, ops in dag.actor_to_execution_schedule.items():
        actor_id = actor._actor_id.hex()
        tasks = dag.actor_to_executable_tasks[actor]
        order = [
            labels.get((actor_id, tasks[op.exec_task_idx].bind_index), op.method_name)
            for op in ops
            if op.type.name == "COMPUTE"
        ]
        out[labels.get((actor_id, -1), actor_id[:8])] = order
    return out


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def teardown(dag: Any, pair: Sequence[Any]) -> dict:
    """Tear a compiled DAG down (forcing after `teardown_timeout`); say which actors had to be
    killed and whether they live on."""
    names = {actor._actor_id.hex(): name for actor, name in zip(pair, "AB")}
    warnings = _Warnings()
    logger = logging.getLogger("ray.dag.compiled_dag_node")
    logger.addHandler(warnings)
    start = time.perf_counter()
    try:
        dag.teardown(kill_actors=True)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {_first_line(e)}"
    finally:
        logger.removeHandler(warnings)
    seconds = time.perf_counter() - start
    stuck = sorted(
        name for actor_id, name in names.items() for m in warnings.messages if actor_id in m
    )
    alive = []
    for actor in pair:
        try:
            ray.get(actor.ping.remote(), timeout=10)
            alive.append(True)
        except Exception:
            alive.append(False)
    return {
        "seconds": seconds,
        "loops_still_running_after_timeout": stuck,
        "actors_alive_after": alive,
        "error": error,
    }


def one_way_dag(a: Any, b: Any) -> tuple[Any, dict[int, str]]:
    from ray.dag import InputNode

    with InputNode() as request:
        produced = a.cg_produce.bind(request)
        consumed = b.cg_consume.bind(produced)
    names = {id(produced): "A.cg_produce", id(consumed): "B.cg_consume"}
    return consumed.experimental_compile(_max_inflight_executions=40), names


def pipeline_dag(a: Any, b: Any) -> tuple[Any, dict[tuple[str, int], str]]:
    """One 1F1B step of 2 stages x 4 micro-batches as a static graph of per-micro-batch nodes.

    Nodes are bound in the schedule's order, so each actor's bind order is its 1F1B order:
    A: F0 F1 B0 F2 B1 F3 B2 B3, B: F0 B0 F1 B1 ... (checked against the compiled schedule).
    """
    from ray.dag import InputNode, MultiOutputNode

    labels: dict[tuple[str, int], str] = {
        (a._actor_id.hex(), -1): "A (stage 0)",
        (b._actor_id.hex(), -1): "B (stage 1)",
    }
    outputs = []

    def label(node: Any, actor: Any, text: str) -> Any:
        labels[(actor._actor_id.hex(), node._get_bind_index())] = text
        return node

    with InputNode() as request:
        activations = {}
        for kind, mb in ONE_F_ONE_B[0]:
            if kind == "F":
                activations[mb] = label(a.cg_forward_first.bind(request, mb), a, f"F{mb}")
                continue
            # B of stage 0 needs stage 1's F and B of the same micro-batch first.
            f1 = label(b.cg_forward_last.bind(activations[mb]), b, f"F{mb}")
            b1 = label(b.cg_backward_last.bind(f1), b, f"B{mb}")
            outputs.append(label(a.cg_backward_first.bind(b1, mb), a, f"B{mb}"))
        dag = MultiOutputNode(outputs)
    return dag.experimental_compile(), labels


# -- pipeline steps -------------------------------------------------------------------------------


def pipeline_actor_path(a: Any, b: Any, nbytes: int, mode: str, steps: int) -> dict:
    times, compute = [], []
    for step in range(steps + 2):
        start = time.perf_counter()
        calls = [
            a.pipe_step.remote(0, step, nbytes, mode),
            b.pipe_step.remote(1, step, nbytes, mode),
        ]
        result = ray.get(calls, timeout=WAIT_S)
        if step >= 2:
            times.append((time.perf_counter() - start) * 1e3)
            compute.extend(t * 1e3 for per_stage in result for t in per_stage)
    return {"step_ms": _spread(times), "compute_ms_per_action": statistics.median(compute)}


def pipeline_compiled(dag: Any, nbytes: int, steps: int) -> dict:
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        ray.get(dag.execute((nbytes, step)), timeout=WAIT_S)
        if step >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return {"step_ms": _spread(times)}


def pipeline_in_process(nbytes: int, steps: int) -> dict:
    """The same step with both stages as threads of this process (queues, copies, compute)."""
    compute = Compute()
    x = np.random.default_rng(0).random(nbytes // 4, np.float32)
    buffers = [np.zeros_like(x), np.zeros_like(x)]
    links: dict[str, queue.Queue] = {"act": queue.Queue(), "grad": queue.Queue()}

    def stage(s: int) -> None:
        for kind, _ in ONE_F_ONE_B[s]:
            if (s, kind) == (0, "B") or (s, kind) == (1, "F"):
                np.copyto(buffers[s], links["grad" if s == 0 else "act"].get(timeout=WAIT_S))
            compute()
            if (s, kind) == (0, "F") or (s, kind) == (1, "B"):
                links["act" if s == 0 else "grad"].put(x)

    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        threads = [threading.Thread(target=stage, args=(s,)) for s in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if step >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return {"step_ms": _spread(times), "compute_ms_per_action": compute() * 1e3}


# -- probes of the compiled graph's failure behaviour ----------------------------------------------


# name: [(label, action, ray.get timeout s)]; action: what B's consume does, or "wait" (2.5 s)
# or "gc" (B runs gc.collect() in an ordinary actor call beside the DAG). B drops the array
# before it raises, yet the edge stays blocked until B's garbage collector runs: something in
# a reference cycle (the exception's traceback, it seems) still holds the channel's buffer.
PROBES = {
    "errors": [
        ("application_error", "raise", 20),
        ("next_execution", "", 5),
        ("gc_in_B", "gc", 0),
        ("next_execution_after_gc", "", 5),
    ],
    "timeout_and_death": [
        ("get_timeout_0.5s_on_a_2s_node", "sleep", 0.5),
        ("wait_2.5s", "wait", 0),
        ("next_execution_after_timeout", "", 5),
        ("actor_B_exits", "die", 30),
    ],
}


def probe_failures(plan: list[tuple[str, str, float]], out: dict[str, Any]) -> None:
    """Run `plan` on a fresh cross-node one-way DAG (64 KiB messages); record each outcome in
    `out` as it comes, so that what happened before a crash is kept."""
    small = 2**16

    def attempt(dag: Any, probe: str, timeout: float) -> str:
        start = time.perf_counter()
        ref = dag.execute((small, probe))
        try:
            ray.get(ref, timeout=timeout)
            outcome = "ok"
        except Exception as e:
            outcome = f"{type(e).__name__}: {_first_line(e)}"
        return f"{outcome} (after {time.perf_counter() - start:.2f} s)"

    pair = make_pair()
    dag, _ = one_way_dag(*pair)
    try:
        ray.get(dag.execute((small, "")), timeout=WAIT_S)
        for label, action, timeout in plan:
            if action == "wait":
                time.sleep(2.5)
            elif action == "gc":
                out[label] = f"collected {ray.get(pair[1].collect.remote(), timeout=WAIT_S)}"
            else:
                out[label] = attempt(dag, action, timeout)
    finally:
        out["teardown"] = teardown(dag, pair)
        kill_pair(pair)


def probe_tensor_transport(out: dict[str, Any]) -> None:
    """`with_tensor_transport` on a numpy edge between CPU actors (what GPU arrays would use)."""
    from ray.dag import InputNode

    pair = make_pair()
    out["ray.put(_owner=receiver)"] = ray.get(pair[0].put_for_peer.remote(), timeout=WAIT_S)
    dag = None
    try:
        for transport in ("shm", "nccl"):
            with InputNode() as request:
                produced = pair[0].cg_produce.bind(request).with_tensor_transport(transport)
                consumed = pair[1].cg_consume.bind(produced)
            try:
                dag = consumed.experimental_compile()
                ray.get(dag.execute((2**16, "")), timeout=20)
                out[transport] = "ok"
            except Exception as e:
                out[transport] = f"{type(e).__name__}: {_first_line(e)}"
            if dag is not None:
                teardown(dag, pair)
                dag = None
    finally:
        kill_pair(pair)


def _first_line(e: BaseException) -> str:
    """The message's first line, and its last one where that differs (a RayTaskError's first
    line names the task, its last one the cause)."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines()]
    lines = [ln for ln in lines if ln.strip("=")]
    if not lines:
        return type(e).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text[:400]


# -- main -----------------------------------------------------------------------------------------


class Sections:
    """Runs the benchmark's parts one after another; a part that fails is recorded, and if a
    node died with it (a raylet crash, say), the cluster is replaced before the next part."""

    def __init__(self, result: dict, system_config: dict[str, Any] | None = None):
        self.result, self.system_config = result, system_config
        self.cluster: LocalCluster | None = None

    def start(self) -> None:
        self.cluster = LocalCluster(1 << 30, self.system_config)

    def __call__(self, name: str, part: Callable[[], None], settle_s: float = 0.0) -> None:
        if self.cluster is None:
            self.start()
        assert self.cluster is not None
        try:
            part()
        except Exception as e:
            self.result["errors"].append(f"{name}: {type(e).__name__}: {_first_line(e)}")
        time.sleep(settle_s)  # a raylet that crashes on a late message does so by then
        crashes, dead = self.cluster.raylet_crashes(), self.cluster.dead_nodes()
        if crashes or dead:
            self.result["node_deaths"].append(
                {"during": name, "dead_nodes": dead, "raylet_checks": crashes}
            )
            self.close()  # the next part gets a fresh cluster

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.close()


def run(args: argparse.Namespace) -> dict:
    from ray.dag import DAGContext

    # Forcing a stuck teardown should not cost 30 s per DAG here (see teardown()).
    DAGContext.get_current().teardown_timeout = args.teardown_timeout
    result: dict[str, Any] = {
        "transfers": [],
        "pipeline": [],
        "compiled_graph": {},
        "errors": [],
        "node_deaths": [],
        "load_average": {"start": os.getloadavg()},
    }
    sizes = [s for s in SIZES if s <= args.max_bytes]
    cg = result["compiled_graph"]

    def actor_paths() -> None:
        for nbytes in sizes:
            result["transfers"].append(
                {"path": "in_process_copy", "bytes": nbytes, **copy_reference(nbytes, args.reps)}
            )
        a, b = make_pair()
        try:
            for nbytes in sizes:
                for mode in ACTOR_MODES:
                    row = actor_transfers(a, b, mode, nbytes, args.reps, args.repeats)
                    result["transfers"].append({"path": mode, "bytes": nbytes, **row})
            for nbytes in args.pipeline_bytes:
                for mode in ACTOR_MODES:
                    row = pipeline_actor_path(a, b, nbytes, mode, args.steps)
                    result["pipeline"].append({"path": mode, "bytes": nbytes, **row})
        finally:
            kill_pair((a, b))
        for nbytes in args.pipeline_bytes:
            row = pipeline_in_process(nbytes, args.steps)
            result["pipeline"].append({"path": "in_process_threads", "bytes": nbytes, **row})

    def compiled_one_way() -> None:
        pair = make_pair()
        start = time.perf_counter()
        dag, names = one_way_dag(*pair)
        cg["compile_s"] = time.perf_counter() - start
        try:
            cg["channels"] = describe_channels(dag, names)
            for nbytes in sizes:
                row = compiled_transfers(dag, nbytes, args.reps, args.repeats)
                result["transfers"].append({"path": "compiled_graph", "bytes": nbytes, **row})
        finally:
            cg["teardown_one_way"] = teardown(dag, pair)
            kill_pair(pair)

    def compiled_pipeline(nbytes: int) -> None:
        pair = make_pair()
        dag, labels = pipeline_dag(*pair)
        try:
            cg.setdefault("schedule", execution_schedule(dag, labels))
            row = pipeline_compiled(dag, nbytes, args.steps)
            result["pipeline"].append({"path": "compiled_graph", "bytes": nbytes, **row})
        finally:
            cg[f"teardown_pipeline_{_human(nbytes)}"] = teardown(dag, pair)
            kill_pair(pair)

    sections = Sections(result)
    try:
        sections("actor paths", actor_paths)
        for name, plan in PROBES.items():
            out = cg.setdefault("failures", {}).setdefault(name, {})
            sections(
                f"compiled graph, probes: {name}", lambda p=plan, o=out: probe_failures(p, o), 1.0
            )
        out = cg.setdefault("tensor_transport", {})
        sections("compiled graph, tensor transport", lambda: probe_tensor_transport(out), 1.0)
        sections("compiled graph, one way", compiled_one_way, 1.0)
        for nbytes in args.pipeline_bytes:
            name = f"compiled graph, pipeline {_human(nbytes)}"
            sections(name, lambda n=nbytes: compiled_pipeline(n), 1.0)
    finally:
        sections.close()

    # Arrays up to ~1 MiB inline in the deliver call: Ray's inlining limit is a cluster-wide
    # setting, fixed when the cluster starts, so this variant needs a cluster of its own.
    limit = args.inline_limit
    inline = Sections(
        result,
        {"max_direct_call_object_size": limit, "task_rpc_inlined_bytes_limit": 4 * limit},
    )

    def inline_path() -> None:
        a, b = make_pair()
        mode, path = "actor_arg", f"actor_arg_inline_{_human(limit)}"
        try:
            for nbytes in [n for n in sizes if n <= 2 * limit]:
                row = actor_transfers(a, b, mode, nbytes, args.reps, args.repeats)
                result["transfers"].append({"path": path, "bytes": nbytes, **row})
            for nbytes in [n for n in args.pipeline_bytes if n < limit]:
                row = pipeline_actor_path(a, b, nbytes, mode, args.steps)
                result["pipeline"].append({"path": path, "bytes": nbytes, **row})
        finally:
            kill_pair((a, b))

    try:
        inline("actor path, inline limit raised", inline_path)
    finally:
        inline.close()
    result["load_average"]["end"] = os.getloadavg()
    return result


def print_tables(result: dict) -> None:
    console = Console(width=160)
    table = Table(
        title="A -> B on two Ray nodes: one-way latency ms, median \\[p25-p75]; "
        "stream throughput GB/s, median \\[min-max] of repeats"
    )
    for column in ("path", "size", "latency ms", "GB/s", "stream"):
        table.add_column(column, justify="right")
    for row in result["transfers"]:
        lat, rate = row["latency_ms"], row["throughput_gbps"]
        table.add_row(
            row["path"],
            _human(row["bytes"]),
            f"{lat['median']:.2f} [{lat['p25']:.2f}-{lat['p75']:.2f}]",
            f"{rate['median']:.2f} [{rate['min']:.2f}-{rate['max']:.2f}]",
            str(row["stream"]),
        )
    console.print(table)
    table = Table(
        title="One 1F1B step, 2 stages x 4 micro-batches, ~1 ms compute per action "
        f"(compute-only bound {(NUM_MICRO_BATCHES + 1) * 2 * ACTION_S * 1e3:.0f} ms): "
        "ms, median \\[p25-p75]"
    )
    for column in ("path", "boundary tensor", "step ms", "compute ms/action"):
        table.add_column(column, justify="right")
    for row in result["pipeline"]:
        s = row["step_ms"]
        compute = row.get("compute_ms_per_action")
        table.add_row(
            row["path"],
            _human(row["bytes"]),
            f"{s['median']:.1f} [{s['p25']:.1f}-{s['p75']:.1f}]",
            "-" if compute is None else f"{compute:.2f}",
        )
    console.print(table)
    cg = result["compiled_graph"]
    console.print(f"compiled graph: compile {cg.get('compile_s', float('nan')):.2f} s")
    for edge in cg.get("channels", []):
        console.print(f"  edge from {edge['from']}: {edge['channel']} {edge['inner']}")
    for actor, order in cg.get("schedule", {}).items():
        console.print(f"  {actor} runs: {' '.join(order)}")
    for key, value in cg.items():
        if key.startswith("teardown"):
            console.print(f"  {key}: {value}")
    for key, value in cg.get("tensor_transport", {}).items():
        console.print(f"  {key}: {value}")
    for group, part in cg.get("failures", {}).items():
        for key, value in part.items():
            console.print(f"  {group}/{key}: {value}")
    for death in result["node_deaths"]:
        console.print(f"node death during {death['during']}: {death['raylet_checks']}")
    for error in result["errors"]:
        console.print(f"error: {error}")
    console.print(f"load average (1, 5, 15 min): {result['load_average']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=15, help="latency samples per size and path")
    parser.add_argument("--repeats", type=int, default=3, help="throughput streams per size")
    parser.add_argument("--steps", type=int, default=10, help="pipeline steps timed per case")
    parser.add_argument("--max-bytes", type=int, default=max(SIZES))
    parser.add_argument("--pipeline-bytes", type=int, nargs="+", default=[2**20, 8 * 2**20])
    parser.add_argument("--teardown-timeout", type=float, default=5.0)
    parser.add_argument(
        "--inline-limit",
        type=int,
        default=2**20 + 2**16,
        help="Ray's max_direct_call_object_size for the inline variant (default 100 KiB)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    result = run(args)
    result.update(
        format="jaxreshard-ray-channels/1",
        when=time.strftime("%Y-%m-%d"),
        machine=platform.node(),
        cpus=os.cpu_count(),
        ray=ray.__version__,
        numpy=np.__version__,
        seconds=time.perf_counter() - started,
        settings={k: v for k, v in vars(args).items() if k != "out"},
    )
    print_tables(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
