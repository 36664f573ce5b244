#!/usr/bin/env python3
"""Goodput and CPU of one transport-engine QP on the live pair (no assertions).

    sudo .venv/bin/python tools/engine_goodput.py [--size-mib 256] [--reps 3] [--json]
                                                  [--opt NAME=VALUE ...]

Builds the two-namespace pair of tests/engine_pair.py (mrc0 and the plane veths at the
largest native-XDP veth MTU, both datapaths loaded in ecmp mode), opens one endpoint per
host in this process, and moves SIZE bytes with one Write-with-Immediate per repetition,
checking the bytes by hash.  CPU is this process's (both engines' progress threads,
their system calls and the softirq work charged to them); softirq work charged to other
processes is not in it, so on a busy host the figure is a lower bound.  For the
comparison with iperf3 and TCP see tools/bench_transport.py.
"""
import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import engine_pair as ep_  # noqa: E402
from mrc_xdp import transport  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(epilog="method and latest figures: docs/benchmarks.md", description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--opt", action="append", default=[], help="engine option NAME=VALUE")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("engine_goodput: run as root (netns, XDP, AF_XDP)", file=sys.stderr)
        return 1
    opts = {k: int(v) for k, v in (o.split("=", 1) for o in a.opt)}
    size = a.size_mib << 20
    pair = ep_.Pair(tempfile.mkdtemp(prefix="engput"))
    runs = []
    try:
        pair.up()
        with transport.Endpoint(pair.ia, **opts) as A, transport.Endpoint(pair.ib, **opts) as B:
            qa, qb = A.create_qp(qpn=ep_.CONNS[0][0]), B.create_qp(qpn=ep_.CONNS[0][1])
            qa.connect(qb.local_attrs())
            qb.connect(qa.local_attrs())
            src, dst = bytearray(os.urandom(size)), bytearray(size)
            ma, mb = A.reg_mr(src), B.reg_mr(dst)
            for rep in range(a.reps):
                dst[:] = bytes(size)
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
                qa.post_write(rep, ma, 0, size, mb.addr, mb.rkey, imm=rep)
                ca = A.cq.wait_blocking(timeout=300)
                cb = B.cq.wait_blocking(timeout=30)
                dt = time.monotonic() - t0
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
                ok = bool(ca and ca[0].ok and cb and cb[0].imm == rep and
                          hashlib.sha256(dst).digest() == hashlib.sha256(src).digest())
                runs.append({"bytes": size, "seconds": round(dt, 4),
                             "gbit_s": round(size * 8 / dt / 1e9, 3), "cpu_s": round(cpu, 3),
                             "cpu_s_per_gb": round(cpu / (size / 1e9), 3), "intact": ok})
                if not a.json:
                    r = runs[-1]
                    print("%d MiB in %.3f s: %.2f Gbit/s, CPU %.2f s (%.2f CPU-s/GB), intact: %s" % (
                        a.size_mib, dt, r["gbit_s"], cpu, r["cpu_s_per_gb"], ok))
            st = qa.stats()
            out = {"payload": A.payload, "mtu": ep_.MTU, "runs": runs,
                   "qp": {k: st[k] for k in ("tx_pkts", "rtx_pkts", "rtx_sack", "rtx_timeout",
                                             "rtx_nack_trim", "sacks_rx", "srtt_ns", "min_rtt_ns",
                                             "cwnd")},
                   "crc_fast": A.stats()["crc_fast"], "zero_copy": A.stats()["zero_copy"],
                   "loadavg": os.getloadavg()}
            if a.json:
                print(json.dumps(out, indent=1))
            else:
                print("payload %d B (mrc0 MTU %d), crc_fast %d, zero_copy %d, load average %.1f; QP: %s" % (
                    A.payload, ep_.MTU, out["crc_fast"], out["zero_copy"], out["loadavg"][0], out["qp"]))
    finally:
        pair.down()
    return 0 if all(r["intact"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
