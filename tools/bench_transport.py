#!/usr/bin/env python3
"""The transport engine against the kernel's own transports, in one run, on one machine.

    sudo .venv/bin/python tools/bench_transport.py [--part a|b|all] [--reps 3] [--seconds 4]
                                                  [--rate 100mbit] [--payloads 1408,3392]
                                                  [--mtu M] [--json]
                                                  [--mrc-only] [--mrc-runs N] [--shape no]
                                                  [--lab-mtu 3000]

(a) Live pair: two namespaces, two planes (veths p0, p1), no switches, the datapath
    loaded on both, and a third veth pair n0 with no XDP program.  For each MRC payload
    of --payloads (default 1408 and 3392, on pairs at MTU 1500 and 3506; see
    POINT_MTUS for larger ones): one MRC QP (`mrc-xdp write-bw --mtu PAYLOAD`) vs one
    iperf3 UDP flow (-b 0, the same payload size) vs one iperf3 TCP flow over the same
    plane veth (XDP attached: the kernel turns the peer's TSO off) vs one iperf3 TCP
    flow over the plain veth n0 (what a user without mrc-xdp runs), interleaved, --reps
    repetitions, each with goodput and CPU s/GB, and the ratios MRC / UDP, MRC / TCP,
    MRC / TCP-noXDP; then 8-byte `mrc-xdp write-lat` p50/p99/p99.9 vs a TCP
    request/response of 8 bytes (Python, both ends, as the MRC side is driven from
    Python too), at the first payload's MTU.
(b) The default lab in ecmp mode with link rates set through the link model: T0-T1
    links at --rate, host links at twice that, so the T0-T1 links are the bottleneck and
    the host-to-host fabric capacity h0 -> h2 is 2 planes x 2 T1s x rate.  One MRC QP vs
    one TCP flow vs MPTCP (one subflow per plane NIC; then a full mesh of 2 x 2
    subflows, as many as the fabric has paths) vs 4 TCP flows, each as a fraction of that
    capacity (goodput at the receiver); MRC in srv6 mode too (a second lab).  TCP and
    MPTCP run over the lab's control path (mrc_xdp.transport.ctlpath.lab_control_path): one
    address per plane NIC, routed by the plane's switches, which hash flows over T1s.

Figures are goodput measured at the receiver.  Every run also reports how its packets
spread over h0's T0 -> T1 uplinks (link-model counters), which explains TCP's share;
MRC runs also how busy the uplinks were (wire bytes over capacity x run time: headers,
trimmed frames and retransmissions included; goodput can reach at most payload / frame
bytes of it: 1408 / 1506 = 0.935 in ecmp, 1408 / 1546 = 0.911 in srv6 with its 40-byte
outer header, at the lab's MTU 1500).
Nothing here asserts a speed: it prints figures and ratios.  Namespaces and labs get
unique names and are removed at the end, also on error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mrc_xdp.lab import ctlpath
from mrc_xdp.datapath import loader, netns  # noqa: E402
from mrc_xdp.datapath.config import HostConfig  # noqa: E402

CLI = [sys.executable, "-m", "mrc_xdp.cli"]
IPPROTO_MPTCP = 262
TAG = "%x%s" % (os.getpid() & 0xffff, uuid.uuid4().hex[:3])


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ns_cmd(ns, argv, **kw):
    return subprocess.run(["nsenter", "--net=/run/netns/" + ns] + list(argv), **kw)


def ip(ns, *a):
    r = ns_cmd(ns, ["ip"] + list(a), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError("ip %s (in %s): %s" % (" ".join(a), ns, r.stderr.strip()))
    return r.stdout


def cpu_of(fn):
    """(fn(), CPU seconds: user + sys of this process and of the children it waited for
    meanwhile).  Softirq work the kernel does on behalf of others is not in it."""
    import resource
    a = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    r = fn()
    b = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return r, sum((y.ru_utime - x.ru_utime) + (y.ru_stime - x.ru_stime) for x, y in zip(a, b))


def mbps(bps) -> str:
    return "%.1f Mbit/s" % (bps / 1e6)


# ------------------------------------------------------------------ kernel baselines

_PORTS = 0

def iperf3(server_ns, client_ns, addr, seconds, udp_len=None, parallel=1, port=None, cport=None, extra=()):
    """Goodput (bits/s at the receiver) of iperf3 TCP (udp_len None) or UDP -b 0;
    cport: a fixed client port (a fixed ECMP path)."""
    global _PORTS
    _PORTS += 1
    port = port or 5201 + (os.getpid() + _PORTS) % 2000
    srv = subprocess.Popen(["nsenter", "--net=/run/netns/" + server_ns, "iperf3", "-s", "-1", "--forceflush",
                            "-B", addr, "-p", str(port)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        while "listening" not in seen:         # "Server listening on PORT" once it listens
            line = srv.stdout.readline()
            if not line:
                raise RuntimeError("iperf3 server: %s" % seen.strip()[-300:])
            seen += line
        argv = ["iperf3", "-c", addr, "-p", str(port), "-t", str(seconds), "-J", "-P", str(parallel)]
        if udp_len:
            argv += ["-u", "-b", "0", "-l", str(udp_len)]
        if cport:
            argv += ["--cport", str(cport)]
        argv += list(extra)
        r = ns_cmd(client_ns, argv, capture_output=True, text=True, timeout=seconds + 30)
        j = json.loads(r.stdout)
        if "error" in j or "sum_received" not in j.get("end", {}) and not udp_len:
            raise RuntimeError("iperf3: %s" % j.get("error", "no result (%s)" % r.stdout[-300:]))
        if udp_len:
            s = j["end"]["sum"]
            got = (s["packets"] - s["lost_packets"]) * udp_len * 8
            return got / s["seconds"], {"lost_percent": s["lost_percent"]}
        return j["end"]["sum_received"]["bits_per_second"], {
            "retransmits": j["end"]["sum_sent"].get("retransmits")}
    finally:
        with contextlib.suppress(Exception):
            srv.wait(timeout=5)
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def stream(server_ns, client_ns, dst, seconds, proto=socket.IPPROTO_TCP, src=None):
    """One (MP)TCP stream client -> server; goodput at the receiver (bits/s)."""
    global _PORTS
    _PORTS += 1
    port = 15000 + (os.getpid() + _PORTS) % 1000
    ls = netns.run(server_ns, socket.socket, socket.AF_INET6, socket.SOCK_STREAM, proto)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((dst, port))
    ls.listen(1)
    got = {"bytes": 0}

    def rx():
        c, _ = ls.accept()
        buf = bytearray(1 << 20)
        t0 = None
        n = 0
        while True:
            k = c.recv_into(buf)
            if not k:
                break
            if t0 is None:
                t0 = time.monotonic()
            n += k
        got["bytes"], got["secs"] = n, time.monotonic() - t0
        c.close()
    t = threading.Thread(target=rx)
    t.start()
    cs = netns.run(client_ns, socket.socket, socket.AF_INET6, socket.SOCK_STREAM, proto)
    if src:
        cs.bind((src, 0))
    cs.connect((dst, port))
    data = b"\x5a" * (1 << 18)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        cs.sendall(data)
    cs.close()
    t.join(seconds + 30)
    ls.close()
    return got["bytes"] * 8 / got["secs"]


def tcp_rr(server_ns, client_ns, dst, iters=3000, size=8):
    """8-byte TCP request/response round trips (both ends Python): p50, p99 in us."""
    port = 16000 + os.getpid() % 1000
    ls = netns.run(server_ns, socket.socket, socket.AF_INET6, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((dst, port))
    ls.listen(1)

    def echo():
        c, _ = ls.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            b = c.recv(size, socket.MSG_WAITALL)
            if len(b) < size:
                break
            c.sendall(b)
        c.close()
    t = threading.Thread(target=echo)
    t.start()
    cs = netns.run(client_ns, socket.socket, socket.AF_INET6, socket.SOCK_STREAM)
    cs.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cs.connect((dst, port))
    msg = b"12345678"[:size].ljust(size, b"\0")
    lat = []
    for i in range(iters + 200):
        t0 = time.perf_counter_ns()
        cs.sendall(msg)
        cs.recv(size, socket.MSG_WAITALL)
        if i >= 200:
            lat.append((time.perf_counter_ns() - t0) / 1000)
    cs.close()
    t.join(10)
    ls.close()
    lat.sort()
    return {"p50_us": lat[len(lat) // 2], "p99_us": lat[int(len(lat) * 0.99)],
            "p999_us": lat[min(len(lat) - 1, int(len(lat) * 0.999))], "iters": iters}


# ------------------------------------------------------------------ MRC through the CLI

def engine_available() -> str | None:
    try:
        # endpoint._engine: the package's own `_engine` attribute is the compiled module
        # once imported (not before), not this function
        from mrc_xdp.transport import endpoint
        endpoint._engine()
        return None
    except Exception as e:     # reported as a line of the output
        return str(e).splitlines()[0]


def mrc_perf(kind, server, client, peer_addr, port, extra=(), timeout=180):
    """Run `mrc-xdp write-bw|write-lat` server and client (--json); the client's result."""
    s_inst, s_ns = server
    c_inst, c_ns = client
    srv = subprocess.Popen(CLI + [kind, "-i", s_inst, "--netns", s_ns, "--port", str(port),
                                  "--bind", peer_addr, "--json"] + list(extra),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        r = subprocess.run(CLI + [kind, peer_addr, "-i", c_inst, "--netns", c_ns, "--port", str(port),
                                  "--json"] + list(extra), capture_output=True, text=True, timeout=timeout)
        so, se = srv.communicate(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
    if r.returncode:
        raise RuntimeError("mrc-xdp %s client: %s" % (kind, (r.stderr.strip() or r.stdout.strip())[-400:]))
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ (a) live pair

class Pair:
    """Namespaces A and B, each with mrc0/mrc0p and the datapath loaded (ecmp), joined by
    plane veths p0 and p1 (XDP attached by the datapath: the kernel turns the peer's TSO
    off) and, with plain=True, by a third veth pair n0 that has no XDP program at all: the
    path a user without mrc-xdp would run TCP over (addresses A_N0, B_N0)."""
    A_ADDR, B_ADDR = "fd00:79::a", "fd00:79::b"
    A_P0, B_P0 = "fd00:79:1::a", "fd00:79:1::b"
    A_N0, B_N0 = "fd00:79:2::a", "fd00:79:2::b"

    def __init__(self, mtu: int, plain: bool = False):
        self.a, self.b = "btA-" + TAG, "btB-" + TAG
        self.ia, self.ib = "btA-" + TAG, "btB-" + TAG
        self.mtu = mtu
        self.plain = plain
        self.made = []

    def up(self):
        # native XDP on veth takes an MTU above 3506 only from a frags-aware program, once
        # it is attached: made at most 3506, loaded, then raised
        m0 = str(min(self.mtu, 3506))
        for n in (self.a, self.b):
            netns.create(n)
            self.made.append(n)
            ip(n, "link", "set", "lo", "up")
            ip(n, "link", "add", "mrc0", "mtu", m0, "type", "veth", "peer", "name", "mrc0p", "mtu", m0)
        for p in ("p0", "p1"):
            ip(self.a, "link", "add", p, "mtu", m0, "type", "veth", "peer", "name", p,
               "netns", self.b, "mtu", m0)
        for n in (self.a, self.b):
            for d in ("mrc0", "mrc0p", "p0", "p1"):
                ip(n, "link", "set", d, "up")
        ip(self.a, "addr", "add", self.A_P0 + "/64", "dev", "p0", "nodad")
        ip(self.b, "addr", "add", self.B_P0 + "/64", "dev", "p0", "nodad")
        if self.plain:
            ip(self.a, "link", "add", "n0", "mtu", str(self.mtu), "type", "veth", "peer", "name", "n0",
               "netns", self.b, "mtu", str(self.mtu))
            for n, addr in ((self.a, self.A_N0), (self.b, self.B_N0)):
                ip(n, "link", "set", "n0", "up")
                ip(n, "addr", "add", addr + "/64", "dev", "n0", "nodad")

        def mac(ns, dev):
            return json.loads(ip(ns, "-j", "link", "show", dev))[0]["address"]

        def cfg(inst, local, peer, gws):
            return HostConfig.from_dict({
                "instance": inst, "mode": "ecmp", "local_addr": local,
                "planes": [{"dev": "p%d" % i, "gateway_mac": m} for i, m in enumerate(gws)]})
        loader.load(cfg(self.ia, self.A_ADDR, self.B_ADDR, [mac(self.b, "p0"), mac(self.b, "p1")]), netns_name=self.a)
        loader.load(cfg(self.ib, self.B_ADDR, self.A_ADDR, [mac(self.a, "p0"), mac(self.a, "p1")]), netns_name=self.b)
        if self.mtu > int(m0):
            for n in (self.a, self.b):
                for d in ("p0", "p1", "mrc0p", "mrc0"):
                    ip(n, "link", "set", d, "mtu", str(self.mtu))
        # the engines reach each other's MRC address through mrc0 (spray); the kernel
        # needs a neighbour entry for it (the datapath rewrites the MACs anyway)
        for ns, peer in ((self.a, self.B_ADDR), (self.b, self.A_ADDR)):
            ip(ns, "addr", "add", (self.A_ADDR if ns == self.a else self.B_ADDR) + "/64", "dev", "mrc0", "nodad")
            ip(ns, "neigh", "replace", peer, "lladdr", mac(ns, "mrc0p"), "dev", "mrc0", "nud", "permanent")
        return self

    def down(self):
        for i in (self.ia, self.ib):
            with contextlib.suppress(Exception):
                loader.unload(i, quiet_missing=True)
        for n in self.made:
            with contextlib.suppress(Exception):
                netns.delete(n)


# Payload points of part (a): each runs on its own pair whose veths have the MTU the
# payload needs.  MTUs a veth takes with the datapath's (single-buffer) XDP programs end at
# 3506 on x86-64; larger payloads (4096, the InfiniBand size, and beyond) need programs
# loaded with frags support and a bigger MTU: a point whose pair cannot be set up is
# reported as not measured, with the reason, and the rest of the run goes on.
POINT_MTUS = (1500, 3506, 4184, 9000, 16000, 65000)


def point_mtu(payload: int) -> int:
    """The MTU of part (a)'s pair for an MRC payload: the smallest of POINT_MTUS whose
    default payload (mrc_xdp.transport.default_payload) is at least it."""
    from mrc_xdp.transport.endpoint import MAX_PAYLOAD, default_payload
    for m in POINT_MTUS:
        if default_payload(m, MAX_PAYLOAD) >= payload:
            return m
    raise ValueError("payload %d: larger than any MTU part (a) knows (%d)" % (payload, POINT_MTUS[-1]))


def per_gb(cpu_s, bps, seconds):
    return cpu_s / max(bps * seconds / 8 / 1e9, 1e-9)


def part_a_point(args, payload, mtu, no_engine):
    """One payload point: MRC (write-bw at this payload), iperf3 UDP (-l payload), iperf3
    TCP over the XDP plane veth, iperf3 TCP over the plain veth (no XDP), interleaved,
    --reps times; goodput and CPU s/GB of each; the ratios."""
    pr = Pair(mtu, plain=True)
    rows = {"mrc": [], "udp": [], "tcp": [], "tcp_noxdp": []}
    cpu = {k: [] for k in rows}
    try:
        pr.up()
        log("(a) live pair MTU %d: MRC payload %d B, UDP payload %d B, TCP over the XDP veth and over a "
            "plain veth, %d x %d s, load %s" % (mtu, payload, payload, args.reps, args.seconds,
                                                open("/proc/loadavg").read().split()[0]))
        for rep in range(args.reps):
            if no_engine is None:
                r, c = cpu_of(lambda: mrc_perf("write-bw", (pr.ib, pr.b), (pr.ia, pr.a), pr.B_P0, 18515 + rep,
                                               ["--duration", str(args.seconds), "--size", str(args.msg_size),
                                                "--mtu", str(payload)]))
                rows["mrc"].append(r["bw_avg_bps"])
                cpu["mrc"].append(c / (r["bytes"] * r["iterations"] / 1e9))
                log("  rep %d  MRC        %s  (%.2f CPU s/GB)" % (rep + 1, mbps(r["bw_avg_bps"]), cpu["mrc"][-1]))
            (bps, info), c = cpu_of(lambda: iperf3(pr.b, pr.a, pr.B_P0, args.seconds, udp_len=payload))
            rows["udp"].append(bps)
            cpu["udp"].append(per_gb(c, bps, args.seconds))
            log("  rep %d  UDP        %s (lost %.1f%%)  (%.2f CPU s/GB)" % (rep + 1, mbps(bps), info["lost_percent"],
                                                                         cpu["udp"][-1]))
            for k, dst, what in (("tcp", pr.B_P0, "TCP"), ("tcp_noxdp", pr.B_N0, "TCP-noXDP")):
                (bps, info), c = cpu_of(lambda: iperf3(pr.b, pr.a, dst, args.seconds))
                rows[k].append(bps)
                cpu[k].append(per_gb(c, bps, args.seconds))
                log("  rep %d  %-10s %s (retransmits %s)  (%.2f CPU s/GB)" % (rep + 1, what, mbps(bps),
                                                                            info["retransmits"], cpu[k][-1]))
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        log("  MTU %d: not measured: %s" % (mtu, str(e)[-300:]))
        return {"mtu": mtu, "payload": payload, "error": str(e)[-300:]}
    finally:
        pr.down()
    res = {k: {"runs": v, "median": statistics.median(v), "cpu_s_per_gb": statistics.median(cpu[k])}
           for k, v in rows.items() if v}
    if no_engine is not None:
        res["mrc"] = {"skipped": no_engine}
    elif res["mrc"]["median"]:
        res["ratios"] = {"MRC / UDP": res["mrc"]["median"] / res["udp"]["median"],
                         "MRC / TCP": res["mrc"]["median"] / res["tcp"]["median"],
                         "MRC / TCP-noXDP": res["mrc"]["median"] / res["tcp_noxdp"]["median"]}
    res.update(mtu=mtu, payload=payload)
    return res


def part_a(args, out):
    no_engine = engine_available()
    if args.mtu:
        from mrc_xdp.transport import default_payload
        points = [(default_payload(args.mtu), args.mtu)]
    else:
        points = [(p, point_mtu(p)) for p in args.payloads]
    res = {"points": [part_a_point(args, p, m, no_engine) for p, m in points]}
    # 8-byte latency on a pair at the first point's MTU
    pr = Pair(points[0][1])
    try:
        pr.up()
        res["tcp_rr_8B"] = tcp_rr(pr.b, pr.a, pr.B_P0)
        log("  TCP 8-byte request/response: p50 %.1f us, p99 %.1f us, p99.9 %.1f us" % (
            res["tcp_rr_8B"]["p50_us"], res["tcp_rr_8B"]["p99_us"], res["tcp_rr_8B"]["p999_us"]))
        if no_engine is None:
            r = mrc_perf("write-lat", (pr.ib, pr.b), (pr.ia, pr.a), pr.B_P0, 18600, ["--size", "8", "--iters", "3000"])
            res["mrc_lat_8B"] = r
            log("  MRC 8-byte write-lat round trip: p50 %.1f us, p99 %.1f us, p99.9 %.1f us" % (
                r["rtt_p50_us"], r["rtt_p99_us"], r["rtt_p999_us"]))
        res["lat_mtu"] = points[0][1]
    finally:
        pr.down()
    out["a"] = res


# ------------------------------------------------------------------ (b) lab

def uplinks(topo, lm, src="h0"):
    ends = {name: rx.ifindex for name, rx, _, _ in topo.link_ends()}
    t0 = topo.host(src).t0
    return {"p%dt1s%d" % (p, j): lm.counters(ends["%s>%s" % (topo.t0_name(p, t0), topo.t1_name(p, j))])["pkts"]
            for p in range(topo.planes) for j in range(topo.t1_per_plane)}


def uplink_bytes(topo, lm, src="h0"):
    """Bytes the link models counted on src's T0 -> T1 uplinks (whole frames, trimmed
    ones at their trimmed size): with the run time, how busy the bottleneck was."""
    ends = {name: rx.ifindex for name, rx, _, _ in topo.link_ends()}
    t0 = topo.host(src).t0
    return sum(lm.counters(ends["%s>%s" % (topo.t0_name(p, t0), topo.t1_name(p, j))])["bytes"]
               for p in range(topo.planes) for j in range(topo.t1_per_plane))


def spread(before, after):
    d = {k: after[k] - before[k] for k in after}
    tot = sum(d.values()) or 1
    return {k: round(v / tot, 3) for k, v in d.items()}


def mptcp_setup(prefix, addrs, mesh: bool):
    """MPTCP path manager endpoints: one subflow per plane NIC (h0's plane-1 address as
    a subflow endpoint), or (mesh) both of h0's addresses as full-mesh endpoints with
    h2 announcing its plane-1 address: 2 x 2 subflows.  No `dev` on the endpoints: a
    subflow bound to a device would drop its replies, which come back over the plane
    of the peer's address."""
    for h in ("h0", "h2"):
        ns = prefix + h
        ip(ns, "mptcp", "endpoint", "flush")
        ip(ns, "mptcp", "limits", "set", "subflow", "8", "add_addr_accepted", "8")
    if mesh:
        ip(prefix + "h2", "mptcp", "endpoint", "add", addrs["h2"][1], "signal")
        ip(prefix + "h0", "mptcp", "endpoint", "add", addrs["h0"][0], "subflow", "fullmesh")
        ip(prefix + "h0", "mptcp", "endpoint", "add", addrs["h0"][1], "subflow", "fullmesh")
    else:
        ip(prefix + "h0", "mptcp", "endpoint", "add", addrs["h0"][1], "subflow")


def lab_up(mode, rate, progress=log, mtu=None):
    """The default lab in `mode`; mtu: its fabric links' MTU instead of the default's
    (mrc0 gets mtu - 40, room for the SRv6 outer header), as a topology file may say."""
    from mrc_xdp.lab import fabric, hosts, topology
    from mrc_xdp.lab import linkmodel as lmod
    from mrc_xdp.datapath.validate import read_toml
    prefix = "bt%s%s-" % (mode[0], TAG[:5])
    data = read_toml(topology.DEFAULT_TOPOLOGY, "topology", topology.TopologyError)
    data["mode"] = mode
    if mtu:
        data["mtu"], data["app_mtu"] = mtu, mtu - topology.SRV6_OUTER_LEN
    topo = topology.from_dict(data, source=topology.DEFAULT_TOPOLOGY)
    st = fabric.up(topo, prefix=prefix, hosts_hook=hosts.fabric_hook)
    topo = fabric.topology_of(st)
    lm = lmod.LinkModel.open(st["pin_dir"])
    for lk in topo.links:
        for name, rx, tx in lk.ends():
            lm.update(rx.ifindex, rate_bps=rate * (1 if lk.tier == "fabric" else 2))
    return prefix, topo, lm


def lab_down(prefix):
    from mrc_xdp.lab import fabric, hosts
    with contextlib.suppress(Exception):
        fabric.down(prefix, unload_hosts=hosts.unload_all)


def shape(prefix, topo, rate, on: bool):
    """tbf at the sending end of every link, at the link model's rate: a real queue
    (the phantom queue only counts; it never delays), for transports that need ACK
    clocking.  XDP-redirected frames (a host's datapath to its plane NIC) skip qdiscs."""
    for lk in topo.links:
        r = rate * (1 if lk.tier == "fabric" else 2)
        for name, rx, tx in lk.ends():
            ns = prefix + tx.node
            if on:
                ns_cmd(ns, ["tc", "qdisc", "replace", "dev", tx.ifname, "root", "tbf", "rate", str(r),
                            "burst", "16kb", "limit", str(topo.linkmodel.drop_bytes)], check=True)
            else:
                ns_cmd(ns, ["tc", "qdisc", "del", "dev", tx.ifname, "root"], capture_output=True)


def part_b(args, out):
    from mrc_xdp.lab import topology
    rate = topology.parse_rate(args.rate)
    no_engine = engine_available()
    res = {}
    for mode in (["ecmp", "srv6"] if no_engine is None else ["ecmp"]):
        prefix = None
        try:
            prefix, topo, lm = lab_up(mode, rate, mtu=getattr(args, "lab_mtu", None))
            cap = topo.planes * topo.t1_per_plane * rate
            addrs = ctlpath.lab_control_path(prefix, topo)
            h0, h2 = prefix + "h0", prefix + "h2"
            for h in (h0, h2):      # a TCP flow keeps its path (no re-hash on RTO), as on hardware ECMP
                netns.run(h, ctlpath._sysctl, "net.core.txrehash", "0")
            dst = addrs["h2"][0]
            r = {"capacity_bps": cap, "rate_t0t1_bps": rate, "rate_host_bps": 2 * rate,
                 "mtu": topo.mtu, "app_mtu": topo.app_mtu}
            for shaped in {"no": [False], "yes": [False, True], "only": [True]}[args.shape]:
                shape(prefix, topo, rate, shaped)
                cfg = "linkmodel+tbf" if shaped else "linkmodel"
                log("(b) lab %s mode, %s: T0-T1 links %s, host links %s, h0 -> h2 capacity %s, MTU %d "
                    "(mrc0 %d), %d s per run" % (mode, cfg, mbps(rate), mbps(2 * rate), mbps(cap), topo.mtu,
                                                topo.app_mtu, args.seconds))
                runs = []
                if no_engine is None and not shaped:   # MRC runs on the link model as designed
                    pols = getattr(args, "ce_ack", None) or ["coalesced"]
                    for i in range(max(1, getattr(args, "mrc_runs", 1))):
                        for j, pol in enumerate(pols):     # interleaved when several
                            runs.append(("mrc_1qp" + ("[ce %s]" % pol if len(pols) > 1 else "")
                                         + ("#%d" % (i + 1) if i else ""),
                                         lambda i=i, j=j, pol=pol: mrc_perf(
                                             "write-bw", (prefix + "h2", h2), (prefix + "h0", h0), dst,
                                             18515 + i * len(pols) + j,
                                             ["--duration", str(args.seconds), "--size", str(args.msg_size),
                                              "--ce-ack", pol])))
                if mode == "ecmp" and not getattr(args, "mrc_only", False):
                    runs += [
                        ("tcp_1flow", lambda: iperf3(h2, h0, dst, args.seconds)[0]),
                        ("mptcp_2subflows", lambda: (mptcp_setup(prefix, addrs, False),
                                                     stream(h2, h0, dst, args.seconds, IPPROTO_MPTCP))[1]),
                        ("mptcp_4subflows", lambda: (mptcp_setup(prefix, addrs, True),
                                                     stream(h2, h0, dst, args.seconds, IPPROTO_MPTCP))[1]),
                        ("tcp_4flows", lambda: iperf3(h2, h0, dst, args.seconds, parallel=4)[0]),
                    ]
                rc = r.setdefault(cfg, {})
                for name, fn in runs:
                    time.sleep(1)         # the phantom queues drain between runs
                    b, bb = uplinks(topo, lm), uplink_bytes(topo, lm)
                    try:
                        x = fn()
                    except RuntimeError as e:
                        log("  %-16s failed: %s" % (name, str(e)[-200:]))
                        rc[name] = {"error": str(e)[-300:]}
                        continue
                    bps = x["bw_avg_bps"] if isinstance(x, dict) else x
                    sp = spread(b, uplinks(topo, lm))
                    rc[name] = {"bps": bps, "fraction": bps / cap, "uplink_share": sp}
                    extra = ""
                    if isinstance(x, dict):
                        q = x["qp_stats"]
                        rc[name]["qp_stats"] = q
                        # uplinks busy: wire bytes (headers, trimmed frames, retransmissions
                        # included) over what the uplinks carry in the run's time
                        busy = (uplink_bytes(topo, lm) - bb) * 8 / (cap * x["seconds"])
                        rc[name]["uplinks_busy"] = busy
                        # feedback volume: SACKs (and those echoing CE) per data packet sent
                        rc[name]["ecn_sacks_per_pkt"] = q["sacks_rx_ecn"] / max(1, q["tx_pkts"])
                        rc[name]["sacks_per_pkt"] = q["sacks_rx"] / max(1, q["tx_pkts"])
                        extra = "  (uplinks %.0f%% busy; rtx %d of %d pkts, SACKs %d = %.2f/pkt, of them ECN %d " \
                                "= %.2f/pkt, trims %d; cwnd %s B, srtt %s us at the end)" % (
                                    100 * busy, q["rtx_pkts"], q["tx_pkts"], q["sacks_rx"],
                                    rc[name]["sacks_per_pkt"], q["sacks_rx_ecn"], rc[name]["ecn_sacks_per_pkt"],
                                    q["nacks_rx_trim"], q.get("cwnd"), q.get("srtt_us"))
                    log("  %-16s %10s  %5.1f%% of capacity   uplinks %s%s" % (
                        name, mbps(bps), 100 * bps / cap,
                        " ".join("%s:%.0f%%" % (k, 100 * v) for k, v in sp.items()), extra))
                shape(prefix, topo, rate, False)
            res[mode] = r
        finally:
            if prefix:
                with contextlib.suppress(Exception):
                    lm.close()
                lab_down(prefix)
    if no_engine is not None:
        res["mrc"] = {"skipped": no_engine}
    out["b"] = res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(epilog="method and latest figures: docs/benchmarks.md (section \"Transport\")", description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["a", "b", "all"], default="all")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--rate", default="100mbit", help="T0-T1 link rate in (b); host links get twice it")
    ap.add_argument("--payloads", type=lambda v: [int(x) for x in v.split(",")], default=[1408, 3392],
                    help="(a) MRC payloads, comma-separated (default 1408,3392: MTU 1500 and 3506); each runs "
                         "on a pair at the MTU it needs (one of %s), UDP at the same payload, TCP at that MTU"
                         % ", ".join(map(str, POINT_MTUS)))
    ap.add_argument("--mtu", type=int, default=None,
                    help="(a) instead of --payloads: one point at this MTU (its default payload)")
    ap.add_argument("--msg-size", type=int, default=1 << 20, help="MRC write size for write-bw")
    ap.add_argument("--no-mrc", action="store_true", help="only the kernel baselines")
    ap.add_argument("--mrc-only", action="store_true", help="(b) only MRC (no kernel baselines)")
    ap.add_argument("--mrc-runs", type=int, default=1, help="(b) MRC runs per lab (mrc_1qp, mrc_1qp#2, ...)")
    ap.add_argument("--ce-ack", type=lambda v: v.split(","), default=["coalesced"], metavar="POLICIES",
                    help="(b) how the receiving engine SACKs CE-marked data: coalesced (default), each (a SACK "
                         "per marked packet, the policy before 0.3) or both, comma-separated: interleaved rows")
    ap.add_argument("--lab-mtu", type=int, default=None,
                    help="(b) fabric MTU of the lab (mrc0: 40 less; default: the default topology's 1600/1500; "
                         "at most 3000)")
    ap.add_argument("--shape", choices=["no", "yes", "only"], default="yes",
                    help="(b) also (yes) or only run every transport with tbf at each link's rate (a real queue)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_transport: needs root (namespaces, XDP): run with sudo", file=sys.stderr)
        return 2
    out: dict = {}
    t0 = time.monotonic()
    if args.no_mrc:
        global engine_available
        engine_available = lambda: "--no-mrc"   # noqa: E731
    try:
        if args.part in ("a", "all"):
            part_a(args, out)
        if args.part in ("b", "all"):
            part_b(args, out)
    except KeyboardInterrupt:
        return 130
    out["seconds"] = round(time.monotonic() - t0, 1)
    summary(out)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


def summary(out):
    a, b = out.get("a"), out.get("b")
    print("== bench_transport (%.0f s)" % out["seconds"])
    if a:
        print("(a) live pair (medians of the runs; CPU s/GB: user + sys of the tools, softirq work on their "
              "behalf not counted):")
        for pt in a["points"]:
            if "error" in pt:
                print("    payload %d B (MTU %d): not measured: %s" % (pt["payload"], pt["mtu"], pt["error"][-160:]))
                continue
            print("    payload %d B (MTU %d):" % (pt["payload"], pt["mtu"]))
            for k, name in (("mrc", "MRC"), ("udp", "UDP"), ("tcp", "TCP"), ("tcp_noxdp", "TCP-noXDP")):
                if "median" in pt.get(k, {}):
                    print("      %-10s %12s   %.2f CPU s/GB   runs: %s" % (
                        name, mbps(pt[k]["median"]), pt[k]["cpu_s_per_gb"],
                        ", ".join("%.1f" % (x / 1e6) for x in pt[k]["runs"])))
            if "ratios" in pt:
                print("      " + "   ".join("%s = %.2f" % kv for kv in pt["ratios"].items()))
            else:
                print("      MRC: not measured (%s)" % pt.get("mrc", {}).get("skipped"))
        rr = a["tcp_rr_8B"]
        print("    8-byte latency (MTU %d): TCP request/response p50 %.1f us p99 %.1f us p99.9 %.1f us" % (
            a.get("lat_mtu", 0), rr["p50_us"], rr["p99_us"], rr["p999_us"]))
        if "mrc_lat_8B" in a:
            m = a["mrc_lat_8B"]
            print("                             MRC write-lat round trip p50 %.1f us p99 %.1f us p99.9 %.1f us "
                  "(%.2fx / %.2fx / %.2fx TCP)" % (
                      m["rtt_p50_us"], m["rtt_p99_us"], m["rtt_p999_us"], m["rtt_p50_us"] / rr["p50_us"],
                      m["rtt_p99_us"] / rr["p99_us"], m["rtt_p999_us"] / rr["p999_us"]))
    if b:
        for mode in ("ecmp", "srv6"):
            if mode not in b:
                continue
            r = b[mode]
            print("(b) lab %s: capacity h0 -> h2 %s (T0-T1 %s, host links %s)" % (
                mode, mbps(r["capacity_bps"]), mbps(r["rate_t0t1_bps"]), mbps(r["rate_host_bps"])))
            for cfg in ("linkmodel", "linkmodel+tbf"):
                for k, v in r.get(cfg, {}).items():
                    if "error" in v:
                        print("    %-14s %-16s failed: %s" % (cfg, k, v["error"][-120:]))
                        continue
                    fb = ("   SACKs %.2f / data packet, ECN SACKs %.2f" % (v["sacks_per_pkt"], v["ecn_sacks_per_pkt"])
                          if "sacks_per_pkt" in v else "")
                    print("    %-14s %-16s %10s  %5.2f of capacity%s" % (cfg, k, mbps(v["bps"]), v["fraction"], fb))
        if "mrc" in b:
            print("    MRC: not measured (%s)" % b["mrc"]["skipped"])


if __name__ == "__main__":
    sys.exit(main())
