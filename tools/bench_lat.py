"""8-byte latency only (bench_transport part (a)'s last step): MRC write-lat round trip
vs a TCP request/response of the same size, on the live pair, `--reps` times each,
interleaved; prints every run and the medians.  Run as root:
    .venv/bin/python tools/bench_lat.py --reps 3
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_transport as bt  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(epilog="method and latest figures: docs/benchmarks.md", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--mtu", type=int, default=1500)
    args = ap.parse_args(argv)
    pr = bt.Pair(args.mtu)
    runs = {"mrc_p50": [], "mrc_p99": [], "tcp_p50": [], "tcp_p99": []}
    try:
        pr.up()
        for rep in range(args.reps):
            t = bt.tcp_rr(pr.b, pr.a, pr.B_P0, iters=args.iters)
            r = bt.mrc_perf("write-lat", (pr.ib, pr.b), (pr.ia, pr.a), pr.B_P0, 18600 + rep,
                            ["--size", "8", "--iters", str(args.iters)])
            runs["tcp_p50"].append(t["p50_us"])
            runs["tcp_p99"].append(t["p99_us"])
            runs["mrc_p50"].append(r["rtt_p50_us"])
            runs["mrc_p99"].append(r["rtt_p99_us"])
            print("rep %d: MRC round trip p50 %.1f us p99 %.1f us | TCP RR p50 %.1f us p99 %.1f us | load %s" % (
                rep + 1, r["rtt_p50_us"], r["rtt_p99_us"], t["p50_us"], t["p99_us"],
                open("/proc/loadavg").read().split()[0]), flush=True)
    finally:
        pr.down()
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(json.dumps({"median": med, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
