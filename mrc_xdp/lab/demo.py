"""`mrc-xdp demo`: MRC on a lab fabric, explained as it runs.

Brings up the default lab (2 planes x 2 T0 + 2 T1, 4 hosts) with the real datapath on
every host and a transport engine endpoint (AF_XDP) on h0 and h2, RDMA-Writes a real
buffer h0 -> h2 over one queue pair and shows how its packets were sprayed over all four
paths, then writes a bigger one and fails a T1 switch midway: the datapath retires
exactly the EVs (paths) through it, the engine retransmits what was lost, and the
buffer arrives intact (sha256 on both sides), with a goodput time line around the
failure and how fast the datapath reacted (from the fault's injection to the first and
the last EV retired, by the datapath's own event timestamps).  Then it tears the lab
down.  Every figure printed is read live: the link models' per-link counters, h0's
pinned EV table and event ring, the engine's per-QP counters and completions.

``failover()`` is phase 3 as a library call (tests run it on a lab of their own).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import time

from mrc_xdp.datapath import bpfsys
from mrc_xdp.lab import fabric, hosts, topology
from mrc_xdp.lab import linkmodel as lmod
from mrc_xdp.datapath.maps import Instance
from mrc_xdp.datapath.shared import EvReason, EvState, ffi

PREFIX = "mrcdemo-"
SRC, DST = "h0", "h2"
FAIL = "p0t1s1"        # plane 0, T1 number 1


def _p(msg: str = "") -> None:
    print(msg, flush=True)


def _bar(frac: float, width: int = 30) -> str:
    n = int(round(frac * width))
    return "#" * n + "." * (width - n)


def _paths(topo, lm, base=None):
    """Packets on each of the 4 uplinks out of h0's T0 (plane, T1) -> count since base."""
    t0 = topo.host(SRC).t0
    out = {}
    ends = {name: rx for name, rx, _, _ in topo.link_ends()}
    for p in range(topo.planes):
        for j in range(topo.t1_per_plane):
            name = "%s>%s" % (topo.t0_name(p, t0), topo.t1_name(p, j))
            out[(p, j)] = lm.counters(ends[name].ifindex)["mrc_pkts"]
    if base:
        out = {k: v - base.get(k, 0) for k, v in out.items()}
    return out


def _print_paths(paths) -> None:
    tot = sum(paths.values()) or 1
    _p("    path (plane, T1)        packets  share")
    for (p, j), n in sorted(paths.items()):
        _p("    plane %d via T1 %d  %12d  %5.1f%%  %s" % (p, j, n, 100.0 * n / tot, _bar(n / tot)))


def _print_evs(rows, base=None, mode="srv6") -> None:
    """srv6: the EV names its T1; ecmp: the T1 the switches' hash sends it to, learnt by
    probing at lab up."""
    base = {r["ev"]: r["tx_pkts"] for r in (base or [])}
    _p("    EV          plane T1 role    state        packets  why")
    for r in rows:
        if r["role"] == "backup" and r["tx_pkts"] == base.get(r["ev"], 0) and r["state"] == "GOOD":
            continue     # unused spare
        _p("    %#010x    %d   %s  %-6s  %-11s %8d  %s" % (
            r["ev"], r["plane"], r["t1"], r["role"], r["state"], r["tx_pkts"] - base.get(r["ev"], 0),
            "" if r["reason"] in ("NONE", "REPLACED") else r["reason"].lower()))


def _ev_rows(inst):
    return [r for r in inst.ev_table() if r["conn_name"] == DST]


