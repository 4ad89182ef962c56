"""No leaks on Ray: the host actors let a pipeline go when the driver drops it, closes it
(`Parallelized.close`) or shuts the runtime down (see [Note: pipeline lifetime])."""

import gc
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxreshard as jr

pytestmark = pytest.mark.ray

HIDDEN, FEATURES, ROWS = 8, 6, 8
# Threads a pipeline makes in a host actor: its receive pool, its channels' senders, a step's
# stage threads, a completion wait (the process-wide copy pool and the transports' own are not
# a pipeline's).
PIPELINE_THREADS = (
    "jaxreshard-recv",
    "jaxreshard-send",
    "jaxreshard-rank",
    "jaxreshard-stage",
    "jaxreshard-wait",
)


def make_step():
    """A 2-stage MLP (as tests/test_parallelize.py's `make_step(2)`)."""

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["emb"])
            h = jr.stage_boundary(h)
            h = jnp.tanh(h @ p["w1"] + p["b1"])
            return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

        loss, grads = jr.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads), loss

    return step


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "emb": rng.normal(size=(FEATURES, HIDDEN)).astype(np.float32) * 0.4,
        "out": rng.normal(size=(HIDDEN, FEATURES)).astype(np.float32) * 0.4,
        "w1": rng.normal(size=(HIDDEN, HIDDEN)).astype(np.float32) * 0.4,
        "b1": rng.normal(size=(HIDDEN,)).astype(np.float32) * 0.1,
    }


def make_batch(seed=1):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
        "y": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
    }


def parallelized():
    cfg = jr.PipelineConfig(
        stage_mesh_shape=(1, 2),
        mesh_axis_names=("data", "model"),
        num_micro_batches=2,
        backend="ray",
    )
    return jr.parallelize(make_step(), config=cfg, batch_argnums=(1,))


def held(rt):
    """Each host's `HostActor.held()`, with its pipeline threads alone under 'threads'."""
    import ray

    reports = ray.get([a.held.remote() for a in rt.actors], timeout=60)
    for report in reports:
        report["threads"] = sorted(t for t in report["threads"] if t.startswith(PIPELINE_THREADS))
    return reports


def held_once(rt, done, timeout_s=30.0):
    """The hosts' reports once `done(reports)` holds (drops and frees are messages: the hosts
    take them in their own time), or the last ones."""
    deadline = time.monotonic() + timeout_s
    reports = held(rt)
    while not done(reports) and time.monotonic() < deadline:
        time.sleep(0.1)
        reports = held(rt)
    return reports


def settled(rt):
    """The hosts' reports once the driver's dropped handles (of earlier tests too) are freed
    there: garbage collected here, frees sent, and two reports in a row alike."""
    gc.collect()
    rt.flush_frees()
    last = held(rt)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = held(rt)
        if [r["arrays"] for r in now] == [r["arrays"] for r in last]:
            return now
        last = now
    return last


