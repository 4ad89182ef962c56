"""The local runtime: every stage on this process's devices.

The driver's side of a step is `PipelineDriver` (`_driver.py`) and the stages' side the
`HostEngine` (`_engine.py`), as on Ray; here the driver calls the one engine directly
(`LocalHosts`), and boundary tensors move inside the process (`LocalChannels`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard._jax_compat import copy_shards, shard_for_shard
from jaxreshard.comm import Cluster, Plan
from jaxreshard.comm._emulate import LinkEmulator
from jaxreshard.comm._local import execute_local
from jaxreshard.frontend._split import StepGraph
from jaxreshard.pipeline import Schedule
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime._api import track_pipeline
from jaxreshard.runtime._compile import StageCompiler
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime._driver import HostResult, Hosts, PipelineDriver, StepCall
from jaxreshard.runtime._engine import (
    HostEngine,
    Placement,
    SegmentCall,
    StepInputs,
    on_mesh,
)
from jaxreshard.runtime._executor import (
    Channels,
    Event,
    check_source,
    is_ready,
    transfer_key,
)
from jaxreshard.runtime._layout import (
    PipelineLayout,
    Transfer,
    layout_pipeline,
    parameter_specs,
    pipeline_schedule,
)
from jaxreshard.runtime._specs import spec_of
from jaxreshard.runtime._threads import wait_ready


@dataclasses.dataclass
class CompiledPipeline:
    """A step compiled for this process's devices: its layout and the engine that runs it."""

    graph: StepGraph
    layout: PipelineLayout
    meshes: list[Mesh]
    cluster: Cluster
    engine: HostEngine

    @property
    def config(self) -> PipelineConfig:
        return self.layout.config

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def compilers(self) -> list[StageCompiler]:
        return [self.engine.compilers[s] for s in range(self.num_stages)]

    @property
    def fused(self) -> dict[int, int]:
        return self.engine.fused

    @property
    def transfers(self) -> dict[tuple[str, int, int, int], Transfer]:
        return self.layout.transfers

    @property
    def schedule(self) -> Schedule:
        return self.layout.schedule

    @property
    def programs(self) -> tuple[tuple[Instruction, ...], ...]:
        return self.layout.programs

    def sharding(self, s: int, spec: P) -> NamedSharding:
        return NamedSharding(self.meshes[s], spec)


def compile_local(
    graph: StepGraph,
    config: PipelineConfig,
    meshes: list[Mesh],
    leaves: Sequence[Any],
    cluster: Cluster,
    recorded: bool = False,
) -> CompiledPipeline:
    """Compile a cut step for this process's devices: `meshes` has one mesh per rank; every
    stage (chunk) compiles on the mesh the schedule places it on (up front, the executables
    a step calls; a `recorded` one's for a profile)."""
    schedule = pipeline_schedule(config, graph.num_stages, graph.forward_only)
    meshes = [meshes[schedule.rank_of(c)] for c in range(graph.num_stages)]
    engine = HostEngine(graph, config, dict(enumerate(meshes)))
    # The optimizer segments compile beside the stages (see [Note: segment executables]).
    specs = parameter_specs(graph, leaves, [dict(mesh.shape) for mesh in meshes])
    leaf_specs = [spec_of(x.sharding) if isinstance(x, jax.Array) else None for x in leaves]
    post = threading.Thread(
        target=engine.warm_segments,
        args=(specs, leaf_specs),
        name="jaxreshard-compile-post",
        daemon=True,
    )
    post.start()
    try:
        layout = layout_pipeline(
            graph,
            config,
            schedule,
            meshes,
            leaves,
            cluster,
            engine.compilers,
            engine.fused,
            recorded,
        )
    finally:
        post.join()
    return CompiledPipeline(graph, layout, meshes, cluster, engine)


