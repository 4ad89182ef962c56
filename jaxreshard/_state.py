"""Bringing a pipelined step's state (spread over stage meshes or Ray hosts) to one place."""

from __future__ import annotations

from typing import Any

import jax

from jaxreshard._tracebacks import api_boundary


@api_boundary
def collect(tree: Any, device: Any = None) -> Any:
    """Bring every array of `tree` to the host as numpy arrays, or onto one device.

    A step returned by `parallelize` leaves each parameter and optimizer state on the mesh of
    the stage that uses it (or on a Ray host, as a `RemoteArray`), so the state spans several
    meshes and plain JAX code that mixes its leaves (`nnx.merge(graphdef, state)(x)`, saving a
    checkpoint) refuses the "incompatible devices". `collect` gathers it: with no `device`,
    every array becomes a numpy array on the host (for export and checkpoints); with a device
    (`jax.devices()[0]`), a `jax.Array` on that device. Other leaves stay as they are. To keep
    evaluating on the meshes instead, `parallelize` the eval function: it takes the state as it
    is (see "Bring your model" in the README).

    Args:
        tree: any pytree: parameters, optimizer state, a Flax `nnx.State`, an Equinox module.
        device: where to put the arrays; None: host numpy.

    Returns:
        `tree` with its arrays gathered.
    """
    from jaxreshard.runtime.ray._remote import RemoteArray

    def one(x: Any) -> Any:
        if isinstance(x, RemoteArray):
            x = x.fetch()
        if not isinstance(x, jax.Array) and not hasattr(x, "__array__"):
            return x
        if device is None:
            return jax.device_get(x)
        return jax.device_put(x, device)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, RemoteArray))
