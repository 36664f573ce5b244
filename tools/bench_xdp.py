#!/usr/bin/env python3
"""Per-packet cost of the XDP datapath against an empty XDP_PASS program.

    sudo .venv/bin/python tools/bench_xdp.py [--repeat N] [--rounds R] [--json] [--no-budget]

Every case runs through BPF_PROG_TEST_RUN with a large repeat and the kernel's ns/run is
read; an empty XDP_PASS program is measured the same way, in the same run, between every
two measurements (B M1 B M2 ... Mn B, the order rotated each round), and each case's ratio
in a round is taken against the mean of that round's baselines, so drift on a small VM
does not bias the ratio.  Reported: the median over rounds, the spread (min..max over
rounds) and, per spray / ingress case, PASS/FAIL against the budget of issue 2 (each at
most 4x the XDP_PASS baseline).  Beside the XDP_PASS ratio each case's ratio to a bare
forwarder timed the same way in the same rounds ("x FWD": parse, connection lookup, one
fixed EV, sport/flow label rewrite with the ICRC update, MACs, redirect -- bench_forward,
built from the same helpers) says what spraying, EV health and feedback cost on top of
forwarding at all: that is the figure to drive down.  Exit 1 if a case is over budget (unless --no-budget), 2
on a set-up error (not root, compile failure, a case not taking the path it should time).

The programs are the real ones (bpf/mrc_datapath.c compiled by mrc_xdp.datapath.loader.build()),
configured through the real map writer (Datapath.configure) for one connection with 16
active EVs over 2 planes, in a temporary network namespace holding veth pairs mrc0/mrc0p,
p0/q0 and p1/q1 (ingress needs ctx.ingress_ifindex of a real device, the devmap real
ifindexes); the namespace is deleted at the end, also on error.  Nothing is attached or
pinned.  The test run does not perform the redirect: these are the programs' own costs,
not the cost of delivering a frame.  Before timing, every case is checked to take the
path it is meant to time: a repeat=1 run (return code, output bytes: ICRC, EV, headers)
and a 100-repetition run (its counter must grow by exactly 100).

What BPF_PROG_TEST_RUN does with repeat > 1 (read in net/bpf/test_run.c of Linux 6.x and
checked by experiment on every run, see probe_reset()):

  * Without BPF_F_TEST_XDP_LIVE_FRAMES, bpf_prog_test_run_xdp() builds ONE xdp_buff and
    bpf_test_run() calls bpf_prog_run_xdp(prog, &xdp) `repeat` times on it: neither the
    packet bytes nor data/data_end are reset between repetitions.  Repetition k sees what
    repetition k-1 left.  (The kernel also reports duration as floor(total / repeat) in
    whole ns; every repeat-N value here gets +0.5 ns, the expected truncation, which
    matters for the ~6 ns baseline.  Run-to-run noise makes single baseline values
    flip between two integers, so the baseline is the MEAN of its ~15 values a round,
    which dithers out most of the truncation; a median would not.)
  * Spray in ECMP mode rewrites the frame in place (flow label, UDP sport, ICRC, MACs):
    the next repetition sees a valid MRC frame of the same connection whose sport is the
    previous EV, so every repetition takes the full path (EV pick, ICRC fix, PSN record,
    redirect).  Ingress data and SACK with M=NONE change no byte the next run depends on.
    These are measured directly.
  * Spray in SRv6 mode pushes an outer IPv6 header (bpf_xdp_adjust_head(-40)): from the
    second repetition on, spray sees an IPv6-in-IPv6 frame, which it does not parse as
    MRC, and takes the cheap non-MRC XDP_PASS path.  Ingress SRv6 decap pulls the outer
    header: from the second repetition on it sees a plain frame for us (the ordinary
    ingress data path).  A SACK with M=SKIP_ONCE moves the echoed EV GOOD -> SKIP once;
    later repetitions find it SKIP already.  A plain repeat-N figure for any of these
    times another path than the one named.  BPF_F_TEST_XDP_LIVE_FRAMES does not help: it
    resets only the data pointers per frame, not the bytes the encap overwrote.
  * Timing single repeat=1 runs instead does not work either: each starts with cold
    caches and branch predictors (user space and the syscall ran in between), which costs
    a big program far more than an empty one (spray ECMP: ~80 ns in a repeat-N loop,
    ~200 ns as a lone repeat=1 run on the VM this was written on), and paired differences
    of such runs were off by ~20 ns against repeat-N on a case both can measure.

So those three are measured on repeat-safe copies built here from the same source (the
real bpf files are not touched): the body of mrc_spray / mrc_ingress verbatim, then a few
instructions that put the frame (or EV) back the way the next repetition needs it:

  spray SRv6      = bench_spray(SRv6 mode) - U - C   U = (push_eth_undo - PASS) / 2
                                                     C = bench_spray(ECMP) - spray(ECMP)
  ingress decap   = bench_ingress_decap - R          R = push_outer_undo - PASS - U
  SACK GOOD->SKIP = real SACK M=NONE + bench_reset(M=SKIP_ONCE) - bench_reset(M=NONE)

U is the cost of the undo (copy the Ethernet header 40 bytes on, bpf_xdp_adjust_head(+40)),
taken as half of a program doing the mirror-image push and then the undo; R is the cost
of re-pushing the saved outer header.  bench_reset is ingress followed by resetting the
echoed EV to GOOD; the SKIP_ONCE and NONE runs share that reset, so it cancels; they run
with a repeat small enough (5000) for the EV-event ring buffer, drained between runs, not
to fill up (the number of events drained is checked).  C is what being a copy costs (the
check after the body, code generation), measured in ECMP mode where the copy undoes
nothing; the decap copy has no such counterpart, so its figure may read a few ns high.
Should the kernel ever reset the buffer per repetition (probe_reset() finds out), encap
and decap are measured directly on the real programs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import sys
import time

try:
    import mrc_xdp  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUDGET = 4.0
PAYLOAD_BIG = 1024
PAYLOAD_SMALL = 64
LOCAL = "fd00::1"
PEER = "fd00::2"
LOCAL_QPN = 0x100
REMOTE_QPN = 0x200
PSN = 0x1234
PEER_EV = 0x5a5a1234                  # the EV the peer chose for data it sends us
OUTER_SRC = "fd00:ff::1"
GW_MACS = ("02:00:00:00:00:10", "02:00:00:00:00:11")
DEVS = (("mrc0", "mrc0p"), ("p0", "q0"), ("p1", "q1"))
SMALL_REPEAT = 5000                   # EV events per run: well below the ring's capacity
TEMPLATE = {"block": "fcbb:0::", "usids": [0x0101, 0x0200, 0x0102, 0x0302], "t1_pos": 1,
            "plane_shift": 12, "t1_shift": 0}

BIG, SMALL = "1 KB", "64 B"
C_SPRAY = "spray ECMP, %s payload"
C_SPRAY_TS = "spray ECMP, TSETH, %s payload"    # as the engine sends (its tx timestamp)
C_SPRAY6 = "spray SRv6 encap, %s payload"
C_ING = "ingress data, %s payload"
C_SACK = "ingress SACK M=NONE"
C_SACK_BM = "ingress SACK M=NONE, bitmap 15 holes"
C_SKIP_AGAIN = "ingress SACK M=SKIP_ONCE, EV already SKIP"
C_SKIP = "ingress SACK M=SKIP_ONCE, GOOD->SKIP"
C_DECAP = "ingress SRv6 decap + data, 1 KB"
C_ING6 = "ingress data, 1 KB, SRv6 mode, no outer"
C_FWD = "bare forwarder, 1 KB (parse, conn lookup, fixed EV, rewrite, redirect)"
SINGLE = " [single-buffer]"            # --compare-single: the same case on MRC_XDP_FRAGS=0 programs
C_SPRAY_MB = "spray ECMP, 4 KB payload, multi-buffer"     # frags path: linear 3520 B + a frag
C_ING_MB = "ingress data, 4 KB payload, multi-buffer"
PAYLOAD_MB = 4096
# --conns N: the same cases on two more ECMP datapaths holding 3 and N connections (the
# bench connection the last of them), in the same rounds: what a full instance costs
SCALE_FEW = 3
C_SCALE = {"spray": "spray ECMP, 1 KB payload, %d conns", "ingress": "ingress data, 1 KB payload, %d conns",
           "sack": "ingress SACK M=NONE, %d conns",
           # repeat-safe copies that forget the per-CPU connection cache first (the hash lookup)
           "spray_miss": "spray ECMP, 1 KB, conn cache miss, %d conns",
           "ingress_miss": "ingress data, 1 KB, conn cache miss, %d conns"}
SCALE_GROUP = {"spray": "spray", "ingress": "ingress", "sack": "ingress", "spray_miss": "spray",
               "ingress_miss": "ingress"}

# Appended to a copy of the amalgamated datapath source; %(spray)s and %(ingress)s are the
# bodies of mrc_spray and mrc_ingress, renamed.  Loaded for test runs only.
BENCH_C = r"""
/* ---- tools/bench_xdp.py: repeat-safe copies, for BPF_PROG_TEST_RUN only ---- */
struct bench_hdr { __u8 b[MRC_IPV6_LEN]; };
BPF_ARRAY(bench_outer, struct bench_hdr, 1);

