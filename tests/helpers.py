"""Shared pieces of the tier-1 datapath tests (tests/test_datapath_*.py).

``Env`` is one bcc build of bpf/mrc_datapath.c plus a private network namespace holding
the devices the maps name (mrc0/mrc0p, p0/q0, p1/q1): ingress test runs need an
xdp_md.ingress_ifindex of the caller's netns, devmap entries an ifindex of it too.
``Env.use(mode)`` rewrites every map from the ECMP or SRv6 test configuration and zeroes
all run-time state (counters, rotation, PSN ring, rx counters, events), so tests do not
depend on their order.

The expected outputs are computed here, in Python, from the input frame and the
configuration: field rewrites by hand, the ICRC with wire.icrc (zlib over the masked
packet, not the datapath's update table), the UDP checksum with wire.udp6_checksum (a
full recomputation, not RFC 1624), SRv6 destinations with wire.usid_address.
"""
from __future__ import annotations

import ipaddress
import json
import os
import struct
import warnings

from scapy.layers.inet import UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from mrc_xdp.datapath import bpfsys, netns, shared, wire
from mrc_xdp.datapath.config import HostConfig
from mrc_xdp.datapath.shared import Ctr, EvState, Opcode, const, ffi

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)

SLOTS = const("MRC_EV_SLOTS")
ACTIVE_MAX = const("MRC_EV_ACTIVE_MAX")
PSN_RING = const("MRC_PSN_RING")
MAX_CONNS = const("MRC_MAX_CONNS")
PORT = const("MRC_UDP_PORT_DEFAULT")
ETH, IP6, UDPH = 14, 40, 8

# ------------------------------------------------------------------ addressing plan
LOCAL = "fd00:100::1"
PEER_A = "fd00:100::2"
PEER_B = "fd00:100::3"
STRANGER = "fd00:100::99"
QPN_A_LOCAL, QPN_A_REMOTE = 0x100, 0x200
QPN_B_LOCAL, QPN_B_REMOTE = 0x101, 0x201

# Device MACs are set explicitly so expected frames are written with known bytes.
DEV_MACS = {
    "mrc0": "02:6d:72:00:00:01", "mrc0p": "02:6d:72:00:00:02",
    "p0": "02:6d:72:00:01:00", "q0": "02:6d:72:00:01:0f",
    "p1": "02:6d:72:00:02:00", "q1": "02:6d:72:00:02:0f",
}
VETHS = (("mrc0", "mrc0p"), ("p0", "q0"), ("p1", "q1"))
GW_MACS = ["02:6d:72:00:01:01", "02:6d:72:00:02:01"]

DSCP_DATA, DSCP_CTRL, DSCP_RTX = 4, 46, 10
LOSS_REORDER = 8
HOP_LIMIT = 61

SRV6_BLOCK = "fcbb:bb00::"
# Per plane: our outer source, and the SID of traffic to us (first 48 bits compared).
SRV6_SRC = ["fcbb:bb00:f00::1", "fcbb:bb00:1f00::1"]
LOCAL_SID = ["fcbb:bb00:100::", "fcbb:bb00:1100::"]
TEMPLATES = {
    # two-tier path: T0 0x0101, T1 0x0200 (+ t1), T0 0x0102, host 0x0302
    "to_a": {"block": SRV6_BLOCK, "usids": [0x0101, 0x0200, 0x0102, 0x0302], "t1_pos": 1,
             "plane_shift": 12, "t1_shift": 0},
    # all six uSIDs of an F3216 address in use, no T1 position, other shifts
    "to_b": {"block": SRV6_BLOCK, "usids": [0x0011, 0x0022, 0x0033, 0x0044, 0x0055, 0x0066],
             "t1_pos": -1, "plane_shift": 8, "t1_shift": 4},
}


