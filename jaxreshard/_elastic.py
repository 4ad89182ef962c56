"""`jaxreshard.train_elastic`: a training loop on Ray that survives losing hosts.

[Note: elastic training]
The loop trains `num_steps` steps, saving the state every `checkpoint_every` steps
(asynchronously: the next steps run while the files are written). When a host dies
(`RuntimeBroken`), it:
1. lets the save in flight finish or fail (a failed save leaves the previous checkpoint);
2. shuts the runtime down and starts one on the hosts that are left: `num_hosts - 1` for the
   local Ray cluster `init` starts; on a cluster (`address=`), once Ray has marked the dead
   node dead (its missed health checks), the first live nodes; the `hosts_after_failure`
   callback may choose otherwise;
3. asks `layout(num_hosts)` for the step to run there: fewer stages or smaller meshes, any
   schedule; the user's function places `jr.stage_boundary` as it likes;
4. restores the newest checkpoint into that step's placement (`restore_checkpoint`, which reads
   every leaf into the new layout, whatever layout wrote it), and goes on from its step, with
   the batches `batch(step)` gives.
So the loss after a failure is exactly what an uninterrupted run from that checkpoint in the new
layout computes. Steps done after the last checkpoint are done again (at most
`checkpoint_every`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxreshard._tracebacks import api_boundary


@api_boundary
def train_elastic(
    layout: Callable[[int], Any],
    init_state: Callable[[], tuple[Any, ...]],
    batch: Callable[[int], Any],
    *,
    num_steps: int,
    checkpoint_dir: str | os.PathLike[str],
    checkpoint_every: int,
    init_options: dict[str, Any],
    max_failures: int = 3,
    hosts_after_failure: Callable[[int, int | None], int] | None = None,
    on_step: Callable[[int, float, Any], None] | None = None,
    node_timeout_s: float = 300.0,
) -> tuple[tuple[Any, ...], list[tuple[int, float, int]]]:
    """Train on a Ray runtime, resuming on the surviving hosts when one dies.

    Args:
        layout: `num_hosts -> train_step`: a `parallelize`d step for that many hosts; called
            again after every failure. The step takes `(*state, batch)` and returns
            `(*state, loss)`.
        init_state: the initial state tuple (e.g. `(params, opt_state)`), as host data.
        batch: `step -> batch` (the data of training step `step`, from 0).
        num_steps: steps to train in all.
        checkpoint_dir: a folder every host can see; checkpoints go to `step_<n>` in it, and
            a run whose folder has one resumes from the newest.
        checkpoint_every: steps between checkpoints.
        init_options: `jaxreshard.init`'s arguments (`backend='ray'`, `num_hosts`, ...).
        max_failures: host failures to survive before giving up (the error is raised).
        hosts_after_failure: `(num_hosts, dead_host) -> hosts to restart on`; default: one
            fewer.
        on_step: called after each step with `(step, loss, runtime)` (e.g. to log).
        node_timeout_s: on a cluster (`init_options["address"]`), how long to wait for Ray to
            mark the dead host's node dead (its missed health checks) before starting again on
            the live nodes; a `TimeoutError` after it.

    Returns:
        The final state (`RemoteArray`s on the last runtime), and `(step, loss, num_hosts)`
        for every step trained, in order (a step redone after a failure appears again).
    """
    import jaxreshard as jr
    from jaxreshard.checkpoint._format import latest_step, step_dir
    from jaxreshard.runtime.ray._wait import RuntimeBroken

    if checkpoint_every < 1 or num_steps < 0:
        raise ValueError(
            f"train_elastic: checkpoint_every={checkpoint_every} must be >= 1 and "
            f"num_steps={num_steps} >= 0"
        )
    root = Path(checkpoint_dir).expanduser().absolute()
    options = dict(init_options)
    num_hosts = int(options.get("num_hosts", 1))
    history: list[tuple[int, float, int]] = []
    failures = 0
    while True:
        runtime = jr.init(**{**options, "num_hosts": num_hosts})
        step_fn = layout(num_hosts)
        fresh = init_state()
        found = latest_step(root)
        step = 0
        state: tuple[Any, ...] = tuple(fresh)
        if found is not None:
            step, path = found
            target = step_fn.placement(*fresh, batch(step))[: len(fresh)]
            state = tuple(jr.restore_checkpoint(path, target))
        pending = None
        try:
            while step < num_steps:
                *state_list, loss = step_fn(*state, batch(step))
                state = tuple(state_list)
                step += 1
                value = float(loss)
                history.append((step, value, num_hosts))
                if on_step is not None:
                    on_step(step, value, runtime)
                if step % checkpoint_every == 0 or step == num_steps:
                    if pending is not None:
                        pending.wait()
                    pending = jr.save_checkpoint(
                        step_dir(root, step), state, metadata={"step": step}, overwrite=True,
                        wait=False,
                    )  # fmt: skip
            if pending is not None:
                pending.wait()
            return state, history
        except RuntimeBroken as e:
            failures += 1
            if pending is not None:
                # A save that died with the host leaves the one before it standing.
                with contextlib.suppress(Exception):
                    pending.wait()
            if failures > max_failures:
                raise
            dead = e.host
            address = options.get("address")
            alive = None
            if address is not None:  # a cluster: start again once Ray has dropped the host
                # (asked over this runtime's connection, before `shutdown` ends it: one
                # disconnect and connect fewer)
                alive = _wait_for_fewer_hosts(address, num_hosts, node_timeout_s)
            jr.shutdown()
            num_hosts = (
                hosts_after_failure(num_hosts, dead)
                if hosts_after_failure is not None
                else num_hosts - 1
                if alive is None
                else min(num_hosts - 1, alive)
            )
            if num_hosts < 1:
                raise


def _wait_for_fewer_hosts(address: str, num_hosts: int, timeout_s: float) -> int:
    """Wait until the Ray cluster at `address` has fewer live host nodes than `num_hosts` (a
    killed machine is dropped after its missed health checks); return how many it has."""
    import time

    import ray

    from jaxreshard.runtime.ray._start import _host_nodes, join_ray

    joined = not ray.is_initialized()
    if joined:
        join_ray(address)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            alive = len(_host_nodes([n for n in ray.nodes() if n["Alive"]]))
            if alive < num_hosts:
                return alive
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"train_elastic: a host of the cluster at {address} failed, but after "
                    f"{timeout_s:.0f} s Ray still counts {alive} live host nodes (of "
                    f"{num_hosts}); the failure did not take a node down. Restart the failed "
                    "node's Ray, or raise node_timeout_s"
                )
            time.sleep(1.0)
    finally:
        if joined:
            ray.shutdown()
