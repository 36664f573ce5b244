"""Lab topology: schema validation with key-named errors, derived names and addresses."""
from __future__ import annotations

import ipaddress

import pytest

from mrc_xdp.lab import topology as T


def base(**over):
    d = {"planes": 2, "t0_per_plane": 2, "t1_per_plane": 2,
         "hosts": [{"name": "h0", "t0": 0}, {"name": "h1", "t0": 0},
                   {"name": "h2", "t0": 1}, {"name": "h3", "t0": 1}]}
    d.update(over)
    return d


def test_default_file_matches_the_brief():
    t = T.load()
    assert (t.mode, t.planes, t.t0_per_plane, t.t1_per_plane) == ("srv6", 2, 2, 2)
    assert [(h.name, h.t0) for h in t.hosts] == [("h0", 0), ("h1", 0), ("h2", 1), ("h3", 1)]
    assert len(t.nodes) == 12 and len(t.links) == 16
    assert t.rate_host == t.rate_fabric == 10 * 10**9
    assert t.host("h0").addr == "fd00:100::1" and t.host("h3").addr == "fd00:100::4"
    assert T.load(mode="ecmp").mode == "ecmp"


def test_ifindexes_and_macs_unique_across_the_lab():
    t = T.load()
    ports = [p for n in t.nodes.values() for p in n.ports]
    idx = [p.ifindex for p in ports] + [i for h in t.hosts for i in (h.app_ifindex, h.fab_ifindex)]
    assert len(set(idx)) == len(idx) == 40
    assert min(idx) >= T.IFINDEX_BASE
    assert len({p.mac for p in ports}) == len(ports)
    assert all(p.mac == T.mac_of(p.ifindex) for p in ports)
    # link ends: each link's two ports are on different nodes, addresses in one /64
    for lk in t.links:
        net = ipaddress.IPv6Network(lk.subnet)
        assert ipaddress.IPv6Address(lk.a.addr) in net and ipaddress.IPv6Address(lk.b.addr) in net
        assert lk.a.peer is lk.b and lk.b.peer is lk.a


def test_names():
    t = T.load()
    assert sorted(n for n in t.nodes if n.startswith("p0")) == ["p0t0s0", "p0t0s1", "p0t1s0", "p0t1s1"]
    names = [lk.name for lk in t.links]
    assert "h0-p0t0s0" in names and "h2-p1t0s1" in names and "p1t0s1-p1t1s0" in names
    assert t.port("p0t0s0", "h0").peer.node == "h0"
    assert t.port("p0t1s1", "t0s0").peer.node == "p0t0s0"
    assert t.gateway("h2", 1).node == "p1t0s1"
    ends = [e[0] for e in t.link_ends()]
    assert len(ends) == 32 and "p0t0s0>h0" in ends and "h0>p0t0s0" in ends


def test_usid_plan_and_paths():
    t = T.load()
    assert t.nodes["p1t0s1"].usid() == 0x1101
    assert t.nodes["p1t1s0"].usid() == 0x1200
    assert t.nodes["h2"].usid(1) == 0x1302
    assert t.srv6_usids("h0", "h2") == [0x0100, 0x0200, 0x0101, 0x0302]
    assert t.srv6_usids("h0", "h1") == [0x0100, 0x0301]
    assert t.path_usids("h0", "h2", 1, 1) == [0x1100, 0x1201, 0x1101, 0x1302]
    assert t.usid_addr(t.path_usids("h0", "h2", 1, 1)) == "fcbb:0:1100:1201:1101:1302::"
    assert t.host_locator("h3", 1) == "fcbb:0:1303::"
    assert t.path_nodes("h0", "h2", 0, 1) == ["h0", "p0t0s0", "p0t1s1", "p0t0s1", "h2"]
    assert t.path_nodes("h0", "h1", 1) == ["h0", "p1t0s0", "h1"]


@pytest.mark.parametrize("over,msg", [
    ({"mode": "bgp"}, "mode:"),
    ({"planes": 9}, "planes: 9 is out of range"),
    ({"planes": "2"}, "planes: '2' is not an integer"),
    ({"t1_per_plane": 0}, "t1_per_plane: 0 is out of range"),
    ({"hosts": []}, "hosts: at least one"),
    ({"hosts": [{"name": "h0", "t0": 2}]}, "hosts[0].t0: 2 is out of range [0, 1]"),
    ({"hosts": [{"name": "h0"}]}, "hosts[0].t0: required"),
    ({"hosts": [{"name": "H0!", "t0": 0}]}, "hosts[0].name:"),
    ({"hosts": [{"name": "h0", "t0": 0}, {"name": "h0", "t0": 1}]}, "hosts[1].name: duplicate host"),
    ({"hosts": [{"name": "p0t0s1", "t0": 0}]}, "hosts[0].name: 'p0t0s1' is reserved"),
    ({"hosts": [{"name": "h0", "t0": 0, "nic": 1}]}, "hosts[0].nic: unknown key"),
    ({"capacity": {"host_t0": "fast"}}, "capacity.host_t0: 'fast' is not a rate"),
    ({"capacity": {"spine": "1gbit"}}, "capacity.spine: unknown key"),
    ({"addressing": {"base": "fd00::/64"}}, "addressing.base: fd00::/64 is longer than /48"),
    ({"addressing": {"base": "nope"}}, "addressing.base: 'nope' is not an IPv6 prefix"),
    ({"addressing": {"srv6_block": "fd00:100::/32", "base": "fd00:100::/48"}}, "addressing.srv6_block:"),
    ({"linkmodel": {"dscp_ctrl": 64}}, "linkmodel.dscp_ctrl: 64 is out of range"),
    ({"linkmodel": {"ecn": 1}}, "linkmodel.ecn: unknown key"),
    ({"app_mtu": 1590}, "app_mtu: 1590 is out of range"),
    ({"colour": "red"}, "colour: unknown key"),
])
def test_errors_name_the_key(over, msg):
    with pytest.raises(T.TopologyError) as e:
        T.from_dict(base(**over))
    assert msg in str(e.value)
    assert "\n" not in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(T.TopologyError, match="no such topology file"):
        T.load(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("planes = = 2\n")
    with pytest.raises(T.TopologyError, match="not valid TOML"):
        T.load(str(bad))


def test_rates():
    assert T.parse_rate("10gbit") == 10**10
    assert T.parse_rate("500mbit") == 5 * 10**8
    assert T.parse_rate("1.5Gbit") == 15 * 10**8
    assert T.parse_rate(1000) == 1000
    assert T.format_rate(10**10) == "10gbit" and T.format_rate(0) == "unlimited"


def test_single_plane_single_t0():
    t = T.from_dict({"planes": 1, "t0_per_plane": 1, "t1_per_plane": 1,
                     "hosts": [{"name": "a", "t0": 0}, {"name": "b", "t0": 0}]})
    assert len(t.links) == 3 and t.srv6_usids("a", "b") == [0x0100, 0x0301]


def test_topology_keeps_its_own_name():
    """The file's name is the topology's (it was overwritten by the last host's)."""
    from mrc_xdp.lab import topology as T
    t = T.load()
    assert t.name == "default" and [h.name for h in t.hosts] == ["h0", "h1", "h2", "h3"]
    assert T.from_dict(t.to_dict()).name == "default"
