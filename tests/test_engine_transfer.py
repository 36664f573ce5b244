"""Transport engine on the live pair: transfers, integrity, forged frames, access errors.

Real AF_XDP sockets on each host's mrc0 (tests/engine_pair.py): every data frame goes
engine -> mrc0 -> spray (XDP) -> a plane veth -> ingress (XDP) -> to_engine (XDP) ->
XSKMAP -> the peer's engine, and SACKs come back the same way.
"""
import hashlib
import os
import socket
import time

import pytest

from mrc_xdp.datapath import netns, wire
from mrc_xdp import transport

import engine_pair as ep_

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, AF_XDP, netns)")

BIG = 64 << 20


def test_icrc_matches_wire():
    """The engine's ICRC is wire.icrc() bit for bit (data, SACK, NACK, odd lengths)."""
    frames = [wire.data_frame("fd00::1", "fd00::2", 0x100 + n, n * 999, os.urandom(n * 37),
                              ev=0x12345678 + n, tc=n) for n in range(16)]
    frames += [wire.data_frame("fd00::1", "fd00::2", 0x100, n, os.urandom(n), ev=n)
               for n in (3392, 3391, 3328, 1000, 64, 63, 17)]
    frames.append(wire.sack_frame("fd00::1", "fd00::2", 3, 7, 5, 0xABCDEF01, bitmap=0xF0F0))
    frames.append(wire.nack_frame("fd00::2", "fd00::1", 3, 7, 5, 0x1))
    for f in frames:
        ip6 = wire.inner_ipv6(f)[:-4]
        want = wire.icrc(ip6)
        # zlib alone, the PCLMULQDQ fold (if this CPU has it), and what the engine uses
        assert transport.icrc(ip6, fast=False) == want
        assert transport.icrc(ip6, fast=True) == want
        assert transport.icrc(ip6) == want


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = ep_.Pair(str(tmp_path_factory.mktemp("engpair")))
    try:
        p.up()
        yield p
    finally:
        p.down()


@pytest.fixture(scope="module")
def eps(pair):
    a = transport.Endpoint(pair.ia)
    b = transport.Endpoint(pair.ib)
    src = bytearray(os.urandom(BIG))
    dst = bytearray(BIG)
    env = {"A": a, "B": b, "src": src, "dst": dst, "ma": a.reg_mr(src), "mb": b.reg_mr(dst)}
    try:
        yield env
    finally:
        a.close()
        b.close()


