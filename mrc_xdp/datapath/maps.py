"""Live datapath state: write configuration into the maps, read counters and EV tables.

Works on any map fds: the bcc object's while loading, or the pins under
/sys/fs/bpf/mrc/<instance>/ from any later process (``Instance``).
"""
from __future__ import annotations

import ipaddress
import json
import math
import os
import random
import time

from mrc_xdp.datapath import bpfsys
from mrc_xdp.datapath.names import BadName, check_instance, confined, is_instance
from mrc_xdp.datapath.config import HostConfig
from mrc_xdp.datapath.shared import (Ctr, EvReason, EvState, EV_CTR_FIELDS, MAP_NAMES, as_dict, from_bytes,
                                     const, ffi, sizeof, to_bytes)

PIN_ROOT = "/sys/fs/bpf/mrc"
STATE_DIR = "/run/mrc-xdp"

SLOTS = const("MRC_EV_SLOTS")
MAX_CONNS = const("MRC_MAX_CONNS")
UNKNOWN_CONN = "unknown"      # name of the connection id MRC_MAX_CONNS: no known connection
ACTIVE_MAX = const("MRC_EV_ACTIVE_MAX")
QPN_PROBE = const("MRC_QPN_PROBE")
PROBE_RATE_DEFAULT = 20000     # probe answers per second per instance (mrc_config.probe_rate)
PROBE_BURST_DEFAULT = 256
EVOP_RETRIES = 2000            # mrc_evop found the swap lock held: tries before giving up
DATAPATH_MAPS = sorted(v for k, v in MAP_NAMES.items() if k.startswith("MRC_MAP_"))


class NotLoaded(RuntimeError):
    pass


class BadInstanceName(NotLoaded, BadName):
    """An instance name off the rule (names.py), or one whose pins would resolve outside
    the pin root: such an instance cannot be loaded, so it is not."""


def pin_dir(instance: str) -> str:
    """/sys/fs/bpf/mrc/<instance>; names.BadName for a name off the rule or a path that
    resolves anywhere else."""
    return confined(PIN_ROOT, check_instance(instance))


def state_path(instance: str) -> str:
    return confined(STATE_DIR, check_instance(instance) + ".json")


def lock_path(instance: str) -> str:
    """The per-instance lock file, taken by load and unload (loader.instance_lock)."""
    return confined(STATE_DIR, check_instance(instance) + ".lock")


def instances() -> list[str]:
    """Every loaded instance: a directory of the pin root, named by the rule, with mrc_cfg."""
    try:
        return sorted(d for d in os.listdir(PIN_ROOT)
                      if is_instance(d) and not os.path.islink(os.path.join(PIN_ROOT, d))
                      and os.path.exists(os.path.join(PIN_ROOT, d, MAP_NAMES["MRC_MAP_CFG"])))
    except FileNotFoundError:
        return []


def pinned_map_id(instance: str, name: str):
    """The id of the map pinned as <instance>/<name>, None when it is not pinned."""
    try:
        fd = bpfsys.obj_get(os.path.join(pin_dir(instance), name))
    except (OSError, ValueError):
        return None
    try:
        return bpfsys.map_info(fd).id
    except OSError:
        return None
    finally:
        os.close(fd)


def load_complete(instance: str) -> bool:
    """True when the instance's state file says its load went through to the end."""
    try:
        with open(state_path(instance)) as f:
            return json.load(f).get("complete") is True
    except (OSError, ValueError, AttributeError):
        return False


def _u32(v: int) -> bytes:
    return int(v).to_bytes(4, "little")


def _addr(a: str) -> bytes:
    return ipaddress.IPv6Address(a).packed


def _mac(m: str) -> bytes:
    return bytes.fromhex(m.replace(":", ""))


def rotation_strides(n: int, rng: random.Random) -> list[int]:
    """Four strides coprime with n (different rotation orders), 1 for n == 1."""
    cands = [s for s in range(1, max(n, 2)) if math.gcd(s, n) == 1] or [1]
    return [rng.choice(cands) for _ in range(4)]


# ---------------------------------------------------------------- writing

class DevInfo:
    """What the loader learned about the devices: ifindexes and MACs."""

    def __init__(self, app_ifindex, app_mac, fab_ifindex, fab_mac, planes):
        self.app_ifindex, self.app_mac = app_ifindex, app_mac
        self.fab_ifindex, self.fab_mac = fab_ifindex, fab_mac
        self.planes = planes   # list of (ifindex, mac, gateway_mac)