def _run_and_drop(rt, before):
    """Build, run and drop a parallelized step; check that the hosts let its pipeline go (and
    its threads), and its outputs once those are dropped too. The hosts' live jax.Arrays then."""
    from jaxreshard.runtime.driver import _lifetime

    step = parallelized()
    params, batch = make_params(), make_batch()
    new_params, loss = step(params, batch)
    ref_params, ref_loss = jax.jit(make_step())(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    (entry,) = step._cache.values()
    pipe = entry.pipeline
    key, hosts = pipe.key, list(pipe.hosts)
    assert len(hosts) == 2 and pipe in _lifetime._pipelines  # jaxreshard.shutdown() would close it
    during = held(rt)
    for h in hosts:  # each host keeps it, with its channels' threads
        assert key in during[h]["pipelines"]
        assert during[h]["threads"], during[h]
    dead = weakref.ref(pipe)
    del step, entry, pipe
    gc.collect()
    assert dead() is None  # nothing (its finalizer, the runtime's list) keeps it alive

    after = held_once(
        rt, lambda rs: all(key not in r["pipelines"] and not r["threads"] for r in rs)
    )
    for h, report in enumerate(after):
        assert key not in report["pipelines"], (h, report)
        assert report["threads"] == [], (h, report)
        assert report["pipelines"] == before[h]["pipelines"]

    # The step's outputs outlive its pipeline (they are the next step's inputs) until dropped.
    assert isinstance(new_params["w1"], jr.RemoteArray)
    np.testing.assert_allclose(
        new_params["w1"].fetch(), np.asarray(ref_params["w1"]), rtol=1e-5, atol=1e-6
    )
    del new_params, loss
    gc.collect()
    rt.flush_frees()
    freed = held_once(
        rt, lambda rs: all(set(r["arrays"]) <= set(b["arrays"]) for r, b in zip(rs, before))
    )
    for h, (report, was) in enumerate(zip(freed, before)):
        assert not [a for a in report["arrays"] if a.startswith(key)], h  # none of its arrays
        assert set(report["arrays"]) <= set(was["arrays"]), h  # and nothing else new
    return [r["live_arrays"] for r in freed]


def test_a_dropped_pipeline_leaves_nothing_on_the_hosts(ray_runtime):
    rt = ray_runtime
    before = settled(rt)  # (handles earlier tests dropped may still be on their way)
    first = _run_and_drop(rt, before)
    # A second pipeline, dropped too, leaves no more live arrays on any host than the first (a
    # transport may hold on to its last message's payload: that is not a pipeline's).
    second = _run_and_drop(rt, before)
    # (an array a host's own reference cycle holds goes at its next collection: wait for it)
    second = [
        r["live_arrays"]
        for r in held_once(
            rt, lambda rs: all(r["live_arrays"] <= a for r, a in zip(rs, first)), timeout_s=15.0
        )
    ]
    assert all(b <= a for a, b in zip(first, second)), (first, second)


def test_close_drops_the_pipeline_and_the_next_call_compiles_again(ray_runtime):
    rt = ray_runtime
    step = parallelized()
    params, batch = make_params(), make_batch()
    _, first = step(params, batch)
    pipe = step.pipeline(params, batch)
    key = pipe.key
    assert not pipe.closed and all(key in held(rt)[h]["pipelines"] for h in pipe.hosts)

    step.close()  # waits (a few seconds at most) for the hosts to drop it
    assert pipe.closed
    reports = held(rt)
    assert all(key not in r["pipelines"] for r in reports)
    with pytest.raises(RuntimeError, match=f"pipeline {key} was closed"):
        pipe.run([])
    pipe.close()  # idempotent

    _, again = step(params, batch)  # compiles again, on new host pipelines
    new = step.pipeline(params, batch)
    assert new is not pipe and new.key != key and not new.closed
    np.testing.assert_allclose(float(again), float(first), rtol=1e-6)
    assert all(new.key in held(rt)[h]["pipelines"] for h in new.hosts)
    step.close()
    assert all(new.key not in r["pipelines"] for r in held(rt))


def test_a_pipeline_dropped_by_the_driver_is_an_error_on_its_hosts(ray_runtime):
    """A host that was told to drop a pipeline says so to a late call, and takes a late peer
    signal or progress probe quietly."""
    import ray

    rt = ray_runtime
    step = parallelized()
    params, batch = make_params(), make_batch()
    step(params, batch)
    pipe = step.pipeline(params, batch)
    key, host = pipe.key, pipe.hosts[0]
    step.close()
    actor = rt.actors[host]
    assert ray.get(actor.pipeline_drop.remote(key), timeout=60) is False  # gone already
    assert ray.get(actor.pipeline_progress.remote(key, f"{key}:0"), timeout=60) == (
        0,
        "nothing",
        0.0,
    )
    with pytest.raises(ray.exceptions.RayTaskError, match="closed by the driver"):
        ray.get(actor.pipeline_segment.remote(key, 0, f"{key}:1", []), timeout=60)


def test_a_cluster_reconnected_by_a_late_thread_still_shuts_down(monkeypatch):
    """A thread of ours that calls Ray after `ray.shutdown()` connects this process to the local
    cluster again (Ray's auto-init), and Ray then refuses to remove the head; the shutdown
    disconnects and tries again (a full test run once failed there). Other errors are raised.
    (`ray.shutdown` is a stand-in here: the real one would end the shared runtime's actors,
    which share the fate of this driver.)"""
    import ray

    from jaxreshard.runtime.ray._runtime import _shutdown_cluster

    disconnects = []
    monkeypatch.setattr(ray, "shutdown", lambda: disconnects.append(1))

    class Cluster:
        def __init__(self, errors):
            self.errors, self.calls = list(errors), 0

        def shutdown(self):
            self.calls += 1
            if self.errors:
                raise self.errors.pop(0)

    refused = ValueError("Removing a node that is connected to this Ray client is not allowed")
    cluster = Cluster([refused, refused])
    _shutdown_cluster(cluster)
    assert cluster.calls == 3 and len(disconnects) == 2
    with pytest.raises(ValueError, match="connected to this Ray client"):
        _shutdown_cluster(Cluster([refused] * 3))
    with pytest.raises(ValueError, match="something else"):
        _shutdown_cluster(Cluster([ValueError("something else")]))
