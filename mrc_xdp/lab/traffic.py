"""A minimal MRC sender and receiver over AF_PACKET on a host's mrc0.

Not the transport engine: no memory registration, no retransmission.  The sender
writes Write-Only data frames with consecutive PSNs into mrc0 (the datapath sprays
them); the receiver answers every data frame per mrc-wire.md with a SACK (cumulative
PSN, 64-bit bitmap, the EV echoed, M=SKIP_ONCE when the frame arrived CE-marked) or,
for a trimmed frame (the trimmed DSCP), a NACK TRIMMED.  Enough to drive the EV
state machine end to end in the lab and the tests.  Frames are built once with
wire.py and patched per packet; every loop is bounded by a count and a deadline.
"""
from __future__ import annotations

import ipaddress
import select
import socket
import threading
import time

from mrc_xdp.datapath import netns, wire
from mrc_xdp.datapath.shared import NackReason, SackM

ETH_P_ALL = 0x0003
L3 = wire.ETH_LEN               # offsets in a plain (ECMP) frame: IPv6 header
UDP = L3 + wire.IPV6_LEN
BTH = UDP + wire.UDP_LEN
EXT = BTH + wire.BTH_LEN        # the first extension header (SETH, NETH, METH)
ETHERTYPE_IPV6 = wire.ETHERTYPE_IPV6.to_bytes(2, "big")
MRC_PORT = wire.UDP_PORT.to_bytes(2, "big")
DATA_OPS = set(int(o) for o in wire.DATA_OPCODES)
GIVE_UP = 1024          # receiver: holes this far behind the newest PSN are given up
GIVE_UP_STEP = 256


def _patch_icrc(frame: bytearray) -> bytes:
    """Recompute the ICRC trailer of an ECMP frame (plain IPv6) in place."""
    ip6 = bytes(frame[L3:-4])
    frame[-4:] = wire.pack_icrc(wire.icrc(ip6))
    return bytes(frame)


def _raw_socket(dev: str, ns: str | None, recv: bool):
    def mk():
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL if recv else 0))
        s.bind((dev, 0))
        if recv:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        return s
    return netns.run(ns, mk) if ns else mk()


class Sender:
    """Send count data frames src -> dst (dqpn) on dev, PSNs start_psn..; paced by pps."""

    def __init__(self, dev: str, src: str, dst: str, dqpn: int, ns: str | None = None,
                 payload: int = 1024, dmac: str = wire.DEFAULT_DMAC, smac: str = wire.DEFAULT_SMAC):
        self.sock = _raw_socket(dev, ns, recv=False)
        self.tmpl = bytearray(wire.data_frame(src, dst, dqpn, 0, b"\0" * payload, smac=smac, dmac=dmac,
                                              dlen=payload))
        self.sent = 0
        self.psn = 0

    def send(self, count: int, pps: float = 0, deadline_s: float = 60.0, stop: threading.Event | None = None) -> int:
        t0 = time.monotonic()
        f = self.tmpl
        for i in range(count):
            if stop is not None and stop.is_set():
                break
            if pps:
                ahead = t0 + i / pps - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            if time.monotonic() - t0 > deadline_s:
                break
            psn = self.psn & 0xFFFFFF
            f[BTH + 9:BTH + 12] = psn.to_bytes(3, "big")
            try:
                self.sock.send(_patch_icrc(f))
            except BlockingIOError:
                time.sleep(0.001)
                continue
            self.psn += 1
            self.sent += 1
        return self.sent

    def close(self):
        self.sock.close()


class _RxConn:
    __slots__ = ("peer_qpn", "cack", "high", "recv", "pkts", "ce", "trimmed")

    def __init__(self, peer_qpn):
        self.peer_qpn = peer_qpn
        self.cack = 0          # every PSN below has been received (or given up on)
        self.high = 0          # newest PSN received
        self.recv = set()      # received PSNs >= cack
        self.pkts = self.ce = self.trimmed = 0

    def receive(self, psn: int) -> tuple[int, int, int]:
        """Record psn; returns (cack, sack_offset, bitmap) for the SACK answering it.

        The bitmap window ends at psn (base = psn - 63, or cack if that is newer), so
        each SACK reports the holes just behind the newest arrival.  This sender never
        retransmits, so holes more than GIVE_UP PSNs behind the newest are given up
        (cack jumps over them, in steps of GIVE_UP_STEP): state stays bounded and the
        16-bit sack_offset never overflows.
        """
        if (psn - self.cack) & 0xFFFFFF >= 0x800000:
            return self.cack, 0, 0                    # older than cack: duplicate
        self.recv.add(psn)
        if (psn - self.high) & 0xFFFFFF < 0x800000:
            self.high = psn
        if (self.high - self.cack) & 0xFFFFFF > GIVE_UP + GIVE_UP_STEP:
            self.cack = (self.high - GIVE_UP) & 0xFFFFFF
            self.recv = {p for p in self.recv if (p - self.cack) & 0xFFFFFF < 0x800000}
        while self.cack in self.recv:
            self.recv.discard(self.cack)
            self.cack = (self.cack + 1) & 0xFFFFFF
        base = (psn - 63) & 0xFFFFFF
        if (base - self.cack) & 0xFFFFFF >= 0x800000:
            base = self.cack
        bitmap = 0
        for i in range(64):
            if (base + i) & 0xFFFFFF in self.recv:
                bitmap |= 1 << i
        return self.cack, (base - self.cack) & 0xFFFF, bitmap