class LocalChannels(Channels):
    """Boundary tensors between stages of this process (see [Note: boundary tensors]).

    A transfer moves in the sending stage's thread, asynchronously, where JAX can make the copy
    without waiting for the value (see [Note: one dispatching thread]): a copy shard for shard
    (`copy_shards`), or a small plan run by device copies; a large plan whose value does not
    exist yet goes to a sender thread, which runs it by the CPU fast path
    (`comm._local.execute_local`) once the value exists. Profiles (`record`) and network
    emulation move everything in sender threads, where a transfer can be timed or delayed."""

    # A plan of at most this many bytes runs by asynchronous device copies when its value is not
    # ready yet (the CPU fast path would wait for it).
    async_bytes = 4 << 20

    def __init__(self, compiled: CompiledPipeline):
        super().__init__(compiled.layout, compiled.config.timeout_s)
        self.c = compiled
        gbps = compiled.config.emulate_network_gbps
        if gbps is None:
            self.inline_bytes = 1 << 20
        self._emulator = (
            LinkEmulator(gbps, compiled.cluster.latency_s) if gbps is not None else None
        )
        self._shardings = {
            key: (
                compiled.sharding(t.src_stage, t.src_spec),
                compiled.sharding(t.dst_stage, t.dst_spec),
            )
            for key, t in compiled.transfers.items()
        }
        self._whole = {
            key: t.plan is not None and shard_for_shard(*self._shardings[key], t.shape)
            for key, t in compiled.transfers.items()
        }

    @property
    def threaded(self) -> bool:
        """Whether transfers (and so the stages) need threads of their own this step."""
        return self.record is not None or self._emulator is not None

    def moves_inline(self, ins: Instruction, transfer: Transfer, value: Any) -> bool:
        if transfer.plan is None:
            return True
        if self.threaded:
            return super().moves_inline(ins, transfer, value)
        return (
            self.signal_only
            or self._whole[transfer_key(ins)]
            or transfer.nbytes <= self.async_bytes
            or (transfer.nbytes <= self.inline_bytes and is_ready(value))
        )

    def _move(self, ins: Instruction, transfer: Transfer, value: Any) -> None:
        src, dst = self._shardings[transfer_key(ins)]
        check_source(transfer, value, src)
        if transfer.plan is None:  # between two chunks of one rank: it stays on the mesh
            self.deliver(ins.key, value if src == dst else jax.device_put(value, dst))
            return
        if not self.threaded:
            if self.signal_only:
                moved = self.placeholder(transfer, dst)
            elif self._whole[transfer_key(ins)]:
                moved = (
                    copy_shards(value, dst) if value.sharding == src else jax.device_put(value, dst)
                )
            elif is_ready(value) or transfer.nbytes > self.async_bytes:
                moved = execute_local(transfer.plan, value, dst)
            else:
                moved = execute_local(transfer.plan, value, dst, path="devices")
            self.deliver(ins.key, moved)
            return
        if not wait_ready(value, self.abandoned):  # (polling: see [Note: threads at exit])
            return
        start = time.perf_counter()
        ready = 0.0
        if self.signal_only:
            moved = self.placeholder(transfer, dst)
        else:
            moved = execute_local(transfer.plan, value, dst)
            if self._emulator is not None:
                # The receiver, not this thread, sleeps until the emulated hops end.
                ready = emulated_end(self._emulator, self.c.cluster, transfer.plan)
        if self.record is not None:
            jax.block_until_ready(moved)  # (our own copy: it ends; a poll would blur its time)
            end = time.perf_counter() + max(0.0, ready - time.monotonic())
            nbytes = 0 if self.signal_only else None
            self.record(Event.send(transfer, ins.mb, start, end, nbytes))
        self.deliver(ins.key, moved, ready)


def emulated_end(emulator: LinkEmulator, cluster: Cluster, plan: Plan) -> float:
    """When a plan's cross-host hops would end on the emulated NICs (see
    [Note: network emulation])."""
    host = cluster.host_of
    end = 0.0
    for op in plan.ops:
        if op.kind == "allgather":
            continue
        chain = (op.src_device, *op.dst_devices)
        for a, b in itertools.pairwise(chain):
            if host(a) != host(b):
                end = max(end, emulator.reserve(host(a), host(b), op.nbytes)[1])
    return end