/* Drop an outer IPv6 header the program pushed: Ethernet header 40 bytes on, pull 40. */
static __always_inline int bench_undo_encap(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	if (data + MRC_ETH_LEN + MRC_IPV6_LEN > data_end)
		return -1;
	__builtin_memcpy(data + MRC_IPV6_LEN, data, MRC_ETH_LEN);
	return bpf_xdp_adjust_head(ctx, (int)MRC_IPV6_LEN);
}

/* Put back the outer IPv6 header the program pulled (saved in bench_outer). */
static __always_inline int bench_push_outer(struct xdp_md *ctx)
{
	struct bench_hdr *h;
	void *data, *data_end;
	__u32 k = 0;

	h = bench_outer.lookup(&k);
	if (!h || bpf_xdp_adjust_head(ctx, -(int)MRC_IPV6_LEN))
		return -1;
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	if (data + MRC_ETH_LEN + MRC_IPV6_LEN > data_end)
		return -1;
	__builtin_memcpy(data, data + MRC_IPV6_LEN, MRC_ETH_LEN);
	__builtin_memcpy(data + MRC_ETH_LEN, h->b, MRC_IPV6_LEN);
	return 0;
}

%(spray)s

%(ingress)s

int bench_spray(struct xdp_md *ctx)
{
	int rc = bench_spray_body(ctx);
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ipv6hdr *ip6 = data + MRC_ETH_LEN;

	if ((void *)(ip6 + 1) <= data_end && ip6->nexthdr == NEXTHDR_IPV6_ENCAP)
		bench_undo_encap(ctx);
	return rc;
}

int bench_ingress_decap(struct xdp_md *ctx)
{
	int rc = bench_ingress_body(ctx);
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ipv6hdr *ip6 = data + MRC_ETH_LEN;

	if ((void *)(ip6 + 1) <= data_end && ip6->nexthdr != NEXTHDR_IPV6_ENCAP)
		bench_push_outer(ctx);
	return rc;
}

int bench_reset(struct xdp_md *ctx)
{
	int rc = bench_ingress_body(ctx);
	struct mrc_ev *e = ev_at(0, 0);

	if (e)
		e->state = MRC_EV_GOOD;
	return rc;
}

/* The floor a multipath spray is measured against: what any forwarder of this protocol
 * does.  Parse (mrc_parse), find the connection (conn_find), take a fixed EV (slot 0, or
 * slot 1 when the frame already carries slot 0's, so that every repetition rewrites the
 * source port and updates the ICRC as spray does), rewrite sport + flow label, MACs,
 * redirect to the EV's plane.  No rotation, no EV state, no PSN record, no DSCP. */
int bench_forward(struct xdp_md *ctx)
{
	struct mrc_config *cfg = cfg_get();
	struct mrc_pkt p = {};
	struct mrc_conn *c;
	struct mrc_plane *pl;
	struct mrc_ev *e;
	struct ipv6hdr *ip6;
	struct udphdr *udp;
	void *data, *data_end;
	__u32 reason, cid, k;
	__u16 old_sport, new_sport;
	int icrc_frag = 0;

	if (!cfg)
		return XDP_PASS;
	if (mrc_parse(ctx, &p, cfg->udp_port, 0, &reason) != MRC_P_OK)
		return XDP_PASS;
	if (p.udp_len - 6 >= MRC_ICRC_TBL_LEN)
		return XDP_DROP;
	if (conn_find(p.daddr, p.dqpn, MRC_DIR_TX, &cid, &c))
		return XDP_PASS;
	e = ev_at(cid, 0);
	if (e && (e->ev >> 16) == (p.ev >> 16))
		e = ev_at(cid, 1);
	if (!e)
		return XDP_DROP;
	k = e->plane;
	pl = mrc_planes.lookup(&k);
	if (!pl)
		return XDP_DROP;
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	ip6 = data + MRC_ETH_LEN;
	udp = data + MRC_ETH_LEN + MRC_IPV6_LEN;
	if ((void *)(udp + 1) > data_end)
		return XDP_DROP;
	old_sport = bpf_ntohs(udp->source);
	new_sport = e->ev >> 16;
	ip6->flow_lbl[0] &= 0xf0;
	ip6->flow_lbl[1] = (e->ev >> 8) & 0xff;
	ip6->flow_lbl[2] = e->ev & 0xff;
	if (old_sport != new_sport) {
		udp->source = bpf_htons(new_sport);
		if (udp->check)
			udp->check = bpf_htons(udp_csum_replace16(bpf_ntohs(udp->check), old_sport, new_sport));
		if (icrc_update_sport(ctx, &p, udp, old_sport, new_sport, &icrc_frag))
			return XDP_DROP;
	}
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	if (data + MRC_ETH_LEN > data_end)
		return XDP_DROP;
	__builtin_memcpy(data, pl->dmac, 6);
	__builtin_memcpy(data + 6, pl->smac, 6);
	ctr_inc(MRC_C_SPRAY_TX);
	return mrc_ports.redirect_map(k, 0);
}

