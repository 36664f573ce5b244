"""Tier 1: multi-buffer (XDP frags) frames through spray, ingress and to_engine, and the
choice between the frags-aware and the single-buffer programs (progload).

BPF_PROG_TEST_RUN gives a program a multi-buffer frame when the frame is longer than
one page minus the XDP headroom and skb_shared_info (3520 B with 4 KiB pages): that many
bytes linear, the rest in page-sized frags.  xdp_md.data_end smaller than the frame
asks for a shorter linear part (6.1 and 6.18 take it; a kernel that wants data_end equal
to the frame's length refuses it: those cases skip).  Expected outputs are computed as
in the other tier-1 tests (helpers.py): the ICRC by zlib over the masked packet, the
UDP checksum recomputed in full, never by the datapath's own update.
"""
from __future__ import annotations

import errno

import pytest

from helpers import (CONN_A, DSCP_CTRL, DSCP_DATA, ETH, HOP_LIMIT, IP6, LOCAL, LOCAL_SID, PEER_A,
                     QPN_A_LOCAL, QPN_A_REMOTE, SRV6_SRC, TEMPLATES, UDPH, XDP_DROP, XDP_PASS,
                     XDP_REDIRECT, data, frame_of, spray_rewrite, srv6_da, srv6_push,
                     udp6_csum_valid, with_macs, xdp_name)
from mrc_xdp.datapath import bpfsys, progload, wire

LINEAR_MAX = bpfsys.TEST_RUN_LINEAR_MAX
BIG = bytes(range(256)) * 16                 # 4096 B: the IB MTU payload
BTH_LEN, METH_LEN = 12, 4
OUTER_SRC = "fcbb:bb00:200::1"


@pytest.fixture
def mb(datapath):
    """The session's datapath, which must be the frags-aware one (this kernel takes it)."""
    if not datapath.dp.frags:
        pytest.skip("the datapath was built single-buffer: %s" % datapath.dp.path_info["why"])
    return datapath


@pytest.fixture
def mb_ecmp(mb, ecmp):
    return ecmp


@pytest.fixture
def mb_srv6(mb, srv6):
    return srv6


def _run(env, prog, frame, linear=None, ifindex=None):
    """run_counted, skipping where the kernel cannot make the linear part asked for."""
    try:
        return env.run_counted(prog, frame, ifindex=ifindex, linear=linear)
    except bpfsys.BpfError as e:
        if linear is not None and e.errno == errno.EINVAL:
            pytest.skip("this kernel's test_run takes no linear part shorter than the frame "
                        "(xdp_md.data_end < data_size_in)")
        raise


def _trailer_off(frame: bytes, l3: int = ETH) -> int:
    return l3 + IP6 + int.from_bytes(frame[l3 + 4:l3 + 6], "big") - wire.ICRC_LEN


# ------------------------------------------------------------------ spray
# (id, data_frame keywords, linear part: None = the kernel's 3520 B)
SPRAY_MB = [
    ("4096", dict(payload=BIG), None),
    ("4096-csum", dict(payload=BIG, udp_csum=True), None),
    ("4097-odd-csum", dict(payload=BIG + b"\x7e", udp_csum=True), None),   # trailer at an odd offset
    ("4096-ts-imm", dict(payload=BIG, ts=0xABCD, opcode=wire.Opcode.WRITE_ONLY_IMM, imm=0x1234567),
     None),
    ("9000", dict(payload=bytes(range(250)) * 36, udp_csum=True), None),   # 3 frags
    ("straddle", dict(payload=BIG, udp_csum=True), "straddle"),            # trailer over the edge
    ("small-trailer-in-frag", dict(payload=b"\x33" * 64, udp_csum=True), "trailer"),
    ("small-all-linear", dict(payload=b"\x33" * 64, udp_csum=True), "all"),
]


def _linear(frame, how):
    t = _trailer_off(frame)
    return {None: None, "straddle": t + 2, "trailer": t, "all": len(frame)}[how]


