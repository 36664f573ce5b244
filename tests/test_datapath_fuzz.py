"""Robustness: thousands of random and mutated frames through spray, ingress and
to_engine, in both modes, against an oracle written from the wire format.

Oracle (``classify``): a frame is MRC when it is Ethernet | IPv6 [| IPv6, SRv6 ingress
only] | UDP with destination port 4791 at the expected place; otherwise it is not MRC.
An MRC frame is malformed, with exactly one reason, when its lengths disagree with the
frame or with each other, its opcode is not an MRC opcode, or its extension headers do
not fit.  Assertions, per frame and program:

  * never XDP_ABORTED;
  * not MRC: XDP_PASS, output byte-for-byte equal, only the non-MRC counters move;
  * malformed: XDP_DROP and exactly one counter moves besides *_rx: the named bad_*
    reason (so the sum of bad_* deltas equals the number of malformed frames);
  * well-formed: never dropped as malformed; the output is what the program must write
    (spray: EV rewrite, DSCP, ECT, MACs, ICRC update, SRv6 push; ingress: decap, MACs).

The corpus is drawn from a fixed seed (printed; set MRC_FUZZ_SEED to replay another).
"""
from __future__ import annotations

import os
import random

import pytest

from helpers import (CONN_A, CONN_B, DSCP_CTRL, DSCP_DATA, DSCP_RTX, ETH, HOP_LIMIT, IP6,
                     LOCAL, LOCAL_SID, PEER_A, PEER_B, QPN_A_LOCAL, QPN_A_REMOTE,
                     QPN_B_LOCAL, QPN_B_REMOTE, SRV6_SRC, TEMPLATES, UDPH, XDP_ABORTED,
                     XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX, addr, decap, delta, frame_of,
                     probe_answer,
                     spray_rewrite, srv6_da, srv6_push, with_macs, xdp_name)
from mrc_xdp.datapath import wire
from mrc_xdp.datapath.shared import CONSTS, NackReason, Opcode, SackM

SEED = int(os.environ.get("MRC_FUZZ_SEED", "4791"))
N_RANDOM = int(os.environ.get("MRC_FUZZ_N", "6000"))   # mutated frames per mode
RESET_EVERY = 500          # re-configure now and then: random feedback retires EVs

NOT, BAD, OK = "not", "bad", "ok"
EXT_NH = {0, 43, 44, 50, 51, 60, 135, 139, 140}     # IPv6 extension header numbers
TS_BIT = CONSTS["MRC_BTH_B8_TS"]
RTX_BIT = CONSTS["MRC_BTH_B8_RTX"]
ONLY_HDR = {Opcode.ACK: 4, Opcode.ENDPOINT_REQ: 16, Opcode.ENDPOINT_RESP: 36,
            Opcode.SACK: 28 + 8, Opcode.NACK: 20, Opcode.PROBE_REQ: 16}


def ext_len(op: int, b8: int) -> int:
    """BTH + extension headers of an opcode, from mrc-wire.md; 0 for a non-MRC opcode."""
    if Opcode.WRITE_FIRST <= op <= Opcode.WRITE_ONLY_IMM:
        return 12 + 4 + (4 if b8 & TS_BIT else 0) + 16 + \
            (4 if op in (Opcode.WRITE_LAST_IMM, Opcode.WRITE_ONLY_IMM) else 0)
    return 12 + ONLY_HDR[op] if op in ONLY_HDR else 0


def u16(f, off):
    return int.from_bytes(f[off:off + 2], "big")


def is_mrc_opcode(op: int) -> bool:
    return op in set(int(o) for o in Opcode)


def transit_srv6(f: bytes) -> bool:
    """An IPv6-in-IPv6 frame whose outer destination is not our SID on plane 0."""
    return len(f) >= ETH + 2 * IP6 and f[ETH + 6] == 41 and f[ETH + IP6] >> 4 == 6 and \
        f[ETH + 24:ETH + 30] != addr(LOCAL_SID[0])[:6]


