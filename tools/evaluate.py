#!/usr/bin/env python3
"""The evaluation: the experiment suite on the netns lab, written up as results/REPORT.md
with PNG plots.

    sudo .venv/bin/python tools/evaluate.py [--quick] [--only a,b,c,d,e,f,g,h] [--out DIR]
    make evaluate                       (the full run, into results/)

(a) multipath goodput of one MRC QP vs 1 and 4 TCP flows and MPTCP against the fabric
    capacity, ecmp and srv6 (tools/bench_transport.py part (b), link-model rates);
(b) failover time series around a T1 blackhole and the heal, MRC vs TCP vs MPTCP
    (tools/bench_failover.py scenario 1);
(c) goodput vs injected loss (0.1%, 1%, 20%) on one of the 4 paths h0 -> h2: one MRC QP
    (its EVs spread over the 4 paths) and one TCP flow whose ECMP path is the lossy one;
(d) a ring all-reduce among the 4 hosts (sum of float32 arrays, fixed-size chunks, result
    verified) over MRC (an Endpoint per host on its lab instance, QPs to the ring
    neighbours exchanged through mrc_xdp.transport.bootstrap) and over TCP sockets, time per
    iteration, healthy and with a T1 flapping;
(e) datapath ns/packet vs XDP_PASS and a bare forwarder (tools/bench_xdp.py);
(f) allreduce-perf tables, MRC vs gloo (and gloo over MPTCP), 1 KiB to 64 MiB, busbw against
    the host-to-host capacity on the rate-limited lab; the CPU-bound ratio unthrottled;
(g) DDP training throughput (examples/train_ddp.py), MRC vs gloo over TCP vs over MPTCP,
    rate-limited;
(h) job failures: the DDP job again and again under faults of a fixed-seed schedule,
    failed / slow / unaffected jobs per transport.
(f), (g), (h) are in tools/eval_jobs.py, which says what each transport had.

Running some parts into a directory that holds an earlier run's results.json keeps the
other parts' results (figures, plots, load averages) in REPORT.md as they were.

Each part writes what it measured, on what machine (cores, kernel, load average) and how
to rerun it.  Progress goes to stderr.  Nothing asserts a speed.  Labs and namespaces get
unique names and are removed at the end, also on error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

T_START = time.monotonic()
JOB_MTU = 3000          # (f, g, h): the lab topology's largest fabric MTU
LOSSES = [0.0, 0.001, 0.01, 0.20]
AR_PORT = 17300


def log(msg: str) -> None:
    print("[evaluate %5.0fs] %s" % (time.monotonic() - T_START, msg), file=sys.stderr, flush=True)


import eval_jobs  # noqa: E402  (parts f, g, h)
eval_jobs.log = log


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def machine() -> dict:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu": cpu, "kernel": platform.release(),
            "os": platform.freedesktop_os_release().get("PRETTY_NAME", "?") if hasattr(platform, "freedesktop_os_release") else "?",
            "loadavg_start": loadavg(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def plt_():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def footer(fig, text):
    fig.text(0.01, 0.005, text, fontsize=7, color="0.3", ha="left", va="bottom", wrap=True)


def bar_labels(ax, bars, vals, dy=0, **kw):
    """Each bar's value (%.0f) centred over it, dy above its top."""
    for b_, v in zip(bars, vals):
        ax.text(b_.get_x() + b_.get_width() / 2, v + dy, "%.0f" % v, ha="center", **kw)


# ================================================================== (a) multipath goodput

def part_a(args, res):
    import bench_transport as bt
    a = argparse.Namespace(rate=args.rate, seconds=2 if args.quick else 4, msg_size=1 << 20,
                           shape="no" if args.quick else "yes")
    o = {}
    bt.log = lambda m: log("(a) " + m.strip().removeprefix("(b) "))    # its part (b) is our (a)
    bt.part_b(a, o)
    r = o["b"]
    r["seconds"] = a.seconds
    res["a"] = r