@pytest.mark.parametrize("kw,how", [c[1:] for c in SPRAY_MB], ids=[c[0] for c in SPRAY_MB])
def test_spray_multibuffer_ecmp(mb_ecmp, kw, how):
    env = mb_ecmp
    f = data(41, **dict(kw))
    assert wire.frame_icrc_ok(f)
    linear = _linear(f, how)
    ret, out, d = _run(env, "spray", f, linear)
    assert ret == XDP_REDIRECT, xdp_name(ret)
    ev = wire.ev_of_frame(out)
    plane = env.ev_plane(CONN_A)[ev]
    smac, dmac = env.plane_macs(plane)
    assert out.hex() == spray_rewrite(f, ev, smac, dmac, DSCP_DATA).hex()
    assert wire.frame_icrc_ok(out)                           # the independent CRC
    if kw.get("udp_csum"):
        assert udp6_csum_valid(out)
    beyond = (linear or min(len(f), LINEAR_MAX)) < _trailer_off(f) + wire.ICRC_LEN
    want = {"spray_rx": 1, "spray_tx": 1, "spray_bytes": len(out), "spray_icrc_fix": 1,
            "spray_data": 1}
    if beyond:
        want["spray_icrc_frag"] = 1
    if kw.get("udp_csum"):
        want["spray_csum_fix"] = 1
    assert d == want
    assert env.evctr(CONN_A, ev)["tx_bytes"] == len(f)


@pytest.mark.parametrize("kind", ["sack", "nack", "ack", "ep_req", "ep_resp"])
def test_spray_multibuffer_control_trailer_in_frag(mb_ecmp, kind):
    env = mb_ecmp
    f = frame_of(kind, LOCAL, PEER_A, QPN_A_REMOTE, psn=41, udp_csum=True)
    ret, out, d = _run(env, "spray", f, linear=_trailer_off(f) + 1)
    assert ret == XDP_REDIRECT, xdp_name(ret)
    ev = wire.ev_of_frame(out)
    smac, dmac = env.plane_macs(env.ev_plane(CONN_A)[ev])
    assert out.hex() == spray_rewrite(f, ev, smac, dmac, DSCP_CTRL).hex()
    assert wire.frame_icrc_ok(out) and udp6_csum_valid(out)
    assert d["spray_icrc_frag"] == 1 and d["spray_tx"] == 1


@pytest.mark.parametrize("how", [None, "trailer"])
def test_spray_multibuffer_srv6(mb_srv6, how):
    env = mb_srv6
    conn = env.conn(CONN_A)
    f = data(77, payload=BIG, udp_csum=True) if how is None else data(77, payload=b"\x44" * 99)
    ret, out, d = _run(env, "spray", f, _linear(f, how))
    assert ret == XDP_REDIRECT, xdp_name(ret)
    ev = wire.ev_of_frame(out)
    e = env.ev(CONN_A, ev)
    smac, dmac = env.plane_macs(e.plane)
    inner = spray_rewrite(f, ev, smac, dmac, DSCP_DATA)
    da = srv6_da(TEMPLATES[conn.template], e.plane, e.t1)
    assert out.hex() == srv6_push(inner, SRV6_SRC[e.plane], da, HOP_LIMIT).hex()
    assert wire.frame_icrc_ok(out)
    assert d["spray_srv6_encap"] == 1 and d["spray_icrc_frag"] == 1
    assert d["spray_bytes"] == len(out)


