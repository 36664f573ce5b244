"""`mrc-xdp demo`: MRC on a lab fabric, explained as it runs.

Brings up the default lab (2 planes x 2 T0 + 2 T1, 4 hosts) with the real datapath on
every host, sends a stream of RDMA-Write frames h0 -> h2 that h2 answers with SACKs,
shows how the packets are sprayed over all four paths, fails a T1 switch midway and
shows the datapath retiring exactly the EVs (paths) through it while traffic goes on
over the others, then tears the lab down.  Every figure printed is read live from the
BPF maps: the link models' per-link counters and h0's pinned EV table and event ring.
"""
from __future__ import annotations

import sys
import threading
import time

from . import bpfsys
from .lab import cli as labcli
from .lab import fabric, hosts, topology
from .lab import linkmodel as lmod
from .maps import Instance
from .shared import EvReason, EvState, ffi
from .traffic import Receiver, Sender

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


def _traffic(prefix, topo, n, pps):
    s, d = topo.host(SRC), topo.host(DST)
    rx = Receiver("mrc0", d.addr, {(s.addr, hosts.qpn(d.index, s.index)): hosts.qpn(s.index, d.index)},
                  ns=prefix + DST, max_seconds=120, trimmed_dscp=topo.linkmodel.dscp_trimmed).start()
    tx = Sender("mrc0", s.addr, d.addr, hosts.qpn(d.index, s.index), ns=prefix + SRC, payload=1024)
    return rx, tx


def run(args) -> None:
    mode = getattr(args, "mode", "srv6")
    n = max(2000, getattr(args, "packets", 20000))
    pps = 20000
    _p("MRC (Multipath Reliable Connection) is the RDMA transport of large AI clusters. A NIC")
    _p("running MRC sends every packet of one connection down a different path (an \"entropy")
    _p("value\", EV) of a multi-plane fabric, and when feedback says a path is congested or")
    _p("broken it stops using that path at once, in the datapath. Here XDP programs do that")
    _p("job on ordinary Linux hosts, on a lab fabric of network namespaces.")
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
        with lmod.LinkModel.open(st["pin_dir"]) as lm, Instance(PREFIX + SRC) as inst:
            _demo(topo, lm, inst, n, pps, mode)
    finally:
        if getattr(args, "keep", False):
            _p("\n[5/5] leaving the lab up (--keep): `mrc-xdp lab status --prefix %s`, "
               "`mrc-xdp lab down --prefix %s`" % (PREFIX, PREFIX))
        else:
            t0 = time.monotonic()
            fabric.down(PREFIX, unload_hosts=hosts.unload_all)
            _p("\n[5/5] lab torn down in %.1f s (namespaces, programs and pins removed)" % (time.monotonic() - t0))


def _demo(topo, lm, inst, n, pps, mode):
    d = topo.host(DST)
    _p("\n[2/5] h0 sends %d RDMA-Write packets to %s (%s); a receiver on h2 answers each one with" % (n, DST, d.addr))
    _p("      a SACK that echoes the EV the packet travelled on.")
    base_paths, base_evs = _paths(topo, lm), _ev_rows(inst)
    rx, tx = _traffic(PREFIX, topo, n, pps)
    try:
        tx.send(n, pps=pps)
        time.sleep(0.5)
    finally:
        rx.stop()
        tx.close()
    paths = _paths(topo, lm, base_paths)
    _p("      sent %d, received %d, SACKs sent %d. Where the packets went (per-link counters of the" % (
        tx.sent, rx.frames, rx.sacks))
    _p("      fabric's uplinks out of h0's T0 switch, not h0's own bookkeeping):")
    _print_paths(paths)
    _p("      Every packet got the next EV of a pseudo-random rotation; planes alternate, so each")
    _p("      plane carries exactly half. The EVs of connection h0 -> h2:")
    after1 = _ev_rows(inst)
    _print_evs(after1, base_evs, mode)
    if mode == "ecmp":
        _p("      (ecmp mode: each T0 hashes an EV onto one of its T1s; at lab up every host probed")
        _p("      candidate EVs to learn which T1 each one takes, and kept equal numbers per T1.)")

    _p("\n[3/5] now T1 switch %s (plane 0) fails: every packet into it is dropped (blackhole)." % FAIL)
    _p("      h0 is not told. It sees holes in h2's SACK bitmaps, looks up which EV carried each")
    _p("      lost PSN, and retires that EV in the datapath (ASSUMED_BAD), putting a backup EV of")
    _p("      the SAME plane in its place so both planes stay equally loaded.")
    base_paths = _paths(topo, lm)
    rx, tx = _traffic(PREFIX, topo, n, pps)
    t_fail = [0]
    events = []

    def on_event(raw):
        e = ffi.cast("struct mrc_event *", ffi.from_buffer(raw))
        events.append((e.ts_ns, e.ev, e.plane, 0, EvState(e.old_state).name, EvState(e.new_state).name, EvReason(e.reason).name, e.other_ev))

    ring = bpfsys.RingReader(inst.map("mrc_events").fd, on_event)
    while ring.poll(0) > 0:       # drop events from phase 2 (SKIP churn, if any)
        pass
    events.clear()
    try:
        sender = threading.Thread(target=tx.send, args=(n,), kwargs={"pps": pps}, daemon=True)
        sender.start()
        time.sleep(0.25 * n / pps)                 # a quarter of the stream on the healthy fabric
        t_fail[0] = time.monotonic_ns()
        labcli.fail(PREFIX, FAIL)
        while sender.is_alive():
            ring.poll(50)
        sender.join()
        time.sleep(0.5)
        while ring.poll(10) > 0:
            pass
    finally:
        rx.stop()
        tx.close()
        ring.close()
    paths = _paths(topo, lm, base_paths)
    retired = [e for e in events if e[5] == "ASSUMED_BAD"]
    _p("      sent %d, received %d (%.1f%%), SACKs %d." % (tx.sent, rx.frames, 100.0 * rx.frames / max(tx.sent, 1), rx.sacks))
    if retired:
        first, last = retired[0][0], retired[-1][0]
        _p("      first EV retired %.2f ms after the failure, the last one %.2f ms after it; %d EVs" % (
            (first - t_fail[0]) / 1e6, (last - t_fail[0]) / 1e6, len(retired)))
        _p("      retired, %d backups promoted, no operator and no user space in the loop." % (
            sum(1 for e in events if e[6] == "REPLACED")))
    else:
        _p("      no EV was retired: the stream may have been too short to see losses.")
    _p("      Packets per path during this phase (the failed T1 stops receiving them):")
    _print_paths(paths)
    after2 = _ev_rows(inst)
    _p("\n[4/5] EV table of h0 -> h2 after the failure (packets during phase 3):")
    _print_evs(after2, after1, mode)
    bad = [r for r in after2 if r["state"] == "ASSUMED_BAD"]
    via_failed = bad and all(r["plane"] == 0 and r["t1"] == 1 for r in bad)
    _p("      %d EVs ASSUMED_BAD%s, every one of them in plane 0; plane 1 never noticed." % (
        len(bad), ", all through T1 1 (%s)" % ("the T1 their uSID path names" if mode == "srv6"
                                               else "the T1 probing mapped them to") if via_failed else ""))
    _p("      Resurrecting retired EVs once the path heals is the control plane's job (probes,")
    _p("      or `mrc-xdp ev allow EV`); the datapath never puts one back by itself.")
    labcli.heal(PREFIX, FAIL)


if __name__ == "__main__":
    class A:
        mode, packets, keep = (sys.argv[1] if len(sys.argv) > 1 else "srv6"), 20000, False
    run(A)
