"""The emulated cluster's pure parts: names, the description, preflight messages, and how a
driver reads the description. (The cluster itself: tests/test_netns.py, root only.)"""

import json

import pytest

from jaxreshard import cli as _cli
from jaxreshard.cluster import _describe, _emulated, _netns
from jaxreshard.cluster._describe import EmulatedCluster, HostInfo, links_of
from jaxreshard.comm import Cluster
from jaxreshard.runtime._ray import _host_nodes


def example(name="emu", nic_gbps=0.1, latency_ms=2.0):
    hosts = tuple(
        HostInfo(f"h{i}", f"jrs-{name}-h{i}", f"10.213.1.{10 + i}", (i % 2,)) for i in range(3)
    )
    return EmulatedCluster(
        name=name,
        address="10.213.1.2:6379",
        nic_gbps=nic_gbps,
        latency_ms=latency_ms,
        hosts=hosts,
        devices_per_host=2,
        head=HostInfo("head", f"jrs-{name}-head", "10.213.1.2"),
        subnet="10.213.1.0/24",
        driver_ip="10.213.1.1",
        object_store_mib=512,
    )


def test_description_has_the_issue_format_and_round_trips():
    c = example()
    data = json.loads(json.dumps(c.to_json()))
    assert data["format"] == "jaxreshard-cluster/1"
    for key in ("name", "address", "nic_gbps", "latency_ms", "hosts"):
        assert key in data
    assert data["hosts"][1] == {
        "name": "h1",
        "netns": "jrs-emu-h1",
        "ip": "10.213.1.11",
        "cpus": [1],
    }
    assert EmulatedCluster.from_json(data) == c
    with pytest.raises(ValueError, match="format is 'x', expected 'jaxreshard-cluster/1'"):
        EmulatedCluster.from_json({**data, "format": "x"})


def test_the_planner_model_comes_from_the_description():
    links = example(nic_gbps=0.1, latency_ms=2.0).links()
    assert links == {"inter_host_gbytes_per_s": 0.1, "latency_s": 0.002}
    cluster = Cluster(((0, 1), (2, 3)), **links)
    assert cluster.inter_host_bytes_per_s == pytest.approx(1e8)
    assert links_of({"latency_ms": 0}) == {"latency_s": 0.0}  # unshaped: the default bandwidth


@pytest.mark.parametrize("name", ["", "Emu", "1abc", "abcdefgh", "a-b", "a b", None])
def test_bad_cluster_names_say_the_rule(name):
    with pytest.raises(ValueError, match="1-7 lowercase letters or digits"):
        _netns.check_name(name)


def test_every_name_carries_the_cluster_prefix_and_fits_linux():
    bridge, prefix = _netns.names("abcdefg")
    assert prefix == "jrs-abcdefg-" and bridge.startswith(prefix)
    for node in ("head", "h0", "h63"):
        netns, link = _netns.host_names("abcdefg", node)
        assert netns.startswith(prefix) and link.startswith(prefix)
        assert len(link) <= 15 and len(bridge) <= 15  # IFNAMSIZ - 1


def test_missing_tools_and_capabilities_are_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(_netns.shutil, "which", lambda tool: None if tool == "tc" else "/bin/ip")
    monkeypatch.setattr(_netns, "_effective_capabilities", lambda: 1 << _netns._CAP_SYS_ADMIN)
    text = _netns.missing_requirements()
    assert "`tc` command of iproute2" in text and "apt-get install -y iproute2" in text
    assert "CAP_NET_ADMIN" in text and "CAP_SYS_ADMIN" not in text
    assert "--cap-add NET_ADMIN" in text and "sudo" in text
    assert "\n" not in text  # one paragraph
    with pytest.raises(_netns.ClusterUnavailable):
        _netns.require()


def test_cli_without_privileges_prints_the_paragraph_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setattr(_netns, "missing_requirements", lambda: "needs root, here is how.")
    code = _cli.main(["cluster", "up", "--hosts", "2", "--nic-gbps", "0.1", "--name", "nopriv"])
    err = capsys.readouterr().err
    assert code == 3
    assert "jaxreshard cluster up: needs root, here is how." in err
    assert "Traceback" not in err


def test_bad_up_arguments_fail_before_anything_is_made(monkeypatch):
    made = []
    monkeypatch.setattr(_netns, "run", lambda *a, **k: made.append(a) or "")
    with pytest.raises(ValueError, match=r"--hosts 0: must be an int in \[1, 64\]"):
        _emulated.up(0, 0.1, name="bad")
    with pytest.raises(ValueError, match="--nic-gbps -1: must be > 0 GB/s"):
        _emulated.up(2, -1, name="bad")
    with pytest.raises(ValueError, match=r"--cpus-per-host 9999: must be an int in \[1, "):
        _emulated.up(2, 0.1, cpus_per_host=9999, name="bad")
    assert made == []


def test_cpu_sets_share_the_cpus_round_robin(monkeypatch):
    monkeypatch.setattr(_emulated.os, "sched_getaffinity", lambda pid: {0, 1})
    assert _emulated._cpu_sets(3, 1) == [(0,), (1,), (0,)]
    assert _emulated._cpu_sets(2, 2) == [(0, 1), (0, 1)]
    assert _emulated._cpu_sets(2, None) == [None, None]


def test_a_driver_finds_its_node_address_only_for_clusters_of_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv(_describe.STATE_DIR_ENV, str(tmp_path))
    c = example(name="here")
    path = _describe.state_file("here")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**c.to_json(), "driver_ip": "127.0.0.1"}))
    assert _describe.known_names() == ["here"]
    assert _describe.read_state("here").address == c.address
    assert _describe.driver_ip_for(c.address) == "127.0.0.1"  # bindable here
    assert _describe.driver_ip_for("10.9.9.9:6379") is None
    # An address of another namespace (TEST-NET-2: documentation only, never assigned here).
    path.write_text(json.dumps({**c.to_json(), "driver_ip": "198.51.100.1"}))
    assert _describe.driver_ip_for(c.address) is None


def test_host_actors_go_to_the_nodes_marked_as_hosts_in_order():
    def node(ip, **resources):
        return {"NodeManagerAddress": ip, "Resources": {"CPU": 1.0, **resources}}

    head, driver = node("10.0.0.2"), node("10.0.0.1")
    h0, h1 = node("10.0.0.12", jaxreshard_host_0=1.0), node("10.0.0.11", jaxreshard_host_1=1.0)
    assert _host_nodes([head, h1, driver, h0]) == [h0, h1]
    # A cluster nobody described: every node, by address.
    assert _host_nodes([head, driver]) == [driver, head]
