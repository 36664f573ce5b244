"""The job-level parts of the evaluation (tools/evaluate.py --only f,g,h): what MRC promises
a training job, measured on the netns lab with its fabric links rate-limited, so that the
network and not the two CPUs is the bottleneck.

(f) allreduce-perf tables (`mrc-xdp allreduce-perf`, nccl-tests format), MRC vs gloo (and
    gloo over MPTCP), 1 KiB to 64 MiB, busbw against the fabric's host-to-host capacity;
    then the same tool unthrottled (CPU-bound), with the CPU it took;
(g) training throughput (samples/s) of examples/train_ddp.py over MRC, gloo over TCP and
    gloo over MPTCP, interleaved rounds;
(h) job failures: the same DDP job, a fixed number of steps, run again and again with a
    fault from a fixed-seed schedule (a T1 that stops forwarding for 5-30 s, a T0-T1 link
    flapping, 2% loss on one link, a plane NIC down for 10 s) injected after its first
    step; failed, slow (> 1.5x healthy) and unaffected jobs per transport.

What each transport gets.  The link model (XDP on every switch port) limits every T0-T1
link to RATE and every host link to 2 x RATE in both directions; its phantom queue marks
ECN, trims MRC data and drops above 250 KB, but never delays.  MRC runs on that alone, as
designed.  gloo (over TCP or MPTCP) also gets a real queue: tbf at each link's rate in
front of the link model at the sending end of every link (as tools/bench_transport.py
--shape), which TCP's ACK clock needs; tbf is removed while MRC runs (switches forward
in the kernel, so it would queue MRC too).  gloo binds to its host name, the host's
plane-0 control address (mrc_xdp.lab.launch), so its TCP connections use plane 0, where
the T0s hash each over the two T1s.  gloo over MPTCP: every host announces its plane-1
control address as a subflow endpoint (one subflow per plane), and every socket of the
job is made MPTCP by mptcpize's library (LD_PRELOAD).  gloo sets SO_REUSEADDR on the
sockets it accepts, which MPTCP on this kernel refuses (EINVAL) on an accepted socket, and
gloo then aborts: `mptcpize run` alone cannot run gloo.  So a 10-line preload
(MPTCP_SHIM below) turns that one EINVAL into success (SO_REUSEADDR only matters to bind).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")
MPTCPIZE_LIB = "/usr/lib/x86_64-linux-gnu/mptcpize/libmptcpwrap.so.0"
TRANSPORTS = ("mrc", "gloo", "mptcp")
LABEL = {"mrc": "MRC", "gloo": "gloo (TCP)", "mptcp": "gloo (MPTCP)"}
# the collective timeout of (h): torch's default for NCCL is 10 minutes, which operators
# keep; the lab runs 60x faster than production (jobs of ~20 s for ~20 min, outages of
# 5-30 s for 5-30 min), so 10 s here
JOB_TIMEOUT_S = 10.0
SEED = 17
SLOW = 1.5

MPTCP_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>
/* gloo sets SO_REUSEADDR on accepted sockets; MPTCP refuses it there (EINVAL). */
int setsockopt(int fd, int level, int name, const void *val, socklen_t len)
{
    static int (*real)(int, int, int, const void *, socklen_t);
    if (!real)
        real = (int (*)(int, int, int, const void *, socklen_t))dlsym(RTLD_NEXT, "setsockopt");
    int rv = real(fd, level, name, val, len);
    if (rv == -1 && errno == EINVAL && level == SOL_SOCKET && name == SO_REUSEADDR)
        return 0;
    return rv;
}
"""

log = print          # evaluate.py sets its own


# ================================================================== the rate-limited lab

