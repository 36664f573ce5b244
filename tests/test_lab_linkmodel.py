"""Tier 1: the lab link model (bpf/linkmodel.c) through BPF_PROG_TEST_RUN.

Every case puts a config for ifindex 1 (lo, which exists in the test's netns), runs one
frame and checks the verdict, the exact output bytes and the per-link counters.  The
phantom queue is frozen at a chosen backlog by a last_ns far in the future.
"""
from __future__ import annotations

import ipaddress
import os
import struct
import time

import pytest

from mrc_xdp.datapath import bpfsys
from mrc_xdp.lab import linkmodel as lmod

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="BPF_PROG_TEST_RUN needs root")

IFX = 1                   # lo
FROZEN = 1 << 62          # last_ns in the future: the queue does not drain
PORT = 4791
DSCP_TRIMMED, DSCP_CTRL, DSCP_DATA = 12, 46, 4
SRC, DST = "fd00:100::1", "fd00:100::3"
OUTER_SRC, OUTER_DST = "fcbb:0:300::", "fcbb:0:100:201:101:302::"
SMAC, DMAC = bytes.fromhex("026d00010000"), bytes.fromhex("026d00010001")

BASE_CFG = dict(rate_bps=10_000_000_000, ecn_bytes=30000, trim_bytes=60000, drop_bytes=250000,
                dscp_trimmed=DSCP_TRIMMED, dscp_ctrl=DSCP_CTRL, udp_port=PORT, ecn=True, trim=True)


# ------------------------------------------------------------------ frames (exact bytes)
def ipv6(payload: bytes, nh: int, src=SRC, dst=DST, dscp=DSCP_DATA, ecn=0, flow=0x12345, hlim=64) -> bytes:
    tc = (dscp << 2) | ecn
    word = (6 << 28) | (tc << 20) | flow
    return struct.pack("!IHBB", word, len(payload), nh, hlim) + \
        ipaddress.IPv6Address(src).packed + ipaddress.IPv6Address(dst).packed + payload


def eth(l3: bytes, ethertype=0x86DD) -> bytes:
    return DMAC + SMAC + struct.pack("!H", ethertype) + l3


def bth(opcode: int, dqpn=0x100, psn=7, b8=0) -> bytes:
    return struct.pack("!BBHBBHBBH", opcode, 0, 0xFFFF, 0, dqpn >> 16, dqpn & 0xFFFF,
                       b8, psn >> 16, psn & 0xFFFF)


def data_transport(opcode=0xCA, payload_len=1024, ts=False) -> tuple[bytes, int]:
    """BTH|METH|[TSETH]|RETH|[ImmDt]|payload|ICRC; returns (bytes, header length)."""
    h = bth(opcode, b8=0x10 if ts else 0) + struct.pack("!HH", 1, 2)
    if ts:
        h += struct.pack("!HH", 0xABCD, 0)
    h += struct.pack("!QII", 0x1000, 0x77, payload_len)
    if opcode in (0xC9, 0xCB):
        h += struct.pack("!I", 0xDEADBEEF)
    body = bytes((i * 7) & 0xFF for i in range(payload_len))
    return h + body + b"\xa1\xb2\xc3\xd4", len(h)


def udp(transport: bytes, sport=0xC001, dport=PORT, csum=0) -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(transport), csum) + transport


def mrc_frame(opcode=0xCA, payload_len=1024, ts=False, dscp=DSCP_DATA, ecn=2, srv6=False,
              dport=PORT):
    t, hl = data_transport(opcode, payload_len, ts) if 0xC6 <= opcode <= 0xCB else \
        (bth(opcode) + bytes(36) + b"\xa1\xb2\xc3\xd4", None)
    l3 = ipv6(udp(t, dport=dport), 17, dscp=dscp, ecn=ecn)
    if srv6:
        l3 = ipv6(l3, 41, src=OUTER_SRC, dst=OUTER_DST, dscp=dscp, ecn=ecn)
    hdr = None if hl is None else 14 + (80 if srv6 else 40) + 8 + hl
    return eth(l3), hdr


def tc_of(ip6: bytes) -> int:
    return (struct.unpack("!I", ip6[:4])[0] >> 20) & 0xFF


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def lm():
    m = lmod.LinkModel.load()
    yield m
    m.delete(IFX)
    m.close()