def classify(f: bytes, encap: bool):
    """(NOT, subset counter | None) | (BAD, reason counter) | (OK, offset of the IPv6
    header carrying the UDP)."""
    n = len(f)
    et = u16(f, 12)
    if et in (0x8100, 0x88A8):
        return NOT, "non_mrc_vlan"
    if et == 0x0800:
        return NOT, "non_mrc_ipv4"
    if et != 0x86DD or n < ETH + IP6 or f[ETH] >> 4 != 6:
        return NOT, None
    l3 = ETH
    if encap and f[ETH + 6] == 41:
        l3 = ETH + IP6
        if n < l3 + IP6 or f[l3] >> 4 != 6:
            return NOT, None
    nh = f[l3 + 6]
    if nh != 17:
        return NOT, ("non_mrc_exthdr" if nh in EXT_NH else None)
    if n < l3 + IP6 + UDPH or u16(f, l3 + IP6 + 2) != 4791:
        return NOT, None
    if n < l3 + IP6 + UDPH + 1:                 # no opcode byte: cannot be MRC
        return NOT, None
    if not is_mrc_opcode(f[l3 + IP6 + UDPH]):   # plain RoCEv2 on 4791: not ours
        return NOT, "non_mrc_roce"
    plen, ulen = u16(f, l3 + 4), u16(f, l3 + IP6 + 4)
    if l3 + IP6 + plen > n:
        return BAD, "bad_trunc_ipv6"
    if l3 != ETH and u16(f, ETH + 4) != IP6 + plen:
        return BAD, "bad_srv6"              # outer payload is not exactly the inner packet
    if ulen != plen:
        return BAD, "bad_udp_len"
    if ulen < UDPH + 12 + 4:
        return BAD, "bad_trunc_bth"
    op, b8 = f[l3 + IP6 + UDPH], f[l3 + IP6 + UDPH + 8]
    el = ext_len(op, b8)
    if UDPH + el + 4 > ulen:
        return BAD, "bad_trunc_ext"
    return OK, l3


# ------------------------------------------------------------------ corpus

def _fix_lengths(f: bytearray, l3: int) -> None:
    """IPv6 payload length and UDP length = what the frame holds after the header."""
    plen = len(f) - l3 - IP6
    f[l3 + 4:l3 + 6] = plen.to_bytes(2, "big")
    f[l3 + IP6 + 4:l3 + IP6 + 6] = plen.to_bytes(2, "big")
    if l3 != ETH:
        f[ETH + 4:ETH + 6] = (plen + IP6).to_bytes(2, "big")


def _redo_icrc(f: bytearray, l3: int) -> None:
    ulen = u16(f, l3 + IP6 + 4)
    end = l3 + IP6 + ulen - 4
    if l3 + IP6 + UDPH + 12 <= end <= len(f) - 4:
        f[end:end + 4] = wire.pack_icrc(wire.icrc(bytes(f[l3:end])))


def base_frames(rng: random.Random, evs_a: list[int]) -> list[tuple[str, bytes]]:
    """Well-formed MRC frames of both directions, every opcode."""
    out = []
    for kind in ("data", "sack", "nack", "ack", "probe", "ep_req", "ep_resp"):
        for direction in ("tx", "rx", "rx-b", "stranger"):
            kw = {"udp_csum": rng.random() < 0.4, "tc": rng.randrange(256),
                  "ev": rng.getrandbits(32)}
            if kind == "data":
                kw.update(opcode=rng.choice(range(0xC6, 0xCC)), rtx=rng.random() < 0.3,
                          payload=bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 90))))
                if rng.random() < 0.5:
                    kw["ts"] = rng.getrandbits(16)
                if kw["opcode"] in (Opcode.WRITE_LAST_IMM, Opcode.WRITE_ONLY_IMM):
                    kw["imm"] = rng.getrandbits(32)
            if kind == "sack":
                kw.update(ev_echo=rng.choice(evs_a), m=rng.choice(list(SackM)),
                          bitmap=rng.getrandbits(64), sack_offset=rng.randrange(-8, 8))
            if kind == "nack":
                kw.update(ev_echo=rng.choice(evs_a), reason=rng.choice(list(NackReason)))
            src, dst, qpn = {
                "tx": (LOCAL, PEER_A, QPN_A_REMOTE), "rx": (PEER_A, LOCAL, QPN_A_LOCAL),
                "rx-b": (PEER_B, LOCAL, QPN_B_LOCAL), "stranger": (PEER_B, "fd00:100::42", 0x77),
            }[direction]
            if direction == "tx" and rng.random() < 0.3:
                dst, qpn = PEER_B, QPN_B_REMOTE
            out.append(("%s-%s" % (kind, direction),
                        frame_of(kind, src, dst, qpn, psn=rng.getrandbits(24), **kw)))
    return out


def encap_of(f: bytes, rng: random.Random) -> bytes:
    da = LOCAL_SID[0] if rng.random() < 0.8 else "fcbb:bb00:101::"
    return srv6_push(f, "fcbb:bb00:300::1", da, rng.randrange(1, 256))


