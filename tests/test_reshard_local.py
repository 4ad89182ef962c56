import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AXES, mesh_shapes, shape_for, specs
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard
from jaxreshard.comm import STRATEGY_NAMES, Cluster, VirtualMesh, VirtualSharding, plan_reshard
from jaxreshard.comm._local import execute_local

DTYPES = [
    jnp.bool_,
    jnp.int8,
    jnp.uint8,
    jnp.int16,
    jnp.int32,
    jnp.uint32,
    jnp.float16,
    jnp.bfloat16,
    jnp.float32,
    jnp.complex64,
]


def named(devices, mesh_shape, spec):
    grid = np.array(devices[: math.prod(mesh_shape)]).reshape(mesh_shape)
    return NamedSharding(Mesh(grid, AXES[: len(mesh_shape)]), spec)


def values(shape, dtype):
    data = np.arange(math.prod(shape)).reshape(shape) % 251
    return jnp.asarray(data).astype(dtype)


def check(y, reference, dst):
    assert y.sharding == dst
    assert y.dtype == reference.dtype and y.shape == reference.shape
    ref = np.asarray(reference)
    for shard in y.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), ref[shard.index])


@given(st.data())
def test_reshard_is_exact_for_random_layouts(cpu_devices, data):
    src_mesh = data.draw(mesh_shapes(max_devices=8))
    dst_mesh = data.draw(mesh_shapes(max_devices=12))
    rank = data.draw(st.integers(0, 3))
    src_spec, dst_spec = data.draw(specs(src_mesh, rank)), data.draw(specs(dst_mesh, rank))
    shape = shape_for([(src_mesh, src_spec), (dst_mesh, dst_spec)], rank, data.draw)
    src = named(cpu_devices, src_mesh, src_spec)
    dst = named(cpu_devices[math.prod(src_mesh) :], dst_mesh, dst_spec)
    dtype = data.draw(st.sampled_from(DTYPES))
    strategy = data.draw(st.sampled_from(STRATEGY_NAMES))
    reference = values(shape, dtype)
    x = jax.device_put(reference, src)
    check(jaxreshard.reshard(x, dst, strategy=strategy), reference, dst)
    # The general device-to-device path (the one GPUs take) gives the same.
    cluster = Cluster.from_devices(cpu_devices, devices_per_host=data.draw(st.sampled_from([1, 4])))
    plan = plan_reshard(shape, dtype, src, dst, cluster=cluster, strategy=strategy)
    check(execute_local(plan, x, dst, path="devices"), reference, dst)
    check(execute_local(plan, x, dst, path="cpu"), reference, dst)


@pytest.mark.parametrize("dtype", ["float64", "int64", "uint64", "complex128"])
def test_64_bit_dtypes(cpu_devices, dtype):
    with jax.enable_x64(True):
        src = named(cpu_devices, (2, 2), P("a"))
        dst = named(cpu_devices[4:], (3,), P(None, "a"))
        reference = jnp.asarray(np.arange(4 * 6).reshape(4, 6) * 1.000001 + 2**40).astype(dtype)
        y = jaxreshard.reshard(jax.device_put(reference, src), dst)
        assert y.dtype == jnp.dtype(dtype)
        check(y, reference, dst)


def test_zero_d_empty_and_one_d(cpu_devices):
    for shape, src_spec, dst_spec in [
        ((), P(), P()),
        ((0, 4), P("a"), P(None, "a")),
        ((12,), P("a"), P(("a", "b"))),
    ]:
        src = named(cpu_devices, (2,), src_spec)
        dst = named(cpu_devices[2:], (2, 2), dst_spec)
        reference = values(shape, jnp.float32)
        check(jaxreshard.reshard(jax.device_put(reference, src), dst), reference, dst)


def test_overlapping_devices_fall_back_to_device_put(cpu_devices):
    src = named(cpu_devices, (4,), P("a"))
    dst = named(cpu_devices[2:], (4,), P(None, "a"))
    reference = values((8, 8), jnp.float32)
    check(jaxreshard.reshard(jax.device_put(reference, src), dst), reference, dst)
    same = jaxreshard.reshard(jax.device_put(reference, src), src)
    check(same, reference, src)


def test_plans_are_reused(cpu_devices):
    from jaxreshard.comm._planner import plan_layouts

    src, dst = named(cpu_devices, (2,), P("a")), named(cpu_devices[2:], (2,), P())
    x = jax.device_put(values((4, 4), jnp.float32), src)
    jaxreshard.reshard(x, dst)
    hits = plan_layouts.cache_info().hits
    jaxreshard.reshard(x + 1, dst)
    assert plan_layouts.cache_info().hits == hits + 1