# ------------------------------------------------------------------ ingress and to_engine
@pytest.mark.parametrize("how", [None, "trailer"])
def test_ingress_multibuffer_to_engine(mb_ecmp, how):
    env = mb_ecmp
    f = frame_of("data", PEER_A, LOCAL, QPN_A_LOCAL, payload=BIG if how is None else b"\x55" * 80,
                 ev=0x00050006, udp_csum=True)
    ret, out, d = _run(env, "ingress", f, _linear(f, how))
    assert ret == XDP_REDIRECT, xdp_name(ret)
    assert out.hex() == with_macs(f, *env.engine_macs()).hex()
    assert wire.frame_icrc_ok(out)
    assert d == {"ing_rx": 1, "ing_data": 1, "ing_to_engine": 1}
    assert env.rxev() == {(CONN_A, 0x00050006): {"pkts": 1, "bytes": len(f), "ce": 0}}


def test_ingress_multibuffer_srv6_decap(mb_srv6):
    env = mb_srv6
    plain = frame_of("data", PEER_A, LOCAL, QPN_A_LOCAL, payload=BIG, ev=0x00AA00BB)
    f = srv6_push(plain, OUTER_SRC, LOCAL_SID[0], 60)
    ret, out, d = _run(env, "ingress", f)
    assert ret == XDP_REDIRECT, xdp_name(ret)
    assert out.hex() == with_macs(plain, *env.engine_macs()).hex()
    assert wire.frame_icrc_ok(out)
    assert d == {"ing_rx": 1, "ing_decap": 1, "ing_data": 1, "ing_to_engine": 1}
    assert env.rxev()[(CONN_A, 0x00AA00BB)]["bytes"] == len(plain)


def test_to_engine_multibuffer_passes(mb_ecmp):
    env = mb_ecmp
    f = with_macs(frame_of("data", PEER_A, LOCAL, QPN_A_LOCAL, payload=BIG), *env.engine_macs())
    ret, out, d = _run(env, "engine", f)
    assert (xdp_name(ret), out) == ("PASS", f)
    assert d == {"eng_rx": 1, "eng_pass": 1}


# ------------------------------------------------------------------ headers not linear, truncation
HDR_CUTS = [
    # (id, linear part, verdict, counters of spray beyond spray_rx)
    ("eth-only", ETH, "PASS", {"spray_non_mrc": 1, "non_mrc_frag_hdr": 1}),
    ("ipv6-half", ETH + 20, "PASS", {"spray_non_mrc": 1, "non_mrc_frag_hdr": 1}),
    ("udp-half", ETH + IP6 + 4, "PASS", {"spray_non_mrc": 1, "non_mrc_frag_hdr": 1}),
    ("bth-opcode-only", ETH + IP6 + UDPH + 1, "DROP", {"bad_frag_hdr": 1}),
    ("bth-half", ETH + IP6 + UDPH + 6, "DROP", {"bad_frag_hdr": 1}),
    ("reth-half", ETH + IP6 + UDPH + BTH_LEN + METH_LEN + 8, "DROP", {"bad_frag_hdr": 1}),
]


@pytest.mark.parametrize("linear,verdict,want", [c[1:] for c in HDR_CUTS], ids=[c[0] for c in HDR_CUTS])
def test_headers_beyond_the_linear_part(mb_ecmp, linear, verdict, want):
    """Never misparsed: before the frame is known to be MRC it is passed unchanged
    (non_mrc_frag_hdr); after, it is dropped (bad_frag_hdr).  Whatever the cut, the
    bytes that come back are the frame's."""
    env = mb_ecmp
    f = data(9, payload=BIG)
    ret, out, d = _run(env, "spray", f, linear)
    assert xdp_name(ret) == verdict
    if verdict == "PASS":
        assert out == f
    assert d == dict(want, spray_rx=1)
    g = frame_of("data", PEER_A, LOCAL, QPN_A_LOCAL, payload=BIG)
    ret, out, d = _run(env, "ingress", g, linear)
    assert xdp_name(ret) == verdict
    if verdict == "PASS":
        assert out == g
    assert d == dict({("ing_non_mrc" if k == "spray_non_mrc" else k): v for k, v in want.items()},
                     ing_rx=1)
    ret, out, d = _run(env, "engine", g, linear)        # to_engine passes what is not MRC
    assert (xdp_name(ret), out, d) == ("PASS", g, {})


