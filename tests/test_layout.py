import math

import jax
import numpy as np
import pytest
from helpers import AXES, mesh_shapes, shape_for, specs
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import Layout, VirtualMesh, VirtualSharding


@given(st.data())
def test_virtual_sharding_matches_named_sharding(data):
    mesh_shape = data.draw(mesh_shapes(max_devices=24))
    rank = data.draw(st.integers(0, 3))
    spec = data.draw(specs(mesh_shape, rank))
    shape = shape_for([(mesh_shape, spec)], rank, data.draw)
    devices = np.array(jax.devices()[: math.prod(mesh_shape)]).reshape(mesh_shape)
    names = AXES[: len(mesh_shape)]
    real = NamedSharding(Mesh(devices, names), spec)
    virt = VirtualSharding(
        VirtualMesh.from_ids(mesh_shape, names, [d.id for d in devices.flat]), spec
    )
    assert Layout.from_sharding(real, shape) == Layout.from_sharding(virt, shape)


def test_layout_of_partial_replication():
    mesh = VirtualMesh.from_ids((2, 4), ("x", "y"), range(8))
    layout = Layout.from_sharding(VirtualSharding(mesh, P("x")), (4, 3))
    assert layout.index_of(0) == ((0, 2), (0, 3))
    assert layout.index_of(3) == ((0, 2), (0, 3))  # replicated along y
    assert layout.index_of(4) == ((2, 4), (0, 3))


def test_layout_multi_axis_dim_is_major_to_minor():
    mesh = VirtualMesh.from_ids((2, 4), ("x", "y"), range(8))
    layout = Layout.from_sharding(VirtualSharding(mesh, P(("y", "x"))), (8,))
    # ("y", "x"): y is major, so device (x=1, y=0) = id 4 holds block 1.
    assert layout.index_of(4) == ((1, 2),)
    assert layout.index_of(1) == ((2, 3),)


def test_zero_d_and_empty_arrays():
    mesh = VirtualMesh.from_ids((2,), ("x",), range(2))
    assert Layout.from_sharding(VirtualSharding(mesh, P()), ()).indices == ((), ())
    empty = Layout.from_sharding(VirtualSharding(mesh, P("x")), (0, 5))
    assert empty.indices == (((0, 0), (0, 5)), ((0, 0), (0, 5)))


@pytest.mark.parametrize(
    "spec, shape, message",
    [
        (P("x", None, None), (4, 4), "has 3 entries but the array has rank 2"),
        (P("y"), (6,), "dim 0 (size 6) over mesh axes ('y',) (size 4), which does not divide it"),
        (P("z"), (4,), "names mesh axis 'z', which the mesh does not have"),
        (P("x", "x"), (4, 4), "uses mesh axis 'x' for dims 0 and 1"),
    ],
)
def test_layout_errors_name_rule_and_fix(spec, shape, message):
    mesh = VirtualMesh.from_ids((2, 4), ("x", "y"), range(8))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Layout.from_sharding(VirtualSharding(mesh, spec), shape, what="dst_sharding")


def test_layout_rejects_non_sharding():
    with pytest.raises(TypeError, match=r"src_sharding must be a jax\.sharding\.Sharding"):
        Layout.from_sharding(P("x"), (4,), what="src_sharding")


def test_real_named_sharding_indivisible_message(cpu_devices):
    mesh = Mesh(np.array(cpu_devices[:3]), ("x",))
    with pytest.raises(ValueError, match="make dim 0 a multiple of 3"):
        Layout.from_sharding(NamedSharding(mesh, P("x")), (8,), what="dst_sharding")


def test_virtual_mesh_errors():
    with pytest.raises(ValueError, match="needs 8 devices, got 7"):
        VirtualMesh.from_ids((2, 4), ("x", "y"), range(7))
    with pytest.raises(ValueError, match="one name per mesh dim"):
        VirtualMesh.from_ids((2, 4), ("x",), range(8))
    with pytest.raises(ValueError, match="has no devices"):
        VirtualMesh(np.empty((0,), dtype=object), ("x",))