def test_bad_input(cpu_devices):
    src, dst = named(cpu_devices, (2,), P("a")), named(cpu_devices[2:], (2,), P("a"))
    x = jax.device_put(values((4, 4), jnp.float32), src)
    with pytest.raises(TypeError, match=r"takes a jax\.Array .* got ndarray"):
        jaxreshard.reshard(np.zeros((4, 4)), dst)
    with pytest.raises(TypeError, match=r"takes a jax.sharding.Sharding .* got P\('a',?\)"):
        jaxreshard.reshard(x, P("a"))
    remote = VirtualSharding(VirtualMesh.from_ids((2,), ("a",), [90, 91]), P("a"))
    with pytest.raises(TypeError, match="sharding over remote devices"):
        jaxreshard.reshard(x, remote)
    with pytest.raises(ValueError, match="does not divide it"):
        jaxreshard.reshard(jax.device_put(values((3, 4), jnp.float32), cpu_devices[0]), dst)
    with pytest.raises(ValueError, match="has 3 entries but the array has rank 2"):
        jaxreshard.reshard(x, named(cpu_devices[2:], (2,), P(None, None, "a")))
    with pytest.raises(ValueError, match="strategy='best' is not a resharding strategy"):
        jaxreshard.reshard(x, dst, strategy="best")


def test_adopted_shards_never_write_through_to_the_source(cpu_devices):
    # Same layout on both sides: every destination shard is adopted from a source shard.
    src, dst = named(cpu_devices, (2,), P("a")), named(cpu_devices[2:], (2,), P("a"))
    reference = values((64, 16), jnp.float32)
    x = jax.device_put(reference, src)
    y = jaxreshard.reshard(x, dst)
    overwritten = jax.jit(lambda a: a * 0 - 1, donate_argnums=0)(y)
    assert np.all(np.asarray(overwritten) == -1)
    assert np.array_equal(np.asarray(x), np.asarray(reference))


def test_buffer_pool_reuses_only_released_buffers(cpu_devices):
    import gc

    from jaxreshard.comm._local import POOL

    POOL.clear()  # free buffers of earlier tests would be as good a choice as ours
    src = named(cpu_devices, (2,), P(None, "a"))
    dst = named(cpu_devices[2:], (2,), P("a"))
    reference = values((1024, 512), jnp.float32)  # 1 MiB shards: pooled (_POOL_MIN_BYTES)
    x = jax.device_put(reference, src)

    def pointers(y):
        return {s.data.unsafe_buffer_pointer() for s in y.addressable_shards}

    first = jaxreshard.reshard(x, dst)
    second = jaxreshard.reshard(x * 2, dst)
    assert not pointers(first) & pointers(second)  # live results never share memory
    released = pointers(first)
    jax.block_until_ready((first, second))
    both = POOL.leased_bytes()
    assert both == 4 * 2**20  # every destination shard came from the pool
    del first
    # JAX lets an adopted buffer go when its runtime is done with it, which may be a moment
    # after the array is dropped (seen on a loaded machine): wait for first's leases to end.
    deadline = time.monotonic() + 30
    while POOL.leased_bytes() > both // 2 and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert POOL.leased_bytes() == both // 2, "first's buffers were never released"
    third = jaxreshard.reshard(x * 3, dst)
    assert not pointers(third) & pointers(second)  # never a live result's buffer
    assert pointers(third) == released  # released buffers come back
    check(second, reference * 2, dst)
    check(third, reference * 3, dst)


def test_buffer_pool_leases_end_when_nothing_reaches_the_memory(cpu_devices):
    import gc

    from jaxreshard.comm._local import BufferPool

    pool = BufferPool(64 * 2**20)
    nbytes = 2**20
    first = pool.take(nbytes)
    # The array `take` returned is a holder by itself, without any view of it (reference
    # counts of the memory's owner did not see it, and handed the same memory out twice).
    second = pool.take(nbytes)
    assert first.ctypes.data != second.ctypes.data
    pointer = first.ctypes.data
    shaped = first.view(np.float32).reshape(512, 512)  # what aligned_empty hands out
    del first
    gc.collect()
    assert pool.take(nbytes).ctypes.data != pointer  # a view still holds it
    # JAX adopts the buffer without a copy and holds it as long as its array lives.
    adopted = jax.device_put(shaped, cpu_devices[0], may_alias=True)
    assert adopted.unsafe_buffer_pointer() == pointer
    del shaped
    gc.collect()
    assert pool.take(nbytes).ctypes.data != pointer
    on_host = np.asarray(adopted)  # a NumPy view of JAX's array holds it too
    del adopted
    gc.collect()
    assert pool.take(nbytes).ctypes.data != pointer
    del on_host
    gc.collect()
    assert pool.take(nbytes).ctypes.data == pointer  # released: reused
    assert pool.leased_bytes() == nbytes  # `second`; the arrays taken and dropped are free


def test_init_replaces_the_local_runtime_started_on_demand():
    from jaxreshard.runtime import _api

    saved = (_api._current, _api._implicit)
    try:
        _api._current, _api._implicit = None, False
        on_demand = _api.current_runtime()  # what reshard/parallelize start when none runs
        runtime = jaxreshard.init("local")
        assert runtime is not on_demand and not on_demand.is_alive
        with pytest.raises(RuntimeError, match="already initialised"):
            jaxreshard.init("local")
        jaxreshard.shutdown()
    finally:
        _api._current, _api._implicit = saved
