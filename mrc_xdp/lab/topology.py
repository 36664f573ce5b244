"""Lab topology: a TOML file -> a validated, fully derived `Topology`.

The netns lab (fabric.py) and the Vagrant lab read the same file.  Every error names the
key, e.g. ``hosts[2].t0: 5 is out of range [0, 1]``.

Schema (every key optional except where noted; defaults are those of default.toml)::

    name = "default"              # free text
    mode = "srv6"                 # "srv6" (uSID source routing) or "ecmp" (L4-hash multipath)
    planes = 2                    # 1..8 independent planes; a host has one NIC per plane
    t0_per_plane = 2              # T0 (leaf) switches per plane, 1..64
    t1_per_plane = 2              # T1 (spine) switches per plane, 1..64 (0 when t0_per_plane = 1);
                                  #   every T0 links to every T1
    mtu = 1600                    # fabric links (room for the 40-byte SRv6 outer header)
    app_mtu = 1500                # mrc0/mrc0p on each host

    [capacity]                    # link rate per tier: "<n>[k|m|g|t]bit" or bits/s
    host_t0 = "10gbit"            # host NIC <-> T0
    t0_t1 = "10gbit"              # T0 <-> T1

    [addressing]
    base = "fd00:100::/48"        # a /48 (or shorter: its first 48 bits are used)
                                  #   host n's MRC address: <base>::<n+1>   (on mrc0)
                                  #   fabric link k: <base>:<k+1>::/64, ::1 lower tier, ::2 upper
    srv6_block = "fcbb:0::/32"    # SRv6 uSID block (32 bits)

    [linkmodel]                   # phantom-queue thresholds (bytes of backlog) and classes
    ecn_bytes = 30000             # mark CE above (not on the last hop to a host)
    trim_bytes = 60000            # trim MRC data to headers above
    drop_bytes = 250000           # drop above (0 = never)
    dscp_trimmed = 12
    dscp_ctrl = 46                # never trimmed
    udp_port = 4791

    [[hosts]]                     # at least one
    name = "h0"                   # 1-8 chars [a-z0-9_], unique, not a switch name
    t0 = 0                        # T0 index: the host's NIC on plane p joins T0 <t0> of plane p

Names.  Switches are ``p<plane>t0s<i>`` (T0 i of the plane) and ``p<plane>t1s<j>``
(T1 j).  Inside a switch the port towards a neighbour is named after it (T0: ``h0``,
``t1s1``; T1: ``t0s0``); a host has ``p0``..``p<N-1>`` (plane NICs) and ``mrc0``/``mrc0p``.
A link is named ``<lower>-<upper>`` (``h0-p0t0s0``, ``p0t0s0-p0t1s1``); one direction of
it ``<from>><to>`` (``h0>p0t0s0`` is modelled at p0t0s0's port ``h0``).

uSID plan (16 bits): plane (bits 15-12) | role (bits 11-8: 1 T0, 2 T1, 3 host) | index
(bits 7-0).  A host's locator on plane p is ``<block>:<its uSID with plane p>::/48``.
Paths: src -> T0 -> T1 -> T0' -> dst, uSIDs [T0src, T1, T0dst, host_dst]; hosts on the
same T0 use [T0, host_dst].  Per-destination templates keep plane bits and the T1 index
zero; the datapath ORs plane << 12 into every uSID and the T1 index into the T1 uSID.
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field

from mrc_xdp.datapath.shared import const
from mrc_xdp.datapath import validate as V
from mrc_xdp.datapath.validate import int_in, no_unknown_keys, read_toml

DEFAULT_TOPOLOGY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.toml")

ROLE_T0, ROLE_T1, ROLE_HOST = 1, 2, 3
MAX_PLANES = const("MRC_MAX_PLANES")
MAX_PER_TIER = 64
LINK_MAX = const("MRC_LINK_MAX")     # link model map size
SRV6_OUTER_LEN = const("MRC_IPV6_LEN")  # the outer header spray pushes in srv6 mode
IFINDEX_BASE = 0x10000  # lab-owned ifindex range, unique across all namespaces of a lab
MAC_OUI = (0x02, 0x6D)  # locally administered; the rest of the MAC is the ifindex

_HOSTNAME = re.compile(r"^[a-z0-9_]{1,8}$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*$", re.I)
_RATE_MULT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
MAX_RATE = 10**15       # 1 Pbit/s; the link model keeps a u64 of bits per second


class TopologyError(ValueError):
    """Invalid topology; str() is one line naming the key."""


def parse_rate(v, key: str = "rate") -> int:
    """'10gbit' / '500mbit' / 1000000 -> bits per second (0: unlimited), at most MAX_RATE."""
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise TopologyError("%s: %s is not a rate (e.g. \"10gbit\", \"500mbit\")" % (key, V.show(v)))
    if isinstance(v, int):
        if v < 0:
            raise TopologyError("%s: %s is negative" % (key, V.show(v)))
        bps = v
    else:
        m = _RATE.fullmatch(v) if len(v) <= 40 else None
        if not m:
            raise TopologyError("%s: %s is not a rate (e.g. \"10gbit\", \"500mbit\")" % (key, V.show(v)))
        bps = int(float(m.group(1)) * _RATE_MULT[m.group(2).lower()])
    if bps > MAX_RATE:
        raise TopologyError("%s: %s is above %s" % (key, V.show(v), format_rate(MAX_RATE)))
    return bps


def format_rate(bps: int) -> str:
    if bps == 0:
        return "unlimited"
    for unit, mult in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= mult and bps % (mult // 1000 or 1) == 0:
            v = bps / mult
            return ("%g" % v) + unit
    return "%dbit" % bps


def usid(plane: int, role: int, index: int) -> int:
    return (plane << 12) | (role << 8) | index


def mac_of(ifindex: int) -> str:
    b = list(MAC_OUI) + list(ifindex.to_bytes(4, "big"))
    return ":".join("%02x" % x for x in b)


@dataclass
class Node:
    name: str
    kind: str               # "host" | "t0" | "t1"
    plane: int = -1         # switches; -1 for hosts
    index: int = 0          # T0/T1 index in its plane; host number for hosts
    t0: int = -1            # hosts: the T0 index joined in every plane
    ports: list["Port"] = field(default_factory=list)

    def usid(self, plane: int | None = None) -> int:
        if self.kind == "host":
            return usid(plane or 0, ROLE_HOST, self.index)
        return usid(self.plane, ROLE_T0 if self.kind == "t0" else ROLE_T1, self.index)


@dataclass
class Port:
    node: str
    ifname: str
    ifindex: int
    mac: str
    addr: str               # link address (no prefix length; /64)
    link: "Link" = None     # type: ignore[assignment]

    @property
    def peer(self) -> "Port":
        return self.link.b if self.link.a is self else self.link.a


@dataclass
class Link:
    name: str               # "<lower>-<upper>"
    tier: str               # "host" (host <-> T0) | "fabric" (T0 <-> T1)
    plane: int
    a: Port                 # lower end (host / T0)
    b: Port                 # upper end (T0 / T1)
    rate_bps: int
    subnet: str

    def ends(self):
        """The two directions as (name, receiving port, sending port)."""
        return [("%s>%s" % (self.a.node, self.b.node), self.b, self.a),
                ("%s>%s" % (self.b.node, self.a.node), self.a, self.b)]


@dataclass
class Host:
    name: str
    index: int
    t0: int
    addr: str               # MRC address (on mrc0)
    app_ifindex: int = 0    # mrc0
    fab_ifindex: int = 0    # mrc0p


@dataclass
class LinkModelDefaults:
    ecn_bytes: int = 30000
    trim_bytes: int = 60000
    drop_bytes: int = 250000
    dscp_trimmed: int = 12
    dscp_ctrl: int = 46
    udp_port: int = const("MRC_UDP_PORT_DEFAULT")


@dataclass
class Topology:
    name: str
    mode: str
    planes: int
    t0_per_plane: int
    t1_per_plane: int
    hosts: list[Host]
    rate_host: int
    rate_fabric: int
    base: ipaddress.IPv6Network
    block: ipaddress.IPv6Network
    mtu: int = 1600
    app_mtu: int = 1500
    linkmodel: LinkModelDefaults = field(default_factory=LinkModelDefaults)
    source: str = ""
    nodes: dict[str, Node] = field(default_factory=dict)
    links: list[Link] = field(default_factory=list)

    # ------------------------------------------------------------ naming
    @staticmethod
    def t0_name(plane: int, i: int) -> str:
        return "p%dt0s%d" % (plane, i)

    @staticmethod
    def t1_name(plane: int, j: int) -> str:
        return "p%dt1s%d" % (plane, j)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def switches(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind != "host"]

    def link(self, name: str) -> Link:
        for lk in self.links:
            if lk.name == name:
                return lk
        raise KeyError(name)

    def link_ends(self):
        """Every direction of every link: (name, receiving port, sending port, link)."""
        for lk in self.links:
            for name, rx, tx in lk.ends():
                yield name, rx, tx, lk

    def port(self, node: str, ifname: str) -> Port:
        for p in self.nodes[node].ports:
            if p.ifname == ifname:
                return p
        raise KeyError("%s:%s" % (node, ifname))

    def gateway(self, host: str, plane: int) -> Port:
        """The T0 port a host's plane NIC is cabled to."""
        return self.port(host, "p%d" % plane).peer

    # ------------------------------------------------------------ addressing
    def usid_addr(self, usids: list[int]) -> str:
        v = int(self.block.network_address)
        for k, u in enumerate(usids):
            v |= u << (96 - 16 * (k + 1))
        return str(ipaddress.IPv6Address(v))

    def host_locator(self, host: str, plane: int) -> str:
        """block:<host uSID on the plane>:: (outer source and local SID of the host)."""
        return self.usid_addr([self.nodes[host].usid(plane)])

    def srv6_usids(self, src: str, dst: str) -> list[int]:
        """Template uSIDs from src to dst: plane bits zero, T1 index zero."""
        s, d = self.host(src), self.host(dst)
        t0s = usid(0, ROLE_T0, s.t0)
        hd = usid(0, ROLE_HOST, d.index)
        if s.t0 == d.t0:
            return [t0s, hd]
        return [t0s, usid(0, ROLE_T1, 0), usid(0, ROLE_T0, d.t0), hd]

    def t1_pos(self, src: str, dst: str) -> int:
        return 1 if self.host(src).t0 != self.host(dst).t0 else -1

    def path_usids(self, src: str, dst: str, plane: int, t1: int = 0) -> list[int]:
        """The uSIDs a packet from src to dst carries on `plane` via T1 `t1`."""
        us = [u | (plane << 12) for u in self.srv6_usids(src, dst)]
        if len(us) == 4:
            us[1] |= t1
        return us

    def path_nodes(self, src: str, dst: str, plane: int, t1: int = 0) -> list[str]:
        s, d = self.host(src), self.host(dst)
        if s.t0 == d.t0:
            return [src, self.t0_name(plane, s.t0), dst]
        return [src, self.t0_name(plane, s.t0), self.t1_name(plane, t1),
                self.t0_name(plane, d.t0), dst]

    # ------------------------------------------------------------ derived
    def _derive(self) -> None:
        ifx = [IFINDEX_BASE]
        base = int(self.base.network_address)

        def next_ifindex() -> int:
            ifx[0] += 1
            return ifx[0] - 1

        for h in self.hosts:
            self.nodes[h.name] = Node(h.name, "host", index=h.index, t0=h.t0)
        for p in range(self.planes):
            for i in range(self.t0_per_plane):
                n = self.t0_name(p, i)
                self.nodes[n] = Node(n, "t0", p, i)
            for j in range(self.t1_per_plane):
                n = self.t1_name(p, j)
                self.nodes[n] = Node(n, "t1", p, j)

        def mklink(tier, plane, lo_node, lo_if, hi_node, hi_if, rate):
            k = len(self.links)
            net = base | ((k + 1) << 64)
            subnet = "%s/64" % ipaddress.IPv6Address(net)
            ia, ib = next_ifindex(), next_ifindex()
            a = Port(lo_node, lo_if, ia, mac_of(ia), str(ipaddress.IPv6Address(net | 1)))
            b = Port(hi_node, hi_if, ib, mac_of(ib), str(ipaddress.IPv6Address(net | 2)))
            lk = Link("%s-%s" % (lo_node, hi_node), tier, plane, a, b, rate, subnet)
            a.link = b.link = lk
            self.nodes[lo_node].ports.append(a)
            self.nodes[hi_node].ports.append(b)
            self.links.append(lk)

        for p in range(self.planes):
            for h in self.hosts:
                mklink("host", p, h.name, "p%d" % p, self.t0_name(p, h.t0), h.name, self.rate_host)
        for p in range(self.planes):
            for i in range(self.t0_per_plane):
                for j in range(self.t1_per_plane):
                    mklink("fabric", p, self.t0_name(p, i), "t1s%d" % j,
                           self.t1_name(p, j), "t0s%d" % i, self.rate_fabric)
        for h in self.hosts:
            h.app_ifindex, h.fab_ifindex = next_ifindex(), next_ifindex()

    def summary(self) -> str:
        return ("%s: %s mode, %d plane(s) x (%d T0 + %d T1), %d hosts, %d links, "
                "%d paths between hosts on different T0s"
                % (self.name, self.mode, self.planes, self.t0_per_plane, self.t1_per_plane,
                   len(self.hosts), len(self.links), self.planes * self.t1_per_plane))

    def to_dict(self) -> dict:
        return {
            "name": self.name, "mode": self.mode, "planes": self.planes,
            "t0_per_plane": self.t0_per_plane, "t1_per_plane": self.t1_per_plane,
            "mtu": self.mtu, "app_mtu": self.app_mtu,
            "capacity": {"host_t0": self.rate_host, "t0_t1": self.rate_fabric},
            "addressing": {"base": str(self.base), "srv6_block": str(self.block)},
            "linkmodel": dict(vars(self.linkmodel)),
            "hosts": [{"name": h.name, "t0": h.t0} for h in self.hosts],
        }


