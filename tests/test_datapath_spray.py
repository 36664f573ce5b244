"""Tier 1: the spray program (engine -> fabric) through BPF_PROG_TEST_RUN.

Each case: an input frame built with mrc_xdp.datapath.wire / scapy, the expected verdict, the
expected output bytes (computed in tests/helpers.py independently of the datapath: field
rewrites by hand, ICRC by zlib over the masked packet, UDP checksum recomputed, SRv6
destination from the template by wire.usid_address) and the exact counter deltas.
"""
from __future__ import annotations

import collections

import pytest

from helpers import (CONN_A, CONN_B, DSCP_CTRL, DSCP_DATA, DSCP_RTX, HOP_LIMIT, LOCAL,
                     PEER_A, PEER_B, QPN_A_LOCAL, QPN_A_REMOTE, QPN_B_LOCAL, SRV6_SRC, STRANGER,
                     TEMPLATES, XDP_DROP, XDP_REDIRECT, data, frame_of,
                     set_flowlabel, spray_rewrite, srv6_da, srv6_push, xdp_name)
from mrc_xdp.datapath import wire
from mrc_xdp.datapath.shared import EvState, Opcode, SackM, const

DATA_OPS = [Opcode.WRITE_FIRST, Opcode.WRITE_MIDDLE, Opcode.WRITE_LAST,
            Opcode.WRITE_LAST_IMM, Opcode.WRITE_ONLY, Opcode.WRITE_ONLY_IMM]
CTRL_KINDS = ["ack", "sack", "nack", "ep_req", "ep_resp"]   # probes: test_probe_datapath.py


def _spray_cases():
    """(id, kind, builder keywords, is data)."""
    cases = []
    for op in DATA_OPS:
        for ts in (None, 0xABCD):
            for csum in (False, True):
                cases.append(("%s%s%s" % (op.name, "-ts" if ts is not None else "",
                                          "-csum" if csum else ""),
                              "data", dict(opcode=op, ts=ts, udp_csum=csum,
                                           imm=0x1234567 if op.name.endswith("IMM") else None)))
    for kind in CTRL_KINDS:
        for csum in (False, True):
            cases.append(("%s%s" % (kind, "-csum" if csum else ""), kind, dict(udp_csum=csum)))
    # traffic class, retransmission, an odd payload length and an EV already in the frame
    cases += [
        ("data-ect1", "data", dict(tc=1)),
        ("data-ce", "data", dict(tc=(7 << 2) | 3)),
        ("data-ect0-dscp9", "data", dict(tc=(9 << 2) | 2)),
        ("data-rtx", "data", dict(rtx=True)),
        ("data-rtx-csum-ackreq", "data", dict(rtx=True, ackreq=True, udp_csum=True)),
        ("data-odd-payload", "data", dict(payload=b"\x01" * 37, udp_csum=True)),
        ("data-big", "data", dict(payload=bytes(range(256)) * 12, udp_csum=True)),
        ("data-ev-in", "data", dict(ev=0xFEDC1234, tc=0x12)),
        ("sack-ev-in", "sack", dict(ev=0x00010002, tc=(46 << 2) | 2)),
        ("nack-tc", "nack", dict(tc=(12 << 2))),
    ]
    return cases


SPRAY_CASES = _spray_cases()


def _expected_dscp(kind, kw):
    if kind != "data":
        return DSCP_CTRL
    return DSCP_RTX if kw.get("rtx") else DSCP_DATA