class _Transfer:
    """One QP h0 -> h2 on the lab's QPNs: RDMA-Write a random buffer in CHUNK-sized
    Writes (the last with immediate data), with a time line of the bytes acknowledged.

    The time line is read from h0's completions (a Write completes once h2 has
    acknowledged every byte of it), by a loop that does nothing else: the Writes are
    posted by a thread of their own, because posting takes the engine's lock and can
    wait there behind a busy progress thread for as long as the transfer runs (a fresh
    machine's demo showed no sample until 90% had arrived).  Completions are read
    without that lock.  CHUNK sets the time line's resolution."""

    CHUNK = 1 << 18

    def __init__(self, topo, ep_s, ep_d, size):
        s, d = topo.host(SRC), topo.host(DST)
        self.ep_s, self.ep_d, self.size = ep_s, ep_d, size
        self.data = bytearray(os.urandom(size))
        self.dbuf = bytearray(size)
        self.qs = ep_s.create_qp(qpn=hosts.qpn(s.index, d.index))
        self.qd = ep_d.create_qp(qpn=hosts.qpn(d.index, s.index))
        self.ms, self.md = ep_s.reg_mr(self.data), ep_d.reg_mr(self.dbuf)
        self.qs.connect(self.qd.local_attrs())
        self.qd.connect(self.qs.local_attrs())
        self.samples = []            # (monotonic s, bytes acknowledged)
        self.fired_at = None         # bytes acknowledged when the action ran

    def _post(self, n, failed):
        try:
            for k in range(n):
                off = k * self.CHUNK
                self.qs.post_write(k, self.ms, off, min(self.CHUNK, self.size - off), self.md.addr + off,
                                   self.md.rkey, imm=n if k == n - 1 else None)
        except Exception as e:       # the sampling loop reports it
            failed.append(e)

    def run(self, at_fraction=None, action=None, timeout=120.0):
        n = (self.size + self.CHUNK - 1) // self.CHUNK
        failed = []
        poster = threading.Thread(target=self._post, args=(n, failed), name="demo-post", daemon=True)
        t0 = time.monotonic()
        self.samples.append((t0, 0))
        poster.start()
        done = acked = 0
        fired = False
        try:
            while done < n:
                if failed:
                    raise RuntimeError("demo: posting the writes failed: %s" % failed[0])
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError("demo: the transfer stalled (%d of %d writes acknowledged)" % (done, n))
                got = self.ep_s.cq.wait_blocking(timeout=0.005, max_n=256)
                now = time.monotonic()
                for c in got:
                    if not c.ok:
                        raise RuntimeError("demo: a write completed with %s" % c.status.name)
                    acked += min(self.CHUNK, self.size - c.wr_id * self.CHUNK)
                    done += 1
                if got:
                    self.samples.append((now, acked))
                if action and not fired and acked >= at_fraction * self.size:
                    fired, self.fired_at = True, acked
                    action()
        finally:
            poster.join()
        self.seconds = time.monotonic() - t0
        imm = None
        end = time.monotonic() + 5
        while imm is None and time.monotonic() < end:
            for c in self.ep_d.cq.poll(16):
                if c.opcode == 1:
                    imm = c.imm
            time.sleep(0.002)
        self.imm = imm
        self.tx, self.rx = self.qs.stats(), self.qd.stats()
        self.sha_s = hashlib.sha256(self.data).hexdigest()
        self.sha_d = hashlib.sha256(self.dbuf).hexdigest()
        return self

    def close(self):
        for q in (self.qs, self.qd):
            q.destroy()
        self.ms.dereg()
        self.md.dereg()


def timeline(samples, buckets=16) -> list:
    """The goodput time line of samples [(monotonic s, bytes so far)]: `buckets` equal
    intervals from the first sample to the last, each (start s, end s, bytes in it),
    the bytes a sample adds counted in the interval it was taken in."""
    t0, t1 = samples[0][0], samples[-1][0]
    width = max((t1 - t0) / buckets, 0.01)
    got = [0] * buckets
    for (_, a), (t, b) in zip(samples, samples[1:]):
        got[min(int((t - t0) / width), buckets - 1)] += b - a
    return [(k * width, (k + 1) * width, got[k]) for k in range(buckets)]


