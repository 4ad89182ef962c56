"""NCCL transport: the pure parts everywhere, the GPU parts where a GPU is."""

import importlib.util

import numpy as np
import pytest
from helpers import cluster_over, virtual
from jax.sharding import PartitionSpec as P

from jaxreshard.comm import plan_reshard
from jaxreshard.comm._nccl import expected_bytes, group_ranks
from jaxreshard.comm._order import COLLECTIVE, host_programs
from jaxreshard.comm._transport import HostWork


def has_gpu():
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


gpu = pytest.mark.skipif(not has_gpu(), reason="needs CuPy and a CUDA GPU")


def test_group_ranks_follow_sorted_device_ids():
    assert group_ranks((9, 2, 5, 7), [5, 7, 8]) == [(5, 1), (7, 2)]
    assert group_ranks((3,), [3]) == [(3, 0)]


def test_collective_steps_name_their_communicator():
    plan = plan_reshard(
        (8, 4),
        "bfloat16",
        virtual((2,), P("a"), 0, 2),
        virtual((2,), P(), 2, 1),
        cluster=cluster_over(4, 2),
    )
    programs = host_programs(plan, collectives=True)
    groups = {s.group for steps in programs.values() for s in steps if s.role == COLLECTIVE}
    assert groups and all(set(g) <= set(range(4)) and g == tuple(sorted(g)) for g in groups)
    step = next(s for steps in programs.values() for s in steps if s.role == COLLECTIVE)
    work = HostWork(
        "w", 0, plan.shape, plan.dtype, (step,), {step.op: plan.ops[step.op]}, {}, {}, "a", "b", 1.0
    )
    shape, nbytes = expected_bytes(work, step.op)
    assert nbytes == int(np.prod(shape)) * 2


def test_transport_explains_missing_cupy(monkeypatch):
    import builtins

    from jaxreshard.comm import _nccl

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name.startswith("cupy"):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    with pytest.raises(RuntimeError, match=r"pip install 'jaxreshard\[gpu\]'"):
        _nccl.cupy_modules()


@pytest.mark.gpu
@gpu
def test_dlpack_shares_memory_between_jax_and_cupy():
    import cupy
    import jax
    import jax.numpy as jnp

    x = jax.device_put(jnp.arange(16, dtype=jnp.float32), jax.devices("gpu")[0])
    view = cupy.from_dlpack(x)
    assert view.data.ptr == x.unsafe_buffer_pointer()
    back = jax.dlpack.from_dlpack(cupy.arange(4, dtype=cupy.int32))
    assert np.array_equal(np.asarray(back), np.arange(4))


@pytest.mark.gpu
@gpu
def test_one_rank_communicator_broadcast():
    import cupy
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    buffer = cupy.arange(1024, dtype=cupy.uint8)
    comm.broadcast(
        buffer.data.ptr,
        buffer.data.ptr,
        buffer.nbytes,
        nccl.NCCL_UINT8,
        0,
        cupy.cuda.Stream.null.ptr,
    )
    cupy.cuda.Stream.null.synchronize()
    assert int(buffer[-1]) == 1023 % 256


@pytest.mark.gpu
@gpu
def test_local_runtime_on_gpu():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding

    import jaxreshard

    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs two GPUs for disjoint meshes")
    half = len(gpus) // 2
    src = NamedSharding(Mesh(np.array(gpus[:half]), ("x",)), P("x"))
    dst = NamedSharding(Mesh(np.array(gpus[half : 2 * half]), ("x",)), P(None, "x"))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), src)
    y = jaxreshard.reshard(x, dst)
    assert y.sharding == dst and np.array_equal(np.asarray(y), np.asarray(x))