class LocalHosts(Hosts):
    """The driver's way to the local runtime's one host: this process, called directly (see
    [Note: one step])."""

    def __init__(self, compiled: CompiledPipeline):
        self.compiled, self.engine = compiled, compiled.engine
        self.hosts_of_stage = {s: (0,) for s in range(compiled.num_stages)}
        g, layout = compiled.graph, compiled.layout
        self._param_shardings = [
            compiled.sharding(g.owner[k], layout.param_specs[k]) for k in range(len(g.params))
        ]
        self._devices = [frozenset(mesh.devices.flat) for mesh in compiled.meshes]

    def params(self, values: Mapping[int, Any]) -> dict[int, Any]:
        placing = Placement()
        placed = {k: placing.put(x, self._param_shardings[k]) for k, x in values.items()}
        return placing.done(placed)

    def pre_inputs(self, leaves: Sequence[Any]) -> list[Any]:
        return list(leaves)

    def pre_place(self, inputs: list[Any]) -> list[Any]:
        """The `pre` part's inputs on one device set: as they are, unless JAX arrays among them
        sit on several (a parameter and an optimizer count on two stages): then all on stage
        0's mesh."""
        # (`device_set` is a plain set, which does not hash.)
        sets = {frozenset(x.sharding.device_set) for x in inputs if isinstance(x, jax.Array)}
        if len(sets) <= 1:
            return inputs
        mesh = self.compiled.meshes[0]
        return [on_mesh(x, mesh, self._devices[0]) for x in inputs]

    def ref(self, value: Any, hosts: Sequence[int], gather: bool = False) -> Any:
        return ("value", value)

    def begin(self, step_id: str) -> None:
        """Before a step: an earlier step's failure is raised now, and at most
        `steps_in_flight` steps stay in flight (see [Note: asynchronous steps])."""
        self.engine.watch.admit(self.compiled.config.steps_in_flight)

    def wait(self) -> None:
        self.engine.watch.wait()

    def call(self, calls: Mapping[int, StepCall]) -> dict[int, HostResult]:
        (call,) = calls.values()
        out = self.engine.step(
            StepInputs(
                call.step_id,
                call.params,
                call.feeds,
                call.consts,
                {s: [x for _, x in items] for s, items in call.apply_inputs.items()},
                [SegmentCall(j, items) for j, items in call.segments],
                call.record,
                call.signal_only,
            ),
            watch=self.engine.watch,
        )
        m = self.compiled.config.num_micro_batches
        results = {
            j: [out.results[(j, mb)] for mb in range(m)] for j in {j for j, _ in out.results}
        }
        return {0: HostResult(out.losses, out.grads, out.applied, out.segments, results,
                              out.events)}  # fmt: skip

    def segment(self, stage: int, index: int, step_id: str, inputs: list[Any]) -> list[Any]:
        return self.engine.segment(index, [x for _, x in inputs])

    def zeros(self, aval: Any, like: Any) -> Any:
        return jax.numpy.zeros_like(like)

    def loss_value(self, loss: Any, aval: Any) -> Any:
        return loss  # (a jax.Array of the loss's dtype, as jax.jit gives it)


class LocalPipeline(PipelineDriver):
    """A step compiled for this process's devices, and its driver (see [Note: one step]).

    `channels` may give each stage other channels instead of one `LocalChannels` (tests run
    `HostChannels` of several emulated hosts in one process this way; their ranks run in
    threads)."""

    # Closed by an exit hook before JAX tears down: its threads run JAX calls (see
    # [Note: threads at exit]).
    close_at_exit = True

    def __init__(self, compiled: CompiledPipeline, channels: dict[int, Channels] | None = None):
        self.compiled = compiled
        self.engine = compiled.engine
        self.channels_of = channels or dict.fromkeys(
            range(compiled.num_stages), LocalChannels(compiled)
        )
        self.engine.start(compiled.layout, self.channels_of)
        super().__init__(compiled.graph, compiled.layout, self.engine.fused,
                         LocalHosts(compiled))  # fmt: skip
        self.key = "local"
        # Threads and pools end with the pipeline, or at `close`.
        self._finalizer = weakref.finalize(self, self.engine.close)
        track_pipeline(self)

    def close(self) -> None:
        """Free the pipeline's threads now (dropping it, or `jaxreshard.shutdown()`, does
        too); a closed pipeline runs no more steps."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def meshes(self) -> list[Mesh]:
        return self.compiled.meshes

    def sharding(self, s: int, spec: P) -> NamedSharding:
        return self.compiled.sharding(s, spec)