int bench_push_eth_undo(struct xdp_md *ctx)
{
	void *data, *data_end;

	if (bpf_xdp_adjust_head(ctx, -(int)MRC_IPV6_LEN))
		return XDP_ABORTED;
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	if (data + MRC_ETH_LEN + MRC_IPV6_LEN > data_end)
		return XDP_ABORTED;
	__builtin_memcpy(data, data + MRC_IPV6_LEN, MRC_ETH_LEN);
	if (bench_undo_encap(ctx))
		return XDP_ABORTED;
	return XDP_PASS;
}

int bench_push_outer_undo(struct xdp_md *ctx)
{
	if (bench_push_outer(ctx) || bench_undo_encap(ctx))
		return XDP_ABORTED;
	return XDP_PASS;
}

/* The per-CPU connection cache forgotten before every repetition: conn_find takes the
 * mrc_connidx hash, as for a packet of another connection than the previous one. */
static __always_inline void bench_forget_conn(void)
{
	__u32 zero = 0;
	struct mrc_ccache *cc = mrc_ccache.lookup(&zero);

	if (cc) {
		cc->cid1[0] = 0;
		cc->cid1[1] = 0;
	}
}

int bench_spray_miss(struct xdp_md *ctx)
{
	bench_forget_conn();
	return bench_spray_body(ctx);
}

int bench_ingress_miss(struct xdp_md *ctx)
{
	bench_forget_conn();
	return bench_ingress_body(ctx);
}
"""


def say(msg: str) -> None:
    print("bench_xdp: " + msg, file=sys.stderr, flush=True)


class BenchError(RuntimeError):
    pass


# ------------------------------------------------------------------ set-up

def host_config(mode: str, nconns: int = 1):
    """nconns: connections in all; the bench connection is the last, after nconns - 1
    others (to 64 other peers, 8 active + 4 backup EVs per plane each, as it has)."""
    from mrc_xdp.datapath.config import HostConfig
    planes = [{"dev": "p%d" % i, "gateway_mac": GW_MACS[i]} for i in range(2)]
    conn = {"peer": PEER, "local_qpn": LOCAL_QPN, "remote_qpn": REMOTE_QPN,
            "ev_per_plane": 8, "backup_per_plane": 4, "name": "bench"}
    others = [{"peer": "fd00::1:%x" % (i % 64), "local_qpn": 0x1000 + i, "remote_qpn": 0x2000 + i,
               "ev_per_plane": 8, "backup_per_plane": 4, "name": "other%d" % i}
              for i in range(nconns - 1)]
    d = {"instance": "bench", "mode": mode, "local_addr": LOCAL, "planes": planes,
         "connections": others + [conn]}
    if mode == "srv6":
        for i, p in enumerate(planes):
            p["srv6_src"] = "fd00:%x::1" % (0xa + i)
            p["local_sid"] = "fcbb:0:%x::" % (0x100 | i << 12)
        conn["template"] = "peer"
        conn["t1s"] = 2
        d["srv6_templates"] = {"peer": dict(TEMPLATE)}
    return HostConfig.from_dict(d)


def make_netns(name: str) -> None:
    import subprocess
    from mrc_xdp.datapath import netns
    try:
        netns.create(name)
        for a, b in DEVS:
            netns.run_cmd(name, ["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        for dev in [d for pair in DEVS for d in pair] + ["lo"]:
            netns.run_cmd(name, ["ip", "link", "set", dev, "up"])
    except subprocess.CalledProcessError as e:
        raise BenchError("netns set-up: `%s` failed: %s" % (" ".join(e.cmd), (e.stderr or "").strip()))
    except OSError as e:
        raise BenchError("netns set-up: %s" % e)


def dev_info():
    """DevInfo for the current netns plus {name: ifindex}."""
    from pyroute2 import IPRoute
    from mrc_xdp.datapath.maps import DevInfo
    links = {}
    with IPRoute() as ipr:
        for lk in ipr.get_links():
            links[lk.get_attr("IFLA_IFNAME")] = (lk["index"], lk.get_attr("IFLA_ADDRESS"))
    missing = [d for pair in DEVS for d in pair if d not in links]
    if missing:
        raise BenchError("veth set-up failed: %s missing in the bench netns" % ", ".join(missing))
    planes = [(links["p%d" % i][0], links["p%d" % i][1], GW_MACS[i]) for i in range(2)]
    dev = DevInfo(links["mrc0"][0], links["mrc0"][1], links["mrc0p"][0], links["mrc0p"][1], planes)
    return dev, {k: v[0] for k, v in links.items()}


def build_baseline():
    from mrc_xdp.datapath import kheaders
    kheaders.ensure()
    from bcc import BPF
    b = BPF(text="int xdp_pass(struct xdp_md *ctx) { return XDP_PASS; }")
    return b, b.load_func(b"xdp_pass", BPF.XDP).fd


def bench_source() -> str:
    """The amalgamated datapath plus BENCH_C; BenchError if the entry points are not found."""
    from mrc_xdp.datapath.bpfsrc import amalgamate
    from mrc_xdp.datapath.shared import BPF_DIR
    src = amalgamate(os.path.join(BPF_DIR, "mrc_datapath.c"))
    bodies = {}
    for key, fn in (("spray", "mrc_spray"), ("ingress", "mrc_ingress")):
        m = re.search(r"^int %s\(struct xdp_md \*ctx\)\n\{\n.*?^\}\n" % fn, src, re.M | re.S)
        if not m:
            raise BenchError("cannot find `int %s(struct xdp_md *ctx)` in bpf/mrc_datapath.c to "
                             "build its repeat-safe copy" % fn)
        bodies[key] = m.group(0).replace(
            "int %s(" % fn, "static __always_inline int bench_%s_body(" % key, 1)
    return src + BENCH_C % bodies


class Bench:
    """The repeat-safe copies: a bcc object with the datapath's maps and the bench_* programs."""

    PROGS = ("bench_spray", "bench_ingress_decap", "bench_reset", "bench_push_eth_undo",
             "bench_push_outer_undo", "bench_forward", "bench_spray_miss", "bench_ingress_miss")

    def __init__(self):
        from bcc import BPF
        from mrc_xdp.datapath import bpfsrc, kheaders, progload
        from mrc_xdp.datapath.loader import PROGS, Datapath
        kheaders.ensure()
        src = bench_source()
        try:
            # one path for all (the devmap takes programs of one kind): the datapath's
            built = progload.build(lambda extra: BPF(text=src, cflags=bpfsrc.CFLAGS + extra),
                                   list(PROGS.values()) + list(self.PROGS))
        except BenchError:
            raise
        except Exception as e:
            raise BenchError("compiling the repeat-safe copies failed: %s" % e) from e
        self.bpf = built.bpf
        self.dp = Datapath(built)
        self.fds = {p: built.progs[p].fd for p in self.PROGS}
        from mrc_xdp.datapath import bpfsys
        self.outer = bpfsys.Map(self.bpf[b"bench_outer"].map_fd, "bench_outer", owns_fd=False)
        self._mode = None

    def set_mode(self, mode: str) -> None:
        from mrc_xdp.datapath.shared import ffi, sizeof, to_bytes
        if mode == self._mode:
            return
        m = self.dp.maps["mrc_cfg"]
        c = ffi.new("struct mrc_config *")
        ffi.memmove(c, m.lookup(0), sizeof("struct mrc_config"))
        c.mode = 1 if mode == "srv6" else 0
        m.update(0, to_bytes(c))
        self._mode = mode