def plot_a(plt, r, args):
    names = ["mrc_1qp", "tcp_1flow", "tcp_4flows", "mptcp_2subflows", "mptcp_4subflows"]
    labels = ["MRC, 1 QP", "TCP, 1 flow", "TCP, 4 flows", "MPTCP,\n1 subflow/plane", "MPTCP,\n2x2 mesh"]
    series = []
    for mode in ("ecmp", "srv6"):
        for cfg in ("linkmodel", "linkmodel+tbf"):
            row = r.get(mode, {}).get(cfg)
            if row:
                series.append(("%s, %s" % (mode, cfg), [row.get(n, {}).get("fraction") for n in names]))
    fig, ax = plt.subplots(figsize=(10, 5.2))
    w = 0.8 / max(len(series), 1)
    for i, (lab, vals) in enumerate(series):
        xs = [j + i * w for j, v in enumerate(vals) if v is not None]
        vs = [100 * v for v in vals if v is not None]
        bar_labels(ax, ax.bar(xs, vs, w, label=lab), vs, dy=1, fontsize=7)
    ax.set_xticks([j + w * (len(series) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(labels, fontsize=8)
    ax.axhline(100, color="k", ls="--", lw=0.8, label="fabric capacity h0 -> h2")
    ax.set_ylabel("goodput at the receiver, % of capacity")
    cap = r.get("ecmp", r.get("srv6", {})).get("capacity_bps", 0)
    ax.set_title("(a) h0 -> h2 goodput vs fabric capacity %.0f Mbit/s (4 paths x %s)" % (cap / 1e6, args.rate))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


# ================================================================== (b) failover

def part_b(args, res):
    import bench_failover as bf
    a = argparse.Namespace(warmup=1.0 if args.quick else 1.5, fault=1.0 if args.quick else 2.0,
                           after=1.0 if args.quick else 1.5, pace=300, timestamps=1, note=FOOT % "b")
    r = bf.run_failover(a, args.out)
    r["params"] = {k: v for k, v in vars(a).items() if k != "note"}
    m = r["flows"]["mrc"]
    log("(b) %s blackholed %.1f s: MRC EVs retired %d (during the fault %d), EVs that cross the fault %d, "
        "retired not crossing it %d; first EV retired %s after the fault" % (
            r["t1"], a.fault, m["evs_retired"], m["evs_retired_fault"], m["evs_crossing"],
            m["evs_retired_not_crossing"], "n/a" if m["detect_s"] is None else "%.0f us" % (m["detect_s"] * 1e6)))
    res["b"] = r


# ================================================================== shared lab for (c), (d)

class Lab:
    """The default lab (ecmp), its control path and a health daemon (probes bring
    retired EVs back)."""

    def __init__(self, mode="ecmp", mtu=None, tag=""):
        self.prefix = "ev%d%s-" % (os.getpid() % 100000, tag)
        self.mode = mode
        self.mtu = mtu          # fabric links' MTU (mrc0 gets 40 less), None: the topology's
        self.daemon = None
        self.tmp = tempfile.mkdtemp(prefix="evaluate-")

    def __enter__(self):
        from mrc_xdp.lab import ctlpath
        from mrc_xdp.health import daemon as health
        from mrc_xdp.datapath import netns
        from mrc_xdp.lab import fabric, hosts, topology
        from mrc_xdp.lab import linkmodel as lmod
        log("lab %s: bringing up the default topology (%s%s)" % (
            self.prefix, self.mode, ", fabric MTU %d" % self.mtu if self.mtu else ""))
        topo = topology.load(mode=self.mode)
        if self.mtu and self.mtu != topo.mtu:
            topo = dataclasses.replace(topo, mtu=self.mtu, app_mtu=self.mtu - topology.SRV6_OUTER_LEN)
        self.st = fabric.up(topo, prefix=self.prefix, hosts_hook=hosts.fabric_hook)
        self.topo = fabric.topology_of(self.st)
        self.lm = lmod.LinkModel.open(self.st["pin_dir"])
        self.ctl = ctlpath.lab_control_path(self.prefix, self.topo)
        for h in self.topo.hosts:     # a TCP flow keeps its path on RTO (as on hardware ECMP)
            netns.run(self.prefix + h.name, ctlpath._sysctl, "net.core.txrehash", "0")
        self.sock = os.path.join(self.tmp, "events.sock")
        cfgf = os.path.join(self.tmp, "daemon.toml")
        with open(cfgf, "w") as f:
            f.write('socket = "%s"\ninstances = ["%s*"]\n[probe]\ninterval_ms = 20\nok_needed = 3\n'
                    'backoff_max_ms = 100\nbackground_per_s = 0\n' % (self.sock, self.prefix))
        self.daemon = subprocess.Popen([sys.executable, "-m", "mrc_xdp.cli", "daemon", "--config", cfgf],
                                       stdout=subprocess.DEVNULL,
                                       stderr=open(os.path.join(self.tmp, "daemon.log"), "w"))
        end = time.monotonic() + 20
        while time.monotonic() < end and not (health.status(self.sock) or {}).get("instances", {}).get(self.prefix + "h0"):
            time.sleep(0.1)
        self.prober = bool((health.status(self.sock) or {}).get("prober"))
        log("lab up; health daemon %s" % ("with prober" if self.prober else "without prober"))
        return self

    def link(self, name):
        return next(rx.ifindex for n, rx, _, _ in self.topo.link_ends() if n == name)

    def t1_ends(self, t1):
        return [rx.ifindex for n, rx, _, lk in self.topo.link_ends() if t1 in (lk.a.node, lk.b.node)]

    def t1_bytes(self, plane=0):
        """Bytes into each T1 of the plane so far (link-model counters)."""
        d = {}
        for n, rx, _, lk in self.topo.link_ends():
            dst = n.split(">")[1]
            if dst.startswith("p%dt1" % plane):
                d[dst] = d.get(dst, 0) + self.lm.counters(rx.ifindex)["bytes"]
        return d

    def __exit__(self, *a):
        from mrc_xdp.lab import fabric, hosts
        if not hasattr(self, "st"):
            return
        if self.daemon is not None:
            self.daemon.terminate()
            with contextlib.suppress(Exception):
                self.daemon.wait(10)
        with contextlib.suppress(Exception):
            self.lm.close()
        log("lab %s: down" % self.prefix)
        fabric.down(self.prefix, unload_hosts=hosts.unload_all)
        self._drop_tmp()

    def _drop_tmp(self):
        """The daemon's directory goes, unless its log has something to read."""
        try:
            with open(os.path.join(self.tmp, "daemon.log")) as f:
                bad = "Traceback" in f.read()
        except OSError:
            bad = False
        if bad:
            log("the health daemon's log had a traceback: kept in %s" % self.tmp)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


# ================================================================== (c) loss on one path

def part_c_one_ev(args):
    """bench_failover scenario 2: 20% loss on the path of 1 EV of 16 (srv6 lab, EVs placed)."""
    import statistics
    import bench_failover as bf
    a = argparse.Namespace(rounds=1 if args.quick else 3, loss_seconds=1.0 if args.quick else 1.5)
    log("(c) 20%% loss on the path of 1 EV of 16 (srv6 lab, EVs placed): %d interleaved rounds of %.1f s"
        % (a.rounds, a.loss_seconds))
    r = bf.run_loss_one_ev(a)
    nf, lf = r["no fault"], r["20% loss on one EV's path"]
    ratios = [x["goodput_bps"] / y["goodput_bps"] for x, y in zip(lf, nf)]
    out = {"rounds": a.rounds, "seconds": a.loss_seconds, "no_fault": nf, "lossy": lf,
           "median_ratio": statistics.median(ratios),
           "no_fault_bps": statistics.median(x["goodput_bps"] for x in nf),
           "lossy_bps": statistics.median(x["goodput_bps"] for x in lf)}
    log("(c)   median ratio %.0f%% (no fault %.0f Mbit/s, with the loss %.0f Mbit/s)" % (
        100 * out["median_ratio"], out["no_fault_bps"] / 1e6, out["lossy_bps"] / 1e6))
    return out


def part_c(args, res, lab):
    import bench_failover as bf
    import bench_transport as bt
    from mrc_xdp import transport
    from mrc_xdp.lab import hosts
    import statistics
    secs = 1.0 if args.quick else 3.0
    reps = 1 if args.quick else 3
    t0 = lab.topo.host("h0").t0
    lossy_name = "%s>%s" % (lab.topo.t0_name(0, t0), lab.topo.t1_name(0, 0))
    dst = lab.ctl["h2"][0]
    h0, h2 = lab.prefix + "h0", lab.prefix + "h2"
    port = 40000 + os.getpid() % 1000
    rows = []
    eps = {h: transport.Endpoint(lab.prefix + h) for h in ("h0", "h2")}
    # h0's plane-0 T0 uplinks: a TCP flow's T1 follows its socket's random hash (carried
    # across the veths), so the uplink it took is measured in each run
    ups = {lab.topo.t1_name(0, j): lab.link("%s>%s" % (lab.topo.t0_name(0, t0), lab.topo.t1_name(0, j)))
           for j in range(lab.topo.t1_per_plane)}
    try:
        m = bf.MrcFlow(eps["h0"], eps["h2"], hosts.qpn(0, 2), hosts.qpn(2, 0))     # MRC warm-up
        m.t.start()
        time.sleep(1.0)
        m.close()
        log("(c) MRC: loss on %s (1 of its 4 paths); TCP: loss on the uplink its flow takes, found in each run"
            % lossy_name)
        runs = {p: [] for p in LOSSES}
        for rnd, p in [(k, p) for k in range(reps) for p in LOSSES]:     # interleaved rounds
            ppm = int(p * 1e6)
            lab.lm.update(lab.link(lossy_name), loss_ppm=ppm)
            time.sleep(0.2)
            m = bf.MrcFlow(eps["h0"], eps["h2"], hosts.qpn(0, 2), hosts.qpn(2, 0))
            m.t.start()
            time.sleep(0.3)
            a, ta = m.rx_bytes(), time.monotonic()
            time.sleep(secs)
            b, tb = m.rx_bytes(), time.monotonic()
            st = m.qs.stats()
            m.close()
            lab.lm.update(lab.link(lossy_name), loss_ppm=0)
            mrc_bps = (b - a) * 8 / (tb - ta)
            retired = sum(1 for r in bf.evs_of(h0) if r["state"] == "ASSUMED_BAD" and r["conn_name"] == "h2")
            time.sleep(0.3)
            tcp_bps, tcp_link, share, after, drops = tcp_on_lossy_path(lab, ups, h2, h0, dst, secs, port, ppm)
            runs[p].append({"mrc_bps": mrc_bps, "tcp_bps": tcp_bps, "mrc_rtx_pkts": st["rtx_pkts"],
                            "mrc_tx_pkts": st["tx_pkts"], "mrc_evs_retired_after": retired,
                            "tcp_uplink": tcp_link, "tcp_uplink_share": share, "tcp_uplink_share_during": after,
                            "tcp_drops": drops})
            log("(c) round %d, loss %5.1f%%: MRC %s (rtx %d of %d pkts, %d EVs retired at the end)   TCP %s (its uplink %s: %.0f%% of its bytes, %.0f%% while lossy, %d drops)"
                % (rnd + 1, 100 * p, bt.mbps(mrc_bps), st["rtx_pkts"], st["tx_pkts"], retired, bt.mbps(tcp_bps),
                   tcp_link, 100 * share, 100 * after, drops))
            # the health daemon's probes bring retired EVs back before the next level
            end = time.monotonic() + 3
            while time.monotonic() < end and any(r["state"] == "ASSUMED_BAD" and r["conn_name"] == "h2"
                                                 for r in bf.evs_of(h0)):
                time.sleep(0.1)
        for p in LOSSES:         # the median round of each level (by MRC goodput), TCP's median
            rr = sorted(runs[p], key=lambda x: x["mrc_bps"])
            row = dict(rr[(len(rr) - 1) // 2], loss=p, runs=runs[p])
            row["tcp_bps"] = statistics.median(x["tcp_bps"] for x in runs[p])
            rows.append(row)
    finally:
        for e in eps.values():
            e.close()
    res["c"] = {"rows": rows, "seconds": secs, "rounds": reps, "one_ev_of_16": res.pop("c_one_ev", None), "mrc_lossy_link": lossy_name}


def plot_c(plt, r, args):
    rows, one = r["rows"], r["one_ev_of_16"]
    if one:
        fig, (ax, az) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [2, 1]})
        v = [one["no_fault_bps"] / 1e6, one["lossy_bps"] / 1e6]
        bar_labels(az, az.bar([0, 1], v, color=["C0", "C3"]), v, va="bottom", fontsize=8)
        az.set_xticks([0, 1])
        az.set_xticklabels(["no fault", "20% loss on\nthe path of 1 EV"], fontsize=8)
        az.set_ylabel("MRC goodput, Mbit/s (median of %d rounds)" % one["rounds"])
        az.set_title("1 EV of 16 lossy (srv6, EVs placed): %.0f%%" % (100 * one["median_ratio"]), fontsize=9)
        az.grid(axis="y", alpha=0.3)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.8))
    xs = list(range(len(rows)))
    base_m, base_t = rows[0]["mrc_bps"] or 1, rows[0]["tcp_bps"] or 1
    ax.plot(xs, [100 * r["mrc_bps"] / base_m for r in rows], "o-", label="MRC, 1 QP (loss on 1 of its 4 paths)")
    ax.plot(xs, [100 * r["tcp_bps"] / base_t for r in rows], "s-", label="TCP, 1 flow (loss on its path)")
    for x, r in zip(xs, rows):
        ax.annotate("%.0f" % (r["mrc_bps"] / 1e6), (x, 100 * r["mrc_bps"] / base_m), fontsize=7,
                    textcoords="offset points", xytext=(0, 6), ha="center")
        ax.annotate("%.0f" % (r["tcp_bps"] / 1e6), (x, 100 * r["tcp_bps"] / base_t), fontsize=7,
                    textcoords="offset points", xytext=(0, -12), ha="center")
    ax.set_xticks(xs)
    ax.set_xticklabels(["%g%%" % (100 * r["loss"]) for r in rows])
    ax.set_xlabel("random loss injected on one T0 -> T1 link (link model)")
    ax.set_ylabel("goodput, % of the same flow without loss")
    ax.set_ylim(bottom=0)
    ax.set_title("(c) goodput vs loss on one path, h0 -> h2 (ecmp lab); labels: Mbit/s", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def tcp_on_lossy_path(lab, ups, server_ns, client_ns, dst, seconds, port, ppm):
    """One iperf3 TCP flow; during its omitted first 2 s, the uplink it takes is found
    (link-model byte counters) and gets the loss: (bits/s over the next `seconds`, that
    uplink, its share of the uplinks' bytes)."""
    import bench_transport as bt
    box = {}

    def run():
        try:
            box["bps"] = bt.iperf3(server_ns, client_ns, dst, max(1, int(round(seconds))), port=port,
                                   extra=["-O", "2"])[0]
        except Exception as e:       # reported by the caller
            box["error"] = e
    th = threading.Thread(target=run)
    th.start()
    link, share, lossy = None, 0.0, None
    end = time.monotonic() + 1.6
    try:
        while time.monotonic() < end and th.is_alive():
            a = {k: lab.lm.counters(i)["bytes"] for k, i in ups.items()}
            time.sleep(0.2)
            d = {k: lab.lm.counters(i)["bytes"] - a[k] for k, i in ups.items()}
            if sum(d.values()) > 200_000:
                link = max(d, key=d.get)
                share = d[link] / sum(d.values())
                lossy = ups[link]
                lab.lm.update(lossy, loss_ppm=ppm)
                break
        c0 = {k: lab.lm.counters(i) for k, i in ups.items()}
        th.join()
        c1 = {k: lab.lm.counters(i) for k, i in ups.items()}
    finally:
        if lossy is not None:
            lab.lm.update(lossy, loss_ppm=0)
    if "error" in box:
        raise box["error"]
    if link is None:
        raise RuntimeError("(c) the TCP flow did not start within its first 1.6 s")
    moved = {k: c1[k]["bytes"] - c0[k]["bytes"] for k in ups}
    after = moved[link] / max(sum(moved.values()), 1)       # did the flow stay on that uplink?
    return box["bps"], link, share, after, c1[link]["drop_loss"] - c0[link]["drop_loss"]


# ================================================================== (d) ring all-reduce

def ring_schedule(rank, n):
    """[(kind, send segment, recv segment)] of a ring all-reduce: n-1 reduce-scatter
    steps (received segment added), n-1 all-gather steps (received segment copied)."""
    steps = []
    for s in range(n - 1):
        steps.append(("reduce", (rank - s) % n, (rank - s - 1) % n))
    for s in range(n - 1):
        steps.append(("gather", (rank + 1 - s) % n, (rank - s) % n))
    return steps


def ar_inputs(n, count, seed=7):
    """Every rank's input (integers in float32, so the sum is exact) and the expected sum."""
    import numpy as np
    xs = [np.random.default_rng(seed + r).integers(-1000, 1000, count).astype(np.float32) for r in range(n)]
    return xs, np.sum(xs, axis=0, dtype=np.float32)


def role_allreduce(a):
    """One host of the ring: prints 'ready', waits for 'go' on stdin, runs a.iters
    all-reduces, prints a JSON line {times, verified}."""
    import numpy as np
    from mrc_xdp.transport import bootstrap
    from mrc_xdp.datapath import netns
    n, rank = a.n, a.rank
    ctl = json.loads(a.ctl)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    xs, expect = ar_inputs(n, a.count)
    x = np.empty(a.count, dtype=np.float32)
    L = a.count // n
    segb = L * 4
    steps = ring_schedule(rank, n)
    times, ok = [], True
    if a.transport == "mrc":
        from mrc_xdp import transport
        ep = transport.Endpoint(a.inst)
        stage = np.zeros(2 * len(steps) * L, dtype=np.float32)      # [parity][step] slots
        mx, ms = ep.reg_mr(x), ep.reg_mr(stage)
        qs, qr = ep.create_qp(), ep.create_qp()
        lis = bootstrap.Listener(a.port, bind=ctl[rank], ns=a.ns)
        out_ch = bootstrap.connect(ctl[nxt], a.port, timeout=60, ns=a.ns)
        in_ch = lis.accept(60)
        out_ch.send({"type": "qp", "qp": bootstrap.qp_attrs(qs)})
        in_ch.send({"type": "qp", "qp": bootstrap.qp_attrs(qr, ms)})
        rnext = bootstrap.check_qp_attrs(out_ch.expect("qp", 60)["qp"], "next")
        rprev = bootstrap.check_qp_attrs(in_ch.expect("qp", 60)["qp"], "prev")
        qs.connect(rnext)
        qr.connect(rprev)
        ring_barrier((out_ch, in_ch), "connected")
        rmr = rnext["mr"]
        nchunk = (segb + a.chunk - 1) // a.chunk
        got: dict = {}
        state = {"inflight": 0}

        def pump(timeout):
            for c in ep.cq.wait_blocking(timeout=timeout):
                if not c.ok:
                    raise RuntimeError("rank %d: completion %s" % (rank, c))
                if c.opcode == transport.WcOpcode.RECV_RDMA_IMM:
                    got[c.imm] = got.get(c.imm, 0) + 1
                else:
                    state["inflight"] -= 1

        def step(it, k, send_seg, recv_seg):
            imm = ((it & 1) << 8) | k
            slot = ((it & 1) * len(steps) + k) * segb
            off = send_seg * segb
            for j in range(nchunk):
                ln = min(a.chunk, segb - j * a.chunk)
                while state["inflight"] >= 32:
                    pump(1.0)
                qs.post_write(j, mx, off + j * a.chunk, ln, rmr["addr"] + slot + j * a.chunk, rmr["rkey"], imm=imm)
                state["inflight"] += 1
            end = time.monotonic() + 60
            while got.get(imm, 0) < nchunk or state["inflight"] > 0:
                if time.monotonic() > end:
                    raise RuntimeError("rank %d: step %d stalled 60 s" % (rank, k))
                pump(0.5)
            got.pop(imm)
            s0 = slot // 4
            return stage[s0:s0 + L]
        chans = (out_ch, in_ch)
    else:
        lis = netns.run(a.ns, socket.socket, socket.AF_INET6, socket.SOCK_STREAM)
        lis.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lis.bind((ctl[rank], a.port))
        lis.listen(1)
        out_s = netns.run(a.ns, socket.socket, socket.AF_INET6, socket.SOCK_STREAM)
        end = time.monotonic() + 60
        while True:
            try:
                out_s.connect((ctl[nxt], a.port))
                break
            except OSError:
                if time.monotonic() > end:
                    raise
                out_s.close()
                out_s = netns.run(a.ns, socket.socket, socket.AF_INET6, socket.SOCK_STREAM)
                time.sleep(0.1)
        in_s, _ = lis.accept()
        for s_ in (out_s, in_s):
            s_.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rbuf = np.empty(L, dtype=np.float32)
        rview = memoryview(rbuf).cast("B")
        xview = memoryview(x).cast("B")

        def step(it, k, send_seg, recv_seg):
            t = threading.Thread(target=out_s.sendall, args=(xview[send_seg * segb:(send_seg + 1) * segb],))
            t.start()
            n_ = 0
            while n_ < segb:
                r = in_s.recv_into(rview[n_:])
                if not r:
                    raise RuntimeError("rank %d: the previous host closed" % rank)
                n_ += r
            t.join()
            return rbuf
        chans = ()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    for it in range(a.iters):
        x[:] = xs[rank]
        t0 = time.perf_counter()
        for k, (kind, ss, rs) in enumerate(steps):
            seg = step(it, k, ss, rs)
            dst = x[rs * L:(rs + 1) * L]
            if kind == "reduce":
                dst += seg
            else:
                dst[:] = seg
        times.append(time.perf_counter() - t0)
        if not np.array_equal(x, expect):
            ok = False
    ring_barrier(chans, "done")
    print(json.dumps({"rank": rank, "times": times, "verified": ok}), flush=True)
    if a.transport == "mrc":
        for q in (qs, qr):
            q.destroy()
        ep.close()
    return 0


def ring_barrier(chans, name):
    """Channel.barrier on each channel in turn would deadlock around a ring: send to
    both neighbours first, then wait for both."""
    for c in chans:
        c.send({"type": "barrier", "name": name})
    for c in chans:
        c.expect("barrier", 120)


def run_allreduce(lab, transport_, count, iters, chunk, flap=None):
    """Start the 4 host processes, go, (flap a T1 meanwhile), collect their results."""
    hs = [h.name for h in lab.topo.hosts]
    ctl = json.dumps([lab.ctl[h][0] for h in hs])
    port = AR_PORT + (os.getpid() + int(time.monotonic() * 10)) % 500
    procs = []
    stop = threading.Event()
    flaps = []
    try:
        for r, h in enumerate(hs):
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--role", "allreduce", "--transport", transport_,
                 "--ns", lab.prefix + h, "--inst", lab.prefix + h, "--rank", str(r), "--n", str(len(hs)),
                 "--ctl", ctl, "--count", str(count), "--iters", str(iters), "--chunk", str(chunk),
                 "--port", str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError("all-reduce host did not start (%r)" % line)
        th = None
        if flap:
            ends, down_s, up_s = flap

            def flapper():
                while not stop.is_set():
                    for i in ends:
                        lab.lm.update(i, blackhole=True)
                    flaps.append(time.monotonic())
                    stop.wait(down_s)
                    for i in ends:
                        lab.lm.update(i, blackhole=False)
                    stop.wait(up_s)
            th = threading.Thread(target=flapper, daemon=True)
        b0 = lab.t1_bytes()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        if th:
            th.start()
        outs = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("all-reduce host %d failed (exit %s)" % (len(outs), p.wait(30)))
            outs.append(json.loads(line))
        stop.set()
        if th:
            th.join(5)
        b1 = lab.t1_bytes()
        for p in procs:
            p.wait(30)
        per_iter = [max(o["times"][i] for o in outs) for i in range(iters)]
        return {"per_iter_s": per_iter, "verified": all(o["verified"] for o in outs),
                "t1_bytes": {k: b1[k] - b0.get(k, 0) for k in b1}, "flaps": len(flaps)}
    finally:
        stop.set()
        if flap:
            for i in flap[0]:
                lab.lm.update(i, blackhole=False)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def part_d(args, res, lab):
    import statistics
    count = (256 << 10) if args.quick else (1 << 20)       # float32 per host: 1 MiB / 4 MiB
    iters = 4 if args.quick else 16
    chunk = 256 << 10
    down_s, up_s = 0.1, 0.4
    r = {"floats": count, "bytes": count * 4, "iters": iters, "chunk": chunk, "flap_down_s": down_s,
         "flap_up_s": up_s, "runs": {}}
    order = [("tcp", False), ("mrc", False), ("mrc", True), ("tcp", True)]
    flap_t1 = None
    for tr, flapping in order:
        flap = None
        if flapping:
            flap = (lab.t1_ends(flap_t1), down_s, up_s)
        log("(d) all-reduce over %s, %s: %d x %d MiB per host, %d KiB chunks%s" % (
            tr.upper(), "flapping" if flapping else "healthy", iters, count * 4 >> 20, chunk >> 10,
            " (%s down %.0f ms every %.0f ms)" % (flap_t1, down_s * 1e3, (down_s + up_s) * 1e3) if flapping else ""))
        x = run_allreduce(lab, tr, count, iters, chunk, flap)
        if flap_t1 is None:      # flap the plane-0 T1 that carried most of the TCP ring
            flap_t1 = max(x["t1_bytes"], key=x["t1_bytes"].get)
        x["median_s"] = statistics.median(x["per_iter_s"])
        key = "%s_%s" % (tr, "flap" if flapping else "healthy")
        r["runs"][key] = x
        log("(d)   per iteration: median %.1f ms, max %.1f ms, result verified: %s" % (
            1e3 * x["median_s"], 1e3 * max(x["per_iter_s"]), x["verified"]))
        time.sleep(1.0)       # retired EVs come back (health daemon) between runs
    r["flap_t1"] = flap_t1
    for x in r["runs"].values():       # how much of each run crossed the flapped T1
        tot = sum(x["t1_bytes"].values())
        x["flap_t1_share"] = x["t1_bytes"].get(flap_t1, 0) / tot if tot else 0.0
    res["d"] = r


def plot_d(plt, r, args):
    iters, flap_t1, down_s, up_s = r["iters"], r["flap_t1"], r["flap_down_s"], r["flap_up_s"]
    fig, (ax, az) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1, 1.4]})
    keys = ["mrc_healthy", "tcp_healthy", "mrc_flap", "tcp_flap"]
    labs = ["MRC\nhealthy", "TCP\nhealthy", "MRC\nT1 flapping", "TCP\nT1 flapping"]
    med = [1e3 * r["runs"][k]["median_s"] for k in keys]
    bar_labels(ax, ax.bar(range(4), med, color=["C0", "C1", "C0", "C1"]), med, va="bottom", fontsize=8)
    ax.set_xticks(range(4))
    ax.set_xticklabels(labs, fontsize=8)
    ax.set_ylabel("ms per all-reduce (median)")
    ax.set_title("(d) ring all-reduce, 4 hosts, %d MiB float32 each" % (r["bytes"] >> 20), fontsize=9)
    for k, c, ls in (("mrc_healthy", "C0", "-"), ("tcp_healthy", "C1", "-"), ("mrc_flap", "C0", "--"),
                     ("tcp_flap", "C1", "--")):
        az.plot(range(1, iters + 1), [1e3 * v for v in r["runs"][k]["per_iter_s"]], ls, color=c, marker=".",
                label=k.replace("_", ", "))
    az.set_yscale("log")
    az.set_xlabel("iteration")
    az.set_ylabel("ms (log scale)")
    az.set_title("per iteration (slowest host); flapping: %s down %.0f of every %.0f ms" % (
        flap_t1, down_s * 1e3, (down_s + up_s) * 1e3), fontsize=9)
    az.legend(fontsize=8)
    for a_ in (ax, az):
        a_.grid(alpha=0.3)
    return fig