def configure(lm, backlog=0, **over):
    cfg = dict(BASE_CFG)
    cfg.update(over)
    lm.set(IFX, cfg)
    lm.set_state(IFX, backlog, FROZEN)


def run(lm, frame: bytes):
    ret, out, _ = bpfsys.prog_test_run(lm.prog_fd, frame, ifindex=IFX)
    return ret, out


def ctr(lm):
    return lm.counters(IFX)


# ------------------------------------------------------------------ cases
def test_unconfigured_ifindex_passes_untouched(lm):
    lm.delete(IFX)
    f, _ = mrc_frame()
    ret, out = run(lm, f)
    assert (ret, out) == (bpfsys.XDP_PASS, f)
    assert ctr(lm)["pkts"] == 0


def test_idle_link_passes_and_counts(lm):
    configure(lm)
    f, _ = mrc_frame()
    ret, out = run(lm, f)
    assert (ret, out) == (bpfsys.XDP_PASS, f)
    c = ctr(lm)
    assert (c["pkts"], c["bytes"], c["mrc_pkts"]) == (1, len(f), 1)
    assert sum(c[k] for k in lmod.DROP_FIELDS) + c["marked"] + c["trimmed"] == 0
    # the frame was queued: frozen backlog grew by its length
    assert lm.state(IFX)["backlog"] == len(f)


@pytest.mark.parametrize("ecn,marked", [(0, False), (1, True), (2, True), (3, False)])
def test_ecn_mark_above_threshold(lm, ecn, marked):
    configure(lm, backlog=40000)
    f, _ = mrc_frame(payload_len=64, ecn=ecn)
    ret, out = run(lm, f)
    assert ret == bpfsys.XDP_PASS and len(out) == len(f)
    want = bytearray(f)
    if marked:
        want[15] |= 0x30
    assert out == bytes(want)
    assert tc_of(out[14:]) & 3 == (3 if marked or ecn == 3 else ecn)
    assert ctr(lm)["marked"] == int(marked)


def test_no_mark_below_threshold_or_flag_off(lm):
    configure(lm, backlog=29000)
    f, _ = mrc_frame(payload_len=64, ecn=2)
    assert run(lm, f) == (bpfsys.XDP_PASS, f)
    configure(lm, backlog=40000, ecn=False)         # last hop to a host: ECN off
    assert run(lm, f) == (bpfsys.XDP_PASS, f)
    assert ctr(lm)["marked"] == 0


def test_srv6_marks_outer_header_only(lm):
    configure(lm, backlog=40000)
    f, _ = mrc_frame(payload_len=64, ecn=1, srv6=True)
    ret, out = run(lm, f)
    assert tc_of(out[14:]) & 3 == 3
    assert tc_of(out[54:]) & 3 == 1            # the datapath copies CE inward at decap
    assert out[16:] == f[16:]


@pytest.mark.parametrize("opcode,ts,srv6", [
    (0xCA, False, False), (0xCB, False, False), (0xC6, True, False), (0xC7, False, True),
    (0xC9, True, True)])
def test_trim_keeps_headers_exactly(lm, opcode, ts, srv6):
    configure(lm, backlog=70000)
    f, hdr = mrc_frame(opcode=opcode, payload_len=1000, ts=ts, srv6=srv6, ecn=2)
    ret, out = run(lm, f)
    assert ret == bpfsys.XDP_PASS
    assert len(out) == hdr + 4
    assert out[hdr:] == b"\0\0\0\0"             # the ICRC stand-in
    exp = bytearray(f[:hdr] + b"\0\0\0\0")
    n = len(exp)
    ips = [14, 54] if srv6 else [14]
    for off in ips:                              # payload length, DSCP (ECN kept, then CE)
        struct.pack_into("!H", exp, off + 4, n - off - 40)
        word = struct.unpack_from("!I", exp, off)[0]
        tc = (DSCP_TRIMMED << 2) | ((word >> 20) & 3)
        struct.pack_into("!I", exp, off, (word & ~(0xFF << 20)) | (tc << 20))
    uoff = ips[-1] + 40
    struct.pack_into("!HH", exp, uoff + 4, n - uoff, 0)
    exp[15] |= 0x30                              # above ecn_bytes too: outer CE
    assert out == bytes(exp)
    c = ctr(lm)
    assert (c["trimmed"], c["marked"], c["mrc_pkts"]) == (1, 1, 1)
    # the queue grew by the trimmed length, not the original
    assert lm.state(IFX)["backlog"] == 70000 + len(out)


