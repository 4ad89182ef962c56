"""`jaxreshard.init` / `shutdown`: choose where plans and pipelines run."""

from __future__ import annotations

from typing import Any

from jaxreshard._tracebacks import api_boundary
from jaxreshard.runtime.driver._lifetime import close_pipelines

BACKENDS = ("local", "ray")

_current: Any = None
# True while `_current` is the local runtime started on demand (not by `init`): `init` replaces it.
_implicit = False


class LocalRuntime:
    """Every mesh is a set of this process's devices (the default)."""

    backend = "local"
    is_alive = True

    def __init__(self) -> None:
        import jax

        self.devices = tuple(jax.local_devices())

    def shutdown(self) -> None:
        self.is_alive = False

    def __repr__(self) -> str:
        return f"LocalRuntime({len(self.devices)} {self.devices[0].platform} devices)"


@api_boundary
def init(
    backend: str = "local",
    *,
    address: str | None = None,
    num_hosts: int | None = None,
    devices_per_host: int | None = None,
    **options: Any,
) -> Any:
    """Start the runtime that later calls use, and return it.

    Args:
        backend: `local` (this process's devices) or `ray` (one host actor per Ray node).
        address: Ray only: the cluster to join (`'auto'`, or `'HOST:PORT'` of `ray start
            --head`); one host actor per live node, owning that node's GPUs (or
            `devices_per_host` CPU devices). Without it, a local Ray instance starts with
            `num_hosts` host actors of `devices_per_host` devices each (fake CPU devices when the
            machine has no GPUs): a multi-host cluster emulated on one machine.
        num_hosts: Ray only: how many hosts (local: required; cluster: at most the live nodes).
        devices_per_host: Ray only: devices each host actor owns.
        **options: Ray only: `timeout_s` (every wait; default 120), `transport` (`auto`,
            `object_store` or `nccl`), `object_store_memory`, `cluster_links` (bandwidths for
            the planner's cost model, as in `Cluster`), `gpu_memory_fraction` (of each GPU that
            XLA may take in a host actor, default 0.6; the rest is for CuPy's receive buffers
            and NCCL), `distributed` (whether the host actors join one `jax.distributed`
            runtime, so that a stage's mesh may span hosts: default True with two or more
            hosts; the coordinator is host 0's actor, at an address Ray gives).

    Raises:
        RuntimeError: a runtime started by `init` is already running (call
            `jaxreshard.shutdown()` first). The local runtime that calls start on demand is
            replaced silently.
        ValueError: an unknown backend or bad sizes.
    """
    global _current, _implicit
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"init(backend={backend!r}): choose one of {', '.join(BACKENDS)}")
    if _current is not None and _current.is_alive and _implicit:
        shutdown()
    if _current is not None and _current.is_alive:
        raise RuntimeError(
            f"jaxreshard is already initialised ({_current!r}); call jaxreshard.shutdown() first"
        )
    if backend == "local":
        if address is not None or num_hosts is not None or devices_per_host is not None or options:
            raise ValueError(
                "init(backend='local') takes no address/num_hosts/devices_per_host/options; "
                "those are for backend='ray'"
            )
        _current = LocalRuntime()
        _implicit = False
    else:
        from jaxreshard.runtime.ray._options import check_init_options
        from jaxreshard.runtime.ray._runtime import RayRuntime

        check_init_options(address, options)
        _current = RayRuntime(
            address=address, num_hosts=num_hosts, devices_per_host=devices_per_host, **options
        )
        _implicit = False
    return _current


@api_boundary
def shutdown() -> None:
    """Stop the current runtime (host actors and Ray, for the Ray backend), and close every
    pipeline built so far (their threads end; the steps compile again at their next call).
    Idempotent."""
    global _current, _implicit
    _implicit = False
    close_pipelines()
    if _current is not None:
        runtime, _current = _current, None
        runtime.shutdown()


def running_runtime() -> Any:
    """The runtime `init` (or a call needing one) started, if it is still running; else None.
    Unlike `current_runtime`, this never starts one."""
    return _current if _current is not None and _current.is_alive else None


def current_runtime() -> Any:
    """The running runtime, starting the local one if none was initialised."""
    global _current, _implicit
    if _current is None or not _current.is_alive:
        _current = LocalRuntime()
        _implicit = True
    return _current