# ================================================================== (e) datapath cost

def part_e(args, res):
    argv = [sys.executable, os.path.join(ROOT, "tools", "bench_xdp.py"), "--json", "--no-budget"]
    argv += ["--repeat", "20000", "--rounds", "1"] if args.quick else ["--repeat", "200000", "--rounds", "5"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if p.returncode not in (0, 1):
        raise RuntimeError("bench_xdp: %s" % (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1])
    s = json.loads(p.stdout)
    s["argv"] = " ".join(argv[1:]).replace(ROOT + "/", "")
    res["e"] = s


def plot_e(plt, s, args):
    cases = s["cases"]
    fig, ax = plt.subplots(figsize=(10, 6))
    names = [c["name"] for c in cases][::-1]
    ns = [c["ns"] for c in cases][::-1]
    col = {"spray": "C0", "ingress": "C2", "floor": "C7"}
    ax.barh(range(len(ns)), ns, color=[col.get(c["group"], "C3") for c in cases][::-1],
            xerr=[[c["ns"] - c["ns_min"] for c in cases][::-1], [c["ns_max"] - c["ns"] for c in cases][::-1]])
    for i, c in enumerate(cases[::-1]):
        ax.text(c["ns"] + 2, i, "%.0f ns  %.2fx PASS  %.2fx FWD" % (c["ns"], c["ratio"], c["ratio_fwd"]),
                va="center", fontsize=7)
    ax.axvline(s["baseline"]["ns"], color="k", ls="--", lw=0.8, label="XDP_PASS %.1f ns" % s["baseline"]["ns"])
    ax.set_yticks(range(len(ns)))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("ns per packet (BPF_PROG_TEST_RUN, median over rounds; bars: min..max)")
    ax.set_xlim(0, max(ns) * 1.6)
    ax.set_title("(e) datapath cost per packet vs XDP_PASS and a bare forwarder (grey)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return fig


# ================================================================== report

FOOT = "placeholder %s"


def mb(bps):
    return "%.0f Mbit/s" % (bps / 1e6)


def ms(s):
    return "never (in the window)" if s is None else "%.1f ms" % (s * 1e3)


def headline(res) -> list[str]:
    """The few figures the README repeats (same strings)."""
    h = []
    if "a" in res:
        for mode in ("ecmp", "srv6"):
            lm = res["a"].get(mode, {}).get("linkmodel", {})
            m, t = lm.get("mrc_1qp", {}), lm.get("tcp_1flow", {})
            if "bps" in m:
                s = "(a) %s: one MRC QP %s = %.0f%% of the %s fabric capacity" % (
                    mode, mb(m["bps"]), 100 * m["fraction"], mb(res["a"][mode]["capacity_bps"]))
                if "bps" in t:
                    s += "; one TCP flow %.0f%%" % (100 * t["fraction"])
                    t4 = lm.get("tcp_4flows", {})
                    mp = lm.get("mptcp_2subflows", {})
                    if "bps" in t4:
                        s += ", 4 TCP flows %.0f%%" % (100 * t4["fraction"])
                    if "bps" in mp:
                        s += ", MPTCP %.0f%%" % (100 * mp["fraction"])
                tb = res["a"].get(mode, {}).get("linkmodel+tbf", {})
                got = [(lab_, tb[k]["fraction"]) for k, lab_ in (("tcp_1flow", "1 TCP flow"), ("tcp_4flows", "4 TCP flows"),
                                                                  ("mptcp_2subflows", "MPTCP")) if "bps" in tb.get(k, {})]
                if got:
                    s += " (with real tbf queues, which TCP needs: %s)" % ", ".join(
                        "%s %.0f%%" % (lab_, 100 * f) for lab_, f in got)
                h.append(s)
    if "b" in res:
        f = res["b"]["flows"]
        h.append("(b) T1 blackhole: back to 90%% of its goodput after %s (MRC), %s (TCP), %s (MPTCP)" % (
            ms(f["mrc"]["recover_from_fault_s"]), ms(f["tcp"]["recover_from_fault_s"]),
            ms(f["mptcp"]["recover_from_fault_s"])))
    if "c" in res:
        rows = res["c"]["rows"]
        r0 = rows[0]
        h.append("(c) loss on one path: MRC keeps %s of its goodput, TCP %s (at %s loss)" % (
            ", ".join("%.0f%%" % (100 * r["mrc_bps"] / max(r0["mrc_bps"], 1)) for r in rows[1:]),
            ", ".join("%.0f%%" % (100 * r["tcp_bps"] / max(r0["tcp_bps"], 1)) for r in rows[1:]),
            " / ".join("%g%%" % (100 * r["loss"]) for r in rows[1:])))
        one = res["c"].get("one_ev_of_16")
        if one:
            h.append("(c) 20%% loss on the path of 1 EV of 16: MRC keeps %.0f%% of its goodput" % (100 * one["median_ratio"]))
    if "d" in res:
        R = res["d"]["runs"]
        h.append("(d) ring all-reduce of %d MiB x 4 hosts: MRC %.0f ms vs TCP %.0f ms healthy, %.0f ms vs %.0f ms "
                 "with a T1 flapping (median per iteration)" % (
                     res["d"]["bytes"] >> 20, 1e3 * R["mrc_healthy"]["median_s"], 1e3 * R["tcp_healthy"]["median_s"],
                     1e3 * R["mrc_flap"]["median_s"], 1e3 * R["tcp_flap"]["median_s"]))
    if "e" in res:
        c = {x["name"]: x for x in res["e"]["cases"]}
        sp = c.get("spray ECMP, 1 KB payload")
        ing = c.get("ingress data, 1 KB payload")
        if sp and ing:
            h.append("(e) datapath: spray %.0f ns/packet (%.1fx XDP_PASS, %.2fx a bare forwarder), ingress data "
                     "%.0f ns (%.1fx XDP_PASS)" % (sp["ns"], sp["ratio"], sp["ratio_fwd"], ing["ns"], ing["ratio"]))
    return h + eval_jobs.headline(res)


def all_headlines(res) -> list[str]:
    """This run's headline lines and the kept parts' ones, in part order."""
    lines = headline(res) + [h for v in res.get("kept", {}).values() for h in v["headline"]]
    return sorted(lines, key=lambda h: h[:3])


def report(res, mach, args, out, parts, elapsed):
    L = []
    w = L.append
    w("# mrc-xdp evaluation report")
    w("")
    w("Generated by `tools/evaluate.py%s` (`make evaluate`) on %s in %.0f s." % (
        " --quick" if args.quick else "", mach["date"], elapsed))
    w("")
    if res.get("kept"):
        w("This run measured part(s) %s; part(s) %s are kept from the earlier run(s) of %s as they were: "
          "their sections, headline lines, plots and load averages are that run's (the machine line above is "
          "this run's)." % (", ".join(k for k in PARTS if k in parts and k in res) or "none",
                            ", ".join(res["kept"]), ", ".join(sorted({v["date"] for v in res["kept"].values()}))))
        w("")
    w("**Machine:** %s CPUs (%s), kernel %s, %s. Load average (1/5/15 min) at the start %s, at the end %s: "
      "the machine was shared with other jobs, so absolute figures are low and noisy; ratios measured in "
      "the same run are the meaningful part. Every experiment runs on the netns lab (veth links, the "
      "link model in XDP on every switch port, the real datapath and AF_XDP engine on every host)."
      % (mach["cpus"], mach["cpu"], mach["kernel"], mach["os"], mach["loadavg_start"], mach["loadavg_end"]))
    w("")
    w("Rerun everything: `make evaluate` (or `sudo .venv/bin/python tools/evaluate.py --out results`); one part: "
      "`--only c`; a smoke run: `--quick`.")
    w("")
    w("## Headline figures")
    w("")
    heads = all_headlines(res)
    for s in heads:
        w("- " + s)
    if not heads:
        w("- (no part ran)")
    w("")
    if "errors" in res:
        w("## Parts that failed")
        w("")
        for k, v in res["errors"].items():
            w("- (%s): %s" % (k, v))
        w("")
    load = res.get("load", {})

    def where(k):
        when = (" on %s" % res[k]["date"]) if isinstance(res[k], dict) and res[k].get("date") else ""
        return "Measured%s on %s CPUs, kernel %s, load average %s when the part started; rerun: `%s`." % (
            when, mach["cpus"], mach["kernel"], load.get(k, "?"), RERUN[k])
    kept = res.get("kept", {})
    for k, part in PARTS.items():
        if k in kept:
            w(kept[k]["section"].rstrip("\n"))
            w("")
        elif k in res:
            w("## (%s) %s" % (k, part.title))
            w("")
            w("![%s](%s)" % (k, part.png))
            w("")
            part.section(w, res[k], args)
            w(where(k))
            w("")
    with open(os.path.join(out, "REPORT.md"), "w") as f:
        f.write("\n".join(L))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"machine": mach, "quick": args.quick, "parts": parts, "seconds": round(elapsed, 1),
                   "headline": heads, "kept": {k: v["date"] for k, v in kept.items()},
                   "results": dict({k: v for k, v in res.items() if k != "kept"},
                                   **{k: v["results"] for k, v in kept.items()})}, f, indent=1, default=str)