def _conf(mode: str) -> dict:
    planes = []
    for p, dev in enumerate(("p0", "p1")):
        pl = {"dev": dev, "gateway_mac": GW_MACS[p]}
        if mode == "srv6":
            pl.update(srv6_src=SRV6_SRC[p], local_sid=LOCAL_SID[p])
        planes.append(pl)
    conns = [
        {"name": "A", "peer": PEER_A, "local_qpn": QPN_A_LOCAL, "remote_qpn": QPN_A_REMOTE,
         "ev_per_plane": 8, "backup_per_plane": 4, "t1s": 2},
        {"name": "B", "peer": PEER_B, "local_qpn": QPN_B_LOCAL, "remote_qpn": QPN_B_REMOTE,
         "ev_per_plane": 4, "backup_per_plane": 0, "t1s": 1},
    ]
    d = {"instance": "t1", "mode": mode, "local_addr": LOCAL, "planes": planes,
         "connections": conns, "loss_reorder": LOSS_REORDER, "loss_thresh": 1,
         "hop_limit": HOP_LIMIT,
         "dscp": {"data": DSCP_DATA, "ctrl": DSCP_CTRL, "rtx": DSCP_RTX}}
    if mode == "srv6":
        d["srv6_templates"] = TEMPLATES
        conns[0]["template"] = "to_a"
        conns[1]["template"] = "to_b"
    return d


CONFIGS = {m: HostConfig.from_dict(_conf(m)) for m in ("ecmp", "srv6")}
CONN_A, CONN_B = 0, 1


# ------------------------------------------------------------------ frames
def data(psn: int = 1, conn: int = CONN_A, payload: bytes = b"\x5a" * 64, **kw) -> bytes:
    """Engine -> fabric data frame of a configured connection (spray input)."""
    peer, rqpn = ((PEER_A, QPN_A_REMOTE) if conn == CONN_A else (PEER_B, QPN_B_REMOTE))
    return wire.data_frame(LOCAL, peer, rqpn, psn, payload, **kw)


def endpoint_frame(src: str, dst: str, dqpn: int, psn: int = 0, resp: bool = False,
                   ev: int = 0, tc: int = 0, udp_csum: bool = False) -> bytes:
    """ENDPOINT_REQUEST (ERTH) / ENDPOINT_RESPONSE (EETH); wire has no builder for them."""
    op = Opcode.ENDPOINT_RESP if resp else Opcode.ENDPOINT_REQ
    hdr = (wire.EETH(data=bytes(range(36))) if resp else wire.ERTH(data=bytes(range(16))))
    sport, fl = wire.ev_to_fields(ev)
    pkt = (Ether(src=wire.DEFAULT_SMAC, dst=wire.DEFAULT_DMAC) /
           IPv6(src=src, dst=dst, tc=tc, fl=fl) / UDP(sport=sport, dport=PORT, chksum=0) /
           wire.BTH(opcode=op, dqpn=dqpn, psn=psn) / hdr)
    raw = bytes(pkt)
    ip6 = wire.add_icrc(raw[ETH:])
    if udp_csum:
        ip6 = wire.with_udp6_checksum(ip6)
    return raw[:ETH] + ip6


def frame_of(kind: str, src: str, dst: str, dqpn: int, psn: int = 7, **kw) -> bytes:
    """One frame per opcode family: 'data' (with data_frame keywords), 'ack', 'sack',
    'nack', 'probe', 'ep_req', 'ep_resp'."""
    if kind == "data":
        return wire.data_frame(src, dst, dqpn, psn, kw.pop("payload", b"\x33" * 40), **kw)
    if kind == "ack":
        return wire.ack_frame(src, dst, dqpn, psn, msn=3, **kw)
    if kind == "sack":
        return wire.sack_frame(src, dst, dqpn, psn, cack_psn=psn, ev_echo=kw.pop("ev_echo", 0x77),
                               **kw)
    if kind == "nack":
        return wire.nack_frame(src, dst, dqpn, psn, nack_psn=psn,
                               ev_echo=kw.pop("ev_echo", 0x77),
                               reason=kw.pop("reason", wire.NackReason.NO_BITMAP), **kw)
    if kind == "probe":
        return wire.probe_frame(src, dst, dqpn, psn, probe_id=9, **kw)
    if kind in ("ep_req", "ep_resp"):
        return endpoint_frame(src, dst, dqpn, psn, resp=kind == "ep_resp", **kw)
    raise ValueError(kind)


def odd_length(frame: bytes, extra: bytes = b"\x7e", udp_csum: bool = True) -> bytes:
    """A copy with extra bytes put before the ICRC (lengths, ICRC and checksum redone):
    with one byte the UDP length is odd, the trailer at an odd offset."""
    ip6 = bytearray(frame[ETH:-wire.ICRC_LEN] + extra)
    plen = len(ip6) - IP6 + wire.ICRC_LEN
    ip6[4:6] = plen.to_bytes(2, "big")
    ip6[IP6 + 4:IP6 + 6] = plen.to_bytes(2, "big")
    ip6[IP6 + 6:IP6 + 8] = b"\0\0"
    ip6 = bytes(ip6) + wire.pack_icrc(wire.icrc(bytes(ip6)))
    if udp_csum:
        ip6 = wire.with_udp6_checksum(ip6)
    return frame[:ETH] + ip6


