"""Pipelines on the Ray runtime: the driver's side (the hosts' side is `ray/_host_pipeline.py`).

[Note: pipelines on Ray]
The driver traces and cuts the step; every host actor that runs stages traces and cuts it too
(the step function travels by value, and a fingerprint proves both traces agree), compiles its
own stages in its `HostEngine` (see [Note: host engine]), and is sent the layout: specs,
transfer plans over the runtime's device ids, and its stages' instruction lists. A step is
`PipelineDriver.run` (see [Note: one step]) over `RayHosts` (`ray/_hosts.py`): one call per host
per step (feeds in; losses, small outputs and array handles out; the call returns before the
step is done, see [Note: asynchronous steps on Ray]). Boundary tensors move between hosts by the
plan's host programs over the runtime's transport, inside a host by a local resharding (see
[Note: boundary tensors]). Parameters, gradients and optimizer state stay in the actors: a host
keeps a step's outputs as the jax.Arrays they are, the optimizer segments whose inputs are all
on their stage's hosts run there within the step call, and the step returns `RemoteArray`s that
the next call hands straight back. Handles the driver drops are freed in one batched message
per host with the next call.

[Note: multi-host stages]
A stage's mesh may cover several hosts: the stages' meshes take the runtime's devices in order,
and one that does not fit in a host takes whole hosts (e.g. (2, 2) on hosts of 2 devices: a
`data` axis across two hosts, a `model` axis inside each). Such a stage is one SPMD program run
jointly by those hosts' actors, multi-controller JAX style: the actors joined one
`jax.distributed` runtime when they started (the coordinator is host 0's actor, at an address
Ray gives; see `HostActor.join`), so each sees every host's devices, builds the stage's mesh
over them, compiles the same executables, and calls them with its own shards; XLA's collectives
inside the stage (gloo over TCP on CPU, NCCL on GPUs) go over the hosts' links. What JAX allows
here (checked on jax 0.10.2 and 0.12): a computation over a subset of the processes, called by
exactly those processes (each stage's hosts call only their stages' programs); one distributed
client per process, made before its first computation. Every host of a stage gets the same step
call and runs the same programs, so their collectives come in the same order. A boundary tensor
between two stages moves by its plan's host programs as any other: each sending host sends the
slices its devices hold (the plan picks which host serves which, broadcasting where several
receiving hosts need the same data, see [Note: cluster model]), each receiving host builds its
shards of the global array. The driver takes a multi-host stage's outputs from its lead host
(array ids are the same on every host of it), and an aux output sharded over its hosts from the
pieces each host sends (`Shards`). Stages of different ranks never share a host unless both fit
in that one host.

[Note: progress deadline]
A step may take as long as it needs while it gets on: the driver's wait for the hosts' step calls
ends only when none of the hosts still busy has made progress for `PipelineConfig.timeout_s`
(plus `STEP_GRACE_S`, so that a host's own deadline, which names the transfer it waited for,
speaks first). Every second the driver asks each busy host for its `StepProgress` (a call beside
the step: the actor is threaded); a host progresses when an action it dispatched has finished (its
outputs are ready), a boundary tensor has arrived, or a post-gradient segment has run. The
progress deadline then fails a hung device or host callback, which nothing inside the hosts can
interrupt, in bounded time, and names each host's last finished action.

[Note: pipeline lifetime]
The host actors keep a pipeline (its traced step, compiled executables, channels with their
sender threads and receive pool, placeholders) until the driver lets it go: `RayPipeline.close`
(`Parallelized` evicting or closing a compiled step), `jaxreshard.shutdown()` (which closes every
pipeline it tracks), or dropping the `RayPipeline`, whose `weakref.finalize` holds only the key,
the hosts and a weak reference to the runtime. `close` tells every host now and waits a few
seconds at most (a dead host, or a runtime already shut down, is skipped); the finalizer may run
at any point of any thread, so it only queues the drop for the runtime's drop thread, and at
interpreter exit it does nothing (the actors go with Ray). A host drops it in
`HostActor.pipeline_drop`: a step still running fails, the channels close and their threads end,
and the executables, including the post-gradient segments' (jitted per pipeline for this), go.
Arrays a step kept for the driver's `RemoteArray`s (parameters, optimizer state) stay until those
handles are freed: they outlive the pipeline, and a step compiled again takes them.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import VirtualSharding
from jaxreshard.frontend._split import StepGraph
from jaxreshard.frontend._trace import fingerprint
from jaxreshard.runtime._config import PipelineConfig
from jaxreshard.runtime.driver._driver import PipelineDriver
from jaxreshard.runtime.driver._lifetime import track_pipeline
from jaxreshard.runtime.engine._watch import StepWatch
from jaxreshard.runtime.ray._hosts import RayHosts
from jaxreshard.runtime.ray._nccl_order import check_channel_order, nccl_programs
from jaxreshard.runtime.ray._placement import (
    COMPILE_WAIT_S,
    _RemoteCompiler,
    stage_placement,
    warn_distributed_cost,
)
from jaxreshard.runtime.ray._remote import RemoteArray
from jaxreshard.runtime.ray._step_wire import tree_skeleton
from jaxreshard.runtime.step._fusion import fusable_segments
from jaxreshard.runtime.step._layout import layout_pipeline, pipeline_schedule
from jaxreshard.runtime.step._specs import spec_of

DROP_WAIT_S = 5.0  # how long `RayPipeline.close` waits for the hosts to have dropped it


class RayPipeline(PipelineDriver):
    """A step compiled for the Ray runtime's host actors (see [Note: pipelines on Ray])."""

    def __init__(
        self,
        runtime: Any,
        fun: Callable[..., Any],
        config: PipelineConfig,
        graph: StepGraph,
        in_tree: Any,
        leaves: Sequence[Any],
        batch_leaves: Sequence[int],
        input_specs: Sequence[P] | None,
        static: dict[int, Any] | None = None,
        recorded: bool = False,
    ):
        self.runtime, self.config, self.graph = runtime, config, graph
        key = f"pipeline-{uuid.uuid4().hex[:8]}"
        p = graph.num_stages
        schedule = pipeline_schedule(config, p, graph.forward_only)
        rank_meshes, hosts_of_rank = stage_placement(runtime, config, schedule.num_stages)
        warn_distributed_cost(runtime, config.mesh_shapes(schedule.num_stages), hosts_of_rank)
        # Stages (chunks) run on the mesh the schedule places them on.
        meshes = [rank_meshes[schedule.rank_of(c)] for c in range(p)]
        hosts_of_stage = {c: hosts_of_rank[schedule.rank_of(c)] for c in range(p)}
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        stages_of: dict[int, dict[int, Any]] = {}
        for s, hs in hosts_of_stage.items():
            grid = np.vectorize(lambda d: d.id)(meshes[s].devices)
            for h in hs:
                stages_of.setdefault(h, {})[s] = grid.tolist()
        payload = _by_value(fun, static or {}, in_tree, avals)
        hosts = RayHosts(runtime, key, graph, config, meshes, hosts_of_stage)
        self.hosts = sorted(stages_of)  # the hosts that run its stages
        # The hosts keep the pipeline until the driver closes it: `close`, `jaxreshard.shutdown()`
        # or dropping it (see [Note: pipeline lifetime]). (No reference to `self` in here.)
        runtime.start_dropper()
        self._finalizer = weakref.finalize(
            self, _drop_on_hosts, weakref.ref(runtime), key, tuple(self.hosts), hosts.watch
        )
        self._finalizer.atexit = False  # at exit, the actors go with Ray
        track_pipeline(self)
        try:
            prints = runtime._wait(
                {
                    h: runtime.actors[h].pipeline_prepare.remote(
                        key,
                        payload,
                        config,
                        avals,
                        list(batch_leaves),
                        input_specs,
                        stages,
                        list(graph.donated),
                    )
                    for h, stages in stages_of.items()
                },
                "tracing the step on the hosts",
                COMPILE_WAIT_S,
            )
            mine = fingerprint(graph)
            for h, theirs in prints.items():
                if theirs != mine:
                    raise RuntimeError(
                        f"host {h} traced the step differently from the driver; the step must "
                        "be a pure function of its arguments (same JAX version on every host)"
                    )
            compilers = [_RemoteCompiler(runtime, hosts_of_stage[s], key, s) for s in range(p)]
            fused: dict[int, int] = {}  # as each host fuses its own stages' optimizers
            for stages in stages_of.values():
                fused.update(fusable_segments(graph, list(stages), config))
            layout = layout_pipeline(
                graph, config, schedule, meshes, leaves, runtime.cluster, compilers, fused,
                recorded,
            )  # fmt: skip
            hosts.layout = layout
            if hosts.transport == "nccl":
                check_channel_order(layout)
                for channel, programs in nccl_programs(layout, hosts_of_stage):
                    runtime._ensure_communicators(programs, channel)
            leaf_specs = [_leaf_spec(x) for x in leaves]
            hosts_fused = runtime._wait(
                {
                    h: runtime.actors[h].pipeline_set_layout.remote(
                        key, layout, hosts_of_stage, hosts.transport, leaf_specs
                    )
                    for h in stages_of
                },
                "sending the layout (the hosts compile their optimizer segments)",
                COMPILE_WAIT_S,
            )
            theirs = {s: j for per_host in hosts_fused.values() for s, j in per_host.items()}
            assert theirs == fused, (theirs, fused)
        except BaseException:
            self.close()  # what the hosts made of it so far
            raise
        super().__init__(graph, layout, fused, hosts)
        self.key = key
        self.meshes = meshes
        self.hosts_of_stage = hosts_of_stage
        self.transport = hosts.transport

    def close(self) -> None:
        """Have the host actors drop the pipeline now (its threads end; its executables and
        buffers go), once the steps still running have finished (each within its progress
        deadline: their outputs stay valid), waiting a few seconds at most for the hosts (see
        [Note: pipeline lifetime]). Dropping the pipeline, or `jaxreshard.shutdown()`, does it
        too; a closed pipeline runs no more steps. Idempotent; never raises."""
        processes = getattr(self, "processes", None)
        if processes is not None:
            processes.watch.drain(None)
        detached = self._finalizer.detach()
        if detached is not None:
            runtime_ref, key, hosts, watch = detached[2]
            _drop_on_hosts(runtime_ref, key, hosts, watch, wait_s=DROP_WAIT_S)

    @property
    def closed(self) -> bool:
        """Whether the pipeline was closed, or its runtime shut down (its actors gone)."""
        return not self._finalizer.alive or not self.runtime.is_alive

    def sharding(self, s: int, spec: P) -> VirtualSharding:
        return VirtualSharding(self.meshes[s], spec)

    def run(
        self, leaves: Sequence[Any], *, record: bool = False, signal_only: bool = False
    ) -> list[Any]:
        if self.closed:
            raise RuntimeError(
                f"pipeline {self.key} was closed (close(), jaxreshard.shutdown(), or its runtime "
                "was shut down); a parallelized step compiles again at its next call"
            )
        return super().run(leaves, record=record, signal_only=signal_only)