def write_all(m: dict, cfg: HostConfig, dev: DevInfo, icrc_rows: list[list[int]]) -> None:
    """Fill every configuration map. m: map name -> bpfsys.Map."""
    c = ffi.new("struct mrc_config *")
    c.mode = 1 if cfg.mode == "srv6" else 0
    c.nplanes = len(cfg.planes)
    c.udp_port = cfg.udp_port
    c.flags = (const("MRC_CF_DSCP_REWRITE") if cfg.dscp_rewrite else 0) | const("MRC_CF_SET_ECT")
    c.loss_reorder = cfg.loss_reorder
    c.loss_thresh = cfg.loss_thresh
    c.loss_window_us = cfg.loss_window_us
    c.loss_window_div = cfg.loss_window_div
    ffi.memmove(c.local_addr, _addr(cfg.local_addr), 16)
    ffi.memmove(c.app_mac, _mac(dev.app_mac), 6)
    ffi.memmove(c.fab_mac, _mac(dev.fab_mac), 6)
    c.dscp_data, c.dscp_ctrl, c.dscp_rtx = cfg.dscp_data, cfg.dscp_ctrl, cfg.dscp_rtx
    c.hop_limit = cfg.hop_limit
    c.probe_rate = getattr(cfg, "probe_rate", PROBE_RATE_DEFAULT)
    c.probe_burst = getattr(cfg, "probe_burst", PROBE_BURST_DEFAULT)
    m["mrc_cfg"].update(0, to_bytes(c))
    for i, v in enumerate(crc32_table()):
        m["mrc_crc"].update(i, _u32(v))

    for i, (pl, (ifindex, mac, gw_mac)) in enumerate(zip(cfg.planes, dev.planes)):
        p = ffi.new("struct mrc_plane *")
        p.ifindex = ifindex
        ffi.memmove(p.smac, _mac(mac), 6)
        ffi.memmove(p.dmac, _mac(gw_mac), 6)
        if pl.srv6_src:
            ffi.memmove(p.src_addr, _addr(pl.srv6_src), 16)
        if pl.local_sid:
            ffi.memmove(p.local_sid, _addr(pl.local_sid), 16)
        m["mrc_planes"].update(i, to_bytes(p))
        m["mrc_ifplane"].update(ifindex, _u32(i))
        m["mrc_ports"].update(i, _u32(ifindex))
    m["mrc_ports"].update(const("MRC_PORT_ENGINE"), _u32(dev.fab_ifindex))

    for i, t in enumerate(cfg.srv6_templates.values()):
        st = ffi.new("struct mrc_srv6_tmpl *")
        ffi.memmove(st.block, _addr(t.block)[:4], 4)
        for j, u in enumerate(t.usids):
            st.usid[j] = u
        st.n_usid = len(t.usids)
        st.t1_pos = 255 if t.t1_pos < 0 else t.t1_pos
        st.plane_shift, st.t1_shift = t.plane_shift, t.t1_shift
        m["mrc_srv6"].update(i, to_bytes(st))

    row = ffi.new("struct mrc_icrc_row *")
    for n, bits in enumerate(icrc_rows):
        for i in range(16):
            row.bit[i] = bits[i]
        m["mrc_icrc"].update(n, to_bytes(row))

    for cid, conn in enumerate(cfg.connections):
        write_connection(m, cfg, cid, conn)


def crc32_table() -> list[int]:
    """The reflected CRC-32 table (polynomial 0xEDB88320) ingress builds probe answers'
    ICRC with."""
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        out.append(c)
    return out


def conn_key(peer: str, qpn: int, d: int) -> bytes:
    key = ffi.new("struct mrc_conn_key *")
    ffi.memmove(key.peer, _addr(peer), 16)
    key.qpn, key.dir = qpn, d
    return to_bytes(key)


def write_connection(m: dict, cfg: HostConfig, cid: int, conn) -> None:
    """Write connection cid of the config (at load)."""
    tmpl = cfg.template_index(conn.template) if conn.template else 0
    put_connection(m, cid, conn, tmpl, conn.ev_sets(len(cfg.planes)))


