"""`partition="auto"` on stage meshes with a model axis: each segment's compute per device and
the collectives XLA adds over the model axes, read off the segment compiled for the mesh's
model slice and priced by the cluster model (see [Note: tensor-parallel stages in the
partitioner])."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_partition import OPT, WIDTHS, auto_report, init_params, make_batch, make_step

import jaxreshard as jr
from jaxreshard.comm import Cluster
from jaxreshard.comm._layout import VirtualMesh
from jaxreshard.pipeline import simulate
from jaxreshard.runtime.step import _partition
from jaxreshard.runtime.step._collectives import with_sums
from jaxreshard.runtime.step._tensor_parallel import (
    Collective,
    TensorParallel,
    _model_slice,
    collectives_of,
)

NAMES = ("data", "model")
ROW = 16 * 32 * 4  # (a micro-batch's 16 rows of a 32-wide layer output, float32)


def megatron_params(mesh_shape=(1, 4)):
    """The test model's weights alternately column- and row-parallel over `model`: a 512-wide
    layer's output stays split, the next 32-wide one sums its parts (one all-reduce in its
    forward, one in the backward of the layer before)."""
    mesh = jax.make_mesh(mesh_shape, NAMES, devices=jax.devices()[: int(np.prod(mesh_shape))])
    params = init_params()
    return {
        k: jax.device_put(v, NamedSharding(mesh, P(None, "model") if i % 2 == 0 else P("model")))
        for i, (k, v) in enumerate(sorted(params.items()))
    }


def test_collectives_are_read_from_compiled_programs():
    """Each collective's kind, bytes and group size, from XLA's HLO text in every way it
    writes groups (listed, iota, mesh axes), an async start counted once; and from a real
    program compiled for a 2 x 4 mesh."""
    lines = "\n".join([
        "%a = f32[8,64]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}",
        "%b = (f32[4]{0}, bf16[2,8]{1,0}) all-reduce(%y, %z), replica_groups=[4,2]<=[8]",
        "%c = f32[4,32]{1,0} all-reduce(%w), replica_groups=mesh['axis_0'=1,'axis_1'=4] "
        "{'axis_1'}, use_global_device_ids=true",
        "%d = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%v), replica_groups={{0,1,2,3}}",
        "%e = f32[8,8]{1,0} all-gather-done(%d)",
        "%f = f32[2,8]{1,0} reduce-scatter(%u), replica_groups={{0,1,2,3}}",
        "%g = ((f32[20]{0}), f32[10]{0}) reduce-scatter-start(%t), replica_groups={{0,1}}",
        "%h = f8e4m3fn[4,8]{1,0} all-reduce(%s), replica_groups=[2,4]<=[4,2]T(1,0)",
        "%i = f32[3]{0} add(%h, %i)",
    ])  # fmt: skip
    assert collectives_of(lines) == [
        Collective("all-reduce", 8 * 64 * 4, 4),
        Collective("all-reduce", 16 + 32, 2),
        Collective("all-reduce", 4 * 32 * 4, 4),
        Collective("all-gather", 8 * 8 * 4, 4),
        Collective("reduce-scatter", 2 * 8 * 4, 4),
        Collective("reduce-scatter", 10 * 4, 2),
        Collective("all-reduce", 4 * 8, 4),
    ]
    mesh = jax.make_mesh((2, 4), NAMES, devices=jax.devices()[:8])

    def f(x, w1, w2):
        return jax.numpy.sum(jax.numpy.tanh(jax.numpy.tanh(x @ w1) @ w2))

    shardings = [NamedSharding(mesh, s) for s in (P("data"), P(None, "model"), P("model"))]
    args = [np.zeros(s, np.float32) for s in ((16, 64), (64, 128), (128, 64))]
    compiled = jax.jit(f, in_shardings=shardings).lower(*args).compile()
    found = collectives_of(compiled.as_text())
    assert Collective("all-reduce", 8 * 64 * 4, 4) in found  # (the row-parallel output's sum)
    assert all(c.group in (2, 4) for c in found)

    # A scan of 5 tensor-parallel blocks: one all-reduce in the loop's body, run 5 times.
    def blocks(h, w1, w2):
        def body(h, ws):
            return h + jax.numpy.tanh(h @ ws[0]) @ ws[1], None

        return jax.lax.scan(body, h, (w1, w2))[0]

    shardings = [NamedSharding(mesh, s) for s in (P(), P(None, None, "model"), P(None, "model"))]
    args = [np.zeros(s, np.float32) for s in ((8, 16), (5, 16, 32), (5, 32, 16))]
    compiled = jax.jit(blocks, in_shardings=shardings).lower(*args).compile()
    assert collectives_of(compiled.as_text()) == [Collective("all-reduce", 8 * 16 * 4, 4, 5)]

    # Nested: 3 times a scan of 5 (the text prints the inner body before the outer).
    def nested(h, w1, w2):
        return jax.lax.scan(lambda h, ws: (blocks(h, *ws), None), h, (w1, w2))[0]

    shardings = [
        NamedSharding(mesh, s) for s in (P(), P(*[None] * 3, "model"), P(None, None, "model"))
    ]
    args = [np.zeros(s, np.float32) for s in ((8, 16), (3, 5, 16, 32), (3, 5, 32, 16))]
    compiled = jax.jit(nested, in_shardings=shardings).lower(*args).compile()
    assert collectives_of(compiled.as_text()) == [Collective("all-reduce", 8 * 16 * 4, 4, 15)]


def test_auto_divides_compute_and_prices_the_model_axis_collectives():
    """On two (1, 4) meshes of a Megatron-style model: each segment's compute per device is
    about a quarter of one device's (XLA's flops), and its collectives are the model's own:
    the 32-wide layers' outputs summed in their forwards, the gradients of their inputs in the
    512-wide layers' backwards (not the first's: it has no input gradient); each a ring over
    the mesh's 4 devices (one host here). Every choice is simulated with them."""
    step, report = auto_report(
        params=megatron_params(), stage_mesh_shape=(1, 4), mesh_axis_names=NAMES
    )
    inside = Cluster.from_devices(jax.devices()[:8])
    for m, ids in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
        work = report.tensor_parallel_json[m]
        assert work["priced"] and not work["note"]
        ring = inside.all_reduce_seconds([ids], ROW)
        for s, (seconds, factors) in enumerate(zip(work["collective_seconds"], work["factors"])):
            want_f = ring if s % 2 == 1 else 0.0
            want_b = ring if s % 2 == 0 and s > 0 else 0.0
            assert seconds == pytest.approx([want_f, want_b, 0.0])
            assert 0.2 < factors[0] < 0.3 and 0.2 < factors[2] < 0.3
            assert 0.2 < factors[1] < 0.3 if s > 0 else factors[1] == 1.0  # (no B: the ratio)
    assert "mesh 0: 5 collectives over its model axes per micro-batch" in report.summary()
    cfg = jr.PipelineConfig(
        num_stages=2, stage_mesh_shape=(1, 4), mesh_axis_names=NAMES, num_micro_batches=4,
        backend="local", devices_per_host=1,
    )  # fmt: skip
    for choice in report.tried:
        (cut,) = [p for p, kind in enumerate(report.markers) if kind in choice.cuts]
        chunks = (range(cut + 1), range(cut + 1, len(WIDTHS)))
        for c, r in enumerate(chunks):
            per = [report.tensor_parallel_json[c]["collective_seconds"][s] for s in r]
            assert choice.sums.forward[c] == pytest.approx(sum(p[0] for p in per))
            assert choice.sums.input_grad[c] == pytest.approx(sum(p[1] for p in per))
            factors = report.tensor_parallel_json[c]["factors"]
            segs = [(report.segments[s], factors[s]) for s in r]
            assert choice.costs.forward[c] == pytest.approx(sum(g.forward * f[0] for g, f in segs))
            weight = sum(g.weight_grad * f[2] for g, f in segs)
            assert choice.costs.weight_grad[c] == pytest.approx(weight)
            assert choice.costs.backward[c] == pytest.approx(
                weight + sum((g.backward - g.weight_grad) * f[1] for g, f in segs)
            )
        summed = with_sums(choice.costs, choice.sums)
        schedule = _partition._schedule(cfg, summed)
        assert choice.step == pytest.approx(simulate(schedule.with_apply(), summed).makespan)

    # A segment of a column- and a row-parallel layer has both: its output summed in F, its
    # input's gradient in B (the forward's outputs kept beside the backward, as the runtime
    # sends them on).
    def pair(i, h, w):
        h = jax.numpy.tanh(h @ w)
        return jr.stage_candidate(h) if i in (1, 3) else h

    _, pairs = auto_report(
        make_step(layer=pair), params=megatron_params(), stage_mesh_shape=(1, 4),
        mesh_axis_names=NAMES,
    )  # fmt: skip
    ring = inside.all_reduce_seconds([[0, 1, 2, 3]], ROW)
    seconds = pairs.tensor_parallel_json[0]["collective_seconds"]
    np.testing.assert_allclose(
        seconds, [[ring, 0, 0], [ring, ring, 0], [ring, ring, 0]], atol=1e-12
    )
    params = megatron_params()
    got = step(params, OPT.init(params), make_batch())[2]
    want = jax.jit(make_step(pipelined=False))(init_params(), OPT.init(init_params()), make_batch())
    np.testing.assert_allclose(float(got), float(want[2]), rtol=1e-5)