def test_device_keys_stay_unique_across_platforms():
    """A CPU device and a GPU device may share an id; plans must still tell them apart."""
    from types import SimpleNamespace

    from jaxreshard.comm._layout import PLATFORM_STRIDE, device_key

    cpu0 = jax.devices()[0]
    assert cpu0.platform == "cpu" and device_key(cpu0) == cpu0.id
    gpu0 = SimpleNamespace(id=0, platform="gpu")
    assert device_key(gpu0) not in {device_key(d) for d in jax.devices()}
    assert device_key(gpu0) % PLATFORM_STRIDE == 0
    assert device_key(SimpleNamespace(id=7, platform="virtual")) == 7
    with pytest.raises(ValueError, match="platform 'metal'"):
        device_key(SimpleNamespace(id=0, platform="metal"))


def test_virtual_shardings_that_shard_alike_are_equal():
    """XLA reports `P("x", None)` for what a user wrote as `P("x")`; a held array must still
    match the sharding a step expects (else the Ray runtime re-uploads it every step)."""
    mesh = VirtualMesh.from_ids((2, 2), ("x", "y"), list(range(4)))
    same = [P("x"), P("x", None), P(("x",)), P(("x",), None)]
    for a in same:
        for b in same:
            assert VirtualSharding(mesh, a) == VirtualSharding(mesh, b)
            assert hash(VirtualSharding(mesh, a)) == hash(VirtualSharding(mesh, b))
    assert VirtualSharding(mesh, P("x")) != VirtualSharding(mesh, P(None, "x"))
    assert VirtualSharding(mesh, P(("x", "y"))) != VirtualSharding(mesh, P(("y", "x")))


def test_axes_of_one_device_shard_like_none():
    """On a mesh whose "data" axis has one device, `P("data")` is `P()`: XLA reports the step's
    outputs so, and a held parameter placed with `P("data")` must still match (no re-upload,
    and `parallelize` must not compile the step a second time for its own outputs)."""
    from jaxreshard._arguments import _leaf_key, signature

    mesh = VirtualMesh.from_ids((1, 2), ("data", "model"), [0, 1])
    for a, b in [(P("data"), P()), (P("data", "model"), P(None, "model")),
                 (P(("data", "model")), P("model"))]:  # fmt: skip
        assert VirtualSharding(mesh, a) == VirtualSharding(mesh, b)
        assert hash(VirtualSharding(mesh, a)) == hash(VirtualSharding(mesh, b))
    assert VirtualSharding(mesh, P("model")) != VirtualSharding(mesh, P())

    jmesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    x = np.zeros((4, 4), np.float32)
    specs = (P("data"), P(), P("data", None), P(None, "model"), P("data", "model"))
    arrays = {spec: jax.device_put(x, NamedSharding(jmesh, spec)) for spec in specs}
    keys = {spec: _leaf_key(a, frozenset({"data"})) for spec, a in arrays.items()}
    assert keys[P("data")] == keys[P()] == keys[P("data", None)]
    assert keys[P(None, "model")] == keys[P("data", "model")] != keys[P()]
    # 'data' has one device on the leaf's mesh but more on a stage mesh: the step would shard
    # over it, so the spec keeps it (a different compile, not a shared one).
    assert _leaf_key(arrays[P("data")]) != _leaf_key(arrays[P()])
    # The per-call key (one pass over the leaves) is the same key, host arrays and statics too.
    leaves = [*arrays.values(), x, 3, "s"]
    signed, found = signature(leaves, frozenset({"data"}))
    assert signed[: len(arrays) + 1] == [_leaf_key(a, frozenset({"data"})) for a in leaves[:-2]]
    assert [k[1] for k in signed[-2:]] == [3, "s"] and found == leaves[:-2]