# ------------------------------------------------------------------ helpers on the datapath

def stat(dp, name: str) -> int:
    from mrc_xdp.datapath import bpfsys
    from mrc_xdp.datapath.shared import Ctr
    return bpfsys.sum_u64_percpu(dp.maps["mrc_stats"].lookup(int(Ctr[name])), 1)[0]


class Rings:
    """Drains the EV-event ring buffers so state-change runs never find one full."""

    def __init__(self, dps):
        from mrc_xdp.datapath import bpfsys
        self.readers = []
        self.n = 0
        for dp in dps:
            self.readers.append(bpfsys.RingReader(dp.maps["mrc_events"].fd, self._count))

    def _count(self, raw):
        self.n += 1

    def drain(self) -> int:
        """Consume every pending event; returns how many there were."""
        n0 = self.n
        for rd in self.readers:
            while rd.poll(0) > 0:
                pass
        return self.n - n0

    def close(self):
        for rd in self.readers:
            rd.close()


# ------------------------------------------------------------------ what is run

class Run:
    """One thing timed by BPF_PROG_TEST_RUN: a program fd, a frame, an ifindex, a repeat."""

    def __init__(self, key, fd, frame, ifindex, expect, repeat=None, before=None, after=None,
                 check=None, counter=None, events=False):
        self.key, self.fd, self.frame, self.ifindex = key, fd, frame, ifindex
        self.expect = expect            # XDP return code of every repetition
        self.repeat = repeat            # None: --repeat; "small": SMALL_REPEAT
        self.before, self.after = before, after   # untimed set-up / restore around each run
        self.check = check              # fn(out) -> error or None, on a repeat=1 run
        self.counter = counter          # (dp, counter name): must grow by `repeat` per run
        self.events = events            # every repetition writes one EV event
        self.drained = 0                # events drained after the last run
        self.vals: list[float] = []     # ns per repetition, one per round


def scale_ns(dps) -> list[int]:
    """The connection counts of the --conns datapaths, fewest first ([] without them)."""
    return sorted(int(k[5:]) for k in dps if k.startswith("conns"))


