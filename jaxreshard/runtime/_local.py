"""The local runtime: every stage on this process's devices, one thread per stage."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import Cluster, Plan
from jaxreshard.comm._emulate import LinkEmulator, sleep_until
from jaxreshard.comm._local import execute_local
from jaxreshard.frontend._backward import derive_backward
from jaxreshard.frontend._split import StepGraph
from jaxreshard.pipeline import Schedule
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime._compile import StageCompiler, fusable_segments
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime._executor import Event, PipelineError, StageRunner
from jaxreshard.runtime._layout import PipelineLayout, Transfer, layout_pipeline


@dataclasses.dataclass
class CompiledPipeline:
    """A step compiled for this process's devices."""

    graph: StepGraph
    layout: PipelineLayout
    meshes: list[Mesh]
    cluster: Cluster
    compilers: list[StageCompiler]
    fused: dict[int, int] = dataclasses.field(default_factory=dict)  # stage -> post segment

    @property
    def config(self) -> PipelineConfig:
        return self.layout.config

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

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
) -> CompiledPipeline:
    split = config.weight_delay or config.schedule == "zb_h1"
    compilers = [
        StageCompiler(graph, derive_backward(stage, split=split), meshes[s], config)
        for s, stage in enumerate(graph.loss.stages)
    ]
    layout = layout_pipeline(graph, config, meshes, leaves, cluster, compilers)
    fused = fusable_segments(graph, compilers)
    grad_of = {v: k for k, v in enumerate(graph.grad_outputs[1:])}
    for s, j in fused.items():
        seg = graph.segments[j]
        compilers[s].set_apply(seg.jaxpr, [grad_of.get(v) for v in seg.inputs])
    return CompiledPipeline(graph, layout, meshes, cluster, compilers, fused)


