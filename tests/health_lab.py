"""Shared pieces of the health tests (test_health_*.py, test_top.py, test_fabric_check.py):
a lab with the real datapath on every host and engine endpoints, engine transfers
checked by hash, and the health daemon run as a real `mrc-xdp daemon` process on a
private socket that follows only this lab's instances.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLI = os.path.join(ROOT, ".venv", "bin", "mrc-xdp")
CHUNK = 1 << 20


@contextlib.contextmanager
def lab_up(mode: str, tag: str, topo_dict: dict | None = None, endpoints=("h0", "h2")):
    from mrc_xdp import transport
    from mrc_xdp.lab import fabric, hosts, topology
    from mrc_xdp.lab import linkmodel as lmod
    prefix = "%s%s%s-" % (tag, mode[0], uuid.uuid4().hex[:4])
    eps = {}
    lm = None
    try:
        t = topology.from_dict(dict(topo_dict, mode=mode)) if topo_dict else topology.load(mode=mode)
        st = fabric.up(t, prefix=prefix, hosts_hook=hosts.fabric_hook)
        topo = fabric.topology_of(st)
        lm = lmod.LinkModel.open(st["pin_dir"])
        for h in endpoints:
            eps[h] = transport.Endpoint(prefix + h)
        yield {"prefix": prefix, "topo": topo, "lm": lm, "eps": eps, "mode": mode}
    finally:
        for ep in eps.values():
            ep.close()
        if lm is not None:
            lm.close()
        fabric.down(prefix, unload_hosts=hosts.unload_all)


def qpn(lab, a, b):
    from mrc_xdp.lab import hosts
    t = lab["topo"]
    return hosts.qpn(t.host(a).index, t.host(b).index)


def transfer(lab, src, dst, size, during=None, timeout=120.0):
    """Write size random bytes src -> dst in 1 MiB Writes (the last with immediate) on the
    lab's QPNs; during(frac) runs while completions arrive.  Asserts the receiver's bytes
    by sha256 and returns the sender QP's stats."""
    eps = lab["eps"]
    data = bytearray(os.urandom(size))
    dbuf = bytearray(size)
    qs = eps[src].create_qp(qpn=qpn(lab, src, dst))     # the lab's connection src -> dst
    qd = eps[dst].create_qp(qpn=qpn(lab, dst, src))
    ms, md = eps[src].reg_mr(data), eps[dst].reg_mr(dbuf)
    try:
        qs.connect(qd.local_attrs())
        qd.connect(qs.local_attrs())
        n = (size + CHUNK - 1) // CHUNK
        for k in range(n):
            off = k * CHUNK
            qs.post_write(k, ms, off, min(CHUNK, size - off), md.addr + off, md.rkey,
                          imm=0x5EED if k == n - 1 else None)
        done, imm = 0, None
        deadline = time.monotonic() + timeout
        while done < n or imm is None:
            assert time.monotonic() < deadline, "transfer stalled: %d/%d %s" % (done, n, qs.stats())
            for c in eps[src].cq.poll(256):
                assert c.ok, c
                done += 1
            for c in eps[dst].cq.poll(64):
                if c.opcode == 1 and c.qpn == qd.qpn:
                    imm = c.imm
            if during:
                during(done / n)
            time.sleep(0.002)
        assert imm == 0x5EED
        assert hashlib.sha256(dbuf).digest() == hashlib.sha256(data).digest(), "received bytes differ"
        return qs.stats()
    finally:
        qs.destroy()
        qd.destroy()
        ms.dereg()
        md.dereg()


def t1_links(topo, t1: str):
    return [lk for lk in topo.links if t1 in (lk.a.node, lk.b.node)]


def set_ends(lab, links, **changes):
    for lk in links:
        for _, rx, _ in lk.ends():
            lab["lm"].update(rx.ifindex, **changes)


def heal_all(lab):
    for lk in lab["topo"].links:
        for _, rx, _ in lk.ends():
            lab["lm"].update(rx.ifindex, blackhole=False, loss_ppm=0, flap_period_ms=0)


