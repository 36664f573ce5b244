"""Tier 1: the ingress program (fabric -> engine) and to_engine, through BPF_PROG_TEST_RUN.

Frames arrive on p0 (xdp_md.ingress_ifindex of the session netns) unless a case says
otherwise.  Frames for us leave with the engine's MACs (dst mrc0, src mrc0p) and
XDP_REDIRECT to the engine port; everything else is passed byte-for-byte unchanged.
Non-MRC frames through all three programs are in test_datapath_nonmrc.py; EV state
changes driven by feedback in test_datapath_evstate.py.
"""
from __future__ import annotations

import pytest

from helpers import (CONN_A, CONN_B, LOCAL, LOCAL_SID, MAX_CONNS, PEER_A, PEER_B,
                     QPN_A_LOCAL, QPN_A_REMOTE, QPN_B_LOCAL, SRV6_BLOCK, STRANGER,
                     XDP_DROP, XDP_PASS, XDP_REDIRECT, decap, frame_of, srv6_push, with_macs,
                     xdp_name)
from mrc_xdp.datapath import wire
from mrc_xdp.datapath.shared import EvState, NackReason, Opcode, SackM

KIND_CTR = {"data": "ing_data", "sack": "ing_sack", "nack": "ing_nack", "ack": "ing_ack",
            "probe": "ing_probe", "ep_req": "ing_other", "ep_resp": "ing_other"}

# (id, kind, keywords): one per opcode, data with every extension-header combination
INGRESS_CASES = (
    [("%s%s" % (op.name, "-ts" if ts is not None else ""), "data",
      dict(opcode=op, ts=ts, ev=0x1234ABCD, tc=2))
     for op in (Opcode.WRITE_FIRST, Opcode.WRITE_MIDDLE, Opcode.WRITE_LAST,
                Opcode.WRITE_LAST_IMM, Opcode.WRITE_ONLY, Opcode.WRITE_ONLY_IMM)
     for ts in (None, 99)] +
    [(k, k, dict(ev=0x00050006)) for k in ("sack", "nack", "ack", "ep_req", "ep_resp")] +
    [("data-csum", "data", dict(udp_csum=True, ev=0x77770001))]
)


def _for_us(kind, kw, src=PEER_A, dqpn=QPN_A_LOCAL):
    return frame_of(kind, src, LOCAL, dqpn, **dict(kw))


@pytest.mark.parametrize("kind,kw", [c[1:] for c in INGRESS_CASES],
                         ids=[c[0] for c in INGRESS_CASES])
def test_ingress_for_us_goes_to_engine(ecmp, kind, kw):
    env = ecmp
    f = _for_us(kind, kw)
    before_evs = env.ev_table_bytes()
    ret, out, d = env.run_counted("ingress", f)
    if kind in ("sack", "nack"):
        # connection A has sent nothing: PSN 7 is outside its sent window, so the
        # feedback is counted and dropped (the engine never sees it)
        assert ret == XDP_DROP, xdp_name(ret)
        assert d == {"ing_rx": 1, KIND_CTR[kind]: 1, "ing_fb_oow": 1}
        assert env.ev_table_bytes() == before_evs and env.rxev() == {}
        return
    assert ret == XDP_REDIRECT, xdp_name(ret)
    assert out.hex() == with_macs(f, *env.engine_macs()).hex()
    want = {"ing_rx": 1, KIND_CTR[kind]: 1, "ing_to_engine": 1}
    assert d == want
    assert env.ev_table_bytes() == before_evs
    rx = env.rxev()
    if kind == "data":
        assert rx == {(CONN_A, kw["ev"]): {"pkts": 1, "bytes": len(f), "ce": 0}}
    else:
        assert rx == {}


@pytest.mark.parametrize("ecn", [0, 1, 2, 3], ids=["not-ect", "ect1", "ect0", "ce"])
def test_ingress_data_counted_per_ev_with_ce(ecmp, ecn):
    env = ecmp
    evs = [0x0A0B0C0D, 0x0A0B0C0E]
    frames = [_for_us("data", dict(ev=ev, tc=(26 << 2) | ecn, psn=i))
              for i, ev in enumerate(evs * 3)]
    tot = {}
    for f in frames:
        ret, out, d = env.run_counted("ingress", f)
        assert ret == XDP_REDIRECT
        for k, v in d.items():
            tot[k] = tot.get(k, 0) + v
    want = {"ing_rx": 6, "ing_data": 6, "ing_to_engine": 6}
    if ecn == 3:
        want["ing_data_ce"] = 6
    assert tot == want
    assert env.rxev() == {(CONN_A, ev): {"pkts": 3, "bytes": 3 * len(frames[0]),
                                         "ce": 3 if ecn == 3 else 0} for ev in evs}


