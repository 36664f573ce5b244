"""perftest-style tools over the transport engine: write-bw, write-lat, send, recv.

The commands RDMA users know (ib_write_bw / ib_write_lat): the server runs without a
peer argument, the client names the server's control address.  QP attributes (QPN,
start PSN, MR address, length and R_Key, MTU, MRC address) go over the TCP bootstrap
(mrc_xdp.transport.bootstrap, port 18515); the data goes over MRC.  A QP's connection is added to
the datapath's maps by QP.connect (mrc_xdp.transport.conns) when the instance does not list it,
and removed when the QP is destroyed.

Library functions (``write_bw_client``, ``write_bw_server``, ``write_lat_*``,
``send_file``, ``recv_file``) return result dicts; the CLI prints them as the familiar
tables or, with --json, as one JSON line.
"""
from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import stat
import sys
import time

from mrc_xdp.transport import bootstrap as bs

DEFAULT_SIZE = 65536
MAX_QPS = bs.MAX_QPS  # connections per datapath instance are MRC_MAX_CONNS (1024), a few are taken
CHUNK = 4 << 20       # send/recv: bytes per RDMA Write
MAX_INFLIGHT_BYTES = 32 << 20
# the engine counters write-lat reports (each side's): how the round trips were waited for
ENGINE_LAT_STATS = ("loops", "sleeps", "spin_hits", "spin_misses", "spin_ns", "spin_limit_ns", "post_wakeups",
                    "caller_rx", "caller_wakeups", "caller_preempted", "caller_skipped", "spin_yields",
                    "spin_preempted")
# write-lat: the caller's spin for each completion (--cq-spin-us), receiving frames itself
# (measured, bench_lat at load 3.3-3.6: round trip p50 21-24 us with it and the engine's
# spin, 60-119 us with neither, 100-132 with the engine's spin alone)
CQ_SPIN_DEFAULT_US = 50
LAT_SPIN_US = 50            # write-lat's engine spin (the engine's own default is off)


class PerfError(RuntimeError):
    """One line: what failed, what to do."""


def _transport():
    from mrc_xdp import transport
    return transport


# ------------------------------------------------------------------ per-QP counters for other processes

QP_STATS_DIR = "/run/mrc-xdp/qps"


def published_qps(instance: str | None = None) -> list[dict]:
    """Per-QP counters published by every live transport.Endpoint (of one instance, or
    all): transport.published_qps."""
    return _transport().published_qps(instance)


# ------------------------------------------------------------------ shared set-up

class Session:
    """An endpoint, its QPs and MR, and the bootstrap channel; closes all of it."""

    def __init__(self, instance: str, ns: str | None, mtu: int | None = None, cmd: str = "",
                 spin_us: int | None = None, ce_ack: int | None = None):
        t = _transport()
        opts = {k: v for k, v in (("spin_us", spin_us), ("ce_ack", ce_ack)) if v is not None}
        self.ep = t.Endpoint(instance, ns, mtu=mtu, **opts)
        self.qps = []
        self.mr = None
        self.ch = None
        if self.ep._pub:             # the endpoint publishes its QPs' counters; name the command
            self.ep._pub.cmd = cmd or self.ep._pub.cmd

    def make_qps(self, n: int):
        self.qps = [self.ep.create_qp() for _ in range(n)]
        return self.qps

    def attrs(self):
        return [bs.qp_attrs(q, self.mr) for q in self.qps]

    def connect(self, remote: list):
        if len(remote) != len(self.qps):
            raise PerfError("the peer offered %d QPs, this side has %d" % (len(remote), len(self.qps)))
        for q, r in zip(self.qps, remote):
            q.connect(bs.check_qp_attrs(r, local=self.ep.local_addr))

    def stats(self) -> list[dict]:
        out = []
        for q in self.qps:
            try:
                out.append(q.stats())
            except Exception:      # a QP that failed: no stats
                pass
        return out

    def close(self):
        if self.ch:
            self.ch.close()
        for q in self.qps:
            try:
                q.destroy()
            except Exception:
                pass
        self.ep.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def _check_wc(c, what: str):
    if not c.ok:
        raise PerfError("%s: QP %#x work request %d completed with %s%s" % (
            what, c.qpn, c.wr_id, c.status.name,
            {"RETRY_EXC_ERR": " (the peer stopped answering: is it running, is the fabric up?)",
             "REM_ACCESS_ERR": " (the peer refused the R_Key or range)"}.get(c.status.name, "")))


