"""A real emulated cluster: network namespaces, shaped NICs, one Ray node each (root only).

One 2-host cluster serves the whole module (Ray start-ups are slow on 2 cores); the last test
takes it down and checks that nothing is left.
"""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxreshard
from jaxreshard import cli as _cli
from jaxreshard.cluster import _emulated, _netns, emulated, measure_tcp, status
from jaxreshard.cluster._describe import state_file

pytestmark = [
    pytest.mark.netns,
    pytest.mark.ray,
    pytest.mark.skipif(
        _netns.missing_requirements() is not None,
        reason=f"emulated cluster unavailable: {_netns.missing_requirements()}",
    ),
]

# A name of this run's own: a cluster left up by an earlier, interrupted run (its state outlives
# the process, as `cluster up`'s must) would otherwise refuse this one. Names are 1-7 characters.
NAME = f"t{os.getpid() % 10**6:06d}"
NIC_GBPS = 0.1


@pytest.fixture(scope="module")
def cluster():
    jaxreshard.shutdown()  # a Ray runtime of earlier tests would hold this process's Ray
    with emulated(
        hosts=4,
        nic_gbps=NIC_GBPS,
        cpus_per_host=1,
        devices_per_host=2,
        name=NAME,
        object_store_mib=256,
    ) as c:
        yield c
    # (`down` ran on exit; the last test checks what it leaves.)


def _ours(name):
    """Namespaces, root links and Ray processes of cluster `name`."""
    prefix = _netns.names(name)[1]
    namespaces = _netns.namespaces(prefix)
    pids = [p for ns in namespaces for p in _netns.pids_in(ns)]
    pids += _netns.processes_under(str(state_file(name).parent) + os.sep)
    return namespaces, _netns.links(prefix), pids


def test_the_cluster_is_up_with_shaped_nics_in_both_directions(cluster):
    (info,) = status(NAME)
    assert info["state"] == "up", info
    assert info["format"] == "jaxreshard-cluster/1" and info["nic_gbps"] == NIC_GBPS
    assert [n["name"] for n in info["nodes"]] == ["head", "h0", "h1", "h2", "h3", "driver"]
    assert info["planner_links"]["inter_host_gbytes_per_s"] == NIC_GBPS
    for host in cluster.hosts:
        netns, link = _netns.host_names(NAME, host.name)
        sending = _netns.run(["tc", "-n", netns, "qdisc", "show", "dev", "eth0"])
        receiving = _netns.run(["tc", "qdisc", "show", "dev", link])
        for text in (sending, receiving):
            assert "tbf" in text and "rate 800Mbit" in text, text
        # Every process of the host (raylet, agents, workers) runs on the host's pinned CPUs.
        pids = _netns.pids_in(netns)
        assert pids and all(os.sched_getaffinity(p) == set(host.cpus) for p in pids), host


PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"cluster", b"jaxreshard", timeout=10)
    print("read")
except Exception as e:
    print("refused:", type(e).__name__, e)