RERUN = {k: "sudo .venv/bin/python tools/evaluate.py --only %s --out results" % k for k in "abcdefgh"}


# ================================================================== the parts' report sections, the parts

def section_a(w, r, args):
    """The body of section (a) of REPORT.md."""
    w("h0 -> h2 in the default lab (2 planes x 2 T1s: 4 paths). The link model limits T0-T1 links to %s and host "
      "links to twice that, so the capacity is 4 x %s. One MRC QP (`mrc-xdp write-bw`, 1 MiB writes, %d s) in ecmp "
      "and srv6 mode; in ecmp mode also one TCP flow and 4 TCP flows (iperf3), MPTCP with one subflow per plane "
      "and a 2 x 2 full mesh, over the lab's control path (the T0s hash flows over T1s). 'linkmodel+tbf' adds "
      "a real tbf queue at each link's rate, which TCP's ACK clock needs (the link model's phantom queue marks, "
      "trims and drops but never delays). Goodput measured at the receiver (tools/bench_transport.py part (b))."
      % (args.rate, args.rate, r["seconds"]))
    w("")
    w("| mode, links | transport | goodput | of capacity |")
    w("|---|---|---|---|")
    for mode in ("ecmp", "srv6"):
        for cfg in ("linkmodel", "linkmodel+tbf"):
            for k, v in r.get(mode, {}).get(cfg, {}).items():
                if "bps" in v:
                    w("| %s, %s | %s | %s | %.0f%% |" % (mode, cfg, k, mb(v["bps"]), 100 * v["fraction"]))
                else:
                    w("| %s, %s | %s | failed: %s | |" % (mode, cfg, k, v.get("error", "?")[-100:]))
    w("")