@pytest.mark.parametrize("cut", [1, 100, 600, 4000])
def test_truncated_multibuffer_frame_dropped(mb_ecmp, cut):
    """The IPv6 payload length says more than the whole frame holds (linear part and frags)."""
    env = mb_ecmp
    f = data(9, payload=BIG + BIG)[:-cut]
    assert len(f) > LINEAR_MAX
    ret, out, d = _run(env, "spray", f)
    assert ret == XDP_DROP and d == {"spray_rx": 1, "bad_trunc_ipv6": 1}
    g = frame_of("data", PEER_A, LOCAL, QPN_A_LOCAL, payload=BIG + BIG)[:-cut]
    ret, out, d = _run(env, "ingress", g)
    assert ret == XDP_DROP and d == {"ing_rx": 1, "bad_trunc_ipv6": 1}
    assert env.rxev() == {}


def test_multibuffer_padding_after_the_packet(mb_ecmp):
    """Bytes after the IPv6 packet (in a frag) are neither ICRC nor payload: left alone."""
    env = mb_ecmp
    f = data(3, payload=b"\x21" * 200, udp_csum=True)
    pad = bytes(range(200, 256)) * 80
    ret, out, d = _run(env, "spray", f + pad)
    assert ret == XDP_REDIRECT
    ev = wire.ev_of_frame(out)
    smac, dmac = env.plane_macs(env.ev_plane(CONN_A)[ev])
    assert out.hex() == (spray_rewrite(f, ev, smac, dmac, DSCP_DATA) + pad).hex()
    assert "spray_icrc_frag" not in d


def _big_non_mrc():
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether
    eth = Ether(src=wire.DEFAULT_SMAC, dst=wire.DEFAULT_DMAC)
    mrc = data(5, payload=BIG)
    other_port = bytearray(mrc)
    other_port[ETH + IP6 + 2:ETH + IP6 + 4] = (4792).to_bytes(2, "big")
    return [
        ("ipv6-udp-4792", bytes(other_port)),
        ("ipv4-udp-4791", bytes(eth / IP(src="10.0.0.1", dst="10.0.0.2") / UDP(dport=4791) / BIG)),
        ("ipv6-tcp", bytes(eth / IPv6(src=LOCAL, dst=PEER_A) / TCP(sport=4791, dport=4791) / BIG)),
        ("ipv6-udp-9000", bytes(eth / IPv6(src=LOCAL, dst=PEER_A) / UDP(dport=9) / (BIG * 2))),
    ]


@pytest.mark.parametrize("name,f", _big_non_mrc(), ids=[c[0] for c in _big_non_mrc()])
@pytest.mark.parametrize("prog", ["spray", "ingress", "engine"])
def test_non_mrc_multibuffer_unchanged(mb_ecmp, prog, name, f):
    assert len(f) > LINEAR_MAX
    ret, out, d = _run(mb_ecmp, prog, f)
    assert (xdp_name(ret), out) == ("PASS", f)
    assert "non_mrc_frag_hdr" not in d


# ------------------------------------------------------------------ the path chosen (progload)
TINY = b"int tiny(struct xdp_md *ctx) { return XDP_PASS; }"


@pytest.fixture
def tiny_compile():
    """compile_fn for progload.build over a one-line program; records the cflags asked for."""
    if __import__("os").geteuid() != 0:
        pytest.skip("loading BPF programs needs root")
    from mrc_xdp.datapath import kheaders
    kheaders.ensure()
    from bcc import BPF
    seen = []

    def compile_fn(extra):
        seen.append(list(extra))
        return BPF(text=TINY, cflags=list(extra))
    compile_fn.seen = seen
    return compile_fn