def test_ingress_data_of_unknown_connection_counted_apart(ecmp):
    env = ecmp
    f1 = _for_us("data", dict(ev=0x11112222), src=STRANGER)
    f2 = _for_us("data", dict(ev=0x11112222), dqpn=QPN_A_REMOTE)   # TX-direction QPN
    f3 = _for_us("data", dict(ev=0x33334444), src=PEER_B, dqpn=QPN_B_LOCAL)
    for f in (f1, f2, f3):
        ret, out = env.run("ingress", f)
        assert ret == XDP_REDIRECT and out == with_macs(f, *env.engine_macs())
    rx = env.rxev()
    assert rx[(MAX_CONNS, 0x11112222)]["pkts"] == 2
    assert rx[(CONN_B, 0x33334444)]["pkts"] == 1
    assert len(rx) == 2


@pytest.mark.parametrize("kind", ["data", "sack", "nack", "ack", "probe"])
@pytest.mark.parametrize("dst", ["fd00:100::5", "fd00:200::1", "::1"])
def test_ingress_not_for_us_passes_unchanged(ecmp, kind, dst):
    f = frame_of(kind, PEER_A, dst, QPN_A_LOCAL, udp_csum=True)
    before = ecmp.ev_table_bytes()
    ret, out, d = ecmp.run_counted("ingress", f)
    assert (xdp_name(ret), out) == ("PASS", f)
    assert d == {"ing_rx": 1, "ing_not_ours": 1}
    assert ecmp.ev_table_bytes() == before and ecmp.rxev() == {}


def test_ingress_on_plane1_and_unknown_device(ecmp):
    """The plane NIC a frame arrives on does not matter for plain (ECMP) frames."""
    f = _for_us("data", dict(ev=0x01020304))
    for dev in ("p1", "mrc0", "q0"):
        ret, out = ecmp.run("ingress", f, ifindex=ecmp.ifindex[dev])
        assert ret == XDP_REDIRECT and out == with_macs(f, *ecmp.engine_macs())


def test_ingress_ecmp_mode_does_not_decap(ecmp):
    inner = _for_us("data", dict(ev=0x01020304))
    f = srv6_push(inner, "fcbb:bb00:200::1", LOCAL_SID[0], 60)
    ret, out, d = ecmp.run_counted("ingress", f)
    assert (xdp_name(ret), out) == ("PASS", f)
    assert d == {"ing_rx": 1, "ing_non_mrc": 1}


# ------------------------------------------------------------------ SRv6 decapsulation

OUTER_SRC = "fcbb:bb00:200::1"
CE_CASES = [  # outer ECN, inner ECN -> inner ECN after, CE copied
    (0, 0, 0, False), (0, 2, 2, False), (2, 2, 2, False), (1, 1, 1, False),
    (3, 2, 3, True), (3, 1, 3, True), (3, 0, 0, False), (3, 3, 3, False), (2, 3, 3, False),
]


def _encap(inner, plane=0, da=None, outer_ecn=None, hlim=60):
    f = bytearray(srv6_push(inner, OUTER_SRC, da or LOCAL_SID[plane], hlim))
    if outer_ecn is not None:
        f[15] = (f[15] & 0xCF) | (outer_ecn << 4)
    return bytes(f)


@pytest.mark.parametrize("outer,inner,after,copied", CE_CASES,
                         ids=["o%d-i%d" % c[:2] for c in CE_CASES])
def test_ingress_srv6_decap_copies_ce(srv6, outer, inner, after, copied):
    env = srv6
    plain = _for_us("data", dict(ev=0x0BADCAFE, tc=(4 << 2) | inner, udp_csum=True))
    f = _encap(plain, outer_ecn=outer)
    ret, out, d = env.run_counted("ingress", f)
    assert ret == XDP_REDIRECT, xdp_name(ret)
    expected = with_macs(decap(f), *env.engine_macs())
    assert out.hex() == expected.hex()
    assert (out[15] >> 4) & 3 == after
    assert out == with_macs(_with_ecn(plain, after), *env.engine_macs())
    assert wire.frame_icrc_ok(out) and wire.udp6_checksum_ok(out[14:], allow_zero=False)
    want = {"ing_rx": 1, "ing_decap": 1, "ing_data": 1, "ing_to_engine": 1}
    if copied:
        want["ing_ce_copy"] = 1
    if after == 3:
        want["ing_data_ce"] = 1
    assert d == want
    assert env.rxev()[(CONN_A, 0x0BADCAFE)]["ce"] == (1 if after == 3 else 0)


def _with_ecn(frame, ecn):
    f = bytearray(frame)
    f[15] = (f[15] & 0xCF) | (ecn << 4)
    return bytes(f)


