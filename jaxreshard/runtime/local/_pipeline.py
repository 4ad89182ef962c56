"""The local runtime: every stage on this process's devices.

The driver's side of a step is `PipelineDriver` (`driver/_driver.py`) and the stages' side the
`HostEngine` (`engine/_host.py`), as on Ray; here the driver calls the one engine directly
(`LocalHosts`), and boundary tensors move inside the process (`LocalChannels`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.runtime.driver._driver import HostResult, Hosts, PipelineDriver, StepCall
from jaxreshard.runtime.driver._lifetime import track_pipeline
from jaxreshard.runtime.engine._channels import Channels
from jaxreshard.runtime.engine._host import SegmentCall, StepInputs
from jaxreshard.runtime.engine._placing import Placement, on_mesh
from jaxreshard.runtime.local._channels import LocalChannels
from jaxreshard.runtime.local._compiled import CompiledPipeline


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