def set_flowlabel(frame: bytes, fl: int, l3: int = ETH) -> bytes:
    """A copy with the full 20-bit flow label set (the ICRC masks it)."""
    f = bytearray(frame)
    word = int.from_bytes(f[l3:l3 + 4], "big") & ~0xFFFFF | fl
    f[l3:l3 + 4] = word.to_bytes(4, "big")
    return bytes(f)


# ------------------------------------------------------------------ field access
def mac(s: str) -> bytes:
    return bytes.fromhex(s.replace(":", ""))


def addr(a: str) -> bytes:
    return ipaddress.IPv6Address(a).packed


def tc_of(frame: bytes, l3: int = ETH) -> int:
    return (int.from_bytes(frame[l3:l3 + 4], "big") >> 20) & 0xFF


def flowlabel_of(frame: bytes, l3: int = ETH) -> int:
    return int.from_bytes(frame[l3:l3 + 4], "big") & 0xFFFFF


def opcode_at(frame: bytes, l3: int = ETH) -> int:
    return frame[l3 + IP6 + UDPH]


def is_data_op(op: int) -> bool:
    return Opcode.WRITE_FIRST <= op <= Opcode.WRITE_ONLY_IMM


# ------------------------------------------------------------------ expected outputs
def spray_rewrite(frame: bytes, ev: int, smac: bytes, dmac: bytes, dscp: int | None,
                  set_ect: bool = True) -> bytes:
    """What spray (ECMP rewrite) must make of a plain MRC frame for EV ev.

    Traffic class = dscp << 2 | ECN (DSCP kept when dscp is None), ECT(0) on Not-ECT data,
    flow label = EV[15:0] with its upper 4 bits zero, UDP sport = EV[31:16], MACs of the
    plane.  ICRC: new = old ^ icrc(new body) ^ icrc(old body) -- for equal lengths the
    affine parts of CRC-32 cancel, so this is the full recomputation when the old trailer
    was right and the datapath's in-place update when it was not.  A non-zero UDP
    checksum that was valid is recomputed over the result; an invalid one is left
    (callers that feed invalid checksums compare with the checksum masked).
    """
    l3, udp = ETH, ETH + IP6
    f = bytearray(frame)
    f[0:6], f[6:12] = dmac, smac
    tc = tc_of(frame)
    ecn = tc & 3
    if dscp is not None:
        tc = dscp << 2 | ecn
    if set_ect and is_data_op(opcode_at(frame)) and ecn == 0:
        tc |= 2
    f[l3:l3 + 4] = (6 << 28 | tc << 20 | ev & 0xFFFF).to_bytes(4, "big")
    f[udp:udp + 2] = (ev >> 16).to_bytes(2, "big")
    udp_len = int.from_bytes(f[udp + 4:udp + 6], "big")
    end = udp + udp_len - wire.ICRC_LEN
    if frame[udp:udp + 2] != f[udp:udp + 2]:
        old = int.from_bytes(frame[end:end + 4], wire.ICRC_BYTEORDER)
        delta = wire.icrc(bytes(f[l3:end])) ^ wire.icrc(bytes(frame[l3:end]))
        f[end:end + 4] = wire.pack_icrc(old ^ delta)
    if f[udp + 6:udp + 8] != b"\0\0" and udp6_csum_valid(frame):
        f[udp + 6:udp + 8] = wire.udp6_checksum(bytes(f[l3:])).to_bytes(2, "big")
    return bytes(f)


def udp6_csum_valid(frame: bytes, l3: int = ETH) -> bool:
    return wire.udp6_checksum_ok(frame[l3:], allow_zero=False)


def srv6_da(tmpl: dict, plane: int, t1: int) -> str:
    """Outer destination from a row template: the plane into every uSID, t1 into the T1
    uSID, written by wire.usid_address."""
    usids = []
    for i, u in enumerate(tmpl["usids"]):
        u |= plane << tmpl["plane_shift"]
        if i == tmpl["t1_pos"]:
            u |= t1 << tmpl["t1_shift"]
        usids.append(u & 0xFFFF)
    return wire.usid_address(tmpl["block"], usids)