def test_trim_udp_checksum_zeroed(lm):
    configure(lm, backlog=70000)
    t, hl = data_transport(0xCA, 200)
    f = eth(ipv6(udp(t, csum=0x1234), 17))
    ret, out = run(lm, f)
    assert len(out) == 14 + 40 + 8 + hl + 4
    assert out[14 + 40 + 6:14 + 40 + 8] == b"\0\0"


@pytest.mark.parametrize("opcode", [0xDC, 0xDD, 0xD1, 0xDE])
def test_control_never_trimmed(lm, opcode):
    configure(lm, backlog=70000, ecn=False)
    f, _ = mrc_frame(opcode=opcode)
    assert run(lm, f) == (bpfsys.XDP_PASS, f)
    assert ctr(lm)["trimmed"] == 0


def test_ctrl_dscp_data_not_trimmed(lm):
    configure(lm, backlog=70000, ecn=False)
    f, _ = mrc_frame(dscp=DSCP_CTRL)
    assert run(lm, f) == (bpfsys.XDP_PASS, f)


def test_trim_off_flag(lm):
    configure(lm, backlog=70000, ecn=False, trim=False)
    f, _ = mrc_frame()
    assert run(lm, f) == (bpfsys.XDP_PASS, f)


def test_header_only_frame_not_trimmed_again(lm):
    configure(lm, backlog=70000, ecn=False)
    f, hdr = mrc_frame(payload_len=0)
    assert len(f) == hdr + 4
    assert run(lm, f) == (bpfsys.XDP_PASS, f)
    assert ctr(lm)["trimmed"] == 0


def test_drop_above_drop_threshold(lm):
    configure(lm, backlog=260000)
    f, _ = mrc_frame()
    ret, _ = run(lm, f)
    assert ret == bpfsys.XDP_DROP
    c = ctr(lm)
    assert (c["drop_queue"], c["pkts"]) == (1, 1)
    assert lm.state(IFX)["backlog"] == 260000      # a dropped frame is not queued


def test_non_mrc_counted_queued_never_modified(lm):
    configure(lm, backlog=70000)
    frames = [
        eth(bytes(range(60)), ethertype=0x0800),                                 # IPv4
        eth(ipv6(bytes(40), 6, ecn=2)),                                          # TCP, ECT
        mrc_frame(dport=4792, ecn=2)[0],                                         # other UDP port
        eth(ipv6(bytes(8), 58, ecn=1)),                                          # ICMPv6
    ]
    for f in frames:
        assert run(lm, f) == (bpfsys.XDP_PASS, f)
    c = ctr(lm)
    assert (c["pkts"], c["mrc_pkts"], c["marked"], c["trimmed"]) == (4, 0, 0, 0)
    assert lm.state(IFX)["backlog"] == 70000 + sum(len(f) for f in frames)


def test_non_mrc_dropped_above_drop_threshold(lm):
    configure(lm, backlog=300000)
    assert run(lm, eth(bytes(60), ethertype=0x0800))[0] == bpfsys.XDP_DROP


def test_blackhole(lm):
    configure(lm, blackhole=True)
    for f in (mrc_frame()[0], eth(bytes(60), ethertype=0x0800)):
        assert run(lm, f)[0] == bpfsys.XDP_DROP
    assert ctr(lm)["drop_blackhole"] == 2


def test_loss_probability(lm):
    configure(lm, loss_ppm=250_000, rate_bps=0)
    f, _ = mrc_frame(payload_len=64)
    n = 20000
    ret, _, _ = bpfsys.prog_test_run(lm.prog_fd, f, repeat=n, ifindex=IFX)
    c = ctr(lm)
    assert c["pkts"] == n
    assert 0.22 < c["drop_loss"] / n < 0.28


