"""A live pair of datapath instances for the perftest-style commands (tests/test_perf_cli.py,
tests/test_harden_recv.py): namespaces A and B, each with mrc0/mrc0p and the datapath
loaded in ECMP mode, joined by two plane veths p0 and p1; the bootstrap runs over p0
(control addresses A_CTL, B_CTL).  The datapaths list no connection: every QP's
connection is added at connect and removed at the end."""
import json
import os
import uuid

from mrc_xdp.datapath import loader, netns
from mrc_xdp.datapath.config import HostConfig

A_ADDR, B_ADDR = "fd00:7a::a", "fd00:7a::b"
A_CTL, B_CTL = "fd00:7a:1::a", "fd00:7a:1::b"
MTU = 3506


def _ip(ns, *a):
    return netns.run_cmd(ns, ["ip"] + list(a))


def _mac(ns, dev):
    return json.loads(_ip(ns, "-j", "link", "show", dev).stdout)[0]["address"]


def make_pair(tag_prefix="pf", mtu=MTU):
    """Generator for a module fixture: yields {"a": ns A (= instance A), "b": ns B}.  An mtu
    above MTU is set once the (frags-aware) programs are attached."""
    tag = "%x%s" % (os.getpid() & 0xffff, uuid.uuid4().hex[:4])
    a, b = tag_prefix + "A-" + tag, tag_prefix + "B-" + tag
    made = []
    try:
        for n in (a, b):
            netns.create(n)
            made.append(n)
            _ip(n, "link", "set", "lo", "up")
            _ip(n, "link", "add", "mrc0", "mtu", str(MTU), "type", "veth", "peer", "name", "mrc0p", "mtu", str(MTU))
        for p in ("p0", "p1"):
            _ip(a, "link", "add", p, "mtu", str(MTU), "type", "veth", "peer", "name", p, "netns", b, "mtu", str(MTU))
        for n in (a, b):
            for d in ("mrc0", "mrc0p", "p0", "p1"):
                _ip(n, "link", "set", d, "up")
        _ip(a, "addr", "add", A_CTL + "/64", "dev", "p0", "nodad")
        _ip(b, "addr", "add", B_CTL + "/64", "dev", "p0", "nodad")
        for ns, inst, me, peer, other in ((a, a, A_ADDR, B_ADDR, b), (b, b, B_ADDR, A_ADDR, a)):
            loader.load(HostConfig.from_dict({
                "instance": inst, "mode": "ecmp", "local_addr": me,
                "planes": [{"dev": "p%d" % i, "gateway_mac": _mac(other, "p%d" % i)} for i in range(2)]}),
                netns_name=ns)
        if mtu > MTU:
            for n in (a, b):
                for d in ("p0", "p1", "mrc0p", "mrc0"):
                    _ip(n, "link", "set", d, "mtu", str(mtu))
        yield {"a": a, "b": b}
    finally:
        for n in made:
            loader.unload(n, quiet_missing=True)
            netns.delete(n)