def _summ_qp_stats(stats: list[dict]) -> dict:
    keys = ("tx_pkts", "tx_bytes", "rtx_pkts", "rtx_timeout", "rtx_sack", "rtx_nack_trim", "timeouts",
            "sacks_rx", "sacks_rx_ecn", "nacks_rx_trim", "rx_pkts", "rx_bytes", "rx_dup", "rx_ce",
            "ce_reported")
    out = {k: sum(s.get(k, 0) for s in stats) for k in keys}
    if stats:
        out["cwnd"] = [s.get("cwnd") for s in stats]
        out["srtt_us"] = [round(s.get("srtt_ns", 0) / 1000, 1) for s in stats]
    return out


class Progress:
    """One line a second on stderr for runs longer than a couple of seconds."""

    def __init__(self, enabled: bool, what: str):
        self.enabled = enabled
        self.what = what
        self.t0 = self.last = time.monotonic()
        self.last_bytes = 0

    def tick(self, total_bytes: int, extra: str = ""):
        now = time.monotonic()
        if not self.enabled or now - self.last < 1.0:
            return
        rate = (total_bytes - self.last_bytes) * 8 / (now - self.last)
        print("  %6.1f s  %10.1f MiB  %9.1f Mbit/s%s" % (now - self.t0, total_bytes / 2**20, rate / 1e6, extra),
              file=sys.stderr, flush=True)
        self.last, self.last_bytes = now, total_bytes


# ------------------------------------------------------------------ write-bw

def _drain(ep, timeout, what):
    got = ep.cq.wait_blocking(timeout=timeout, max_n=256)
    for c in got:
        _check_wc(c, what)
    return got


def _await(ch, kind: str, s: Session, timeout: float, what: str, **ctx) -> dict:
    """The peer's next message (of type kind), waited for as long as data keeps arriving
    at s's QPs: a sender that vanished (or was stopped) without closing its connection
    is given up after timeout seconds with neither data nor a message."""
    seen, since = None, time.monotonic()
    while True:
        try:
            return ch.expect(kind, min(1.0, timeout), **ctx)
        except bs.BootstrapTimeout:
            pass
        rx = sum(q.get("rx_pkts", 0) + q.get("rx_dup", 0) for q in s.stats())
        if rx != seen:
            seen, since = rx, time.monotonic()
        elif time.monotonic() - since >= timeout:
            raise PerfError("%s: no data and no message from %s for %.0f s (%d packets received): the "
                            "sender stopped or vanished" % (what, ch.peer, timeout, rx))


def _stderr_log(cmd: str):
    return lambda line: print("mrc-xdp %s: %s" % (cmd, line), file=sys.stderr, flush=True)


def _serve(instance, ns, port, bind, accept_timeout, timeout, cmd, log=None, agree=None, prepare=None,
           need_mr=None):
    """The first client that asks for cmd with a valid hello and valid QP attributes
    (bootstrap.check_msg); every other one is told why, logged (log, default stderr) and
    the wait goes on, for accept_timeout seconds in all (None: for ever).  agree(hello):
    this server's own conditions, before the QPs are read; prepare(ch): what the transfer
    needs once agreed, kept as ch.prepared (both raise BootstrapError to refuse);
    need_mr(hello): the MR bytes the client's QPs must offer.  The channel's .remote
    holds the client's QP attributes."""
    local = _transport().local_addr(instance)
    wants = "send" if cmd == "recv" else cmd

    def check(ch):
        h = bs.check_msg("hello", ch.hello, ch.peer, cmd=wants)
        if agree:
            agree(h)
        ch.remote = ch.expect("qps", min(timeout, bs.HELLO_TIMEOUT), n=h.get("qps", 1), local=local,
                              need_mr=need_mr(h) if need_mr else None)["qps"]
        ch.prepared = prepare(ch) if prepare else None
    lst = bs.Listener(port, bind=bind, ns=ns)
    try:
        return lst.accept(accept_timeout, check=check, log=log or _stderr_log(cmd))
    finally:
        lst.close()