def build_runs(dps, cfgs, ifx, bench, probe):
    from mrc_xdp.datapath import wire
    from mrc_xdp.datapath.bpfsys import XDP_PASS, XDP_REDIRECT, prog_test_run
    from mrc_xdp.datapath.shared import SackM

    ecmp, srv6 = dps["ecmp"], dps["srv6"]
    single = dps.get("single")
    active, _ = cfgs["ecmp"].connections[0].ev_sets(2)
    evs = {e.ev for pl in active for e in pl}
    ev0 = active[0][0].ev                    # in slot 0 of connection 0 (bench_reset)
    ifx_fab, ifx_p0 = ifx["mrc0p"], ifx["p0"]

    def tx_data(n):
        return wire.data_frame(LOCAL, PEER, REMOTE_QPN, PSN, b"\xab" * n)

    def rx_data(n):
        return wire.data_frame(PEER, LOCAL, LOCAL_QPN, PSN, b"\xcd" * n, ev=PEER_EV)

    def sack(m, bitmap=0, cack=PSN, aoff=0):
        return wire.sack_frame(PEER, LOCAL, LOCAL_QPN, PSN, cack_psn=cack, ev_echo=ev0, m=m,
                               ack_psn_offset=aoff, bitmap=bitmap)

    def same_len(frame, delta=0):
        def chk(out):
            if len(out) != len(frame) + delta:
                return "output %d bytes, expected %d" % (len(out), len(frame) + delta)
            return None
        return chk

    def sprayed(frame, delta):
        def chk(out):
            if len(out) != len(frame) + delta:
                return "output %d bytes, expected %d" % (len(out), len(frame) + delta)
            if delta and out[wire.ETH_LEN + 6] != wire.NH_IPV6:
                return "no outer IPv6 header"
            if not wire.frame_icrc_ok(out):
                return "ICRC wrong after the rewrite"
            if wire.ev_of_frame(out) not in evs:
                return "EV %#x is not one of the connection's" % wire.ev_of_frame(out)
            return None
        return chk

    def restore_ev(dp):
        mp = dp.maps["mrc_evs"]
        raw = mp.lookup(0)

        def restore():
            mp.update(0, raw)
        return restore

    runs = {}

    def add(r):
        runs[r.key] = r

    for label, n in ((BIG, PAYLOAD_BIG), (SMALL, PAYLOAD_SMALL)):
        f = tx_data(n)
        add(Run(C_SPRAY % label, ecmp.fd("spray"), f, ifx_fab, XDP_REDIRECT,
                check=sprayed(f, 0), counter=(ecmp, "SPRAY_ICRC_FIX")))
        f6 = tx_data(n)
        if probe["resets"]:
            add(Run(C_SPRAY6 % label, srv6.fd("spray"), f6, ifx_fab, XDP_REDIRECT,
                    check=sprayed(f6, 40), counter=(srv6, "SPRAY_SRV6_ENCAP")))
        add(Run("bench_spray srv6 " + label, bench.fds["bench_spray"], f6, ifx_fab, XDP_REDIRECT,
                before=lambda: bench.set_mode("srv6"), check=sprayed(f6, 0),
                counter=(bench.dp, "SPRAY_SRV6_ENCAP")))
        f = rx_data(n)
        add(Run(C_ING % label, ecmp.fd("ingress"), f, ifx_p0, XDP_REDIRECT,
                check=same_len(f), counter=(ecmp, "ING_DATA")))
        if single is not None:      # the same frames, single-buffer programs, same rounds
            f = tx_data(n)
            add(Run(C_SPRAY % label + SINGLE, single.fd("spray"), f, ifx_fab, XDP_REDIRECT,
                    check=sprayed(f, 0), counter=(single, "SPRAY_ICRC_FIX")))
            f = rx_data(n)
            add(Run(C_ING % label + SINGLE, single.fd("ingress"), f, ifx_p0, XDP_REDIRECT,
                    check=same_len(f), counter=(single, "ING_DATA")))
    if ecmp.frags:                  # a frame longer than test_run's linear part: linear + frags
        f = tx_data(PAYLOAD_MB)
        add(Run(C_SPRAY_MB, ecmp.fd("spray"), f, ifx_fab, XDP_REDIRECT,
                check=sprayed(f, 0), counter=(ecmp, "SPRAY_ICRC_FRAG")))
        f = rx_data(PAYLOAD_MB)
        add(Run(C_ING_MB, ecmp.fd("ingress"), f, ifx_p0, XDP_REDIRECT,
                check=same_len(f), counter=(ecmp, "ING_DATA")))
    for n in scale_ns(dps):         # --conns: 3 and N connections loaded, the same frames
        dp = dps["conns%d" % n]
        f = tx_data(PAYLOAD_BIG)
        add(Run(C_SCALE["spray"] % n, dp.fd("spray"), f, ifx_fab, XDP_REDIRECT,
                check=sprayed(f, 0), counter=(dp, "SPRAY_ICRC_FIX")))
        add(Run(C_SCALE["spray_miss"] % n, dp.bench_fds["bench_spray_miss"], f, ifx_fab, XDP_REDIRECT,
                check=sprayed(f, 0), counter=(dp, "SPRAY_ICRC_FIX")))
        f = rx_data(PAYLOAD_BIG)
        add(Run(C_SCALE["ingress"] % n, dp.fd("ingress"), f, ifx_p0, XDP_REDIRECT,
                check=same_len(f), counter=(dp, "ING_DATA")))
        add(Run(C_SCALE["ingress_miss"] % n, dp.bench_fds["bench_ingress_miss"], f, ifx_p0, XDP_REDIRECT,
                check=same_len(f), counter=(dp, "ING_DATA")))
    f = wire.data_frame(LOCAL, PEER, REMOTE_QPN, PSN, b"\xab" * PAYLOAD_BIG, ts=0x1234)
    add(Run(C_SPRAY_TS % BIG, ecmp.fd("spray"), f, ifx_fab, XDP_REDIRECT,
            check=sprayed(f, 0), counter=(ecmp, "SPRAY_ICRC_FIX")))
    f = tx_data(PAYLOAD_BIG)
    add(Run("bench_spray ecmp 1 KB", bench.fds["bench_spray"], f, ifx_fab, XDP_REDIRECT,
            before=lambda: bench.set_mode("ecmp"), check=sprayed(f, 0),
            counter=(bench.dp, "SPRAY_ICRC_FIX")))
    add(Run(C_FWD, bench.fds["bench_forward"], f, ifx_fab, XDP_REDIRECT,
            before=lambda: bench.set_mode("ecmp"), check=sprayed(f, 0),
            counter=(bench.dp, "SPRAY_TX")))
    add(Run("push_eth_undo", bench.fds["bench_push_eth_undo"], f, ifx_fab, XDP_PASS,
            check=lambda out, f=f: None if out == f else "frame changed"))
    add(Run("push_outer_undo", bench.fds["bench_push_outer_undo"], f, ifx_fab, XDP_PASS,
            check=lambda out, f=f: None if out == f else "frame changed"))

    # Feedback counts only inside the sent window: every SACK below acks PSN, sent here
    # once (untimed) on both datapaths that see SACKs; main() checks none fell outside.
    for fd in [ecmp.fd("spray"), bench.fds["bench_spray"]] + [dps["conns%d" % n].fd("spray")
                                                              for n in scale_ns(dps)]:
        prog_test_run(fd, tx_data(PAYLOAD_SMALL), ifindex=ifx_fab)
    f = sack(SackM.NONE)
    add(Run(C_SACK, ecmp.fd("ingress"), f, ifx_p0, XDP_REDIRECT, check=same_len(f),
            counter=(ecmp, "ING_SACK")))
    for n in scale_ns(dps):
        dp = dps["conns%d" % n]
        add(Run(C_SCALE["sack"] % n, dp.fd("ingress"), f, ifx_p0, XDP_REDIRECT, check=same_len(f),
                counter=(dp, "ING_SACK")))
    # Every other bit set over the 64 PSNs before PSN: the loss scan visits 31 positions
    # and looks up the PSN ring for the 15 holes; none was sent (no PSN recorded there),
    # so no loss is attributed and nothing changes between repetitions: the scan is the
    # whole extra cost.
    f = sack(SackM.NONE, bitmap=0x5555555555555555, cack=PSN - 64, aoff=64)
    add(Run(C_SACK_BM, ecmp.fd("ingress"), f, ifx_p0, XDP_REDIRECT, check=same_len(f),
            counter=(ecmp, "ING_SACK")))
    f = sack(SackM.SKIP_ONCE)
    add(Run(C_SKIP_AGAIN, ecmp.fd("ingress"), f, ifx_p0, XDP_REDIRECT, check=same_len(f),
            after=restore_ev(ecmp), counter=(ecmp, "ING_SACK")))
    add(Run("bench_reset SKIP_ONCE", bench.fds["bench_reset"], f, ifx_p0, XDP_REDIRECT,
            repeat="small", before=lambda: bench.set_mode("ecmp"), after=restore_ev(bench.dp),
            check=same_len(f), counter=(bench.dp, "ING_FB_SKIP"), events=True))
    f = sack(SackM.NONE)
    add(Run("bench_reset NONE", bench.fds["bench_reset"], f, ifx_p0, XDP_REDIRECT,
            repeat="small", before=lambda: bench.set_mode("ecmp"), check=same_len(f),
            counter=(bench.dp, "ING_SACK")))

    inner = rx_data(PAYLOAD_BIG)
    f = wire.srv6_encap(inner, OUTER_SRC, cfgs["srv6"].planes[0].local_sid)
    bench.outer.update(0, f[wire.ETH_LEN:wire.ETH_LEN + wire.IPV6_LEN])
    if probe["resets"]:
        add(Run(C_DECAP, srv6.fd("ingress"), f, ifx_p0, XDP_REDIRECT, check=same_len(f, -40),
                counter=(srv6, "ING_DECAP")))
    add(Run("bench_ingress_decap", bench.fds["bench_ingress_decap"], f, ifx_p0, XDP_REDIRECT,
            before=lambda: bench.set_mode("srv6"), check=same_len(f),
            counter=(bench.dp, "ING_DECAP")))
    add(Run(C_ING6, srv6.fd("ingress"), inner, ifx_p0, XDP_REDIRECT, check=same_len(inner),
            counter=(srv6, "ING_DATA")))
    return runs


