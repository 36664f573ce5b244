"""8-byte latency: MRC write-lat round trip (p50 / p99 / p99.9) under engine-spin settings,
beside a TCP request/response of the same size, on the live pair (bench_transport part
(a)'s pair), `--reps` times each, interleaved; then the idle CPU of endpoints that have
just had traffic.  Prints every run, the medians and the ratios.  Run as root:
    .venv/bin/python tools/bench_lat.py --reps 3

--configs lists ENGINE:CALLER pairs: ENGINE is each side's engine spin (write-lat
--spin-us: the progress thread spins up to that many us after work, adaptive below it;
0 off, as before the spin existed), CALLER each side's spin for a completion (write-lat
--cq-spin-us: the caller waits in C and receives frames itself; 0: sleeps on the CQ's
eventfd).  The default compares spin off, the engine's spin alone, and both.

Idle CPU: a child process opens an endpoint on each side of the pair, connects a QP pair,
does 100 round trips, then idles; its CPU time (utime + stime, /proc) over --idle-seconds
is reported as a percentage of one core, the process's and its mrc-engine threads' alone
(the rest is the per-QP counter publisher, one JSON file a second).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_transport as bt  # noqa: E402

IDLE_CHILD = r"""
import os, sys, time
from mrc_xdp import transport
ia, ib, spin = sys.argv[1], sys.argv[2], int(sys.argv[3])
A, B = transport.Endpoint(ia, spin_us=spin), transport.Endpoint(ib, spin_us=spin)
qa, qb = A.create_qp(), B.create_qp()
qa.connect(qb.local_attrs()); qb.connect(qa.local_attrs())
sa, sb = bytearray(8), bytearray(8)
ma, mb = A.reg_mr(sa), B.reg_mr(sb)
def recv(ep, i):
    for _ in range(1000):
        got = ep.cq.wait_blocking(timeout=10)
        assert got and all(c.ok for c in got), got
        if any(c.imm == i for c in got):
            return
    raise AssertionError("no receive completion %d" % i)
for i in range(100):
    qa.post_write(i, ma, 0, 8, mb.addr, mb.rkey, imm=i)
    recv(B, i)
    qb.post_write(i, mb, 0, 8, ma.addr, ma.rkey, imm=i)
    recv(A, i)
time.sleep(0.05)
A.cq.poll(); B.cq.poll()
print("ready", flush=True)
sys.stdin.readline()
qa.destroy(); qb.destroy(); A.close(); B.close()
"""


def _ticks(path):
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])         # utime + stime


def idle_cpu(pr, spin: int, seconds: float) -> dict:
    """CPU of two idle endpoints (A and B of the pair, one QP pair, after 100 round trips)
    over `seconds`: % of one core, whole process and its mrc-engine threads."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen([sys.executable, "-c", IDLE_CHILD, pr.ia, pr.ib, str(spin)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("idle child failed (spin_us %d)" % spin)
        time.sleep(0.2)            # the last spin (at most spin_us) and the publisher's first write
        tasks = "/proc/%d/task" % p.pid
        eng = [t for t in os.listdir(tasks) if open("%s/%s/comm" % (tasks, t)).read().strip() == "mrc-engine"]
        hz = os.sysconf("SC_CLK_TCK")
        p0, e0, t0 = _ticks("/proc/%d/stat" % p.pid), sum(_ticks("%s/%s/stat" % (tasks, t)) for t in eng), \
            time.monotonic()
        time.sleep(seconds)
        p1, e1, t1 = _ticks("/proc/%d/stat" % p.pid), sum(_ticks("%s/%s/stat" % (tasks, t)) for t in eng), \
            time.monotonic()
        el = t1 - t0
        return {"spin_us": spin, "seconds": round(el, 2), "engine_threads": len(eng),
                "process_pct": 100.0 * (p1 - p0) / hz / el, "engine_pct": 100.0 * (e1 - e0) / hz / el,
                "tick_s": 1.0 / hz}
    finally:
        try:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=30)
        except Exception:
            p.kill()
            p.wait()


