"""Crafted MRC frames through a running lab, without the host datapath.

``path_frame`` builds the frame a host's datapath would put on a plane NIC for one path
(SRv6: outer header with the uSID path; ECMP: the EV in UDP sport + flow label); ``send``
writes frames on a host's plane NIC from inside its netns; ``Capture`` reads what
arrives at a device.  Tests and demos check where frames went with the link model's
per-link counters (``mrc_pkts`` at each receiving end).
"""
from __future__ import annotations

import socket

from mrc_xdp.datapath import netns, wire
from mrc_xdp.lab.topology import Topology

ETH_P_ALL = 0x0003


def path_frame(topo: Topology, src: str, dst: str, plane: int, t1: int = 0, ev: int = 0x10001,
               payload: bytes = b"\0" * 256, opcode: int = wire.Opcode.WRITE_ONLY, ecn: int = 2,
               dscp: int | None = None, psn: int = 0, dqpn: int = 0x100) -> bytes:
    """The frame `src` sends on its plane NIC `plane` to `dst` (via T1 `t1` in SRv6 mode)."""
    me = topo.port(src, "p%d" % plane)
    gw = me.peer
    dscp = 4 if dscp is None else dscp     # trimmable data class
    tc = (dscp << 2) | ecn
    f = wire.data_frame(topo.host(src).addr, topo.host(dst).addr, dqpn, psn, payload,
                        opcode=opcode, ev=ev, tc=tc, smac=me.mac, dmac=gw.mac)
    if topo.mode == "srv6":
        f = wire.srv6_encap(f, topo.host_locator(src, plane),
                            topo.usid_addr(topo.path_usids(src, dst, plane, t1)))
    return f


def send(prefix: str, host: str, dev: str, frames) -> int:
    """Write raw frames on `dev` of lab node `host`; returns how many were sent."""
    with netns.enter(prefix + host):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    try:
        s.bind((dev, 0))
        n = 0
        for f in frames:
            s.send(f)
            n += 1
        return n
    finally:
        s.close()


class Capture:
    """Frames arriving at `dev` of lab node `node` (after the link model's XDP)."""

    def __init__(self, prefix: str, node: str, dev: str):
        with netns.enter(prefix + node):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.bind((dev, ETH_P_ALL))
        self.sock.settimeout(0.05)

    def read(self, timeout: float = 0.5, want: int | None = None, incoming_only: bool = True):
        import time
        out = []
        end = time.monotonic() + timeout
        while time.monotonic() < end and (want is None or len(out) < want):
            try:
                data, addr = self.sock.recvfrom(65536)
            except socket.timeout:
                continue
            if incoming_only and addr[2] == socket.PACKET_OUTGOING:
                continue
            out.append(data)
        return out

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()
