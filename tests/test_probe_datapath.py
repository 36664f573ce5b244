"""Tier 1: EV probes answered in the datapath (bpf/probe.h), through BPF_PROG_TEST_RUN.

spray sends a PROBE_REQ on the EV it names (no rotation; ASSUMED_BAD and backup EVs too,
never DENIED); ingress turns a probe from a configured peer into its answer (a SACK with
PR set, expected bytes built by helpers.probe_answer from wire's builders) and sends it
back out the plane it came in on (XDP_TX), SRv6-encapsulated in srv6 mode; answers are
rate-limited; an answer for a probe in flight (mrc_probes) is recorded and dropped.
Operator changes through mrc_evop are at the end.
"""
from __future__ import annotations

import time

import pytest

from helpers import (ACTIVE_MAX, CONN_A, CONN_B, DSCP_CTRL, HOP_LIMIT, LOCAL, PEER_A, PEER_B,
                     QPN_A_LOCAL, QPN_A_REMOTE, QPN_B_LOCAL, QPN_B_REMOTE, SRV6_SRC, STRANGER,
                     LOCAL_SID, TEMPLATES, XDP_DROP, XDP_REDIRECT, XDP_TX, addr, probe_answer,
                     odd_length, spray_rewrite, srv6_da, srv6_push, xdp_name)
from mrc_xdp.datapath import maps as libmaps
from mrc_xdp.datapath import shared, wire
from mrc_xdp.datapath.shared import EvReason, EvState, const, ffi

QPN_PROBE = const("MRC_QPN_PROBE")


def _probe(src, dst, dqpn, ev, psn=0x123456, probe_id=0x8765, vendor_info=0, **kw):
    return wire.probe_frame(src, dst, dqpn, psn, probe_id=probe_id, tx_ts=0xBEEF, ev=ev,
                            peth={"spdcid": 0x1111, "dpdcid": 0x2222, "vendor_info": vendor_info},
                            **kw)


def _backup_evs(env, cid):
    return [s.ev for plane in env.ev_sets(cid)[1] for s in plane]


# ------------------------------------------------------------------ spray

@pytest.mark.parametrize("which", ["active-good", "active-assumed-bad", "active-skip", "backup"])
def test_spray_sends_probe_on_its_ev(ecmp, which):
    env = ecmp
    ev = _backup_evs(env, CONN_A)[5] if which == "backup" else env.active_evs(CONN_A)[11]
    if which == "active-assumed-bad":
        env.set_state(CONN_A, ev, EvState.ASSUMED_BAD)
    if which == "active-skip":
        env.set_state(CONN_A, ev, EvState.SKIP)
    env.events()
    rot = env.rot(CONN_A)
    f = _probe(LOCAL, PEER_A, QPN_A_REMOTE, ev)
    ret, out, d = env.run_counted("spray", f)
    assert ret == XDP_REDIRECT, xdp_name(ret)
    e = env.ev(CONN_A, ev)
    assert out.hex() == spray_rewrite(f, ev, *env.plane_macs(e.plane), DSCP_CTRL).hex()
    assert d == {"spray_rx": 1, "spray_probe": 1, "spray_ctrl": 1, "spray_tx": 1,
                 "spray_bytes": len(f)}
    assert env.rot(CONN_A) == rot, "a probe does not move the rotation"
    assert env.evctr(CONN_A, ev)["tx_pkts"] == 1
    want = {"active-good": EvState.GOOD, "active-assumed-bad": EvState.ASSUMED_BAD,
            "active-skip": EvState.SKIP, "backup": EvState.GOOD}[which]
    assert env.state(CONN_A, ev) == want, "probing changes no state"
    assert env.events() == []


def test_spray_never_probes_denied_or_foreign_evs(ecmp):
    env = ecmp
    ev = env.active_evs(CONN_A)[3]
    env.set_state(CONN_A, ev, EvState.DENIED)
    ret, out, d = env.run_counted("spray", _probe(LOCAL, PEER_A, QPN_A_REMOTE, ev))
    assert (ret, d) == (XDP_DROP, {"spray_rx": 1, "spray_probe_denied": 1})
    other = env.active_evs(CONN_B)[0]            # connection B's EV, not A's
    ret, out, d = env.run_counted("spray", _probe(LOCAL, PEER_A, QPN_A_REMOTE, other))
    assert (ret, d) == (XDP_DROP, {"spray_rx": 1, "spray_probe_no_ev": 1})