def mutations(rng: random.Random, bases: list[tuple[str, bytes]]):
    """(name, frame) pairs: truncations at every offset, then N_RANDOM random mutants."""
    tx = next(f for n, f in bases if n == "data-tx")
    sack = next(f for n, f in bases if n == "sack-rx")
    for name, f in (("data-tx", tx), ("sack-rx", sack), ("sack-rx-srv6", encap_of(sack, rng))):
        for cut in range(ETH, len(f)):
            yield "trunc-%s@%d" % (name, cut), f[:cut]
    for i in range(N_RANDOM):
        name, f = rng.choice(bases)
        f = bytearray(f)
        if rng.random() < 0.3:
            f = bytearray(encap_of(bytes(f), rng))
            name += "-srv6"
        l3 = ETH + IP6 if f[ETH + 6] == 41 else ETH
        udp = l3 + IP6
        m = rng.randrange(15)
        if m == 0:                                   # truncated, lengths made consistent
            del f[rng.randrange(udp + UDPH, len(f)):]
            _fix_lengths(f, l3)
        elif m == 1:                                 # random opcode (and TS bit)
            f[udp + UDPH] = rng.randrange(256)
            if rng.random() < 0.5:
                f[udp + UDPH + 8] = rng.randrange(256)
            if rng.random() < 0.5:
                _redo_icrc(f, l3)
        elif m == 2:                                 # random bytes after valid headers
            hdr = udp + UDPH + (ext_len(f[udp + UDPH], f[udp + UDPH + 8]) or 12)
            del f[hdr:]
            f += bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 300)))
            _fix_lengths(f, l3)
            if rng.random() < 0.7:
                _redo_icrc(f, l3)
        elif m == 3:                                 # byte flips in the headers
            for _ in range(rng.randrange(1, 5)):
                f[rng.randrange(min(len(f), udp + UDPH + 48))] = rng.randrange(256)
        elif m == 4:                                 # an IPv6 extension header before UDP
            nh = rng.choice(sorted(EXT_NH - {50, 51}) + [51])
            hdr = bytes([17, 0]) + bytes(6) if nh != 44 else bytes([17, 0, 0, 0]) + b"\0\0\0\1"
            f[udp:udp] = hdr
            f[l3 + 6] = nh
            _fix_lengths(f, l3)
        elif m == 5:                                 # VLAN tag(s)
            tag = rng.choice([b"\x81\x00", b"\x88\xa8"]) + rng.getrandbits(16).to_bytes(2, "big")
            f[12:12] = tag
        elif m == 6:                                 # IPv4 ethertype over the same bytes
            f[12:14] = b"\x08\x00"
        elif m == 7:                                 # not UDP
            f[l3 + 6] = rng.choice([6, 58, 59, 132, 41, 4, rng.randrange(256)])
        elif m == 8:                                 # wrong IPv6 payload length
            f[l3 + 4:l3 + 6] = rng.randrange(0x10000).to_bytes(2, "big")
        elif m == 9:                                 # wrong UDP length
            v = rng.choice([0, 1, 8, 23, 24, rng.randrange(0x10000),
                            u16(f, udp + 4) + rng.randrange(-8, 9)])
            f[udp + 4:udp + 6] = (v & 0xFFFF).to_bytes(2, "big")
        elif m == 10:                                # trailing bytes (Ethernet padding)
            f += bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))
        elif m == 11:                                # wrong outer length (SRv6)
            f[ETH + 4:ETH + 6] = rng.randrange(0x10000).to_bytes(2, "big")
        elif m == 12:                                # another ethertype
            f[12:14] = rng.getrandbits(16).to_bytes(2, "big")
        elif m == 13:                                # nothing: a well-formed frame
            pass
        else:                                        # random bytes that look like IPv6/UDP
            f = bytearray(rng.getrandbits(8) for _ in range(rng.randrange(ETH, 200)))
            if rng.random() < 0.8:
                f[12:14] = b"\x86\xdd"
                if len(f) > ETH:
                    f[ETH] = 0x60 | (f[ETH] & 0x0F)
                if len(f) > ETH + 6 and rng.random() < 0.7:
                    f[ETH + 6] = 17
                if len(f) > ETH + IP6 + 4 and rng.random() < 0.7:
                    f[ETH + IP6 + 2:ETH + IP6 + 4] = b"\x12\xb7"
            name = "random"
        yield "%s/m%d#%d" % (name, m, i), bytes(f)


# ------------------------------------------------------------------ expectations