def test_a_replicated_weight_gathers_its_gradient_in_w():
    """A weight replicated over `model` that reads a column-parallel layer's split output:
    its gradient comes out split and is gathered to its accumulator's layout in every W (an
    all-gather over the mesh), its forward's partial products summed in F."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(1, 4), NAMES)
    params = {
        k: jax.device_put(v, NamedSharding(mesh, P(None, "model") if i % 2 == 0 else P()))
        for i, (k, v) in enumerate(sorted(init_params().items()))
    }
    _, report = auto_report(params=params, stage_mesh_shape=(1, 4), mesh_axis_names=NAMES)
    inside = Cluster.from_devices(jax.devices()[:8])
    gather = inside.all_reduce_seconds([[0, 1, 2, 3]], 512 * 32 * 4, scatter=True)
    seconds = report.tensor_parallel_json[0]["collective_seconds"]
    for s in (1, 3, 5):
        assert seconds[s] == pytest.approx(
            [inside.all_reduce_seconds([[0, 1, 2, 3]], ROW), 0, gather]
        )
    for s in (0, 2, 4):
        assert seconds[s][2] == 0.0


def test_model_axis_collectives_across_hosts_weigh_on_the_choice(monkeypatch):
    """The same meshes priced on a cluster of 2 devices per host at 0.001 GB/s: each model
    axis spans two hosts, so every collective crosses a NIC; the chunks' collectives grow by
    the links' ratio and every choice's predicted step with them. A second mesh that only
    splits the batch (4, 1) divides its segments' compute by its batch share alone."""
    seen = {}
    choose = _partition.choose_cuts

    def spy(*args, **kwargs):
        seen["args"] = args
        return choose(*args, **kwargs)

    monkeypatch.setattr(_partition, "choose_cuts", spy)
    params = megatron_params()
    _, inside = auto_report(params=params, stage_mesh_shape=(1, 4), mesh_axis_names=NAMES)
    graph, markers, config, meshes, cluster, specs, _, _ = seen["args"]
    slow = Cluster.from_devices(
        jax.devices()[:8], devices_per_host=2, inter_host_gbytes_per_s=0.001
    )
    timed = [(s, 0) for s in inside.segments]
    report = choose(graph, markers, config, meshes, cluster, specs, lambda *_: timed, slow)
    ring = slow.all_reduce_seconds([[0, 1, 2, 3]], ROW)
    assert ring > 10 * Cluster.from_devices(jax.devices()[:8]).all_reduce_seconds(
        [[0, 1, 2, 3]], ROW
    )
    assert report.tensor_parallel_json[0]["collective_seconds"][1][0] == pytest.approx(ring)
    by_cuts = {c.cuts: c for c in inside.tried}
    for choice in report.tried:
        assert choice.step > by_cuts[choice.cuts].step
        assert sum(choice.sums.forward) > 10 * sum(by_cuts[choice.cuts].sums.forward)

    _, mixed = auto_report(params=params, stage_mesh_shape=((1, 4), (4, 1)), mesh_axis_names=NAMES)
    assert mixed.tensor_parallel_json[1]["factors"] == [[0.25] * 3] * len(WIDTHS)
    assert not any(map(any, mixed.tensor_parallel_json[1]["collective_seconds"]))
    assert mixed.tensor_parallel_json[0]["priced"]