def test_spray_connectionless_probe_uses_the_peers_connection(ecmp):
    env = ecmp
    ev = _backup_evs(env, CONN_A)[0]
    f = _probe(LOCAL, PEER_A, QPN_PROBE, ev)
    ret, out, d = env.run_counted("spray", f)
    assert ret == XDP_REDIRECT and d["spray_probe"] == 1
    assert out == spray_rewrite(f, ev, *env.plane_macs(env.ev(CONN_A, ev).plane), DSCP_CTRL)
    ret, out, d = env.run_counted("spray", _probe(LOCAL, STRANGER, QPN_PROBE, ev))
    assert (xdp_name(ret), out, d) == ("PASS", _probe(LOCAL, STRANGER, QPN_PROBE, ev),
                                       {"spray_rx": 1, "spray_no_conn": 1})


@pytest.mark.parametrize("cid", [CONN_A, CONN_B])
def test_spray_srv6_probe_takes_its_evs_path(srv6, cid):
    env = srv6
    conn = env.conn(cid)
    for ev in env.active_evs(cid)[:2] + _backup_evs(env, cid)[:2]:
        e = env.ev(cid, ev)
        f = _probe(LOCAL, conn.peer, conn.remote_qpn, ev)
        ret, out = env.run("spray", f)
        assert ret == XDP_REDIRECT
        want = spray_rewrite(f, ev, *env.plane_macs(e.plane), DSCP_CTRL)
        want = srv6_push(want, SRV6_SRC[e.plane], srv6_da(TEMPLATES[conn.template], e.plane, e.t1),
                         HOP_LIMIT)
        assert out.hex() == want.hex()


# ------------------------------------------------------------------ ingress: answering

CASES = [("conn-p0", PEER_A, QPN_A_LOCAL, QPN_A_REMOTE, 0), ("conn-p1", PEER_A, QPN_A_LOCAL, QPN_A_REMOTE, 1),
         ("qpn2", PEER_A, QPN_PROBE, QPN_PROBE, 0), ("conn-b", PEER_B, QPN_B_LOCAL, QPN_B_REMOTE, 1)]


