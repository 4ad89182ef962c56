"""The host actor: one per host (Ray node), owning that host's devices and their shards.

It runs in its own process. Its JAX sees only this host's devices (on a CPU-only machine, as many
fake CPU devices as asked for); global device ids are `first_device + local index`.
"""

from __future__ import annotations

import collections
import gc
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

from jaxreshard.runtime.ray._host_arrays import HostArrays
from jaxreshard.runtime.ray._naive import NaiveBaseline


class HostActor(HostArrays, NaiveBaseline):
    """Ray actor body (wrapped with `ray.remote` by the driver; threaded, so deliveries from
    peers arrive while a plan runs)."""

    def __init__(
        self,
        host: int,
        first_device: int,
        num_devices: int | None,
        platform: str,
        enable_x64: bool = False,
        distributed: bool = False,
        compile_cache: dict[str, Any] | None = None,
    ):
        import jax

        from jaxreshard.runtime.ray._start import use_compile_cache

        if platform == "cpu" and num_devices:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", num_devices)
        # The driver's setting, so that 64-bit data is never narrowed on the way.
        jax.config.update("jax_enable_x64", enable_x64)
        use_compile_cache(compile_cache)  # the driver's, where this host can write it
        self.host, self._first, self._count, self._platform = (
            host,
            first_device,
            num_devices,
            platform,
        )
        self.devices: dict[int, Any] = {}  # this host's, by global id
        self.global_devices: dict[int, Any] = {}  # every host's, once joined (see `join`)
        self.platform = platform
        if not distributed:  # else the devices are there once `join` made the client
            self._take_devices()
        self.arrays: dict[str, dict[int, Any]] = {}  # id -> shards by global device id
        self.whole: dict[str, Any] = {}  # id -> a jax.Array a pipeline step kept as it is
        # id -> (sharding, its shards, the array a step put together from them): see `assembled`
        self._assembled: dict[str, tuple[Any, tuple[Any, ...], Any]] = {}
        self.peers: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._transport: Any = None  # the CPU point-to-point transport in use
        self._objects: Any = None  # the object-store transport (also behind `deliver`)
        self._stream: Any = None  # the TCP transport, once `open_stream` made its listener
        self._emulator: Any = None
        self._nccl: Any = None
        self._pipelines: dict[str, Any] = {}  # key -> HostPipeline (runtime/ray/_host_pipeline.py)
        self._dropped: collections.deque[str] = collections.deque(maxlen=64)  # for messages
        self.checkpoint_writes: dict[str, Any] = {}  # token -> writes in flight (checkpoint/)

    # -- setup ---------------------------------------------------------------------------------

    def _take_devices(self) -> None:
        import jax

        platform, num_devices = self._platform, self._count
        local = jax.local_devices(backend=platform) if platform != "auto" else jax.local_devices()
        if num_devices is not None:
            if len(local) < num_devices:
                raise RuntimeError(
                    f"host {self.host} ({socket.gethostname()}) has {len(local)} "
                    f"{local[0].platform} devices, but {num_devices} were asked for"
                )
            local = local[:num_devices]
        self.devices = {self._first + k: d for k, d in enumerate(local)}
        self.platform = local[0].platform

    def coordinator_address(self) -> str:
        """Where this host (host 0) serves the hosts' jax.distributed runtime: its node's
        address and a free port."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
            port = probe.getsockname()[1]
        return f"{ip}:{port}"

    def join(self, coordinator: str, num_hosts: int, timeout_s: float) -> None:
        """Join the hosts' one jax.distributed runtime as process `host` (every host calls it
        at once; host 0 serves it at `coordinator`), so that a stage's mesh can span hosts
        (see [Note: multi-host stages] in `ray/_pipeline.py`). Collectives between
        hosts run over gloo on this node's address (CPU) or NCCL (GPUs). Global device ids:
        each host's devices in order, hosts in order, as the driver numbered them."""
        import jax
        import ray

        from jaxreshard._jax_compat import cpu_collectives_on, enable_recoverability

        if not enable_recoverability():  # a dead host must not take the others down with it
            import warnings

            warnings.warn(
                f"host {self.host}: this JAX has no jax_enable_recoverability: a host that dies "
                "will end every other host's actor once it misses its heartbeats (then "
                "jaxreshard.shutdown() and init() start afresh)",
                stacklevel=2,
            )
        if self._platform == "cpu":
            cpu_collectives_on(ray.util.get_node_ip_address())
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_hosts,
            process_id=self.host,
            cluster_detection_method="deactivate",
            initialization_timeout=max(1, int(timeout_s)),
            # Host 0 serves it on its node's address only (JAX's default: every interface).
            coordinator_bind_address=coordinator,
        )
        self._take_devices()
        by_process: dict[int, list[Any]] = {}
        for d in jax.devices():
            by_process.setdefault(d.process_index, []).append(d)
        first = 0
        for p in sorted(by_process):
            for k, d in enumerate(sorted(by_process[p], key=lambda d: d.id)):
                self.global_devices[first + k] = d
            first += len(by_process[p])
        mine = {g: d for g, d in self.global_devices.items() if d.process_index == self.host}
        if mine != self.devices:
            raise RuntimeError(
                f"host {self.host}: the distributed runtime numbers this host's devices "
                f"{sorted(mine)}, but the driver numbered them {sorted(self.devices)}; every "
                "host needs the same number of devices as planned"
            )

    def device(self, gid: int) -> Any:
        """The JAX device of global id `gid`: one of this host's, or, once the hosts joined one
        distributed runtime (`join`), another host's (for a stage whose mesh spans hosts)."""
        found = self.devices.get(gid)
        if found is None:
            found = self.global_devices.get(gid)
        if found is None:
            raise KeyError(
                f"host {self.host} cannot see device {gid}: it has {sorted(self.devices)}"
                + ("" if self.global_devices else " and joined no distributed runtime")
            )
        return found

    def info(self) -> dict[str, Any]:
        import jax

        return {
            "host": self.host,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "platform": self.platform,
            "devices": {gid: str(d) for gid, d in self.devices.items()},
            "compile_cache": jax.config.jax_compilation_cache_dir,
        }

    def open_stream(self, secret: bytes) -> tuple[str, int]:
        """Listen for the TCP transport on this node's address; return (ip, port). `secret` is
        the runtime's, which every connection must prove it knows (see [Note: stream
        authentication] in `comm/_stream.py`)."""
        import ray

        from jaxreshard.comm._stream import StreamTransport

        if self._stream is None:
            ip = ray.util.get_node_ip_address()
            self._stream = StreamTransport(self.host, ip, secret=secret)
        return self._stream.address

    def set_peers(
        self,
        peers: Mapping[int, Any],
        emulator: Any = None,
        addresses: Mapping[int, tuple[str, int]] | None = None,
    ) -> None:
        """Meet the other hosts: their actors, and (for the TCP transport, which then becomes
        this host's point-to-point transport) where they listen."""
        from jaxreshard.comm._transport import ObjectStoreTransport, book_link

        self.peers = dict(peers)
        self._emulator = emulator
        self._objects = ObjectStoreTransport(self.peers.__getitem__, self.host, emulator)
        self._transport = self._objects
        if addresses is not None:
            book = None
            if emulator is not None:
                book = lambda peer, nbytes: book_link(emulator, self.host, peer, nbytes)
            self._stream.connect(addresses, book)
            self._transport = self._stream

    # -- checkpoints (jaxreshard/storage/_host.py) ---------------------------------------------

    def checkpoint_start_write(self, token: str, parts: Any, root: str) -> dict[str, Any]:
        from jaxreshard.storage import _host

        return _host.start_write(self, token, parts, root)

    def checkpoint_finish_write(self, token: str) -> dict[str, Any]:
        from jaxreshard.storage import _host

        return _host.finish_write(self, token)

    def checkpoint_read(self, sources: Any) -> dict[str, Any]:
        """Read each source's leaves (path -> (skeleton, places, new ids)); report the bytes
        and time."""
        from jaxreshard.storage import _host

        total = {"read_bytes": 0, "seconds": 0.0}
        for path in sorted(sources):
            skeleton, places, new_ids = sources[path]
            done = _host.read(self, path, skeleton, places, new_ids)
            total["read_bytes"] += done["read_bytes"]
            total["seconds"] += done["seconds"]
        return total

    # -- resharding ----------------------------------------------------------------------------

    def deliver(self, work_id: str, items: list[Any], boxed: list[Any], ready: float = 0.0) -> None:
        """A peer hands over slices of `work_id` (see `ObjectStoreTransport.deliver`)."""
        self._objects.deliver(work_id, items, boxed, ready)

    def abort(self, work_id: str, reason: str) -> None:
        """Stop `work_id` (a resharding, or a pipeline step) here: a peer failed."""
        self._objects.abort(work_id, reason)
        if self._stream is not None:
            self._stream.abort(work_id, reason)
        if self._nccl is not None:
            self._nccl.abort(work_id, reason)
        for pipeline in list(self._pipelines.values()):
            pipeline.abort(work_id, reason)

    def run(self, work: Any, transport: str = "object_store") -> dict[str, float]:
        """Run this host's part of a resharding; keep the result as `work.dst_array`."""
        from jaxreshard.comm._transport import HostData, run_host_work

        src = self._array(work.src_array) if work.src_regions else {}
        try:
            if transport == "nccl":
                from jaxreshard.comm._nccl import DeviceData

                data: Any = DeviceData(work, src, self.devices, self._nccl_transport())
                stats = run_host_work(work, data, self._nccl)
            else:
                data = HostData(work, src, self.devices)
                stats = run_host_work(work, data, self._transport)
            result = data.finish()
        finally:
            self._transport.forget(work.work_id)
            if self._nccl is not None:
                self._nccl.forget(work.work_id)
        with self._lock:
            self.arrays.setdefault(work.dst_array, {}).update(result)
            self._assembled.pop(work.dst_array, None)
        return stats

    # -- NCCL ----------------------------------------------------------------------------------

    def _nccl_transport(self) -> Any:
        if self._nccl is None:
            from jaxreshard.comm._nccl import NcclTransport

            self._nccl = NcclTransport(self.devices)
        return self._nccl

    def nccl_unique_id(self) -> Any:
        return self._nccl_transport().unique_id()

    def nccl_create(self, group: tuple[int, ...], uid: Any, channel: str = "reshard") -> None:
        """Make this host's ranks of a communicator (every member host calls it at once)."""
        self._nccl_transport().create(tuple(group), uid, channel)

    # -- pipelines (see runtime/ray/_pipeline.py) ---------------------------------------------

    def pipeline_prepare(
        self,
        key: str,
        fun: bytes,
        config: Any,
        avals: Any,
        batch_leaves: Any,
        input_specs: Any,
        stages: Any,
        donated: Any = (),
    ) -> Any:
        """Trace and cut a pipelined step here (`fun`: the pickled step and its static leaves;
        `donated`: the leaves whose buffers it may reuse); return its fingerprint."""
        from jaxreshard.frontend._trace import fingerprint
        from jaxreshard.runtime.ray._host_pipeline import HostPipeline

        step, static, in_tree = load_step(self.host, fun, len(avals))
        pipeline = HostPipeline(
            self,
            key,
            step,
            static,
            config,
            in_tree,
            avals,
            batch_leaves,
            input_specs,
            {int(s): grid for s, grid in stages.items()},
            donated,
        )
        with self._lock:
            dropped = key in self._dropped  # the driver dropped it while it was traced here
            if not dropped:
                self._pipelines[key] = pipeline
        if dropped:
            pipeline.drop()
            raise KeyError(f"host {self.host}: pipeline {key!r} was closed by the driver")
        return fingerprint(pipeline.graph)

    def partition_segment_costs(
        self,
        fun: bytes,
        config: Any,
        avals: Any,
        batch_leaves: Any,
        input_specs: Any,
        donated: Any,
        split: int,
    ) -> dict[str, Any]:
        """Time the step's segments here for `partition="auto"` (see [Note: segments timed on
        the hosts] in `runtime/ray/_segments.py`)."""
        from jaxreshard.runtime.ray._segments import host_segment_costs

        return host_segment_costs(
            self.host, fun, config, avals, batch_leaves, input_specs, donated, split
        )

    def _pipeline(self, key: str) -> Any:
        """Pipeline `key` of this host; an error that says why it is not here."""
        pipeline = self._pipelines.get(key)
        if pipeline is None:
            why = "it was closed by the driver" if key in self._dropped else "never made here"
            raise KeyError(f"host {self.host} has no pipeline {key!r} ({why})")
        return pipeline

    def pipeline_prepare_stage(
        self, key: str, stage: int, specs: Any, loss_scale: float | None
    ) -> str:
        """Stage `stage`'s input specs (and the last stage's loss cotangent), to compile for;
        how the stage reduces its gradients."""
        return self._pipeline(key).compilers[stage].prepare(specs, loss_scale)

    def pipeline_compile_forward(self, key: str, stage: int) -> Any:
        """Compile stage `stage`'s forward; its output and residual specs."""
        return self._pipeline(key).compilers[stage].compile_forward()

    def pipeline_compile_variants(self, key: str, stage: int, names: Any, extra_specs: Any) -> None:
        """Compile the executables `names` of stage `stage` (see [Note: stage executables])."""
        self._pipeline(key).compilers[stage].compile_variants(names, extra_specs)

    def pipeline_set_layout(
        self, key: str, layout: Any, hosts_of_stage: Any, transport: str, leaf_specs: Any
    ) -> dict[int, int]:
        """Take the layout (`HostPipeline.set_layout`); the optimizer segments fused here."""
        return self._pipeline(key).set_layout(layout, hosts_of_stage, transport, leaf_specs)

    def pipeline_step(self, key: str, call: Any) -> dict[str, Any]:
        """This host's part of a step (`HostPipeline.step`)."""
        return self._pipeline(key).step(call)

    def pipeline_segment(self, key: str, index: int, step_id: str, inputs: Any) -> list[Any]:
        """Run a post-gradient segment the driver placed here now (`HostPipeline.segment`)."""
        return self._pipeline(key).segment(index, step_id, inputs)

    def pipeline_progress(self, key: str, step_id: str) -> tuple[int, str, float]:
        """What this host finished of step `step_id` (nothing, for a pipeline dropped here:
        nothing more of its step will finish)."""
        pipeline = self._pipelines.get(key)
        return pipeline.progress(step_id) if pipeline is not None else (0, "nothing", 0.0)

    def pipeline_signalled(self, key: str, step_id: str, transfer: Any) -> None:
        """A peer's signal-only transfer (quietly ignored for a pipeline dropped here)."""
        pipeline = self._pipelines.get(key)
        if pipeline is not None:
            pipeline.signalled(step_id, transfer)

    def pipeline_drop(self, key: str) -> bool:
        """Drop pipeline `key` (the driver closed it, or dropped it): its channels close, their
        threads end, and its executables and the arrays it keeps go (arrays kept for the
        driver's handles stay until those are freed). Never raises; False when it was not here.
        """
        with self._lock:
            pipeline = self._pipelines.pop(key, None)
            self._dropped.append(key)
        if pipeline is None:
            return False
        try:
            pipeline.drop()
        except Exception as e:  # nothing a drop leaves behind may fail the driver's call
            import logging

            logging.getLogger(__name__).warning(
                "host %d: dropping pipeline %s: %s: %s", self.host, key, type(e).__name__, e
            )
        del pipeline
        gc.collect()  # a pipeline's objects hold cycles; device memory goes with them
        return True

    def held(self) -> dict[str, Any]:
        """What this host holds now: its pipelines' keys, its live `jaxreshard-*` threads (by
        name), the ids of the arrays it keeps for the driver, the number of live jax.Arrays in
        the process, and per pipeline the post-gradient segments that had to compile in a step
        because their inputs came laid out otherwise than expected (for tests and leak
        hunting)."""
        import jax

        return {
            "pipelines": sorted(self._pipelines),
            "segments_compiled_in_steps": {
                key: pipeline.engine.segments.compiled_in_steps()
                for key, pipeline in list(self._pipelines.items())
            },
            "threads": sorted(
                t.name for t in threading.enumerate() if t.name.startswith("jaxreshard")
            ),
            "arrays": self.array_ids(),
            "live_arrays": len(jax.live_arrays()),
        }

    def _store(self, array_id: str, shards: Mapping[int, Any]) -> None:
        with self._lock:
            self.arrays[array_id] = dict(shards)
            self._assembled.pop(array_id, None)

    def _keep(self, array_id: str, value: Any) -> None:
        """Keep a jax.Array as it is (its shards are cut only if someone asks for them)."""
        with self._lock:
            self.whole[array_id] = value
            self._assembled.pop(array_id, None)

    def ping(self) -> int:
        return self.host

    def exit(self) -> None:
        os._exit(0)


def load_step(host: int, payload: bytes, num_arrays: int = 0) -> tuple[Any, Any, Any]:
    """Unpickle a step the driver sent (`ray/_pipeline.py`'s `_by_value`): the step, its static
    leaves and the `PyTreeDef` of its arguments, `num_arrays` arrays and those static leaves
    (None if none was sent); an error names the host and what it could not import."""
    import pickle

    from jaxreshard.runtime.ray._step_wire import tree_from_skeleton

    try:
        fun, static, *wire = pickle.loads(payload)
    except Exception as e:
        missing = getattr(e, "name", None)
        what = f"module {missing!r}" if isinstance(e, ImportError) and missing else "it"
        raise RuntimeError(
            f"host {host} ({socket.gethostname()}) cannot load the step it was sent: "
            f"{type(e).__name__}: {e}. The step's own module travels by value, but the modules "
            f"it imports travel by reference: make {what} importable on every host (install "
            "it there, or move the code the step needs into the step's module)"
        ) from e
    if not wire or wire[0] is None:
        return fun, static, None
    return fun, static, tree_from_skeleton(wire[0], static, num_arrays)
