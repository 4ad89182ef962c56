"""What travels to other processes (the Ray hosts) pickled: a step and its arguments' structure
(`dumps`, which sends JAX's module-level caches by reference), and trees by their leaves'
positions (`dump_numbered`: loaded there with an error that names a module the host cannot
import, and checked for a class that flattens differently there, one that travelled by
value)."""

from __future__ import annotations

import importlib
import io
import sys
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


# [Note: JAX's caches travel by reference]
# A function wrapped by `jax.checkpoint` (`jax.remat`) is a closure of JAX's whose globals include
# module-level caches (`WeakrefLRUCache`, a C++ object that does not pickle). A step that calls
# one, or a model built with one, travels to the hosts by value (a script's, or the step's own
# module's), and cloudpickle then failed on the cache ("cannot pickle 'WeakrefLRUCache'").
# `dumps` sends such an object as its module and name instead; every host imports JAX itself.
_BY_REFERENCE = {"WeakrefLRUCache", "MultiWeakrefLRUCache"}
_PACKAGES = ("jax", "jaxlib", "flax", "equinox", "optax")
_where: dict[int, tuple[str, str]] = {}  # id -> (module, attribute) of JAX's module-level caches


def _scan() -> dict[int, tuple[str, str]]:
    where: dict[int, tuple[str, str]] = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in _PACKAGES:
            continue
        for attr, value in list(vars(module).items()):
            if type(value).__name__ in _BY_REFERENCE:
                where.setdefault(id(value), (name, attr))
    return where


def _locate(obj: Any) -> tuple[str, str] | None:
    """The module and attribute that hold `obj`, one of JAX's caches, if any. The modules are
    scanned again when it is not found where it was (JAX imports some lazily; an id may be
    reused), and the new map replaces the old whole."""
    global _where

    def found() -> tuple[str, str] | None:
        where = _where.get(id(obj))
        if where is not None and getattr(sys.modules.get(where[0]), where[1], None) is obj:
            return where
        return None

    if found() is None:
        _where = _scan()
    return found()


def attribute(module: str, name: str) -> Any:
    """`module.name`, imported here (how `dumps` sends a JAX cache)."""
    return getattr(importlib.import_module(module), name)


def dumps(obj: Any) -> bytes:
    """`obj` pickled for a host by cloudpickle, JAX's module-level caches by reference (see
    [Note: JAX's caches travel by reference])."""
    from ray import cloudpickle

    class Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, value: Any) -> Any:
            if type(value).__name__ in _BY_REFERENCE:
                where = _locate(value)
                if where is not None:
                    return attribute, where
            return super().reducer_override(value)

    buffer = io.BytesIO()
    Pickler(buffer).dump(obj)
    return buffer.getvalue()


def dump_numbered(tree: Any) -> bytes:
    """`tree`'s structure pickled for a host, with each leaf's position as its value and the
    count (`load_numbered` checks them there): classes of importable modules go by reference,
    the script's by value."""
    treedef = jax.tree_util.tree_structure(tree)
    numbered = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    return dumps((numbered, treedef.num_leaves))


def load_numbered(data: bytes, what: str) -> tuple[list[int], Any]:
    """The leaves and `PyTreeDef` of a tree `dump_numbered` pickled, flattened with this
    process's classes; an error names a module this process cannot import, or says that a
    class flattens differently here (a leaf would be misplaced)."""
    import pickle

    try:
        numbered, count = pickle.loads(data)
    except (ImportError, AttributeError) as e:
        missing = getattr(e, "name", None) or str(e)
        raise ValueError(
            f"{what} names {missing!r}, which this host cannot import ({type(e).__name__}: "
            f"{e}); the tree's classes travel by reference: make their module importable on "
            "every host, the same version as here (install it there, or put its directory on "
            "the hosts' PYTHONPATH)"
        ) from e
    leaves, treedef = jax.tree_util.tree_flatten(numbered)
    if leaves != list(range(count)) or not all(type(x) is int for x in leaves):
        raise ValueError(
            f"{what} came to this host as {len(leaves)} leaves, not the driver's {count} in "
            "its order: " + BY_VALUE_FIX
        )
    return leaves, treedef