def probe_reset(dp_srv6, ifx_fab, ifx_p0, local_sid):
    """Does a repeat run reset the buffer between repetitions?  Runs the SRv6 encap and the
    decap three times in one test run each and counts how often each really happened."""
    from mrc_xdp.datapath import wire
    from mrc_xdp.datapath.bpfsys import XDP_NAMES, prog_test_run
    tx = wire.data_frame(LOCAL, PEER, REMOTE_QPN, PSN, b"x" * 64)
    rx = wire.srv6_encap(wire.data_frame(PEER, LOCAL, LOCAL_QPN, PSN, b"x" * 64), OUTER_SRC, local_sid)
    out = {}
    done_all = True
    for key, prog, frame, ifx, ctr in (("encap", "spray", tx, ifx_fab, "SPRAY_SRV6_ENCAP"),
                                       ("decap", "ingress", rx, ifx_p0, "ING_DECAP")):
        before = stat(dp_srv6, ctr)
        ret, o, _ = prog_test_run(dp_srv6.fd(prog), frame, repeat=3, ifindex=ifx)
        done = stat(dp_srv6, ctr) - before
        done_all &= done == 3
        out[key] = ("SRv6 %s with repeat=3: done %d time(s), last repetition returned XDP_%s, "
                    "output %+d bytes" % (key, done, XDP_NAMES.get(ret, ret), len(o) - len(frame)))
    out["resets"] = done_all
    return out


def validate(runs, small_repeat, ring):
    """Each run must take its path: a repeat=1 run checked on its output, then a short
    repeat run (every repetition must return `expect` and bump its counter)."""
    from mrc_xdp.datapath.bpfsys import XDP_NAMES, prog_test_run
    for r in runs.values():
        for rep in (1, min(100, small_repeat)):
            if r.before:
                r.before()
            c0 = stat(*r.counter) if r.counter else 0
            ret, out, _ = prog_test_run(r.fd, r.frame, rep, ifindex=r.ifindex)
            grew = stat(*r.counter) - c0 if r.counter else rep
            if r.after:
                r.after()
            ring.drain()
            if ret != r.expect:
                raise BenchError("%s: returned XDP_%s, expected XDP_%s: it does not take the path "
                                 "it should time" % (r.key, XDP_NAMES.get(ret, ret),
                                                     XDP_NAMES.get(r.expect)))
            if grew != rep:
                raise BenchError("%s: counter %s grew by %d in %d repetitions: not every "
                                 "repetition takes the path" % (r.key, r.counter[1].lower(), grew, rep))
            if rep == 1 and r.check:
                err = r.check(out)
                if err:
                    raise BenchError("%s: %s" % (r.key, err))


# ------------------------------------------------------------------ measuring

def run_once(r, repeat, ring):
    from mrc_xdp.datapath.bpfsys import prog_test_run
    if r.before:
        r.before()
    _, _, ns = prog_test_run(r.fd, r.frame, repeat=repeat, ifindex=r.ifindex)
    if r.after:
        r.after()
    if ring is not None:
        r.drained = ring.drain()
    return ns + 0.5            # the kernel reports floor(total / repeat)


def measure(runs, base, args, small_repeat, ring):
    """Rounds of B R1 B R2 ... Rn B, the order rotated each round.  The small-repeat runs
    (bench_reset) run 5 times in a row, keeping the median.  Returns the baselines of
    each round."""
    rounds = []
    order0 = list(runs.values())
    n = len(order0)
    for rnd in range(args.rounds):
        say("round %d/%d" % (rnd + 1, args.rounds))
        order = order0[rnd % n:] + order0[:rnd % n]
        bl = [run_once(base, args.repeat, None)]
        for r in order:
            if r.repeat is None:
                r.vals.append(run_once(r, args.repeat, ring))
            else:
                vals = []
                for _ in range(5):
                    vals.append(run_once(r, small_repeat, ring))
                    if r.events and r.drained != small_repeat:
                        raise BenchError("%s: %d EV events for %d repetitions (ring buffer full?)"
                                         % (r.key, r.drained, small_repeat))
                r.vals.append(statistics.median(vals))
            bl.append(run_once(base, args.repeat, None))
        rounds.append(bl)
    return rounds


def derive(runs, probe, small_repeat, rounds):
    """Rows: name -> (group, method, [ns per round], [ratio per round], formula)."""
    med = statistics.median
    b = [statistics.mean(bl) for bl in rounds]
    rows = {}

    def row(name, group, method, ns, formula=None):
        rows[name] = (group, method, ns, [v / x for v, x in zip(ns, b)], formula)

    def sub(xs, ys):
        return [x - y for x, y in zip(xs, ys)]

    v = {k: r.vals for k, r in runs.items()}
    u = [(p - x) / 2 for p, x in zip(v["push_eth_undo"], b)]
    for label in (BIG, SMALL):
        row(C_SPRAY % label, "spray", "direct", v[C_SPRAY % label])
        if C_SPRAY % label + SINGLE in v:
            row(C_SPRAY % label + SINGLE, "spray", "direct", v[C_SPRAY % label + SINGLE])
    if C_SPRAY_MB in v:
        row(C_SPRAY_MB, "spray", "direct", v[C_SPRAY_MB])
    row(C_SPRAY_TS % BIG, "spray", "direct", v[C_SPRAY_TS % BIG])
    for label in (BIG, SMALL):
        name = C_SPRAY6 % label
        if probe["resets"]:
            row(name, "spray", "direct", v[name])
            continue
        w = v["bench_spray srv6 " + label]
        c = sub(v["bench_spray ecmp 1 KB"], v[C_SPRAY % BIG])
        row(name, "spray", "copy", sub(sub(w, u), c),
            "bench_spray(SRv6) %.1f - U %.1f - C %.1f" % (med(w), med(u), med(c)))
    for label in (BIG, SMALL):
        row(C_ING % label, "ingress", "direct", v[C_ING % label])
        if C_ING % label + SINGLE in v:
            row(C_ING % label + SINGLE, "ingress", "direct", v[C_ING % label + SINGLE])
    if C_ING_MB in v:
        row(C_ING_MB, "ingress", "direct", v[C_ING_MB])
    for name in (C_SACK, C_SACK_BM, C_SKIP_AGAIN):
        row(name, "ingress", "direct", v[name])
    sk, no = v["bench_reset SKIP_ONCE"], v["bench_reset NONE"]
    row(C_SKIP, "ingress", "copy", [a + d for a, d in zip(v[C_SACK], sub(sk, no))],
        "SACK M=NONE %.1f + (bench_reset SKIP_ONCE %.1f - NONE %.1f, repeat %d)" % (
            med(v[C_SACK]), med(sk), med(no), small_repeat))
    if probe["resets"]:
        row(C_DECAP, "ingress", "direct", v[C_DECAP])
    else:
        w = v["bench_ingress_decap"]
        rr = [p - x - y for p, x, y in zip(v["push_outer_undo"], b, u)]
        row(C_DECAP, "ingress", "copy", sub(w, rr),
            "bench_ingress_decap %.1f - R %.1f" % (med(w), med(rr)))
    row(C_ING6, "ingress", "direct", v[C_ING6])
    for key, group in SCALE_GROUP.items():
        for name in sorted((k for k in v if re.fullmatch(C_SCALE[key].replace("%d", "[0-9]+"), k)),
                           key=lambda k: int(k.split(", ")[-1].split()[0])):
            row(name, group, "copy" if "miss" in key else "direct", v[name])
    row(C_FWD, "floor", "direct", v[C_FWD])
    return rows