TX_CONNS = {(addr(PEER_A), QPN_A_REMOTE): CONN_A, (addr(PEER_B), QPN_B_REMOTE): CONN_B}


def check_spray(env, f, l3, ret, out, d):
    pre = {"spray_rx": 1}
    bth = ETH + IP6 + UDPH
    conn = TX_CONNS.get((f[ETH + 24:ETH + 40], int.from_bytes(f[bth + 5:bth + 8], "big")))
    if conn is None:
        assert (ret, out, d) == (XDP_PASS, f, dict(pre, spray_no_conn=1))
        return
    op0 = f[ETH + IP6 + UDPH]
    if ret == XDP_DROP and op0 == Opcode.PROBE_REQ:   # probes: only on an EV of the set
        assert d in (dict(pre, spray_probe_no_ev=1), dict(pre, spray_probe_denied=1))
        return
    if ret == XDP_DROP:                       # random feedback may have used up every EV
        assert d == dict(pre, spray_no_ev=1)
        return
    assert ret == XDP_REDIRECT and d["spray_tx"] == 1
    srv6 = env.mode == "srv6"
    inner_out = out[:ETH] + out[ETH + IP6:] if srv6 else out
    ev = wire.ev_of_frame(inner_out)
    e = env.ev(conn, ev)
    smac, dmac = env.plane_macs(e.plane)
    op, b8 = f[ETH + IP6 + UDPH], f[ETH + IP6 + UDPH + 8]
    is_data = Opcode.WRITE_FIRST <= op <= Opcode.WRITE_ONLY_IMM
    dscp = DSCP_CTRL if not is_data else (DSCP_RTX if b8 & RTX_BIT else DSCP_DATA)
    expected = spray_rewrite(f, ev, smac, dmac, dscp)
    if srv6:
        tmpl = TEMPLATES[env.conn(conn).template]
        expected = srv6_push(expected, SRV6_SRC[e.plane], srv6_da(tmpl, e.plane, e.t1), HOP_LIMIT)
    csum = (40 if srv6 else 0) + ETH + IP6 + 6
    if f[ETH + IP6 + 6:ETH + IP6 + 8] != b"\0\0" and \
            not wire.udp6_checksum_ok(f[ETH:], allow_zero=False):
        # an invalid checksum was updated, not recomputed: compare everything else
        expected = expected[:csum] + out[csum:csum + 2] + expected[csum + 2:]
    assert out.hex() == expected.hex()


def check_ingress(env, f, l3, ret, out, d):
    pre = {"ing_rx": 1}
    frame = f
    if f[l3 + 24:l3 + 40] != addr(LOCAL):       # not for us: unchanged (not decapsulated)
        assert (ret, out) == (XDP_PASS, f)
        assert d.get("ing_not_ours") == 1
        return
    if l3 != ETH:                               # SRv6 for our SID, arriving on p0
        frame = decap(f)
    bth = ETH + IP6 + UDPH
    op = frame[bth]
    if op == Opcode.PROBE_REQ:
        check_probe(env, frame, ret, out, d)
        return
    if op == Opcode.SACK and frame[bth + 12 + 1] & CONSTS["MRC_SETH_PR"]:   # no probe in flight
        assert (ret, d.get("ing_probe_ans_unknown")) == (XDP_DROP, 1)
        return
    if d.get("ing_fb_oow"):                     # feedback outside the sent window: dropped
        assert ret == XDP_DROP and op in (Opcode.SACK, Opcode.NACK) and not d.get("ing_to_engine")
        return
    assert ret == XDP_REDIRECT
    assert out.hex() == with_macs(frame, *env.engine_macs()).hex()
    assert d["ing_to_engine"] == 1


RX_CONNS = {(addr(PEER_A), QPN_A_LOCAL): CONN_A, (addr(PEER_B), QPN_B_LOCAL): CONN_B,
            (addr(PEER_A), CONSTS["MRC_QPN_PROBE"]): CONN_A, (addr(PEER_B), CONSTS["MRC_QPN_PROBE"]): CONN_B}