def load() -> str:
    return open("/proc/loadavg").read().split()[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(epilog="method and latest figures: docs/benchmarks.md", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--configs", default="0:0,50:0,50:50",
                    help="ENGINE:CALLER spin pairs in us, comma-separated (default 0:0,50:0,50:50)")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="idle CPU window (0: skip)")
    ap.add_argument("--json", action="store_true", help="also one JSON document at the end")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_lat: needs root (namespaces, XDP): run with sudo", file=sys.stderr)
        return 2
    try:
        configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
        assert configs and all(len(c) == 2 for c in configs)
    except (ValueError, AssertionError):
        print("bench_lat: --configs %r: give ENGINE:CALLER pairs, e.g. 0:0,50:0" % args.configs, file=sys.stderr)
        return 2
    pr = bt.Pair(args.mtu)
    tcp = {"p50": [], "p99": [], "p999": []}
    mrc = {c: {"p50": [], "p99": [], "p999": [], "engine": []} for c in configs}
    idle = []
    print("bench_lat: MTU %d, %d round trips a run, %d reps, configs (engine:caller spin us) %s, load %s" % (
        args.mtu, args.iters, args.reps, " ".join("%d:%d" % c for c in configs), load()), flush=True)
    try:
        pr.up()
        for rep in range(args.reps):
            t = bt.tcp_rr(pr.b, pr.a, pr.B_P0, iters=args.iters)
            for k in tcp:
                tcp[k].append(t[k + "_us"])
            print("rep %d  TCP RR           p50 %7.1f  p99 %7.1f  p99.9 %7.1f us   load %s" % (
                rep + 1, t["p50_us"], t["p99_us"], t["p999_us"], load()), flush=True)
            for i, (sp, cq) in enumerate(configs):
                r = bt.mrc_perf("write-lat", (pr.ib, pr.b), (pr.ia, pr.a), pr.B_P0, 18600 + (rep * len(configs) + i) % 300,
                                ["--size", "8", "--iters", str(args.iters), "--spin-us", str(sp),
                                 "--cq-spin-us", str(cq)])
                m = mrc[(sp, cq)]
                m["p50"].append(r["rtt_p50_us"])
                m["p99"].append(r["rtt_p99_us"])
                m["p999"].append(r["rtt_p999_us"])
                m["engine"].append(r.get("engine", {}))
                e = r.get("engine", {})
                print("rep %d  MRC spin %4d:%-4d p50 %7.1f  p99 %7.1f  p99.9 %7.1f us   load %s   client engine: "
                      "spin hits %d misses %d yields %d preempted %d, sleeps %d, post wake-ups %d, caller rx %d "
                      "(preempted %d)" % (
                          rep + 1, sp, cq, r["rtt_p50_us"], r["rtt_p99_us"], r["rtt_p999_us"], load(),
                          e.get("spin_hits", 0), e.get("spin_misses", 0), e.get("spin_yields", 0),
                          e.get("spin_preempted", 0), e.get("sleeps", 0), e.get("post_wakeups", 0),
                          e.get("caller_rx", 0), e.get("caller_preempted", 0)), flush=True)
        if args.idle_seconds > 0:
            for sp in sorted({c[0] for c in configs}):
                d = idle_cpu(pr, sp, args.idle_seconds)
                d["load"] = load()
                idle.append(d)
    finally:
        pr.down()
    med = lambda v: statistics.median(v)  # noqa: E731
    print("== bench_lat: medians of %d runs, round trip in us (8 B; MTU %d)" % (args.reps, args.mtu))
    tm = {k: med(v) for k, v in tcp.items()}
    print("    TCP request/response     p50 %7.1f  p99 %7.1f  p99.9 %7.1f" % (tm["p50"], tm["p99"], tm["p999"]))
    out = {"tcp_rr": {"median": tm, "runs": tcp}, "mrc": {}, "idle": idle, "mtu": args.mtu, "iters": args.iters}
    for c in configs:
        m = {k: med(mrc[c][k]) for k in ("p50", "p99", "p999")}
        print("    MRC spin %4d:%-4d        p50 %7.1f  p99 %7.1f  p99.9 %7.1f   MRC / TCP p50 = %.2f" % (
            c[0], c[1], m["p50"], m["p99"], m["p999"], m["p50"] / tm["p50"]))
        out["mrc"]["%d:%d" % c] = {"median": m, "runs": {k: mrc[c][k] for k in ("p50", "p99", "p999")},
                                   "client_engine": mrc[c]["engine"]}
    base = configs[0]
    for c in configs[1:]:
        print("    spin %d:%d / spin %d:%d p50 = %.2f" % (c + base + (med(mrc[c]["p50"]) / med(mrc[base]["p50"]),)))
    for d in idle:
        print("    idle CPU, 2 endpoints + 1 QP pair, engine spin %d us: %.2f%% of a core (process), %.2f%% "
              "(its %d mrc-engine threads), over %.1f s (tick %.0f ms), load %s" % (
                  d["spin_us"], d["process_pct"], d["engine_pct"], d["engine_threads"], d["seconds"],
                  d["tick_s"] * 1000, d["load"]))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
