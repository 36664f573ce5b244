#!/usr/bin/env python3
"""Failover measured: one MRC QP, one TCP flow and one MPTCP connection facing the same
T1 blackhole in the same run, then the heal; and 20% loss on the path of one EV of 16.

Scenario 1 (ecmp lab, IPv6): the T0s hash src/dst address, flow label and ports
(policy 3, fields 0x3f), so TCP's flow-label rehash on timeouts (kernel defaults,
net.ipv6.auto_flowlabels, net.core.txrehash) can move it to another path.

- MRC: h0 -> h2, one QP of the transport engine, Writes kept in flight.  Goodput is
  the receiver QP's placed payload bytes (rx_bytes), sampled every 100 us.
- TCP: h1 -> h3 over plane 0 (lab control addresses), one flow, default sysctls.
- MPTCP: h3 -> h1, one subflow per plane (endpoints on p0 and p1 control addresses).
  Goodput of both is the receiving process's byte count, in shared memory, sampled by
  the same 100 us sampler.
- After a warm-up the T1 that carries the TCP flow (plane 0) is blackholed (every link
  end into and out of it); the MPTCP plane-0 subflow and a quarter of MRC's EVs cross
  it too.  After the fault window the T1 heals.

Printed per flow: goodput before; time to detect (MRC: the first ASSUMED_BAD event of
the datapath; TCP/MPTCP: the first retransmission); time to recover to 90% of the
surviving capacity (the pre-fault goodput: the surviving paths are not the bottleneck
on this machine), measured on a 1 ms moving average, from the fault and from the
first loss report; bytes retransmitted in the fault window; for MRC, time after the
heal until the retired EVs are back in service (the health daemon's probes; "n/a"
when no prober is installed).  Writes <out>/failover.csv (100 us bins) and
<out>/failover.png.

Scenario 2 (srv6 lab, EVs placed explicitly): one QP whose 16 active EVs are 7 on
(plane 0, T1 0), 1 on (plane 0, T1 1), 8 over plane 1's two T1s; 20% random loss on
the forward link into p0t1s1: goodput of a fixed-length run against the same run
without the fault.

Run as root: .venv/bin/python tools/bench_failover.py [--out DIR] (about a minute).
"""
from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BIN_S = 100e-6
TCP_PORT, MPTCP_PORT = 15201, 15202
IPPROTO_MPTCP = 262


# ---------------------------------------------------------------- helper processes

def _netns_enter(ns):
    from mrc_xdp.datapath import netns
    fd = netns.open_fd(ns)
    netns._setns(fd, ns)          # this single-threaded helper process stays there
    os.close(fd)


def role_sink(a):
    """Accept one connection, count received bytes into shm slot a.slot."""
    _netns_enter(a.ns)
    f = open(a.shm, "r+b")
    mm = mmap.mmap(f.fileno(), 64)
    proto = IPPROTO_MPTCP if a.proto == "mptcp" else 0
    ls = socket.socket(socket.AF_INET6, socket.SOCK_STREAM, proto)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((a.addr, a.port))
    ls.listen(1)
    print("ready", flush=True)
    c, _ = ls.accept()
    buf = bytearray(1 << 20)
    n = 0
    off = 8 * a.slot
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        n += k
        mm[off:off + 8] = struct.pack("<Q", n)


def _retrans_segs() -> int:
    with open("/proc/self/net/snmp") as f:
        lines = [l.split() for l in f if l.startswith("Tcp:")]
    return int(lines[1][lines[0].index("RetransSegs")])


def role_source(a):
    """Connect from a.src to a.addr and send until SIGTERM; log (t_ns, RetransSegs) on
    every change, and the MSS, as JSON to a.log."""
    _netns_enter(a.ns)
    proto = IPPROTO_MPTCP if a.proto == "mptcp" else 0
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM, proto)
    s.bind((a.src, 0))
    if a.pace:
        SO_MAX_PACING_RATE = 47
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(a.pace) // 8)
        except OSError as e:        # MPTCP sockets refuse it: pace in the sender loop
            print("bench_failover: %s: SO_MAX_PACING_RATE: %s (paced by the sender loop)" % (a.proto, e),
                  file=sys.stderr)
            soft = int(a.pace) / 8.0
    s.connect((a.addr, a.port))
    s.setblocking(False)
    stop = []
    signal.signal(signal.SIGTERM, lambda *x: stop.append(1))
    data = memoryview(bytearray(256 << 10))
    log = []
    last = _retrans_segs()
    log.append((time.monotonic_ns(), last))
    import select
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        mss = struct.unpack_from("<I", info, 16)[0] or 1440        # tcpi_snd_mss
    except OSError:
        mss = 1440
    nxt = 0.0
    soft = locals().get("soft")
    sent, t_start = 0, time.monotonic()
    while not stop:
        if soft and sent > soft * (time.monotonic() - t_start):
            time.sleep(0.0005)
            w = False
        else:
            _, w, _ = select.select([], [s], [], 0.001)
        if w:
            try:
                sent += s.send(data)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                break
        if time.monotonic() >= nxt:         # RetransSegs of this netns, every 0.5 ms at most
            nxt = time.monotonic() + 0.0005
            r = _retrans_segs()
            if r != last:
                last = r
                log.append((time.monotonic_ns(), r))
    with open(a.log, "w") as f:
        json.dump({"log": log, "mss": mss}, f)
    s.close()


