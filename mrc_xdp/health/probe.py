"""EV probes from user space, answered by the peer's datapath (bpf/probe.h).

    from mrc_xdp.health.probe import Prober
    rtts = Prober().probe("default", conn=0, ev=0x1234abcd, count=4, timeout=0.05)
    # [0.000081, 0.000077, None, 0.000079]: seconds, None = no answer in time

How a probe travels, and why it needs no engine:

- The prober takes a probe id in the instance's ``mrc_probes`` map (an insert with
  BPF_NOEXIST, so concurrent probers never share an id), recording the peer, the EV and a
  random PSN (nonce) and the send time (CLOCK_MONOTONIC), then writes one PROBE_REQ frame
  into the instance's mrc0 with an AF_PACKET socket (in the instance's netns), the EV in
  its UDP source port and flow label.
- spray (mrc0p) sends it on that EV, without rotating: active or backup, any state but
  DENIED (ASSUMED_BAD EVs are what probes are for).
- The peer's ingress answers it in XDP (a SACK with PR set, echoing EV, probe id, PSN and
  timestamp) straight back out the plane it came in on; the answer is never handed to
  the peer's engine or user space.
- Our ingress matches the answer with the probe in flight (id, peer address, EV, PSN),
  stamps rx_ns and drops the frame.  The prober polls its entries: RTT = rx_ns - sent_ns,
  both kernel CLOCK_MONOTONIC, so the figure does not include the polling delay.

Nothing here touches the AF_XDP socket an engine may hold on mrc0: probes work whether
or not an endpoint is open.  Connection probes go to the connection's QPN; connectionless
EV probes (``probe_peer``) to QPN 0x2, answered by any peer with a configured connection.
Answers are rate-limited at the peer (mrc_config.probe_rate / probe_burst); a batch is
sent in waves of at most ``wave`` probes so a burst never exceeds the peer's bucket.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import random
import socket
import struct
import threading
import time

from mrc_xdp.datapath import bpfsys, maps, netns, wire
from mrc_xdp.datapath.shared import const, ffi, to_bytes

QPN_PROBE = const("MRC_QPN_PROBE")
BPF_NOEXIST = 1
POLL_S = 0.0002             # between the first two sweeps over the probes in flight ...
POLL_MAX_S = 0.005          # ... doubling up to this: an RTT is the datapath's rx_ns - sent_ns
                            # (kernel clock), so looking later costs no precision, only CPU
STALE_NS = 10_000_000_000   # entries older than this are reaped when the map is full
_RX_OFF = ffi.offsetof("struct mrc_probe", "rx_ns")
_SENT_OFF = ffi.offsetof("struct mrc_probe", "sent_ns")
_PLANE_OFF = ffi.offsetof("struct mrc_probe", "plane")
_OWNER_OFF = ffi.offsetof("struct mrc_probe", "owner")


class ProbeError(RuntimeError):
    pass


def probe_frame(src: str, dst: str, dqpn: int, ev: int, psn: int, probe_id: int,
                tx_ts: int = 0, udp_port: int = wire.UDP_PORT, t1: int | None = None) -> bytes:
    """A PROBE_REQ as mrc-wire.md lays it out (the same bytes as wire.probe_frame, built
    without scapy): EV[31:16] in the UDP source port, EV[15:0] in the flow label.  t1: the
    T1 the EV goes through, put in PETH vendor_info (MRC_PETH_VI_OFF) as t1 + 1 so the
    answer comes back through the same T1."""
    vi = t1 + 1 if t1 is not None and 0 <= t1 < 255 else 0
    plen = 8 + 12 + 16 + 4
    ip6 = (struct.pack("!IHBB", 6 << 28 | (ev & 0xFFFF), plen, 17, 64) +
           ipaddress.IPv6Address(src).packed + ipaddress.IPv6Address(dst).packed +
           struct.pack("!HHHH", ev >> 16, udp_port, plen, 0) +
           struct.pack("!BBHB", 0xDE, 0, 0xFFFF, 0) + (dqpn & 0xFFFFFF).to_bytes(3, "big") +
           b"\0" + (psn & 0xFFFFFF).to_bytes(3, "big") +
           struct.pack("!HBBHHHHHH", 0, 0, vi, probe_id & 0xFFFF, 0, 0, 0, tx_ts & 0xFFFF, 0))
    eth = bytes.fromhex(wire.DEFAULT_DMAC.replace(":", "")) + \
        bytes.fromhex(wire.DEFAULT_SMAC.replace(":", "")) + b"\x86\xdd"
    return eth + ip6 + wire.pack_icrc(wire.icrc(ip6))


class _Inst:
    """What probing one instance needs: its maps, a raw socket on its mrc0, its connections."""

    def __init__(self, name: str):
        self.name = name
        self.inst = maps.Instance(name)
        st = self.inst.state
        if not st.get("local_addr") or not st.get("app_dev"):
            self.inst.close()
            raise ProbeError("instance %r has no load record (local address, mrc0): reload it" % name)
        self.local = st["local_addr"]
        self.ns = st.get("netns")
        self.probes = self.inst.map("mrc_probes")
        self.map_id = bpfsys.map_info(self.probes.fd).id
        self.conns = {c["id"]: (c["peer"], c["remote_qpn"]) for c in self.inst.connections()}
        self.ev_t1: dict[int, int | None] = {}

        def mk():
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
            s.bind((st["app_dev"], 0))
            return s
        try:
            self.sock = netns.run(self.ns, mk) if self.ns else mk()
        except OSError as e:
            self.inst.close()
            raise ProbeError("instance %r: cannot open a raw socket on %s: %s" % (name, st["app_dev"], e)) from None

    def refresh(self) -> None:
        """Re-read the connections when the state file changed: run-time connections
        (mrc_xdp.transport.conns) come and go, and a freed id may be taken by another peer."""
        if not self.inst.reload_state():
            return
        self.conns = {c["id"]: (c["peer"], c["remote_qpn"]) for c in self.inst.connections()}
        self.ev_t1 = {}

    def current(self) -> bool:
        """Still the loaded instance (not unloaded or reloaded since)?"""
        try:
            fd = bpfsys.obj_get(os.path.join(self.inst.dir, "mrc_probes"))
        except OSError:
            return False
        try:
            return bpfsys.map_info(fd).id == self.map_id
        finally:
            os.close(fd)

    def t1_of(self, ev: int) -> int | None:
        """The T1 EV ev goes through (from the EV tables, re-read once for an EV not seen
        before: a connection added since; None, remembered, for an EV in no set)."""
        if ev not in self.ev_t1:
            self.ev_t1 = {r["ev"]: r["t1"] for r in self.inst.ev_table()}
            self.ev_t1.setdefault(ev, None)
        return self.ev_t1[ev]

    def close(self):
        self.sock.close()
        self.inst.close()


class Prober:
    """Probes EVs of loaded instances (thread-safe; one raw socket per instance)."""

    def __init__(self, wave: int = 64):
        self.wave = wave
        self._lock = threading.Lock()
        self._inst: dict[str, _Inst] = {}
        self._rng = random.Random()
        self.pid = os.getpid()

    # -- instances
    def _get(self, name: str) -> _Inst:
        with self._lock:
            it = self._inst.get(name)
            if it is not None and not it.current():
                it.close()
                it = None
            if it is None:
                try:
                    it = _Inst(name)
                except maps.NotLoaded as e:
                    raise ProbeError(str(e)) from None
                self._inst[name] = it
            return it

    def close(self):
        with self._lock:
            for it in self._inst.values():
                it.close()
            self._inst.clear()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    # -- the API
    def probe(self, instance: str, conn: int, ev: int, count: int = 1, timeout: float = 0.05) -> list:
        """count probes of EV ev of connection conn: one RTT in seconds (or None: no
        answer within timeout) per probe."""
        return self.probe_many([(instance, conn, ev)], count, timeout)[0]

    def probe_peer(self, instance: str, peer: str, ev: int, count: int = 1, timeout: float = 0.05) -> list:
        """Connectionless probes (QPN 0x2) of EV ev to peer: the EV must be in the set of the
        instance's first connection to that peer (it names the plane and path)."""
        return self.probe_many([(instance, ("peer", peer), ev)], count, timeout)[0]

    def probe_many(self, jobs, count: int = 1, timeout: float = 0.05) -> list[list]:
        """Batch: jobs = [(instance, conn id | ("peer", address), ev)]; all probes go out in
        waves of at most `wave`, each wave waits for its answers up to timeout.  Returns
        one list of count results per job."""
        todo = []
        for j, (name, conn, ev) in enumerate(jobs):
            it = self._get(name)
            if isinstance(conn, tuple):
                peer, qpn = str(ipaddress.IPv6Address(conn[1])), QPN_PROBE
            else:
                it.refresh()
                if conn not in it.conns:
                    raise ProbeError("instance %r has no connection %r" % (name, conn))
                peer, qpn = it.conns[conn]
            todo += [(j, k, it, peer, qpn, int(ev)) for k in range(count)]
        out = [[None] * count for _ in jobs]
        for i in range(0, len(todo), max(1, self.wave)):
            self._wave(todo[i:i + self.wave], out, timeout)
        return out

    # -- one wave
    def _take_id(self, it: _Inst, peer: str, ev: int) -> tuple[int, int, bytes]:
        pr = ffi.new("struct mrc_probe *")
        ffi.memmove(pr.peer, ipaddress.IPv6Address(peer).packed, 16)
        pr.ev, pr.owner = ev, self.pid
        for attempt in range(64):
            pid, psn = self._rng.getrandbits(16), self._rng.getrandbits(24)
            pr.psn = psn
            pr.sent_ns = time.monotonic_ns()
            try:
                it.probes.update(pid, to_bytes(pr), BPF_NOEXIST)
                return pid, psn, bytes(ffi.buffer(pr))
            except OSError as e:
                if e.errno == errno.E2BIG:
                    self._reap(it)
                elif e.errno != errno.EEXIST:
                    raise
        raise ProbeError("instance %r: no free probe id (mrc_probes full)" % it.name)

    def _reap(self, it: _Inst) -> None:
        """Entries of probers that died (or of long ago) when the map is full."""
        now = time.monotonic_ns()
        for k, v in list(it.probes.items()):
            sent = int.from_bytes(v[_SENT_OFF:_SENT_OFF + 8], "little")
            owner = int.from_bytes(v[_OWNER_OFF:_OWNER_OFF + 4], "little")
            if now - sent > STALE_NS or not os.path.exists("/proc/%d" % owner):
                it.probes.delete(k)

    def _wave(self, batch, out, timeout: float) -> None:
        pending = {}
        try:
            for j, k, it, peer, qpn, ev in batch:
                pid, psn, _ = self._take_id(it, peer, ev)
                f = probe_frame(it.local, peer, qpn, ev, psn, pid, tx_ts=time.monotonic_ns() >> 10,
                                t1=it.t1_of(ev))
                # the entry's sent_ns was taken just before; the send follows at once
                try:
                    it.sock.send(f)
                except OSError as e:
                    it.probes.delete(pid)
                    raise ProbeError("instance %r: sending a probe on %s failed: %s" % (
                        it.name, it.inst.state.get("app_dev"), e)) from None
                pending[(it.name, pid)] = (j, k, it)
            deadline = time.monotonic() + timeout
            nap = POLL_S
            while pending:
                for key, (j, k, it) in list(pending.items()):
                    raw = it.probes.lookup(key[1])
                    if raw is None:
                        pending.pop(key)
                        continue
                    rx = int.from_bytes(raw[_RX_OFF:_RX_OFF + 8], "little")
                    if rx:
                        sent = int.from_bytes(raw[_SENT_OFF:_SENT_OFF + 8], "little")
                        out[j][k] = max(rx - sent, 0) / 1e9
                        it.probes.delete(key[1])
                        pending.pop(key)
                left = deadline - time.monotonic()
                if not pending or left <= 0:
                    break
                time.sleep(min(nap, left))
                nap = min(2 * nap, POLL_MAX_S)
        finally:
            for (_, pid), (_, _, it) in pending.items():
                try:
                    it.probes.delete(pid)
                except OSError:
                    pass