@pytest.mark.parametrize("kind,kw", [c[1:] for c in SPRAY_CASES], ids=[c[0] for c in SPRAY_CASES])
def test_spray_rewrites_every_opcode(ecmp, kind, kw):
    env = ecmp
    f = frame_of(kind, LOCAL, PEER_A, QPN_A_REMOTE, psn=41, **dict(kw))
    assert wire.frame_icrc_ok(f)
    ret, out, d = env.run_counted("spray", f)
    assert ret == XDP_REDIRECT, xdp_name(ret)

    ev = wire.ev_of_frame(out)
    assert ev in env.active_evs(CONN_A)
    assert (int.from_bytes(out[14:18], "big") >> 16) & 0xF == 0, "upper 4 flow-label bits set"
    plane = env.ev_plane(CONN_A)[ev]
    smac, dmac = env.plane_macs(plane)
    assert env.plane_of_macs(out) == plane
    expected = spray_rewrite(f, ev, smac, dmac, _expected_dscp(kind, kw))
    assert out.hex() == expected.hex()
    # independent checks of what the comparison above already implies
    assert wire.frame_icrc_ok(out), "ICRC invalid after spray"
    if kw.get("udp_csum"):
        assert wire.udp6_checksum_ok(out[14:], allow_zero=False), "UDP checksum invalid after spray"
    else:
        assert out[60:62] == b"\0\0"
    tc = (int.from_bytes(out[14:16], "big") >> 4) & 0xFF
    assert tc >> 2 == _expected_dscp(kind, kw)
    in_ecn = kw.get("tc", 0) & 3
    assert tc & 3 == (2 if kind == "data" and in_ecn == 0 else in_ecn)

    want = {"spray_rx": 1, "spray_tx": 1, "spray_bytes": len(out), "spray_icrc_fix": 1,
            "spray_data" if kind == "data" else "spray_ctrl": 1}
    if kw.get("udp_csum"):
        want["spray_csum_fix"] = 1
    assert d == want
    ctr = env.evctr(CONN_A, ev)
    assert (ctr["tx_pkts"], ctr["tx_bytes"]) == (1, len(f))

    # PSN -> EV is recorded for data only
    pe = env.psn_entry(CONN_A, 41)
    if kind == "data":
        assert (pe.psn, pe.ev, pe.flags) == (41, ev, const("MRC_PSNF_VALID"))
    else:
        assert pe.flags == 0


@pytest.mark.parametrize("extra", [b"\x7e", b"\x7e\x7f", b"\x01\x02\x03"],
                         ids=["odd", "even-2", "odd-3"])
@pytest.mark.parametrize("kind", ["data", "sack"])
def test_spray_checksum_with_unaligned_trailer(ecmp, kind, extra):
    """UDP lengths that are not a multiple of 4 put the ICRC trailer at an odd offset."""
    from helpers import odd_length
    f = odd_length(frame_of(kind, LOCAL, PEER_A, QPN_A_REMOTE), extra)
    assert wire.frame_icrc_ok(f) and wire.udp6_checksum_ok(f[14:], allow_zero=False)
    ret, out = ecmp.run("spray", f)
    assert ret == XDP_REDIRECT
    assert wire.frame_icrc_ok(out)
    assert wire.udp6_checksum_ok(out[14:], allow_zero=False), "UDP checksum invalid after spray"
    ev = wire.ev_of_frame(out)
    smac, dmac = ecmp.plane_macs(ecmp.ev_plane(CONN_A)[ev])
    assert out.hex() == spray_rewrite(f, ev, smac, dmac, _expected_dscp(kind, {})).hex()


def test_spray_upper_flowlabel_bits_cleared(ecmp):
    f = set_flowlabel(data(3), 0xF1234)
    ret, out = ecmp.run("spray", f)
    assert ret == XDP_REDIRECT
    ev = wire.ev_of_frame(out)
    assert int.from_bytes(out[14:18], "big") & 0xFFFFF == ev & 0xFFFF
    smac, dmac = ecmp.plane_macs(ecmp.ev_plane(CONN_A)[ev])
    assert out == spray_rewrite(f, ev, smac, dmac, DSCP_DATA)


def test_spray_without_dscp_rewrite_keeps_dscp(ecmp):
    ecmp.set_cfg(flags=const("MRC_CF_SET_ECT"))
    for kind, tc in (("data", (9 << 2)), ("sack", (20 << 2) | 1)):
        f = frame_of(kind, LOCAL, PEER_A, QPN_A_REMOTE, tc=tc)
        ret, out = ecmp.run("spray", f)
        assert ret == XDP_REDIRECT
        ev = wire.ev_of_frame(out)
        smac, dmac = ecmp.plane_macs(ecmp.ev_plane(CONN_A)[ev])
        assert out == spray_rewrite(f, ev, smac, dmac, None)