def check_probe(env, frame, ret, out, d):
    """A probe for us (plain frame, arrived on p0): answered by a configured peer's
    connection, or dropped with one reason."""
    bth = ETH + IP6 + UDPH
    dqpn = int.from_bytes(frame[bth + 5:bth + 8], "big")
    cid = RX_CONNS.get((frame[ETH + 8:ETH + 24], dqpn))
    if cid is None:
        assert (ret, d.get("ing_probe_not_peer")) == (XDP_DROP, 1)
        return
    if ret == XDP_DROP:         # trailing bytes, a payload, over the rate
        assert d.get("ing_probe_bad", 0) + d.get("ing_probe_rate", 0) == 1
        assert len(frame) != ETH + IP6 + UDPH + 12 + 16 + 4 or d.get("ing_probe_rate") == 1
        return
    assert ret == XDP_TX and d["ing_probe_answered"] == 1
    conn = env.conn(cid)
    ans_qpn = dqpn if dqpn == CONSTS["MRC_QPN_PROBE"] else conn.remote_qpn
    want = probe_answer(frame, ans_qpn, *env.plane_macs(0))
    if env.mode == "srv6":
        ev = wire.ev_of_frame(frame)
        slot = env.slot_of(cid, ev)
        e = env.ev_at(cid, slot) if slot is not None else None
        if e is None or e.plane != 0:
            e = env.ev_at(cid, ev % conn.ev_per_plane)
        want = srv6_push(want, SRV6_SRC[0], srv6_da(TEMPLATES[conn.template], 0, e.t1), HOP_LIMIT)
    assert out.hex() == want.hex()


def check(env, prog, name, f, ret, out, d):
    encap = prog == "ingress" and env.mode == "srv6"
    cls, info = classify(f, encap)
    assert ret != XDP_ABORTED
    bad = {k: v for k, v in d.items() if k.startswith("bad_")}
    pre = {"spray": "spray", "ingress": "ing", "engine": "eng"}[prog]
    if prog == "engine":                        # to_engine passes everything, counts MRC
        assert (ret, out) == (XDP_PASS, f)
        cls0, _ = classify(f, False)
        assert d == ({"eng_rx": 1, "eng_pass": 1} if cls0 == OK else {})
        return cls0
    if cls != NOT and encap and transit_srv6(f):    # not our SID: passed, whatever inside
        assert (xdp_name(ret), out.hex(), d) == ("PASS", f.hex(), {"ing_rx": 1, "ing_not_ours": 1})
        return cls
    if cls == NOT:
        want = {pre + "_rx": 1, pre + "_non_mrc": 1}
        if info:
            want[info] = 1
        assert (xdp_name(ret), out.hex(), d) == ("PASS", f.hex(), want)
    elif cls == BAD:
        assert (xdp_name(ret), d) == ("DROP", {pre + "_rx": 1, info: 1})
    else:
        assert bad == {}, "well-formed frame counted malformed"
        (check_spray if prog == "spray" else check_ingress)(env, f, info, ret, out, d)
    return cls


@pytest.mark.parametrize("mode", ["ecmp", "srv6"])
def test_fuzz(datapath, mode):
    env = datapath.use(mode)
    print("\nfuzz seed %d (MRC_FUZZ_SEED), %d random frames, mode %s" % (SEED, N_RANDOM, mode))
    rng = random.Random("%d-%s" % (SEED, mode))
    bases = base_frames(rng, env.active_evs(CONN_A))
    seen = {}
    bad_total = bad_frames = 0
    before = env.counters()
    for i, (name, f) in enumerate(mutations(rng, bases)):
        if i and i % RESET_EVERY == 0:
            env.use(mode)
            before = env.counters()
        for prog in ("spray", "ingress", "engine"):
            ret, out = env.run(prog, f)
            after = env.counters()
            d = delta(before, after)
            before = after
            try:
                cls = check(env, prog, name, f, ret, out, d)
            except AssertionError as e:
                raise AssertionError("seed %d, frame %d %r through %s (%s mode): %s\n"
                                     "frame %s\nout   %s\nverdict %s, counters %s" % (
                                         SEED, i, name, prog, mode, e, f.hex(), out.hex(),
                                         xdp_name(ret), d)) from None
            seen[(prog, cls)] = seen.get((prog, cls), 0) + 1
            if ret == XDP_REDIRECT:
                seen[(prog, "redirected")] = seen.get((prog, "redirected"), 0) + 1
            if prog != "engine" and cls == BAD and not (prog == "ingress" and mode == "srv6"
                                                         and transit_srv6(f)):
                bad_frames += 1
                bad_total += sum(v for k, v in d.items() if k.startswith("bad_"))
    print("verdict classes seen: %s" % dict(sorted(seen.items())))
    assert bad_total == bad_frames
    # the corpus really exercises all three classes in both programs
    for prog in ("spray", "ingress"):
        for cls in (NOT, BAD, OK, "redirected"):
            assert seen.get((prog, cls), 0) >= 100, (prog, cls, seen)