def section_b(w, r, args):
    """The body of section (b) of REPORT.md."""
    w("One ecmp lab run: one MRC QP h0 -> h2 (Writes kept in flight), one TCP flow h1 -> h3 and one MPTCP "
      "connection h3 -> h1 (a subflow per plane; TCP and MPTCP paced to 300 Mbit/s so Python senders do "
      "not starve the engine of CPU). After %.1f s the plane-0 T1 carrying the TCP flow (%s) is blackholed "
      "(every link end into and out of it) for %.1f s, then healed. Goodput sampled every 100 us at the "
      "receivers (tools/bench_failover.py scenario 1; time series in failover.csv)."
      % (r["params"]["warmup"], r["t1"], r["params"]["fault"]))
    w("")
    w("| flow | goodput before | first 10 ms after the fault | loss detected | back to 90% (from the fault) | "
      "retransmitted | EVs |")
    w("|---|---|---|---|---|---|---|")
    for name, f in r["flows"].items():
        ev = ""
        if name == "mrc":
            ev = "%d retired (during the fault %d; EVs that cross the fault %d, retired not crossing it %d; "\
                 "first %s after the fault; by reason %s); back in service %s after the heal" % (
                     f["evs_retired"], f["evs_retired_fault"], f["evs_crossing"], f["evs_retired_not_crossing"],
                     "n/a" if f["detect_s"] is None else "%.0f us" % (f["detect_s"] * 1e6),
                     ", ".join("%s %d" % kv for kv in sorted(f["retired_by_reason"].items())) or "none",
                     ms(f["back_after_heal_s"]) if f["prober"] else "n/a (no prober)")
        w("| %s | %s | %s | %s | %s | %d B | %s |" % (
            name.upper(), mb(f["goodput_before_bps"]), mb(f["goodput_first_10ms_bps"] or 0), ms(f["detect_s"]),
            ms(f["recover_from_fault_s"]), f["bytes_retransmitted"], ev))
    w("")


