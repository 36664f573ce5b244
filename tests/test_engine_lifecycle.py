"""Transport engine lifecycle on the live pair: 1,000 QPs and repeated endpoints leave
nothing behind, an idle engine sleeps, a vanished peer puts the QP in error within the
retry budget, a missing datapath is one clear error."""
import os
import time

import pytest

from mrc_xdp import transport

import engine_pair as ep_

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, AF_XDP, netns)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = ep_.Pair(str(tmp_path_factory.mktemp("englife")))
    try:
        p.up()
        yield p
    finally:
        p.down()


def fds():
    return len(os.listdir("/proc/self/fd"))


def threads():
    return len(os.listdir("/proc/self/task"))


def cpu_ticks_of_new_threads(before: set) -> int:
    total = 0
    for tid in set(os.listdir("/proc/self/task")) - before:
        with open("/proc/self/task/%s/stat" % tid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])      # utime + stime
    return total


def test_endpoint_errors_are_one_line():
    with pytest.raises(transport.TransportError, match="not loaded"):
        transport.Endpoint("no-such-instance-%d" % os.getpid())


def test_thousand_qps_and_idle(pair):
    """1,000 QP pairs created, connected and destroyed (every 50th moves 64 KiB): no QP,
    UMEM frame, fd or thread left; an idle endpoint's thread sleeps."""
    fd0, th0 = fds(), threads()
    tasks0 = set(os.listdir("/proc/self/task"))
    A, B = transport.Endpoint(pair.ia), transport.Endpoint(pair.ib)
    try:
        assert threads() == th0 + 3     # two progress threads, one per-QP counter publisher
        with pytest.raises(transport.TransportError, match="one endpoint per instance"):
            transport.Endpoint(pair.ia)
        free0 = A.stats()["umem_free"]
        src, dst = bytearray(os.urandom(65536)), bytearray(65536)
        ma, mb = A.reg_mr(src), B.reg_mr(dst)
        for i in range(1000):
            qa, qb = ep_.connect(A, B, 0)
            if i % 50 == 0:
                qa.post_write(i, ma, 0, 65536, mb.addr, mb.rkey, imm=i)
                ca = A.cq.wait_blocking(timeout=10)
                cb = B.cq.wait_blocking(timeout=10)
                assert [(c.wr_id, c.ok) for c in ca] == [(i, True)] and [c.imm for c in cb] == [i]
            qa.destroy()
            qb.destroy()
        assert dst == src
        time.sleep(0.1)          # the last completions' frames come back
        for ep in (A, B):
            st = ep.stats()
            assert st["qps"] == 0 and st["umem_free"] == free0, st
        # idle: both progress threads asleep in ppoll (no spinning at 0 load)
        t0 = cpu_ticks_of_new_threads(tasks0)
        time.sleep(1.0)
        idle = cpu_ticks_of_new_threads(tasks0) - t0
        assert idle <= 5, "idle engine threads used %d ticks in 1 s" % idle
    finally:
        A.close()
        B.close()
    assert fds() == fd0 and threads() == th0
    # endpoints opened and closed again and again: the same
    for _ in range(20):
        with transport.Endpoint(pair.ia) as ep:
            ep.create_qp()
    assert fds() == fd0 and threads() == th0


def _map_entries(inst: str) -> dict:
    """Entries of the instance's per-connection maps: hash keys (mrc_rxev: those of the
    run-time ids; the config's connections keep counting what they receive), non-zero
    array rows of mrc_conns, the connections in its state file."""
    from mrc_xdp.datapath import bpfsys, maps
    from mrc_xdp.datapath.shared import const
    from mrc_xdp.transport import conns
    out = {}
    d = maps.pin_dir(inst)
    for n in ("mrc_connidx", "mrc_evidx", "mrc_rxev"):
        with bpfsys.Map.open_pinned(os.path.join(d, n)) as m:
            keys = m.keys_batch()
            if n == "mrc_rxev":
                keys = [k for k in keys                  # (id MRC_MAX_CONNS: no known connection)
                        if len(ep_.CONNS) <= int.from_bytes(k[:4], "little") < const("MRC_MAX_CONNS")]
            out[n] = len(keys)
    with bpfsys.Map.open_pinned(os.path.join(d, "mrc_conns")) as m:
        zero = bytes(m.value_size)
        out["mrc_conns"] = sum(m.lookup(i) != zero for i in range(m.max_entries))
    out["state"] = len(conns.list_(inst))
    return out