def test_flap_down_in_second_half_of_period(lm):
    period_ms = 4000
    configure(lm, flap_period_ms=period_ms)
    f, _ = mrc_frame(payload_len=64)
    per = period_ms * 1_000_000
    for _ in range(10):
        t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        ret, _ = run(lm, f)
        t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        down0, down1 = t0 % per >= per // 2, t1 % per >= per // 2
        if down0 == down1 and t0 // per == t1 // per:
            assert ret == (bpfsys.XDP_DROP if down0 else bpfsys.XDP_PASS)
            assert ctr(lm)["drop_flap"] == int(down0)
            return
    pytest.fail("could not run the frame away from a flap edge")


def test_phantom_queue_drains_at_rate(lm):
    f, _ = mrc_frame(payload_len=64)
    # 8 Gbit/s = 1 byte/ns: a 1 MB backlog left 5 ms ago has drained completely
    lm.set(IFX, dict(BASE_CFG, rate_bps=8_000_000_000))
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    lm.set_state(IFX, 1_000_000, now - 5_000_000)
    assert run(lm, f)[0] == bpfsys.XDP_PASS
    st = lm.state(IFX)
    assert st["backlog"] == len(f) and st["last_ns"] >= now
    # 8 kbit/s = 1 byte/ms: back-to-back frames pile up
    lm.set(IFX, dict(BASE_CFG, rate_bps=8000, ecn_bytes=len(f) + 10, drop_bytes=10 * len(f)))
    lm.set_state(IFX, 0, time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    rets = [run(lm, f)[0] for _ in range(12)]
    c = ctr(lm)
    assert rets.count(bpfsys.XDP_DROP) == c["drop_queue"] >= 1
    assert c["marked"] >= 8


def test_unlimited_rate_never_queues(lm):
    configure(lm, backlog=10**7, rate_bps=0)
    f, _ = mrc_frame()
    assert run(lm, f) == (bpfsys.XDP_PASS, f)


def test_update_keeps_other_settings(lm):
    configure(lm)
    lm.update(IFX, loss_ppm=5, blackhole=True)
    g = lm.get(IFX)
    assert (g["loss_ppm"], g["blackhole"], g["ecn"], g["trim"], g["rate_bps"]) == \
        (5, True, True, True, BASE_CFG["rate_bps"])
    lm.update(IFX, blackhole=False)
    assert lm.get(IFX)["blackhole"] is False and lm.get(IFX)["loss_ppm"] == 5


# ------------------------------------------------------------------ uN (kernels without seg6local)
UN_SELF = dict(usid_end=True, usid_block=0xFCBB0000, usid_self=0x0100)   # OUTER_DST's first uSID


def _with_outer_dst(frame: bytes, dst: str) -> bytes:
    return frame[:38] + ipaddress.IPv6Address(dst).packed + frame[54:]


@pytest.mark.parametrize("trimmed", [False, True])
def test_un_shifts_the_outer_destination_to_the_next_usid(lm, trimmed):
    configure(lm, backlog=70000 if trimmed else 0, **UN_SELF)
    f, hl = mrc_frame(srv6=True)
    ret, out = run(lm, f)
    assert ret == bpfsys.XDP_PASS
    want = _with_outer_dst(f, "fcbb:0:201:101:302::")   # block:self:a:b:c -> block:a:b:c:0
    if trimmed:
        assert ctr(lm)["trimmed"] == 1 and len(out) == hl + 4
        assert out[38:54] == want[38:54]        # (DSCP, CE and lengths are the trim's)
    else:
        assert out == want
    assert ctr(lm)["usid_end"] == 1


@pytest.mark.parametrize("cfg, dst", [
    (dict(UN_SELF, usid_self=0x0200), OUTER_DST),            # another switch's SID
    (dict(UN_SELF, usid_block=0xFCBB0001), OUTER_DST),       # another block
    (UN_SELF, "fcbb:0:100::"),                               # no next uSID: the kernel's
    (dict(UN_SELF, usid_end=False), OUTER_DST),              # uN off (kernel seg6local)
])
def test_un_leaves_other_destinations_unchanged(lm, cfg, dst):
    configure(lm, **cfg)
    f = _with_outer_dst(mrc_frame(srv6=True)[0], dst)
    assert run(lm, f) == (bpfsys.XDP_PASS, f)
    assert ctr(lm)["usid_end"] == 0


def test_un_applies_to_any_ipv6_frame_and_not_to_others(lm):
    configure(lm, **UN_SELF)
    icmp = eth(ipv6(bytes(8), 58, dst=OUTER_DST))              # not MRC: still routed by uSID
    ret, out = run(lm, icmp)
    assert (ret, out) == (bpfsys.XDP_PASS, _with_outer_dst(icmp, "fcbb:0:201:101:302::"))
    arp = eth(bytes(28), ethertype=0x0806)
    assert run(lm, arp) == (bpfsys.XDP_PASS, arp)
    assert ctr(lm)["usid_end"] == 1


def _nxt(mode: str):
    """A next program returning XDP_TX, loaded frags-aware ('on') or single-buffer ('off')."""
    from mrc_xdp.datapath import kheaders, progload
    kheaders.ensure()
    from bcc import BPF
    return progload.build(lambda extra: BPF(text=b"int nxt(struct xdp_md *ctx) { return XDP_TX; }"),
                          ["nxt"], mode)


def test_next_program_tail_call(lm):
    nxt = _nxt("on" if lm.frags else "off")     # the prog array takes only the model's path
    other = _nxt("off" if lm.frags else "on")
    configure(lm)
    f, _ = mrc_frame()
    with pytest.raises(lmod.LinkModelError, match="both be frags-aware or both"):
        lm.set_next(IFX, 3, other.progs["nxt"].fd)
    other.close()
    lm.set_next(IFX, 3, nxt.progs["nxt"].fd)
    assert run(lm, f)[0] == bpfsys.XDP_TX
    configure(lm, blackhole=True, next_prog=4)      # a drop is final
    assert run(lm, f)[0] == bpfsys.XDP_DROP
    lm.set_next(IFX, 3, None)
    assert run(lm, f)[0] == bpfsys.XDP_DROP
    configure(lm)
    assert run(lm, f)[0] == bpfsys.XDP_PASS


# ------------------------------------------------------------------ multi-buffer frames
def _need_frags(lm):
    if not lm.frags:
        pytest.skip("the link model was built single-buffer (MRC_XDP_FRAGS / kernel)")


def test_multibuffer_frame_counted_whole(lm):
    """A frame longer than test_run's linear part (3520 B) is a linear part plus frags:
    the queue and the counters take its whole length; it passes unchanged."""
    _need_frags(lm)
    configure(lm)
    f, _ = mrc_frame(payload_len=5000)
    assert len(f) > bpfsys.TEST_RUN_LINEAR_MAX
    assert run(lm, f) == (bpfsys.XDP_PASS, f)
    c = ctr(lm)
    assert (c["pkts"], c["bytes"], c["mrc_pkts"]) == (1, len(f), 1)
    assert lm.state(IFX)["backlog"] == len(f)


def test_multibuffer_marked(lm):
    _need_frags(lm)
    configure(lm, backlog=40000)
    f, _ = mrc_frame(payload_len=8000, ecn=2)
    ret, out = run(lm, f)
    exp = bytearray(f)
    exp[15] |= 0x30
    assert (ret, out) == (bpfsys.XDP_PASS, bytes(exp))
    assert ctr(lm)["marked"] == 1


@pytest.mark.parametrize("srv6", [False, True])
def test_multibuffer_trim_keeps_headers(lm, srv6):
    """Trimmed to headers + the 4-byte stand-in: the frags are shrunk away."""
    _need_frags(lm)
    configure(lm, backlog=70000)
    f, hdr = mrc_frame(payload_len=9000, srv6=srv6, ecn=2)
    small, _ = mrc_frame(payload_len=1000, srv6=srv6, ecn=2)
    ret, out = run(lm, f)
    ret_s, out_s = run(lm, small)        # the same trim of a linear frame
    assert ret == ret_s == bpfsys.XDP_PASS
    assert len(out) == hdr + 4
    n = 14 + (80 if srv6 else 40) + 8
    # equal but for the RETH DMA length (payload_len) the builder put in the header
    assert out[:n + 28] == out_s[:n + 28] and out[n + 32:] == out_s[n + 32:]
    c = ctr(lm)
    assert (c["trimmed"], c["bytes"]) == (2, len(f) + len(small))