# ---------------------------------------------------------------- the run

def sh(ns, *cmd, check=True):
    return subprocess.run(["nsenter", "--net=/run/netns/" + ns, *cmd], capture_output=True, text=True,
                          check=check)


class MrcFlow:
    """One QP h_src -> h_dst writing 1 MiB messages back to back into a 16 MiB region."""

    def __init__(self, ep_s, ep_d, qpn_s, qpn_d, size=16 << 20, chunk=1 << 20, depth=8):
        self.ep_s, self.ep_d = ep_s, ep_d
        self.src = bytearray(os.urandom(size))
        self.dst = bytearray(size)
        self.qs = ep_s.create_qp(qpn=qpn_s)
        self.qd = ep_d.create_qp(qpn=qpn_d)
        self.ms, self.md = ep_s.reg_mr(self.src), ep_d.reg_mr(self.dst)
        self.qs.connect(self.qd.local_attrs())
        self.qd.connect(self.qs.local_attrs())
        self.size, self.chunk, self.depth = size, chunk, depth
        self.stop = threading.Event()
        self.errors = []
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        k = 0
        inflight = 0
        nchunks = self.size // self.chunk
        while not self.stop.is_set():
            while inflight < self.depth:
                off = (k % nchunks) * self.chunk
                self.qs.post_write(k, self.ms, off, self.chunk, self.md.addr + off, self.md.rkey)
                k += 1
                inflight += 1
            for c in self.ep_s.cq.wait_blocking(timeout=0.01):
                if not c.ok:
                    self.errors.append(str(c))
                    self.stop.set()
                inflight -= 1
        end = time.monotonic() + 10
        while inflight > 0 and time.monotonic() < end:
            inflight -= len(self.ep_s.cq.poll(64))
            time.sleep(0.001)

    def rx_bytes(self) -> int:
        return self.qd.stats()["rx_bytes"]

    def close(self):
        self.stop.set()
        self.t.join(15)
        for q in (self.qs, self.qd):
            q.destroy()
        self.ms.dereg()
        self.md.dereg()


class Sampler(threading.Thread):
    """Every 100 us: (t_ns, MRC rx bytes, TCP bytes, MPTCP bytes)."""

    def __init__(self, mrc, mm):
        super().__init__(daemon=True)
        self.mrc, self.mm = mrc, mm
        self.rows = []
        self.stop = threading.Event()

    def run(self):
        nxt = time.monotonic()
        while not self.stop.is_set():
            t = time.monotonic_ns()
            tcp, mp = struct.unpack_from("<QQ", self.mm, 0)
            self.rows.append((t, self.mrc.rx_bytes() if self.mrc else 0, tcp, mp))
            nxt += BIN_S
            d = nxt - time.monotonic()
            if d > 0:
                time.sleep(d)
            else:
                nxt = time.monotonic()


def binned(rows, t0_ns, col):
    """Goodput per 100 us bin (bit/s), bins from t0: [(t_s, bps)] by linear interpolation
    of the cumulative counter at each bin edge."""
    import bisect
    ts = [r[0] for r in rows]
    vs = [r[col] for r in rows]
    out = []
    t = max(ts[0], t0_ns)
    step = int(BIN_S * 1e9)
    prev = None
    while t <= ts[-1]:
        i = bisect.bisect_left(ts, t)
        if i == 0:
            v = vs[0]
        elif i >= len(ts):
            v = vs[-1]
        else:
            a, b = ts[i - 1], ts[i]
            v = vs[i - 1] + (vs[i] - vs[i - 1]) * (t - a) / max(b - a, 1)
        if prev is not None:
            out.append(((t - t0_ns) / 1e9, (v - prev) * 8 / BIN_S))
        prev = v
        t += step
    return out


def moving(series, n=10):
    out, acc = [], 0.0
    for i, (t, v) in enumerate(series):
        acc += v
        if i >= n:
            acc -= series[i - n][1]
        out.append((t, acc / min(i + 1, n)))
    return out