def test_a_slice_this_process_cannot_compile_keeps_the_timed_compute(monkeypatch):
    """A Ray runtime's mesh is compiled on this process's CPU devices; one whose model axes
    need more than it has keeps one device's times, and the plan says why and what to set."""
    seen = {}
    choose = _partition.choose_cuts
    monkeypatch.setattr(
        _partition, "choose_cuts", lambda *a, **k: seen.setdefault("args", a) and choose(*a, **k)
    )
    auto_report(params=megatron_params(), stage_mesh_shape=(1, 4), mesh_axis_names=NAMES)
    graph, _, _, _, cluster, specs, _, _ = seen["args"]
    fits = VirtualMesh.from_ids((1, 4), NAMES, [0, 1, 2, 3], {0: 0, 1: 0, 2: 1, 3: 1})
    sliced = _model_slice(fits, "data")
    assert dict(sliced.shape) == {"data": 1, "model": 4}
    assert all(d.platform == "cpu" for d in sliced.devices.flat)
    wide = VirtualMesh.from_ids((1, 1024), NAMES, list(range(1024)))
    tensor = TensorParallel(graph, specs, "data", [fits, wide], [1, 1], cluster)
    assert tensor.priced == [True, False]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=1024" in tensor.notes[1]
    assert all(w.factors == (1.0, 1.0, 1.0) for w in tensor.work[1])
    assert "mesh 1: tensor-parallel work not priced" in "\n".join(tensor.summary())


