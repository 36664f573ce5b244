"""The live pair for the transport engine tests (tests/test_engine_*.py).

    hA: mrc0==mrc0p  p0 ------------ p0  mrc0p==mrc0 :hB
                     p1 ------------ p1

Two namespaces, loaded with the real CLI (`mrc-xdp load --config ... --netns ...`), every
veth at the largest MTU native XDP on veth allows (so the engine's default payload is the
largest the path carries).  The configs list CONNS connections with fixed QPNs; an
engine QP created with one of those QPNs is sprayed by the datapath.  Links puts the lab's
link model (loss, trimming, ECN) in front of both hosts' ingress.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from mrc_xdp.datapath import bpfsys, maps, netns
from mrc_xdp.lab import linkmodel as lmod

A_ADDR, B_ADDR = "fd00:78::a", "fd00:78::b"
CONNS = [(0x2A0 + i, 0x2B0 + i) for i in range(4)]      # (A's QPN, B's QPN)
SID_HOST = {"a": 0x0A00, "b": 0x0B00}                     # SRv6 mode: uSID of each host
PLANE_IFINDEX = {"a": 3100, "b": 3200}                    # + plane number
CLI = [sys.executable, "-m", "mrc_xdp.cli"]
MTU = 3506        # the largest MTU veth accepts with a native XDP program here (measured, kernel 6.18)
# ... without frags support; the frags-aware programs (docs/datapath.md "Multi-buffer frames")
# lift it, but only once they are attached: a larger MTU is set after the load
MTU_IB = 4200     # mrc0's MTU for a 4096-byte payload (+ 88 bytes of headers, rounded up)
LM_BASE = {"udp_port": 4791, "dscp_ctrl": 46, "dscp_trimmed": 12}   # a link model config, no faults


def sh(ns, cmd):
    subprocess.run(["nsenter", "--net=/run/netns/" + ns, "sh", "-ec", cmd], check=True)


def mac_of(ns, dev):
    out = subprocess.run(["ip", "-n", ns, "-j", "link", "show", dev], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["address"]


def cli(*args, check=True):
    r = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=180)
    if check and r.returncode != 0:
        raise AssertionError("mrc-xdp %s failed (%d): %s%s" % (" ".join(args), r.returncode, r.stdout, r.stderr))
    return r


def host_toml(inst, local, peer, conns, gw_macs, mode="ecmp", extra="", me="a", them="b"):
    """A host config.  SRv6 without switches: the one-uSID path to the peer is the peer's
    own SID on each plane, fcbb:0:<plane><host>00:: (plane << 12 OR-ed in by spray)."""
    planes = ""
    for i, m in enumerate(gw_macs):
        planes += '[[planes]]\ndev = "p%d"\ngateway_mac = "%s"\n' % (i, m)
        if mode == "srv6":
            planes += ('srv6_src = "fd00:5%d::%s"\nlocal_sid = "fcbb:0:%x::"\n'
                       % (i, me, i << 12 | SID_HOST[me]))
        planes += "\n"
    tmpl = 'template = "peer"\n' if mode == "srv6" else ""
    cs = "".join('[[connections]]\npeer = "%s"\nlocal_qpn = %d\nremote_qpn = %d\nev_per_plane = 4\n'
                 'backup_per_plane = 2\n%s\n' % (peer, lq, rq, tmpl) for lq, rq in conns)
    if mode == "srv6":
        cs += ('[srv6_templates.peer]\nblock = "fcbb:0::"\nusids = [%d]\nt1_pos = -1\nplane_shift = 12\n'
               't1_shift = 0\n' % SID_HOST[them])
    return 'instance = "%s"\nmode = "%s"\nlocal_addr = "%s"\n%s\n%s%s' % (inst, mode, local, extra, planes, cs)


class Pair:
    def __init__(self, tmp_dir: str, mtu: int = MTU, extra: str = "", mode: str = "ecmp"):
        """extra: top-level host config lines (e.g. "loss_thresh = 1000000").  mtu: the
        plane veths'; mrc0 gets 40 bytes less in srv6 mode (room for the outer header).
        An mtu above MTU needs the frags-aware programs: the veths are made at MTU, the
        datapath loaded (attached), then every MTU raised."""
        self.mode = mode
        tag = "%x%s" % (os.getpid(), os.urandom(2).hex())
        self.a, self.b = "mrceA-" + tag, "mrceB-" + tag
        self.ia, self.ib = "teA-" + tag, "teB-" + tag
        self.loaded: list[str] = []
        self.tmp = tmp_dir
        self.mtu = mtu
        self.extra = extra
        self.app_mtu = mtu - (40 if mode == "srv6" else 0)

    def up(self):
        for n in (self.a, self.b):
            netns.create(n)
        mtu0 = min(self.mtu, MTU)          # at creation: what native XDP takes without frags
        app0 = mtu0 - (self.mtu - self.app_mtu)
        for n in (self.a, self.b):
            sh(n, "ip link set lo up; ip link add mrc0 mtu %d type veth peer name mrc0p mtu %d; "
                  "ip link set mrc0 up; ip link set mrc0p up" % (app0, app0))
        for k, p in enumerate(("p0", "p1")):
            # ifindexes unique across both namespaces: the link model keys its maps by them
            subprocess.run(["ip", "link", "add", p, "index", str(PLANE_IFINDEX["a"] + k), "netns", self.a,
                            "mtu", str(mtu0), "type", "veth", "peer", "name", p, "index",
                            str(PLANE_IFINDEX["b"] + k), "netns", self.b, "mtu", str(mtu0)], check=True)
            sh(self.a, "ip link set %s up" % p)
            sh(self.b, "ip link set %s up" % p)
        ta, tb = os.path.join(self.tmp, "a.toml"), os.path.join(self.tmp, "b.toml")
        with open(ta, "w") as f:
            f.write(host_toml(self.ia, A_ADDR, B_ADDR, CONNS, [mac_of(self.b, "p0"), mac_of(self.b, "p1")],
                              mode=self.mode, extra=self.extra, me="a", them="b"))
        with open(tb, "w") as f:
            f.write(host_toml(self.ib, B_ADDR, A_ADDR, [(b, a) for a, b in CONNS],
                              [mac_of(self.a, "p0"), mac_of(self.a, "p1")], mode=self.mode,
                              extra=self.extra, me="b", them="a"))
        self.ta, self.tb = ta, tb
        # both loads at once (each is mostly a bcc compile)
        procs = [(inst, subprocess.Popen(CLI + ["load", "--config", toml, "--netns", ns],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                 for inst, toml, ns in ((self.ia, ta, self.a), (self.ib, tb, self.b))]
        errs = []
        for inst, pr in procs:
            out, err = pr.communicate(timeout=180)
            if pr.returncode == 0:
                self.loaded.append(inst)
            else:
                errs.append("mrc-xdp load %s failed (%d): %s%s" % (inst, pr.returncode, out, err))
        if errs:
            raise AssertionError("; ".join(errs))
        if self.mtu > mtu0:
            self.raise_mtu()
        return self

    def raise_mtu(self):
        """Every veth to the pair's MTUs (plane links mtu, mrc0/mrc0p app_mtu), the
        programs attached: veth takes an MTU above 3506 only from a frags-aware program's
        peer, and only once it is attached."""
        for n in (self.a, self.b):
            sh(n, "ip link set p0 mtu %d; ip link set p1 mtu %d; ip link set mrc0p mtu %d; "
                  "ip link set mrc0 mtu %d" % (self.mtu, self.mtu, self.app_mtu, self.app_mtu))

    def load(self, side):
        inst, toml, ns = (self.ia, self.ta, self.a) if side == "a" else (self.ib, self.tb, self.b)
        cli("load", "--config", toml, "--netns", ns)
        self.loaded.append(inst)

    def unload(self, side):
        inst = self.ia if side == "a" else self.ib
        cli("unload", "--instance", inst, check=False)
        if inst in self.loaded:
            self.loaded.remove(inst)

    def down(self):
        for i in (self.ia, self.ib):
            cli("unload", "--instance", i, check=False)
        for n in (self.a, self.b):
            if netns.exists(n):
                netns.delete(n)


def connect(A, B, k):
    """QPs of connection CONNS[k] on endpoints A and B, connected to each other."""
    qa = A.create_qp(qpn=CONNS[k][0])
    qb = B.create_qp(qpn=CONNS[k][1])
    qa.connect(qb.local_attrs())
    qb.connect(qa.local_attrs())
    return qa, qb


def ifindex(ns, dev):
    return json.loads(netns.run_cmd(ns, ["ip", "-j", "link", "show", dev]).stdout)[0]["ifindex"]


class Links:
    """The lab's link model (bpf/linkmodel.c, real XDP) attached to both hosts' plane
    NICs of a Pair that is up, in front of the datapath's ingress (tail call through
    mrc_lnext, as the lab does), with no faults.  lm: the LinkModel; links: one
    (netns, ifindex, side) per plane NIC, side the host it delivers to ("a" or "b")."""

    def __init__(self, pair: Pair):
        self.lm = lmod.LinkModel.load()
        self.links: list[tuple[str, int, str]] = []
        try:
            for slot, (ns, inst) in enumerate(((pair.a, pair.ia), (pair.b, pair.ib))):
                ing = bpfsys.obj_get(os.path.join(maps.pin_dir(inst), "prog_ingress"))
                try:
                    for k, dev in enumerate(("p0", "p1")):
                        ix = ifindex(ns, dev)
                        self.lm.set(ix, LM_BASE)
                        self.lm.set_next(ix, slot * 2 + k, ing)
                        lmod.xdp_attach(ix, self.lm.prog_fd, netns_name=ns)
                        self.links.append((ns, ix, "b" if ns == pair.b else "a"))
                finally:
                    os.close(ing)
        except BaseException:
            self.lm.close()
            raise

    def faults(self, to_b: dict, to_a: dict | None = None):
        """Link model settings (over LM_BASE) on the links into B and into A (none when
        to_a is not given); {} clears them.  The tail call to ingress stays."""
        for ns, ix, side in self.links:
            nxt = self.lm.get(ix)["next_prog"]
            self.lm.set(ix, dict(LM_BASE, **(to_b if side == "b" else (to_a or {})), next_prog=nxt))

    def counters(self, side):
        """The link model's counters summed over the links into side ("a" or "b")."""
        tot = {}
        for ns, ix, s in self.links:
            if s == side:
                for k, v in self.lm.counters(ix).items():
                    tot[k] = tot.get(k, 0) + v
        return tot

    def close(self):
        self.lm.close()
