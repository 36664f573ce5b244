"""Transport engine, IB-size packets: AF_XDP multi-buffer (XDP_USE_SG) on the live pair.

The pair's veths are raised to MTU 4200 once the frags-aware programs are attached
(tests/engine_pair.py), so an endpoint's default payload is 4096 bytes, InfiniBand's
largest path MTU: a data frame of 4190 bytes does not fit one 4096-byte UMEM frame
(an RX frame holds 3840), and goes as a chain of two descriptors (XDP_PKT_CONTD) each
way.  The same pair runs the single-buffer path at payload 1408.  Every transfer is
checked byte for byte; loss and trimming come from the lab's link model (real XDP,
frags-aware) on both hosts' plane NICs.
"""
import hashlib
import json
import os
import socket

import pytest

from mrc_xdp import transport
from mrc_xdp.datapath import netns, wire
from mrc_xdp.transport import endpoint as tep

import engine_pair as ep_

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, AF_XDP, netns)")

BIG = 24 << 20
RX_FRAME = tep.FRAME_SIZE - tep.RX_HEADROOM       # what one RX frame holds (3840)


class Env:
    """The pair, the link model in front of ingress, and one endpoint per host at a
    given payload (reopened when a test asks for another)."""

    def __init__(self, pair, lk):
        self.pair, self.lk = pair, lk
        self.src = bytearray(os.urandom(BIG))
        self.dst = bytearray(BIG)
        self.key = None
        self.A = self.B = None

    def eps(self, pa, pb=None, **opts):
        key = (pa, pb, tuple(sorted(opts.items())))
        if key != self.key:
            self.close()
            self.A = transport.Endpoint(self.pair.ia, mtu=pa, **opts)
            self.B = transport.Endpoint(self.pair.ib, mtu=pb, **opts)
            self.ma, self.mb = self.A.reg_mr(self.src), self.B.reg_mr(self.dst)
            self.key = key
        return self.A, self.B

    def close(self):
        for e in (self.A, self.B):
            if e is not None:
                e.close()
        self.A = self.B = self.key = None



@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # loss_thresh: random loss is not a path failure (see test_engine_loss.py)
    p = ep_.Pair(str(tmp_path_factory.mktemp("engsg")), mtu=ep_.MTU_IB, extra="loss_thresh = 1000000\n")
    lk, e = None, None
    try:
        p.up()
        lk = ep_.Links(p)
        e = Env(p, lk)
        yield e
    finally:
        if e is not None:
            e.close()
        if lk is not None:
            lk.close()
        p.down()


def write(env, k, size, off=0, imm=1, timeout=60):
    """One Write-with-Immediate of size bytes from src[off:] on connection k; every byte checked."""
    A, B = env.A, env.B
    qa, qb = ep_.connect(A, B, k)
    try:
        env.dst[:size] = bytes(size)
        qa.post_write(k, env.ma, off, size, env.mb.addr, env.mb.rkey, imm=imm)
        ca = A.cq.wait_blocking(timeout=timeout)
        cb = B.cq.wait_blocking(timeout=10)
        sa, sb = qa.stats(), qb.stats()
        assert [(c.wr_id, c.status) for c in ca] == [(k, transport.WcStatus.SUCCESS)], (ca, sa)
        assert [(c.imm, c.byte_len) for c in cb] == [(imm, size)], (cb, sb)
        assert hashlib.sha256(env.dst[:size]).digest() == hashlib.sha256(env.src[off:off + size]).digest()
        assert qa.payload == qb.payload
        return qa.payload, sa, sb
    finally:
        qa.destroy()
        qb.destroy()


