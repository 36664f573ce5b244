"""Tier 1: a datapath instance holding MRC_MAX_CONNS (1024) connections.

A datapath of its own (built here, in the session netns of the tier-1 tests), configured
through the real map writer with 1024 connections over 32 peers, 8 active + 4 backup EVs
per plane on 2 planes.  For the first, a middle and the last connection: spray puts a
data frame on one of that connection's EVs, counts it on that connection's per-EV counter
and records its PSN in that connection's PSN ring; ingress applies a SACK echoing one of
its EVs to that connection's slot (SKIP) and nobody else's, and counts received data
under that connection.  The map sizes follow MRC_MAX_CONNS.
"""
from __future__ import annotations

import pytest

from helpers import LOCAL, XDP_REDIRECT
from mrc_xdp.datapath import bpfsys, netns, wire
from mrc_xdp.datapath.config import HostConfig
from mrc_xdp.datapath.shared import CONSTS, EvState, SackM, const, from_bytes

N = const("MRC_MAX_CONNS")
SLOTS = const("MRC_EV_SLOTS")
RING = const("MRC_PSN_RING")
PEERS = 32
PSN = 0x1234


def peer_of(i: int) -> str:
    return "fd00:300::%x" % (1 + i % PEERS)


def qpns_of(i: int) -> tuple[int, int]:
    return 0x10000 + i, 0x20000 + i          # (local, remote)


def config() -> HostConfig:
    planes = [{"dev": "p0", "gateway_mac": "02:6d:72:00:01:01"},
              {"dev": "p1", "gateway_mac": "02:6d:72:00:02:01"}]
    conns = [{"peer": peer_of(i), "local_qpn": qpns_of(i)[0], "remote_qpn": qpns_of(i)[1],
              "ev_per_plane": 8, "backup_per_plane": 4, "name": "c%d" % i} for i in range(N)]
    return HostConfig.from_dict({"instance": "scale", "mode": "ecmp", "local_addr": LOCAL,
                                 "planes": planes, "connections": conns, "loss_thresh": 1})


@pytest.fixture(scope="module")
def scale(dp_env):
    from mrc_xdp.datapath import loader
    dp = loader.build()
    try:
        cfg = config()
        with netns.enter(dp_env.ns):
            dp.configure(cfg, dp_env.dev)
        yield dp, cfg
    finally:
        dp.close()


def run(dp_env, dp, prog, frame):
    ifx = dp_env.ifindex["p0"] if prog == "ingress" else dp_env.ifindex["mrc0p"]
    with netns.enter(dp_env.ns):
        ret, out, _ = bpfsys.prog_test_run(dp.fd(prog), frame, ifindex=ifx)
    return ret, out


def ev_state(dp, cid, slot):
    return from_bytes("struct mrc_ev", dp.maps["mrc_evs"].lookup(cid * SLOTS + slot))


def test_maps_sized_from_max_conns(scale):
    dp, _ = scale
    assert N >= 1024
    m = dp.maps
    assert m["mrc_conns"].max_entries == N
    assert m["mrc_rot"].max_entries == N
    assert m["mrc_connidx"].max_entries == 4 * N
    for name in ("mrc_evs", "mrc_evidx", "mrc_evctr"):
        assert m[name].max_entries == N * SLOTS, name
    assert m["mrc_psn"].max_entries == N * RING
    assert CONSTS["MRC_RXEV_MAX"] >= 16 * N
    # every connection's two keys and every peer's two probe keys are in the index
    assert len(list(m["mrc_connidx"].keys())) == 2 * N + 2 * PEERS


@pytest.mark.parametrize("cid", [0, N // 2 - 1, N - 1], ids=["first", "middle", "last"])
def test_spray_and_ingress_pick_the_connection(dp_env, scale, cid):
    dp, cfg = scale
    conn = cfg.connections[cid]
    peer, (lq, rq) = peer_of(cid), qpns_of(cid)
    active, _ = conn.ev_sets(2)
    slot_of = {e.ev: p * 8 + k for p, pl in enumerate(active) for k, e in enumerate(pl)}

    # spray: one of this connection's EVs, counted and recorded as this connection's
    tx = wire.data_frame(LOCAL, peer, rq, PSN, b"\xab" * 256)
    ret, out = run(dp_env, dp, "spray", tx)
    assert ret == XDP_REDIRECT
    ev = wire.ev_of_frame(out)
    assert ev in slot_of, "EV %#x is not one of connection %d's" % (ev, cid)
    assert wire.frame_icrc_ok(out)
    e = ev_state(dp, cid, slot_of[ev])
    ctr = bpfsys.sum_u64_percpu(dp.maps["mrc_evctr"].lookup(cid * SLOTS + e.cidx), 8)
    assert ctr[0] == 1                                           # tx_pkts
    ent = from_bytes("struct mrc_psn_ent", dp.maps["mrc_psn"].lookup(cid * RING + PSN % RING))
    assert (ent.psn, ent.ev) == (PSN, ev)
    c = from_bytes("struct mrc_conn", dp.maps["mrc_conns"].lookup(cid))
    assert c.psn_hi == PSN

    # ingress: a SACK (M=SKIP_ONCE) echoing that EV puts it in SKIP, in this connection only
    others = [x for x in (0, N // 2 - 1, N - 1) if x != cid]
    before = {x: [ev_state(dp, x, s).state for s in range(16)] for x in others}
    sk = wire.sack_frame(peer, LOCAL, lq, PSN, cack_psn=PSN, ev_echo=ev, m=SackM.SKIP_ONCE)
    ret, _ = run(dp_env, dp, "ingress", sk)
    assert ret == XDP_REDIRECT
    assert ev_state(dp, cid, slot_of[ev]).state == EvState.SKIP
    assert {x: [ev_state(dp, x, s).state for s in range(16)] for x in others} == before

    # ingress data from the peer: counted under this connection
    rx_ev = 0x5A5A0000 | cid
    rx = wire.data_frame(peer, LOCAL, lq, PSN, b"\xcd" * 64, ev=rx_ev)
    ret, _ = run(dp_env, dp, "ingress", rx)
    assert ret == XDP_REDIRECT
    key = (cid).to_bytes(4, "little") + rx_ev.to_bytes(4, "little")
    row = dp.maps["mrc_rxev"].lookup(key)
    assert row is not None and bpfsys.sum_u64_percpu(row, 3)[0] == 1