def test_spray_without_set_ect_keeps_not_ect(ecmp):
    ecmp.set_cfg(flags=const("MRC_CF_DSCP_REWRITE"))
    f = data(5)
    ret, out = ecmp.run("spray", f)
    assert ret == XDP_REDIRECT
    ev = wire.ev_of_frame(out)
    smac, dmac = ecmp.plane_macs(ecmp.ev_plane(CONN_A)[ev])
    assert out == spray_rewrite(f, ev, smac, dmac, DSCP_DATA, set_ect=False)


def test_spray_second_connection(ecmp):
    ret, out = ecmp.run("spray", data(9, CONN_B))
    assert ret == XDP_REDIRECT
    assert wire.ev_of_frame(out) in ecmp.active_evs(CONN_B)


UNKNOWN_CONN = [
    ("unknown-peer", STRANGER, QPN_A_REMOTE),
    ("wrong-qpn", PEER_A, 0x3FF),
    ("local-qpn-is-rx-key", PEER_A, QPN_A_LOCAL),
    ("peer-b-with-a-qpn", PEER_B, QPN_A_REMOTE),
]


@pytest.mark.parametrize("kind", ["data", "sack", "ack"])
@pytest.mark.parametrize("dst,dqpn", [c[1:] for c in UNKNOWN_CONN],
                         ids=[c[0] for c in UNKNOWN_CONN])
def test_spray_unknown_connection_passes_unchanged(ecmp, kind, dst, dqpn):
    f = frame_of(kind, LOCAL, dst, dqpn, udp_csum=True)
    ret, out, d = ecmp.run_counted("spray", f)
    assert (xdp_name(ret), out) == ("PASS", f)
    assert d == {"spray_rx": 1, "spray_no_conn": 1}
    assert ecmp.psn_entry(CONN_A, 7).flags == 0


def test_spray_no_usable_ev_drops(ecmp):
    for ev in ecmp.active_evs(CONN_B):
        ecmp.set_state(CONN_B, ev, EvState.DENIED)
    ret, out, d = ecmp.run_counted("spray", data(1, CONN_B))
    assert ret == XDP_DROP
    assert d == {"spray_rx": 1, "spray_no_ev": 1}


def test_spray_every_ev_skipping_sends_on_one(ecmp):
    """Every active EV in SKIP (ECN marks came back on all of them): the packet goes on
    the first EV met, which has sat out its turn and is GOOD again (spray_skip_resort),
    rather than being dropped (spray_no_ev): a congested path still delivers, and a
    dropped first send costs a resend at best (issue 17's lab stall began with one)."""
    env = ecmp
    evs = env.active_evs(CONN_B)
    for ev in evs:
        env.set_state(CONN_B, ev, EvState.SKIP)
    ret, out, d = env.run_counted("spray", data(1, CONN_B))
    assert ret == XDP_REDIRECT, xdp_name(ret)
    assert d["spray_skip_resort"] == 1 and d["spray_tx"] == 1 and d["spray_skip"] >= 1
    assert "spray_no_ev" not in d and "spray_last_resort" not in d
    used = wire.ev_of_frame(out)
    assert used in evs and env.state(CONN_B, used) == EvState.GOOD


def test_spray_last_resort_on_a_retired_ev(ecmp):
    """Every EV retired (ASSUMED_BAD; connection B has no backups) and no daemon to probe
    them back: spray sends on a retired EV rather than drop (spray_last_resort), states
    unchanged, so random loss cannot cut a connection off for good.  One GOOD EV back:
    only it is used.  DENIED EVs are never a last resort (test above)."""
    env = ecmp
    evs = env.active_evs(CONN_B)
    for ev in evs:
        env.set_state(CONN_B, ev, EvState.ASSUMED_BAD)
    used = set()
    for i in range(2 * len(evs)):
        ret, out, d = env.run_counted("spray", data(i, CONN_B))
        assert ret == XDP_REDIRECT, xdp_name(ret)
        assert d["spray_last_resort"] == 1 and d["spray_tx"] == 1 and "spray_no_ev" not in d
        used.add(wire.ev_of_frame(out))
    assert used <= set(evs) and len(used) > 1
    assert all(env.state(CONN_B, ev) == EvState.ASSUMED_BAD for ev in evs)
    env.set_state(CONN_B, evs[2], EvState.GOOD)
    on_good = 0
    for i in range(4 * len(evs)):
        ret, out, d = env.run_counted("spray", data(100 + i, CONN_B))
        assert ret == XDP_REDIRECT
        if wire.ev_of_frame(out) == evs[2]:
            on_good += 1
            assert "spray_last_resort" not in d
        else:           # a turn whose tries missed the one GOOD EV
            assert d["spray_last_resort"] == 1
    assert on_good >= 2 * len(evs)