def put_connection(m, cid: int, conn, tmpl: int, sets) -> None:
    """Write connection cid: its mrc_conns row (SRv6 row template tmpl), its EV slots
    (mrc_evs, mrc_evidx), and only then the two mrc_connidx keys that make the datapath
    see it, and its peer's connectionless-probe keys when no connection has them yet.
    m: map name -> bpfsys.Map; conn: a config.Connection; sets: conn.ev_sets(nplanes)."""
    rng = random.Random(cid * 7919 + conn.local_qpn)
    cc = ffi.new("struct mrc_conn *")
    ffi.memmove(cc.peer, _addr(conn.peer), 16)
    cc.local_qpn, cc.remote_qpn = conn.local_qpn, conn.remote_qpn
    cc.ev_per_plane, cc.backup_per_plane = conn.ev_per_plane, conn.backup_per_plane
    cc.tmpl = tmpl
    for i, s in enumerate(rotation_strides(conn.ev_per_plane, rng)):
        cc.stride[i] = s
    m["mrc_conns"].update(cid, to_bytes(cc))

    active, backup = sets
    ev = ffi.new("struct mrc_ev *")
    now = time.monotonic_ns()
    k = ffi.new("struct mrc_evidx_key *")
    k.conn = cid
    for region, per_plane, per in ((0, active, conn.ev_per_plane),
                                   (ACTIVE_MAX, backup, conn.backup_per_plane)):
        for p, evs in enumerate(per_plane):
            for j, spec in enumerate(evs):
                slot = region + p * per + j
                ev.ev, ev.plane, ev.t1 = spec.ev, spec.plane, spec.t1
                ev.state = EvState.GOOD
                ev.reason = EvReason.NONE
                ev.cidx = slot
                ev.losses = 0
                ev.changed_ns = now
                m["mrc_evs"].update(cid * SLOTS + slot, to_bytes(ev))
                k.ev = spec.ev
                m["mrc_evidx"].update(to_bytes(k), _u32(slot))

    # the index last: from here on the datapath sees a complete connection
    for d in (0, 1):
        m["mrc_connidx"].update(conn_key(conn.peer, conn.remote_qpn if d == 0 else conn.local_qpn, d),
                                _u32(cid))
    index_probes(m, conn.peer, cid)


def index_probes(m, peer: str, cid: int, replace: bool = False) -> None:
    """Connectionless probes (QPN 0x2) to and from peer use one connection's EV set: the
    first connection to that peer keeps them; replace hands them to cid (when the
    connection that had them goes)."""
    for d in (0, 1):
        k = conn_key(peer, QPN_PROBE, d)
        if replace or m["mrc_connidx"].lookup(k) is None:
            m["mrc_connidx"].update(k, _u32(cid))


# ---------------------------------------------------------------- EV state from user space

def ev_slot(evidx, cid: int, ev: int) -> int | None:
    """The slot of EV ev in connection cid's set (mrc_evidx), None when it is not there."""
    k = ffi.new("struct mrc_evidx_key *")
    k.conn, k.ev = cid, ev
    raw = evidx.lookup(to_bytes(k))
    return None if raw is None else int.from_bytes(raw, "little")


class EvopError(RuntimeError):
    pass


def evop(prog_fd: int, cid: int, ev: int, state: int, reason: int) -> dict | None:
    """Run mrc_evop once: {slot, old} or None when the EV is not in the set; retries while
    the connection's swap lock is held (a swap takes a few hundred ns)."""
    op = ffi.new("struct mrc_evop *")
    op.conn, op.ev, op.state, op.reason = cid, ev, int(state), int(reason)
    raw = to_bytes(op)
    for i in range(EVOP_RETRIES):
        rc, out, _ = bpfsys.prog_test_run(prog_fd, raw)
        if rc == const("MRC_EVOP_OK"):
            res = ffi.cast("struct mrc_evop *", ffi.from_buffer(out))
            return {"slot": res.slot, "old": res.old_state}
        if rc == const("MRC_EVOP_NO_EV"):
            return None
        if rc != const("MRC_EVOP_BUSY"):
            raise EvopError("mrc_evop refused connection %d EV %#010x state %d (code %d)" % (cid, ev, state, rc))
        if i >= 16:
            time.sleep(0.0001)
    raise EvopError("connection %d: swap lock held for %d tries (a crashed writer?): EV %#010x unchanged"
                    % (cid, EVOP_RETRIES, ev))


def _evop_fd(evs):
    """The mrc_evop program that goes with this mrc_evs map: given (evs.evop_fd), or that of
    the instance the map was opened from (Instance.map)."""
    fd = getattr(evs, "evop_fd", None)
    if fd is None and getattr(evs, "instance", None) is not None:
        fd = evs.instance.evop_fd()
    return fd


