import math

from helpers import mesh_shapes, owners, shape_for, specs, virtual
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import Layout, decompose


def check_against_brute_force(src, dst, shape, itemsize=4):
    tasks = decompose(Layout.from_sharding(src, shape), Layout.from_sharding(dst, shape), itemsize)
    have, need = owners(src, shape), owners(dst, shape)
    seen = {}
    for i, task in enumerate(tasks):
        assert task.nbytes == math.prod(b - a for a, b in task.index) * itemsize
        cells = list(_cells(task.index))
        assert cells, "a unit task covers at least one element"
        for cell in cells:
            assert cell not in seen, f"element {cell} in tasks {seen.get(cell)} and {i}"
            seen[cell] = i
            # Each slice lies whole inside one shard of every holder and every needer.
            assert set(task.senders) == have[cell]
            assert set(task.receivers) == need[cell]
    assert set(seen) == {cell for cell, devices in need.items() if devices}
    return tasks


def _cells(index):
    import itertools

    return itertools.product(*(range(a, b) for a, b in index))


@given(st.data())
def test_decomposition_matches_brute_force(data):
    src_mesh = data.draw(mesh_shapes(max_devices=8))
    dst_mesh = data.draw(mesh_shapes(max_devices=12))
    rank = data.draw(st.integers(0, 3))
    src_spec = data.draw(specs(src_mesh, rank))
    dst_spec = data.draw(specs(dst_mesh, rank))
    shape = shape_for([(src_mesh, src_spec), (dst_mesh, dst_spec)], rank, data.draw)
    src = virtual(src_mesh, src_spec, 0, 4)
    dst = virtual(dst_mesh, dst_spec, math.prod(src_mesh), 4)
    check_against_brute_force(src, dst, shape)


def test_case6_two_way_to_three_way_cuts():
    src = virtual((2, 4), P("a"), 0, 4)
    dst = virtual((3, 4), P("a"), 8, 4)
    tasks = check_against_brute_force(src, dst, (12, 2, 1))
    assert [t.index[0] for t in tasks] == [(0, 4), (4, 6), (6, 8), (8, 12)]
    assert tasks[1].senders == (0, 1, 2, 3) and tasks[1].receivers == (12, 13, 14, 15)
    assert tasks[2].senders == (4, 5, 6, 7)


def test_several_axes_on_one_dim():
    src = virtual((2, 4), P(None, ("a", "b")), 0, 4)
    dst = virtual((2, 4), P(("a", "b")), 8, 4)
    tasks = check_against_brute_force(src, dst, (8, 8))
    assert len(tasks) == 64 and all(len(t.senders) == len(t.receivers) == 1 for t in tasks)


def test_replicated_source_and_destination():
    src = virtual((2, 2), P(), 0, 2)
    dst = virtual((3,), P(), 4, 3)
    (task,) = check_against_brute_force(src, dst, (5, 3))
    assert task.senders == (0, 1, 2, 3) and task.receivers == (4, 5, 6)


def test_zero_d_one_d_and_empty():
    (task,) = check_against_brute_force(virtual((2,), P(), 0, 2), virtual((2,), P(), 2, 2), ())
    assert task.index == () and task.nbytes == 4
    tasks = check_against_brute_force(
        virtual((4,), P("a"), 0, 2), virtual((2,), P("a"), 4, 2), (8,)
    )
    assert len(tasks) == 4
    empty = decompose(
        Layout.from_sharding(virtual((2,), P("a"), 0, 2), (0, 3)),
        Layout.from_sharding(virtual((2,), P(), 2, 2), (0, 3)),
        4,
    )
    assert empty == ()


def test_itemsize_scales_bytes():
    src, dst = virtual((2,), P("a"), 0, 2), virtual((2,), P(), 2, 2)
    for itemsize in (1, 2, 8, 16):
        tasks = decompose(
            Layout.from_sharding(src, (4,)), Layout.from_sharding(dst, (4,)), itemsize
        )
        assert sum(t.nbytes for t in tasks) == 4 * itemsize