def _print_timeline(rows, t_fail) -> None:
    """A bar per interval, Mbit/s, the failure (seconds from the start) marked."""
    mbps = [b * 8 / (hi - lo) / 1e6 for lo, hi, b in rows]
    peak = max(mbps) or 1
    for (lo, hi, b), m in zip(rows, mbps):
        mark = "  <- T1 fails" if t_fail is not None and lo <= t_fail < hi else ""
        _p("    %6.0f-%-6.0f ms %8.1f Mbit/s  %s%s" % (lo * 1000, hi * 1000, m, _bar(m / peak, 40), mark))


def _fault_ends(topo, node):
    """The receiving port of every link end into and out of a node (`lab fail` of it)."""
    return [rx for name, rx, tx, lk in topo.link_ends() if node in (lk.a.node, lk.b.node)]


def failover(topo, lm, inst, ep_s, ep_d, size, fail_node=FAIL, at_fraction=0.3) -> dict:
    """Phase 3: h0 RDMA-Writes `size` bytes to h2 and, once at_fraction of them are
    acknowledged, fail_node fails (every link end into and out of it blackholed through
    the link model, lm); its ends' earlier configs are restored before returning.  Returns the finished
    _Transfer ("transfer", closed), the time line ("timeline": timeline() rows, "t_fail"
    seconds into it), the injection ("inject_ns": CLOCK_MONOTONIC just before the first
    end was blackholed, "inject_us": how long blackholing every end took, "fired_at":
    bytes acknowledged then), h0's EV events during the phase ("events": dicts) and the
    reaction ("retired": the ASSUMED_BAD events after the injection; "first_us",
    "last_us": their datapath timestamps minus inject_ns, None if none)."""
    # each end's config before and during the fault, made before the clock starts: the
    # injection is then one map write per end
    saved = {rx.ifindex: lm.get(rx.ifindex) for rx in _fault_ends(topo, fail_node)}
    dead = {i: dict(c, blackhole=True) for i, c in saved.items()}
    events = []

    def on_event(raw):
        e = ffi.cast("struct mrc_event *", ffi.from_buffer(raw))
        events.append({"ts_ns": e.ts_ns, "ev": e.ev, "plane": e.plane, "old": EvState(e.old_state).name,
                       "new": EvState(e.new_state).name, "reason": EvReason(e.reason).name,
                       "other_ev": e.other_ev})

    inject = {}

    def fail():
        # the datapath stamps events with bpf_ktime_get_ns(): CLOCK_MONOTONIC
        inject["t"] = time.monotonic()
        inject["ns"] = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        for i, c in dead.items():
            lm.set(i, c, reset=False)
        inject["done_ns"] = time.clock_gettime_ns(time.CLOCK_MONOTONIC)

    ring = bpfsys.RingReader(inst.map("mrc_events").fd, on_event)
    try:
        while ring.poll(0) > 0:       # drop earlier events (phase 2's SKIP churn, if any)
            pass
        events.clear()
        x = _Transfer(topo, ep_s, ep_d, size)
        try:
            x.run(at_fraction=at_fraction, action=fail)
        finally:
            x.close()
            for i, c in saved.items():
                lm.set(i, c, reset=False)
        while ring.poll(10) > 0:
            pass
    finally:
        ring.close()
    t_ns = inject.get("ns")
    retired = sorted((e for e in events if e["new"] == "ASSUMED_BAD" and t_ns is not None and e["ts_ns"] >= t_ns),
                     key=lambda e: e["ts_ns"])       # (CPUs' events may interleave in the ring)
    return {"transfer": x, "timeline": timeline(x.samples),
            "t_fail": inject["t"] - x.samples[0][0] if inject else None,
            "inject_ns": t_ns, "inject_us": (inject["done_ns"] - t_ns) / 1000 if inject else None,
            "fired_at": x.fired_at, "events": events, "retired": retired,
            "first_us": (retired[0]["ts_ns"] - t_ns) / 1000 if retired else None,
            "last_us": (retired[-1]["ts_ns"] - t_ns) / 1000 if retired else None}