@contextlib.contextmanager
def _telling(ch):
    """The peer hears (in one line) why this side failed; then the error goes on."""
    try:
        yield
    except Exception as e:
        ch.reject(str(e))
        raise
    finally:
        ch.close()


def write_bw_client(peer: str, instance: str, ns: str | None = None, size: int = DEFAULT_SIZE,
                    iters: int | None = None, duration: float | None = None, qps: int = 1,
                    port: int = bs.DEFAULT_PORT, tx_depth: int | None = None, mtu: int | None = None,
                    progress: bool = False, timeout: float = 30.0, spin_us: int | None = None,
                    ce_ack: int | None = None) -> dict:
    if size < 1:
        raise PerfError("--size %d: must be at least 1 byte" % size)
    _check_spins(spin_us, 0)
    if not 1 <= qps <= MAX_QPS:
        raise PerfError("--qps %d: must be 1..%d" % (qps, MAX_QPS))
    if iters is None and duration is None:
        iters = 5000 if size <= 65536 else 1000
    depth = tx_depth or max(1, min(128, MAX_INFLIGHT_BYTES // size // qps))
    with Session(instance, ns, mtu, "write-bw client", spin_us, ce_ack) as s:
        src = bytearray(os.urandom(min(size, 1 << 16)) * (size // (1 << 16) + 1))[:size]
        s.mr = s.ep.reg_mr(src)
        s.make_qps(qps)
        s.ch = bs.connect(peer, port, timeout=timeout, ns=ns,
                          hello={"cmd": "write-bw", "size": size, "qps": qps})
        s.ch.send({"type": "qps", "qps": s.attrs()})
        remote = s.ch.expect("qps", timeout, n=qps, local=s.ep.local_addr, need_mr=size)["qps"]
        s.connect(remote)
        s.ch.barrier("go", timeout)
        prog = Progress(progress, "write-bw")
        posted = done = 0
        out = [0] * qps
        window_bytes, windows = 0, []
        t0 = tw = time.monotonic()
        stop_at = t0 + duration if duration else None

        def more():
            if stop_at is not None:
                return time.monotonic() < stop_at
            return posted < iters
        while True:
            for i, q in enumerate(s.qps):
                while out[i] < depth and more():
                    r = remote[i]["mr"]
                    q.post_write(posted, s.mr, 0, size, r["addr"], r["rkey"])
                    posted += 1
                    out[i] += 1
            if done == posted and not more():
                break
            got = _drain(s.ep, timeout, "write-bw")
            if not got:
                raise PerfError("write-bw: no completion for %.0f s (%d of %d writes done): the peer or the "
                                "fabric stopped" % (timeout, done, posted))
            qidx = {q.qpn: i for i, q in enumerate(s.qps)}
            for c in got:
                out[qidx[c.qpn]] -= 1
            done += len(got)
            window_bytes += len(got) * size
            now = time.monotonic()
            if now - tw >= 0.1:
                windows.append(window_bytes * 8 / (now - tw))
                window_bytes, tw = 0, now
            prog.tick(done * size)
        el = time.monotonic() - t0
        st = _summ_qp_stats(s.stats())
        res = {"test": "write-bw", "bytes": size, "iterations": done, "qps": qps, "seconds": el,
               "payload": s.ep.payload, "tx_depth": depth,
               "bw_avg_bps": done * size * 8 / el if el > 0 else 0.0,
               "bw_peak_bps": max(windows) if windows else done * size * 8 / max(el, 1e-9),
               "msg_rate_mps": done / el / 1e6 if el > 0 else 0.0, "qp_stats": st,
               "spin_us": s.ep.options()["spin_us"]}
        s.ch.send({"type": "result", "result": res})
        res["path"] = s.ep.path       # (local: single- or multi-buffer; not sent to the peer)
        s.ch.barrier("done", timeout)
        return res


def write_bw_server(instance: str, ns: str | None = None, port: int = bs.DEFAULT_PORT,
                    bind: str = "::", mtu: int | None = None, accept_timeout: float | None = None,
                    timeout: float = 30.0, log=None, spin_us: int | None = None,
                    ce_ack: int | None = None) -> dict:
    """ce_ack: how this side SACKs CE-marked data (Endpoint's ce_ack: 1 coalesced, 2 one
    SACK each; None: the engine's default, 1)."""
    _check_spins(spin_us, 0)
    ch = _serve(instance, ns, port, bind, accept_timeout, timeout, "write-bw", log)
    with _telling(ch):
        size, qps = ch.hello["size"], ch.hello["qps"]
        with Session(instance, ns, mtu, "write-bw server", spin_us, ce_ack) as s:
            s.mr = s.ep.reg_mr(bytearray(size))
            s.make_qps(qps)
            ch.send({"type": "qps", "qps": s.attrs()})
            s.connect(ch.remote)
            ch.barrier("go", timeout)
            res = _await(ch, "result", s, timeout, "write-bw", cmd="write-bw")["result"]
            res["server_qp_stats"] = _summ_qp_stats(s.stats())
            ch.barrier("done", timeout)
            return res


# ------------------------------------------------------------------ write-lat

def _lat_loop(s, remote, size, iters, client: bool, timeout: float, cq_spin_us: int = 0):
    """Ping-pong of Write-with-Immediate: the client writes, the server answers when the
    whole message has arrived (its RECV_RDMA_IMM completion), and back.  cq_spin_us: wait
    for each completion spinning in C first (CQ.wait_blocking's spin_us), then on the
    eventfd."""
    q = s.qps[0]
    r = remote[0]["mr"]
    lat = []
    warm = min(100, iters // 10)
    ep = s.ep

    def wait_recv():
        while True:
            # ib_write_lat spins on its CQ; a Python busy poll here starved the engines'
            # progress threads on a shared 2-core host (measured: round trip p50 88 -> 486 us
            # with a 200 us spin).  cq_spin_us spins in C (GIL released, bounded, given up
            # when descheduled) and receives the frames itself, so nothing waits for the
            # progress thread (docs/transport.md, "Latency path")
            for c in ep.cq.wait_blocking(timeout=timeout, max_n=16, spin_us=cq_spin_us) or [None]:
                if c is None:
                    raise PerfError("write-lat: no message from the peer for %.0f s" % timeout)
                _check_wc(c, "write-lat")
                if c.opcode == _transport().WcOpcode.RECV_RDMA_IMM:
                    return
    for i in range(iters + warm):
        if client:
            t0 = time.perf_counter_ns()
            q.post_write(i, s.mr, 0, size, r["addr"], r["rkey"], imm=i)
            wait_recv()
            if i >= warm:
                lat.append((time.perf_counter_ns() - t0) / 1000.0)
        else:
            wait_recv()
            q.post_write(i, s.mr, 0, size, r["addr"], r["rkey"], imm=i)
    return lat


def _lat_result(lat, size, payload) -> dict:
    lat.sort()
    n = len(lat)
    half = [x / 2 for x in lat]           # perftest reports one way: half the round trip

    def pct(v, p):
        return v[min(n - 1, int(n * p))]
    return {"test": "write-lat", "bytes": size, "iterations": n, "payload": payload,
            "t_min_us": half[0], "p50_us": pct(half, 0.5), "p99_us": pct(half, 0.99),
            "p999_us": pct(half, 0.999), "t_max_us": half[-1], "t_avg_us": sum(half) / n,
            "rtt_p50_us": pct(lat, 0.5), "rtt_p99_us": pct(lat, 0.99), "rtt_p999_us": pct(lat, 0.999)}


def _check_spins(spin_us, cq_spin_us):
    t = _transport()
    try:
        if spin_us is not None:
            t.endpoint.spin_checked(spin_us, "--spin-us")
        t.endpoint.spin_checked(cq_spin_us, "--cq-spin-us", "microseconds to spin for a completion")
    except t.TransportError as e:
        raise PerfError(str(e)) from None


def write_lat_client(peer: str, instance: str, ns: str | None = None, size: int = 8,
                     iters: int = 1000, port: int = bs.DEFAULT_PORT, mtu: int | None = None,
                     timeout: float = 30.0, spin_us: int | None = None, cq_spin_us: int = 0) -> dict:
    """spin_us: the engine's spin (Endpoint spin_us; None: its default); cq_spin_us:
    this side's spin for each completion (CQ.wait_blocking)."""
    if size < 1 or iters < 1:
        raise PerfError("--size and --iters must be at least 1")
    _check_spins(spin_us, cq_spin_us)
    with Session(instance, ns, mtu, "write-lat client", spin_us) as s:
        s.mr = s.ep.reg_mr(bytearray(size))
        s.make_qps(1)
        s.ch = bs.connect(peer, port, timeout=timeout, ns=ns,
                          hello={"cmd": "write-lat", "size": size, "iters": iters})
        s.ch.send({"type": "qps", "qps": s.attrs()})
        remote = s.ch.expect("qps", timeout, n=1, local=s.ep.local_addr, need_mr=size)["qps"]
        s.connect(remote)
        s.ch.barrier("go", timeout)
        lat = _lat_loop(s, remote, size, iters, True, timeout, cq_spin_us)
        res = _lat_result(lat, size, s.ep.payload)
        res["qp_stats"] = _summ_qp_stats(s.stats())
        st = s.ep.stats()
        res["spin_us"] = s.ep.options()["spin_us"]
        res["cq_spin_us"] = cq_spin_us
        res["engine"] = {k: st[k] for k in ENGINE_LAT_STATS}
        s.ch.send({"type": "result", "result": res})
        s.ch.barrier("done", timeout)
        return res


def write_lat_server(instance: str, ns: str | None = None, port: int = bs.DEFAULT_PORT,
                     bind: str = "::", mtu: int | None = None, accept_timeout: float | None = None,
                     timeout: float = 30.0, log=None, spin_us: int | None = None,
                     cq_spin_us: int = 0) -> dict:
    _check_spins(spin_us, cq_spin_us)
    ch = _serve(instance, ns, port, bind, accept_timeout, timeout, "write-lat", log,
                need_mr=lambda h: h["size"])
    with _telling(ch):
        size, iters = ch.hello["size"], ch.hello["iters"]
        with Session(instance, ns, mtu, "write-lat server", spin_us) as s:
            s.mr = s.ep.reg_mr(bytearray(size))
            s.make_qps(1)
            ch.send({"type": "qps", "qps": s.attrs()})
            s.connect(ch.remote)
            ch.barrier("go", timeout)
            _lat_loop(s, ch.remote, size, iters, False, timeout, cq_spin_us)
            res = ch.expect("result", timeout, cmd="write-lat")["result"]
            st = s.ep.stats()
            res["server_engine"] = {k: st[k] for k in ENGINE_LAT_STATS}
            ch.barrier("done", timeout)
            return res


# ------------------------------------------------------------------ send / recv

def _close_map(m) -> None:
    """Unmap now (the endpoint that read or wrote it is closed, and has let go of it);
    should something still hold it, it is unmapped when that goes."""
    try:
        m.close()
    except BufferError:
        pass


@contextlib.contextmanager
def _mapped(fd: int, size: int, write: bool):
    """fd's first size bytes mapped (an empty file: b""), unmapped on the way out."""
    if not size:
        yield b""
        return
    m = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if write else 0))
    try:
        yield m
    finally:
        _close_map(m)


def _sha256(buf) -> str:
    return hashlib.sha256(buf).hexdigest()


def _mib(n: int) -> str:
    return "%.1f MiB" % (n / 2**20) if n < 1 << 40 else "%.1f TiB" % (n / 2**40)


def send_file(path: str, peer: str, instance: str, ns: str | None = None,
              port: int = bs.DEFAULT_PORT, mtu: int | None = None, progress: bool = False,
              timeout: float = 30.0, chunk: int = CHUNK, depth: int = 8) -> dict:
    """RDMA-Write a file into the receiver's memory-mapped copy; both sides hash it."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise PerfError("send: cannot read %s (%s)" % (path, e.strerror)) from None
    with f, _mapped(f.fileno(), os.fstat(f.fileno()).st_size, False) as buf:
        size = len(buf)
        digest = _sha256(buf)
        with Session(instance, ns, mtu, "send") as s:
            # the engine reads the mapping in place (a read-only MR: local access only)
            t = _transport()
            s.mr = s.ep.reg_mr(buf if size else bytearray(1), access=t.ACCESS_LOCAL)
            s.make_qps(1)
            s.ch = bs.connect(peer, port, timeout=timeout, ns=ns,
                              hello={"cmd": "send", "name": os.path.basename(path), "size": size,
                                     "sha256": digest})
            s.ch.send({"type": "qps", "qps": s.attrs()})
            remote = s.ch.expect("qps", timeout, n=1, local=s.ep.local_addr, need_mr=size)["qps"]
            s.connect(remote)
            s.ch.barrier("go", timeout)
            q, r = s.qps[0], remote[0]["mr"]
            prog = Progress(progress, "send")
            t0 = time.monotonic()
            off = posted = done = 0
            nchunks = (size + chunk - 1) // chunk
            while done < nchunks:
                while posted - done < depth and off < size:
                    n = min(chunk, size - off)
                    last = off + n >= size
                    q.post_write(posted, s.mr, off, n, r["addr"] + off, r["rkey"],
                                 imm=nchunks if last else None)
                    off += n
                    posted += 1
                got = _drain(s.ep, timeout, "send")
                if not got:
                    raise PerfError("send: no completion for %.0f s (%d of %d chunks done): the receiver or "
                                    "the fabric stopped" % (timeout, done, nchunks))
                done += len(got)
                prog.tick(min(size, done * chunk))
            el = time.monotonic() - t0
            st = _summ_qp_stats(s.stats())
            s.ch.send({"type": "done", "sha256": digest, "seconds": el})
            # the receiver hashes and syncs its copy before it answers
            verdict = s.ch.expect("verdict", timeout + size / 100e6)
            s.ch.barrier("done", timeout)
    res = {"test": "send", "file": path, "bytes": size, "sha256": digest, "seconds": el,
           "goodput_bps": size * 8 / el if el > 0 else 0.0, "receiver_sha256": verdict["sha256"],
           "intact": verdict["sha256"] == digest, "saved_as": verdict.get("path"), "qp_stats": st}
    if not res["intact"]:
        raise PerfError("send: the receiver's copy has sha256 %s, the file %s: corrupted in transfer"
                        % (verdict["sha256"], digest))
    return res


def _room_for(dirfd: int, directory: str, name: str, size: int, overwrite: bool) -> None:
    """BootstrapError unless `name` may be received into directory: not an existing name
    (without overwrite; never a directory), and size fits in the space free."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise bs.BootstrapError("%s: %s" % (name, e.strerror)) from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise bs.BootstrapError("%s exists in %s and is a directory: not received" % (name, directory))
    if st is not None and not overwrite:
        raise bs.BootstrapError("%s exists in %s and the receiver runs without --overwrite: not received"
                             % (name, directory))
    try:
        vfs = os.statvfs(dirfd)
    except OSError as e:
        raise bs.BootstrapError("%s: cannot tell the space free (%s)" % (directory, e.strerror)) from None
    free = vfs.f_bavail * vfs.f_frsize
    if size > free:
        raise bs.BootstrapError("%s is %s, %s has %s free: not received" % (name, _mib(size), directory, _mib(free)))



class _Incoming:
    """The file being received, under a temporary name in its directory (created with
    O_EXCL | O_NOFOLLOW, its size reserved with posix_fallocate, so a full file system
    refuses it here rather than faulting the mapping later); commit() moves it to its
    name once verified, anything else removes it."""

    def __init__(self, dirfd: int, directory: str, name: str, size: int, overwrite: bool):
        self.dirfd, self.directory, self.name, self.size = dirfd, directory, name, size
        self.overwrite = overwrite
        self.tmp = ".mrc-recv.%s" % os.urandom(8).hex()
        self.map = None
        try:
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o666, dir_fd=dirfd)
        except OSError as e:
            raise bs.BootstrapError("cannot create a file in %s (%s)" % (directory, e.strerror)) from None
        try:
            if size:
                os.posix_fallocate(self.fd, 0, size)
                self.map = mmap.mmap(self.fd, size)
        except OSError as e:
            self.discard()
            raise bs.BootstrapError("%s: cannot reserve %s in %s (%s): not received"
                                 % (name, _mib(size), directory, e.strerror)) from None

    def buffer(self):
        return self.map if self.map is not None else bytearray(1)

    def digest(self) -> str:
        return _sha256(self.map if self.map is not None else b"")

    def commit(self) -> str:
        """Synced, and under its name (replacing what is there only with overwrite)."""
        try:
            if self.map is not None:
                self.map.flush()
                _close_map(self.map)
                self.map = None
            os.fsync(self.fd)
            d = dict(src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)
            if self.overwrite:
                os.replace(self.tmp, self.name, **d)
            else:
                try:        # a hard link never replaces a name that appeared meanwhile
                    os.link(self.tmp, self.name, **d)
                except FileExistsError:
                    raise PerfError("recv: %s appeared in %s during the transfer: not replaced"
                                    % (self.name, self.directory)) from None
                os.unlink(self.tmp, dir_fd=self.dirfd)
        except OSError as e:
            raise PerfError("recv: cannot save %s in %s (%s)" % (self.name, self.directory, e.strerror)) from None
        self.tmp = None
        return os.path.join(self.directory, self.name)

    def discard(self) -> None:
        if self.map is not None:
            _close_map(self.map)
            self.map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tmp:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dirfd)
            self.tmp = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.discard()


def recv_file(directory: str, instance: str, ns: str | None = None, port: int = bs.DEFAULT_PORT,
              bind: str = "::", mtu: int | None = None, accept_timeout: float | None = None,
              timeout: float = 30.0, overwrite: bool = False, log=None) -> dict:
    """Receive one file (send_file) into directory; the engine writes straight into the
    memory-mapped file, which is created (under a temporary name) only once the sender's
    hello and QPs are agreed and its size reserved, and gets its name only once its
    sha256 matches the sender's.  An existing name is replaced only with overwrite (a
    symlink itself, never what it points to); a directory never."""
    try:
        dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise PerfError("recv: %s: %s (give an existing directory)" % (directory, e.strerror)) from None
    try:
        ch = _serve(instance, ns, port, bind, accept_timeout, timeout, "recv", log,
                    agree=lambda h: _room_for(dirfd, directory, h["name"], h["size"], overwrite),
                    prepare=lambda ch: _Incoming(dirfd, directory, ch.hello["name"], ch.hello["size"], overwrite))
        with _telling(ch), ch.prepared as inc:
            size = inc.size
            with Session(instance, ns, mtu, "recv") as s:
                s.mr = s.ep.reg_mr(inc.buffer())
                s.make_qps(1)
                ch.send({"type": "qps", "qps": s.attrs()})
                s.connect(ch.remote)
                ch.barrier("go", timeout)
                fin = _await(ch, "done", s, timeout, "recv")
                st = _summ_qp_stats(s.stats())
            # the endpoint is closed: the engine writes no more
            digest = inc.digest()
            ok = digest == fin["sha256"]
            path = inc.commit() if ok else None
            ch.send(dict({"type": "verdict", "sha256": digest}, **({"path": path} if path else {})))
            ch.barrier("done", timeout)
            if not ok:
                raise PerfError("recv: %s from %s has sha256 %s, the sender's %s: corrupted in transfer, not kept"
                                % (inc.name, ch.peer, digest, fin["sha256"]))
            return {"test": "recv", "file": path, "bytes": size, "sha256": digest,
                    "sender_sha256": fin["sha256"], "intact": ok, "seconds": fin["seconds"], "qp_stats": st}
    finally:
        os.close(dirfd)
