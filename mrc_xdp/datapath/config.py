"""Host datapath configuration: TOML file or dict -> validated HostConfig.

Every error names the key and says why, e.g.
``connections[1].peer: 'fd00::zz' is not an IPv6 address``.

Example (ECMP mode, two planes)::

    instance = "h0"
    mode = "ecmp"                 # or "srv6"
    local_addr = "fd00:100::1"    # this host's MRC address
    app_dev = "mrc0"              # engine side of the mrc0 veth pair
    fabric_dev = "mrc0p"          # fabric side: spray attaches here

    [[planes]]
    dev = "p0"
    gateway_mac = "02:00:00:00:01:01"   # or gateway = "<IPv6>" resolved from the neighbour table

    [[planes]]
    dev = "p1"
    gateway_mac = "02:00:00:00:02:01"

    [[connections]]
    peer = "fd00:100::2"
    local_qpn = 0x100
    remote_qpn = 0x200
    ev_per_plane = 8               # active EVs per plane
    backup_per_plane = 4
    t1s = 2                        # T1 switches per plane (SRv6: EVs cycle over them)

SRv6 mode adds per plane ``srv6_src`` (our outer source) and ``local_sid`` (outer
destination of traffic to us), per connection ``template = "<name>"``, and::

    [srv6_templates.h2]
    block = "fcbb:0::"            # 32-bit uSID block
    usids = [0x0101, 0x0200, 0x0102, 0x0302]   # plane bits zero
    t1_pos = 1                    # which uSID names the T1 (-1: none)
    plane_shift = 12              # plane << 12 OR-ed into every uSID
    t1_shift = 0                  # t1 << 0 OR-ed into usids[t1_pos]
"""
from __future__ import annotations

import ipaddress
import random
import re
from dataclasses import dataclass, field

from mrc_xdp.datapath.shared import const
from mrc_xdp.datapath import names
from mrc_xdp.datapath import validate as V
from mrc_xdp.datapath.validate import int_in, keyname, no_unknown_keys, read_toml

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
# The time-based loss rule's reorder window floor, us (bpf/mrc_shared.h struct mrc_config):
# a SACK hole is a loss when the packet was sent more than max(this, min(min RTT /
# loss_window_div + 4 x RTT spread, mean RTT)) before the packet whose SACK reports it.
LOSS_WINDOW_US = 200


class ConfigError(ValueError):
    """Invalid configuration; str() is one line naming the key."""


def backup_max(nplanes: int) -> int:
    """Backup EVs per plane at most: MRC_BACKUP_PER_PLANE_MAX, and all planes' backups fit
    the backup slots [MRC_EV_ACTIVE_MAX, MRC_EV_SLOTS)."""
    room = (const("MRC_EV_SLOTS") - const("MRC_EV_ACTIVE_MAX")) // max(1, nplanes)
    return min(const("MRC_BACKUP_PER_PLANE_MAX"), room)


def _ipv6(v, key, unicast=False) -> str:
    return V.ipv6_addr(v, key, ConfigError, unicast)


def _int(v, key, lo, hi) -> int:
    return int_in(v, key, lo, hi, ConfigError)


def _str(v, key) -> str:
    return V.string(v, key, ConfigError)


def _dev(v, key) -> str:
    return V.ifname(v, key, ConfigError)


def _mac(v, key) -> str:
    return V.unicast_mac(v, key, ConfigError)


def _ev_list(v, key: str, nplanes: int, per_plane: int, seen: set) -> list:
    """[[ev, plane, t1], ...] with exactly per_plane EVs in every plane, all distinct."""
    if not isinstance(v, list):
        raise ConfigError("%s: expected a list of [ev, plane, t1], got %s" % (key, V.show(v)))
    out = []
    for i, item in enumerate(v):
        if not isinstance(item, list) or len(item) != 3:
            raise ConfigError("%s[%d]: expected [ev, plane, t1]" % (key, i))
        ev = _int(item[0], "%s[%d] ev" % (key, i), 1 << 16, 0xFFFFFFFF)
        plane = _int(item[1], "%s[%d] plane" % (key, i), 0, nplanes - 1)
        t1 = _int(item[2], "%s[%d] t1" % (key, i), 0, 255)
        if ev in seen:
            raise ConfigError("%s[%d]: EV %#x appears twice in the connection" % (key, i, ev))
        seen.add(ev)
        out.append(EvSpec(ev, plane, t1))
    for p in range(nplanes):
        n = sum(1 for e in out if e.plane == p)
        if n != per_plane:
            raise ConfigError("%s: plane %d has %d EVs, the connection wants %d per plane"
                              % (key, p, n, per_plane))
    return out