def srv6_push(frame: bytes, src: str, da: str, hlim: int) -> bytes:
    """Outer IPv6 (next header 41) in front of the frame's IPv6 header: version, traffic
    class and flow label copied from the inner, payload length = inner header + its
    payload length.  Bytes after the inner packet (padding) stay after it."""
    inner_plen = int.from_bytes(frame[ETH + 4:ETH + 6], "big")
    outer = (frame[ETH:ETH + 4] + struct.pack("!HBB", inner_plen + IP6, 41, hlim) +
             addr(src) + addr(da))
    return frame[:ETH] + outer + frame[ETH:]


def decap(frame: bytes) -> bytes:
    """The frame without its outer IPv6 header; outer CE copied into an ECT inner (RFC 6040)."""
    inner = bytearray(frame[ETH + IP6:])
    outer_ecn = tc_of(frame) & 3
    inner_ecn = (inner[1] >> 4) & 3
    if outer_ecn == 3 and inner_ecn in (1, 2):
        inner[1] |= 0x30
    return frame[:ETH] + bytes(inner)


def probe_answer(probe: bytes, dqpn: int, smac: bytes, dmac: bytes, dscp: int = DSCP_CTRL,
                 hlim: int = HOP_LIMIT) -> bytes:
    """The answer ingress must make of a plain PROBE_REQ (before any SRv6 push): a SACK with
    PR set from the probe's destination to its source, to dqpn, BTH PSN and cack_psn = the
    probe's PSN, entropy = the probe's EV (also in sport / flow label), spdcid and dpdcid
    swapped, the probe id in sack_offset (MRC_PANS_ID_OFF), the probe's tx timestamp in
    CC_STATE, control DSCP, hop limit of the configuration, the probe's P_Key; ICRC by
    wire.icrc."""
    p = wire.parse(probe)
    ip6, bth, peth = p[IPv6], p[wire.BTH], p[wire.PETH]
    ev = wire.ev_of_frame(probe)
    pid = peth.probe_id - 0x10000 if peth.probe_id & 0x8000 else peth.probe_id
    assert const("MRC_PANS_ID_OFF") == 18, "the builder puts the id in sack_offset"
    f = bytearray(wire.sack_frame(ip6.dst, ip6.src, dqpn, bth.psn, cack_psn=bth.psn, ev_echo=ev,
                                  sack_offset=pid,
                                  seth={"pr": 1, "spdcid": peth.dpdcid, "dpdcid": peth.spdcid},
                                  cc={"tx_ts": peth.tx_ts}, ev=ev, tc=dscp << 2, hlim=hlim,
                                  smac=":".join("%02x" % b for b in smac),
                                  dmac=":".join("%02x" % b for b in dmac)))
    b = ETH + IP6 + UDPH
    f[b + 1] = 0
    f[b + 2:b + 4] = probe[b + 2:b + 4]         # P_Key kept
    f[-4:] = wire.pack_icrc(wire.icrc(bytes(f[ETH:-4])))
    return bytes(f)


def with_macs(frame: bytes, dst: bytes, src: bytes) -> bytes:
    return dst + src + frame[12:]