def test_spray_plane_without_nic_drops(ecmp):
    from mrc_xdp.datapath import shared
    for p in (0, 1):
        pl = shared.from_bytes("struct mrc_plane", ecmp.maps["mrc_planes"].lookup(p))
        pl.ifindex = 0
        ecmp.maps["mrc_planes"].update(p, shared.to_bytes(pl))
    ret, out, d = ecmp.run_counted("spray", data(1))
    assert ret == XDP_DROP
    assert d == {"spray_rx": 1, "spray_no_port": 1}


# ------------------------------------------------------------------ SRv6 mode

SRV6_CASES = [("data", dict(udp_csum=True)), ("data", dict(opcode=Opcode.WRITE_LAST_IMM, ts=7)),
              ("sack", {}), ("nack", {}), ("ack", {}), ("ep_req", {}),
              ("ep_resp", dict(udp_csum=True)), ("data", dict(tc=3, rtx=True))]


@pytest.mark.parametrize("cid", [CONN_A, CONN_B], ids=["tmpl-with-t1", "tmpl-6-usids"])
@pytest.mark.parametrize("kind,kw", SRV6_CASES,
                         ids=["%s%d" % (c[0], i) for i, c in enumerate(SRV6_CASES)])
def test_spray_srv6_encapsulates(srv6, cid, kind, kw):
    env = srv6
    conn = env.conn(cid)
    f = frame_of(kind, LOCAL, conn.peer, conn.remote_qpn, psn=77, **dict(kw))
    seen = set()
    # enough packets to visit both planes and both T1s
    for i in range(2 * conn.ev_per_plane):
        if kw.get("rtx"):   # a PSN never sent: no earlier send to blame (test_rtx_loss_*)
            f = frame_of(kind, LOCAL, conn.peer, conn.remote_qpn, psn=5000 + i, **dict(kw))
        ret, out, d = env.run_counted("spray", f)
        assert ret == XDP_REDIRECT, xdp_name(ret)
        ev = wire.ev_of_frame(out)
        e = env.ev(cid, ev)
        plane, t1 = e.plane, e.t1
        seen.add((plane, t1))
        smac, dmac = env.plane_macs(plane)
        inner = spray_rewrite(f, ev, smac, dmac, _expected_dscp(kind, kw))
        da = srv6_da(TEMPLATES[conn.template], plane, t1)
        expected = srv6_push(inner, SRV6_SRC[plane], da, HOP_LIMIT)
        assert out.hex() == expected.hex(), "plane %d t1 %d: DA should be %s" % (plane, t1, da)
        assert out[20] == 41 and out[14:18] == out[54:58]
        assert wire.frame_icrc_ok(out)
        if kw.get("udp_csum"):
            assert wire.udp6_checksum_ok(out[54:], allow_zero=False)
        want = {"spray_rx": 1, "spray_tx": 1, "spray_bytes": len(out), "spray_icrc_fix": 1,
                "spray_srv6_encap": 1, "spray_data" if kind == "data" else "spray_ctrl": 1}
        if kw.get("udp_csum"):
            want["spray_csum_fix"] = 1
        assert d == want
    want_seen = {(p, t) for p in range(2) for t in range(conn.t1s)}
    assert seen == want_seen


def test_spray_srv6_missing_template_drops(srv6):
    from mrc_xdp.datapath import shared
    srv6.maps["mrc_srv6"].update(0, bytes(shared.sizeof("struct mrc_srv6_tmpl")))
    ret, out, d = srv6.run_counted("spray", data(1))
    assert ret == XDP_DROP
    assert d == {"spray_rx": 1, "spray_no_tmpl": 1, "spray_icrc_fix": 1}
    # a dropped packet is neither counted as sent nor remembered as carrying its PSN
    assert sum(srv6.evctr(CONN_A, ev)["tx_pkts"] for ev in srv6.active_evs(CONN_A)) == 0
    assert srv6.psn_entry(CONN_A, 1).flags == 0