def test_a_forward_only_step_prices_its_forwards():
    """An inference step pipelined forward only: each segment's forward alone is compiled for
    the slice, its compute divided and its collectives (the row-parallel layers' sums) in F."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(1, 4), NAMES)
    params = {
        k: jax.device_put(v, NamedSharding(mesh, P(None, "model") if i % 2 == 0 else P("model")))
        for i, (k, v) in enumerate(sorted(init_params().items()))
    }

    def forward(p, x):
        h = x
        for i in range(len(WIDTHS)):
            h = jax.numpy.tanh(h @ p[f"l{i}"])
            h = jr.stage_candidate(h) if i < len(WIDTHS) - 1 else h
        return h

    config = jr.PipelineConfig(
        partition="auto", num_stages=2, stage_mesh_shape=(1, 4), mesh_axis_names=NAMES,
        num_micro_batches=4, partition_trials=0, backend="local", devices_per_host=1,
    )  # fmt: skip
    step = jr.parallelize(forward, config=config, batch_argnums=1)
    x = make_batch()["x"]
    report = step.plan(params, x).partition
    ring = Cluster.from_devices(jax.devices()[:8]).all_reduce_seconds([[0, 1, 2, 3]], ROW)
    work = report.tensor_parallel_json[0]
    assert [s[0] for s in work["collective_seconds"]] == pytest.approx([0, ring] * 3)
    assert all(0.2 < f[0] < 0.3 for f in work["factors"])
    want = jax.jit(forward)(init_params(), x)
    np.testing.assert_allclose(np.asarray(step(params, x)), want, rtol=1e-5, atol=1e-6)