def section_c(w, r, args):
    """The body of section (c) of REPORT.md."""
    import statistics
    w("Random loss injected by the link model on one T0 -> T1 link of plane 0 (one of h0 -> h2's 4 paths), "
      "%.0f s per level and round, %d interleaved rounds (medians; MRC's row is its median round), ecmp lab, health daemon running (its probes bring retired EVs back between levels). "
      "MRC: one QP h0 -> h2 whose EVs spread over the 4 paths, loss on %s. TCP: one iperf3 flow h0 -> h2 "
      "(plane 0 control addresses); its T0 -> T1 uplink follows the socket's random hash, so it is found from "
      "the link-model counters during the flow's first 2 s (omitted by iperf3 -O 2) and the loss put there for "
      "the measured %.0f s: the flow always faces the loss on its only path, the case multipath exists for. "
      "No rate limits: goodput is what the CPUs allow." % (r["seconds"], r["rounds"], r["mrc_lossy_link"], r["seconds"]))
    w("")
    one = r.get("one_ev_of_16")
    if one:
        w("Right panel: tools/bench_failover.py scenario 2 in its own srv6 lab: one QP whose 16 active EVs are "
          "placed explicitly (7 on plane 0 T1 0, 1 on plane 0 T1 1, 8 over plane 1), 20%% loss on the link into "
          "plane 0 T1 1, so on the path of 1 EV of 16; %d interleaved rounds of %.1f s with and without the "
          "loss, a fresh connection each: median goodput %s without, %s with the loss, median ratio %.0f%%."
          % (one["rounds"], one["seconds"], mb(one["no_fault_bps"]), mb(one["lossy_bps"]), 100 * one["median_ratio"]))
        w("")
    sh = [x["tcp_uplink_share"] for row in r["rows"] for x in row["runs"]]
    sh2 = [x["tcp_uplink_share_during"] for row in r["rows"] for x in row["runs"] if row["loss"] > 0]
    w("In every TCP run the uplink that got the loss carried at least %.0f%% of the flow's bytes on h0's "
      "plane-0 T0 uplinks while it was being found, and at least %.0f%% while the loss was on (the flow did "
      "not move to the other T1); the link model dropped %s packets of it at 0.1%% / 1%% / 20%% (median)." % (
          100 * min(sh), 100 * min(sh2 or [0]), " / ".join(
              "%d" % statistics.median(x["tcp_drops"] for x in row["runs"]) for row in r["rows"][1:])))
    w("")
    w("Reading it: with sub-millisecond RTTs and no rate limit the CPUs, not the paths, limit both transports, "
      "so MRC's figures move with the machine's load more than with the loss (it retransmits what was lost and "
      "retires the lossy path's EVs); TCP's window recovers within microseconds here, and it loses most when a "
      "retransmission is lost too and it waits for a retransmission timeout (200 ms minimum), so its figures "
      "swing between runs.")
    w("")
    w("| loss | MRC goodput | MRC retransmitted pkts | EVs retired at the end | TCP goodput |")
    w("|---|---|---|---|---|")
    for x in r["rows"]:
        w("| %g%% | %s (%.0f%%) | %d of %d | %d | %s (%.0f%%) |" % (
            100 * x["loss"], mb(x["mrc_bps"]), 100 * x["mrc_bps"] / max(r["rows"][0]["mrc_bps"], 1),
            x["mrc_rtx_pkts"], x["mrc_tx_pkts"], x["mrc_evs_retired_after"], mb(x["tcp_bps"]),
            100 * x["tcp_bps"] / max(r["rows"][0]["tcp_bps"], 1)))
    w("")