def wait_n(ep, n, timeout=30.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += ep.cq.wait_blocking(timeout=max(0.0, deadline - time.monotonic()))
    return out


@pytest.fixture(scope="module")
def qp0(eps):
    qa, qb = ep_.connect(eps["A"], eps["B"], 0)
    yield qa, qb
    qa.destroy()
    qb.destroy()


def digest(b):
    return hashlib.sha256(b).hexdigest()


@pytest.mark.parametrize("size", [1, 4096, 1 << 20, BIG])
@pytest.mark.parametrize("imm", [None, 0xC0FFEE])
def test_write(eps, qp0, size, imm):
    qa, qb = qp0
    A, B, ma, mb = eps["A"], eps["B"], eps["ma"], eps["mb"]
    off_src, off_dst = (size * 7) % 4096 if size < BIG else 0, 0
    eps["dst"][:size] = bytes(size)
    qa.post_write(size, ma, off_src, size, mb.addr + off_dst, mb.rkey, imm=imm)
    ca = wait_n(A, 1)
    assert [(c.wr_id, c.status, c.opcode, c.byte_len) for c in ca] == \
        [(size, transport.WcStatus.SUCCESS, transport.WcOpcode.RDMA_WRITE, size)]
    if imm is not None:
        cb = wait_n(B, 1, timeout=5)
        assert [(c.opcode, c.imm, c.byte_len, c.qpn) for c in cb] == \
            [(transport.WcOpcode.RECV_RDMA_IMM, imm, size, qb.qpn)]
    else:
        assert B.cq.poll() == []            # a plain Write completes only at the sender
    assert digest(eps["dst"][:size]) == digest(eps["src"][off_src:off_src + size])
    st = qa.stats()
    assert st["state_name"] == "rts" and st["wr_error"] == 0


def test_many_messages_and_qps(eps, pair):
    """Three QPs at once, 50 Write-with-Immediate each: every byte placed, immediates in order."""
    A, B, ma, mb = eps["A"], eps["B"], eps["ma"], eps["mb"]
    qps = [ep_.connect(A, B, k) for k in (1, 2, 3)]
    try:
        eps["dst"][:8 << 20] = bytes(8 << 20)
        n, msg = 50, 40000
        for i in range(n):
            for k, (qa, _) in enumerate(qps):
                off = (k * n + i) * msg
                qa.post_write(k * 1000 + i, ma, off, msg, mb.addr + off, mb.rkey, imm=k << 16 | i)
        ca, cb = wait_n(A, 3 * n), wait_n(B, 3 * n)
        assert len(ca) == 3 * n and all(c.ok for c in ca)
        for k, (qa, qb) in enumerate(qps):
            assert [c.wr_id for c in ca if c.qpn == qa.qpn] == [k * 1000 + i for i in range(n)]
            assert [c.imm for c in cb if c.qpn == qb.qpn] == [k << 16 | i for i in range(n)]
        end = 3 * n * msg
        assert digest(eps["dst"][:end]) == digest(eps["src"][:end])
    finally:
        for qa, qb in qps:
            qa.destroy()
            qb.destroy()


def _inject(ns, frame):
    """Send a frame into host ns's mrc0 from the fabric side (mrc0p): to_engine sees it."""
    def tx():
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
            s.bind(("mrc0p", 0))
            s.send(frame)
    netns.run(ns, tx)


def test_forged_frames_counted_and_dropped(eps, pair, qp0):
    """Wrong QPN, PSN far out of window, bad ICRC (a flipped byte), truncated headers and
    a replayed old PSN injected into B's engine while a 64 MiB transfer runs: each
    counted and dropped, the transfer intact."""
    qa, qb = qp0
    A, B, ma, mb = eps["A"], eps["B"], eps["ma"], eps["mb"]
    eps["dst"][:] = bytes(BIG)
    before = B.stats()
    cack = qb.stats()["rcv_cack"]
    qa.post_write(77, ma, 0, BIG, mb.addr, mb.rkey, imm=5)
    good = dict(smac="02:00:00:00:00:01", dmac="02:00:00:00:00:02")
    wrong_qpn = wire.data_frame(ep_.A_ADDR, ep_.B_ADDR, 0x777, cack, b"x" * 64, va=mb.addr,
                                rkey=mb.rkey, dlen=64, **good)
    far = wire.data_frame(ep_.A_ADDR, ep_.B_ADDR, qb.qpn, (cack + 100000) & 0xFFFFFF, b"y" * 64,
                          va=mb.addr, rkey=mb.rkey, dlen=64, **good)
    bad_crc = bytearray(wire.data_frame(ep_.A_ADDR, ep_.B_ADDR, qb.qpn, cack, b"z" * 64,
                                        va=mb.addr, rkey=mb.rkey, dlen=64, **good))
    bad_crc[-1] ^= 0xFF
    # a replay of an old PSN (already received): a duplicate, never placed again
    dup = wire.data_frame(ep_.A_ADDR, ep_.B_ADDR, qb.qpn, (cack - 1) & 0xFFFFFF, b"d" * 64,
                          va=mb.addr, rkey=mb.rkey, dlen=64, **good)
    # a SACK cut right after its BTH: lengths consistent, no room for the SETH
    short = bytearray(wire.sack_frame(ep_.A_ADDR, ep_.B_ADDR, qb.qpn, 0, 0, 0, **good))
    cut = wire.ETH_LEN + wire.IPV6_LEN + 8 + wire.BTH_LEN + 4
    short = short[:cut]
    plen = cut - wire.ETH_LEN - wire.IPV6_LEN
    short[wire.ETH_LEN + 4:wire.ETH_LEN + 6] = plen.to_bytes(2, "big")
    short[wire.ETH_LEN + 44:wire.ETH_LEN + 46] = plen.to_bytes(2, "big")
    short[-4:] = wire.pack_icrc(wire.icrc(bytes(short[wire.ETH_LEN:-4])))
    for _ in range(20):
        for f in (wrong_qpn, far, bytes(bad_crc), bytes(short), dup):
            _inject(pair.b, f)
        time.sleep(0.005)
    ca, cb = wait_n(A, 1), wait_n(B, 1)
    assert [(c.wr_id, c.ok) for c in ca] == [(77, True)] and [c.imm for c in cb] == [5]
    assert digest(eps["dst"]) == digest(eps["src"])
    after = B.stats()
    d = {k: after[k] - before[k] for k in ("bad_qpn", "out_of_window", "bad_icrc", "truncated",
                                           "duplicates")}
    # every forged frame reached the engine (to_engine) and was counted under its reason;
    # the truncated SACK may instead be dropped by the datapath's parser first
    assert d["bad_qpn"] == 20 and d["out_of_window"] == 20 and d["bad_icrc"] == 20, d
    assert d["truncated"] in (0, 20), d
    assert d["duplicates"] >= 20, d
    assert qb.stats()["state_name"] == "rts" and qa.stats()["state_name"] == "rts"


def test_bad_rkey_and_out_of_region(eps, pair):
    """A bad R_Key, then a write past the end of the region: refused by the receiver
    (counted, NACK), the sender's WR completes with REM_ACCESS_ERR, both QPs in error;
    nothing written outside the region."""
    A, B, ma, mb = eps["A"], eps["B"], eps["ma"], eps["mb"]
    guard = bytearray(b"\xAA" * 8192)
    small = bytearray(4096)
    mg = B.reg_mr(guard)
    ms = B.reg_mr(small)
    try:
        for case, (raddr, rkey) in {"rkey": (ms.addr, ms.rkey ^ 0x5A5A00),
                                    "range": (ms.addr + 1024, ms.rkey)}.items():
            qa, qb = ep_.connect(A, B, 3)
            try:
                before = B.stats()["bad_rkey"]
                qa.post_write(9, ma, 0, 8192, raddr, rkey)
                ca = wait_n(A, 1, timeout=10)
                assert [(c.wr_id, c.status) for c in ca] == [(9, transport.WcStatus.REM_ACCESS_ERR)], case
                assert B.stats()["bad_rkey"] > before
                assert qa.state == transport.QpState.ERROR and qb.state == transport.QpState.ERROR
                assert qa.stats()["nacks_rx_other"] >= 1 and qb.stats()["nacks_tx_access"] >= 1
                with pytest.raises(transport.TransportError, match="error state"):
                    qa.post_write(10, ma, 0, 1, ms.addr, ms.rkey)
            finally:
                qa.destroy()
                qb.destroy()
        assert bytes(guard) == b"\xAA" * 8192
        # the in-range part of the refused write may have landed; nothing beyond 4096
        assert len(small) == 4096
    finally:
        mg.dereg()
        ms.dereg()


def test_buffer_kinds(eps, qp0):
    """Memory regions over bytes (read-only: local access only), numpy and mmap."""
    import mmap
    import numpy as np
    qa, qb = qp0
    A, B = eps["A"], eps["B"]
    size = 300000
    src_bytes = os.urandom(size)
    src_np = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
    dst_mm = mmap.mmap(-1, 2 * size)
    with pytest.raises(transport.TransportError, match="writable"):
        B.reg_mr(src_bytes)                       # remote write into bytes: refused
    m1 = A.reg_mr(src_bytes, access=transport.ACCESS_LOCAL)
    m2 = A.reg_mr(src_np)
    md = B.reg_mr(dst_mm)
    try:
        qa.post_write(1, m1, 0, size, md.addr, md.rkey)
        qa.post_write(2, m2, 0, size, md.addr + size, md.rkey, imm=2)
        ca, cb = wait_n(A, 2), wait_n(B, 1)
        assert [(c.wr_id, c.ok) for c in ca] == [(1, True), (2, True)] and [c.imm for c in cb] == [2]
        assert dst_mm[:size] == src_bytes and dst_mm[size:] == src_np.tobytes()
    finally:
        for m in (m1, m2, md):
            m.dereg()


def test_cq_fd_asyncio(eps, qp0):
    """The CQ's eventfd drives asyncio: await cq.wait() returns the completion."""
    import asyncio
    qa, qb = qp0
    A, ma, mb = eps["A"], eps["ma"], eps["mb"]

    async def run():
        qa.post_write(4242, ma, 0, 100000, mb.addr, mb.rkey)
        return await A.cq.wait(timeout=10)
    got = asyncio.run(run())
    assert [(c.wr_id, c.ok) for c in got] == [(4242, True)]
    assert A.cq.poll() == []


def test_256mib_one_qp(eps):
    """256 MiB in one Write-with-Immediate on one QP (own buffers)."""
    size = 256 << 20
    A, B = eps["A"], eps["B"]
    qa, qb = ep_.connect(A, B, 2)
    src, dst = bytearray(os.urandom(size)), bytearray(size)
    ma, mb = A.reg_mr(src), B.reg_mr(dst)
    try:
        t0 = time.monotonic()
        qa.post_write(256, ma, 0, size, mb.addr, mb.rkey, imm=256)
        ca, cb = wait_n(A, 1, timeout=120), wait_n(B, 1, timeout=10)
        dt = time.monotonic() - t0
        assert [(c.wr_id, c.ok) for c in ca] == [(256, True)] and [c.imm for c in cb] == [256]
        assert digest(dst) == digest(src)
        st = qa.stats()
        print("256 MiB: %.2f s, %.2f Gbit/s, %d packets, %d retransmitted" % (
            dt, size * 8 / dt / 1e9, st["tx_pkts"], st["rtx_pkts"]))
    finally:
        qa.destroy()
        qb.destroy()
        ma.dereg()
        mb.dereg()


def test_srv6_pair(tmp_path):
    """The same engine over a pair in srv6 mode: spray encapsulates every frame (outer
    IPv6 to the peer's SID on the plane), ingress decapsulates; 1 MiB and 64 MiB intact.
    mrc0's MTU is 40 bytes below the planes', so the default payload shrinks with it."""
    p = ep_.Pair(str(tmp_path), mode="srv6")
    try:
        p.up()
        with transport.Endpoint(p.ia) as A, transport.Endpoint(p.ib) as B:
            assert A.payload == transport.default_payload(ep_.MTU - 40)
            qa, qb = ep_.connect(A, B, 0)
            src, dst = bytearray(os.urandom(BIG)), bytearray(BIG)
            ma, mb = A.reg_mr(src), B.reg_mr(dst)
            for i, size in enumerate((1 << 20, BIG)):
                qa.post_write(i, ma, 0, size, mb.addr, mb.rkey, imm=i)
                ca, cb = wait_n(A, 1), wait_n(B, 1, timeout=5)
                assert [(c.wr_id, c.ok) for c in ca] == [(i, True)] and [c.imm for c in cb] == [i]
                assert digest(dst[:size]) == digest(src[:size])
        ca_, cb_ = (json_stats(p.ia), json_stats(p.ib))
        npk = -(-(1 << 20) // A.payload) + -(-BIG // A.payload)
        assert ca_["spray_srv6_encap"] >= npk and cb_["ing_decap"] >= npk
        assert cb_["spray_srv6_encap"] > 0 and ca_["ing_decap"] > 0      # the SACKs too
    finally:
        p.down()


def json_stats(inst):
    import json
    return json.loads(ep_.cli("stats", "--json", "--instance", inst).stdout)["counters"]


def test_qp_counters_in_stats_status_metrics(eps, pair, qp0):
    """Every Endpoint publishes its QPs' engine counters: another process's `mrc-xdp
    stats --json`, `status --json` and the metrics scrape show them (instance, qpn);
    the endpoint's file is gone once it is closed."""
    import json
    import subprocess
    import sys
    qa, _ = qp0
    A, ma, mb = eps["A"], eps["ma"], eps["mb"]
    qa.post_write(77, ma, 0, 1 << 16, mb.addr, mb.rkey)
    assert [c.ok for c in wait_n(A, 1)] == [True]
    A.publish()
    cli = [sys.executable, "-m", "mrc_xdp.cli"]

    def run(*a):
        r = subprocess.run(cli + list(a), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout
    want = qa.stats()["tx_pkts"]
    st = json.loads(run("stats", "-i", pair.ia, "--json"))
    mine = [q for q in st["qps"] if q["qpn"] == qa.qpn and q["pid"] == os.getpid()]
    assert mine and mine[0]["tx_pkts"] == want and mine[0]["state_name"] == "rts", st["qps"]
    status = json.loads(run("status", "-i", pair.ia, "--json"))
    assert any(q["qpn"] == qa.qpn and q["tx_pkts"] == want for q in status[0]["qps"]), status
    assert "engine QPs" in run("stats", "-i", pair.ia)
    m = run("metrics", "--once", "-i", pair.ia)
    from prometheus_client.parser import text_string_to_metric_families
    got = [s.value for f in text_string_to_metric_families(m) for s in f.samples if s.name == "mrc_qp_tx_pkts_total"
           and s.labels == {"mrc_instance": pair.ia, "qpn": "%#x" % qa.qpn, "pid": str(os.getpid())}]
    assert got == [want], [x for x in m.splitlines() if x.startswith("mrc_qp_tx_pkts_total")]
    # a file left by a process that is gone is ignored and removed (closing an endpoint
    # removes its own: tests/test_perf_cli.py::test_qps_from_another_process)
    assert os.path.exists(A._pub.path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(os.path.dirname(A._pub.path), "%d.0.json" % dead.pid)
    with open(stale, "w") as f:
        json.dump({"instance": pair.ia, "pid": dead.pid, "time": 0, "qps": [dict(mine[0], qpn=0xDEAD)]}, f)
    assert not any(q["qpn"] == 0xDEAD for q in transport.published_qps(pair.ia))
    assert not os.path.exists(stale)


def test_forged_nack_outside_window_changes_nothing(eps, pair, qp0):
    """Issue 15 item 5: a NACK with the access-error reason (UNEXP_EVENT, vendor_info 1)
    from the peer's address to the sender's QPN put the QP in error whatever its PSN.
    Now, during a 64 MiB transfer, such NACKs naming PSN 5,000,000 (far outside the sent
    window) change nothing: sent through the fabric, the sender's ingress counts them
    ing_fb_oow and drops them; injected past the datapath, straight into the sender's
    mrc0, its engine ignores them (fb_oow).  The transfer completes intact."""
    from mrc_xdp.datapath.maps import Instance
    qa, qb = qp0
    A, B, ma, mb = eps["A"], eps["B"], eps["ma"], eps["mb"]
    eps["dst"][:] = bytes(BIG)
    forged = wire.nack_frame(ep_.B_ADDR, ep_.A_ADDR, qa.qpn, 0, 5_000_000, 0x12345678,
                             reason=wire.NackReason.UNEXP_EVENT, neth={"vendor_info": 1},
                             smac="02:00:00:00:00:02", dmac="02:00:00:00:00:01")

    def from_fabric():          # B's plane NIC -> A's p0: A's ingress sees it
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
            s.bind(("p0", 0))
            s.send(forged)
    with Instance(pair.ia) as inst:
        oow0 = inst.counters()["ing_fb_oow"]
    before = A.stats()
    qa.post_write(78, ma, 0, BIG, mb.addr, mb.rkey, imm=6)
    for _ in range(10):
        netns.run(pair.b, from_fabric)
        _inject(pair.a, forged)
        time.sleep(0.005)
    ca, cb = wait_n(A, 1), wait_n(B, 1)
    assert [(c.wr_id, c.ok) for c in ca] == [(78, True)] and [c.imm for c in cb] == [6], ca
    assert digest(eps["dst"]) == digest(eps["src"])
    assert qa.stats()["state_name"] == "rts" and qb.stats()["state_name"] == "rts"
    after = A.stats()
    with Instance(pair.ia) as inst:
        oow = inst.counters()["ing_fb_oow"] - oow0
    # the pair trims nothing, so every NACK the engine saw is one of ours: the 10
    # injected into mrc0, not the 10 through the fabric (dropped by ingress)
    assert oow >= 10 and after["rx_nack"] - before["rx_nack"] == 10, (oow, before, after)
    assert after["fb_oow"] - before["fb_oow"] >= 10, after