def test_paths(env):
    """Payload 4096 by default at MTU 4200: the multi-buffer path, two frames per packet
    each way; payload 1408 the single-buffer path; multi-buffer off (sg=1) the largest
    payload one frame holds, and a payload that needs it refused with a clear error."""
    A, B = env.eps(None)
    st = A.stats()
    assert A.payload == 4096 and B.payload == 4096
    assert (st["sg"], st["tx_frames_pkt"], st["rx_frames_pkt"], st["sg_refused"]) == (1, 2, 2, 0)
    assert A.path.startswith("multi-buffer"), A.path
    A, B = env.eps(1408)
    st = A.stats()
    assert (A.payload, st["sg"], st["tx_frames_pkt"]) == (1408, 0, 1) and A.path.startswith("single-buffer")
    A, B = env.eps(None, sg=tep.SG_OFF)
    assert A.payload == tep.single_frame_payload() == 3712 and A.stats()["sg"] == 0
    env.close()
    with pytest.raises(transport.TransportError, match=r"multi-buffer \(sg\) is off"):
        transport.Endpoint(env.pair.ia, mtu=4096, sg=tep.SG_OFF)
    # sg=2 binds with XDP_USE_SG even for a payload of one frame
    A, B = env.eps(1408, sg=tep.SG_ON)
    assert A.stats()["sg"] == 1 and A.stats()["tx_frames_pkt"] == 1


SIZES = [1, 4095, 4096, 4097, 3 * 4096 + 5, (1 << 20) + 3, BIG - 64]


