#!/usr/bin/env python3
"""Non-MRC TCP over a veth with XDP attached, against no XDP, interleaved in one run.

    sudo .venv/bin/python tools/bench_tcp_xdp.py [--seconds S] [--reps N] [--only a,b] [--json]

Two namespaces A (sender) and B (receiver) wired like the live pair: veths p0 and p1
between them and mrc0/mrc0p in each.  TCP (iperf3, one stream, A -> B over p0's IPv6
addresses, nothing on loopback) is measured under each condition with "none" (no XDP)
measured between every two conditions: none c1 none c2 ... cN none, the order rotated
each round, --reps rounds.  Each measurement's ratio is taken against the mean of the two
"none" runs around it, so drift and other load on a shared machine cancel out as far as
they can.  Each line: Gbit/s per round, the median, the ratio per round and its median,
and the offload state the kernel reports at that moment (tso/gso of A's p0, the sender;
gro of B's p0, the receiver).

Conditions:

  none          no XDP anywhere
  pass          an XDP_PASS program, native mode, on B's p0 (the receiving veth)
  mrc           the MRC datapath loaded in A and B (mrc_xdp.datapath.loader, as `mrc-xdp load`
                does for the live pair: ingress native on p0/p1, spray, engine)
  pass+gro      pass, with `ethtool -K p0 gro on` on B (the receiving side)
  mrc+gro       mrc, with GRO on on both p0s
  pass-frags    an XDP_PASS program loaded with BPF_F_XDP_HAS_FRAGS, native, on B's p0
  pass-generic  the XDP_PASS program in generic (skb) mode on B's p0
  mrc-generic   the datapath's ingress in generic mode on both p0s
  pass+gro+mtu  pass+gro with both p0s at MTU 3500 (native XDP on a veth refuses a peer
                MTU above about 3.5 KB unless the program is frags-aware)
  pass+tso      pass, then `ethtool -K p0 tso on gso on` on A (the sender, B's peer)

The XDP_PASS programs are two instructions loaded with a raw BPF_PROG_LOAD (bcc 0.26's
BPF.load_func() takes no prog_flags, so it cannot set BPF_F_XDP_HAS_FRAGS).  Everything
is built in namespaces named btcp{A,B}-<pid> and removed at the end, also on error; the
datapath instances are btcpA-<pid>/btcpB-<pid>, unloaded at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mrc_xdp.datapath import netns  # noqa: E402

ADDR_A, ADDR_B = "fd00:98::a", "fd00:98::b"
MRC_A, MRC_B = "fd00:99::a", "fd00:99::b"
PORT = 5299
CONDITIONS = ["none", "pass", "mrc", "pass+gro", "mrc+gro", "pass+gro+mtu", "pass-frags",
              "pass-generic", "mrc-generic", "pass+tso"]
XDP_VETH_MTU = 3500     # about the most a veth peer may have under a native non-frags program

# ---------------------------------------------------------------- a raw XDP_PASS program
BPF_PROG_LOAD = 5
BPF_PROG_TYPE_XDP = 6
BPF_F_XDP_HAS_FRAGS = 1 << 5
SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
# r0 = XDP_PASS (2); exit
PASS_INSNS = bytes.fromhex("b700000002000000" "9500000000000000")


def load_pass_prog(frags: bool) -> int:
    """fd of a 2-instruction XDP_PASS program, optionally declared frags-aware."""
    if SYS_BPF is None:
        raise SystemExit("bench_tcp_xdp: unknown bpf syscall number on %s" % os.uname().machine)
    libc = ctypes.CDLL(None, use_errno=True)
    insns = ctypes.create_string_buffer(PASS_INSNS, len(PASS_INSNS))
    lic = ctypes.create_string_buffer(b"GPL")
    attr = ctypes.create_string_buffer(128)
    ctypes.memmove(ctypes.addressof(attr), (ctypes.c_uint32 * 2)(BPF_PROG_TYPE_XDP, 2), 8)
    ctypes.memmove(ctypes.addressof(attr) + 8,
                   (ctypes.c_uint64 * 2)(ctypes.addressof(insns), ctypes.addressof(lic)), 16)
    ctypes.memmove(ctypes.addressof(attr) + 44,
                   (ctypes.c_uint32 * 1)(BPF_F_XDP_HAS_FRAGS if frags else 0), 4)
    name = b"bench_pass_fr" if frags else b"bench_pass"
    ctypes.memmove(ctypes.addressof(attr) + 48, name, len(name))
    fd = libc.syscall(SYS_BPF, BPF_PROG_LOAD, attr, 128)
    if fd < 0:
        e = ctypes.get_errno()
        raise SystemExit("bench_tcp_xdp: BPF_PROG_LOAD (frags=%s): %s" % (frags, os.strerror(e)))
    return fd


# ---------------------------------------------------------------- helpers
def sh(ns: str, cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "--net=/run/netns/" + ns, "sh", "-c", cmd], check=check,
                          capture_output=True, text=True, timeout=60)


def _link(ns: str, dev: str) -> dict:
    return json.loads(sh(ns, "ip -j link show dev %s" % dev).stdout)[0]


def ifindex(ns: str, dev: str) -> int:
    return int(_link(ns, dev)["ifindex"])


def mac(ns: str, dev: str) -> str:
    return _link(ns, dev)["address"]


def offloads(ns: str, dev: str) -> dict:
    out = {}
    for line in sh(ns, "ethtool -k %s" % dev).stdout.splitlines():
        k, _, v = line.partition(":")
        out[k.strip()] = v.strip()
    return out


def short(state: str) -> str:
    """'off [requested on]' -> 'off(req on)', 'off [fixed]' -> 'off(fixed)'."""
    return state.replace(" [requested on]", "(req on)").replace(" [fixed]", "(fixed)")


class Bench:
    def __init__(self, seconds: float):
        tag = "%d" % os.getpid()
        self.a, self.b = "btcpA-" + tag, "btcpB-" + tag
        self.seconds = seconds
        self.instances = []
        self.server = None
        self.attached = []          # (ns, ifindex, mode)
        self.progs = {}

    # -------------------------------------------------------------- set-up
    def setup(self, want_mrc: bool) -> None:
        for n in (self.a, self.b):
            netns.create(n)
            sh(n, "ip link set lo up; ip link add mrc0 type veth peer name mrc0p; "
                  "ip link set mrc0 up; ip link set mrc0p up")
        for p in ("p0", "p1"):
            subprocess.run(["ip", "link", "add", p, "netns", self.a, "type", "veth", "peer", "name", p,
                            "netns", self.b], check=True)
        for n, addr in ((self.a, ADDR_A), (self.b, ADDR_B)):
            sh(n, "ip link set p0 up; ip link set p1 up; ip addr add %s/64 dev p0 nodad" % addr)
        self.idx = {n: ifindex(n, "p0") for n in (self.a, self.b)}
        self.progs["pass"] = load_pass_prog(False)
        self.progs["frags"] = load_pass_prog(True)
        if want_mrc:
            self._load_datapath()
        self.server = subprocess.Popen(["nsenter", "--net=/run/netns/" + self.b, "iperf3", "-s",
                                        "-B", ADDR_B, "-p", str(PORT)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)

    def _load_datapath(self) -> None:
        from mrc_xdp.datapath import bpfsys, loader
        from mrc_xdp.datapath.config import HostConfig
        from mrc_xdp.datapath.maps import pin_dir
        macs = {n: [mac(n, "p0"), mac(n, "p1")] for n in (self.a, self.b)}
        for ns, peer, me, them, lq, rq in ((self.a, self.b, MRC_A, MRC_B, 0x1A0, 0x1B0),
                                          (self.b, self.a, MRC_B, MRC_A, 0x1B0, 0x1A0)):
            cfg = HostConfig.from_dict({
                "instance": ns, "mode": "ecmp", "local_addr": me,
                "planes": [{"dev": "p%d" % i, "gateway_mac": m} for i, m in enumerate(macs[peer])],
                "connections": [{"peer": them, "local_qpn": lq, "remote_qpn": rq,
                                 "ev_per_plane": 4, "backup_per_plane": 2}]})
            self.instances.append(ns)
            st = loader.load(cfg, netns_name=ns)
            if st["xdp_modes"].get("p0") != "native":
                raise SystemExit("bench_tcp_xdp: the datapath's ingress is not native on p0: %s"
                                 % st["xdp_modes"])
            self.progs["mrc:" + ns] = bpfsys.obj_get(os.path.join(pin_dir(ns), "prog_ingress"))
        self._detach_all_p0()     # conditions attach it again when they want it

    # -------------------------------------------------------------- conditions
    def _attach(self, ns: str, fd: int, mode: str) -> None:
        from mrc_xdp.lab.linkmodel import xdp_attach
        xdp_attach(self.idx[ns], fd, mode=mode, netns_name=ns)
        self.attached.append((ns, self.idx[ns], mode))

    def _detach_all_p0(self) -> None:
        from mrc_xdp.lab.linkmodel import xdp_detach
        for ns in (self.a, self.b):
            for mode in ("drv", "skb"):
                with contextlib.suppress(Exception):
                    xdp_detach(self.idx[ns], mode=mode, netns_name=ns)
        self.attached.clear()

    def enter(self, cond: str) -> dict:
        """Set up a condition; returns notes (e.g. what ethtool said)."""
        notes = {}
        base, *extras = cond.split("+")
        if "mtu" in extras:          # before attaching: the attach checks the peer's MTU
            for ns in (self.a, self.b):
                sh(ns, "ip link set p0 mtu %d" % XDP_VETH_MTU)
        if base == "pass":
            self._attach(self.b, self.progs["pass"], "drv")
        elif base == "pass-frags":
            self._attach(self.b, self.progs["frags"], "drv")
        elif base == "pass-generic":
            self._attach(self.b, self.progs["pass"], "skb")
        elif base in ("mrc", "mrc-generic"):
            mode = "skb" if base == "mrc-generic" else "drv"
            for ns in (self.a, self.b):
                self._attach(ns, self.progs["mrc:" + ns], mode)
        if "gro" in extras:
            for ns in ((self.b,) if base == "pass" else (self.a, self.b)):
                sh(ns, "ethtool -K p0 gro on")
        if "tso" in extras:
            r = sh(self.a, "ethtool -K p0 tso on gso on", check=False)
            said = [l.strip() for l in (r.stdout + r.stderr).splitlines() if "tcp6" in l or "ould not" in l]
            notes["`ethtool -K p0 tso on` on A"] = "rc %d, %s" % (r.returncode, "; ".join(said) or "silent")
        oa, ob = offloads(self.a, "p0"), offloads(self.b, "p0")
        notes["A.p0 tso6"] = short(oa.get("tx-tcp6-segmentation", "?"))
        notes["A.p0 gso"] = short(oa.get("generic-segmentation-offload", "?"))
        notes["B.p0 gro"] = short(ob.get("generic-receive-offload", "?"))
        return notes

    def leave(self, cond: str) -> None:
        self._detach_all_p0()
        for ns in (self.a, self.b):
            sh(ns, "ethtool -K p0 gro off tso on gso on; ip link set p0 mtu 1500", check=False)

    def run_tcp(self) -> float:
        r = sh(self.a, "iperf3 -c %s -p %d -t %g -J" % (ADDR_B, PORT, self.seconds), check=False)
        try:
            d = json.loads(r.stdout)
            return d["end"]["sum_received"]["bits_per_second"] / 1e9
        except (ValueError, KeyError):
            raise SystemExit("bench_tcp_xdp: iperf3 failed: %s" % (r.stdout[-300:] + r.stderr[-300:]))

    # -------------------------------------------------------------- tear-down
    def close(self) -> None:
        if self.server:
            self.server.kill()
            self.server.wait()
        with contextlib.suppress(Exception):
            self._detach_all_p0()
        for fd in self.progs.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.instances:
            from mrc_xdp.datapath import loader
            for inst in self.instances:
                with contextlib.suppress(Exception):
                    loader.unload(inst, quiet_missing=True)
        for n in (self.a, self.b):
            with contextlib.suppress(Exception):
                netns.delete(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(epilog="method and latest figures: docs/benchmarks.md (section \"Plain TCP over veth with XDP attached\")", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="iperf3 time per measurement")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", help="comma-separated conditions (none is always measured)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_tcp_xdp: needs root (namespaces, XDP)", file=sys.stderr)
        return 2
    for tool in ("iperf3", "ethtool", "nsenter"):
        if not shutil.which(tool):
            print("bench_tcp_xdp: %s not found: apt-get install %s" % (tool, tool), file=sys.stderr)
            return 2
    conds = CONDITIONS
    if a.only:
        conds = ["none"] + [c for c in a.only.split(",") if c != "none"]
        bad = [c for c in conds if c not in CONDITIONS]
        if bad:
            print("bench_tcp_xdp: unknown condition %s (%s)" % (bad[0], ", ".join(CONDITIONS)),
                  file=sys.stderr)
            return 2
    try:
        return run(a, conds)
    except subprocess.CalledProcessError as e:
        print("bench_tcp_xdp: %s failed: %s" % (" ".join(e.cmd[-1:]), (e.stderr or "").strip()[-200:]),
              file=sys.stderr)
        return 2


def run(a, conds) -> int:
    b = Bench(a.seconds)
    t0 = time.monotonic()
    res = {c: [] for c in conds}
    notes = {}
    try:
        b.setup(want_mrc=any(c.startswith("mrc") for c in conds))
        print("kernel %s; %d conditions x %d rounds, %gs each, `none` between every two "
              "(set-up %.1fs)" % (os.uname().release, len(conds) - 1, a.reps, a.seconds,
                                  time.monotonic() - t0), flush=True)
        others = [c for c in conds if c != "none"]
        ratios = {c: [] for c in others}

        def measure(c):
            notes[c] = b.enter(c)
            try:
                v = b.run_tcp()
            finally:
                b.leave(c)
            res[c].append(v)
            return v

        for rep in range(a.reps):
            k = rep * max(1, len(others) // a.reps)
            order = others[k % len(others):] + others[:k % len(others)]   # rotated each round
            before = measure("none")
            for c in order:
                v = measure(c)
                after = measure("none")
                ratios[c].append(v / ((before + after) / 2))
                before = after
    finally:
        b.close()
    out = [{"condition": "none", "gbps": [round(x, 2) for x in res["none"]],
            "median_gbps": round(statistics.median(res["none"]), 2), "ratio": 1.0,
            "ratios": [], "notes": notes.get("none", {})}]
    for c in others:
        out.append({"condition": c, "gbps": [round(x, 2) for x in res[c]],
                    "median_gbps": round(statistics.median(res[c]), 2),
                    "ratio": round(statistics.median(ratios[c]), 2),
                    "ratios": [round(x, 2) for x in ratios[c]], "notes": notes.get(c, {})})
    if a.json:
        print(json.dumps({"kernel": os.uname().release, "seconds": a.seconds, "reps": a.reps,
                          "results": out}, indent=1))
    else:
        print("%-13s %-17s %6s %-17s %6s  %s" % ("condition", "Gbit/s per round", "median",
                                                "ratio per round", "ratio", "offloads / notes"))
        for r in out:
            g = " ".join("%.2f" % x for x in r["gbps"]) if r["condition"] != "none" else \
                "%d runs" % len(r["gbps"])
            print("%-13s %-17s %6.2f %-17s %5.2fx  %s" % (
                r["condition"], g, r["median_gbps"], " ".join("%.2f" % x for x in r["ratios"]),
                r["ratio"], "; ".join("%s %s" % kv for kv in r["notes"].items())))
    print("total %.1fs" % (time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