# ------------------------------------------------------------------ report

def sysinfo():
    cpu = "?"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    jit = "?"
    with contextlib.suppress(OSError):
        with open("/proc/sys/net/core/bpf_jit_enable") as f:
            jit = {"0": "off", "1": "on", "2": "on (debug)"}.get(f.read().strip(), "?")
    return {"kernel": platform.release(), "cpu": cpu, "cpus": os.cpu_count(), "jit": jit}


def summarize(runs, rows, rounds, args, small_repeat, info, probe):
    med = statistics.median
    means = [statistics.mean(bl) for bl in rounds]
    allb = [x for bl in rounds for x in bl]
    base = {"name": "XDP_PASS (empty program)", "ns": med(means), "ns_min": min(means),
            "ns_max": max(means), "n": len(allb), "round_means": means}
    fwd = rows[C_FWD][2]            # the bare forwarder's ns, per round
    out_rows = []
    for name, (group, method, ns, ratio, comp) in rows.items():
        ok = None if args.no_budget or group == "floor" else med(ratio) <= args.budget
        rf = [x / y for x, y in zip(ns, fwd)]
        out_rows.append({"name": name, "group": group, "method": method, "ns": med(ns),
                         "ns_min": min(ns), "ns_max": max(ns), "ratio": med(ratio),
                         "ratio_min": min(ratio), "ratio_max": max(ratio), "budget_ok": ok,
                         "ratio_fwd": med(rf), "ratio_fwd_min": min(rf), "ratio_fwd_max": max(rf),
                         "formula": comp})
    scale = []
    if args.conns:
        vals = {r.key: r.vals for r in runs.values()}
        for key in C_SCALE:
            few, many = vals[C_SCALE[key] % SCALE_FEW], vals[C_SCALE[key] % args.conns]
            rr = [m / f for m, f in zip(many, few)]      # per round: the same round's two
            scale.append({"case": C_SCALE[key].replace(", %d conns", "") + (" *" if "miss" in key else ""), "few": SCALE_FEW,
                          "many": args.conns, "ns_few": med(few), "ns_many": med(many),
                          "ratio": med(rr), "ratio_min": min(rr), "ratio_max": max(rr)})
    return {"tool": "tools/bench_xdp.py", "system": info, "repeat": args.repeat, "scale": scale,
            "small_repeat": small_repeat, "rounds": args.rounds,
            "budget": None if args.no_budget else args.budget, "baseline": base, "cases": out_rows,
            "aux_ns": {k: med(r.vals) for k, r in runs.items() if k not in rows},
            "probe": probe,
            "budget_ok": None if args.no_budget else all(r["budget_ok"] for r in out_rows
                                                          if r["group"] != "floor")}