def set_ev_state(evs, evidx, cid: int, ev: int, state: EvState,
                 reason: EvReason = EvReason.OPERATOR, evop_fd: int | None = None) -> dict:
    """Set the state of EV ev of connection cid, as an operator's deny/allow does: the
    slot's state and reason change, its loss count restarts, changed_ns is now.

    evs, evidx: the mrc_evs and mrc_evidx maps as bpfsys.Map (pinned, or a bcc build's).
    The change is made by the datapath's mrc_evop program (evop_fd, else the one of the
    instance evs was opened from): under the connection's swap lock, so it never races a
    slot swap, and with an event in mrc_events like every datapath change.  Without that
    program (an instance loaded by an older version) the slot is written directly.
    Returns {conn, slot, ev, old, new} (state names); KeyError when ev is not in the set.
    """
    fd = evop_fd if evop_fd is not None else _evop_fd(evs)
    if fd is not None:
        res = evop(fd, cid, ev, state, reason)
        if res is None:
            raise KeyError("EV %#010x is not in the EV set of connection %d" % (ev, cid))
        return {"conn": cid, "slot": res["slot"], "ev": ev, "old": EvState(res["old"]).name,
                "new": EvState(state).name}
    slot = ev_slot(evidx, cid, ev)
    if slot is None:
        raise KeyError("EV %#010x is not in the EV set of connection %d" % (ev, cid))
    key = cid * SLOTS + slot
    e = ffi.new("struct mrc_ev *")
    ffi.memmove(e, evs.lookup(key), sizeof("struct mrc_ev"))
    old = EvState(e.state)
    e.state = state
    e.reason = reason
    e.losses = 0
    e.changed_ns = time.monotonic_ns()
    evs.update(key, to_bytes(e))
    return {"conn": cid, "slot": slot, "ev": ev, "old": old.name, "new": EvState(state).name}


# ---------------------------------------------------------------- reading

