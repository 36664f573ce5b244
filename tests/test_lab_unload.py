"""Unloading one lab host: its ingress is no longer tail-called by the link model.

In the lab the link model stays attached on a host's plane NICs and tail-calls the
datapath's ingress through the prog array mrc_lnext.  `mrc-xdp unload` of that host must
empty those slots: frames to the host then pass to the kernel on its plane NICs (seen by a
packet socket there) instead of being redirected into its mrc0.  `lab down` still
removes everything afterwards.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
import uuid

import pytest

from mrc_xdp.datapath import netns, wire
from mrc_xdp.lab import fabric, hosts, topology
from mrc_xdp.lab import linkmodel as lmod

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")

CLI = [sys.executable, "-m", "mrc_xdp.cli"]
ETH_P_ALL = 0x0003


class Sniffer:
    """Count MRC frames (IPv6, UDP to wire.UDP_PORT) received on some devices of a netns."""

    def __init__(self, ns: str, devs: list[str]):
        def mk(dev):
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((dev, 0))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setblocking(False)
            return s
        self.socks = [netns.run(ns, mk, d) for d in devs]

    def count(self, settle: float = 0.5) -> int:
        n, end = 0, time.monotonic() + settle
        while time.monotonic() < end:
            r, _, _ = select.select(self.socks, [], [], 0.05)
            for s in r:
                while True:
                    try:
                        f, addr = s.recvfrom(65536)
                    except BlockingIOError:
                        break
                    if addr[2] == socket.PACKET_OUTGOING or len(f) < 58:
                        continue
                    l3 = wire.ETH_LEN
                    udp = l3 + wire.IPV6_LEN
                    if int.from_bytes(f[12:14], "big") == wire.ETHERTYPE_IPV6 and f[l3 + 6] == wire.NH_UDP \
                            and int.from_bytes(f[udp + 2:udp + 4], "big") == wire.UDP_PORT:
                        n += 1
        return n

    def close(self):
        for s in self.socks:
            s.close()


def send(prefix, topo, n, src="h0", dst="h2"):
    """n data frames src -> dst through src's datapath; returns the frames dst's mrc0 got."""
    from mrc_xdp.lab.traffic import Receiver, Sender
    s, d = topo.host(src), topo.host(dst)
    rx = Receiver("mrc0", d.addr, {(s.addr, hosts.qpn(d.index, s.index)): hosts.qpn(s.index, d.index)},
                  ns=prefix + dst, max_seconds=30).start()
    tx = Sender("mrc0", s.addr, d.addr, hosts.qpn(d.index, s.index), ns=prefix + src, payload=256)
    try:
        assert tx.send(n, pps=10000) == n
        time.sleep(0.5)
    finally:
        rx.stop()
        tx.close()
    return rx.frames


def test_unload_one_host_unchains_its_ingress_and_lab_down_still_works():
    prefix = "tu%s-" % uuid.uuid4().hex[:5]
    try:
        st = fabric.up(topology.load(mode="ecmp"), prefix=prefix, hosts_hook=hosts.fabric_hook)
        topo = fabric.topology_of(st)
        with lmod.LinkModel.open(st["pin_dir"]) as lm:
            slots = {h.name: [hosts.next_slot(topo, h.name, p) for p in range(topo.planes)] for h in topo.hosts}
            at_h2 = [r.ifindex for n, r, _, _ in topo.link_ends() if n.endswith(">h2")]
            assert len(at_h2) == topo.planes
            assert all(lm.next_map.lookup(s) is not None for ss in slots.values() for s in ss)

            # loaded: h2's ingress takes the frames off its plane NICs into mrc0
            sniff = Sniffer(prefix + "h2", ["p%d" % p for p in range(topo.planes)])
            try:
                got, seen = send(prefix, topo, 200), sniff.count()
            finally:
                sniff.close()
            assert (got, seen) == (200, 0), "loaded: %d frames at h2's mrc0, %d on its plane NICs" % (got, seen)

            r = subprocess.run(CLI + ["unload", "-i", prefix + "h2"], capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, r.stderr
            assert "mrc_lnext" in r.stdout, r.stdout
            for h, ss in slots.items():
                for s in ss:
                    assert (lm.next_map.lookup(s) is None) == (h == "h2"), (h, s)

            # unloaded: the link model still runs at h2's ports, then passes to the kernel
            before = [lm.counters(i)["mrc_pkts"] for i in at_h2]
            sniff = Sniffer(prefix + "h2", ["p%d" % p for p in range(topo.planes)])
            try:
                got, seen = send(prefix, topo, 200), sniff.count()
            finally:
                sniff.close()
            modelled = sum(lm.counters(i)["mrc_pkts"] for i in at_h2) - sum(before)
            assert (got, seen, modelled) == (0, 200, 200), \
                "unloaded: %d frames at h2's mrc0, %d on its plane NICs, %d through its link model" % (
                    got, seen, modelled)
    finally:
        fabric.down(prefix, unload_hosts=hosts.unload_all)
    assert fabric.leftovers(prefix) == {"netns": [], "pins": [], "state_file": []}
    assert not [n for n in netns.list_names(prefix)]