@pytest.mark.parametrize("op", [0x04, 0x0A, 0x64, 0x81, 0xE0])
def test_plain_rocev2_on_4791_is_not_mrc(ecmp, op):
    """RoCEv2 RC/UD opcodes (SEND, RDMA WRITE ...) and others MRC does not use share
    UDP 4791: they pass both programs byte-for-byte unchanged, counted non_mrc_roce."""
    f = bytearray(data(1))
    f[54 + 8] = op
    f = bytes(f)
    for prog, pre in (("spray", "spray"), ("ingress", "ing")):
        ret, out, d = ecmp.run_counted(prog, f)
        assert (xdp_name(ret), out, d) == ("PASS", f, {pre + "_rx": 1, pre + "_non_mrc": 1,
                                                        "non_mrc_roce": 1})


# ------------------------------------------------------------------ PSN -> EV ring

def test_spray_records_psn_to_ev(ecmp):
    psns = [5, 6, 1023, 1024, 0xFFFFFF]
    evs = {}
    for psn in psns:
        ret, out = ecmp.run("spray", data(psn))
        assert ret == XDP_REDIRECT
        evs[psn] = wire.ev_of_frame(out)
    for psn in psns:
        if psn == 1023 or psn == 0xFFFFFF:   # same ring slot as a later / earlier one
            continue
        pe = ecmp.psn_entry(CONN_A, psn)
        assert (pe.psn, pe.ev, pe.flags) == (psn, evs[psn], const("MRC_PSNF_VALID"))
    pe = ecmp.psn_entry(CONN_A, 0xFFFFFF)    # 0xFFFFFF % 1024 == 1023: the newer send wins
    assert (pe.psn, pe.ev) == (0xFFFFFF, evs[0xFFFFFF])
    # control frames record nothing
    ret, _ = ecmp.run("spray", frame_of("ack", LOCAL, PEER_A, QPN_A_REMOTE, psn=300))
    assert ret == XDP_REDIRECT and ecmp.psn_entry(CONN_A, 300).flags == 0


# ------------------------------------------------------------------ Must show: spraying

N_SPRAY = 100_000


def _spray_many(env, n, psn0=0):
    """Spray n data frames of connection A; (EV -> count, plane -> count) from the output
    frames, checking each frame's MACs against its EV's plane."""
    base = bytearray(data(0, payload=b"\xa5" * 256))
    plane_of = env.ev_plane(CONN_A)
    ev_n = collections.Counter()
    plane_n = collections.Counter()
    macs = {p: env.plane_macs(p) for p in (0, 1)}
    fd = env.dp.fd("spray")
    from mrc_xdp.datapath import bpfsys
    run = bpfsys.prog_test_run
    for i in range(n):
        psn = (psn0 + i) & 0xFFFFFF
        base[71:74] = psn.to_bytes(3, "big")   # BTH PSN (ICRC left stale: spray does not check it)
        ret, out, _ = run(fd, bytes(base))
        if ret != XDP_REDIRECT:
            raise AssertionError("packet %d: %s" % (i, xdp_name(ret)))
        ev = int.from_bytes(out[54:56], "big") << 16 | int.from_bytes(out[16:18], "big")
        p = plane_of[ev]
        smac, dmac = macs[p]
        if out[6:12] != smac or out[0:6] != dmac:
            raise AssertionError("packet %d: EV %#x of plane %d sent with another plane's MACs"
                                 % (i, ev, p))
        ev_n[ev] += 1
        plane_n[p] += 1
    return ev_n, plane_n


def _check_balance(env, ev_n, plane_n, n, usable):
    for p in (0, 1):
        share = plane_n[p] / n
        assert abs(share - 0.5) <= 0.01, "plane %d carried %.4f of the packets" % (p, share)
    fair = n / len(usable)
    assert set(ev_n) == set(usable), "EVs used %s, usable %s" % (
        sorted(map(hex, ev_n)), sorted(map(hex, usable)))
    for ev in usable:
        assert abs(ev_n[ev] - fair) <= 0.10 * fair, "EV %#x carried %d, fair share %.0f" % (
            ev, ev_n[ev], fair)