class Receiver:
    """Answer data frames arriving on dev with SACK/NACK, in a background thread.

    conns: {(peer_addr, local_qpn): peer_qpn}.  trimmed_dscp: the DSCP the fabric sets on
    trimmed frames.  The thread stops by itself after max_seconds.
    """

    def __init__(self, dev: str, local_addr: str, conns: dict, ns: str | None = None,
                 trimmed_dscp: int = 12, max_seconds: float = 120.0, smac: str = wire.DEFAULT_SMAC,
                 dmac: str = wire.DEFAULT_DMAC):
        self.rx = _raw_socket(dev, ns, recv=True)
        self.tx = _raw_socket(dev, ns, recv=False)
        self.local = ipaddress.IPv6Address(local_addr).packed
        self.conns = {(ipaddress.IPv6Address(p).packed, q): _RxConn(pq) for (p, q), pq in conns.items()}
        self.trimmed_dscp = trimmed_dscp
        self.max_seconds = max_seconds
        self.stop_ev = threading.Event()
        self.sacks = self.nacks = self.frames = 0
        self._sack = bytearray(wire.sack_frame(local_addr, local_addr, 3, 0, 0, 0, smac=smac, dmac=dmac))
        self._nack = bytearray(wire.nack_frame(local_addr, local_addr, 3, 0, 0, 0, smac=smac, dmac=dmac))
        self.thread = threading.Thread(target=self._run, name="mrc-receiver", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stop_ev.set()
        self.thread.join(timeout=5)
        self.rx.close()
        self.tx.close()

    def stats(self) -> dict:
        out = {"frames": self.frames, "sacks": self.sacks, "nacks": self.nacks, "conns": []}
        for (peer, q), c in self.conns.items():
            out["conns"].append({"peer": str(ipaddress.IPv6Address(peer)), "local_qpn": q, "pkts": c.pkts,
                                 "ce": c.ce, "trimmed": c.trimmed, "cack": c.cack})
        return out

    def _reply(self, tmpl: bytearray, f: bytes, c: _RxConn, psn: int, fill) -> None:
        r = tmpl
        r[L3 + 8:L3 + 24] = self.local
        r[L3 + 24:L3 + 40] = f[L3 + 8:L3 + 24]
        r[BTH + 5:BTH + 8] = c.peer_qpn.to_bytes(3, "big")
        r[BTH + 9:BTH + 12] = psn.to_bytes(3, "big")
        r[EXT + 4:EXT + 8] = self._ev(f).to_bytes(4, "big")   # echo the EV that carried it
        fill(r)
        self.tx.send(_patch_icrc(r))

    @staticmethod
    def _ev(f: bytes) -> int:
        return (int.from_bytes(f[UDP:UDP + 2], "big") << 16) | int.from_bytes(f[L3 + 2:L3 + 4], "big")

    def _handle(self, f: bytes) -> None:
        if len(f) < EXT + 4 or f[L3 - 2:L3] != ETHERTYPE_IPV6 or f[L3 + 6] != wire.NH_UDP or \
                f[UDP + 2:UDP + 4] != MRC_PORT or f[BTH] not in DATA_OPS or f[L3 + 24:L3 + 40] != self.local:
            return
        key = (bytes(f[L3 + 8:L3 + 24]), int.from_bytes(f[BTH + 5:BTH + 8], "big"))
        c = self.conns.get(key)
        if c is None:
            return
        self.frames += 1
        c.pkts += 1
        tc = ((f[L3] & 0x0F) << 4) | (f[L3 + 1] >> 4)
        psn = int.from_bytes(f[BTH + 9:BTH + 12], "big")
        if tc >> 2 == self.trimmed_dscp:
            c.trimmed += 1

            def fill_nack(r):
                r[EXT + 2] = NackReason.TRIMMED
                r[EXT + 13:EXT + 16] = psn.to_bytes(3, "big")
            self._reply(self._nack, f, c, c.cack, fill_nack)
            self.nacks += 1
            return
        ce = (tc & 3) == 3
        c.ce += ce
        cack, soff, bitmap = c.receive(psn)
        off = (psn - cack) & 0xFFFF

        def fill_sack(r):
            r[EXT + 1] = (r[EXT + 1] & ~(3 << 5)) | ((SackM.SKIP_ONCE if ce else SackM.NONE) << 5)
            r[EXT + 2:EXT + 4] = off.to_bytes(2, "big")
            r[EXT + 13:EXT + 16] = cack.to_bytes(3, "big")
            r[EXT + 18:EXT + 20] = soff.to_bytes(2, "big")       # bitmap base = cack + soff
            r[EXT + 20:EXT + 28] = bitmap.to_bytes(8, "big")
        self._reply(self._sack, f, c, cack, fill_sack)
        self.sacks += 1

    def _run(self):
        t_end = time.monotonic() + self.max_seconds
        self.rx.setblocking(False)
        while not self.stop_ev.is_set() and time.monotonic() < t_end:
            r, _, _ = select.select([self.rx], [], [], 0.05)
            if not r:
                continue
            for _ in range(256):
                try:
                    f, addr = self.rx.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr[2] == socket.PACKET_OUTGOING:
                    continue
                self._handle(f)