def _unknown(d: dict, allowed: set, where: str):
    no_unknown_keys(d, allowed, where, ConfigError)


@dataclass
class Plane:
    dev: str
    gateway_mac: str | None = None
    gateway: str | None = None
    srv6_src: str | None = None
    local_sid: str | None = None


@dataclass
class Srv6Template:
    name: str
    block: str
    usids: list[int]
    t1_pos: int = -1
    plane_shift: int = 12
    t1_shift: int = 0


@dataclass
class EvSpec:
    ev: int
    plane: int
    t1: int


@dataclass
class Connection:
    peer: str
    local_qpn: int
    remote_qpn: int
    ev_per_plane: int = 8
    backup_per_plane: int = 4
    t1s: int = 1
    template: str | None = None
    seed: int | None = None
    name: str = ""
    evs: list | None = None          # explicit active EvSpecs (e.g. learnt by probing)
    backup_evs: list | None = None

    def ev_sets(self, nplanes: int):
        """(active, backup): lists per plane of EvSpec. Deterministic per connection.

        Explicit `evs` / `backup_evs` are used as given.  Otherwise EVs are random 32-bit
        values, unique within the connection, equal in number per plane, and T1s are
        assigned round-robin inside each plane so they are equally loaded.
        """
        if self.evs is not None:
            by_plane = lambda specs: [[s for s in specs if s.plane == p] for p in range(nplanes)]
            return by_plane(self.evs), by_plane(self.backup_evs or [])
        seed = self.seed if self.seed is not None else \
            int(ipaddress.IPv6Address(self.peer)) ^ (self.local_qpn << 24) ^ self.remote_qpn
        rng = random.Random(seed)
        used: set[int] = set()

        def fresh():
            while True:
                ev = rng.getrandbits(32)
                if ev not in used and ev >> 16:  # sport 0 is not a valid UDP source port
                    used.add(ev)
                    return ev

        active = [[EvSpec(fresh(), p, k % self.t1s) for k in range(self.ev_per_plane)]
                  for p in range(nplanes)]
        backup = [[EvSpec(fresh(), p, k % self.t1s) for k in range(self.backup_per_plane)]
                  for p in range(nplanes)]
        return active, backup