# ------------------------------------------------------------------ the environment
class Env:
    """One loaded (not attached) datapath and its private netns; see the module doc."""

    def __init__(self, ns: str):
        self.ns = ns
        self.dp = None
        self.ifindex: dict[str, int] = {}
        self.mode = None
        self.cfg: HostConfig | None = None
        self.dev = None
        self._events: list[bytes] = []
        self._ring = None
        self.cpu = 0            # the CPU the session is pinned to (conftest sets it)

    # -- set-up / tear-down
    def setup(self) -> None:
        from mrc_xdp.datapath import loader
        from mrc_xdp.datapath.maps import DevInfo

        netns.create(self.ns)
        for a, b in VETHS:
            netns.run_cmd(self.ns, ["ip", "link", "add", a, "address", DEV_MACS[a], "type",
                                    "veth", "peer", "name", b, "address", DEV_MACS[b]])
        for a, b in VETHS:
            for d in (a, b):
                netns.run_cmd(self.ns, ["ip", "link", "set", d, "up"])
        links = json.loads(netns.run_cmd(self.ns, ["ip", "-j", "link", "show"]).stdout)
        self.ifindex = {lk["ifname"]: lk["ifindex"] for lk in links}
        with warnings.catch_warnings():    # bcc: "not a bytes object" on its own text
            warnings.simplefilter("ignore", DeprecationWarning)
            self.dp = loader.build()
        self.dev = DevInfo(self.ifindex["mrc0"], DEV_MACS["mrc0"], self.ifindex["mrc0p"],
                           DEV_MACS["mrc0p"],
                           [(self.ifindex[d], DEV_MACS[d], GW_MACS[i])
                            for i, d in enumerate(("p0", "p1"))])
        # The ICRC update table is the same for every configuration: written once.
        with netns.enter(self.ns):
            self.dp.configure(CONFIGS["ecmp"], self.dev)
        self.mode = "ecmp"
        self.cfg = CONFIGS["ecmp"]
        self._ring = bpfsys.RingReader(self.maps["mrc_events"].fd, self._events.append)

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self.dp is not None:
            self.dp.close()
            self.dp = None
        netns.delete(self.ns)

    @property
    def maps(self) -> dict:
        return self.dp.maps

    # -- configuration and state
    def use(self, mode: str) -> "Env":
        """Every configuration map from CONFIGS[mode]; all run-time state zeroed."""
        from mrc_xdp.datapath.maps import write_all

        cfg = CONFIGS[mode]
        m = self.maps
        for name in ("mrc_connidx", "mrc_evidx", "mrc_ifplane", "mrc_rxev", "mrc_probes"):
            m[name].clear()
        zero = bytes(8)
        for c in range(int(Ctr.MAX)):
            m["mrc_stats"].update(c, zero)
        ev_zero = bytes(shared.sizeof("struct mrc_ev"))
        ctr_zero = bytes(shared.sizeof("struct mrc_ev_ctr"))
        rot_zero = bytes(shared.sizeof("struct mrc_rot"))
        psn_zero = bytes(shared.sizeof("struct mrc_psn_ent"))
        conn_zero = bytes(shared.sizeof("struct mrc_conn"))
        for cid in range(len(cfg.connections)):
            m["mrc_conns"].update(cid, conn_zero)
            m["mrc_rot"].update(cid, rot_zero)
            for slot in _all_slots(cid):
                m["mrc_evs"].update(cid * SLOTS + slot, ev_zero)
                m["mrc_evctr"].update(cid * SLOTS + slot, ctr_zero)
            for i in range(PSN_RING):
                m["mrc_psn"].update(cid * PSN_RING + i, psn_zero)
        m["mrc_ptb"].update(0, bytes(shared.sizeof("struct mrc_ptb")))
        tz = bytes(shared.sizeof("struct mrc_srv6_tmpl"))
        for i in range(len(TEMPLATES)):
            m["mrc_srv6"].update(i, tz)
        with netns.enter(self.ns):     # devmap values are ifindexes of this netns
            write_all(m, cfg, self.dev, [])
        self.mode, self.cfg = mode, cfg
        self.events()                   # drop events of earlier tests
        return self

    def set_cfg(self, **fields) -> None:
        """Change fields of the live struct mrc_config (e.g. flags, loss_thresh)."""
        c = shared.from_bytes("struct mrc_config", self.maps["mrc_cfg"].lookup(0))
        for k, v in fields.items():
            setattr(c, k, v)
        self.maps["mrc_cfg"].update(0, shared.to_bytes(c))

    def get_cfg(self):
        return shared.from_bytes("struct mrc_config", self.maps["mrc_cfg"].lookup(0))

    # -- running programs
    def run(self, prog: str, frame: bytes, ifindex: int | None = None, linear: int | None = None):
        """(retval, output) of one BPF_PROG_TEST_RUN, repeat 1.  ingress runs as if the
        frame arrived on p0 and to_engine as if on mrc0, unless ifindex says otherwise.
        linear: bytes in the linear part of a multi-buffer frame (bpfsys.prog_test_run)."""
        if ifindex is None:
            ifindex = {"ingress": self.ifindex["p0"], "engine": self.ifindex["mrc0"]}.get(prog, 0)
        if ifindex:
            with netns.enter(self.ns):
                ret, out, _ = bpfsys.prog_test_run(self.dp.fd(prog), frame, ifindex=ifindex,
                                                   linear=linear)
        else:
            ret, out, _ = bpfsys.prog_test_run(self.dp.fd(prog), frame, linear=linear)
        return ret, out

    def run_counted(self, prog: str, frame: bytes, ifindex: int | None = None,
                    linear: int | None = None):
        """(retval, output, counter deltas by name) of one run."""
        before = self.counters()
        ret, out = self.run(prog, frame, ifindex, linear)
        return ret, out, delta(before, self.counters())

    def counters(self) -> dict[str, int]:
        mp = self.maps["mrc_stats"]
        return {c.name.lower(): sum(bpfsys.sum_u64_percpu(mp.lookup(int(c))))
                for c in Ctr if c != Ctr.MAX}

    # -- EV tables
    def conn(self, cid: int):
        return self.cfg.connections[cid]

    def ev_sets(self, cid: int):
        """(active, backup) EvSpec lists per plane, as configured."""
        return self.conn(cid).ev_sets(len(self.cfg.planes))

    def active_evs(self, cid: int) -> list[int]:
        return [s.ev for plane in self.ev_sets(cid)[0] for s in plane]

    def ev_plane(self, cid: int) -> dict[int, int]:
        act, bak = self.ev_sets(cid)
        return {s.ev: s.plane for sets in (act, bak) for plane in sets for s in plane}

    def ev_at(self, cid: int, slot: int):
        return shared.from_bytes("struct mrc_ev", self.maps["mrc_evs"].lookup(cid * SLOTS + slot))

    def put_ev(self, cid: int, slot: int, e) -> None:
        self.maps["mrc_evs"].update(cid * SLOTS + slot, shared.to_bytes(e))

    def slot_of(self, cid: int, ev: int) -> int | None:
        k = ffi.new("struct mrc_evidx_key *", {"conn": cid, "ev": ev})
        raw = self.maps["mrc_evidx"].lookup(shared.to_bytes(k))
        return None if raw is None else int.from_bytes(raw, "little")

    def ev(self, cid: int, ev: int):
        """The struct mrc_ev of a configured EV, found through mrc_evidx."""
        slot = self.slot_of(cid, ev)
        assert slot is not None, "EV %#x has no mrc_evidx entry" % ev
        e = self.ev_at(cid, slot)
        assert e.ev == ev, "mrc_evidx[%#x] -> slot %d holding %#x" % (ev, slot, e.ev)
        return e

    def state(self, cid: int, ev: int) -> EvState:
        return EvState(self.ev(cid, ev).state)

    def set_state(self, cid: int, ev: int, state: EvState) -> None:
        """An operator's deny/allow: the library's own function, on this build's maps and
        its mrc_evop program."""
        from mrc_xdp.datapath import maps as libmaps
        libmaps.set_ev_state(self.maps["mrc_evs"], self.maps["mrc_evidx"], cid, ev, state,
                             evop_fd=self.dp.fd("evop"))

    def slots(self, cid: int) -> dict[int, tuple[int, int]]:
        """slot -> (ev, state) of every configured slot of a connection."""
        out = {}
        for slot in _all_slots(cid):
            e = self.ev_at(cid, slot)
            if e.state != EvState.UNUSED:
                out[slot] = (e.ev, e.state)
        return out

    def ev_table_bytes(self) -> bytes:
        """Raw mrc_evs + mrc_evidx of every connection, to assert 'nothing changed'."""
        out = []
        for cid in range(len(self.cfg.connections)):
            for slot in _all_slots(cid):
                out.append(self.maps["mrc_evs"].lookup(cid * SLOTS + slot))
        out.extend(sorted(k + v for k, v in self.maps["mrc_evidx"].items()))
        return b"".join(out)

    def evctr(self, cid: int, ev: int) -> dict[str, int]:
        """Per-EV counters (summed over CPUs), keyed by the EV's cidx."""
        e = self.ev(cid, ev)
        vals = self.maps["mrc_evctr"].lookup(cid * SLOTS + e.cidx)
        return dict(zip(shared.EV_CTR_FIELDS,
                        bpfsys.sum_u64_percpu(vals, len(shared.EV_CTR_FIELDS))))

    def rxev(self) -> dict[tuple[int, int], dict[str, int]]:
        out = {}
        for k, vals in self.maps["mrc_rxev"].items():
            key = shared.from_bytes("struct mrc_evidx_key", k)
            pk, by, ce = bpfsys.sum_u64_percpu(vals, 3)
            out[(key.conn, key.ev)] = {"pkts": pk, "bytes": by, "ce": ce}
        return out

    def rot(self, cid: int):
        """This CPU's rotation state of a connection: (next plane, [positions consumed per plane])."""
        raw = self.maps["mrc_rot"].lookup(cid)[self.cpu]
        r = shared.from_bytes("struct mrc_rot", raw)
        n = self.conn(cid).ev_per_plane
        return r.plane, [p.round * n + p.i for p in r.p]

    def psn_entry(self, cid: int, psn: int):
        return shared.from_bytes("struct mrc_psn_ent",
                                 self.maps["mrc_psn"].lookup(cid * PSN_RING + psn % PSN_RING))

    def events(self) -> list:
        """EV state-change events since the last call (struct mrc_event cdata)."""
        self._ring.poll(0)
        evs = [shared.from_bytes("struct mrc_event", b) for b in self._events]
        self._events.clear()
        return evs

    # -- planes
    def plane_macs(self, plane: int) -> tuple[bytes, bytes]:
        """(source, destination) MACs spray writes for a plane: NIC MAC, gateway MAC."""
        return mac(DEV_MACS["p%d" % plane]), mac(GW_MACS[plane])

    def plane_of_macs(self, frame: bytes) -> int:
        for p in range(len(self.cfg.planes)):
            smac, dmac = self.plane_macs(p)
            if frame[6:12] == smac and frame[0:6] == dmac:
                return p
        raise AssertionError("MACs %s > %s belong to no plane" % (frame[6:12].hex(),
                                                                 frame[:6].hex()))

    def engine_macs(self) -> tuple[bytes, bytes]:
        """(destination, source) MACs of frames ingress hands to the engine."""
        return mac(DEV_MACS["mrc0"]), mac(DEV_MACS["mrc0p"])

    # -- feedback helpers (peer -> us, through ingress on p0)
    def feedback(self, kind: str, ev_echo: int, cid: int = CONN_A, src: str | None = None,
                 dqpn: int | None = None, dst: str = LOCAL, **kw) -> bytes:
        conn = self.conn(cid)
        src = conn.peer if src is None else src
        dqpn = conn.local_qpn if dqpn is None else dqpn
        if kind == "sack":
            kw.setdefault("cack_psn", 0)
            bm = kw.get("bitmap", 0)
            if bm and "ack_psn_offset" not in kw:
                # a SACK answers its newest arrival: the highest PSN in the bitmap
                kw["ack_psn_offset"] = kw.get("sack_offset", 0) + bm.bit_length() - 1
            return wire.sack_frame(src, dst, dqpn, 1, ev_echo=ev_echo, **kw)
        kw.setdefault("nack_psn", 0)
        return wire.nack_frame(src, dst, dqpn, 1, ev_echo=ev_echo, **kw)

    def spray_evs(self, n: int, cid: int = CONN_A, psn0: int = 0) -> list[int]:
        """Spray n data frames (PSN psn0..), return the EV each went out on."""
        out = []
        for i in range(n):
            ret, o = self.run("spray", data(psn0 + i, cid))
            assert ret == XDP_REDIRECT, "packet %d: %s" % (i, bpfsys.XDP_NAMES.get(ret, ret))
            out.append(wire.ev_of_frame(o))
        return out