def _rows_zero(inst: str, cids) -> list[str]:
    """Array rows of connection ids cids that are not zero (PSN ring, EV slots, counters)."""
    from mrc_xdp.datapath import bpfsys, maps
    from mrc_xdp.datapath.shared import const
    d, ring, slots = maps.pin_dir(inst), const("MRC_PSN_RING"), const("MRC_EV_SLOTS")
    bad = []
    for n, per in (("mrc_psn", ring), ("mrc_evs", slots), ("mrc_evctr", slots)):
        with bpfsys.Map.open_pinned(os.path.join(d, n)) as m:
            for cid in cids:
                for i in range(cid * per, (cid + 1) * per):
                    v = m.lookup(i)
                    if any(x != bytes(m.value_size) for x in (v if isinstance(v, list) else [v])):
                        bad.append("%s[%d]" % (n, i))
                        break
    return bad


def test_1024_qps_at_once(pair):
    """One endpoint with MRC_MAX_CONNS (1024) QPs: every QP a datapath connection (the 4 of
    the config and 1020 added at connect), a 64 KiB Write-with-Immediate posted on every
    one of them before any completes (64 MiB, 20 packets a QP: more than the endpoint's
    4096 TX frames, so QPs wait for frames and take turns), every byte checked; closing
    both endpoints brings fds,
    threads, UMEM frames, datapath map entries and connections back to the baseline."""
    import hashlib
    from mrc_xdp.datapath.shared import const
    n, size = const("MRC_MAX_CONNS"), 65536
    base = {i: _map_entries(i) for i in (pair.ia, pair.ib)}
    fd0, th0 = fds(), threads()
    t0 = time.monotonic()
    A, B = transport.Endpoint(pair.ia), transport.Endpoint(pair.ib)
    try:
        free0 = (A.stats()["umem_free"], B.stats()["umem_free"])
        src, dst = bytearray(os.urandom(n * size)), bytearray(n * size)
        ma, mb = A.reg_mr(src), B.reg_mr(dst)
        qps = [ep_.connect(A, B, k) for k in range(len(ep_.CONNS))]
        for _ in range(n - len(qps)):
            qa, qb = A.create_qp(), B.create_qp()
            qa.connect(qb.local_attrs())
            qb.connect(qa.local_attrs())
            qps.append((qa, qb))
        assert A.stats()["qps"] == n and B.stats()["qps"] == n
        for i in (pair.ia, pair.ib):
            assert _map_entries(i)["state"] == n
        t_open = time.monotonic() - t0
        for k, (qa, _) in enumerate(qps):
            qa.post_write(k, ma, k * size, size, mb.addr + k * size, mb.rkey, imm=k)
        done, imms = {}, set()
        deadline = time.monotonic() + 120
        while (len(done) < n or len(imms) < n) and time.monotonic() < deadline:
            for c in A.cq.wait_blocking(timeout=1, max_n=1024):
                done[c.wr_id] = c.ok
            for c in B.cq.poll(1024):
                assert c.ok, c
                imms.add(c.imm)
        assert len(done) == n and all(done.values()), "%d of %d writes completed" % (len(done), n)
        while len(imms) < n and time.monotonic() < deadline:
            imms.update(c.imm for c in B.cq.wait_blocking(timeout=1, max_n=1024))
        assert imms == set(range(n))
        assert hashlib.sha256(dst).digest() == hashlib.sha256(src).digest()
        assert dst == src
        st = [qa.stats() for qa, _ in qps]
        assert min(x["tx_pkts"] for x in st) >= 1, "a QP sent nothing"
        rtx = (sum(x["rtx_pkts"] for x in st), sum(x["rtx_timeout"] for x in st), sum(x["tx_pkts"] for x in st))
        t_data = time.monotonic() - t0 - t_open
        time.sleep(0.1)             # the last completions' frames come back
        assert (A.stats()["umem_free"], B.stats()["umem_free"]) == free0
    finally:
        A.close()
        B.close()
    t_all = time.monotonic() - t0
    print("1024 QPs: open+connect %.1f s, data %.1f s, all with close %.1f s; resent %d (RTO %d) of %d packets"
          % ((t_open, t_data, t_all) + rtx))
    assert fds() == fd0 and threads() == th0
    for i in (pair.ia, pair.ib):
        assert _map_entries(i) == base[i], i
        # the run-time ids (4 .. n-1): first, middle, last left with all-zero rows
        assert _rows_zero(i, (4, n // 2, n - 1)) == []


def test_pacing_options(pair):
    """Paced by default (cc_pace 1): the window sets the rate (cwnd per min RTT), so it may
    go below one packet (floor payload/16, fair increase payload/8 per RTT); cc_pace=2 is
    the window alone, with its one-packet floor and one-packet fair increase.  A paced QP
    moves data intact."""
    import hashlib
    with transport.Endpoint(pair.ia) as A, transport.Endpoint(pair.ib, cc_pace=2) as B:
        a, b = A.options(), B.options()
        assert (a["cc_pace"], a["cc_min_cwnd"], a["cc_fair_inc"]) == (1, A.payload // 16, A.payload // 8), a
        assert (b["cc_pace"], b["cc_min_cwnd"], b["cc_fair_inc"]) == (2, B.payload, B.payload), b
        qa, qb = ep_.connect(A, B, 3)
        size = 8 << 20
        src, dst = bytearray(os.urandom(size)), bytearray(size)
        ma, mb = A.reg_mr(src), B.reg_mr(dst)
        qa.post_write(5, ma, 0, size, mb.addr, mb.rkey)
        assert [(c.wr_id, c.ok) for c in A.cq.wait_blocking(timeout=30)] == [(5, True)]
        assert hashlib.sha256(dst).digest() == hashlib.sha256(src).digest()


def test_timestamps(pair):
    """timestamps=1: TSETH on every data packet (through spray, ingress and to_engine),
    its tx time reflected in the SACK's CC_STATE and used for RTT samples; the payload
    shrinks by the 4 bytes of TSETH only if it must."""
    import hashlib
    with transport.Endpoint(pair.ia, timestamps=1) as A, transport.Endpoint(pair.ib, timestamps=1) as B:
        assert A.options()["timestamps"] == 1
        qa, qb = ep_.connect(A, B, 3)
        size = 16 << 20
        src, dst = bytearray(os.urandom(size)), bytearray(size)
        ma, mb = A.reg_mr(src), B.reg_mr(dst)
        qa.post_write(3, ma, 0, size, mb.addr, mb.rkey, imm=3)
        ca, cb = A.cq.wait_blocking(timeout=30), B.cq.wait_blocking(timeout=10)
        assert [(c.wr_id, c.ok) for c in ca] == [(3, True)] and [c.imm for c in cb] == [3]
        assert hashlib.sha256(dst).digest() == hashlib.sha256(src).digest()
        st = qa.stats()
        assert st["rtt_ts"] > 0 and st["srtt_ns"] > 0, st


def test_frames_on_the_wire(pair):
    """What the engine puts on mrc0, read on mrc0p with spray detached (then reattached):
    Ethernet | IPv6 | UDP 4791 | BTH | METH | RETH | [ImmDt] | payload | ICRC, as
    wire.py dissects it, with a valid ICRC, RETH on every packet (VA of the packet,
    R_Key, the message's length), ImmDt and AckReq on the last one."""
    import socket
    from mrc_xdp.datapath import bpfsys, maps, netns, wire
    from mrc_xdp.lab import linkmodel as lmod
    ix = netns.run(pair.a, socket.if_nametoindex, "mrc0p")
    spray = bpfsys.obj_get(os.path.join(maps.pin_dir(pair.ia), "prog_spray"))
    rx = netns.run(pair.a, lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x86DD)))
    try:
        rx.bind(("mrc0p", 0))
        rx.settimeout(2)
        lmod.xdp_detach(ix, netns_name=pair.a)
        try:
            with transport.Endpoint(pair.ia) as A:
                qa = A.create_qp(qpn=ep_.CONNS[0][0])
                qa.connect({"addr": ep_.B_ADDR, "qpn": ep_.CONNS[0][1], "start_psn": 0, "mtu": A.payload})
                size = 2 * A.payload + 5
                src = bytearray(os.urandom(size))
                ma = A.reg_mr(src)
                qa.post_write(1, ma, 0, size, 0x7000_0000_0000, 0xABCDE1, imm=0x11223344)
                frames = []
                while len(frames) < 3:
                    f = rx.recv(65536)
                    if len(f) > 100:
                        frames.append(f)
                start = qa.start_psn
        finally:
            lmod.xdp_attach(ix, spray, netns_name=pair.a)
    finally:
        rx.close()
        os.close(spray)
    ops = [wire.Opcode.WRITE_FIRST, wire.Opcode.WRITE_MIDDLE, wire.Opcode.WRITE_LAST_IMM]
    for k, f in enumerate(frames):
        pkt = wire.parse(f)
        assert wire.frame_icrc_ok(f)
        assert pkt[wire.UDP].dport == 4791 and pkt[wire.IPv6].dst == ep_.B_ADDR
        bth, reth = pkt[wire.BTH], pkt[wire.RETH]
        assert (bth.opcode, bth.dqpn, bth.psn) == (ops[k], ep_.CONNS[0][1], (start + k) & 0xFFFFFF)
        assert bth.ackreq == (k == 2)
        assert (reth.va, reth.rkey, reth.dlen) == (0x7000_0000_0000 + k * A.payload, 0xABCDE1, size)
        if k == 2:
            assert pkt[wire.ImmDt].imm == 0x11223344
    payload = b""
    for i, f in enumerate(frames):      # after RETH: [ImmDt] payload pad ICRC
        pkt = wire.parse(f)
        rest = bytes(pkt[wire.RETH].payload)
        payload += rest[(4 if i == 2 else 0):len(rest) - 4 - pkt[wire.BTH].padcnt]
    assert payload == src


def test_peer_vanishes(pair):
    """B's datapath is unloaded mid-transfer: A's QP reaches the error state within the
    retry budget (every outstanding WR completes with an error), nothing hangs; then B's
    namespace is deleted under a second transfer, with the same outcome."""
    opts = dict(rto_min_us=2000, rto_max_us=100000, retry_limit=6)
    budget = sum(min(2 * 2 ** i, 100) for i in range(opts["retry_limit"] + 1)) / 1000.0
    A = transport.Endpoint(pair.ia, **opts)
    B = transport.Endpoint(pair.ib)
    size = 64 << 20
    src, dst = bytearray(size), bytearray(size)
    ma, mb = A.reg_mr(src), B.reg_mr(dst)
    try:
        qa, qb = ep_.connect(A, B, 1)
        n = 400                  # 400 x 16 MiB: many seconds of work, the unload lands midway
        for i in range(n):
            qa.post_write(i, ma, 0, 16 << 20, mb.addr, mb.rkey)
        time.sleep(0.05)
        t0 = time.monotonic()
        pair.unload("b")             # a CLI run: the datapath goes early in it
        t_unloaded = time.monotonic()
        got = []
        while len(got) < n and time.monotonic() - t_unloaded < 60:
            got += A.cq.wait_blocking(timeout=1)
        st = qa.stats()
        assert len(got) == n, got
        assert [c.wr_id for c in got] == list(range(n))
        failed = [c for c in got if not c.ok]
        assert failed and failed[0].status == transport.WcStatus.RETRY_EXC_ERR, got
        assert all(c.status == transport.WcStatus.WR_FLUSH_ERR for c in failed[1:]), got
        assert all(c.ok for c in got[:n - len(failed)])
        assert qa.state == transport.QpState.ERROR and st["timeouts"] >= opts["retry_limit"] + 1
        dt = time.monotonic() - t0
        # the unload, then the budget (backoff from rto_min, capped at rto_max), plus slack
        assert dt < (t_unloaded - t0) + budget + 2.0, (dt, budget)
        print("peer unloaded: QP error %.2f s after the unload began (unload took %.2f s; retry "
              "budget %.2f s), %d timeouts" % (dt, t_unloaded - t0, budget, st["timeouts"]))
        with pytest.raises(transport.TransportError):
            qa.post_write(9, ma, 0, 1, mb.addr, mb.rkey)
        qa.destroy()
        qb.destroy()
    finally:
        B.close()

    # B's namespace goes away (its veths with it) under a running transfer
    pair.load("b")
    B = transport.Endpoint(pair.ib)
    mb = B.reg_mr(dst)
    qa, qb = ep_.connect(A, B, 2)
    qa.post_write(1, ma, 0, size, mb.addr, mb.rkey)
    time.sleep(0.02)
    B.close()
    pair.unload("b")
    ep_.netns.delete(pair.b)
    got = A.cq.wait_blocking(timeout=budget + 5)
    assert [c.status for c in got] == [transport.WcStatus.RETRY_EXC_ERR] or \
        (got and got[0].ok), got        # ok only if it finished before B went away
    A.close()