def run(args) -> None:
    mode = getattr(args, "mode", "srv6")
    n = max(2000, getattr(args, "packets", 20000))
    _p("MRC (Multipath Reliable Connection) is the RDMA transport of large AI clusters. A NIC")
    _p("running MRC sends every packet of one connection down a different path (an \"entropy")
    _p("value\", EV) of a multi-plane fabric, and when feedback says a path is congested or")
    _p("broken it stops using that path at once, in the datapath. Here XDP programs do that")
    _p("job on ordinary Linux hosts, on a lab fabric of network namespaces, and a transport")
    _p("engine over AF_XDP makes it a reliable connection: lost packets are retransmitted.")
    _p()
    topo = topology.load(mode=mode)
    if fabric.running(PREFIX):
        _p("[setup] a previous demo lab is still up: taking it down first")
        fabric.down(PREFIX, unload_hosts=hosts.unload_all)
    _p("[1/5] building the lab (%s mode): %d planes, each with %d T0 and %d T1 switches; hosts %s"
       % (mode, topo.planes, topo.t0_per_plane, topo.t1_per_plane, ", ".join(h.name for h in topo.hosts)))
    t0 = time.monotonic()
    st = fabric.up(topo, prefix=PREFIX, progress=lambda m: _p("      " + m), hosts_hook=hosts.fabric_hook)
    _p("      lab up in %.1f s; every host runs the MRC datapath (spray + ingress XDP)" % (time.monotonic() - t0))
    topo = fabric.topology_of(st)
    try:
        from mrc_xdp import transport
        with lmod.LinkModel.open(st["pin_dir"]) as lm, Instance(PREFIX + SRC) as inst, \
                transport.Endpoint(PREFIX + SRC) as ep_s, transport.Endpoint(PREFIX + DST) as ep_d:
            _demo(topo, lm, inst, n, mode, ep_s, ep_d)
    finally:
        if getattr(args, "keep", False):
            _p("\n[5/5] leaving the lab up (--keep): `mrc-xdp lab status --prefix %s`, "
               "`mrc-xdp lab down --prefix %s`" % (PREFIX, PREFIX))
        else:
            t0 = time.monotonic()
            fabric.down(PREFIX, unload_hosts=hosts.unload_all)
            _p("\n[5/5] lab torn down in %.1f s (namespaces, programs and pins removed)" % (time.monotonic() - t0))