HORIZON_S = 0.05


def recover_time(series, t_from, t_to, target):
    """The first bin time t in [t_from, t_to) from which the mean goodput over the next
    HORIZON_S reaches target: robust to the noise of 100 us bins on a busy machine."""
    n = int(round(HORIZON_S / BIN_S))
    vals = [v for _, v in series]
    ts = [t for t, _ in series]
    acc = sum(vals[:n])
    for i in range(len(vals) - n):
        if ts[i] >= t_to:
            break
        if ts[i] >= t_from and acc / n >= target:
            return ts[i]
        acc += vals[i + n] - vals[i]
    return None


def first_retrans(logf, fault_ns):
    try:
        with open(logf) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None, 0, 1440
    log = d["log"]
    base = [r for t, r in log if t <= fault_ns]
    base = base[-1] if base else log[0][1]
    after = [(t, r) for t, r in log if t > fault_ns and r > base]
    return (after[0][0] if after else None), base, d["mss"]


def retrans_in(logf, a_ns, b_ns):
    try:
        with open(logf) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return 0
    log = d["log"]

    def at(t):
        v = log[0][1]
        for tt, r in log:
            if tt <= t:
                v = r
        return v
    return (at(b_ns) - at(a_ns)) * d["mss"]


def run_failover(args, out):
    from mrc_xdp.lab import ctlpath
    from mrc_xdp import health, transport
    from mrc_xdp.lab import fabric, hosts, topology
    from mrc_xdp.lab import linkmodel as lmod

    prefix = "bf%d-" % (os.getpid() % 100000)
    topo = topology.load(mode="ecmp")
    st = fabric.up(topo, prefix=prefix, hosts_hook=hosts.fabric_hook)
    procs, eps, mrc, daemon, dps = [], {}, None, None, []
    tmp = tempfile.mkdtemp(prefix="bf-")
    try:
        topo = fabric.topology_of(st)
        lm = lmod.LinkModel.open(st["pin_dir"])
        # the T0s keep the lab's L4 hash: the lab mapped every EV to its T1 under it
        # (hosts.discover_ecmp_evs), and the EVs' t1 column, which says which EVs cross the
        # dead T1, is only true under the hash it was found with
        ctl = ctlpath.lab_control_path(prefix, topo)
        for h in ("h1", "h3"):
            sh(prefix + h, "ip", "mptcp", "limits", "set", "subflow", "2", "add_addr_accepted", "2")
        sh(prefix + "h3", "ip", "mptcp", "endpoint", "add", ctl["h3"][1], "dev", "p1", "subflow")

        # health daemon (probes bring retired EVs back after the heal, when a prober exists)
        sock = os.path.join(tmp, "events.sock")
        cfgf = os.path.join(tmp, "daemon.toml")
        with open(cfgf, "w") as f:
            # history: every event of the run (ECN skips alone are thousands of them); the
            # EVs retired are counted from it
            f.write('socket = "%s"\ninstances = ["%s*"]\nhistory = 1000000\n[probe]\ninterval_ms = 20\nok_needed = 3\n'
                    'backoff_max_ms = 100\nbackground_per_s = 0\n' % (sock, prefix))
        daemon = subprocess.Popen([sys.executable, "-m", "mrc_xdp.cli", "daemon", "--config", cfgf],
                                  stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "daemon.log"), "w"))
        end = time.monotonic() + 20
        while time.monotonic() < end and not (health.status(sock) or {}).get("instances", {}).get(prefix + "h0"):
            time.sleep(0.1)
        prober = bool((health.status(sock) or {}).get("prober"))

        shm = os.path.join(tmp, "shm")
        with open(shm, "wb") as f:
            f.write(b"\0" * 64)
        mmf = open(shm, "r+b")
        mm = mmap.mmap(mmf.fileno(), 64)
        me = os.path.abspath(__file__)
        sinks = [("tcp", "h3", ctl["h3"][0], TCP_PORT, 0), ("mptcp", "h1", ctl["h1"][0], MPTCP_PORT, 1)]
        for proto, host, addr, port, slot in sinks:
            p = subprocess.Popen([sys.executable, me, "--role", "sink", "--ns", prefix + host, "--addr", addr,
                                  "--port", str(port), "--proto", proto, "--shm", shm, "--slot", str(slot)],
                                 stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "ready"
            procs.append(p)
        logs = {"tcp": os.path.join(tmp, "tcp.json"), "mptcp": os.path.join(tmp, "mptcp.json")}
        srcs = [("tcp", "h1", ctl["h1"][0], ctl["h3"][0], TCP_PORT), ("mptcp", "h3", ctl["h3"][0], ctl["h1"][0], MPTCP_PORT)]
        for proto, host, src, dst, port in srcs:
            procs.append(subprocess.Popen([sys.executable, me, "--role", "source", "--ns", prefix + host,
                                           "--src", src, "--addr", dst, "--port", str(port), "--proto", proto,
                                           "--log", logs[proto], "--pace", str(int(args.pace * 1e6))]))
        # which plane-0 T1 carries the TCP flow (h1 on T0 0 -> h3 on T0 1): counted on T0 0's
        # uplinks before MRC (h0, also on T0 0) starts
        time.sleep(0.5)
        ups = {j: next(rx.ifindex for n, rx, _, _ in topo.link_ends() if n == "p0t0s0>p0t1s%d" % j)
               for j in range(topo.t1_per_plane)}
        b0 = {j: lm.counters(i)["bytes"] for j, i in ups.items()}
        time.sleep(0.3)
        b1 = {j: lm.counters(i)["bytes"] - b0[j] for j, i in ups.items()}
        t1 = "p0t1s%d" % max(b1, key=b1.get)
        for h in ("h0", "h2"):
            eps[h] = transport.Endpoint(prefix + h, timestamps=getattr(args, "timestamps", 1))
        q = hosts.qpn
        mrc = MrcFlow(eps["h0"], eps["h2"], q(0, 2), q(2, 0))
        mrc.t.start()
        sampler = Sampler(mrc, mm)
        sampler.start()
        time.sleep(args.warmup)
        t1_ends = [rx.ifindex for n, rx, _, lk in topo.link_ends() if t1 in (lk.a.node, lk.b.node)]
        rows0 = evs_of(prefix + "h0")
        bad0 = {r["ev"] for r in rows0 if r["state"] == "ASSUMED_BAD"}
        # the EVs (active and backup) of the MRC connection whose path crosses the dead T1
        tp, tj = int(t1[1:t1.index("t1")]), int(t1[t1.index("s") + 1:])
        crossing = {"conn": next(r["conn"] for r in rows0 if r["conn_name"] == "h2"),
                    "evs": {r["ev"] for r in rows0 if r["conn_name"] == "h2" and (r["plane"], r["t1"]) == (tp, tj)},
                    "where": {r["ev"]: (r["plane"], r["t1"]) for r in rows0 if r["conn_name"] == "h2"}}
        crossing["bad_before"] = dict(collections.Counter(
            "p%dt1s%d" % (r["plane"], r["t1"]) for r in rows0 if r["conn_name"] == "h2" and r["state"] != "GOOD"))
        # every link's counters at the fault, the heal and the end: where the fabric dropped,
        # trimmed or marked, beside what the datapath retired
        ends = [(n, rx.ifindex) for n, rx, _, _ in topo.link_ends()]
        from mrc_xdp.datapath.maps import Instance
        h0i, h2i = Instance(prefix + "h0"), Instance(prefix + "h2")
        dps += [h0i, h2i]

        def ethtool(ns, dev):
            r = subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-S", dev], capture_output=True, text=True)
            return {k.strip(): int(v) for k, _, v in (ln.partition(":") for ln in r.stdout.splitlines()[1:])
                    if v.strip().isdigit()}

        def kdrops():
            # the kernel's own drops on every lab interface (a veth's ring full under a
            # burst, a backlog): losses the link model never sees
            out = {}
            nss = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True).stdout
            for ns in json.loads(nss or "[]"):
                if not ns["name"].startswith(prefix):
                    continue
                r = subprocess.run(["ip", "-n", ns["name"], "-j", "-s", "link", "show"], capture_output=True, text=True)
                for ln in json.loads(r.stdout or "[]"):
                    st = ln.get("stats64", {})
                    out["%s:%s" % (ns["name"][len(prefix):], ln["ifname"])] = (
                        st.get("rx", {}).get("dropped", 0) + st.get("tx", {}).get("dropped", 0))
            return out

        def snap():
            d = {n: lm.counters(i) for n, i in ends}
            d["kernel drops"] = kdrops()
            d["h0 datapath"] = h0i.counters()
            # the engines' own receive-side losses: AF_XDP ring overflows, window drops
            d["h2 engine"] = {k: v for k, v in eps["h2"].stats().items() if isinstance(v, int)}
            d["h2 qp"] = {k: v for k, v in mrc.qd.stats().items() if isinstance(v, int)}
            d["h2 datapath"] = h2i.counters()
            for h in ("h0", "h2"):
                for dev in ("mrc0", "mrc0p", "p0", "p1"):
                    d["%s %s" % (h, dev)] = ethtool(prefix + h, dev)
            return d
        link_snaps = [snap()]
        # each end's config during the fault, made before the clock starts: the injection is
        # one map write per end (as the demo's), not a read-modify-write each, which took
        # over 1 ms for 4 ends with the engines and TCP senders on both cores
        saved = {i: lm.get(i) for i in t1_ends}
        dead = {i: dict(c, blackhole=True) for i, c in saved.items()}
        fault_ns = time.monotonic_ns()
        for i, c in dead.items():
            lm.set(i, c, reset=False)
        crossing["inject_us"] = (time.monotonic_ns() - fault_ns) / 1e3
        time.sleep(args.fault)
        # the datapath's own record, beside the daemon's events: the connection's EVs
        # retired (and still so) when the fault ends
        rows_heal = evs_of(prefix + "h0")
        crossing["retired_at_heal"] = dict(collections.Counter(
            "p%dt1s%d" % (r["plane"], r["t1"]) for r in rows_heal if r["conn_name"] == "h2"
            and r["state"] == "ASSUMED_BAD" and r["ev"] not in bad0))
        link_snaps.append(snap())
        heal_ns = time.monotonic_ns()
        for i, c in saved.items():
            lm.set(i, c, reset=False)
        back_ns = None
        end = time.monotonic() + args.after
        while time.monotonic() < end:
            rows = evs_of(prefix + "h0")
            retired = [r for r in rows if r["state"] == "ASSUMED_BAD" and r["ev"] not in bad0 and r["conn_name"] == "h2"]
            if back_ns is None and not retired:
                back_ns = time.monotonic_ns()
            time.sleep(0.005)
        link_snaps.append(snap())
        crossing["links"] = link_deltas(link_snaps)
        sampler.stop.set()
        sampler.join()
        for p in procs[2:]:
            p.send_signal(signal.SIGTERM)
        for p in procs[2:]:
            p.wait(10)
        mstats = mrc.qs.stats()
        mrc.close()
        mrc = None
        hist = [e for e in (health.request_lines({"op": "events", "instance": prefix + "h0"}, sock) or [])]
        res = analyse(sampler.rows, fault_ns, heal_ns, hist, logs, mstats, back_ns, prober, t1, args, out,
                      crossing)
    finally:
        if mrc is not None:
            mrc.close()
        for ep in eps.values():
            ep.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if daemon is not None:
            daemon.terminate()
            daemon.wait(10)
        for i in dps:           # the hosts' map handles, before their datapaths unload
            i.close()
        fabric.down(prefix, unload_hosts=hosts.unload_all)
        _cleanup(tmp)
    return res