def _file_stamp(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class Instance:
    """A loaded datapath, through its pins. Usable from any process."""

    def __init__(self, name: str = "default"):
        try:
            self.dir = pin_dir(name)
        except BadName as e:
            raise BadInstanceName(str(e)) from None
        self.name = name
        if not os.path.exists(os.path.join(self.dir, "mrc_cfg")):
            raise NotLoaded("instance %r is not loaded: run `mrc-xdp load` first%s" % (
                name, " (loaded: %s)" % ", ".join(instances()) if instances() else ""))
        self._maps: dict[str, bpfsys.Map] = {}
        self._evop: int | None = None
        self._state_file = state_path(name)      # checked once (confined() resolves the path)
        self._state_stamp = _file_stamp(self._state_file)
        try:
            with open(self._state_file) as f:
                self.state = json.load(f)
        except (FileNotFoundError, ValueError):
            self.state = {}

    def reload_state(self) -> bool:
        """Re-read the state file if it changed since it was read (run-time connections,
        mrc_xdp.transport.conns, are added to and removed from it).  True when it was re-read."""
        stamp = _file_stamp(self._state_file)
        if stamp is None or stamp == self._state_stamp:
            return False
        try:
            with open(self._state_file) as f:
                self.state = json.load(f)
        except (OSError, ValueError):
            return False        # being rewritten: next time
        self._state_stamp = stamp
        return True

    def map(self, name: str) -> bpfsys.Map:
        if name not in self._maps:
            mp = bpfsys.Map.open_pinned(os.path.join(self.dir, name))
            mp.instance = self          # set_ev_state finds this instance's mrc_evop
            self._maps[name] = mp
        return self._maps[name]

    def evop_fd(self) -> int | None:
        """The pinned mrc_evop program (prog_evop), None for an instance loaded without it."""
        if self._evop is None:
            try:
                self._evop = bpfsys.obj_get(os.path.join(self.dir, "prog_evop"))
            except OSError:
                return None
        return self._evop

    def close(self):
        for mp in self._maps.values():
            mp.close()
        self._maps.clear()
        if self._evop is not None:
            os.close(self._evop)
            self._evop = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    # -- counters
    def counters(self) -> dict[str, int]:
        mp = self.map("mrc_stats")
        out = {}
        for c in Ctr:
            if c == Ctr.MAX:
                continue
            out[c.name.lower()] = sum(bpfsys.sum_u64_percpu(mp.lookup(int(c))))
        return out

    def connections(self) -> list[dict]:
        conns = []
        cm = self.map("mrc_conns")
        for cid, meta in enumerate(self.state.get("connections", [])):
            if meta is None:        # an id freed by mrc_xdp.transport.conns.remove
                continue
            raw = cm.lookup(cid)
            if raw is None:         # the instance went away (or changed) under us
                continue
            d = as_dict(ffi.cast("struct mrc_conn *", ffi.from_buffer(raw)))
            d["peer"] = str(ipaddress.IPv6Address(d["peer"]))
            d["id"] = cid
            d["name"] = meta.get("name", "")
            conns.append(d)
        return conns

    def ev_table(self, conn: int | None = None) -> list[dict]:
        """One row per configured EV (active and backup), with summed per-EV counters."""
        rows = []
        evs, ctr = self.map("mrc_evs"), self.map("mrc_evctr")
        nctr = len(EV_CTR_FIELDS)
        for c in self.connections():
            if conn is not None and c["id"] != conn:
                continue
            n, b = c["ev_per_plane"], c["backup_per_plane"]
            nplanes = len(self.state.get("planes", [])) or 1
            slots = [p * n + k for p in range(nplanes) for k in range(n)] + \
                    [ACTIVE_MAX + p * b + k for p in range(nplanes) for k in range(b)]
            for slot in slots:
                raw = evs.lookup(c["id"] * SLOTS + slot)
                if raw is None:     # likewise: no row to show
                    continue
                e = ffi.cast("struct mrc_ev *", ffi.from_buffer(raw))
                if e.state == EvState.UNUSED:
                    continue
                vals = ctr.lookup(c["id"] * SLOTS + e.cidx)
                cnt = bpfsys.sum_u64_percpu(vals, nctr) if vals is not None else [0] * nctr
                row = {"conn": c["id"], "conn_name": c["name"], "slot": slot,
                       "role": "active" if slot < ACTIVE_MAX else "backup",
                       "ev": e.ev, "plane": e.plane, "t1": e.t1,
                       "state": EvState(e.state).name, "reason": EvReason(e.reason).name,
                       "losses": e.losses}
                row.update(zip(EV_CTR_FIELDS, cnt))
                rows.append(row)
        return rows

    def rx_evs(self) -> list[dict]:
        """Data received per (connection, sender EV).  conn MRC_MAX_CONNS counts data of no
        known connection: its conn_name is "unknown"."""
        mp = self.map("mrc_rxev")
        names = {c["id"]: c["name"] for c in self.connections()}
        out = []
        for k, vals in mp.items():
            key = ffi.cast("struct mrc_evidx_key *", ffi.from_buffer(k))
            pk, by, ce = bpfsys.sum_u64_percpu(vals, 3)
            name = UNKNOWN_CONN if key.conn == MAX_CONNS else names.get(key.conn, str(key.conn))
            out.append({"conn": key.conn, "conn_name": name, "ev": key.ev, "pkts": pk, "bytes": by, "ce": ce})
        return sorted(out, key=lambda r: (r["conn"], r["ev"]))

    # -- probe answers
    def probe_limit(self) -> dict:
        c = from_bytes("struct mrc_config", self.map("mrc_cfg").lookup(0))
        return {"rate": c.probe_rate, "burst": c.probe_burst}

    def set_probe_limit(self, rate: int, burst: int) -> dict:
        """Probe answers this instance's datapath sends: at most rate per second (0: none),
        bursts of burst.  Returns the new limit."""
        if not (0 <= rate < 1 << 32 and 0 <= burst < 1 << 32):
            raise ValueError("probe rate and burst: 0 .. 2^32-1, got %r, %r" % (rate, burst))
        self.update_config(probe_rate=rate, probe_burst=burst)
        return self.probe_limit()

    def config(self) -> dict:
        """The datapath's live struct mrc_config, by field."""
        c = from_bytes("struct mrc_config", self.map("mrc_cfg").lookup(0))
        return as_dict(c)

    def update_config(self, **changes) -> dict:
        """Change run-time fields of the datapath's mrc_config (e.g. loss_thresh,
        probe_rate); returns their previous values (to restore them)."""
        mp = self.map("mrc_cfg")
        c = ffi.new("struct mrc_config *")
        ffi.memmove(c, mp.lookup(0), sizeof("struct mrc_config"))
        old = {k: getattr(c, k) for k in changes}
        for k, v in changes.items():
            setattr(c, k, int(v))
        mp.update(0, to_bytes(c))
        return old

    # -- operator actions
    def find_ev(self, ev: int, conn: int | None = None):
        """(connection id, slot) of EV ev, in connection conn or the first that has it."""
        for c in self.connections():
            if conn is not None and c["id"] != conn:
                continue
            slot = ev_slot(self.map("mrc_evidx"), c["id"], ev)
            if slot is not None:
                return c["id"], slot
        raise KeyError("EV %#010x is not in the EV set of %s" % (
            ev, "connection %d" % conn if conn is not None else "any connection"))

    def set_ev_state(self, ev: int, state: EvState, conn: int | None = None) -> dict:
        """Operator deny/allow. Returns {conn, slot, ev, old, new}."""
        cid, _ = self.find_ev(ev, conn)
        return set_ev_state(self.map("mrc_evs"), self.map("mrc_evidx"), cid, ev, state,
                            evop_fd=self.evop_fd())

    # -- planes out of rotation (the health daemon, following plane NIC link state)
    def _planes_map(self):
        mp = self.map("mrc_planes")
        if mp.value_size != sizeof("struct mrc_plane"):
            raise NotLoaded("instance %r was loaded by an older mrc-xdp (its mrc_planes has no flags): "
                            "reload it (`mrc-xdp load`)" % self.name)
        return mp

    def plane_flags(self) -> list[int]:
        """Per configured plane: its MRC_PF_* flags; [] for an instance loaded by an older
        mrc-xdp (no flags)."""
        try:
            mp = self._planes_map()
        except NotLoaded:
            return []
        return [from_bytes("struct mrc_plane", mp.lookup(p)).flags
                for p in range(len(self.state.get("planes", [])))]

    def planes_down(self) -> list[bool]:
        """Per configured plane: True while it is out of rotation (MRC_PF_DOWN: its NIC is
        down, or MRC_PF_ADMIN: the operator's); [] for an instance of an older mrc-xdp."""
        out = const("MRC_PF_OUT")
        return [bool(f & out) for f in self.plane_flags()]

    def plane_rows(self) -> list[dict]:
        """Per configured plane: plane, dev, link_down, operator_out, in_rotation."""
        flags = self.plane_flags()
        rows = []
        for p, pl in enumerate(self.state.get("planes", [])):
            f = flags[p] if p < len(flags) else 0
            rows.append({"plane": p, "dev": pl.get("dev"), "link_down": bool(f & const("MRC_PF_DOWN")),
                         "operator_out": bool(f & const("MRC_PF_ADMIN")), "in_rotation": not f & const("MRC_PF_OUT")})
        return rows

    def set_plane_out(self, plane: int, out: bool) -> bool:
        """The operator takes a plane out of spray's rotation (MRC_PF_ADMIN) or puts it
        back; the health daemon's link flag is separate.  True when the flag changed."""
        return self._plane_flag(plane, out, const("MRC_PF_ADMIN"))

    def set_plane_down(self, plane: int, down: bool) -> bool:
        """Take a plane out of spray's rotation (its EVs unused, their states unchanged; the
        other planes share its turns) or put it back.  True when the flag changed."""
        return self._plane_flag(plane, down, const("MRC_PF_DOWN"))

    def _plane_flag(self, plane: int, on: bool, bit: int) -> bool:
        n = len(self.state.get("planes", []))
        if not 0 <= plane < n:
            raise KeyError("plane %d is not configured in %s (planes 0-%d)" % (plane, self.name, n - 1))
        return set_plane_down(self._planes_map(), plane, on, bit=bit)


def set_plane_down(planes, plane: int, down: bool, bit: int | None = None) -> bool:
    """MRC_PF_DOWN (or bit) of one mrc_planes entry (planes: the map) set or cleared; True
    when it changed.  After load only the health daemon writes MRC_PF_DOWN and only the
    operator MRC_PF_ADMIN (a read-modify-write of a whole entry: two writers at the same
    instant could lose one change; each re-checks, the daemon every second)."""
    bit = const("MRC_PF_DOWN") if bit is None else bit
    p = ffi.new("struct mrc_plane *")
    ffi.memmove(p, planes.lookup(plane), sizeof("struct mrc_plane"))
    new = (p.flags | bit) if down else (p.flags & ~bit)
    if new == p.flags:
        return False
    p.flags = new
    planes.update(plane, to_bytes(p))
    return True
