"""Trees that travel to other processes (the Ray hosts) by their leaves' positions: pickled
here, loaded there with an error that names a module the host cannot import, and checked for
a class that flattens differently there (one that travelled by value)."""

from __future__ import annotations

from typing import Any

import jax

# Why a tree flattens differently on a host than on the driver, and the fix (a message's tail).
BY_VALUE_FIX = (
    "a pytree class of the tree flattens differently in this process. A class defined in the "
    "script (__main__) or in the step's own module travels to the hosts by value, and not "
    "every class survives that: an Equinox Module loses its fields (equinox issue #231), and a "
    "class registered as a pytree node is not registered again here. Define the model's "
    "classes in a module every host can import (installed, or on the hosts' PYTHONPATH), or "
    "build the model from the library's own layers"
)


def dump_numbered(tree: Any) -> bytes:
    """`tree`'s structure pickled for a host, with each leaf's position as its value and the
    count (`load_numbered` checks them there): classes of importable modules go by reference,
    the script's by value."""
    from ray import cloudpickle

    treedef = jax.tree_util.tree_structure(tree)
    numbered = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    return cloudpickle.dumps((numbered, treedef.num_leaves))


def load_numbered(data: bytes, what: str) -> tuple[list[int], Any]:
    """The leaves and `PyTreeDef` of a tree `dump_numbered` pickled, flattened with this
    process's classes; an error names a module this process cannot import, or says that a
    class flattens differently here (a leaf would be misplaced)."""
    import pickle

    try:
        numbered, count = pickle.loads(data)
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        raise ValueError(
            f"{what} names module {missing!r}, which this host cannot import; the tree's "
            "classes travel by reference: make the module importable on every host (install "
            "it there, or put its directory on the hosts' PYTHONPATH)"
        ) from e
    leaves, treedef = jax.tree_util.tree_flatten(numbered)
    if leaves != list(range(count)) or not all(type(x) is int for x in leaves):
        raise ValueError(
            f"{what} came to this host as {len(leaves)} leaves, not the driver's {count} in "
            "its order: " + BY_VALUE_FIX
        )
    return leaves, treedef