def _all_slots(cid: int) -> list[int]:
    """Every slot any test configuration uses for connection cid (active and backup)."""
    slots = set()
    for cfg in CONFIGS.values():
        if cid < len(cfg.connections):
            c, np_ = cfg.connections[cid], len(cfg.planes)
            slots.update(range(c.ev_per_plane * np_))
            slots.update(ACTIVE_MAX + k for k in range(c.backup_per_plane * np_))
    return sorted(slots)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Counters that moved, by name."""
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def xdp_name(ret: int) -> str:
    return bpfsys.XDP_NAMES.get(ret, str(ret))


def bpf_available() -> str | None:
    """None if the bpf() syscall can create a map here, else why not."""
    import ctypes
    import errno as _errno

    libc = ctypes.CDLL(None, use_errno=True)
    # union bpf_attr for BPF_MAP_CREATE: type, key_size, value_size, max_entries
    attr = struct.pack("IIII", 2, 4, 4, 1) + bytes(112)   # BPF_MAP_TYPE_ARRAY
    buf = ctypes.create_string_buffer(attr, len(attr))
    nr = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
    if nr is None:
        return None   # unknown arch: let the build decide
    fd = libc.syscall(nr, 0, buf, len(attr))   # BPF_MAP_CREATE
    if fd < 0:
        e = ctypes.get_errno()
        return "bpf() unavailable: %s" % (_errno.errorcode.get(e, e))
    os.close(fd)
    return None


# ------------------------------------------------------------------ non-MRC traffic
def _non_mrc_frames():
    """(name, frame, subset counter or None): none of these is Ethernet | IPv6 | UDP to
    4791 at the expected place, so every program must pass them unchanged."""
    from scapy.layers.inet import IP, TCP
    from scapy.layers.inet6 import (ICMPv6EchoRequest, IPv6ExtHdrDestOpt,
                                    IPv6ExtHdrFragment, IPv6ExtHdrHopByHop,
                                    IPv6ExtHdrSegmentRouting)
    from scapy.layers.l2 import ARP, Dot1AD, Dot1Q

    mrc = data(5)                        # a valid MRC frame of connection A
    ip6_mrc = IPv6(mrc[ETH:])            # its IPv6 packet, dissected
    udp_mrc = bytes(ip6_mrc[UDP])
    eth = Ether(src=wire.DEFAULT_SMAC, dst=wire.DEFAULT_DMAC)
    e6 = lambda nh, payload: bytes(eth / IPv6(src=LOCAL, dst=PEER_A, nh=nh) / payload)  # noqa: E731

    def ext(hdr):
        return bytes(eth / IPv6(src=LOCAL, dst=PEER_A) / hdr /
                     UDP(sport=0x1234, dport=PORT, chksum=0)) + udp_mrc[8:]

    bad_version = bytearray(mrc)
    bad_version[ETH] = 0x40 | (bad_version[ETH] & 0x0F)
    other_dport = bytearray(mrc)
    other_dport[ETH + IP6 + 2:ETH + IP6 + 4] = (PORT + 1).to_bytes(2, "big")
    sport_only = bytearray(other_dport)
    sport_only[ETH + IP6:ETH + IP6 + 2] = PORT.to_bytes(2, "big")
    lldp = bytearray(mrc)
    lldp[12:14] = b"\x88\xcc"
    return [
        ("arp", bytes(eth / ARP(pdst="10.0.0.1")), None),
        ("ipv4-udp-4791", bytes(eth / IP(src="10.0.0.1", dst="10.0.0.2") /
                                UDP(sport=0xC000, dport=PORT) / udp_mrc[8:]), "non_mrc_ipv4"),
        ("vlan-mrc", bytes(Ether(src=wire.DEFAULT_SMAC, dst=wire.DEFAULT_DMAC) / Dot1Q(vlan=7) /
                           ip6_mrc), "non_mrc_vlan"),
        ("qinq-mrc", bytes(Ether(src=wire.DEFAULT_SMAC, dst=wire.DEFAULT_DMAC) / Dot1AD(vlan=5) /
                           Dot1Q(vlan=7) / ip6_mrc), "non_mrc_vlan"),
        ("ipv6-tcp-4791", bytes(eth / IPv6(src=LOCAL, dst=PEER_A) / TCP(sport=4791, dport=4791)),
         None),
        ("ipv6-udp-4792", bytes(other_dport), None),
        ("ipv6-udp-sport-4791", bytes(sport_only), None),
        ("ipv6-hbh-udp-4791", ext(IPv6ExtHdrHopByHop()), "non_mrc_exthdr"),
        ("ipv6-srh-udp-4791", ext(IPv6ExtHdrSegmentRouting(addresses=[PEER_A])), "non_mrc_exthdr"),
        ("ipv6-frag-udp-4791", ext(IPv6ExtHdrFragment(id=1)), "non_mrc_exthdr"),
        ("ipv6-destopt-udp-4791", ext(IPv6ExtHdrDestOpt()), "non_mrc_exthdr"),
        ("ipv6-icmpv6", bytes(eth / IPv6(src=LOCAL, dst=PEER_A) / ICMPv6EchoRequest()), None),
        ("ipv6-no-next-header", e6(59, b"\0" * 40), None),
        ("ipv6-version-4", bytes(bad_version), None),
        ("lldp-ethertype", bytes(lldp), None),
        ("runt-eth-only", mrc[:ETH], None),
        ("runt-ipv6-39", mrc[:ETH + 39], None),
        ("runt-ipv6-no-udp", mrc[:ETH + IP6], None),
        ("runt-udp-7", mrc[:ETH + IP6 + 7], None),
    ]


NON_MRC_FRAMES = _non_mrc_frames()