"""


@pytest.mark.parametrize("auth", ["none", "wrong", "the cluster's"])
def test_ray_serves_only_who_holds_the_clusters_token(cluster, auth):
    token = state_file(NAME).parent / "ray-token"
    assert oct(os.lstat(token).st_mode & 0o777) == "0o600"
    assert oct(os.lstat(token.parent).st_mode & 0o777) == "0o700"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    if auth == "wrong":
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)
    elif auth == "the cluster's":
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    probe = [sys.executable, "-c", PROBE, cluster.address]
    out = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=120).stdout
    if auth == "the cluster's":
        assert out.strip() == "read", out
    else:
        assert "refused:" in out and "InvalidAuthToken" in out, out


def test_a_plain_tcp_transfer_runs_at_the_set_rate(cluster):
    # The explicit check: within +-20% of the set rate (16 MiB, one retry for noise).
    for _ in range(2):
        result = measure_tcp(cluster, 0, 1, 16 * 2**20)
        if 0.8 <= result["of_nic"] <= 1.2:
            break
    assert 0.8 <= result["of_nic"] <= 1.2, result


def test_a_reshard_across_the_cluster_is_correct(cluster):
    rt = jaxreshard.init("ray", address=cluster.address, timeout_s=60)
    try:
        assert rt.transport == "tcp"
        assert rt.description["name"] == NAME
        assert rt.cluster.inter_host_gbytes_per_s == NIC_GBPS  # the shaped NIC, from the cluster
        assert rt.cluster.hosts == ((0, 1), (2, 3), (4, 5), (6, 7))
        src = rt.sharding(rt.mesh((2,), ("x",), [0, 1]), P("x"))
        dst = rt.sharding(rt.mesh((2,), ("x",), [2, 3]), P(None, "x"))
        value = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)
        x = rt.put(value, src)
        for strategy in ("auto", "send_recv", "broadcast_naive"):
            assert np.array_equal(rt.reshard(x, dst, strategy=strategy).fetch(), value), strategy
        assert np.array_equal(rt.reshard_naive(x, dst).fetch(), value)
    finally:
        jaxreshard.shutdown()


def test_stages_that_span_hosts_train_over_the_shaped_links(cluster):
    """Stage 0 on a (1, 4) mesh over hosts 0-1, stage 1 on (2, 2) over hosts 2-3 (see
    [Note: multi-host stages]): the host actors joined one jax.distributed runtime in their
    namespaces, each stage's collectives (gloo) and the boundary tensors (a layout change, a
    skip connection, a tied parameter) cross the shaped NICs; the same numbers as jax.jit."""
    from test_parallelize import assert_same, make_batch, make_params, make_step, run_steps

    rt = jaxreshard.init("ray", address=cluster.address, timeout_s=60)
    try:
        assert rt.distributed
        cfg = jaxreshard.PipelineConfig(
            stage_mesh_shape=[(1, 4), (2, 2)],
            mesh_axis_names=("data", "model"),
            num_micro_batches=2,
            backend="ray",
        )
        model = make_step(2, skip=True, shared=True)
        step = jaxreshard.parallelize(model, config=cfg, batch_argnums=(1,))
        got = run_steps(step, make_params(2), make_batch())
        pipe = step.pipeline(got[0], make_batch())
        assert pipe.hosts_of_stage == {0: (0, 1), 1: (2, 3)}
        assert_same(*got, *run_steps(jax.jit(model), make_params(2), make_batch()))
    finally:
        jaxreshard.shutdown()


def test_bench_reshard_runs_on_the_cluster_and_reports_predictions(cluster, tmp_path):
    cases = {
        "format": "jaxreshard-reshard-cases/1",
        "cluster": {"devices_per_host": 2, "inter_host_gbytes_per_s": 1.25},
        "cases": [
            {
                "name": "tiny",
                "shape": [64, 256],
                "dtype": "float32",
                "src_mesh": {"shape": [1, 2], "axis_names": ["x", "y"]},
                "src_spec": ["y", None],
                "dst_mesh": {"shape": [1, 2], "axis_names": ["x", "y"]},
                "dst_spec": [None, None],
            }
        ],
    }
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "out.json"
    args = ["bench", "reshard", "--cases", str(tmp_path / "cases.json"), "--strategies", "auto"]
    args += ["--execute", "ray", "--address", cluster.address, "--scale", "1", "--repeats", "1"]
    code = _cli.main([*args, "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["cluster_model"]["inter_host_gbytes_per_s"] == NIC_GBPS  # not the file's 1.25
    executed = result["cases"][0]["executed"]
    assert executed["correct"]
    for key in ("seconds", "predicted_seconds", "baseline_seconds", "baseline_predicted_seconds"):
        assert executed[key] > 0, key


DRIVER = """
import sys, numpy as np, jaxreshard
from jax.sharding import PartitionSpec as P
rt = jaxreshard.init("ray", address=sys.argv[1], timeout_s=60)
src = rt.sharding(rt.mesh((2,), ("x",), [0, 1]), P("x"))
dst = rt.sharding(rt.mesh((2,), ("x",), [2, 3]), P())
x = rt.put(np.ones((1024, 2048), np.float32), src)
while True:
    rt.reshard(x, dst).free()
    print("running", flush=True)