def print_table(s):
    info = s["system"]
    print("XDP datapath cost by BPF_PROG_TEST_RUN, repeat %d, %d rounds: median ns per packet, "
          "spread = min..max over rounds" % (s["repeat"], s["rounds"]))
    print("(XDP_PASS: mean of the %d baselines of each round, interleaved with the cases)"
          % (s["baseline"]["n"] // s["rounds"]))
    print("kernel %s, %s, %s CPUs, JIT %s" % (info["kernel"], info["cpu"], info["cpus"], info["jit"]))
    print()
    w = max(len(r["name"]) for r in s["cases"]) + 4
    fmt = "%-*s %7s  %-13s %7s  %-12s %6s  %-12s %s"
    print(fmt % (w, "case", "ns/pkt", "spread", "x PASS", "x spread", "x FWD", "x spread", "budget"))
    b = s["baseline"]
    print(fmt % (w, b["name"], "%.1f" % b["ns"], "%.1f..%.1f" % (b["ns_min"], b["ns_max"]),
                 "1.00", "", "", "", "-"))
    for r in s["cases"]:
        verdict = "-" if r["budget_ok"] is None else ("PASS" if r["budget_ok"] else "FAIL")
        print(fmt % (w, r["name"] + (" *" if r["method"] == "copy" else ""), "%.1f" % r["ns"],
                     "%.1f..%.1f" % (r["ns_min"], r["ns_max"]), "%.2f" % r["ratio"],
                     "%.2f..%.2f" % (r["ratio_min"], r["ratio_max"]), "%.2f" % r["ratio_fwd"],
                     "%.2f..%.2f" % (r["ratio_fwd_min"], r["ratio_fwd_max"]), verdict))
    print()
    print("x FWD: ratio to the bare forwarder (%s) in the same round: what multipath spraying,"
          % C_FWD.split(" (")[0])
    print("EV health and feedback cost on top of forwarding at all -- the figure to drive down.")
    print()
    if any(r["method"] == "copy" for r in s["cases"]):
        print("* a repeat run of the real program would time another path after the first "
              "repetition; measured on repeat-safe copies (see the module doc), medians:")
        for r in s["cases"]:
            if r["formula"]:
                print("    %s = %s" % (r["name"], r["formula"]))
    for sc in s.get("scale", []):
        print("%s: %d conns / %d conns = %.3f (per round %.3f..%.3f; %.1f vs %.1f ns)"
              % (sc["case"], sc["many"], sc["few"], sc["ratio"], sc["ratio_min"], sc["ratio_max"],
                 sc["ns_many"], sc["ns_few"]))
    if s.get("scale"):
        print("(* repeat-safe copies of spray / ingress that forget the per-CPU connection cache "
              "first, so the connection is found through the mrc_connidx hash every time)")
        print()
    if s["budget"] is not None:
        bad = [r for r in s["cases"] if r["budget_ok"] is False]
        if bad:
            lo = min(bad, key=lambda r: r["ratio"])
            hi = max(bad, key=lambda r: r["ratio"])
            print("budget: FAIL - %d of %d spray/ingress cases above %.1fx XDP_PASS (%.1f ns); "
                  "lowest %.2fx (%s), highest %.2fx (%s)" % (
                      len(bad), len(s["cases"]), s["budget"], s["budget"] * b["ns"],
                      lo["ratio"], lo["name"], hi["ratio"], hi["name"]))
        else:
            worst = max((r for r in s["cases"] if r["group"] != "floor"), key=lambda r: r["ratio"])
            print("budget: PASS - every spray and ingress case within %.1fx XDP_PASS (worst %.2fx: %s)"
                  % (s["budget"], worst["ratio"], worst["name"]))


# ------------------------------------------------------------------ main

def parse_args(argv):
    ap = argparse.ArgumentParser(epilog="method and latest figures: docs/benchmarks.md (section \"Datapath cost\")", description="ns/packet of the MRC XDP programs against an "
                                             "empty XDP_PASS program (BPF_PROG_TEST_RUN)")
    ap.add_argument("--repeat", type=int, default=1_000_000, help="runs per test run (default 1000000)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; medians reported (default 7)")
    ap.add_argument("--budget", type=float, default=BUDGET, help="max ratio to XDP_PASS (default 4.0)")
    ap.add_argument("--no-budget", action="store_true", help="just report; exit 0 whatever the ratios")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ap.add_argument("--compare-single", action="store_true",
                    help="also time spray and ingress (ECMP, 1 KB and 64 B) on the single-buffer "
                         "programs (MRC_XDP_FRAGS=0) in the same rounds: the cost of frags support")
    ap.add_argument("--conns", type=int, default=1024,
                    help="also time spray, ingress data and SACK (ECMP, 1 KB) on two more datapaths "
                         "holding %d and N connections, in the same rounds (default 1024 = "
                         "MRC_MAX_CONNS; 0: not)" % SCALE_FEW)
    a = ap.parse_args(argv)
    if a.repeat < 1000 or a.rounds < 1:
        ap.error("--repeat must be >= 1000 and --rounds >= 1")
    from mrc_xdp.datapath.shared import const
    if a.conns and not SCALE_FEW < a.conns <= const("MRC_MAX_CONNS"):
        ap.error("--conns must be 0 or %d..%d (MRC_MAX_CONNS)" % (SCALE_FEW + 1, const("MRC_MAX_CONNS")))
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_xdp: needs root (BPF_PROG_TEST_RUN, a temporary netns): run it with sudo",
              file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)

    from mrc_xdp.datapath import loader, netns

    ns = "mrcbench%d" % os.getpid()
    small_repeat = min(args.repeat, SMALL_REPEAT)
    objs, ring = [], None
    try:
        say("compiling: XDP_PASS baseline, datapath (ECMP), datapath (SRv6), repeat-safe copies")
        bobj, base_fd = build_baseline()
        objs.append(bobj)
        dps, cfgs = {}, {}
        for mode in ("ecmp", "srv6"):
            cfgs[mode] = host_config(mode)
            dps[mode] = loader.build()
            objs.append(dps[mode])
        say("programs: %s (%s)" % (dps["ecmp"].path_info["path"], dps["ecmp"].path_info["why"]))
        if args.compare_single:
            dps["single"] = loader.build(frags="off")
            objs.append(dps["single"])
        if args.conns:
            say("compiling: datapaths (ECMP) for %d and %d connections" % (SCALE_FEW, args.conns))
            for n in (SCALE_FEW, args.conns):   # the real programs and the cache-miss copies
                cfgs["conns%d" % n] = host_config("ecmp", n)
                b = Bench()
                b.dp.bench_fds = b.fds
                dps["conns%d" % n] = b.dp
                objs.append(b.dp)
        bench = Bench()
        objs.append(bench.dp)
        say("creating netns %s (veths mrc0/mrc0p, p0/q0, p1/q1)" % ns)
        make_netns(ns)
        with netns.enter(ns):
            dev, ifx = dev_info()
            for mode in dps:
                t0 = time.monotonic()
                dps[mode].configure(cfgs.get(mode, cfgs["ecmp"]), dev)
                if mode.startswith("conns"):
                    say("%d connections configured in %.1f s" % (len(cfgs[mode].connections),
                                                                 time.monotonic() - t0))
            bench.dp.configure(cfgs["srv6"], dev)
            ring = Rings([dps["ecmp"], bench.dp])
            probe = probe_reset(dps["srv6"], ifx["mrc0p"], ifx["p0"], cfgs["srv6"].planes[0].local_sid)
            for k in ("encap", "decap"):
                say("probe: %s" % probe[k])
            say("the kernel %s the frame between repetitions" % ("resets" if probe["resets"]
                                                                  else "does not reset"))
            runs = build_runs(dps, cfgs, ifx, bench, probe)
            validate(runs, small_repeat, ring)
            if stat(dps["ecmp"], "ING_FB_OOW") or stat(bench.dp, "ING_FB_OOW"):
                raise BenchError("a SACK case fell outside the sent window (ing_fb_oow): it "
                                 "does not time the path it names")
            say("validated %d runs (path, output, counters per repetition); measuring" % len(runs))
            base = Run("XDP_PASS", base_fd, runs[C_SPRAY % BIG].frame, ifx["p0"], 2)
            t0 = time.monotonic()
            rounds = measure(runs, base, args, small_repeat, ring)
            say("measured in %.1f s" % (time.monotonic() - t0))
        rows = derive(runs, probe, small_repeat, rounds)
        s = summarize(runs, rows, rounds, args, small_repeat, sysinfo(), probe)
    except (BenchError, loader.LoadError) as e:
        print("bench_xdp: %s" % e, file=sys.stderr)
        return 2
    finally:
        if ring is not None:
            with contextlib.suppress(Exception):
                ring.close()
        for o in objs:
            with contextlib.suppress(Exception):
                o.close() if isinstance(o, loader.Datapath) else o.cleanup()
        with contextlib.suppress(Exception):
            if netns.exists(ns):
                netns.delete(ns)
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        print_table(s)
    if s["budget_ok"] is False:
        if args.json:
            print("bench_xdp: budget FAIL - a spray/ingress case is above %.1fx XDP_PASS" % args.budget,
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