def section_d(w, r, args):
    """The body of section (d) of REPORT.md."""
    w("Every host holds %d float32 (%d MiB; integers, so the sum is exact) and all hold the element-wise sum "
      "at the end: a ring all-reduce (3 reduce-scatter steps adding the received segment with numpy, 3 "
      "all-gather steps), segments sent in fixed %d KiB chunks, %d iterations, the result checked against "
      "numpy's sum every iteration. Over MRC each host is a process with an Endpoint on its lab instance and "
      "two QPs (to the next host, from the previous one) whose attributes and MRs are exchanged through "
      "mrc_xdp.transport.bootstrap over the lab's control path; chunks are RDMA Writes with Immediate into a staging "
      "region of the next host. Over TCP the same processes use one socket to each ring neighbour (plane 0 "
      "control addresses). Time per iteration is the slowest host's. Flapping: %s (the plane-0 T1 that "
      "carried most of the healthy TCP ring; each TCP run's connections hash anew, the table says how much "
      "crossed it) blackholed %.0f ms of every %.0f ms by the link model; the "
      "health daemon runs throughout."
      % (r["floats"], r["bytes"] >> 20, r["chunk"] >> 10, r["iters"], r["flap_t1"], 1e3 * r["flap_down_s"],
         1e3 * (r["flap_down_s"] + r["flap_up_s"])))
    w("")
    w("| run | median per iteration | min | max | result verified | flaps during the run | "
      "plane-0 T1 bytes through %s |" % r["flap_t1"])
    w("|---|---|---|---|---|---|---|")
    for k in ("mrc_healthy", "tcp_healthy", "mrc_flap", "tcp_flap"):
        x = r["runs"][k]
        w("| %s | %.1f ms | %.1f ms | %.1f ms | %s | %d | %.0f%% |" % (
            k.replace("_", ", "), 1e3 * x["median_s"], 1e3 * min(x["per_iter_s"]), 1e3 * max(x["per_iter_s"]),
            "yes" if x["verified"] else "NO", x["flaps"], 100 * x["flap_t1_share"]))
    w("")
    fl = [k for k in ("mrc_flap", "tcp_flap") if r["runs"][k]["flap_t1_share"] < 0.05]
    if fl:
        w("The last column: in %s almost none of the plane-0 T1 traffic crossed the flapping T1 (MRC retires "
          "its EVs there at the first blackhole; a TCP run's new connections hash anew, and may avoid it from "
          "the start), so those figures say more about the machine's load during the run than about the flap. "
          "The runs follow one another on a shared machine: compare min and max before reading a difference."
          % " and ".join(k.replace("_", ", ") for k in fl))
        w("")


def section_e(w, s, args):
    """The body of section (e) of REPORT.md."""
    w("The real XDP programs (bpf/mrc_datapath.c, ecmp and srv6 builds) timed with BPF_PROG_TEST_RUN, repeat %d, "
      "%d round(s), interleaved with an empty XDP_PASS program (baseline %.1f ns) and a bare forwarder "
      "(parse, connection lookup, one fixed EV, rewrite, redirect); tools/bench_xdp.py. CPU %s, JIT %s."
      % (s["repeat"], s["rounds"], s["baseline"]["ns"], s["system"]["cpu"], s["system"]["jit"]))
    w("")
    w("| case | ns/packet | x XDP_PASS | x bare forwarder |")
    w("|---|---|---|---|")
    # derived: a difference of timed runs (bench_xdp's repeat-safe copies with a formula);
    # a copy timed as it is (the connection-cache-miss rows) is a direct figure
    derived = [c for c in s["cases"] if c["method"] == "copy" and c.get("formula")]
    for c in s["cases"]:
        w("| %s | %.1f | %.2f | %.2f |" % (c["name"] + (" *" if c in derived else ""),
                                           c["ns"], c["ratio"], c["ratio_fwd"]))
    w("")
    if derived:
        w("\\* derived by subtraction (one measured run minus others, formula in results.json): "
          "on a busy machine or with few rounds (--quick) it can fall below zero; read it "
          "with its spread, %s." % ", ".join("%s %.1f..%.1f" % (c["name"], c["ns_min"], c["ns_max"])
                                             for c in derived))
        w("")