"""


def test_a_killed_driver_leaves_a_usable_cluster(cluster, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    driver = subprocess.Popen(
        [sys.executable, str(script), cluster.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert driver.stdout.readline().strip() == "running"  # mid-run: reshards in flight
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(30)
    (info,) = status(NAME)
    assert info["state"] == "up"


def test_a_profiles_measured_transfer_time_is_the_wires(cluster):
    """A profile measures a transfer from the start of its send to its arrival at the last
    receiver: a boundary activation of 1 MiB between two hosts cannot cross a 0.1 GB/s NIC in
    less than 10.5 ms, whatever the sender's own part took."""
    from jaxreshard.profiler._measured import transfer_stats
    from jaxreshard.profiler._run import StepRecord

    rows, width = 64, 4096  # 1 MiB of float32 per micro-batch
    jaxreshard.init("ray", address=cluster.address, timeout_s=60)
    try:

        def step(params, batch):
            def loss_fn(p):
                h = jax.numpy.tanh(batch["x"] @ p["a"])
                h = jaxreshard.stage_boundary(h)
                return jax.numpy.mean((h @ p["b"]) ** 2)

            loss, grads = jaxreshard.value_and_grad(loss_fn)(params)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

        cfg = jaxreshard.PipelineConfig(
            stage_mesh_shape=(1, 2),
            mesh_axis_names=("data", "model"),
            num_micro_batches=2,
            backend="ray",
        )
        rng = np.random.default_rng(0)
        params = {
            "a": rng.normal(size=(8, width)).astype(np.float32) * 0.1,
            "b": rng.normal(size=(width, 8)).astype(np.float32) * 0.1,
        }
        batch = {"x": rng.normal(size=(2 * rows, 8)).astype(np.float32)}
        pstep = jaxreshard.parallelize(step, config=cfg, batch_argnums=(1,))
        records = []
        for _ in range(3):
            start = time.perf_counter()
            (params, _), events = pstep.profile_call(params, batch)
            shifted = [
                dataclasses.replace(e, start=e.start - start, end=e.end - start) for e in events
            ]
            records.append(StepRecord(time.perf_counter() - start, 0.0, shifted))
        layout = pstep.pipeline(params, batch).layout
        (act,) = [r for r in transfer_stats(records[1:], layout) if r["kind"] == "act"]
        assert act["bytes"] == rows * width * 4
        wire = act["bytes"] / (NIC_GBPS * 1e9)
        assert act["measured_seconds"] >= 0.9 * wire, (act["measured_seconds"], wire)
        assert act["measured_seconds"] < 20 * wire + 1.0
    finally:
        jaxreshard.shutdown()


