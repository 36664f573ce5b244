"""A private two-namespace pair for the hardening tests (tests/test_harden_*.py).

    A: mrc0==mrc0p  p0 ---- p0  :B
                    p1 ---- p1

Only A is loaded; B is the far end of the plane veths (its MACs are A's gateways).
Names carry the pid and a random tag, so parallel runs and other engineers' labs never
collide; ``close()`` deletes only the two namespaces made here.
"""
from __future__ import annotations

import json
import os
import uuid

from mrc_xdp.datapath import netns


def _ip(ns, *args):
    return netns.run_cmd(ns, ["ip"] + list(args))


def _mac(ns, dev) -> str:
    return json.loads(_ip(ns, "-j", "link", "show", dev).stdout)[0]["address"]


class Pair:
    def __init__(self, tmpdir: str, tag: str):
        t = "%s%x%s" % (tag, os.getpid() & 0xffff, uuid.uuid4().hex[:4])
        self.a, self.b = "hpA-" + t, "hpB-" + t
        self.instance = "th-" + t
        self.toml = os.path.join(tmpdir, "a.toml")
        self._made = []

    def setup(self) -> "Pair":
        for n in (self.a, self.b):
            netns.create(n)
            self._made.append(n)
        _ip(self.a, "link", "add", "mrc0", "type", "veth", "peer", "name", "mrc0p")
        for n in (self.a, self.b):
            _ip(n, "link", "set", "lo", "up")
        fd_b = netns.open_fd(self.b)
        try:
            for p in ("p0", "p1"):
                _ip(self.a, "link", "add", p, "type", "veth", "peer", "name", p, "netns", self.b)
        finally:
            os.close(fd_b)
        for d in ("mrc0", "mrc0p", "p0", "p1"):
            _ip(self.a, "link", "set", d, "up")
        for d in ("p0", "p1"):
            _ip(self.b, "link", "set", d, "up")
        planes = "".join('[[planes]]\ndev = "%s"\ngateway_mac = "%s"\n\n' % (p, _mac(self.b, p))
                         for p in ("p0", "p1"))
        with open(self.toml, "w") as f:
            f.write('instance = "%s"\nmode = "ecmp"\nlocal_addr = "fd00:78::a"\n\n%s'
                    '[[connections]]\npeer = "fd00:78::b"\nlocal_qpn = 0x1a0\nremote_qpn = 0x1b0\n'
                    'ev_per_plane = 4\nbackup_per_plane = 2\n' % (self.instance, planes))
        return self

    def xdp_ids(self) -> dict:
        """{dev: attached XDP program id} of every device of A with one attached."""
        out = {}
        for lk in json.loads(_ip(self.a, "-d", "-j", "link", "show").stdout):
            xdp = lk.get("xdp")
            if xdp:
                out[lk["ifname"]] = xdp.get("prog", {}).get("id") or xdp.get("attached", [{}])[0].get(
                    "prog", {}).get("id")
        return out

    def close(self) -> None:
        for n in self._made:
            if netns.exists(n):
                netns.delete(n)