class LocalExecutor:
    """Runs a compiled pipeline on this process's devices (see [Note: pipeline execution])."""

    def __init__(self, compiled: CompiledPipeline):
        self.c = compiled
        self.events: list[Event] = []
        self._record: Callable[[Event], None] | None = None
        self._lock = threading.Condition()
        self._mailbox: dict[tuple[str, int, int, int, int], Future] = {}
        self._failure: BaseException | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=max(8, 4 * compiled.num_stages), thread_name_prefix="jaxreshard-transfer"
        )
        # One long-lived thread per stage, reused every step.
        self._stages = ThreadPoolExecutor(
            max_workers=compiled.num_stages, thread_name_prefix="jaxreshard-stage"
        )
        self.signal_only = False
        self._placeholders: dict[tuple[str, P], Any] = {}
        gbps = compiled.config.emulate_network_gbps
        self._emulator = (
            LinkEmulator(gbps, compiled.cluster.latency_s) if gbps is not None else None
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stages.shutdown(wait=False, cancel_futures=True)

    def _move(self, transfer: Transfer, value: Any, mb: int) -> tuple[Any, float]:
        """Move a value by its plan; return it and when (monotonic clock) the receiver may use
        it: now, or the end of its emulated hops. The receiver, not this transfer thread,
        sleeps until then, so that slow emulated links never hold the thread pool."""

        start = time.perf_counter()
        check_source(transfer, value, self.c.sharding(transfer.src_stage, transfer.src_spec))
        jax.block_until_ready(value)
        dst = self.c.sharding(transfer.dst_stage, transfer.dst_spec)
        ready = 0.0
        if self.signal_only:
            moved = self._placeholder(transfer, dst)
        else:
            moved = execute_local(transfer.plan, value, dst)
            if self._emulator is not None:
                ready = emulated_end(self._emulator, self.c.cluster, transfer.plan)
        jax.block_until_ready(moved)
        if self._record is not None:
            end = time.perf_counter() + max(0.0, ready - time.monotonic())
            self._record(Event.send(transfer, mb, start, end, 0 if self.signal_only else None))
        return moved, ready

    def _placeholder(self, transfer: Transfer, dst: NamedSharding) -> Any:
        """Signal-only mode's stand-in for a transfer's result: zeros already in place, made
        once (see [Note: signal-only bound])."""
        key = (transfer.name, transfer.dst_spec)
        with self._lock:
            value = self._placeholders.get(key)
            if value is None:
                value = self._placeholders[key] = jax.device_put(
                    np.zeros(transfer.shape, transfer.dtype), dst
                )
        return value

    def _send(self, ins: Instruction, value: Any) -> None:
        transfer = self.c.transfers[(ins.kind, ins.tensor, ins.src, ins.dst)]
        future = self._pool.submit(self._move, transfer, value, ins.mb)
        with self._lock:
            self._mailbox[ins.key] = future
            self._lock.notify_all()

    def _recv(self, ins: Instruction) -> Any:
        timeout = self.c.config.timeout_s
        deadline = time.monotonic() + timeout
        with self._lock:
            while ins.key not in self._mailbox:
                if self._failure is not None:
                    raise PipelineError("stopped: another stage failed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(
                        f"stage {ins.dst} waited {timeout:g} s for {ins}; stage {ins.src} never "
                        "sent it"
                    )
                self._lock.wait(min(left, 0.5))
            future = self._mailbox.pop(ins.key)
        try:
            value, ready = future.result(timeout=max(0.001, deadline - time.monotonic()))
            sleep_until(ready)
            return value
        except TimeoutError:
            raise PipelineError(
                f"stage {ins.dst}: the transfer {ins} did not finish within {timeout:g} s"
            ) from None

    def run(
        self,
        params: list[Any],
        batches: list[list[list[Any]]],
        consts: list[list[Any]],
        *,
        record: bool = False,
        signal_only: bool = False,
        apply_inputs: dict[int, list[Any]] | None = None,
    ) -> tuple[list[Any], list[Any], dict[int, list[Any]]]:
        """Run every stage's program; return the loss per micro-batch, the gradient per parameter
        (None where an optimizer segment was fused) and the fused segments' outputs by stage.

        With `record`, every action and transfer is timed into `self.events` (which blocks on
        each action's results, so use it for profiles). With `signal_only`, transfers carry no
        data (see [Note: signal-only bound]): the results are wrong, the timing is the bound.
        """
        self.signal_only = signal_only
        self.events = []
        self._record = self.events.append if record else None
        self._mailbox.clear()
        self._failure = None
        p = self.c.num_stages
        owner = self.c.graph.owner
        accumulators: list[dict[int, Any]] = [{} for _ in range(p)]
        applied: dict[int, list[Any]] = {}
        losses: list[Any] = [None] * self.c.config.num_micro_batches

        def worker(s: int) -> None:
            runner = StageRunner(
                self.c.compilers[s],
                self.c.graph,
                self.c.layout,
                self._send,
                self._recv,
                lambda: self._failure is not None,
                self._record,
            )
            mine = {k: v for k, v in enumerate(params) if owner[k] == s}
            try:
                with jax.set_mesh(self.c.meshes[s]):
                    accumulators[s], out = runner.run(
                        mine, batches[s], consts[s], losses, (apply_inputs or {}).get(s)
                    )
                if out is not None:
                    applied[s] = out
            except BaseException as e:
                with self._lock:
                    if self._failure is None:
                        self._failure = (
                            e
                            if isinstance(e, PipelineError)
                            else PipelineError(f"stage {s} failed: {type(e).__name__}: {e}")
                        )
                        self._failure.__cause__ = e
                    self._lock.notify_all()

        if p == 1:
            worker(0)  # nothing to overlap with: no thread
        else:
            for future in [self._stages.submit(worker, s) for s in range(p)]:
                future.result()
        if self._failure is not None:
            raise self._failure
        grads = [accumulators[owner[k]].get(k) for k in range(len(params))]
        return losses, grads, applied


def check_source(transfer: Transfer, value: Any, planned: Any) -> None:
    """A transfer's plan says which device holds which slice: moving a value laid out otherwise
    would deliver wrong data, so refuse it (an internal error, never silent)."""
    if not value.sharding.is_equivalent_to(planned, len(transfer.shape)):
        raise PipelineError(
            f"{transfer.name}: the value leaves stage {transfer.src_stage} as {value.sharding} but "
            f"its transfer was planned for {planned}; this is a jaxreshard bug, please report it"
        )


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
