"""The GPU path on one real GPU: everything short of a multi-rank collective.

Stream ordering between JAX and NCCL (both ways), DLPack round trips, bfloat16, one-rank NCCL
broadcasts, the transport's device-side buffers, and the local runtime with a GPU stage. The
multi-rank logic runs everywhere against the stand-in (tests/test_nccl.py); one GPU cannot hold
two ranks of one communicator (NCCL refuses it). These tests select the GPU themselves
(conftest.py makes CPU the default backend and keeps CUDA available) and skip without one.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _gpus():
    if importlib.util.find_spec("cupy") is None:
        return []
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="needs a CUDA GPU, JAX's CUDA plugin and CuPy"),
]


@pytest.fixture(scope="module")
def backend():
    from jaxreshard.comm._nccl import CupyBackend

    return CupyBackend()


@jax.jit
def _slow(x):
    """Long enough (tens of ms) that a reader that does not wait sees the old bytes."""
    return jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ y) * 0.5 + 1.0, x)


def _still_running():
    x = jax.device_put(jnp.full((4096, 4096), 1e-3, jnp.float32), GPUS[0])
    expected = np.asarray(_slow(x))
    return (lambda: _slow(x)), expected


def test_broadcast_waits_for_the_jax_computation_that_produces_its_source(backend):
    """The stale read of the old transport: the source taken while JAX still computes it,
    broadcast on the transport's own stream, handed back to JAX. Ten trials, all exact."""
    produce, expected = _still_running()
    gpu = GPUS[0]
    comm = backend.communicator(1, backend.unique_id(), 0, gpu)
    for _ in range(10):
        stream = backend.stream(gpu)
        source = backend.view(produce(), gpu, stream)  # returns before the computation ends
        out = backend.empty(source.shape, source.dtype, gpu, stream)
        backend.broadcast(comm, source, out, source.nbytes, 0, stream, gpu)
        result = backend.to_jax(out, gpu, stream)  # JAX's read waits for the broadcast
        np.testing.assert_array_equal(np.asarray(result), expected)


def test_jax_reads_a_received_buffer_only_after_the_stream(backend):
    """CuPy -> JAX: a buffer written by a long queue of work on the transport's stream is
    handed to JAX at once; JAX's read sees the final bytes."""
    import cupy

    gpu = GPUS[0]
    for _ in range(10):
        stream = backend.stream(gpu)
        with stream:
            a = cupy.full((2048, 2048), 1e-3, cupy.float32)
            for _ in range(20):
                a = cupy.tanh(a @ a) * 0.5 + 1.0
        got = np.asarray(backend.to_jax(a, gpu, stream))
        stream.synchronize()
        np.testing.assert_array_equal(got, cupy.asnumpy(a))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float16"])
def test_dlpack_round_trips_share_memory(backend, dtype):
    gpu = GPUS[0]
    x = jax.device_put(jnp.arange(64).astype(dtype).reshape(8, 8), gpu)
    stream = backend.stream(gpu)
    view = backend.view(x, gpu, stream)
    assert view.data.ptr == x.unsafe_buffer_pointer()  # no copy
    back = backend.to_jax(backend.contiguous(view[:, 2:5], gpu, stream), gpu, stream)
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x)[:, 2:5])


def test_one_rank_broadcast_moves_bfloat16_bytes(backend):
    gpu = GPUS[0]
    x = jax.device_put(jnp.linspace(-3, 3, 1000, dtype=jnp.bfloat16), gpu)
    stream = backend.stream(gpu)
    source = backend.view(x, gpu, stream)
    out = backend.empty(source.shape, source.dtype, gpu, stream)
    comm = backend.communicator(1, backend.unique_id(), 0, gpu)
    with backend.group():
        backend.broadcast(comm, source, out, source.nbytes, 0, stream, gpu)
    np.testing.assert_array_equal(np.asarray(backend.to_jax(out, gpu, stream)), np.asarray(x))


def test_device_data_local_ops_and_finish_on_the_gpu(backend, cpu_devices):
    """The transport's device-side buffers: a plan's local ops (copies within a host) queued on
    the stream, then handed to JAX, from a source still being computed."""
    from helpers import cluster_over, virtual

    from jaxreshard.comm import plan_reshard
    from jaxreshard.comm._nccl import DeviceData, NcclTransport
    from jaxreshard.comm._order import host_programs
    from jaxreshard.comm._transport import HostWork, run_host_work

    plan = plan_reshard(
        (4096, 4096),
        "float32",
        virtual((1,), P(), 0, 2),
        virtual((1,), P(), 1, 2),
        cluster=cluster_over(2, 2),  # one host: the op is a local copy
    )
    gpu = GPUS[0]
    transport = NcclTransport({0: gpu, 1: gpu}, backend)
    (steps,) = host_programs(plan, collectives=True).values()
    work = HostWork(
        "w", 0, plan.shape, plan.dtype, tuple(steps), dict(enumerate(plan.ops)),
        {0: plan.src.indices[0]}, {1: plan.dst.indices[0]}, "", "", 30.0,
    )  # fmt: skip
    produce, expected = _still_running()
    data = DeviceData(work, {0: produce()}, {0: gpu, 1: gpu}, transport)
    run_host_work(work, data, transport)
    np.testing.assert_array_equal(np.asarray(data.finish()[1]), expected)


def test_reshard_between_a_gpu_and_cpu_devices(cpu_devices):
    """Device ids collide across platforms (cuda:0 and cpu:0); the planner keys them apart."""
    import jaxreshard

    x = jax.device_put(
        jnp.arange(48.0).reshape(8, 6), NamedSharding(Mesh(np.array(GPUS[:1]), ("x",)), P())
    )
    dst = NamedSharding(Mesh(np.array(cpu_devices[:2]), ("x",)), P("x"))
    y = jaxreshard.reshard(x, dst)
    assert y.sharding == dst
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    back = jaxreshard.reshard(y, x.sharding)
    assert back.sharding == x.sharding and back.devices() == {GPUS[0]}


def test_pipeline_with_a_gpu_stage_beside_a_cpu_stage(cpu_devices):
    """The local runtime on the GPU: stage 0 on cuda:0, stage 1 on two CPU devices."""
    import jaxreshard as jr

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["a"])
            h = jr.stage_boundary(h)
            return jnp.mean((h @ p["b"] - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=(16, 16)).astype(np.float32) * 0.3 for k in "ab"}
    batch = {k: rng.normal(size=(8, 16)).astype(np.float32) for k in "xy"}
    meshes = [
        Mesh(np.array(GPUS[:1]).reshape(1), ("data",)),
        Mesh(np.array(cpu_devices[:2]).reshape(2), ("data",)),
    ]
    config = jr.PipelineConfig(num_micro_batches=2, schedule="1f1b", backend="local")
    piped = jr.parallelize(step, config=config, batch_argnums=(1,), meshes=meshes)
    with jax.default_matmul_precision("highest"):
        ref_params, ref_loss = jax.jit(step)(params, batch)
        got_params, got_loss = piped(params, batch)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    assert got_params["a"].devices() == {GPUS[0]}
    for k in "ab":
        np.testing.assert_allclose(
            np.asarray(got_params[k]), np.asarray(ref_params[k]), rtol=1e-5, atol=1e-6
        )
