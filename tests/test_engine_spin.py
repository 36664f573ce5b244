"""The engine's spin after work (Endpoint spin_us) and the caller's spin for a completion
(CQ.wait_blocking(spin_us=...)) on the live pair: the option is validated, spin 0 is the
old behaviour (no spin, every post wakes the thread through its eventfd), the default
spins, and a caller that spins keeps the CQ's eventfd readable while completions are
pending.  No timing is asserted: counters and completions only."""
import os
import select
import threading

import pytest

from mrc_xdp import transport

import engine_pair as ep_

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, AF_XDP, netns)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = ep_.Pair(str(tmp_path_factory.mktemp("engspin")))
    try:
        p.up()
        yield p
    finally:
        p.down()


def ping_pong(A, B, qa, qb, n, spin_us=0):
    """n 8-byte Write-with-Immediate round trips A -> B -> A; each side waits for the
    other's message (its own send completions come along)."""
    sa, sb = bytearray(8), bytearray(8)
    ma, mb = A.reg_mr(sa), B.reg_mr(sb)

    def recv(ep, i):
        for _ in range(1000):
            got = ep.cq.wait_blocking(timeout=10, spin_us=spin_us)
            assert got and all(c.ok for c in got), got
            if any(c.imm == i for c in got):
                return
        raise AssertionError("no receive completion %d" % i)
    for i in range(n):
        qa.post_write(i, ma, 0, 8, mb.addr, mb.rkey, imm=i)
        recv(B, i)
        qb.post_write(i, mb, 0, 8, ma.addr, ma.rkey, imm=i)
        recv(A, i)


@pytest.mark.parametrize("bad", [-1, 10001, 1 << 32, "50", 2.5, True])
def test_spin_us_validated(pair, bad):
    with pytest.raises(transport.TransportError) as ei:
        transport.Endpoint(pair.ia, spin_us=bad)
    msg = str(ei.value)
    assert "spin_us" in msg and "0 (off) .. 10000" in msg and "\n" not in msg


def test_spin_default_and_off(pair):
    with transport.Endpoint(pair.ia) as A:
        assert A.options()["spin_us"] == transport.endpoint.SPIN_DEFAULT_US == 0
    with transport.Endpoint(pair.ia, spin_us=0) as A:
        assert A.options()["spin_us"] == 0
    with transport.Endpoint(pair.ia, spin_us=10000) as A:
        assert A.options()["spin_us"] == 10000


def test_spin_off_is_the_old_loop(pair):
    """spin_us=0: the thread never spins, and every post writes the eventfd (as before
    the spin existed); nobody receives in a caller's thread."""
    with transport.Endpoint(pair.ia, spin_us=0) as A, transport.Endpoint(pair.ib, spin_us=0) as B:
        qa, qb = ep_.connect(A, B, 0)
        ping_pong(A, B, qa, qb, 20)
        for ep in (A, B):
            st = ep.stats()
            assert (st["spin_hits"], st["spin_misses"], st["spin_yields"], st["spin_ns"]) == (0, 0, 0, 0), st
            assert st["spin_limit_ns"] == 0 and st["caller_rx"] == 0, st
            assert st["post_wakeups"] == 20, st


def test_spin_on_moves_data(pair):
    """Spin on (50 us, write-lat's): the thread spun after its work (the first spin always
    runs: the limit starts at spin_us), and round trips complete; a caller spinning for
    its completions too (it may receive frames itself) changes nothing in what arrives."""
    with transport.Endpoint(pair.ia, spin_us=50) as A, transport.Endpoint(pair.ib, spin_us=50) as B:
        qa, qb = ep_.connect(A, B, 1)
        ping_pong(A, B, qa, qb, 20)
        ping_pong(A, B, qa, qb, 20, spin_us=200)
        for ep in (A, B):
            st = ep.stats()
            assert st["spin_hits"] + st["spin_misses"] + st["spin_yields"] >= 1, st
            assert st["spin_ns"] > 0 and 0 <= st["spin_limit_ns"] <= 50_000, st
        for ep, q in ((A, qa), (B, qb)):      # the last write's SACK may still be on its way
            for _ in range(100):
                if q.stats()["wr_done"] == 40:
                    break
                ep.cq.wait_blocking(timeout=0.1)
            assert q.stats()["wr_done"] == 40 and q.stats()["wr_error"] == 0


def test_cq_spin_keeps_the_eventfd(pair):
    """Completions pushed while a caller spins write no eventfd; the caller's last poll
    restores it: while any completion is pending the CQ's fd is readable, and once all
    are taken it is not."""
    with transport.Endpoint(pair.ia, spin_us=50) as A, transport.Endpoint(pair.ib, spin_us=50) as B:
        qa, qb = ep_.connect(A, B, 2)
        src, dst = bytearray(os.urandom(4096)), bytearray(4096)
        ma, mb = A.reg_mr(src), B.reg_mr(dst)

        def post():
            for i in range(4):
                qa.post_write(i, ma, i * 1024, 1024, mb.addr + i * 1024, mb.rkey, imm=i)
        t = threading.Timer(0.002, post)
        t.start()
        got = B.cq.wait_blocking(timeout=10, max_n=1, spin_us=10000)
        t.join()
        assert len(got) == 1 and got[0].imm == 0 and got[0].ok
        imms = [0]
        for _ in range(3):
            r, _, _ = select.select([B.cq], [], [], 10)
            assert r, "completions pending (%s taken) but the CQ's eventfd is not readable" % imms
            imms += [c.imm for c in B.cq.poll(1)]
        assert imms == [0, 1, 2, 3]
        assert select.select([B.cq], [], [], 0)[0] == []
        assert dst == src


@pytest.mark.parametrize("bad", [-1, 10001])
def test_cq_spin_validated(pair, bad):
    with transport.Endpoint(pair.ia) as A:
        with pytest.raises(transport.TransportError, match="spin_us"):
            A.cq.wait_blocking(timeout=0.01, spin_us=bad)


def test_cq_spin_backs_off_when_empty(pair):
    """A caller's spin that comes back empty makes the next waits skip theirs (1, then 3,
    7, ... 63): a caller whose completions are far away stops paying for spins."""
    with transport.Endpoint(pair.ia) as A:
        assert A.cq.wait_blocking(timeout=0.005, spin_us=100) == []     # spins, empty
        assert A.stats()["caller_skipped"] == 0
        assert A.cq.wait_blocking(timeout=0.005, spin_us=100) == []     # skips
        assert A.stats()["caller_skipped"] == 1
        for _ in range(4):                                              # spins, then skips 3
            A.cq.wait_blocking(timeout=0.001, spin_us=100)
        assert A.stats()["caller_skipped"] == 4