def test_a_host_that_loses_power_is_survived_by_train_elastic(cluster, tmp_path):
    """Host 3 loses power (every process in its namespace SIGKILLed) after step 5: the driver's
    `train_elastic` waits until Ray drops its node, starts again on hosts 0-2 as 3 stages (from
    2 stages whose meshes spanned 2 hosts each), restores the newest checkpoint (written by the
    hosts, each stage's pair together) into that layout, and every loss equals jax.jit's; then
    a 48 MiB checkpoint on the 3 hosts is written and read a third by each. The driver is
    `benchmarks/elastic_emulated.py` in a process of its own (see its `child`). It kills a host
    of the module's cluster: it runs last before `down`."""
    out = tmp_path / "elastic.json"
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "elastic_emulated.py"
    command = [sys.executable, str(script), "--child", cluster.address, "--name", NAME,
               "--steps", "8", "--child-json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    data = json.loads(out.read_text())
    assert data["layouts"] == [4, 3]
    history = data["history"]
    resumed = next(i for i, (_, _, hosts) in enumerate(history) if hosts == 3)
    first = history[resumed][0]
    assert first in (5, 7)  # from the step-4 or the step-6 checkpoint
    assert [s for s, _, _ in history[resumed:]] == list(range(first, 9))
    want = data["jit_losses"]
    np.testing.assert_allclose([x for _, x, _ in history], [want[s - 1] for s, _, _ in history],
                               rtol=1e-5)  # fmt: skip
    c = data["checkpoint"]
    state = c["mib"] * 2**20
    for bytes_by_host in (c["written_bytes"], c["read_bytes"]):
        assert sorted(bytes_by_host) == ["0", "1", "2"]
        assert all(0.25 < n / state < 0.4 for n in bytes_by_host.values()), bytes_by_host


def test_down_leaves_no_namespace_link_or_ray_process(cluster):
    namespaces, links, pids = _ours(NAME)
    assert len(namespaces) == 5 and links and pids  # head + 4 hosts; bridge; Ray processes
    removed = _emulated.down(NAME)
    assert sorted(removed["namespaces"]) == namespaces and not removed["stuck_pids"]
    assert _ours(NAME) == ([], [], [])
    deadline = time.monotonic() + 10
    while any(_netns._alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _netns._alive(p)]
    assert not state_file(NAME).parent.exists()
    again = _emulated.down(NAME)  # idempotent
    assert again["namespaces"] == [] and again["links"] == []


def test_a_crashed_up_removes_what_it_made(monkeypatch):
    def crash(cluster, timeout_s):
        assert len(_netns.namespaces(_netns.names("jrscrsh")[1])) == 3  # head + 2 hosts
        raise RuntimeError("ray start crashed")

    monkeypatch.setattr(_emulated, "_start_ray", crash)
    with pytest.raises(RuntimeError, match="ray start crashed"):
        _emulated.up(2, 0.5, name="jrscrsh")
    assert _ours("jrscrsh") == ([], [], [])
    assert not state_file("jrscrsh").exists()


def test_latency_is_a_netem_delay_or_a_clear_error(monkeypatch):
    qdiscs = []

    def stop(cluster, timeout_s):
        netns, _ = _netns.host_names("jrsdly", "h0")
        qdiscs.append(_netns.run(["tc", "-n", netns, "qdisc", "show", "dev", "eth0"]))
        raise RuntimeError("stop here")

    monkeypatch.setattr(_emulated, "_start_ray", stop)
    try:
        _emulated.up(2, 0.5, latency_ms=2.0, name="jrsdly")
    except _netns.ClusterUnavailable as e:  # this kernel has no netem
        assert "needs the netem qdisc" in str(e) and "without --latency-ms" in str(e)
    except RuntimeError as e:
        assert "stop here" in str(e)
        assert "netem" in qdiscs[0] and "delay 2ms" in qdiscs[0] and "tbf" in qdiscs[0]
    assert _ours("jrsdly") == ([], [], [])


def test_down_cleans_leftovers_and_touches_no_other_cluster():
    subnet = _netns.pick_subnet()
    keep_subnet = _netns.pick_subnet(taken=[str(subnet)])
    try:
        for name, net in (("jrsleft", subnet), ("jrskeep", keep_subnet)):
            _netns.make_bridge(name, f"{net.network_address + 1}/24")
            address = f"{net.network_address + 10}/24"
            _netns.make_host(name, "h0", address, _netns.Shaping(0.5))
        # A crashed `up` of "jrsleft" (no state file, no Ray) is still removed by name.
        _emulated.down("jrsleft")
        assert _ours("jrsleft") == ([], [], [])
        namespaces, links, _ = _ours("jrskeep")
        assert namespaces == ["jrs-jrskeep-h0"]
        assert sorted(links) == ["jrs-jrskeep-br", "jrs-jrskeep-h0"]
    finally:
        _emulated.down("jrsleft")
        _emulated.down("jrskeep")
    assert _ours("jrskeep") == ([], [], [])
