"""How a step's arguments' structure travels to the host actors (see [Note: argument structure
on the hosts])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxreshard._tree_wire import BY_VALUE_FIX

# [Note: argument structure on the hosts]
# A host traces the step on its arguments' structure. A `PyTreeDef` does not always survive
# pickling into another process: Equinox's holds its `MISSING` sentinel, which unpickles as a
# new object that Equinox then takes for a field's value (every Equinox model failed on Ray
# with "'_Missing' object is not subscriptable"). So the arguments travel as a skeleton, the
# structure with each array replaced by its `ShapeDtypeStruct`, and each host flattens it
# again with its own classes (`tree_from_skeleton`); a structure that cannot be rebuilt with
# such leaves (a node that checks its children as it is made) travels as the `PyTreeDef`.
# A class that travels by value (defined in the script, or in the step's module) is rebuilt on
# the host by cloudpickle, and an Equinox Module class so rebuilt has no fields (equinox issue
# #231): its skeleton flattens to fewer leaves, and the host says where to define it instead.


def tree_skeleton(
    in_tree: Any, avals: Sequence[Any], static: dict[int, Any]
) -> tuple[str, Any] | None:
    """The arguments' structure to send to the hosts (see [Note: argument structure on the
    hosts]): ("skeleton", the tree of `avals`' structs at the array leaves and the `static`
    leaves (leaf index -> value) as they are), else ("tree", `in_tree`); None without one."""
    if in_tree is None:
        return None
    if len(avals) + len(static) != in_tree.num_leaves:
        raise ValueError(
            f"{len(avals)} arrays and {len(static)} static leaves for arguments of "
            f"{in_tree.num_leaves} leaves"
        )
    arrays = iter([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    leaves = [static[i] if i in static else next(arrays) for i in range(in_tree.num_leaves)]
    try:
        return ("skeleton", jax.tree_util.tree_unflatten(in_tree, leaves))
    except Exception:  # (a node that refuses such children: its treedef, as it is)
        return ("tree", in_tree)


def tree_from_skeleton(wire: tuple[str, Any], static: dict[int, Any], num_arrays: int) -> Any:
    """The `PyTreeDef` a host traces with, from `tree_skeleton`'s form: `num_arrays` arrays and
    the `static` leaves at their places, or an error that says why not."""
    kind, value = wire
    if kind == "tree":
        return value
    leaves, tree = jax.tree_util.tree_flatten(value)
    struct = jax.ShapeDtypeStruct
    expected = [i not in static for i in range(num_arrays + len(static))]
    if [isinstance(x, struct) for x in leaves] != expected:
        raise ValueError(
            f"the step's arguments came to this host as {len(leaves)} leaves, not the "
            f"driver's {len(expected)} ({num_arrays} arrays) in the same places: " + BY_VALUE_FIX
        )
    return tree