def test_must_show_spraying_100k_balanced_and_bad_ev_never_used(ecmp):
    env = ecmp
    active = env.active_evs(CONN_A)
    assert len(active) == 16
    ev_n, plane_n = _spray_many(env, N_SPRAY)
    _check_balance(env, ev_n, plane_n, N_SPRAY, active)
    # the per-EV counters agree with the frames
    for ev in active:
        assert env.evctr(CONN_A, ev)["tx_pkts"] == ev_n[ev]
    assert env.counters()["spray_tx"] == N_SPRAY
    print("\nplanes %s; per EV min %d max %d (fair %d)" % (
        dict(plane_n), min(ev_n.values()), max(ev_n.values()), N_SPRAY // 16))

    # one EV of plane 1 goes ASSUMED_BAD through ingress (SACK M=ALWAYS_SKIP)
    bad = env.ev_sets(CONN_A)[0][1][3].ev
    bad_slot = env.slot_of(CONN_A, bad)
    backups1 = [s.ev for s in env.ev_sets(CONN_A)[1][1]]
    tx_before = env.evctr(CONN_A, bad)["tx_pkts"]
    ret, _, d = env.run_counted("ingress", env.feedback("sack", bad, m=SackM.ALWAYS_SKIP,
                                                        cack_psn=N_SPRAY - 1))
    assert ret == XDP_REDIRECT
    assert d["ing_fb_bad"] == 1 and d["ing_fb_replaced"] == 1
    assert env.state(CONN_A, bad) == EvState.ASSUMED_BAD
    repl = env.ev_at(CONN_A, bad_slot).ev
    assert repl == backups1[0], "slot %d took %#x, not plane 1's first backup" % (bad_slot, repl)
    assert env.ev(CONN_A, repl).plane == 1 and env.state(CONN_A, repl) == EvState.GOOD
    # mrc_evidx points at the new slots
    assert env.slot_of(CONN_A, repl) == bad_slot
    assert env.slot_of(CONN_A, bad) == const("MRC_EV_ACTIVE_MAX") + 1 * 4 + 0

    usable = [e for e in active if e != bad] + [repl]
    ev_n, plane_n = _spray_many(env, N_SPRAY, psn0=N_SPRAY)
    assert ev_n[bad] == 0, "retired EV %#x still used %d times" % (bad, ev_n[bad])
    _check_balance(env, ev_n, plane_n, N_SPRAY, usable)
    assert env.evctr(CONN_A, bad)["tx_pkts"] == tx_before
    assert env.evctr(CONN_A, repl)["tx_pkts"] == ev_n[repl]


# ------------------------------------------------------------------ planes out of rotation

N_PLANES4 = 4


def _use_planes(env, nplanes):
    """Connection A alone, over nplanes planes (4 active EVs and 2 backups each: slots
    the two-plane configurations use too, so the next Env.use() zeroes them).  Planes
    2.. reuse the devices of 0 and 1 (a test run redirects nowhere) with MACs of their
    own, so every output frame still says which plane sent it."""
    from helpers import GW_MACS, _conf
    from mrc_xdp.datapath import netns
    from mrc_xdp.datapath.config import HostConfig
    from mrc_xdp.datapath.maps import DevInfo, write_all
    env.use("ecmp")                     # zero every run-time state
    d = _conf("ecmp")
    d["planes"] = [{"dev": "p%d" % p, "gateway_mac": "02:6d:72:00:%02x:01" % (p + 1)} for p in range(nplanes)]
    d["connections"] = [dict(d["connections"][0], ev_per_plane=4, backup_per_plane=2)]
    cfg = HostConfig.from_dict(d)
    assert GW_MACS == ["02:6d:72:00:01:01", "02:6d:72:00:02:01"]     # planes 0, 1 as in helpers
    macs = {p: ("02:6d:72:00:%02x:00" % (p + 1), "02:6d:72:00:%02x:01" % (p + 1)) for p in range(nplanes)}
    dev = DevInfo(env.ifindex["mrc0"], "02:6d:72:00:00:01", env.ifindex["mrc0p"], "02:6d:72:00:00:02",
                  [(env.ifindex["p%d" % (p % 2)],) + macs[p] for p in range(nplanes)])
    with netns.enter(env.ns):
        write_all(env.maps, cfg, dev, [])
    env.cfg = cfg


def _spray_planes(env, n):
    """Spray n data frames; (plane -> packets by the output MACs, EV -> packets)."""
    plane_of = env.ev_plane(CONN_A)
    planes, evs = collections.Counter(), collections.Counter()
    for ev in env.spray_evs(n):
        evs[ev] += 1
        planes[plane_of[ev]] += 1
    return planes, evs


@pytest.mark.parametrize("down", [(2,), (0,), (1, 3), (0, 1, 2)], ids=["p2", "p0", "p1p3", "p0p1p2"])
def test_spray_plane_out_of_rotation_shares_equally(datapath, down):
    """4 planes, some out of rotation (MRC_PF_DOWN, written by the daemon's own writer):
    the planes that are up carry exactly equal shares (round robin on one CPU), every EV
    of theirs equally, none of a down plane's EVs is used and no EV changes state; put
    back, the plane takes its equal share again."""
    from mrc_xdp.datapath import maps as libmaps
    from helpers import data as data_frame
    env = datapath
    _use_planes(env, N_PLANES4)
    for p in down:
        assert libmaps.set_plane_down(env.maps["mrc_planes"], p, True)
    assert not libmaps.set_plane_down(env.maps["mrc_planes"], down[0], True), "already down"
    states = env.ev_table_bytes()
    n = 1200                            # divisible by every number of planes up x 4 EVs
    up = [p for p in range(N_PLANES4) if p not in down]
    before = env.counters()
    planes, evs = _spray_planes(env, n)
    assert dict(planes) == {p: n // len(up) for p in up}, planes
    act = env.ev_sets(CONN_A)[0]
    for p in range(N_PLANES4):
        for s in act[p]:
            assert evs[s.ev] == (n // len(up) // 4 if p in up else 0), (p, hex(s.ev), evs[s.ev])
    assert env.ev_table_bytes() == states, "an EV changed state"
    after = env.counters()
    assert after["spray_tx"] - before["spray_tx"] == n and after["spray_no_ev"] == before["spray_no_ev"]
    # the output frames carry their plane's MACs
    ret, out = env.run("spray", data_frame(n + 1))
    assert ret == XDP_REDIRECT
    p = env.ev_plane(CONN_A)[wire.ev_of_frame(out)]
    assert p in up and out[6:12] == bytes.fromhex("026d7200%02x00" % (p + 1))
    # back in rotation: equal shares over all four
    for p in down:
        assert libmaps.set_plane_down(env.maps["mrc_planes"], p, False)
    planes, _ = _spray_planes(env, n)
    assert dict(planes) == {p: n // N_PLANES4 for p in range(N_PLANES4)}, planes
    env.use("ecmp")


def test_spray_plane_taken_out_by_the_operator(datapath):
    """MRC_PF_ADMIN (`mrc-xdp plane out`) takes a plane out like MRC_PF_DOWN; the two bits
    are separate: the daemon clearing its link flag does not put it back."""
    from mrc_xdp.datapath import maps as libmaps
    env = datapath
    _use_planes(env, N_PLANES4)
    admin, down = const("MRC_PF_ADMIN"), const("MRC_PF_DOWN")
    assert admin & const("MRC_PF_OUT") and down & const("MRC_PF_OUT") and not admin & down
    mp = env.maps["mrc_planes"]
    assert libmaps.set_plane_down(mp, 3, True, bit=admin)
    assert libmaps.set_plane_down(mp, 3, True) and libmaps.set_plane_down(mp, 3, False)
    planes, _ = _spray_planes(env, 600)
    assert dict(planes) == {0: 200, 1: 200, 2: 200}, planes
    assert libmaps.set_plane_down(mp, 3, False, bit=admin)
    planes, _ = _spray_planes(env, 600)
    assert dict(planes) == {p: 150 for p in range(4)}, planes
    env.use("ecmp")


def test_spray_plane_out_of_rotation_fallback_and_all_down(datapath):
    """3 planes, every EV of plane 0 denied: its turns go to the next plane and the round
    robin goes on after that one, so planes 1 and 2 share equally.  Plane 1 down as well:
    plane 0's turns fall through to the next plane that is up (2), never to 1.  Every
    plane down: dropped, no_ev."""
    from mrc_xdp.datapath import maps as libmaps
    env = datapath
    _use_planes(env, 3)
    for s in env.ev_sets(CONN_A)[0][0]:
        env.set_state(CONN_A, s.ev, EvState.DENIED)
    planes, _ = _spray_planes(env, 60)
    assert dict(planes) == {1: 30, 2: 30}, planes
    libmaps.set_plane_down(env.maps["mrc_planes"], 1, True)
    planes, _ = _spray_planes(env, 60)
    assert dict(planes) == {2: 60}, planes
    for p in (0, 2):
        libmaps.set_plane_down(env.maps["mrc_planes"], p, True)
    ret, out, d = env.run_counted("spray", data(1))
    assert ret == XDP_DROP
    assert d == {"spray_rx": 1, "spray_no_ev": 1}
    env.use("ecmp")


def _sprayed_plane(env, frame) -> int:
    ret, out = env.run("spray", frame)
    assert ret == XDP_REDIRECT, xdp_name(ret)
    return env.plane_of_macs(out)


def _rx_plane(env, cid: int) -> int:
    from mrc_xdp.datapath import shared
    return shared.from_bytes("struct mrc_conn", env.maps["mrc_conns"].lookup(cid)).rx_plane


def _repeated(frame: bytes) -> bytes:
    """The frame with BTH RTX set (the engine's second copy of a SACK), ICRC redone."""
    f = bytearray(frame)
    f[14 + 40 + 8 + 8] |= const("MRC_BTH_B8_RTX")
    return bytes(f[:14]) + wire.add_icrc(bytes(f[14:-4]))


def test_feedback_goes_back_on_the_plane_the_peers_data_came_in_on(datapath):
    """Ingress remembers the plane the peer's newest data arrived on (mrc_conn.rx_plane);
    spray sends our SACKs, NACKs and ACKs to that peer on it (a plane that died at either
    end carries no data to us once the peer has retired it, so our feedback avoids it
    too), a repeated SACK (RTX) on the next plane, and our own data keeps its round robin.
    A plane out of rotation is never used for feedback."""
    from mrc_xdp.datapath import maps as libmaps
    env = datapath.use("ecmp")
    sack = frame_of("sack", LOCAL, PEER_A, QPN_A_REMOTE, psn=5)
    ctrl = [sack, frame_of("nack", LOCAL, PEER_A, QPN_A_REMOTE, psn=5),
            frame_of("ack", LOCAL, PEER_A, QPN_A_REMOTE, psn=5)]
    # nothing received yet: feedback takes turns like everything else
    assert {_sprayed_plane(env, sack) for _ in range(4)} == {0, 1}
    assert _rx_plane(env, CONN_A) == 0
    for plane in (1, 0, 1):
        inbound = frame_of("data", PEER_A, LOCAL, QPN_A_LOCAL, psn=3)
        ret, _ = env.run("ingress", inbound, ifindex=env.ifindex["p%d" % plane])
        assert ret == XDP_REDIRECT, xdp_name(ret)
        assert _rx_plane(env, CONN_A) == plane + 1
        assert [_sprayed_plane(env, f) for f in ctrl * 3] == [plane] * 9
        assert _sprayed_plane(env, _repeated(sack)) == 1 - plane
        planes, _ = _spray_planes(env, 8)                 # data: the round robin, untouched
        assert dict(planes) == {0: 4, 1: 4}, planes
    # the plane feedback would take is out of rotation: the other one
    assert libmaps.set_plane_down(env.maps["mrc_planes"], 1, True)
    try:
        assert [_sprayed_plane(env, f) for f in ctrl] == [0] * 3
    finally:
        libmaps.set_plane_down(env.maps["mrc_planes"], 1, False)
    # data of another connection's peer says nothing about connection A's
    inbound_b = frame_of("data", PEER_B, LOCAL, QPN_B_LOCAL, psn=3)
    env.run("ingress", inbound_b, ifindex=env.ifindex["p0"])
    assert _rx_plane(env, CONN_A) == 2