def _leaf_spec(x: Any) -> P | None:
    """An argument leaf's spec as the hosts will hold it (None: host data)."""
    if isinstance(x, RemoteArray | jax.Array):
        return spec_of(x.sharding)
    return None


def _drop_on_hosts(
    runtime_ref: Any,
    key: str,
    hosts: tuple[int, ...],
    watch: StepWatch,
    wait_s: float | None = None,
) -> None:
    """A `RayPipeline`'s finalizer (and `close`, after the steps in flight finished): the
    driver's watch thread ends, and the hosts drop pipeline `key`. From the finalizer (`wait_s`
    None) only a message is queued (it may run at any point of any thread): the runtime's drop
    thread lets the steps still running finish first, so that their outputs stay valid."""
    runtime = runtime_ref()
    if runtime is None:
        watch.close(join_s=wait_s)
        return
    runtime.steps_sent.pop(key, None)
    if wait_s is not None:
        watch.close(join_s=wait_s)
    with contextlib.suppress(Exception):  # nothing may raise from a finalizer
        runtime.drop_pipeline(key, hosts, wait_s, watch=None if wait_s is not None else watch)


_INSTALLED = ("jaxreshard", "jax", "jaxlib", "numpy")  # the hosts import these packages themselves


def _by_value(
    fun: Callable[..., Any],
    static: dict[int, Any],
    in_tree: Any = None,
    avals: Sequence[Any] = (),
) -> bytes:
    """Pickle the step, its static leaves and the structure of its arguments (`in_tree`, whose
    array leaves are `avals`; see `tree_skeleton`) so that host actors can run it even if its module
    is not installed (a script, a test file, an example): its module travels by value. Modules
    it imports travel by reference: the hosts must be able to import them; those marked
    `__jaxreshard_by_value__` (a model file `jaxreshard profile` imported, under a name no
    other process has) travel by value too."""
    from ray import cloudpickle

    from jaxreshard._tree_wire import dumps

    name = getattr(fun, "__module__", "") or ""
    module = sys.modules.get(name)
    already = set(cloudpickle.list_registry_pickle_by_value())
    marked: list[Any] = []  # (registered here, unregistered when done)
    for key, m in list(sys.modules.items()):
        try:  # (the module's own dict: a lazily loaded module stays unloaded)
            flag = object.__getattribute__(m, "__dict__").get("__jaxreshard_by_value__")
        except (AttributeError, TypeError):
            continue
        if flag is not True or key != getattr(m, "__name__", None) or key in already:
            continue
        try:
            cloudpickle.register_pickle_by_value(m)
        except (ValueError, TypeError) as e:
            warnings.warn(
                f"the model module {key!r} cannot travel to the Ray hosts by value "
                f"({type(e).__name__}: {e}); it is pickled by reference, and no host can "
                "import it by that name",
                stacklevel=3,
            )
            continue
        marked.append(m)
        already.add(key)
    registered = False
    if (
        module is not None
        and name not in already
        and name != "__main__"
        and name.split(".")[0] not in _INSTALLED
    ):
        try:
            cloudpickle.register_pickle_by_value(module)
            registered = True
        except (ValueError, TypeError) as e:
            warnings.warn(
                f"the step's module {name!r} cannot travel to the Ray hosts by value "
                f"({type(e).__name__}: {e}); it is pickled by reference, so every host must be "
                f"able to import {name!r} (install it there, or define the step in a module "
                "imported with an `import` statement)",
                stacklevel=3,
            )
    try:
        return dumps((fun, static, tree_skeleton(in_tree, avals, static)))
    except Exception as e:
        raise TypeError(
            f"the step or one of its static (non-array) argument leaves cannot be pickled for the "
            f"Ray host actors: {type(e).__name__}: {e}; pass such values as arrays or close over "
            "them in a function defined at module level"
        ) from e
    finally:
        if registered:
            cloudpickle.unregister_pickle_by_value(module)
        for m in marked:
            cloudpickle.unregister_pickle_by_value(m)