def _refuse(monkeypatch, err=errno.EINVAL):
    def refused(name, insns, flags=0, **kw):
        raise bpfsys.LoadRefused(err, "load %s (prog_flags %#x): %s" % (name, flags, "refused"),
                                 "0: (b7) r0 = 2\nunknown flag (test)\n")
    monkeypatch.setattr(bpfsys, "prog_load_xdp", refused)


def test_progload_auto_takes_frags_here(tiny_compile):
    b = progload.build(tiny_compile, ["tiny"], "auto")
    try:
        assert b.path == progload.PATH_FRAGS and b.frags
        assert tiny_compile.seen == [["-DMRC_FRAGS=1"]]
        info = bpfsys.prog_info(b.progs["tiny"].fd)
        assert bytes(info.tag) in progload.insn_tags(b.bpf.dump_func(b"tiny"))
    finally:
        b.close()


def test_progload_falls_back_when_the_kernel_refuses(tiny_compile, monkeypatch):
    _refuse(monkeypatch)
    b = progload.build(tiny_compile, ["tiny"], "auto")
    try:
        assert b.path == progload.PATH_SINGLE and not b.frags
        assert "refused" in b.why and "unknown flag (test)" in b.why      # the verifier's last line
        assert tiny_compile.seen == [["-DMRC_FRAGS=1"], ["-DMRC_FRAGS=0"]]  # today's programs, rebuilt
        assert bpfsys.prog_test_run(b.progs["tiny"].fd, bytes(64))[0] == XDP_PASS
    finally:
        b.close()


def test_progload_on_never_falls_back(tiny_compile, monkeypatch):
    _refuse(monkeypatch)
    with pytest.raises(progload.FragsRefused, match="MRC_XDP_FRAGS=1"):
        progload.build(tiny_compile, ["tiny"], "on")


def test_progload_off_never_tries_the_flag(tiny_compile, monkeypatch):
    _refuse(monkeypatch)
    b = progload.build(tiny_compile, ["tiny"], "off")
    try:
        assert b.path == progload.PATH_SINGLE and b.why.startswith("MRC_XDP_FRAGS=0")
        assert tiny_compile.seen == [["-DMRC_FRAGS=0"]]
    finally:
        b.close()


def test_progload_tag_mismatch_is_a_refusal(tiny_compile, monkeypatch):
    """The kernel must run what bcc built: a program whose tag is not that of bcc's
    instructions is not used (auto: the single-buffer path instead)."""
    monkeypatch.setattr(progload, "insn_tags", lambda insns: {b"\0" * 8})
    b = progload.build(tiny_compile, ["tiny"], "auto")
    try:
        assert b.path == progload.PATH_SINGLE and "program tag" in b.why
    finally:
        b.close()


@pytest.mark.parametrize("value,want", [(None, "auto"), ("auto", "auto"), ("1", "on"), ("0", "off"),
                                        ("off", "off"), ("", "auto")])
def test_env_override(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(progload.ENV, raising=False)
    else:
        monkeypatch.setenv(progload.ENV, value)
    assert progload.wanted() == want


def test_env_override_spelled_wrong(monkeypatch):
    from mrc_xdp.datapath import loader
    monkeypatch.setenv(progload.ENV, "maybe")
    with pytest.raises(ValueError, match="MRC_XDP_FRAGS='maybe'"):
        progload.wanted()
    with pytest.raises(loader.LoadError, match="MRC_XDP_FRAGS"):
        loader.build()


def test_datapath_single_buffer_by_env(monkeypatch, datapath):
    """MRC_XDP_FRAGS=0: the datapath's programs are the single-buffer ones (flags 0), and
    they still spray a frame as the frags-aware ones do."""
    from mrc_xdp.datapath import loader
    monkeypatch.setenv(progload.ENV, "0")
    dp = loader.build()
    try:
        assert not dp.frags and dp.path_info["path"] == "single"
        assert set(dp.fns) == {"spray", "ingress", "engine", "evop"}
    finally:
        dp.close()