def link_deltas(snaps):
    """{"fault": {name: {counter: delta}}, "after": ...}, what moved during the fault and
    after the heal: of a link end (named "a>b"), its marks, trims and drops other than
    the blackhole's; of every other entry of snap() (named "host what"), any counter."""
    out = {}
    for phase, a, b in (("fault", snaps[0], snaps[1]), ("after", snaps[1], snaps[2])):
        rows = {}
        for name, c in b.items():
            keys = c if " " in name else ("marked", "trimmed", "drop_queue", "drop_loss", "drop_flap")
            d = {k: c[k] - a[name][k] for k in keys}
            if any(d.values()):
                rows[name] = {k: v for k, v in d.items() if v}
        out[phase] = rows
    return out


def _cleanup(tmp: str) -> None:
    """Remove the run's temporary directory, unless the health daemon's log there holds a
    traceback: then keep it and say where."""
    log = os.path.join(tmp, "daemon.log")
    try:
        with open(log) as f:
            bad = "Traceback" in f.read()
    except OSError:
        bad = False
    if bad:
        print("bench_failover: the health daemon failed; its log: %s" % log, file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def evs_of(instance):
    from mrc_xdp.datapath.maps import Instance
    with Instance(instance) as i:
        return i.ev_table()


def analyse(rows, fault_ns, heal_ns, hist, logs, mstats, back_ns, prober, t1, args, out, crossing=None):
    t0 = rows[0][0]
    series = {name: binned(rows, t0, col) for name, col in (("mrc", 1), ("tcp", 2), ("mptcp", 3))}
    fs, hs = (fault_ns - t0) / 1e9, (heal_ns - t0) / 1e9
    res = {"t1": t1, "fault_s": fs, "heal_s": hs, "flows": {}}
    retired = [e for e in hist if e.get("new") == "ASSUMED_BAD" and e.get("source") == "datapath"
               and e["ts_ns"] >= fault_ns]
    for name, s in series.items():
        pre = [v for t, v in s if fs - 0.5 <= t < fs]
        before = sum(pre) / len(pre) if pre else 0.0
        target = 0.9 * before
        if name == "mrc":
            det_ns = min((e["ts_ns"] for e in retired), default=None)
            rtx = mstats["rtx_pkts"] * (mstats["tx_bytes"] / max(mstats["tx_pkts"], 1))
        else:
            det_ns, _, _ = first_retrans(logs[name], fault_ns)
            rtx = retrans_in(logs[name], fault_ns, heal_ns)
        det = (det_ns - fault_ns) / 1e9 if det_ns else None
        # recovery: from the first loss report (the fault when nothing was reported), the
        # first time from which the goodput over the next 50 ms is >= 90% of before
        start = fs + (det or 0.0)
        rec = recover_time(s, start, hs - HORIZON_S, target)
        low = [v for t, v in s if fs <= t < fs + 0.01]
        r = {"goodput_before_bps": before, "detect_s": det,
             "goodput_first_10ms_bps": sum(low) / len(low) if low else None,
             "recover_from_fault_s": None if rec is None else rec - fs,
             "recover_from_report_s": None if rec is None else rec - start,
             "bytes_retransmitted": int(rtx)}
        if name == "mrc":
            r["evs_retired"] = len({e["ev"] for e in retired})
            if crossing is not None:
                # retired during the fault, of the MRC connection: which crossed the dead T1
                mine = {e["ev"] for e in retired if e.get("conn") == crossing["conn"] and e["ts_ns"] < heal_ns}
                r["retired_events"] = [((e["ts_ns"] - fault_ns) / 1e6, "%#x" % e["ev"], e.get("conn"),
                                        "p%dt1s%s" % crossing["where"].get(e["ev"], (-1, "?")), e["reason"],
                                        e.get("old")) for e in retired]
                r["evs_retired_other"] = dict(collections.Counter(
                    ("conn %s" % e.get("conn") if e.get("conn") != crossing["conn"] else "after heal")
                    for e in retired if e.get("conn") != crossing["conn"] or e["ts_ns"] >= heal_ns))
                r["evs_crossing"] = len(crossing["evs"])
                r["evs_retired_fault"] = len(mine)
                r["evs_retired_not_crossing"] = len(mine - crossing["evs"])
                r["evs_not_good_at_fault"] = crossing["bad_before"]
                r["evs_retired_at_heal"] = crossing["retired_at_heal"]
                r["fabric_links"] = crossing.get("links")
                r["fault_monotonic_ns"] = fault_ns
                r["inject_us"] = crossing.get("inject_us")
                r["evs_retired_where"] = dict(collections.Counter(
                    "p%dt1s%s" % crossing["where"].get(ev, (-1, "?")) for ev in mine))
            r["retired_by_reason"] = dict(collections.Counter(e["reason"] for e in retired))
            r["engine"] = {k: mstats[k] for k in ("tx_pkts", "rtx_pkts", "rtx_timeout", "rtx_sack",
                                                  "timeouts") if k in mstats}
            r["probe_ok_during_fault"] = sum(1 for e in hist if e.get("reason") == "PROBE_OK"
                                             and fault_ns <= e["ts_ns"] < heal_ns)
            r["probe_ok_after_heal"] = sum(1 for e in hist if e.get("reason") == "PROBE_OK"
                                           and e["ts_ns"] >= heal_ns)
            r["back_after_heal_s"] = (back_ns - heal_ns) / 1e9 if back_ns and prober else None
            r["prober"] = prober
        res["flows"][name] = r
    csvp = os.path.join(out, "failover.csv")
    with open(csvp, "w") as f:
        f.write("t_s,mrc_bps,tcp_bps,mptcp_bps\n")
        for (t, a), (_, b), (_, c) in zip(series["mrc"], series["tcp"], series["mptcp"]):
            f.write("%.4f,%.0f,%.0f,%.0f\n" % (t, a, b, c))
    res["csv"] = csvp
    res["png"] = plot(series, fs, hs, t1, out, getattr(args, "note", None))
    return res


def plot(series, fs, hs, t1, out, note=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, az) = plt.subplots(2, 1, figsize=(10, 7))
    for name, s in series.items():
        m = moving(s, 200)
        ax.plot([t - fs for t, _ in m], [v / 1e9 for _, v in m], label=name.upper(), lw=1)
        z = [(t, v) for t, v in moving(s) if fs - 0.01 <= t <= fs + 0.05]
        az.plot([(t - fs) * 1e3 for t, _ in z], [v / 1e9 for _, v in z], label=name.upper(), lw=1)
    for a in (ax,):
        a.axvline(0, color="red", ls="--", lw=0.8, label="%s blackholed" % t1)
        a.axvline(hs - fs, color="green", ls="--", lw=0.8, label="healed")
    az.axvline(0, color="red", ls="--", lw=0.8)
    ax.set_xlabel("seconds from the fault")
    az.set_xlabel("milliseconds from the fault (zoom)")
    ax.set_ylabel("goodput, Gbit/s (20 ms average)")
    az.set_ylabel("goodput, Gbit/s (1 ms average)")
    for a in (ax, az):
        a.grid(alpha=0.3)
        a.legend(loc="upper right", fontsize=8)
    ax.set_title("One MRC QP vs one TCP flow vs one MPTCP connection, T1 blackhole (ecmp lab, 100 us samples)")
    if note:            # what machine, how to rerun (tools/evaluate.py)
        fig.text(0.01, 0.005, note, fontsize=7, color="0.3")
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    p = os.path.join(out, "failover.png")
    fig.savefig(p, dpi=110)
    return p


# ---------------------------------------------------------------- scenario 2

def run_loss_one_ev(args):
    from mrc_xdp.transport import conns
    from mrc_xdp import transport
    from mrc_xdp.lab import fabric, hosts, topology
    from mrc_xdp.lab import linkmodel as lmod
    import random
    prefix = "bg%d-" % (os.getpid() % 100000)
    st = fabric.up(topology.load(mode="srv6"), prefix=prefix, hosts_hook=hosts.fabric_hook)
    eps = {}
    try:
        topo = fabric.topology_of(st)
        lm = lmod.LinkModel.open(st["pin_dir"])
        rng = random.Random(16)
        place = [(0, 0)] * 7 + [(0, 1)] + [(1, 0)] * 4 + [(1, 1)] * 4
        evs = [[rng.getrandbits(31) | 0x10000, p, t] for p, t in place]
        backup = [[rng.getrandbits(31) | 0x10000, p, 0] for p in (0, 0, 1, 1)]
        for h in ("h0", "h2"):
            eps[h] = transport.Endpoint(prefix + h)
        ql, qr = 0x7001, 0x7002
        fwd = "%s>p0t1s1" % topo.t0_name(0, topo.host("h0").t0)       # h0's data towards T1 1
        lossy = next(rx.ifindex for n, rx, _, _ in topo.link_ends() if n == fwd)
        results = {"no fault": [], "20% loss on one EV's path": []}
        from mrc_xdp.datapath.maps import Instance
        for rnd in range(args.rounds):           # interleaved: the machine's load drifts
            for phase in results:
                # a fresh connection each time: the EV layout above, nothing retired
                conns.add(prefix + "h0", topo.host("h2").addr, ql, qr, name="loss1of16", ev_per_plane=8,
                          backup_per_plane=2, t1s=2, evs=evs, backup_evs=backup)
                if phase != "no fault":
                    lm.update(lossy, loss_ppm=200_000)
                mrc = MrcFlow(eps["h0"], eps["h2"], ql, qr)
                mrc.t.start()
                time.sleep(0.3)
                a, ta = mrc.rx_bytes(), time.monotonic()
                time.sleep(args.loss_seconds)
                b, tb = mrc.rx_bytes(), time.monotonic()
                st_ = mrc.qs.stats()
                mrc.close()
                lm.update(lossy, loss_ppm=0)
                with Instance(prefix + "h0") as i:
                    rows = [r for r in i.ev_table() if r["conn_name"] == "loss1of16"]
                conns.remove(prefix + "h0", topo.host("h2").addr, ql)
                results[phase].append({"goodput_bps": (b - a) * 8 / (tb - ta), "rtx_pkts": st_["rtx_pkts"],
                                       "tx_pkts": st_["tx_pkts"],
                                       "retired": [hex(r["ev"]) for r in rows if r["state"] == "ASSUMED_BAD"]})
        lm.close()
        return results
    finally:
        for ep in eps.values():
            ep.close()
        fabric.down(prefix, unload_hosts=hosts.unload_all)


def fmt_s(v, unit="ms"):
    if v is None:
        return "never (in the window)"
    return "%.3f ms" % (v * 1e3) if unit == "ms" else "%.3f s" % v


def main(argv=None):
    ap = argparse.ArgumentParser(epilog="method and latest figures: docs/benchmarks.md (section \"Failover\")", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench_failover"))
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--fault", type=float, default=2.0, help="seconds the T1 stays blackholed")
    ap.add_argument("--after", type=float, default=1.5, help="seconds after the heal")
    ap.add_argument("--loss-seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=3, help="scenario 2: interleaved rounds")
    ap.add_argument("--pace", type=float, default=300,
                    help="Mbit/s cap of the TCP and MPTCP senders (SO_MAX_PACING_RATE; 0 = none): on a "
                    "2-core machine uncapped Python TCP starves the MRC engine of CPU")
    ap.add_argument("--timestamps", type=int, choices=[0, 1], default=1,
                    help="MRC engines stamp TSETH (1: the datapath's time-based loss rule "
                         "judges SACK holes; 0: the PSN-distance fallback)")
    ap.add_argument("--skip", choices=["failover", "loss"], action="append", default=[])
    ap.add_argument("--role", help=argparse.SUPPRESS)
    for k in ("ns", "addr", "src", "proto", "shm", "log"):
        ap.add_argument("--" + k, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--slot", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "sink":
        return role_sink(a)
    if a.role == "source":
        return role_source(a)
    if os.geteuid() != 0:
        print("bench_failover: needs root (lab namespaces, BPF)", file=sys.stderr)
        return 1
    os.makedirs(a.out, exist_ok=True)
    summary = {}
    if "failover" not in a.skip:
        r = run_failover(a, a.out)
        summary["failover"] = r
        print("scenario 1: %s blackholed for %.1f s (ecmp lab, IPv6)" % (r["t1"], a.fault))
        print("%-6s %12s %12s %14s %16s %16s %14s %s" % (
            "flow", "before", "first 10ms", "detect", "90% (fault)", "90% (report)", "retransmitted", "EVs back"))
        for name, f in r["flows"].items():
            back = ""
            if name == "mrc":
                back = ("%s after heal (%d EVs retired)" % (fmt_s(f["back_after_heal_s"]), f["evs_retired"])
                        if f["prober"] else "n/a: no prober (%d EVs retired)" % f["evs_retired"])
            print("%-6s %7.3f Gb/s %7.3f Gb/s %14s %16s %16s %12d B  %s" % (
                name, f["goodput_before_bps"] / 1e9, (f["goodput_first_10ms_bps"] or 0) / 1e9,
                fmt_s(f["detect_s"]), fmt_s(f["recover_from_fault_s"]), fmt_s(f["recover_from_report_s"]),
                f["bytes_retransmitted"], back))
        m, t = r["flows"]["mrc"], r["flows"]["tcp"]
        print("MRC: EVs retired %d, EVs that cross the fault %d (retired during the fault: %d, of them not "
              "crossing it %d; by path %s); by reason %s; first EV retired %s after the fault (blackholing the "
              "T1's link ends took %s)" % (
                  m["evs_retired"], m["evs_crossing"], m["evs_retired_fault"], m["evs_retired_not_crossing"],
                  ", ".join("%s %d" % kv for kv in sorted(m.get("evs_retired_where", {}).items())) or "none",
                  ", ".join("%s %d" % kv for kv in sorted(m["retired_by_reason"].items())) or "none",
                  "n/a" if m["detect_s"] is None else "%.0f us" % (m["detect_s"] * 1e6),
                  "n/a" if m.get("inject_us") is None else "%.0f us" % m["inject_us"]))
        print("MRC engine: %s; EVs resurrected by probes during the fault %d, after the heal %d" % (
            ", ".join("%s %d" % kv for kv in m["engine"].items()), m["probe_ok_during_fault"],
            m["probe_ok_after_heal"]))
        if m["recover_from_fault_s"] is not None and t["recover_from_fault_s"] is not None:
            print("MRC recovered %.0fx faster than TCP" % (t["recover_from_fault_s"] / max(m["recover_from_fault_s"], 1e-6)))
        print("time series: %s\nplot: %s" % (r["csv"], r["png"]))
    if "loss" not in a.skip:
        r2 = run_loss_one_ev(a)
        summary["loss"] = r2
        nf, lf = r2["no fault"], r2["20% loss on one EV's path"]
        ratios = sorted(x["goodput_bps"] / y["goodput_bps"] for x, y in zip(lf, nf))
        print("scenario 2: 20%% loss on the path of 1 EV of 16 (srv6 lab), %d interleaved rounds of %.1f s:"
              % (a.rounds, a.loss_seconds))
        for x, y in zip(nf, lf):
            print("  no fault %.3f Gb/s   with the loss %.3f Gb/s (%.1f%%; retransmitted %d of %d packets; "
                  "retired %s)" % (x["goodput_bps"] / 1e9, y["goodput_bps"] / 1e9,
                                   100 * y["goodput_bps"] / x["goodput_bps"], y["rtx_pkts"], y["tx_pkts"],
                                   ",".join(y["retired"]) or "none"))
        print("  median ratio %.1f%%" % (100 * ratios[len(ratios) // 2]))
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