@pytest.mark.parametrize("src,dqpn,ans_qpn,plane", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_ingress_answers_probe_in_place(ecmp, src, dqpn, ans_qpn, plane):
    env = ecmp
    ev = 0x4D5A0102                       # any EV: the answer echoes it
    f = _probe(src, LOCAL, dqpn, ev)
    ret, out, d = env.run_counted("ingress", f, ifindex=env.ifindex["p%d" % plane])
    assert ret == XDP_TX, xdp_name(ret)
    want = probe_answer(f, ans_qpn, *env.plane_macs(plane))
    assert out.hex() == want.hex()
    assert d == {"ing_rx": 1, "ing_probe": 1, "ing_probe_answered": 1}
    seth = wire.parse(out)[wire.SETH]
    assert (seth.pr, seth.entropy, seth.cack_psn) == (1, ev, 0x123456)
    assert env.events() == [] and env.rxev() == {}


@pytest.mark.parametrize("plane", [0, 1])
@pytest.mark.parametrize("own_ev", [True, False], ids=["ev-in-set", "ev-foreign"])
def test_ingress_srv6_answer_is_encapsulated(srv6, plane, own_ev):
    """The answer goes back on the plane it came in on, through the connection's row
    template; T1: the probed EV's when this side has it on that plane, else that of the
    active EV (plane, EV mod n)."""
    env = srv6
    conn = env.conn(CONN_A)
    if own_ev:
        ev = next(s.ev for s in env.ev_sets(CONN_A)[0][plane] if s.t1 == 1)
        t1 = 1
    else:
        ev = 0x00770005
        t1 = env.ev_at(CONN_A, plane * conn.ev_per_plane + ev % conn.ev_per_plane).t1
    plain = _probe(PEER_A, LOCAL, QPN_A_LOCAL, ev)
    f = srv6_push(plain, "fcbb:bb00:300::1", LOCAL_SID[plane], 9)
    ret, out, d = env.run_counted("ingress", f, ifindex=env.ifindex["p%d" % plane])
    assert ret == XDP_TX, xdp_name(ret)
    want = srv6_push(probe_answer(plain, QPN_A_REMOTE, *env.plane_macs(plane)), SRV6_SRC[plane],
                     srv6_da(TEMPLATES["to_a"], plane, t1), HOP_LIMIT)
    assert out.hex() == want.hex()
    assert d == {"ing_rx": 1, "ing_decap": 1, "ing_probe": 1, "ing_probe_answered": 1}


def _with_back_ev(answer: bytes, back: int) -> bytes:
    """The answer with the way back's entropy: UDP sport = back[31:16] (ICRC-covered),
    flow label = back[15:0]; the SETH still echoes the probed EV."""
    f = bytearray(answer)
    f[54:56] = (back >> 16).to_bytes(2, "big")
    f[16:18] = (back & 0xFFFF).to_bytes(2, "big")
    f[-4:] = wire.pack_icrc(wire.icrc(bytes(f[14:-4])))
    return bytes(f)


@pytest.mark.parametrize("plane", [0, 1])
def test_ingress_srv6_answer_comes_back_through_the_named_t1(srv6, plane):
    """PETH vendor_info = 1 + T1 (MRC_PETH_VI_OFF; our prober sets it): the answer's path
    goes through that T1, whatever this side's EVs say, so a live path's probe is not
    lost on a dead T1 of the way back."""
    env = srv6
    conn = env.conn(CONN_A)
    vi = const("MRC_PETH_VI_OFF")
    assert vi == 3
    for t1 in range(conn.t1s):
        ev = next(s.ev for s in env.ev_sets(CONN_A)[0][plane] if s.t1 != t1)   # says: the other T1
        plain = _probe(PEER_A, LOCAL, QPN_A_LOCAL, ev, vendor_info=t1 + 1)
        f = srv6_push(plain, "fcbb:bb00:300::1", LOCAL_SID[plane], 9)
        ret, out = env.run("ingress", f, ifindex=env.ifindex["p%d" % plane])
        assert ret == XDP_TX, xdp_name(ret)
        want = srv6_push(probe_answer(plain, QPN_A_REMOTE, *env.plane_macs(plane)), SRV6_SRC[plane],
                         srv6_da(TEMPLATES["to_a"], plane, t1), HOP_LIMIT)
        assert out.hex() == want.hex()


@pytest.mark.parametrize("plane", [0, 1])
def test_ingress_ecmp_answer_comes_back_through_the_named_t1(ecmp, plane):
    """ECMP: the answer to a probe naming T1 t1 takes the entropy of a GOOD active EV of
    this side's connection on the arrival plane that goes through t1 (the fabric hashes
    it there); none (an unknown T1) -> the probed EV, as without a hint."""
    env = ecmp
    conn = env.conn(CONN_A)
    probed = 0x4D5A0102
    for t1 in range(conn.t1s):
        slots = [plane * conn.ev_per_plane + j for j in range(conn.ev_per_plane)]
        back = next(env.ev_at(CONN_A, s).ev for s in slots if env.ev_at(CONN_A, s).t1 == t1)
        f = _probe(PEER_A, LOCAL, QPN_A_LOCAL, probed, vendor_info=t1 + 1)
        ret, out, d = env.run_counted("ingress", f, ifindex=env.ifindex["p%d" % plane])
        assert ret == XDP_TX, xdp_name(ret)
        assert d == {"ing_rx": 1, "ing_probe": 1, "ing_probe_answered": 1}
        assert back != probed and wire.ev_of_frame(out) == back
        assert wire.parse(out)[wire.SETH].entropy == probed
        assert out.hex() == _with_back_ev(probe_answer(f, QPN_A_REMOTE, *env.plane_macs(plane)), back).hex()
        assert wire.frame_icrc_ok(out)
    # a T1 this side has no EV through: the probed EV comes back
    f = _probe(PEER_A, LOCAL, QPN_A_LOCAL, probed, vendor_info=9)
    ret, out = env.run("ingress", f, ifindex=env.ifindex["p%d" % plane])
    assert ret == XDP_TX and out.hex() == probe_answer(f, QPN_A_REMOTE, *env.plane_macs(plane)).hex()


def test_prober_names_the_t1_in_vendor_info():
    """mrc_xdp.health.probe's frames carry 1 + T1 in PETH vendor_info (0 when unknown), else the
    same bytes as wire's builder."""
    from mrc_xdp.health import probe
    for t1, vi in ((None, 0), (0, 1), (1, 2)):
        f = probe.probe_frame(LOCAL, PEER_A, QPN_A_REMOTE, 0x12345678, 77, 0x4242, tx_ts=5, t1=t1)
        w = wire.probe_frame(LOCAL, PEER_A, QPN_A_REMOTE, 77, probe_id=0x4242, tx_ts=5, ev=0x12345678,
                             peth={"vendor_info": vi})
        assert f == w
        assert wire.parse(f)[wire.PETH].vendor_info == vi


def test_ingress_answer_rate_limited(ecmp):
    env = ecmp
    env.set_cfg(probe_rate=1, probe_burst=2)
    f = _probe(PEER_A, LOCAL, QPN_A_LOCAL, 0x00010001)
    verdicts = [env.run_counted("ingress", f) for _ in range(3)]
    assert [xdp_name(r[0]) for r in verdicts] == ["TX", "TX", "DROP"]
    assert verdicts[2][2] == {"ing_rx": 1, "ing_probe": 1, "ing_probe_rate": 1}
    env.set_cfg(probe_rate=0)
    ret, out, d = env.run_counted("ingress", f)
    assert (ret, d) == (XDP_DROP, {"ing_rx": 1, "ing_probe": 1, "ing_probe_rate": 1})


NOT_PEER = [("stranger", STRANGER, QPN_A_LOCAL), ("stranger-qpn2", STRANGER, QPN_PROBE),
            ("peer-wrong-qpn", PEER_A, 0x999), ("peer-b-with-a-qpn", PEER_B, QPN_A_LOCAL)]


@pytest.mark.parametrize("src,dqpn", [c[1:] for c in NOT_PEER], ids=[c[0] for c in NOT_PEER])
def test_ingress_ignores_probes_of_non_peers(ecmp, src, dqpn):
    env = ecmp
    before = env.ev_table_bytes()
    ret, out, d = env.run_counted("ingress", _probe(src, LOCAL, dqpn, 0x00010001))
    assert (ret, d) == (XDP_DROP, {"ing_rx": 1, "ing_probe": 1, "ing_probe_not_peer": 1})
    assert env.ev_table_bytes() == before


def test_ingress_does_not_answer_probes_with_payload(ecmp):
    env = ecmp
    f = odd_length(wire.probe_frame(PEER_A, LOCAL, QPN_A_LOCAL, 1, probe_id=1), b"\0" * 4,
                   udp_csum=False)
    ret, out, d = env.run_counted("ingress", f)
    assert (ret, d) == (XDP_DROP, {"ing_rx": 1, "ing_probe": 1, "ing_probe_bad": 1})


# ------------------------------------------------------------------ ingress: answers to our probes

def _put_probe(env, pid, peer, ev, psn):
    pr = ffi.new("struct mrc_probe *")
    ffi.memmove(pr.peer, addr(peer), 16)
    pr.ev, pr.psn, pr.sent_ns = ev, psn, time.monotonic_ns()
    env.maps["mrc_probes"].update(pid, shared.to_bytes(pr))


def _get_probe(env, pid):
    return shared.from_bytes("struct mrc_probe", env.maps["mrc_probes"].lookup(pid))


def _answer(peer, ev, psn, pid, plane_macs):
    return probe_answer(_probe(LOCAL, peer, QPN_A_REMOTE, ev, psn=psn, probe_id=pid), QPN_A_LOCAL,
                        *plane_macs)


def test_ingress_records_answer_to_our_probe(ecmp):
    env = ecmp
    ev, psn, pid = 0x12345678, 0xABCDE, 0x9001
    _put_probe(env, pid, PEER_A, ev, psn)
    t0 = time.monotonic_ns()
    ans = _answer(PEER_A, ev, psn, pid, env.plane_macs(0)[::-1])
    ret, out, d = env.run_counted("ingress", ans, ifindex=env.ifindex["p1"])
    assert (ret, d) == (XDP_DROP, {"ing_rx": 1, "ing_probe_ans": 1})
    pr = _get_probe(env, pid)
    assert t0 <= pr.rx_ns <= time.monotonic_ns() and pr.plane == 1
    # a second copy of the answer is not counted twice
    ret, out, d = env.run_counted("ingress", ans)
    assert (ret, d) == (XDP_DROP, {"ing_rx": 1, "ing_probe_ans_unknown": 1})


SPOOFS = [("other-source", dict(peer=PEER_B)), ("other-ev", dict(ev=0x12345679)),
          ("other-psn", dict(psn=0xABCDF)), ("other-id", dict(pid=0x9002)),
          ("stranger", dict(peer=STRANGER))]


@pytest.mark.parametrize("change", [c[1] for c in SPOOFS], ids=[c[0] for c in SPOOFS])
def test_ingress_spoofed_answers_change_nothing(ecmp, change):
    env = ecmp
    ev, psn, pid = 0x12345678, 0xABCDE, 0x9001
    _put_probe(env, pid, PEER_A, ev, psn)
    before = env.ev_table_bytes()
    kw = dict(peer=PEER_A, ev=ev, psn=psn, pid=pid)
    kw.update(change)
    ans = _answer(kw["peer"], kw["ev"], kw["psn"], kw["pid"], env.plane_macs(0)[::-1])
    ret, out, d = env.run_counted("ingress", ans)
    assert (ret, d) == (XDP_DROP, {"ing_rx": 1, "ing_probe_ans_unknown": 1})
    assert _get_probe(env, pid).rx_ns == 0
    assert env.ev_table_bytes() == before and env.events() == []


# ------------------------------------------------------------------ operator changes (mrc_evop)

def test_evop_emits_event_and_respects_the_swap_lock(ecmp):
    env = ecmp
    ev = env.active_evs(CONN_A)[4]
    slot = env.slot_of(CONN_A, ev)
    env.events()
    res = libmaps.set_ev_state(env.maps["mrc_evs"], env.maps["mrc_evidx"], CONN_A, ev,
                               EvState.DENIED, evop_fd=env.dp.fd("evop"))
    assert res == {"conn": CONN_A, "slot": slot, "ev": ev, "old": "GOOD", "new": "DENIED"}
    evs = env.events()
    assert [(e.conn, e.ev, e.slot, e.old_state, e.new_state, e.reason) for e in evs] == \
        [(CONN_A, ev, slot, EvState.GOOD, EvState.DENIED, EvReason.OPERATOR)]
    # the swap lock held (as by a swap in progress): the change waits, then gives up
    c = shared.from_bytes("struct mrc_conn", env.maps["mrc_conns"].lookup(CONN_A))
    c.lock = 1
    env.maps["mrc_conns"].update(CONN_A, shared.to_bytes(c))
    before = env.counters()
    with pytest.raises(libmaps.EvopError):
        libmaps.evop(env.dp.fd("evop"), CONN_A, ev, EvState.GOOD, EvReason.OPERATOR)
    assert env.counters()["evop_busy"] - before["evop_busy"] == libmaps.EVOP_RETRIES
    assert env.state(CONN_A, ev) == EvState.DENIED and env.events() == []
    c.lock = 0
    env.maps["mrc_conns"].update(CONN_A, shared.to_bytes(c))
    env.set_state(CONN_A, ev, EvState.GOOD)
    assert env.state(CONN_A, ev) == EvState.GOOD
    with pytest.raises(KeyError):
        env.set_state(CONN_A, 0xDEADBEEF, EvState.GOOD)
    assert ACTIVE_MAX > slot