def _demo(topo, lm, inst, n, mode, ep_s, ep_d):
    d = topo.host(DST)
    size = (n * ep_s.payload) // (1 << 20) * (1 << 20) or (1 << 20)
    _p("\n[2/5] h0 RDMA-Writes a %d MiB buffer into h2's memory (%s) over one queue pair: the" % (size >> 20, d.addr))
    _p("      engine on h0 cuts it into %d-byte packets; the datapath sprays them; the engine on h2" % ep_s.payload)
    _p("      places each one at its address and answers with SACKs that echo the packet's EV.")
    base_paths, base_evs = _paths(topo, lm), _ev_rows(inst)
    x = _Transfer(topo, ep_s, ep_d, size).run()
    x.close()
    paths = _paths(topo, lm, base_paths)
    _p("      %d MiB in %.2f s (%.0f Mbit/s), %d packets sent, %d retransmitted; sha256 %s on" % (
        size >> 20, x.seconds, size * 8 / x.seconds / 1e6, x.tx["tx_pkts"], x.tx["rtx_pkts"], x.sha_s[:16]))
    _p("      h0, %s on h2: %s. Where the packets went (per-link counters of the fabric's" % (
        x.sha_d[:16], "intact" if x.sha_s == x.sha_d else "CORRUPTED"))
    _p("      uplinks out of h0's T0 switch, not h0's own bookkeeping):")
    _print_paths(paths)
    _p("      Every packet got the next EV of a pseudo-random rotation; planes alternate, so each")
    _p("      plane carries exactly half. The EVs of connection h0 -> h2:")
    after1 = _ev_rows(inst)
    _print_evs(after1, base_evs, mode)
    if mode == "ecmp":
        _p("      (ecmp mode: each T0 hashes an EV onto one of its T1s; at lab up every host probed")
        _p("      candidate EVs to learn which T1 each one takes, and kept equal numbers per T1.)")

    big = 4 * size
    _p("\n[3/5] h0 writes a %d MiB buffer, and when 30%% of it has been acknowledged T1 switch %s" % (big >> 20, FAIL))
    _p("      (plane 0) fails: every packet into it is dropped (blackhole). h0 is not told. Its datapath")
    _p("      sees holes in h2's SACK bitmaps, looks up which EV carried each lost PSN, and retires")
    _p("      that EV (ASSUMED_BAD), putting a backup EV of the SAME plane in its place; the engine")
    _p("      retransmits the lost packets on the paths that work.")
    base_paths = _paths(topo, lm)
    fo = failover(topo, lm, inst, ep_s, ep_d, big)
    x, events, retired = fo["transfer"], fo["events"], fo["retired"]
    paths = _paths(topo, lm, base_paths)
    _p("      %d MiB in %.2f s; sha256 %s on h0, %s on h2: %s (immediate data %s)." % (
        big >> 20, x.seconds, x.sha_s[:16], x.sha_d[:16],
        "the buffer arrived INTACT" if x.sha_s == x.sha_d else "CORRUPTED", x.imm))
    tx = x.tx
    _p("      %d packets sent, %d retransmitted (%.2f%%): %d found lost in SACK bitmaps, %d by timeout," % (
        tx["tx_pkts"], tx["rtx_pkts"], 100.0 * tx["rtx_pkts"] / max(tx["tx_pkts"], 1), tx["rtx_sack"], tx["rtx_timeout"]))
    _p("      %d after NACK TRIMMED; RTO expiries %d, smoothed RTT %.0f us." % (
        tx["rtx_nack_trim"], tx["timeouts"], tx["srtt_ns"] / 1000))
    if fo["inject_ns"] is None:
        _p("      the transfer ended before 30%% was acknowledged: no fault was injected.")
    elif retired:
        _p("      Reaction, by the datapath's event timestamps from the fault's injection (blackholing")
        _p("      its %d link ends took %.0f us): first EV retired after %.0f us, the last after %.0f us;" % (
            len(_fault_ends(topo, FAIL)), fo["inject_us"], fo["first_us"], fo["last_us"]))
        _p("      %d EVs retired, %d backups promoted, no operator and no user space in the loop." % (
            len(retired), sum(1 for e in events if e["reason"] == "REPLACED")))
    else:
        _p("      no EV was retired: the transfer may have been too short to see losses.")
    _p("      Goodput (bytes h2 acknowledged, as h0's completed Writes) around the failure:")
    _print_timeline(fo["timeline"], fo["t_fail"])
    _p("      Packets per path during this phase (the failed T1 stops receiving them):")
    _print_paths(paths)
    after2 = _ev_rows(inst)
    _p("\n[4/5] EV table of h0 -> h2 after the failure (packets during phase 3):")
    _print_evs(after2, after1, mode)
    bad = [r for r in after2 if r["state"] == "ASSUMED_BAD"]
    planes = sorted({r["plane"] for r in bad})
    via_failed = bad and all(r["plane"] == 0 and r["t1"] == 1 for r in bad)
    _p("      %d EVs ASSUMED_BAD, in plane%s %s%s." % (
        len(bad), "s" if len(planes) > 1 else "", ", ".join(map(str, planes)) or "-",
        ", all through T1 1 (%s)" % ("the T1 their uSID path names" if mode == "srv6"
                                     else "the T1 probing mapped them to") if via_failed else ""))
    _p("      Resurrecting retired EVs once the path heals is the control plane's job (probes,")
    _p("      or `mrc-xdp ev allow EV`); the datapath never puts one back by itself.")


if __name__ == "__main__":
    class A:
        mode, packets, keep = (sys.argv[1] if len(sys.argv) > 1 else "srv6"), 20000, False
    run(A)
