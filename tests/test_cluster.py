"""The emulated cluster's pure parts: names, the description, preflight messages, and how a
driver reads the description. (The cluster itself: tests/test_netns.py, root only.)"""

import json
import os
import stat

import pytest

from jaxreshard import cli as _cli
from jaxreshard.cluster import _describe, _emulated, _netns
from jaxreshard.cluster._describe import EmulatedCluster, HostInfo, links_of
from jaxreshard.comm import Cluster
from jaxreshard.runtime.ray._start import _host_nodes


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


@pytest.mark.parametrize(
    "name", ["", "Emu", "1abc", "abcdefgh", "a-b", "a b", None, "ab\n", "abc\n\n", "\nab"]
)
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
    with pytest.raises(ValueError, match="--nic-gbps -1: must be a number of GB/s from 1e-05"):
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


# -- private state (issue 25): see [Note: private state] and [Note: Ray token] ------------------


@pytest.fixture
def state(tmp_path, monkeypatch):
    """A state directory of this test's own (made by `state_dir(create=True)`)."""
    monkeypatch.setenv(_describe.STATE_DIR_ENV, str(tmp_path / "jrs"))
    return _describe.state_dir(create=True)


def test_the_state_directory_is_made_private(state):
    assert stat.S_IMODE(os.lstat(state).st_mode) == 0o700
    folder = _describe.cluster_dir("emu", create=True)
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700


def test_a_state_directory_that_is_a_link_is_refused(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv(_describe.STATE_DIR_ENV, str(tmp_path / "link"))
    message = (
        rf"the cluster state directory {tmp_path}/link is a symbolic link \(to {real}\); it must "
        rf"be a real directory .*: remove the link \(`rm {tmp_path}/link`\) or point "
        "JAXRESHARD_CLUSTER_DIR at a directory of your own"
    )
    uses = (
        _describe.state_dir,
        lambda: _describe.state_dir(create=True),
        _describe.known_names,
        lambda: _describe.read_state("emu"),
        lambda: _describe.driver_ip_for("10.213.1.2:6379"),
    )
    for use in uses:
        with pytest.raises(PermissionError, match=message):
            use()


def test_a_state_directory_others_may_write_to_is_refused(state):
    os.chmod(state, 0o777)
    with pytest.raises(
        PermissionError,
        match=rf"{state} is writable by group or others \(mode 0777\).*`chmod 700 {state}`",
    ):
        _describe.state_dir()
    os.chmod(state, 0o755)  # readable is fine: the token file itself is 0600
    assert _describe.state_dir() == state


def test_a_state_directory_of_another_user_is_refused(state, monkeypatch):
    owner = os.getuid()
    monkeypatch.setattr(_describe.os, "getuid", lambda: owner + 4242)
    with pytest.raises(
        PermissionError,
        match=rf"{state} belongs to uid {owner}, not to this user \(uid {owner + 4242}\).*"
        rf"remove it as its owner \(`rm -r {state}`\)",
    ):
        _describe.state_dir()


def test_a_file_where_the_state_directory_should_be_is_refused(tmp_path, monkeypatch):
    (tmp_path / "jrs").write_text("")
    monkeypatch.setenv(_describe.STATE_DIR_ENV, str(tmp_path / "jrs"))
    with pytest.raises(PermissionError, match="jrs is not a directory"):
        _describe.state_dir(create=True)


def test_a_cluster_folder_that_is_a_link_is_refused(state, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (state / "emu").symlink_to(elsewhere)
    with pytest.raises(
        PermissionError, match=r"the state directory of cluster 'emu' .* is a symbolic link"
    ):
        _describe.read_state("emu")


def test_state_files_are_written_whole_and_links_in_their_place_never_followed(state, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    folder = _describe.cluster_dir("emu", create=True)
    (folder / "cluster.json").symlink_to(victim)
    with pytest.raises(PermissionError, match=r"cluster.json is a symbolic link \(to .*victim\)"):
        _describe.read_state("emu")
    c = example()
    _describe.write_state(c)  # replaces the link itself, not what it points to
    assert victim.read_text() == "keep me"
    assert _describe.read_state("emu") == c
    info = os.lstat(folder / "cluster.json")
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert sorted(p.name for p in folder.iterdir()) == ["cluster.json"]  # no temporary file left


def test_the_lock_never_truncates_what_a_planted_link_points_to(state, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (state / ".lock").symlink_to(victim)
    with pytest.raises(PermissionError, match=r"\.lock is a symbolic link"), _emulated._lock():
        pass
    assert victim.read_text() == "keep me"
    (state / ".lock").unlink()
    with _emulated._lock():
        assert stat.S_IMODE(os.lstat(state / ".lock").st_mode) == 0o600


def test_every_node_starts_with_the_clusters_own_ray_token(state, monkeypatch):
    c = example()
    _describe.cluster_dir("emu", create=True)
    _emulated._make_token("emu")
    token = _describe.token_file("emu")
    assert stat.S_IMODE(os.lstat(token).st_mode) == 0o600
    assert len(token.read_text()) == 64 and int(token.read_text(), 16) >= 0  # 256 random bits
    started = []
    monkeypatch.setattr(
        _emulated.subprocess, "Popen", lambda command, **kw: started.append((command, kw))
    )
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a token of someone else")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    _emulated._ray_start(c, c.hosts[0], ["--address=10.213.1.2:6379"])
    ((command, kw),) = started
    assert command[:3] == ["ip", "netns", "exec"] and "--address=10.213.1.2:6379" in command
    env = kw["env"]
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert "RAY_AUTH_TOKEN" not in env
    log = _describe.cluster_dir("emu") / "h0" / "ray-start.log"
    assert stat.S_IMODE(os.lstat(log).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(log.parent).st_mode) == 0o700


def test_a_driver_of_this_machine_finds_the_clusters_token(state):
    c = example(name="here")
    _describe.cluster_dir("here", create=True)
    _describe.write_state(c)
    assert _describe.ray_token_for(c.address) is None  # a cluster without one
    _emulated._make_token("here")
    assert _describe.ray_token_for(c.address) == _describe.token_file("here")
    assert _describe.ray_token_for("10.9.9.9:6379") is None


def test_ray_auth_holds_the_token_only_while_inside(tmp_path, monkeypatch, no_runtime):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "mine")
    token = tmp_path / "token"
    token.write_text("0" * 64)
    with _describe.ray_auth(token):
        assert os.environ["RAY_AUTH_MODE"] == "token"
        assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(token)
        assert "RAY_AUTH_TOKEN" not in os.environ
    assert "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ
    assert os.environ["RAY_AUTH_TOKEN"] == "mine"
    with _describe.ray_auth(None):  # no token: nothing changes
        assert "RAY_AUTH_MODE" not in os.environ


def test_ray_auth_refuses_another_token_while_this_process_is_connected(tmp_path, monkeypatch):
    """Ray reads the token once per process and every connection sends it: holding another
    cluster's token while connected would make this process's own Ray calls fail."""
    import ray

    token = tmp_path / "token"
    token.write_text("0" * 64)
    before = {k: os.environ.get(k) for k in _describe._RAY_AUTH_ENV}
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    refused = pytest.raises(RuntimeError, match=r"connected to Ray.*jaxreshard.shutdown\(\)")
    with refused, _describe.ray_auth(token):
        pass
    assert {k: os.environ.get(k) for k in _describe._RAY_AUTH_ENV} == before