def ev_rows(lab, host, peer=None):
    from mrc_xdp.datapath.maps import Instance
    with Instance(lab["prefix"] + host) as inst:
        rows = inst.ev_table()
    return [r for r in rows if peer is None or r["conn_name"] == peer]


def cli(*args, env=None, timeout=60, check=True):
    e = dict(os.environ, **(env or {}))
    p = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout, env=e)
    if check:
        assert p.returncode == 0, (args, p.returncode, p.stderr)
    return p


class Daemon:
    """`mrc-xdp daemon` following only one lab's instances, on a private socket.

    malloc_debug: run it under Python's debug allocator (PYTHONMALLOC=debug), which
    aborts the process, with a message in its log, when native code (libbpf, cffi, the
    kernel's writes into our buffers) wrote past a block or into a freed one: the tests
    then fail on the daemon's death instead of a crash some time later.  Off where the
    daemon's speed is measured (test_health_fault_cost)."""

    def __init__(self, lab, malloc_debug=True, **probe):
        self.dir = tempfile.mkdtemp(prefix="mrcd-")
        self.sock = os.path.join(self.dir, "events.sock")
        self.cfg = os.path.join(self.dir, "daemon.toml")
        lines = ['socket = "%s"' % self.sock, 'instances = ["%s*"]' % lab["prefix"], "[probe]"]
        lines += ["%s = %s" % kv for kv in probe.items()]
        self.cfg_text = "\n".join(lines) + "\n"
        self.env = {"MRC_XDP_DAEMON_SOCKET": self.sock}
        self.malloc_debug = malloc_debug
        self.lab = lab
        self.p = None
        self.log = os.path.join(self.dir, "daemon.log")
        self.final_text = None

    def start(self, wait=True):
        """Start (or start again after kill()) the daemon."""
        os.makedirs(self.dir, exist_ok=True)
        with open(self.cfg, "w") as f:
            f.write(self.cfg_text)
        self.final_text = None
        self.logf = open(self.log, "a")
        env = dict(os.environ, PYTHONMALLOC="debug") if self.malloc_debug else None
        self.p = subprocess.Popen([CLI, "daemon", "--config", self.cfg], stdout=self.logf, stderr=self.logf, env=env)
        if wait:
            deadline = time.monotonic() + 20
            from mrc_xdp.health import daemon as health
            while time.monotonic() < deadline:
                st = health.status(self.sock)
                if st and all(n in st["instances"] for n in self.instances()):
                    return self
                assert self.p.poll() is None, self.text()
                time.sleep(0.1)
            raise AssertionError("daemon did not follow the lab: " + self.text())
        return self

    def instances(self):
        return [self.lab["prefix"] + h.name for h in self.lab["topo"].hosts]

    def status(self):
        from mrc_xdp.health import daemon as health
        return health.status(self.sock)

    def text(self):
        if self.final_text is not None:
            return self.final_text
        with open(self.log) as f:
            return f.read()

    def kill(self, sig=signal.SIGKILL):
        """Stop the daemon and remove its directory; text() still gives its log."""
        if self.p and self.p.poll() is None:
            self.p.send_signal(sig)
            self.p.wait(10)
        if self.p is None:                  # never started
            shutil.rmtree(self.dir, ignore_errors=True)
        elif self.final_text is None:
            self.logf.close()
            self.final_text = self.text()
            shutil.rmtree(self.dir, ignore_errors=True)

    def stop(self):
        self.kill(signal.SIGTERM)

    def events(self, instance=None):
        """The daemon's history (of one instance) as dicts."""
        from mrc_xdp.health import daemon as health
        g = health.request_lines({"op": "events", "instance": instance, "follow": False}, self.sock)
        return list(g) if g is not None else []


def wait_for(pred, timeout, step=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return pred()


def link_set(lab, host, dev, up: bool):
    from mrc_xdp.datapath import netns
    netns.run_cmd(lab["prefix"] + host, ["ip", "link", "set", dev, "up" if up else "down"])