@pytest.mark.parametrize("kind", ["data", "sack", "nack", "ack", "ep_req", "ep_resp"])
@pytest.mark.parametrize("plane", [0, 1])
def test_ingress_srv6_decap_every_opcode(srv6, kind, plane):
    env = srv6
    # feedback from a peer without a connection: not window-checked, passed on (from
    # connection A, which has sent nothing, it would be dropped as out of window)
    plain = _for_us(kind, dict(ev=0x00AA00BB), src=STRANGER if kind in ("sack", "nack") else PEER_A)
    # the SID is compared on its first 48 bits: later uSIDs / bits do not matter
    da = LOCAL_SID[plane].rstrip(":") + ":4242::"
    f = _encap(plain, plane, da=da)
    ret, out, d = env.run_counted("ingress", f, ifindex=env.ifindex["p%d" % plane])
    assert ret == XDP_REDIRECT, xdp_name(ret)
    assert out.hex() == with_macs(plain, *env.engine_macs()).hex()
    assert d["ing_decap"] == 1 and d[KIND_CTR[kind]] == 1 and d["ing_to_engine"] == 1


NOT_OUR_SID = [
    ("other-host", 0, SRV6_BLOCK.rstrip(":") + ":101::"),
    ("other-block", 0, "fcbb:bb01:100::"),
    ("plane1-sid-on-p0", 0, LOCAL_SID[1]),
    ("plane0-sid-on-p1", 1, LOCAL_SID[0]),
]


@pytest.mark.parametrize("plane,da", [c[1:] for c in NOT_OUR_SID], ids=[c[0] for c in NOT_OUR_SID])
def test_ingress_srv6_not_our_sid_passes_unchanged(srv6, plane, da):
    f = _encap(_for_us("data", dict(ev=0x01010101)), da=da)
    ret, out, d = srv6.run_counted("ingress", f, ifindex=srv6.ifindex["p%d" % plane])
    assert (xdp_name(ret), out) == ("PASS", f)
    assert d == {"ing_rx": 1, "ing_not_ours": 1}


def test_ingress_srv6_on_a_non_plane_device_passes_unchanged(srv6):
    f = _encap(_for_us("data", dict(ev=0x01010101)))
    ret, out, d = srv6.run_counted("ingress", f, ifindex=srv6.ifindex["mrc0"])
    assert (xdp_name(ret), out) == ("PASS", f)
    assert d == {"ing_rx": 1, "ing_not_ours": 1}


def test_ingress_srv6_mode_still_takes_plain_frames(srv6):
    f = _for_us("sack", dict(ev=0x01010101), src=STRANGER)
    ret, out, d = srv6.run_counted("ingress", f)
    assert ret == XDP_REDIRECT and out == with_macs(f, *srv6.engine_macs())
    assert "ing_decap" not in d


def test_ingress_srv6_feedback_applied_after_decap(srv6):
    """The EV state machine reads the SETH at its post-decap offset."""
    env = srv6
    ev = env.active_evs(CONN_A)[2]
    env.spray_evs(1)                      # the feedback acks PSN 0: sent
    f = _encap(env.feedback("sack", ev, m=SackM.ALWAYS_SKIP))
    ret, out, d = env.run_counted("ingress", f)
    assert ret == XDP_REDIRECT
    assert env.state(CONN_A, ev) == EvState.ASSUMED_BAD
    assert d["ing_decap"] == 1 and d["ing_fb_bad"] == 1 and d["ing_fb_replaced"] == 1
    ev2 = env.active_evs(CONN_A)[9]
    f = _encap(env.feedback("nack", ev2, reason=NackReason.TRIMMED))
    ret, out = env.run("ingress", f, ifindex=env.ifindex["p0"])
    assert ret == XDP_REDIRECT and env.state(CONN_A, ev2) == EvState.SKIP


def test_ingress_srv6_ours_but_inner_not_for_us(srv6):
    """Our SID, inner destination another address: passed to the kernel unchanged (the
    inner destination is checked before decapsulation) -- not handed to the engine."""
    inner = frame_of("data", PEER_A, "fd00:100::77", QPN_A_LOCAL)
    f = _encap(inner)
    ret, out, d = srv6.run_counted("ingress", f)
    assert ret == XDP_PASS
    assert out == f
    assert d == {"ing_rx": 1, "ing_not_ours": 1}


# ------------------------------------------------------------------ to_engine (mrc0)

@pytest.mark.parametrize("kind", ["data", "sack", "nack", "ack", "probe", "ep_req", "ep_resp"])
def test_to_engine_passes_mrc_to_the_stack_without_xsk(ecmp, kind):
    f = with_macs(_for_us(kind, dict(ev=0x01010101)), *ecmp.engine_macs())
    ret, out, d = ecmp.run_counted("engine", f)
    assert (xdp_name(ret), out) == ("PASS", f)
    assert d == {"eng_rx": 1, "eng_pass": 1}


def test_to_engine_ignores_other_traffic(ecmp):
    from helpers import NON_MRC_FRAMES
    for name, f, _ in NON_MRC_FRAMES:
        ret, out, d = ecmp.run_counted("engine", f)
        assert (xdp_name(ret), out, d) == ("PASS", f, {}), name