@dataclass
class HostConfig:
    local_addr: str
    planes: list[Plane]
    connections: list[Connection] = field(default_factory=list)
    instance: str = "default"
    mode: str = "ecmp"
    app_dev: str = "mrc0"
    fabric_dev: str = "mrc0p"
    udp_port: int = const("MRC_UDP_PORT_DEFAULT")
    loss_reorder: int = 32
    # an EV is retired at its second loss since it last delivered: one lone loss on a
    # live path (a packet reordered past the window on a busy host) retires nothing,
    # a dead path's next packet retires it (docs/datapath.md, "Loss attribution")
    loss_thresh: int = 2
    loss_window_us: int = LOSS_WINDOW_US
    loss_window_div: int = 4
    hop_limit: int = 64
    dscp_data: int = 4
    dscp_ctrl: int = 46
    dscp_rtx: int = 4
    dscp_rewrite: bool = True
    srv6_templates: dict[str, Srv6Template] = field(default_factory=dict)

    # ------------------------------------------------------------ parsing
    @classmethod
    def from_toml(cls, path: str, overrides: dict | None = None) -> "HostConfig":
        """Parse and validate a TOML file; overrides (e.g. {"mode": "srv6"} from the
        command line) replace top-level keys before validation, so they are checked too."""
        data = read_toml(path, "config", ConfigError)
        data.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: dict) -> "HostConfig":
        if not isinstance(d, dict):
            raise ConfigError("config: expected a table of keys, got %s" % V.show(d))
        top = {"instance", "mode", "local_addr", "app_dev", "fabric_dev", "udp_port",
               "loss_reorder", "loss_thresh", "loss_window_us", "loss_window_div", "hop_limit",
               "dscp", "planes", "connections",
               "srv6_templates"}
        _unknown(d, top, "")
        if "local_addr" not in d:
            raise ConfigError("local_addr: required (this host's MRC IPv6 address)")
        if not d.get("planes"):
            raise ConfigError("planes: at least one [[planes]] entry is required")
        cfg = cls(local_addr=_ipv6(d["local_addr"], "local_addr", unicast=True), planes=[])
        cfg.instance = _str(d.get("instance", "default"), "instance")
        if not names.is_instance(cfg.instance):   # the one rule of mrc_xdp/names.py
            raise ConfigError("instance: %s must be %s" % (V.show(cfg.instance), names.RULE))
        cfg.mode = V.choice(d.get("mode", "ecmp"), "mode", ("ecmp", "srv6"), ConfigError)
        cfg.app_dev = _dev(d.get("app_dev", "mrc0"), "app_dev")
        cfg.fabric_dev = _dev(d.get("fabric_dev", "mrc0p"), "fabric_dev")
        cfg.udp_port = _int(d.get("udp_port", cfg.udp_port), "udp_port", 1, 65535)
        cfg.loss_reorder = _int(d.get("loss_reorder", 32), "loss_reorder", 1, 63)
        cfg.loss_thresh = _int(d.get("loss_thresh", cfg.loss_thresh), "loss_thresh", 1, 1 << 20)
        cfg.loss_window_us = _int(d.get("loss_window_us", LOSS_WINDOW_US), "loss_window_us", 0,
                                  const("MRC_TS_WINDOW_MAX") - 1)
        cfg.loss_window_div = _int(d.get("loss_window_div", 4), "loss_window_div", 0, 1024)
        cfg.hop_limit = _int(d.get("hop_limit", 64), "hop_limit", 1, 255)
        dscp = V.table(d.get("dscp", {}), "dscp", ConfigError)
        _unknown(dscp, {"data", "ctrl", "rtx", "rewrite"}, "dscp")
        cfg.dscp_data = _int(dscp.get("data", 4), "dscp.data", 0, 63)
        cfg.dscp_ctrl = _int(dscp.get("ctrl", 46), "dscp.ctrl", 0, 63)
        cfg.dscp_rtx = _int(dscp.get("rtx", cfg.dscp_data), "dscp.rtx", 0, 63)
        cfg.dscp_rewrite = V.boolean(dscp.get("rewrite", True), "dscp.rewrite", ConfigError)

        maxp = const("MRC_MAX_PLANES")
        planes = d["planes"]
        if not isinstance(planes, list) or len(planes) > maxp:
            raise ConfigError("planes: expected a list of 1..%d [[planes]] tables" % maxp)
        for i, p in enumerate(planes):
            k = "planes[%d]" % i
            if not isinstance(p, dict):
                raise ConfigError("%s: expected a table" % k)
            _unknown(p, {"dev", "gateway_mac", "gateway", "srv6_src", "local_sid"}, k)
            if "dev" not in p:
                raise ConfigError("%s.dev: required (the plane NIC)" % k)
            pl = Plane(dev=_dev(p["dev"], k + ".dev"))
            if "gateway_mac" in p:
                pl.gateway_mac = _mac(p["gateway_mac"], k + ".gateway_mac")
            elif "gateway" in p:
                pl.gateway = _ipv6(p["gateway"], k + ".gateway", unicast=True)
            else:
                raise ConfigError("%s: gateway_mac or gateway is required (the next hop on this plane)" % k)
            if cfg.mode == "srv6":
                for f in ("srv6_src", "local_sid"):
                    if f not in p:
                        raise ConfigError("%s.%s: required in srv6 mode" % (k, f))
                    setattr(pl, f, _ipv6(p[f], "%s.%s" % (k, f)))
            cfg.planes.append(pl)
        devs = [p.dev for p in cfg.planes] + [cfg.app_dev, cfg.fabric_dev]
        if len(set(devs)) != len(devs):
            raise ConfigError("planes: device names must be distinct from each other and from app_dev/fabric_dev")

        tmpls = d.get("srv6_templates", {})
        if not isinstance(tmpls, dict):
            raise ConfigError("srv6_templates: expected a table of named templates")
        for name, t in tmpls.items():
            k = "srv6_templates.%s" % keyname(name)
            if not isinstance(t, dict):
                raise ConfigError("%s: expected a table" % k)
            _unknown(t, {"block", "usids", "t1_pos", "plane_shift", "t1_shift"}, k)
            if "block" not in t or "usids" not in t:
                raise ConfigError("%s: block and usids are required" % k)
            block = _ipv6(t["block"], k + ".block")
            if int(ipaddress.IPv6Address(block)) & ((1 << 96) - 1):
                raise ConfigError("%s.block: %s has bits beyond the 32-bit block" % (k, block))
            usids = t["usids"]
            if not isinstance(usids, list) or not 1 <= len(usids) <= const("MRC_USID_MAX"):
                raise ConfigError("%s.usids: expected 1..%d uSIDs" % (k, const("MRC_USID_MAX")))
            usids = [_int(u, "%s.usids[%d]" % (k, j), 1, 0xFFFF) for j, u in enumerate(usids)]
            t1_pos = _int(t.get("t1_pos", -1), k + ".t1_pos", -1, len(usids) - 1)
            cfg.srv6_templates[name] = Srv6Template(
                name, block, usids, t1_pos,
                _int(t.get("plane_shift", 12), k + ".plane_shift", 0, 15),
                _int(t.get("t1_shift", 0), k + ".t1_shift", 0, 15))
        if len(cfg.srv6_templates) > const("MRC_MAX_TMPL"):
            raise ConfigError("srv6_templates: at most %d" % const("MRC_MAX_TMPL"))

        conns = d.get("connections", [])
        if not isinstance(conns, list) or len(conns) > const("MRC_MAX_CONNS"):
            raise ConfigError("connections: expected a list of at most %d [[connections]]" % const("MRC_MAX_CONNS"))
        seen = set()
        np_ = len(cfg.planes)
        for i, c in enumerate(conns):
            k = "connections[%d]" % i
            if not isinstance(c, dict):
                raise ConfigError("%s: expected a table" % k)
            _unknown(c, {"peer", "local_qpn", "remote_qpn", "ev_per_plane", "backup_per_plane",
                         "t1s", "template", "seed", "name", "evs", "backup_evs"}, k)
            for req in ("peer", "local_qpn", "remote_qpn"):
                if req not in c:
                    raise ConfigError("%s.%s: required" % (k, req))
            conn = Connection(
                peer=_ipv6(c["peer"], k + ".peer", unicast=True),
                local_qpn=_int(c["local_qpn"], k + ".local_qpn", 3, 0xFFFFFF),
                remote_qpn=_int(c["remote_qpn"], k + ".remote_qpn", 3, 0xFFFFFF),
                ev_per_plane=_int(c.get("ev_per_plane", 8), k + ".ev_per_plane", 1,
                                  const("MRC_EV_ACTIVE_MAX") // np_),
                backup_per_plane=_int(c.get("backup_per_plane", 4), k + ".backup_per_plane", 0,
                                      backup_max(np_)),
                t1s=_int(c.get("t1s", 1), k + ".t1s", 1, 255),
            )
            conn.name = _str(c["name"], k + ".name") if "name" in c else \
                "%s/%d" % (conn.peer, conn.remote_qpn)
            if "seed" in c:
                conn.seed = _int(c["seed"], k + ".seed", 0, (1 << 63) - 1)
            if "evs" in c:
                conn.evs = _ev_list(c["evs"], k + ".evs", np_, conn.ev_per_plane, set())
                conn.backup_evs = _ev_list(c.get("backup_evs", []), k + ".backup_evs", np_,
                                           conn.backup_per_plane, {e.ev for e in conn.evs})
            elif "backup_evs" in c:
                raise ConfigError("%s.backup_evs: needs evs too" % k)
            if cfg.mode == "srv6":
                t = c.get("template")
                if t is None:
                    raise ConfigError("%s.template: required in srv6 mode (name of a srv6_templates entry)" % k)
                if not isinstance(t, str) or t not in cfg.srv6_templates:
                    raise ConfigError("%s.template: no srv6_templates entry named %s" % (k, V.show(t)))
                conn.template = t
            for key in ((conn.peer, conn.remote_qpn, "tx"), (conn.peer, conn.local_qpn, "rx")):
                if key in seen:
                    raise ConfigError("%s: duplicate connection (peer %s, qpn %#x)" % (k, key[0], key[1]))
                seen.add(key)
            cfg.connections.append(conn)
        return cfg

    def template_index(self, name: str) -> int:
        return list(self.srv6_templates).index(name)