class Part(typing.NamedTuple):
    """One part of the evaluation, in the common scaffolding of main() and report():
    run(args, res[, lab]) measures and records res[k]; plot(plt, res[k], args) returns
    its figure, which gets the common footer and is saved as png (None: the part's tool
    draws png itself); section(w, res[k], args) writes its report section between the
    common heading (title, png) and the common 'measured on ..., rerun' line."""
    title: str
    png: str
    run: typing.Callable
    plot: typing.Callable | None
    section: typing.Callable
    lab: bool = False         # runs on the lab shared by (c) and (d)


PARTS = {
    "a": Part("Multipath goodput vs fabric capacity", "a_goodput.png", part_a, plot_a, section_a),
    "b": Part("Failover: a T1 blackholed, then healed", "failover.png", part_b, None, section_b),
    "c": Part("Goodput vs loss on one path", "c_loss.png", part_c, plot_c, section_c, lab=True),
    "d": Part("Ring all-reduce among the 4 hosts", "d_allreduce.png", part_d, plot_d, section_d, lab=True),
    "e": Part("Datapath cost per packet", "e_xdp.png", part_e, plot_e, section_e),
    "f": Part("allreduce-perf: MRC vs gloo on rate-limited links, and unthrottled", "f_allreduce_perf.png",
              eval_jobs.part_f, eval_jobs.plot_f, eval_jobs.section_f, lab=True),
    "g": Part("DDP training throughput: MRC vs gloo over TCP and MPTCP", "g_training.png",
              eval_jobs.part_g, eval_jobs.plot_g, eval_jobs.section_g, lab=True),
    "h": Part("Job failures under a fault schedule", "h_job_failures.png",
              eval_jobs.part_h, eval_jobs.plot_h, eval_jobs.section_h, lab=True),
}


def plot(k: str, res: dict, args) -> None:
    """Part k's figure of res[k], with the common footer (machine, how to rerun), into
    args.out as its PNG."""
    part = PARTS[k]
    if part.plot is None:
        return
    plt = plt_()
    fig = part.plot(plt, res[k], args)
    footer(fig, FOOT % k)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(os.path.join(args.out, part.png), dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    global FOOT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and shorter runs (a smoke test)")
    ap.add_argument("--only", default="a,b,c,d,e,f,g,h", help="comma-separated parts among a,b,c,d,e,f,g,h")
    ap.add_argument("--out", default=os.path.join(ROOT, "results"))
    ap.add_argument("--rate", default="100mbit", help="(a) T0-T1 link rate; host links get twice it")
    ap.add_argument("--job-mtu", type=int, default=JOB_MTU,
                    help="(f, g, h) fabric MTU of their lab, for both transports (mrc0 gets 40 less); default "
                         "%(default)s, the lab's largest: MRC NICs send 4096-byte payloads, and at 1500 the two "
                         "CPUs, not the links, bound MRC's ranks")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    for k in ("transport", "ns", "inst", "ctl"):
        ap.add_argument("--" + k, help=argparse.SUPPRESS)
    for k in ("rank", "n", "count", "iters", "chunk", "port"):
        ap.add_argument("--" + k, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "allreduce":
        return role_allreduce(args)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        print("evaluate: --only takes parts among %s (got %r)" % (",".join(PARTS), args.only), file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("evaluate: needs root (lab namespaces, XDP, AF_XDP): run with sudo", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        print("evaluate: %s: install Debian's python3-matplotlib (make setup)" % e, file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    os.makedirs(args.out, exist_ok=True)
    mach = machine()
    FOOT = ("Measured by tools/evaluate.py%s on %s CPUs (%s), kernel %s, load avg %s at the start; rerun: "
            "sudo .venv/bin/python tools/evaluate.py --only %%s" % (" --quick" if args.quick else "", mach["cpus"],
                                                                    mach["cpu"], mach["kernel"], mach["loadavg_start"]))
    log("parts %s into %s%s; %s CPUs, kernel %s, load average %s" % (
        ",".join(parts), args.out, " (quick)" if args.quick else "", mach["cpus"], mach["kernel"], mach["loadavg_start"]))
    res: dict = {"load": {}}
    order = [p for p in "eabcdfgh" if p in parts]      # (e) first: no lab
    lab = jlab = None       # parts a-d on the default lab; f-h on one with the job MTU
    try:
        for p in order:
            res["load"][p] = loadavg()
            log("(%s) starting (load average %s)" % (p, res["load"][p]))
            t = time.monotonic()
            started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            try:
                if p == "c":
                    try:
                        res["c_one_ev"] = part_c_one_ev(args)
                    except (RuntimeError, OSError, ValueError) as e:
                        log("(c) 1 EV of 16: FAILED: %s" % str(e).strip().splitlines()[-1:])
                if PARTS[p].lab and p in "fgh":
                    if jlab is None:
                        jlab = Lab(mtu=args.job_mtu, tag="j")
                        jlab.__enter__()
                    PARTS[p].run(args, res, jlab)
                elif PARTS[p].lab:
                    if lab is None:
                        lab = Lab()
                        lab.__enter__()
                    PARTS[p].run(args, res, lab)
                else:
                    PARTS[p].run(args, res)
                if p in "fgh":
                    res[p]["date"] = started
                    res[p]["seconds_part"] = round(time.monotonic() - t, 1)
                plot(p, res, args)
            except (RuntimeError, OSError, ValueError) as e:
                msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                log("(%s) FAILED: %s" % (p, msg))
                res.setdefault("errors", {})[p] = msg
            log("(%s) done in %.0f s" % (p, time.monotonic() - t))
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        for lb in (lab, jlab):
            if lb is not None:
                lb.__exit__(None, None, None)
    mach["loadavg_end"] = loadavg()
    elapsed = time.monotonic() - T_START
    keep_earlier(res, args, parts)
    report(res, mach, args, args.out, parts, elapsed)
    log("wrote %s/REPORT.md (%.0f s)" % (args.out, elapsed))
    for s in all_headlines(res):
        print(s)
    return 1 if "errors" in res else 0


def keep_earlier(res: dict, args, parts) -> None:
    """The parts not run now that the output directory's earlier REPORT.md has (and its
    results.json, same --quick) are kept as they were: their sections and headline lines
    verbatim (an older run's results may not fit this version's report code), their
    results carried over into the new results.json."""
    try:
        with open(os.path.join(args.out, "results.json")) as f:
            prev = json.load(f)
        with open(os.path.join(args.out, "REPORT.md")) as f:
            text = f.read()
    except (OSError, ValueError):
        return
    if bool(prev.get("quick")) != bool(args.quick):
        return
    import re
    heads = [(m.start(), m.group(1)) for m in re.finditer(r"^## \(([a-z])\) ", text, re.M)]
    kept = {}
    for i, (pos, k) in enumerate(heads):
        if k in parts or k not in PARTS or k in res:
            continue
        end = heads[i + 1][0] if i + 1 < len(heads) else len(text)
        kept[k] = {"section": text[pos:end].rstrip("\n") + "\n",
                   "headline": [h for h in prev.get("headline", []) if h.startswith("(%s)" % k)],
                   "results": prev.get("results", {}).get(k),
                   "date": (prev.get("kept", {}).get(k) or {}).get("date") if isinstance(prev.get("kept", {}).get(k), dict)
                   else prev.get("kept", {}).get(k) or prev.get("machine", {}).get("date", "?")}
    if kept:
        res["kept"] = kept


if __name__ == "__main__":
    sys.exit(main())