@pytest.mark.parametrize("payload", [4096, 1408])
@pytest.mark.parametrize("size", SIZES)
def test_write(env, payload, size):
    """Writes of 1 B .. 24 MiB at payload 4096 (multi-buffer) and 1408 (single): every
    byte placed; at 4096 every full packet arrived as a chain of frames."""
    A, B = env.eps(payload)
    off = 61 if size < BIG - 64 else 64        # an unaligned source too
    b0 = B.stats()
    pl, sa, sb = write(env, size % 4, size, off=off, imm=size & 0xFFFF)
    b1 = B.stats()
    assert pl == payload
    full = size // payload                     # packets of a whole payload: frames > RX_FRAME at 4096
    if payload == 4096:
        assert b1["rx_mb"] - b0["rx_mb"] >= full, (b0, b1)
        assert b1["rx_mb_frames"] - b0["rx_mb_frames"] >= 2 * full
    else:
        assert b1["rx_mb"] == b0["rx_mb"] == 0
    for k in ("bad_icrc", "truncated", "rx_mb_bad", "xsk_rx_dropped"):
        assert b1[k] == b0[k], (k, b0, b1)
    assert sb["rx_pkts"] >= -(-size // payload)


def test_mixed_payloads_negotiated(env):
    """A at 4096 (multi-buffer), B at 1408 (single-buffer): each QP takes the smaller, as
    the bootstrap's QP attributes do; B never sees a chain."""
    A, B = env.eps(4096, 1408)
    assert A.stats()["sg"] == 1 and B.stats()["sg"] == 0
    pl, sa, sb = write(env, 0, 5 << 20)
    assert pl == 1408 and B.stats()["rx_mb"] == 0 and B.stats()["xsk_rx_dropped"] == 0


@pytest.mark.parametrize("payload", [4096, 1408])
def test_random_loss(env, payload):
    """1% random loss on every plane link, both directions: 16 MiB intact, the losses
    resent selectively (multi-buffer frames lost whole)."""
    env.eps(payload)
    env.lk.faults({"loss_ppm": 10000}, {"loss_ppm": 10000})
    try:
        pl, sa, sb = write(env, 1, 16 << 20, timeout=120)
        lost = env.lk.counters("b")["drop_loss"]
    finally:
        env.lk.faults({}, {})
    print("payload %d, 1%% loss: %d packets, %d dropped, %d resent" % (pl, sa["tx_pkts"] - sa["rtx_pkts"],
                                                                      lost, sa["rtx_pkts"]))
    assert lost > 0 and sa["rtx_pkts"] >= lost * 0.5 and sa["rtx_pkts"] <= 2 * lost + 64, (lost, sa)


def test_trim_multibuffer(env):
    """The link model trims multi-buffer frames (the frags shrunk away, headers kept):
    NACK TRIMMED, resent at once; 8 MiB intact."""
    env.eps(4096)
    env.lk.faults({"rate_bps": 400_000_000, "ecn_bytes": 20000, "trim_bytes": 60000, "ecn": True, "trim": True})
    try:
        pl, sa, sb = write(env, 2, 8 << 20, timeout=120)
        lc = env.lk.counters("b")
    finally:
        env.lk.faults({}, {})
    print("trim at 4096: trimmed %d, nacks %d, resent %d" % (lc["trimmed"], sa["nacks_rx_trim"], sa["rtx_nack_trim"]))
    assert lc["trimmed"] > 0 and sa["nacks_rx_trim"] > 0 and sa["rtx_nack_trim"] > 0


def _frame(qb, mb, psn, payload, imm=None):
    op = wire.Opcode.WRITE_ONLY_IMM if imm is not None else wire.Opcode.WRITE_ONLY
    return bytearray(wire.data_frame(ep_.A_ADDR, ep_.B_ADDR, qb.qpn, psn, payload, opcode=op, va=mb.addr,
                                     rkey=mb.rkey, imm=imm, smac="02:00:00:00:00:01",
                                     dmac="02:00:00:00:00:02"))


def test_chains_through_the_receive_path(env):
    """Frames fed to the engine's receive code as RX descriptors (mrc_eng_rx_inject, the
    code rx_batch runs on the ring): a chain is placed whole; a truncated chain (the IPv6
    length says more than its frames hold), one whose first frame lacks the headers, and
    one whose second frame is corrupt are counted and dropped, nothing placed; a chain
    cut at the end of a batch is left for the next; a chain longer than a batch is
    dropped to its end."""
    A, B = env.eps(4096)
    qa, qb = ep_.connect(A, B, 3)
    try:
        mb = env.mb
        cack = qb.stats()["rcv_cack"]
        pay = os.urandom(5000)

        def st():
            return B.stats()

        def check(d0, **want):
            d1 = st()
            got = {k: d1[k] - d0[k] for k in ("rx_data", "rx_mb", "truncated", "rx_mb_bad", "bad_icrc")}
            assert got == dict({"rx_data": 0, "rx_mb": 0, "truncated": 0, "rx_mb_bad": 0, "bad_icrc": 0},
                               **want), got

        def chain(f, cuts):
            parts, last = [], 0
            for c in cuts + [len(f)]:
                parts.append((bytes(f[last:c]), c != len(f)))
                last = c
            return parts

        env.dst[:8192] = bytes(8192)
        # truncated: the last frame's tail missing (IPv6 length says 40 bytes more)
        f = _frame(qb, mb, cack, pay, imm=7)
        s0 = st()
        assert B._rx_inject(chain(f[:-40], [RX_FRAME])) == 2
        check(s0, rx_mb=1, truncated=1)
        # the first frame too short to hold the headers
        s0 = st()
        assert B._rx_inject(chain(f, [60, RX_FRAME])) == 3
        check(s0, rx_mb_bad=1)
        # a corrupt byte in the second frame: the ICRC runs over every frame
        bad = bytearray(f)
        bad[RX_FRAME + 100] ^= 0x10
        s0 = st()
        assert B._rx_inject(chain(bad, [RX_FRAME])) == 2
        check(s0, rx_mb=1, bad_icrc=1)
        assert env.dst[:8192] == bytes(8192)
        # a chain cut at the end of a short batch: left in the ring, nothing read
        s0 = st()
        assert B._rx_inject([(bytes(f[:RX_FRAME]), True)]) == 0
        check(s0)
        # a chain longer than a batch: dropped, and its rest as it comes
        s0 = st()
        assert B._rx_inject([(bytes(f[:RX_FRAME]), True)] * 64) == 64
        assert B._rx_inject([(bytes(f[RX_FRAME:]), False)]) == 1
        check(s0, rx_mb_bad=1)
        # the same packet whole, in three frames: placed, completed
        s0 = st()
        assert B._rx_inject(chain(f, [200, RX_FRAME])) == 3
        check(s0, rx_mb=1, rx_data=1)
        assert bytes(env.dst[:5000]) == pay
        assert [(c.imm, c.byte_len) for c in B.cq.wait_blocking(timeout=5)] == [(7, 5000)]
    finally:
        qa.destroy()
        qb.destroy()


def test_live_chain_bad_icrc(env):
    """A 4000-byte-payload frame (4098 bytes: more than an RX frame holds, within mrc0p's
    MTU) with one byte flipped past the first frame, sent into
    B's mrc0 from the fabric side: to_engine (frags-aware) hands it to the socket as a
    chain of two frames, and the engine's ICRC over both catches it."""
    A, B = env.eps(4096)
    qa, qb = ep_.connect(A, B, 3)
    try:
        f = _frame(qb, env.mb, (qb.stats()["rcv_cack"] + 5) & 0xFFFFFF, os.urandom(4000))
        assert RX_FRAME < len(f) <= ep_.MTU_IB + 14
        f[RX_FRAME + 100] ^= 0x01
        s0 = B.stats()

        def tx():
            with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
                s.bind(("mrc0p", 0))
                for _ in range(5):
                    s.send(bytes(f))
        netns.run(env.pair.b, tx)
        import time
        deadline = time.monotonic() + 5
        while B.stats()["bad_icrc"] - s0["bad_icrc"] < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        s1 = B.stats()
        assert s1["bad_icrc"] - s0["bad_icrc"] == 5 and s1["rx_mb"] - s0["rx_mb"] == 5, (s0, s1)
        assert s1["rx_data"] == s0["rx_data"]
    finally:
        qa.destroy()
        qb.destroy()


def test_large_payloads(tmp_path):
    """Per-endpoint payloads above 4096 on a pair at MTU 33000 (a software-only path):
    8192 (3 frames per packet) and 32768 (9 frames), Writes of 1 B .. 8 MiB intact; a
    payload the mrc0 MTU cannot carry is refused at open."""
    p = ep_.Pair(str(tmp_path), mtu=33000)
    try:
        p.up()
        src, dst = bytearray(os.urandom(8 << 20)), bytearray(8 << 20)
        for pl, frames in ((8192, 3), (32768, 9)):
            with transport.Endpoint(p.ia, mtu=pl) as A, transport.Endpoint(p.ib, mtu=pl) as B:
                st = A.stats()
                assert (A.payload, st["sg"], st["tx_frames_pkt"], st["rx_frames_pkt"]) == (pl, 1, frames, frames)
                qa, qb = ep_.connect(A, B, 0)
                ma, mb = A.reg_mr(src), B.reg_mr(dst)
                for i, size in enumerate((1, pl - 1, pl + 1, 3 * pl + 7, (1 << 20) + 3, 8 << 20)):
                    dst[:size] = bytes(size)
                    qa.post_write(i, ma, 0, size, mb.addr, mb.rkey, imm=i)
                    ca, cb = A.cq.wait_blocking(timeout=30), B.cq.wait_blocking(timeout=10)
                    assert [(c.wr_id, c.ok) for c in ca] == [(i, True)] and [c.imm for c in cb] == [i], (pl, size)
                    assert dst[:size] == src[:size], (pl, size)
                sb = B.stats()
                assert sb["rx_mb"] >= (8 << 20) // pl and sb["bad_icrc"] == 0 and sb["rx_mb_bad"] == 0
        with pytest.raises(transport.TransportError, match="MTU"):
            transport.Endpoint(p.ia, mtu=40000)
    finally:
        p.down()


@pytest.mark.parametrize("payload", [4096, 1408])
def test_send_without_copy_from_umem_mr(env, payload):
    """Issue 20 item 3: a memory region inside the UMEM (Endpoint(umem_mr=...),
    ep.alloc_mr): every data packet goes as a header frame, descriptors pointing at the
    payload in place, and a trailer frame (tx_inplace counts them), resends too (1% loss);
    1 B .. 16 MiB at any offset intact; an ordinary buffer on the same endpoint still goes
    by copy; the region's space comes back at dereg."""
    env.close()
    size = 16 << 20
    A = transport.Endpoint(env.pair.ia, mtu=payload, umem_mr=size + (1 << 20))
    B = transport.Endpoint(env.pair.ib, mtu=payload)
    try:
        assert A.stats()["sg"] == 1
        data = os.urandom(size)
        ma = A.alloc_mr(size + 4096)
        ma.buf[:size] = data
        mb = B.reg_mr(env.dst)
        qa, qb = ep_.connect(A, B, 0)
        for i, (n, off) in enumerate(((1, 0), (payload - 1, 5), (payload + 1, 4093), (300001, 3), (size, 0))):
            env.dst[:n] = bytes(n)
            qa.post_write(i, ma, off, n, mb.addr, mb.rkey, imm=i)
            ca, cb = A.cq.wait_blocking(timeout=30), B.cq.wait_blocking(timeout=10)
            assert [(c.wr_id, c.ok) for c in ca] == [(i, True)] and [c.imm for c in cb] == [i]
            assert bytes(env.dst[:n]) == data[off:off + n], (n, off)
        st = qa.stats()
        assert A.stats()["tx_inplace"] == st["tx_pkts"] > 0 and A.stats()["xsk_tx_invalid"] == 0
        # under loss: resends go in place too
        env.lk.faults({"loss_ppm": 10000}, {"loss_ppm": 10000})
        try:
            env.dst[:size] = bytes(size)
            qa.post_write(9, ma, 0, size, mb.addr, mb.rkey, imm=9)
            ca, cb = A.cq.wait_blocking(timeout=60), B.cq.wait_blocking(timeout=10)
        finally:
            env.lk.faults({}, {})
        assert [c.ok for c in ca] == [True] and bytes(env.dst[:size]) == data
        st = qa.stats()
        assert st["rtx_pkts"] > 0 and A.stats()["tx_inplace"] == st["tx_pkts"]
        # an ordinary buffer goes by copy
        before = A.stats()["tx_inplace"]
        mo = A.reg_mr(env.src)
        qa.post_write(10, mo, 0, 1 << 20, mb.addr, mb.rkey)
        assert [c.ok for c in A.cq.wait_blocking(timeout=30)] == [True]
        assert bytes(env.dst[:1 << 20]) == bytes(env.src[:1 << 20]) and A.stats()["tx_inplace"] == before
        qa.destroy()
        qb.destroy()
        with pytest.raises(transport.TransportError, match="no room"):
            A.alloc_mr(2 << 20)
        ma.dereg()
        A.alloc_mr(size).dereg()        # the space came back
    finally:
        A.close()
        B.close()
    # the space is unmapped once the endpoint is closed and its regions dropped
    import gc
    base = A._umem.addr
    del ma, mo, qa, qb, A
    gc.collect()

    def mapped(addr):
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= addr < hi:
                    return True
        return False
    assert not mapped(base)


def test_lab_srv6_at_ib_mtu():
    """The netns lab in srv6 mode with mtu 4240 / app_mtu 4200 (the 40-byte outer header
    included): made at 3506, raised once the frags-aware programs are attached; h0 -> h2
    (two switches per path) moves 8 MiB at payload 4096, multi-buffer, intact."""
    import uuid
    from mrc_xdp.lab import fabric, hosts, topology
    d = topology.read_toml(topology.DEFAULT_TOPOLOGY, "topology", topology.TopologyError)
    d.update(mode="srv6", mtu=4240, app_mtu=4200)
    prefix = "sgl%s-" % uuid.uuid4().hex[:4]
    eps = {}
    try:
        st = fabric.up(topology.from_dict(d), prefix=prefix, hosts_hook=hosts.fabric_hook)
        assert st["complete"]
        for h in ("h0", "h2"):
            eps[h] = transport.Endpoint(prefix + h)
        A, B = eps["h0"], eps["h2"]
        assert A.payload == 4096 and A.stats()["sg"] == 1, A.path
        qa, qb = A.create_qp(), B.create_qp()
        qa.connect(qb.local_attrs())
        qb.connect(qa.local_attrs())
        src, dst = bytearray(os.urandom(8 << 20)), bytearray(8 << 20)
        ma, mb = A.reg_mr(src), B.reg_mr(dst)
        qa.post_write(1, ma, 0, len(src), mb.addr, mb.rkey, imm=3)
        ca, cb = A.cq.wait_blocking(timeout=60), B.cq.wait_blocking(timeout=10)
        assert [c.ok for c in ca] == [True] and [c.imm for c in cb] == [3] and dst == src
        assert qa.payload == 4096 and B.stats()["rx_mb"] >= (8 << 20) // 4096
        qa.destroy()
        qb.destroy()
    finally:
        for e in eps.values():
            e.close()
        fabric.down(prefix, unload_hosts=hosts.unload_all)


def test_kernel_without_multibuffer_falls_back(env, monkeypatch):
    """A kernel that refuses XDP_USE_SG (before 6.6: EINVAL; simulated here by the engine's
    test switch MRC_ENG_TEST_REFUSE_SG): with sg auto the endpoint takes the single-buffer
    path with the largest one-frame payload and says why; with the 4096 payload asked
    for explicitly (sg on) it fails saying so.  Transfers still run, at 3712."""
    env.close()
    monkeypatch.setenv("MRC_ENG_TEST_REFUSE_SG", "1")
    A, B = env.eps(None)
    st = A.stats()
    assert (A.payload, st["sg"], st["sg_refused"]) == (tep.single_frame_payload(), 0, 22), st
    assert "refused XDP_USE_SG" in A.path and A.path.startswith("single-buffer"), A.path
    pl, sa, sb = write(env, 0, (3 << 20) + 11)
    assert pl == 3712 and B.stats()["rx_mb"] == 0
    env.close()
    with pytest.raises(transport.TransportError, match="multi-buffer .XDP_USE_SG. refused"):
        transport.Endpoint(env.pair.ia, mtu=4096)


def test_bootstrap_negotiates_payload():
    """Over the bootstrap (the CLI's write-bw on a live pair at MTU 9000): a client asking
    for 8192 against a server at its default (4096) moves 4096-byte packets; both asking
    for 8192 move 8192-byte ones; every byte placed."""
    import subprocess
    import sys
    from perf_pair import B_CTL, make_pair
    gen = make_pair("sg", mtu=9000)
    pair = next(gen)
    try:
        cli = [sys.executable, "-m", "mrc_xdp.cli"]
        for server_mtu, want in ((None, 4096), (8192, 8192)):
            port = str(21000 + (os.getpid() + want) % 2000)
            srv = subprocess.Popen(cli + ["write-bw", "-i", pair["b"], "--bind", B_CTL, "--port", port, "--json"]
                                   + (["--mtu", str(server_mtu)] if server_mtu else []),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                cl = subprocess.run(cli + ["write-bw", B_CTL, "-i", pair["a"], "--port", port, "--json",
                                           "--mtu", "8192", "--size", str(1 << 20), "--iters", "20"],
                                    capture_output=True, text=True, timeout=120)
                so, se = srv.communicate(timeout=30)
            finally:
                if srv.poll() is None:
                    srv.kill()
            assert cl.returncode == 0 and srv.returncode == 0, (cl.stderr, se)
            c, s = json.loads(cl.stdout.splitlines()[-1]), json.loads(so.splitlines()[-1])
            st = c["qp_stats"]
            assert s["server_qp_stats"]["rx_bytes"] == 20 << 20
            # packets of the negotiated payload: 256 per 1 MiB at 4096, 128 at 8192
            assert st["tx_pkts"] - st["rtx_pkts"] == 20 * (1 << 20) // want, (want, st)
    finally:
        gen.close()


def test_status_shows_the_path(env):
    """`mrc-xdp status` (another process) shows which path each endpoint's QPs took, from
    the counters every Endpoint publishes; --json has it as engine_path."""
    A, B = env.eps(None)
    qa, qb = ep_.connect(A, B, 1)
    try:
        A.publish()
        out = ep_.cli("status", "-i", env.pair.ia).stdout
        assert "engine multi-buffer (XDP_USE_SG, 2 frames per packet" in out, out
        js = json.loads(ep_.cli("status", "-i", env.pair.ia, "--json").stdout)
        assert any(q["qpn"] == qa.qpn and q["engine_path"].startswith("multi-buffer") for q in js[0]["qps"]), js
    finally:
        qa.destroy()
        qb.destroy()