class Jobs:
    """Jobs on evaluate.Lab's lab (ecmp, health daemon): link rates, tbf for gloo, MPTCP
    endpoints, the preload, and one job at a time through mrc_xdp.lab.launch."""

    def __init__(self, lab, rate_bps: int):
        self.lab, self.rate = lab, rate_bps
        self.topo = lab.topo
        self.shaped = False
        self.limited = False
        self.port = 29500 + os.getpid() % 200
        self.preload = None

    # ---------------------------------------------------------------- links
    def set_rates(self, rate_bps: int) -> None:
        """rate_bps on every T0-T1 link end, twice it on host links (0: unlimited)."""
        for lk in self.topo.links:
            for _name, rx, _tx in lk.ends():
                self.lab.lm.update(rx.ifindex, rate_bps=rate_bps * (1 if lk.tier == "fabric" else 2))
        self.limited = bool(rate_bps)        # tbf for gloo only on a rate-limited lab

    def tbf(self, on: bool) -> None:
        import bench_transport as bt
        if on != self.shaped and self.rate:
            bt.shape(self.lab.prefix, self.topo, self.rate, on)
            self.shaped = on

    def capacity(self) -> dict:
        """Host-to-host capacity: a host's NICs (planes x 2 RATE) and, between hosts on
        different T0s, the paths (planes x T1s x RATE); the ring's hops are bounded by
        the smaller."""
        nic = self.topo.planes * 2 * self.rate
        fabric = self.topo.planes * self.topo.t1_per_plane * self.rate
        return {"nic_bps": nic, "cross_t0_bps": fabric, "host_to_host_bps": min(nic, fabric)}

    def ends(self, link_name: str):
        return [rx.ifindex for lk in self.topo.links if lk.name == link_name for _n, rx, _t in lk.ends()]

    def heal_all(self) -> None:
        for _n, rx, _t, _lk in self.topo.link_ends():
            self.lab.lm.update(rx.ifindex, blackhole=False, loss_ppm=0, flap_period_ms=0)

    # ---------------------------------------------------------------- MPTCP
    def mptcp_setup(self) -> None:
        """Every host: its plane-1 control address a subflow endpoint (the connecting
        side opens a second subflow over plane 1; policy routing keeps what is sent from
        C(1, h) on plane 1)."""
        from mrc_xdp.datapath import netns  # noqa: F401
        import bench_transport as bt
        if not os.path.exists(MPTCPIZE_LIB):
            raise RuntimeError("gloo over MPTCP needs mptcpize (apt-get install mptcpize; make setup)")
        for h in self.topo.hosts:
            ns = self.lab.prefix + h.name
            bt.ip(ns, "mptcp", "endpoint", "flush")
            bt.ip(ns, "mptcp", "limits", "set", "subflow", "8", "add_addr_accepted", "8")
            bt.ip(ns, "mptcp", "endpoint", "add", self.lab.ctl[h.name][1], "subflow")
        src = os.path.join(self.lab.tmp, "mptcp_shim.c")
        so = os.path.join(self.lab.tmp, "mptcp_shim.so")
        with open(src, "w") as f:
            f.write(MPTCP_SHIM)
        p = subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", so, src, "-ldl"], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError("compiling the MPTCP preload: %s" % p.stderr.strip()[-300:])
        self.preload = "%s:%s" % (MPTCPIZE_LIB, so)

    def mptcp_joins(self) -> int:
        """MP_JOIN subflows accepted so far by every host (nstat, absolute counters)."""
        n = 0
        for h in self.topo.hosts:
            p = subprocess.run(["nsenter", "--net=/run/netns/" + self.lab.prefix + h.name, "nstat", "-az",
                                "MPTcpExtMPJoinAckRx"], capture_output=True, text=True)
            for line in p.stdout.splitlines():
                if line.startswith("MPTcpExtMPJoinAckRx"):
                    n += int(line.split()[1])
        return n

    # ---------------------------------------------------------------- jobs
    def cmd(self, transport: str, argv: list[str]) -> list[str]:
        env = ["env", "PYTHONFAULTHANDLER=1"]       # a crashing rank says where
        if transport == "mptcp":
            if self.preload is None:
                self.mptcp_setup()
            env.append("LD_PRELOAD=" + self.preload)
        return env + argv

    def run(self, transport: str, argv: list[str], timeout: float, on_line=None) -> dict:
        """One job on every host: tbf on for gloo/MPTCP, off for MRC; returns exit status,
        wall time, rank 0's JSON line, the last lines, CPU seconds of the ranks and the
        machine's CPU busy fraction while it ran."""
        from mrc_xdp.lab import launch
        import resource
        self.tbf(transport != "mrc" and self.limited)
        self.port = 29500 + (self.port - 29500 + 1) % 400
        out = _Lines(on_line)
        c0 = cpu_times()
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.monotonic()
        rc = launch.launch(self.lab.prefix, self.cmd(transport, argv), timeout=timeout, port=self.port, out=out)
        wall = time.monotonic() - t
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy = cpu_busy(c0, cpu_times())
        js = None
        for line in out.lines:
            if line.startswith("[rank 0] {"):
                with contextlib.suppress(ValueError):
                    js = json.loads(line[len("[rank 0] "):])
        return {"rc": rc, "wall_s": wall, "json": js, "tail": [ln[-400:] for ln in out.lines[-40:]],
                "rank_cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), "cpu": busy}


class _Lines(io.TextIOBase):
    """launch()'s output: kept, and each line handed to on_line."""

    def __init__(self, on_line=None):
        self.lines, self.on_line, self._part = [], on_line, ""

    def write(self, s: str) -> int:
        self._part += s
        while "\n" in self._part:
            line, self._part = self._part.split("\n", 1)
            self.lines.append(line)
            if self.on_line:
                self.on_line(line)
        return len(s)

    def flush(self):
        pass


def cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def cpu_busy(a, b) -> dict:
    """The machine's CPUs between two /proc/stat readings: busy fraction (everything not
    idle or iowait, every process on the machine) and the softirq share of it."""
    d = [y - x for x, y in zip(a, b)]
    tot = sum(d[:8]) or 1
    idle = d[3] + d[4]
    return {"busy": round(1 - idle / tot, 3), "softirq": round(d[6] / tot, 3), "user": round((d[0] + d[1]) / tot, 3),
            "system": round(d[2] / tot, 3)}


@contextlib.contextmanager
def limited(lab, args):
    """The lab rate-limited for a part, unlimited again (and tbf removed) after it."""
    from mrc_xdp.lab import topology
    j = Jobs(lab, topology.parse_rate(args.rate))
    j.set_rates(j.rate)
    try:
        yield j
    finally:
        j.heal_all()
        j.tbf(False)
        j.set_rates(0)


def perf_cmd(lo: str, hi: str, factor: int, iters: int, warmup: int, backend: str) -> list[str]:
    return [sys.executable, "-m", "mrc_xdp.cli", "allreduce-perf", "-b", lo, "-e", hi, "-f", str(factor),
            "-n", str(iters), "-w", str(warmup), "--backend", "mrc" if backend == "mrc" else "gloo", "--json",
            "--timeout", "120"]


def train_cmd(backend: str, steps: int, timeout: float) -> list[str]:
    return [sys.executable, TRAIN, "--backend", "mrc" if backend == "mrc" else "gloo", "--steps", str(steps),
            "--log-every", "10", "--json", "--timeout", "%g" % timeout]


def _err(x: dict) -> str:
    """The line that says why a job failed: the last error a rank printed, else launch's."""
    errs = [ln for ln in x["tail"] if ("rror" in ln or "Segmentation" in ln or "imed out" in ln)
            and not ln.startswith("launch:")]
    if errs:                    # each rank's last word: the one that saw the cause first may not be last
        last = {}
        for ln in errs:
            last[ln.split("]", 1)[0] if ln.startswith("[rank ") else ""] = ln[-300:]
        return " | ".join([last.pop(k) for k in sorted(last) if k and k != errs[-1].split("]", 1)[0]] +
                          [errs[-1][-300:]])
    lines = [ln for ln in x["tail"] if ln.startswith("launch:")] or x["tail"]
    return (lines[-1] if lines else "exit %d" % x["rc"])[-300:]


# ================================================================== (f) allreduce-perf

def part_f(args, res, lab):
    with limited(lab, args) as j:
        cap = j.capacity()
        if args.quick:
            spans = [("1K", "4M", 4, 3, 1)]
            free_spans = [("1M", "4M", 4, 3, 1)]
            limited_tr = ("mrc", "gloo")
        else:
            spans = [("1K", "1M", 2, 20, 5), ("2M", "64M", 2, 3, 1)]
            free_spans = [("1M", "64M", 4, 3, 1)]
            limited_tr = ("mrc", "gloo", "mptcp")
        r = {"rate_bps": j.rate, "mtu": lab.topo.mtu, "app_mtu": lab.topo.app_mtu, "capacity": cap, "spans": spans, "free_spans": free_spans,
             "limited": {}, "free": {}, "load": {}}
        log("(f) rate-limited lab: T0-T1 links %s, host links %s: host-to-host capacity %.0f Mbit/s "
            "(%.1f MB/s of busbw)" % (args.rate, _rate(2 * j.rate), cap["host_to_host_bps"] / 1e6,
                                      cap["host_to_host_bps"] / 8e6))
        for tr in limited_tr:
            r["load"]["limited_" + tr] = _load()
            r["limited"][tr] = _perf(j, tr, spans, "rate-limited")
        j.tbf(False)
        j.set_rates(0)
        log("(f) unthrottled (no rate limits, no tbf): the CPUs bound both")
        for tr in ("mrc", "gloo"):
            r["load"]["free_" + tr] = _load()
            x = r["free"][tr] = _perf(j, tr, free_spans, "unthrottled")
            if args.quick:          # the smoke run leaves out the CPU-per-byte figure
                continue
            # CPU per byte: the ranks' CPU time less a run of one 1 KiB all-reduce (start-up,
            # rendezvous, teardown), over the bytes every rank sent (each size run -w + -n + 1
            # (the check) times, 2(n-1)/n of it sent per all-reduce)
            f = _perf(j, tr, [("1K", "1K", 2, 1, 0)], "fixed cost")
            n = 4
            sent = sum(row["size"] * 2 * (n - 1) / n * (it + wu + 1) for (lo, hi, fac, it, wu) in free_spans
                       for row in x["rows"] if _size(lo) <= row["size"] <= _size(hi))
            x["fixed_cpu_s"] = f["rank_cpu_s"]
            x["bytes_sent_all_ranks"] = n * sent
            x["cpu_s_per_gb"] = (x["rank_cpu_s"] - f["rank_cpu_s"]) / (n * sent / 1e9)
            log("(f)   %s unthrottled: %.1f CPU s of the ranks per GB sent (fixed cost %.1f CPU s left out)"
                % (tr, x["cpu_s_per_gb"], f["rank_cpu_s"]))
    res["f"] = r


def _size(v: str) -> int:
    from mrc_xdp.collective.perf import parse_size
    return parse_size(v)


def _perf(j, tr, spans, what) -> dict:
    rows, cpu, wall, rank_cpu = [], [], 0.0, 0.0
    for lo, hi, fac, n, w in spans:
        x = j.run(tr, perf_cmd(lo, hi, fac, n, w, tr), timeout=1800)
        if x["rc"] != 0 or not x["json"]:
            for ln in x["tail"][-15:]:
                log("(f)     | " + ln)
            raise RuntimeError("(f) allreduce-perf over %s (%s) failed: %s" % (tr, what, _err(x)))
        rows += x["json"]["rows"]
        cpu.append(x["cpu"])
        wall += x["wall_s"]
        rank_cpu += x["rank_cpu_s"]
    for row in rows:
        log("(f)   %-6s %-11s %10d B  %10.1f us  busbw %7.4f GB/s" % (tr, what, row["size"], row["time_us"],
                                                                     row["busbw"]))
    big = rows[-1]
    log("(f)   %s %s: %d B busbw %.1f MB/s; machine CPUs %.0f%% busy (%.0f%% softirq), ranks %.1f CPU s"
        % (tr, what, big["size"], big["busbw"] * 1e3, 100 * cpu[-1]["busy"], 100 * cpu[-1]["softirq"], rank_cpu))
    moved = sum(row["size"] * 1 for row in rows)       # bytes per rank per iteration, for a CPU/GB figure
    return {"rows": rows, "cpu": cpu, "wall_s": wall, "rank_cpu_s": rank_cpu, "wrong": sum(r["wrong"] or 0 for r in rows),
            "bytes_per_iter_sum": moved}


def plot_f(plt, r, args):
    fig, (ax, az) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.6, 1]})
    cap = r["capacity"]["host_to_host_bps"] / 8e6
    for tr, st in (("mrc", "o-"), ("gloo", "s-"), ("mptcp", "^-")):
        if tr in r["limited"]:
            rows = r["limited"][tr]["rows"]
            ax.plot([x["size"] for x in rows], [x["busbw"] * 1e3 for x in rows], st, ms=4, label=LABEL[tr])
    ax.axhline(cap, color="k", ls="--", lw=0.8, label="host-to-host capacity %.0f MB/s" % cap)
    ax.axhline(0.85 * cap, color="0.5", ls=":", lw=0.8, label="85% of it")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("all-reduce size per rank (bytes)")
    ax.set_ylabel("busbw, MB/s")
    big = {tr: v["rows"][-1] for tr, v in r["limited"].items()}
    ax.set_title("(f) allreduce-perf, 4 ranks, rate-limited: T0-T1 %s, host links %s\n64 MiB: %s" % (
        _rate(r["rate_bps"]), _rate(2 * r["rate_bps"]), ", ".join(
            "%s %.0f%%" % (LABEL[tr], 100 * x["busbw"] * 1e3 / cap) for tr, x in big.items())), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for tr, st in (("mrc", "o-"), ("gloo", "s-")):
        rows = r["free"][tr]["rows"]
        az.plot([x["size"] for x in rows], [x["busbw"] * 1e3 for x in rows], st, ms=4, label=LABEL[tr])
    az.set_xscale("log", base=2)
    az.set_xlabel("all-reduce size per rank (bytes)")
    az.set_ylabel("busbw, MB/s")
    fm, fg = r["free"]["mrc"]["rows"][-1], r["free"]["gloo"]["rows"][-1]
    az.set_title("unthrottled (CPU-bound): MRC / gloo at %d MiB = %.2f" % (fm["size"] >> 20, fm["busbw"] / fg["busbw"]),
                 fontsize=9)
    az.grid(alpha=0.3)
    az.legend(fontsize=8)
    return fig


def _mtu_text(r: dict) -> str:
    if "mtu" not in r:
        return ""
    return ("Fabric MTU %d and mrc0 %d for both transports (`evaluate.py --job-mtu`): the lab's largest, as MRC "
            "NICs send 4096-byte payloads; at the default 1600/1500 the two CPUs, not the links, bound MRC's four "
            "ranks." % (r["mtu"], r["app_mtu"]))


def section_f(w, r, args):
    cap = r["capacity"]
    w("`mrc-xdp allreduce-perf` (nccl-tests' table; float32 sum, in place, results checked, time = mean of -n "
      "iterations after -w warm-ups, averaged over ranks; busbw = algbw x 2(n-1)/n) on the 4 lab hosts, one rank "
      "each (`mrc-xdp lab launch`), ecmp lab, health daemon running. Sizes and iterations: %s. "
      % "; ".join("-b %s -e %s -f %d -n %d -w %d" % s for s in r["spans"]))
    w("")
    w("**Links.** The link model limits every T0-T1 link to %s and every host link to %s, both directions, so a "
      "host's two NICs carry %.0f Mbit/s and two hosts on different T0s have %d paths of %s (%.0f Mbit/s): the "
      "host-to-host capacity, which a ring all-reduce's busbw can reach at best, is %.0f Mbit/s = %.1f MB/s. "
      "MRC ran on the link model alone (phantom queue: ECN above 30 KB, trimming above 60 KB, drops above 250 KB, "
      "never a delay), as designed. %s gloo got real queues too: tbf at each link's rate (burst 16 KB, limit 250 KB) "
      "at the sending end of every link, which TCP's ACK clock needs (removed while MRC runs). gloo's TCP "
      "connections use the hosts' plane-0 control addresses (one plane; the T0s hash each connection onto one "
      "of the two T1s); gloo over MPTCP adds a subflow over plane 1 per connection (mptcpize's preload and a "
      "shim for gloo's SO_REUSEADDR on accepted sockets, see tools/eval_jobs.py)."
      % (_rate(r["rate_bps"]), _rate(2 * r["rate_bps"]), cap["nic_bps"] / 1e6, cap["cross_t0_bps"] // r["rate_bps"],
         _rate(r["rate_bps"]), cap["cross_t0_bps"] / 1e6, cap["host_to_host_bps"] / 1e6,
         cap["host_to_host_bps"] / 8e6, _mtu_text(r)))
    w("")
    trs = [t for t in TRANSPORTS if t in r["limited"]]
    w("| size (B) | " + " | ".join("%s time (us) | %s busbw (MB/s) | of capacity" % (LABEL[t], LABEL[t]) for t in trs)
      + " | MRC / gloo |")
    w("|---|" + "---|---|---|" * len(trs) + "---|")
    capB = cap["host_to_host_bps"] / 8e6
    for i, row in enumerate(r["limited"]["mrc"]["rows"]):
        cells = []
        for t in trs:
            x = r["limited"][t]["rows"][i]
            cells.append("%.0f | %.2f | %.0f%%" % (x["time_us"], x["busbw"] * 1e3, 100 * x["busbw"] * 1e3 / capB))
        g = r["limited"]["gloo"]["rows"][i]
        w("| %d | %s | %.2fx |" % (row["size"], " | ".join(cells), row["busbw"] / g["busbw"] if g["busbw"] else 0))
    w("")
    w("Wrong elements (checked against the exact sum): %s. Load average when each transport started: %s." % (
        ", ".join("%s %d" % (LABEL[t], r["limited"][t]["wrong"]) for t in trs),
        ", ".join("%s %s" % (LABEL[t], r["load"].get("limited_" + t, "?")) for t in trs)))
    w("")
    w("**Unthrottled (CPU-bound).** The same tool with no rate limit and no tbf (%s): every byte's cost is CPU "
      "on the 2 cores, shared by the 4 ranks, their engines and the switches' forwarding (softirq)." %
      "; ".join("-b %s -e %s -f %d -n %d -w %d" % s for s in r["free_spans"]))
    w("")
    w("| size (B) | MRC busbw (MB/s) | gloo busbw (MB/s) | MRC / gloo |")
    w("|---|---|---|---|")
    for m, g in zip(r["free"]["mrc"]["rows"], r["free"]["gloo"]["rows"]):
        w("| %d | %.1f | %.1f | %.2f |" % (m["size"], m["busbw"] * 1e3, g["busbw"] * 1e3, m["busbw"] / g["busbw"]))
    w("")
    for t in ("mrc", "gloo"):
        x = r["free"][t]
        c = x["cpu"][-1]
        w("- %s: the machine's CPUs %.0f%% busy while it ran (user %.0f%%, system %.0f%%, softirq %.0f%%); the "
          "ranks' own CPU time %.1f s in %.1f s of wall time; %s (load average %s at the start)." % (
              LABEL[t], 100 * c["busy"], 100 * c["user"], 100 * c["system"], 100 * c["softirq"], x["rank_cpu_s"],
              x["wall_s"], "less the %.1f s of a run of one 1 KiB all-reduce (start-up, rendezvous, teardown): "
              "**%.1f CPU s per GB** sent by the ranks (%.2f GB)" % (x["fixed_cpu_s"], x["cpu_s_per_gb"],
                                                                      x["bytes_sent_all_ranks"] / 1e9)
              if "cpu_s_per_gb" in x else "", r["load"].get("free_" + t, "?")))
    w("")
    for note in r.get("notes", []):
        w(note)
        w("")


# ================================================================== (g) training throughput

def part_g(args, res, lab):
    steps = 10 if args.quick else 80
    rounds = 1 if args.quick else 3
    with limited(lab, args) as j:
        cap = j.capacity()
        r = {"rate_bps": j.rate, "mtu": lab.topo.mtu, "app_mtu": lab.topo.app_mtu, "capacity": cap, "steps": steps, "rounds": rounds, "runs": {t: [] for t in TRANSPORTS},
             "load": []}
        log("(g) examples/train_ddp.py, %d steps, on the 4 hosts, rate-limited (T0-T1 %s): %d interleaved rounds"
            % (steps, args.rate, rounds))
        for rnd in range(rounds):
            for tr in TRANSPORTS:
                r["load"].append(_load())
                j0 = j.mptcp_joins() if tr == "mptcp" and j.preload else 0
                x = j.run(tr, train_cmd(tr, steps, 120), timeout=900)
                if x["rc"] != 0 or not x["json"]:
                    for ln in x["tail"][-15:]:
                        log("(g)     | " + ln)
                    raise RuntimeError("(g) training over %s failed: %s" % (tr, _err(x)))
                js = x["json"]
                run = {"samples_per_s": js["samples_per_s"], "seconds": js["seconds"],
                       "step_ms_median": 1e3 * statistics.median(js["step_times"]), "loss": js["loss"],
                       "params": js["params"], "rank_cpu_s": x["rank_cpu_s"], "cpu": x["cpu"], "wall_s": x["wall_s"],
                       "load": r["load"][-1]}
                if tr == "mptcp":
                    run["mp_joins"] = j.mptcp_joins() - j0
                r["runs"][tr].append(run)
                log("(g)   round %d %-12s %7.1f samples/s (step %.0f ms median, %.1f s; CPUs %.0f%% busy)%s" % (
                    rnd + 1, LABEL[tr], run["samples_per_s"], run["step_ms_median"], run["seconds"],
                    100 * x["cpu"]["busy"], "  %d MP_JOIN subflows" % run["mp_joins"] if tr == "mptcp" else ""))
    r["median"] = {t: statistics.median(x["samples_per_s"] for x in r["runs"][t]) for t in TRANSPORTS}
    r["ratio_mrc_gloo"] = r["median"]["mrc"] / r["median"]["gloo"]
    r["ratio_mptcp_gloo"] = r["median"]["mptcp"] / r["median"]["gloo"]
    r["round_ratios"] = [m["samples_per_s"] / g["samples_per_s"] for m, g in zip(r["runs"]["mrc"], r["runs"]["gloo"])]
    log("(g) median samples/s: MRC %.1f, gloo %.1f, MPTCP %.1f: MRC / gloo %.2fx" % (
        r["median"]["mrc"], r["median"]["gloo"], r["median"]["mptcp"], r["ratio_mrc_gloo"]))
    res["g"] = r


def plot_g(plt, r, args):
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, t in enumerate(TRANSPORTS):
        v = [x["samples_per_s"] for x in r["runs"][t]]
        ax.bar(i, r["median"][t], 0.6, color="C%d" % i, alpha=0.8)
        ax.plot([i] * len(v), v, "k.", ms=6)
        ax.text(i, r["median"][t] * 1.02, "%.0f" % r["median"][t], ha="center", fontsize=9)
    ax.set_xticks(range(len(TRANSPORTS)))
    ax.set_xticklabels([LABEL[t] for t in TRANSPORTS])
    ax.set_ylabel("samples/s (bars: median of %d rounds; dots: rounds)" % r["rounds"])
    ax.set_title("(g) DDP training (examples/train_ddp.py, %d k params, 4 ranks, %d steps), rate-limited\n"
                 "T0-T1 %s, host links %s: MRC / gloo = %.2fx, MPTCP / gloo = %.2fx" % (
                     r["runs"]["mrc"][0]["params"] // 1000, r["steps"], _rate(r["rate_bps"]), _rate(2 * r["rate_bps"]),
                     r["ratio_mrc_gloo"], r["ratio_mptcp_gloo"]), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return fig


def section_g(w, r, args):
    p = r["runs"]["mrc"][0]["params"]
    w("The DDP job of examples/train_ddp.py (a character-level transformer, %d parameters, so %.1f MB of float32 "
      "gradients all-reduced per step in DDP's buckets; batch 16 x 64 bytes per rank; torch CPU build, one thread "
      "per rank), %d steps on the 4 hosts (`mrc-xdp lab launch`), over MRC (`--backend mrc`), gloo over TCP and gloo "
      "over MPTCP, in %d interleaved rounds. Same lab, links and queues as (f): T0-T1 links %s, host links %s "
      "(link model); tbf queues for gloo; host-to-host capacity %.0f Mbit/s. samples/s = 4 ranks x 16 x steps / "
      "the training loop's time on rank 0 (start-up excluded)."
      % (p, 4 * p / 1e6, r["steps"], r["rounds"], _rate(r["rate_bps"]), _rate(2 * r["rate_bps"]),
         r["capacity"]["host_to_host_bps"] / 1e6))
    w("")
    w("| transport | samples/s per round | median | median step | ranks' CPU s per round | machine CPUs busy |")
    w("|---|---|---|---|---|---|")
    for t in TRANSPORTS:
        xs = r["runs"][t]
        w("| %s | %s | **%.1f** | %s | %s | %s |" % (
            LABEL[t], ", ".join("%.1f" % x["samples_per_s"] for x in xs), r["median"][t],
            ", ".join("%.0f ms" % x["step_ms_median"] for x in xs), ", ".join("%.1f" % x["rank_cpu_s"] for x in xs),
            ", ".join("%.0f%%" % (100 * x["cpu"]["busy"]) for x in xs)))
    w("")
    joins = [x.get("mp_joins") for x in r["runs"]["mptcp"] if x.get("mp_joins") is not None]
    w("MRC / gloo over TCP: **%.2fx** (median; per round %s); gloo over MPTCP / gloo over TCP: %.2fx.%s "
      "Load average at each run's start: %s." % (
          r["ratio_mrc_gloo"], ", ".join("%.2fx" % v for v in r["round_ratios"]), r["ratio_mptcp_gloo"],
          " MPTCP subflows joined per run (MP_JOIN accepted, all hosts): %s." % ", ".join(map(str, joins)) if joins else "",
          ", ".join(r["load"])))
    w("")
    for note in r.get("notes", []):
        w(note)
        w("")


# ================================================================== (h) job failures

KINDS = ("t1_down", "link_flap", "loss_2pct", "nic_down")
KIND_TEXT = {"t1_down": "a T1 stops forwarding", "link_flap": "a T0-T1 link flapping",
             "loss_2pct": "2% loss on one link", "nic_down": "a plane NIC down"}


def schedule(topo, n: int, seed: int = SEED, quick: bool = False) -> list[dict]:
    """n faults, the kinds balanced and shuffled, their targets and times drawn from a
    seeded generator: the same schedule on every run and for every transport."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    rng.shuffle(kinds)
    t1s = [topo.t1_name(p, j) for p in range(topo.planes) for j in range(topo.t1_per_plane)]
    fab = sorted(lk.name for lk in topo.links if lk.tier == "fabric")
    hostl = sorted(lk.name for lk in topo.links if lk.tier != "fabric")
    out = []
    for i, k in enumerate(kinds):
        f = {"job": i + 1, "kind": k, "start_s": round(rng.uniform(0.5, 3.0), 2)}
        if k == "t1_down":
            f.update(target=rng.choice(t1s), duration_s=round(rng.uniform(5, 30), 1))
        elif k == "link_flap":
            f.update(target=rng.choice(fab), duration_s=round(rng.uniform(10, 20), 1),
                     period_ms=rng.choice([1000, 2000, 4000]))
        elif k == "loss_2pct":
            f.update(target=rng.choice(fab), duration_s=None, loss_ppm=20000)
        else:
            f.update(target=rng.choice(hostl), duration_s=10.0)
        if quick:                              # the smoke run's jobs are short: so are its faults
            f["start_s"] = min(f["start_s"], 1.0)
            if f["duration_s"]:
                f["duration_s"] = min(f["duration_s"], 6.0)
        out.append(f)
    return out


def fault_text(f: dict) -> str:
    if f["kind"] == "t1_down":
        return "%s stops forwarding for %.1f s" % (f["target"], f["duration_s"])
    if f["kind"] == "link_flap":
        return "%s flaps (down %.1f s of every %.0f s) for %.1f s" % (f["target"], f["period_ms"] / 2000,
                                                                     f["period_ms"] / 1000, f["duration_s"])
    if f["kind"] == "loss_2pct":
        return "2%% loss on %s (both ways) until the job ends" % f["target"]
    return "NIC link %s down for %.1f s" % (f["target"], f["duration_s"])


class Fault:
    """Injects f once rank 0 has printed its first step, for its duration or until the
    job ends; heals it either way."""

    def __init__(self, j: Jobs, f: dict):
        self.j, self.f = j, f
        self.started = threading.Event()
        self.done = threading.Event()
        self.applied_at = None
        self.cleared_at = None
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def on_line(self, line: str) -> None:
        if line.startswith("[rank 0] step "):
            self.started.set()

    def _ends(self):
        f, lab = self.f, self.j.lab
        if f["kind"] == "t1_down":
            return lab.t1_ends(f["target"])
        return self.j.ends(f["target"])

    def _set(self, on: bool):
        f = self.f
        for i in self._ends():
            if f["kind"] in ("t1_down", "nic_down"):
                self.j.lab.lm.update(i, blackhole=on)
            elif f["kind"] == "link_flap":
                self.j.lab.lm.update(i, flap_period_ms=f["period_ms"] if on else 0)
            else:
                self.j.lab.lm.update(i, loss_ppm=f["loss_ppm"] if on else 0)

    def _run(self):
        while not self.started.wait(0.05):
            if self.done.is_set():
                return
        if self.done.wait(self.f["start_s"]):
            return
        self._set(True)
        self.applied_at = time.monotonic()
        try:
            self.done.wait(self.f["duration_s"])
        finally:
            self._set(False)
            self.cleared_at = time.monotonic()

    def finish(self):
        self.done.set()
        self.th.join(10)
        self.j.heal_all()


def part_h(args, res, lab):
    n_jobs = 2 if args.quick else 20
    steps = 20 if args.quick else 25
    healthy_n = 1 if args.quick else 2        # before the schedule, and after it
    with limited(lab, args) as j:
        sched = schedule(lab.topo, n_jobs, quick=args.quick)
        r = {"rate_bps": j.rate, "mtu": lab.topo.mtu, "app_mtu": lab.topo.app_mtu, "steps": steps, "timeout_s": JOB_TIMEOUT_S, "seed": SEED, "schedule": sched,
             "healthy": {t: [] for t in TRANSPORTS}, "jobs": {t: [] for t in TRANSPORTS}, "slow_factor": SLOW}
        log("(h) %d jobs per transport of examples/train_ddp.py (%d steps, collective timeout %g s), faults from "
            "seed %d; %d healthy job(s) each (before%s)" % (n_jobs, steps, JOB_TIMEOUT_S, SEED, healthy_n,
                                                        " and after" if healthy_n > 1 else ""))
        t_part = time.monotonic()

        def healthy():
            for tr in TRANSPORTS:
                x = j.run(tr, train_cmd(tr, steps, JOB_TIMEOUT_S), timeout=300)
                if x["rc"] != 0 or not x["json"]:
                    raise RuntimeError("(h) a healthy job over %s failed: %s" % (tr, _err(x)))
                r["healthy"][tr].append({"seconds": x["json"]["seconds"], "wall_s": x["wall_s"], "load": _load()})
                log("(h)   healthy %-12s %.1f s training (%.1f s with start-up)" % (LABEL[tr], x["json"]["seconds"],
                                                                                  x["wall_s"]))
        healthy()               # healthy jobs before and after the schedule: the machine's load drifts
        for f in sched:
            for tr in TRANSPORTS:
                fl = Fault(j, f)
                try:
                    x = j.run(tr, train_cmd(tr, steps, JOB_TIMEOUT_S), timeout=300, on_line=fl.on_line)
                finally:
                    fl.finish()
                job = {"job": f["job"], "rc": x["rc"], "wall_s": x["wall_s"], "load": _load(),
                       "fault_applied": fl.applied_at is not None,
                       "fault_s": (fl.cleared_at - fl.applied_at) if fl.applied_at and fl.cleared_at else None}
                if x["rc"] == 0 and x["json"]:
                    job["seconds"] = x["json"]["seconds"]
                    job["max_step_s"] = max(x["json"]["step_times"])
                else:
                    job["outcome"] = "failed"
                    job["error"] = _err(x)
                r["jobs"][tr].append(job)
                log("(h)   job %2d %-12s %s   [%s]" % (
                    f["job"], LABEL[tr], "%.1f s training, longest step %.1f s" % (job["seconds"], job["max_step_s"])
                    if "seconds" in job else "FAILED: " + job["error"][-150:], fault_text(f)))
                time.sleep(1.0)      # the health daemon's probes bring retired EVs back
        if healthy_n > 1:
            healthy()
        base = {t: statistics.median(h["seconds"] for h in r["healthy"][t]) for t in TRANSPORTS}
        r["healthy_s"] = base
        for t in TRANSPORTS:
            for job in r["jobs"][t]:
                if "seconds" in job:
                    job["slowdown"] = job["seconds"] / base[t]
                    job["outcome"] = "slow" if job["slowdown"] > SLOW else "unaffected"
        r["part_s"] = time.monotonic() - t_part
    r["counts"] = {t: {o: sum(1 for x in r["jobs"][t] if x["outcome"] == o) for o in ("failed", "slow", "unaffected")}
                   for t in TRANSPORTS}
    log("(h) %s" % "; ".join("%s: %d failed, %d slow, %d unaffected" % (
        LABEL[t], c["failed"], c["slow"], c["unaffected"]) for t, c in r["counts"].items()))
    res["h"] = r


def plot_h(plt, r, args):
    fig, (ax, az) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.8]})
    cols = {"failed": "C3", "slow": "C1", "unaffected": "C2"}
    bottom = [0] * len(TRANSPORTS)
    for o in ("failed", "slow", "unaffected"):
        v = [r["counts"][t][o] for t in TRANSPORTS]
        ax.bar(range(len(TRANSPORTS)), v, 0.6, bottom=bottom, color=cols[o], label=o)
        for i, (b, x) in enumerate(zip(bottom, v)):
            if x:
                ax.text(i, b + x / 2, str(x), ha="center", va="center", fontsize=9)
        bottom = [b + x for b, x in zip(bottom, v)]
    ax.set_xticks(range(len(TRANSPORTS)))
    ax.set_xticklabels([LABEL[t] for t in TRANSPORTS], fontsize=8)
    ax.set_ylabel("jobs")
    ax.set_title("(h) %d jobs per transport, one fault each;\nslow: > %.1fx healthy; timeout %g s" % (
        len(r["schedule"]), r["slow_factor"], r["timeout_s"]), fontsize=9)
    ax.legend(fontsize=8)
    top = 1
    for i, t in enumerate(TRANSPORTS):
        xs = [x["job"] + (i - 1) * 0.22 for x in r["jobs"][t]]
        ys = [x.get("slowdown") for x in r["jobs"][t]]
        ok = [(a, b) for a, b in zip(xs, ys) if b is not None]
        top = max([top] + [b for _, b in ok])
        az.bar([a for a, _ in ok], [b for _, b in ok], 0.22, color="C%d" % i, label=LABEL[t])
    for i, t in enumerate(TRANSPORTS):
        fx = [x["job"] + (i - 1) * 0.22 for x in r["jobs"][t] if x["outcome"] == "failed"]
        az.plot(fx, [top * 1.05] * len(fx), "x", color="C%d" % i, ms=8, mew=2)
    az.axhline(r["slow_factor"], color="k", ls=":", lw=0.8)
    az.set_xticks([f["job"] for f in r["schedule"]])
    az.set_xticklabels(["%d\n%s" % (f["job"], {"t1_down": "T1", "link_flap": "flap", "loss_2pct": "loss",
                                                 "nic_down": "NIC"}[f["kind"]]) for f in r["schedule"]], fontsize=7)
    az.set_ylabel("training time / healthy (x: failed)")
    az.set_title("per job: T0-T1 %s, host links %s" % (_rate(r["rate_bps"]), _rate(2 * r["rate_bps"])), fontsize=9)
    az.legend(fontsize=8)
    az.grid(axis="y", alpha=0.3)
    return fig


def section_h(w, r, args):
    w("Each job is examples/train_ddp.py, %d steps on the 4 hosts, same lab, links and queues as (f) and (g) "
      "(T0-T1 %s, host links %s; tbf for gloo). Once rank 0 has printed its first step, one fault from a fixed "
      "schedule (seed %d: the four kinds in equal numbers, shuffled; target, start 0.5-3 s after the first step "
      "and duration drawn) is injected by the link model and healed after its duration or when the job ends; "
      "every transport gets the same fault in job i, the three transports interleaved. The collective timeout is "
      "**%g s** (`init_process_group(timeout=...)`, train_ddp.py --timeout): operators keep torch's default of "
      "10 minutes (NCCL), and the lab runs about 60x faster than production (jobs of ~20 s for jobs of ~20 min, "
      "outages of 5-30 s for outages of 5-30 min), so 10 minutes becomes 10 s. Over MRC the timeout is the time "
      "without progress from a peer; over gloo the time one collective may take. A job **failed** when it exited "
      "non-zero (a collective timed out or failed), is **slow** when its training loop took more than %.1fx the "
      "median of %d healthy jobs of the same transport (run before and after the schedule), else **unaffected**. The health daemon runs "
      "(its probes bring retired EVs back); hosts keep a TCP flow on its path on RTO (net.core.txrehash = 0, as "
      "hardware ECMP, which does not hash the flow label). Part time: %.0f s."
      % (r["steps"], _rate(r["rate_bps"]), _rate(2 * r["rate_bps"]), r["seed"], r["timeout_s"], r["slow_factor"],
         len(r["healthy"]["mrc"]), r.get("part_s", 0)))
    w("")
    w("| transport | healthy training time | failed | slow (> %.1fx) | unaffected |" % r["slow_factor"])
    w("|---|---|---|---|---|")
    for t in TRANSPORTS:
        c = r["counts"][t]
        w("| %s | %s | **%d** | %d | %d |" % (LABEL[t], ", ".join("%.1f s" % h["seconds"] for h in r["healthy"][t]),
                                              c["failed"], c["slow"], c["unaffected"]))
    w("")
    w("| job | fault | " + " | ".join(LABEL[t] for t in TRANSPORTS) + " |")
    w("|---|---|" + "---|" * len(TRANSPORTS))
    for i, f in enumerate(r["schedule"]):
        cells = []
        for t in TRANSPORTS:
            x = r["jobs"][t][i]
            if x["outcome"] == "failed":
                cells.append("FAILED")
            else:
                cells.append("%s %.2fx (longest step %.1f s)" % ("slow" if x["outcome"] == "slow" else "ok",
                                                                 x["slowdown"], x["max_step_s"]))
        w("| %d | %s | %s |" % (f["job"], fault_text(f), " | ".join(cells)))
    w("")
    errs = {}
    for t in TRANSPORTS:
        for x in r["jobs"][t]:
            if x["outcome"] == "failed":
                errs.setdefault(t, x["error"])
    for t, e in errs.items():
        w("- A failed %s job's last error line: `%s`" % (LABEL[t], e.replace("`", "'")[-200:]))
    if errs:
        w("")
    for note in r.get("notes", []):
        w(note)
        w("")


# ================================================================== shared

def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _rate(bps: int) -> str:
    return "%g Mbit/s" % (bps / 1e6)


def headline(res) -> list[str]:
    h = []
    if "f" in res:
        r = res["f"]
        capB = r["capacity"]["host_to_host_bps"] / 8e6
        m, g = r["limited"]["mrc"]["rows"][-1], r["limited"]["gloo"]["rows"][-1]
        s = "(f) allreduce-perf at %d MiB, rate-limited (capacity %.1f MB/s): MRC busbw %.1f MB/s = %.0f%% of " \
            "capacity, gloo %.1f MB/s (%.0f%%): %.1fx" % (
                m["size"] >> 20, capB, m["busbw"] * 1e3, 100 * m["busbw"] * 1e3 / capB, g["busbw"] * 1e3,
                100 * g["busbw"] * 1e3 / capB, m["busbw"] / g["busbw"])
        if "mptcp" in r["limited"]:
            x = r["limited"]["mptcp"]["rows"][-1]
            s += "; gloo over MPTCP %.1f MB/s (%.0f%%)" % (x["busbw"] * 1e3, 100 * x["busbw"] * 1e3 / capB)
        fm, fg = r["free"]["mrc"]["rows"][-1], r["free"]["gloo"]["rows"][-1]
        s += "; unthrottled (CPU-bound) MRC / gloo %.2f at %d MiB" % (fm["busbw"] / fg["busbw"], fm["size"] >> 20)
        h.append(s)
    if "g" in res:
        r = res["g"]
        h.append("(g) DDP training, rate-limited: MRC %.0f samples/s, gloo over TCP %.0f, gloo over MPTCP %.0f: "
                 "MRC / gloo %.2fx" % (r["median"]["mrc"], r["median"]["gloo"], r["median"]["mptcp"], r["ratio_mrc_gloo"]))
    if "h" in res:
        r = res["h"]
        h.append("(h) %d jobs per transport with a fault each (timeout %g s): failed / slow / unaffected: %s" % (
            len(r["schedule"]), r["timeout_s"], ", ".join("%s %d / %d / %d" % (
                LABEL[t], r["counts"][t]["failed"], r["counts"][t]["slow"], r["counts"][t]["unaffected"])
                for t in TRANSPORTS)))
    return h