# ---------------------------------------------------------------- parsing
def _int(v, key, lo, hi) -> int:
    return int_in(v, key, lo, hi, TopologyError)


def _table(d, key) -> dict:
    return V.table(d.get(key, {}), key, TopologyError)


def _unknown(d: dict, allowed: set, where: str) -> None:
    no_unknown_keys(d, allowed, where, TopologyError)


def _network(v, key, maxlen) -> ipaddress.IPv6Network:
    net = V.ipv6_net(v, key, TopologyError)
    if net.prefixlen > maxlen:
        raise TopologyError("%s: %s is longer than /%d" % (key, net, maxlen))
    return ipaddress.IPv6Network((int(net.network_address) >> (128 - maxlen) << (128 - maxlen), maxlen))


def from_dict(d: dict, source: str = "") -> Topology:
    if not isinstance(d, dict):
        raise TopologyError("topology: expected a table")
    _unknown(d, {"name", "mode", "planes", "t0_per_plane", "t1_per_plane", "mtu", "app_mtu",
                 "capacity", "addressing", "linkmodel", "hosts"}, "")
    name = V.string(d.get("name", "lab"), "name", TopologyError)
    mode = V.choice(d.get("mode", "srv6"), "mode", ("srv6", "ecmp"), TopologyError)
    planes = _int(d.get("planes", 2), "planes", 1, MAX_PLANES)
    t0n = _int(d.get("t0_per_plane", 2), "t0_per_plane", 1, MAX_PER_TIER)
    # no T1 only with a single T0 (every host on it): the smallest fabric, e.g. the VM lab's CI
    t1n = _int(d.get("t1_per_plane", 2), "t1_per_plane", 0 if t0n == 1 else 1, MAX_PER_TIER)
    # above 3506 (native XDP on veth without frags), the lab makes the veths at 3506 and
    # raises them once the frags-aware programs are attached (fabric.up); 65535: IPv6
    # without jumbograms
    mtu = _int(d.get("mtu", 1600), "mtu", 1280, 65535)
    app_mtu = _int(d.get("app_mtu", 1500), "app_mtu", 1280, mtu - SRV6_OUTER_LEN)
    cap = _table(d, "capacity")
    _unknown(cap, {"host_t0", "t0_t1"}, "capacity")
    rate_host = parse_rate(cap.get("host_t0", "10gbit"), "capacity.host_t0")
    rate_fab = parse_rate(cap.get("t0_t1", "10gbit"), "capacity.t0_t1")
    addr = _table(d, "addressing")
    _unknown(addr, {"base", "srv6_block"}, "addressing")
    base = _network(addr.get("base", "fd00:100::/48"), "addressing.base", 48)
    block = _network(addr.get("srv6_block", "fcbb:0::/32"), "addressing.srv6_block", 32)
    if base.overlaps(ipaddress.IPv6Network((int(block.network_address), 32))):
        raise TopologyError("addressing.srv6_block: %s overlaps addressing.base %s" % (block, base))
    lm = _table(d, "linkmodel")
    _unknown(lm, set(vars(LinkModelDefaults())), "linkmodel")
    lmd = LinkModelDefaults()
    for k, hi in (("ecn_bytes", 1 << 31), ("trim_bytes", 1 << 31), ("drop_bytes", 1 << 31),
                  ("dscp_trimmed", 63), ("dscp_ctrl", 63), ("udp_port", 65535)):
        if k in lm:
            setattr(lmd, k, _int(lm[k], "linkmodel." + k, 0, hi))
    hosts_in = d.get("hosts")
    if not isinstance(hosts_in, list) or not hosts_in:
        raise TopologyError("hosts: at least one [[hosts]] entry is required")
    if len(hosts_in) > 250:
        raise TopologyError("hosts: at most 250 hosts")
    hosts: list[Host] = []
    names = set()
    for i, h in enumerate(hosts_in):
        k = "hosts[%d]" % i
        if not isinstance(h, dict):
            raise TopologyError("%s: expected a table" % k)
        _unknown(h, {"name", "t0"}, k)
        hname = h.get("name")
        if not isinstance(hname, str) or not _HOSTNAME.fullmatch(hname):
            raise TopologyError("%s.name: %s must be 1-8 characters of [a-z0-9_]" % (k, V.show(hname)))
        if re.match(r"^p\d+t[01]s\d+$", hname) or hname in ("lab",):
            raise TopologyError("%s.name: %r is reserved (switch names are p<n>t0s<i>/p<n>t1s<j>)" % (k, hname))
        if hname in names:
            raise TopologyError("%s.name: duplicate host %r" % (k, hname))
        names.add(hname)
        if "t0" not in h:
            raise TopologyError("%s.t0: required (the T0 index this host joins in every plane)" % k)
        t0 = _int(h["t0"], k + ".t0", 0, t0n - 1)
        hosts.append(Host(hname, i, t0, str(ipaddress.IPv6Address(int(base.network_address) | (i + 1)))))
    ends = 2 * planes * (len(hosts) + t0n * t1n)     # the links _derive makes, before making them
    if ends > LINK_MAX:
        raise TopologyError("hosts/planes: %d link ends exceed the link model's %d" % (ends, LINK_MAX))
    topo = Topology(name=name, mode=mode, planes=planes, t0_per_plane=t0n,
                    t1_per_plane=t1n, hosts=hosts, rate_host=rate_host, rate_fabric=rate_fab,
                    base=base, block=block, mtu=mtu, app_mtu=app_mtu, linkmodel=lmd,
                    source=source)
    topo._derive()
    return topo


def load(path: str | None = None, mode: str | None = None) -> Topology:
    """Read a topology file (default: the packaged default.toml); mode overrides the file's."""
    path = path or DEFAULT_TOPOLOGY
    data = read_toml(path, "topology", TopologyError)
    if mode is not None:
        data["mode"] = mode
    return from_dict(data, source=os.path.abspath(path))
