"""MRC transport: reliable multipath RDMA Write over AF_XDP, from Python.

The engine is C (mrc_xdp/engine/, built by cffi at install time): one AF_XDP socket per
endpoint on the host's app_dev (mrc0) and one progress thread that does every
per-packet job.  Python sets things up, posts work requests and reaps completions; it
is never called per packet.

    from mrc_xdp import transport

    with transport.Endpoint("h0") as ep:                 # datapath instance h0, loaded
        buf = bytearray(1 << 20)
        mr = ep.reg_mr(buf)                              # LOCAL | REMOTE_WRITE
        qp = ep.create_qp(qpn=0x100)
        attrs = qp.local_attrs()                         # send to the peer out of band
        qp.connect(peer_attrs)                           # the peer's local_attrs()
        qp.post_write(1, mr, 0, len(buf), peer_mr_addr, peer_mr_rkey, imm=7)
        for c in ep.cq.wait_blocking(timeout=5):         # or: await ep.cq.wait()
            assert c.ok, c

The receiver of a Write-with-Immediate gets a completion (opcode RECV_RDMA_IMM) with
``imm`` and ``byte_len`` once every byte of the message has been placed.  A plain Write
completes only at the sender.
"""
from __future__ import annotations

import asyncio
import enum
import errno
import fcntl
import ipaddress
import json
import os
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass

from mrc_xdp.datapath import bpfsys, maps
from mrc_xdp.datapath import netns as _netns

ACCESS_LOCAL = 1            # engine.h MRC_ENG_ACCESS_LOCAL
ACCESS_REMOTE_WRITE = 2     # engine.h MRC_ENG_ACCESS_REMOTE_WRITE
XSKMAP = "mrc_xsks"
SIOCGIFMTU = 0x8921

# Per-packet overhead of a data frame on app_dev, beyond the payload:
# IPv6 40 + UDP 8 + BTH 12 + METH 4 + RETH 16 + ImmDt 4 + ICRC 4 (MTU counts from IPv6).
DATA_OVERHEAD = 88
PAYLOAD_ALIGN = 64          # the default payload is rounded down to this
TSETH_LEN = 4               # more per packet with timestamps=1
# The default payload is at most InfiniBand's largest path MTU (what MRC NICs use); larger
# payloads (8, 16, 32 KiB ...) are a per-endpoint option (Endpoint(mtu=...)) where the path's
# MTU allows them.  A payload larger than one UMEM frame holds goes as a multi-buffer packet
# (AF_XDP XDP_USE_SG, Linux 6.6+): see engine.h `sg`.
IB_PAYLOAD = 4096
FRAME_SIZE = 4096           # engine.h: the UMEM frame (opts.frame_size default)
RX_HEADROOM = 256           # engine.h MRC_ENG_RX_HEADROOM: an RX frame holds FRAME_SIZE - this
ETH_LEN = 14
SG_AUTO, SG_OFF, SG_ON = 0, 1, 2     # engine.h MRC_ENG_SG_*
MAX_PAYLOAD = 65472         # an IPv6 packet of at most 65535 bytes, rounded down to 64


class TransportError(RuntimeError):
    """An engine call failed; the message is one line saying what to do."""


class WcStatus(enum.IntEnum):
    SUCCESS = 0
    RETRY_EXC_ERR = 1
    REM_ACCESS_ERR = 2
    WR_FLUSH_ERR = 3
    LOC_ACCESS_ERR = 4


class WcOpcode(enum.IntEnum):
    RDMA_WRITE = 0
    RECV_RDMA_IMM = 1


class QpState(enum.IntEnum):
    INIT = 1
    RTS = 2
    ERROR = 3
    DESTROYED = 4


def send_slot_name(una_state: int) -> str:
    """A QP's stats()["una_state"] in words: its oldest unacknowledged PSN's send slot,
    named from engine.h's enum mrc_txp_state (MRC_TXP_IN_FLIGHT: "in flight"), with
    " (queued)" while it waits in the resend queue (MRC_TXP_QUEUED)."""
    ffi, lib = _engine()
    names = ffi.typeof("enum mrc_txp_state").elements          # value -> MRC_TXP_...
    name = names[una_state & (lib.MRC_TXP_QUEUED - 1)][len("MRC_TXP_"):].lower().replace("_", " ")
    return name + (" (queued)" if una_state & lib.MRC_TXP_QUEUED else "")


@dataclass(frozen=True)
class Completion:
    wr_id: int              # the sender's wr_id; 0 for receive completions
    qpn: int
    status: WcStatus
    opcode: WcOpcode
    byte_len: int
    imm: int | None         # immediate data (Write-with-Immediate), else None

    @property
    def ok(self) -> bool:
        return self.status == WcStatus.SUCCESS


_lib_cache = None


def _engine():
    """(ffi, lib) of the compiled engine, or one clear error."""
    global _lib_cache
    if _lib_cache is None:
        try:
            import mrc_xdp.transport._engine as mod
        except ImportError as e:
            raise TransportError("the transport engine is not built (%s): run `make setup`" % e) from None
        _lib_cache = (mod.ffi, mod.lib)
    return _lib_cache


def _struct_dict(ffi, cdata) -> dict:
    return {name: getattr(cdata, name) for name, _ in ffi.typeof(cdata[0]).fields}


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise TransportError("%s: %s" % (what, os.strerror(-rc)))
    return rc


def _dev_mtu(ns, dev) -> int:
    """MTU of dev in netns ns (SIOCGIFMTU on a socket made inside it: /sys/class/net
    shows the namespace sysfs was mounted in, not the thread's)."""
    def rd():
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            r = fcntl.ioctl(s, SIOCGIFMTU, struct.pack("16si12x", dev.encode(), 0))
            return struct.unpack("16si12x", r)[1]
    try:
        return _netns.run(ns, rd)
    except OSError:
        raise TransportError("%s: no such device%s: load the datapath on this host first" % (
            dev, " in netns %s" % ns if ns else "")) from None


def default_payload(mtu: int, cap: int = IB_PAYLOAD) -> int:
    """Payload bytes per data packet for an app_dev MTU (IPv6 packet size): the largest
    multiple of 64 the MTU allows, at most cap (IB_PAYLOAD, 4096)."""
    return max(PAYLOAD_ALIGN, min(cap, (mtu - DATA_OVERHEAD) // PAYLOAD_ALIGN * PAYLOAD_ALIGN))


def single_frame_payload(timestamps: bool = False) -> int:
    """The largest payload (a multiple of 64) whose frame fits one UMEM RX frame: above
    it a packet is multi-buffer (engine.c single_frame_payload)."""
    over = ETH_LEN + DATA_OVERHEAD + (TSETH_LEN if timestamps else 0)
    return (FRAME_SIZE - RX_HEADROOM - over) // PAYLOAD_ALIGN * PAYLOAD_ALIGN


def local_addr(instance: str) -> str:
    """The MRC address of a loaded datapath instance (its config map), without opening
    an endpoint: what a peer must not claim to be."""
    try:
        inst = maps.Instance(instance)
    except maps.NotLoaded as e:
        raise TransportError(str(e)) from None
    try:
        from mrc_xdp.datapath.shared import from_bytes
        c = from_bytes("struct mrc_config", inst.map("mrc_cfg").lookup(0))
        return str(ipaddress.IPv6Address(bytes(c.local_addr)))
    finally:
        inst.close()


# -------------------------------------------------------------------- memory region

class _UmemSpace:
    """The memory-region space inside an endpoint's UMEM (engine.h umem_mr): first-fit
    allocation in 4 KiB units; unmapped once nothing refers to it (the engine leaves it
    mapped at close)."""
    UNIT = 4096

    def __init__(self, addr: int, length: int):
        self.addr, self.length = addr, length
        self.free_list = [(0, length)]
        self.closed = False         # the engine is closed: nothing else uses the space

    def alloc(self, size: int) -> int:
        need = -(-max(1, size) // self.UNIT) * self.UNIT
        for i, (off, n) in enumerate(self.free_list):
            if n >= need:
                self.free_list[i] = (off + need, n - need)
                return off
        raise TransportError("alloc_mr(%d): the UMEM's memory-region space (%d bytes) has no room: "
                             "open the Endpoint with a larger umem_mr" % (size, self.length))

    def free(self, off: int, size: int) -> None:
        need = -(-max(1, size) // self.UNIT) * self.UNIT
        merged = sorted(self.free_list + [(off, need)])
        self.free_list = []
        for o, n in merged:
            if n and self.free_list and self.free_list[-1][0] + self.free_list[-1][1] == o:
                self.free_list[-1] = (self.free_list[-1][0], self.free_list[-1][1] + n)
            elif n:
                self.free_list.append((o, n))

    def __del__(self):
        # only once the engine is closed (an endpoint dropped without close() keeps its
        # engine, and the space stays: a leak, not a crash)
        if self.closed and _munmap is not None:
            _munmap(self.addr, self.length)


def _libc_munmap():
    import ctypes
    try:
        f = ctypes.CDLL(None, use_errno=True).munmap
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return f


_munmap = _libc_munmap()


class MR:
    """A registered memory region: .addr (VA), .length, .rkey (also the local key)."""

    _umem = None            # alloc_mr: the UMEM space it lives in (kept mapped while this lives)
    _umem_off = 0

    @property
    def buf(self) -> memoryview:
        """The region's memory (regions from Endpoint.alloc_mr)."""
        return memoryview(self._buf)

    def __init__(self, ep: "Endpoint", buf, access: int):
        ffi, lib = _engine()
        writable = bool(access & ACCESS_REMOTE_WRITE)
        try:
            self._cdata = ffi.from_buffer(buf, require_writable=writable)
        except (TypeError, BufferError) as e:
            raise TransportError("reg_mr: %s (remote write needs a writable buffer: bytearray, "
                                 "numpy array, mmap)" % e) from None
        self._buf = buf
        self._ep = ep
        self.addr = int(ffi.cast("uintptr_t", self._cdata))
        self.length = len(self._cdata)
        self.access = access
        rk = ffi.new("uint32_t *")
        try:
            _check(lib.mrc_eng_reg_mr(ep._e, self.addr, self.length, access, rk), "reg_mr")
        except TransportError:
            self._release()
            raise
        self.rkey = int(rk[0])
        self.lkey = self.rkey
        self.registered = True

    def _release(self) -> None:
        """Let go of the buffer (once the engine cannot touch it any more): an mmap can
        then be closed at once, not when the garbage collector gets to this MR."""
        if self._cdata is not None:
            _engine()[0].release(self._cdata)
            self._cdata = self._buf = None

    def attrs(self) -> dict:
        """JSON-able {addr, length, rkey} for the peer."""
        return {"addr": self.addr, "length": self.length, "rkey": self.rkey}

    def dereg(self) -> None:
        if self.registered and self._ep._e is not None:
            _engine()[1].mrc_eng_dereg_mr(self._ep._e, self.rkey)
            if self._umem is not None:
                self._umem.free(self._umem_off, self.length)
        self.registered = False

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.dereg()

    def __repr__(self):
        return "MR(addr=%#x, length=%d, rkey=%#x)" % (self.addr, self.length, self.rkey)


# -------------------------------------------------------------------- queue pair

def _drop_conns(instance: str, qps) -> None:
    """Remove the datapath connections these QPs added in connect() (one QP: conns.remove;
    more: conns.remove_many, one lock, one sweep and one state write for all)."""
    items = []
    for qp in qps:
        peer, qp._conn = getattr(qp, "_conn", None), None
        if peer:
            items.append((peer, qp.qpn))
    if not items:
        return
    from mrc_xdp.transport import conns
    try:
        if len(items) == 1:
            conns.remove(instance, *items[0])
        else:
            conns.remove_many(instance, items)
    except (conns.ConnError, maps.NotLoaded, OSError):
        pass       # already removed, or the datapath was unloaded


class QP:
    """A reliable connection to one peer QP.  Create with Endpoint.create_qp()."""

    def __init__(self, ep: "Endpoint", qpn: int | None, start_psn: int | None):
        ffi, lib = _engine()
        self._ep = ep
        self.start_psn = (int.from_bytes(os.urandom(3), "big") if start_psn is None else start_psn) & 0xFFFFFF
        out = ffi.new("uint32_t *")
        _check(lib.mrc_eng_qp_create(ep._e, qpn or 0, self.start_psn, out),
               "create_qp(qpn=%s)" % (hex(qpn) if qpn else "auto"))
        self.qpn = int(out[0])
        self.remote: dict | None = None
        self.payload = ep.payload
        self._destroyed = False

    def local_attrs(self) -> dict:
        """What the peer needs to connect to this QP (JSON-able)."""
        return {"addr": self._ep.local_addr, "qpn": self.qpn, "start_psn": self.start_psn,
                "mtu": self._ep.payload}

    def connect(self, remote: dict) -> None:
        """Connect to the peer QP described by its local_attrs().  The datapath must carry
        the connection (peer address + QPNs) for frames to be sprayed."""
        _, lib = _engine()
        payload = min(int(remote.get("mtu", self._ep.payload)), self._ep.payload)
        peer = ipaddress.IPv6Address(remote["addr"]).packed
        self._add_conn(remote)
        _check(lib.mrc_eng_qp_connect(self._ep._e, self.qpn, peer, int(remote["qpn"]),
                                      int(remote.get("start_psn", 0)) & 0xFFFFFF, payload),
               "connect qp %#x" % self.qpn)
        self.remote = dict(remote)
        self.payload = payload

    def _add_conn(self, remote: dict) -> None:
        """The datapath sprays only connections it knows: add (peer, this QPN, the peer's
        QPN) to the instance's maps when it does not list them (mrc_xdp.transport.conns); destroy()
        removes what was added here."""
        from mrc_xdp.transport import conns
        if getattr(self, "_conn", None) or conns.find(self._ep.instance, remote["addr"], self.qpn) is not None:
            return
        try:
            conns.add(self._ep.instance, remote["addr"], self.qpn, int(remote["qpn"]),
                      name="qp%#x" % self.qpn, owner=os.getpid())
        except conns.ConnError as e:
            raise TransportError("connect qp %#x: %s" % (self.qpn, e)) from None
        self._conn = remote["addr"]

    def _drop_conn(self) -> None:
        _drop_conns(self._ep.instance, [self])

    def post_write(self, wr_id: int, mr: MR, offset: int, length: int, remote_addr: int,
                   rkey: int, imm: int | None = None) -> None:
        """RDMA Write of mr[offset:offset+length] to remote_addr (R_Key rkey) of the peer;
        with imm, a Write-with-Immediate.  Completes on ep.cq with wr_id."""
        _, lib = _engine()
        if offset < 0 or length < 0 or offset + length > mr.length:
            raise TransportError("post_write: [%d, %d) is outside the MR (length %d)" % (
                offset, offset + length, mr.length))
        rc = lib.mrc_eng_post_write(self._ep._e, self.qpn, wr_id & 0xFFFFFFFFFFFFFFFF,
                                    mr.addr + offset, mr.lkey, length, remote_addr, rkey,
                                    imm is not None, (imm or 0) & 0xFFFFFFFF)
        if rc < 0:
            why = {errno.ENOTCONN: "not connected: call connect() first",
                   errno.EPIPE: "in the error state: destroy it and create a new QP",
                   errno.EFAULT: "the local range is not inside a registered MR with local access",
                   errno.EMSGSIZE: "a message is at most 4 GiB - 1 (RETH DMA length is 32 bits)",
                   errno.ENOENT: "destroyed"}.get(-rc, os.strerror(-rc))
            raise TransportError("post_write on qp %#x: %s" % (self.qpn, why))

    @property
    def state(self) -> QpState:
        if self._destroyed:
            return QpState.DESTROYED
        return QpState(self.stats()["state"])

    def stats(self) -> dict:
        """Per-QP counters: packets/bytes sent, retransmissions by reason, SACKs, NACKs by
        reason, RTT (srtt, min), cwnd, state, ... (struct mrc_qp_stats)."""
        ffi, lib = _engine()
        if self._destroyed:
            raise TransportError("qp %#x is destroyed" % self.qpn)
        st = ffi.new("struct mrc_qp_stats *")
        _check(lib.mrc_eng_qp_stats(self._ep._e, self.qpn, st), "stats of qp %#x" % self.qpn)
        d = _struct_dict(ffi, st)
        d["qpn"] = self.qpn
        d["state_name"] = QpState(d["state"]).name.lower()
        return d

    def destroy(self) -> None:
        """Flush outstanding work (completions with WR_FLUSH_ERR) and free the QP."""
        if not self._destroyed and self._ep._e is not None:
            _engine()[1].mrc_eng_qp_destroy(self._ep._e, self.qpn)
        self._drop_conn()
        self._destroyed = True
        self._ep._qps.pop(self.qpn, None)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.destroy()

    def __repr__(self):
        return "QP(qpn=%#x, state=%s)" % (self.qpn, "destroyed" if self._destroyed else self.state.name)


# -------------------------------------------------------------------- completion queue

class CQ:
    """The endpoint's completion queue.  fileno() is an eventfd readable while
    completions are pending (select, poll, asyncio)."""

    def __init__(self, ep: "Endpoint"):
        ffi, lib = _engine()
        self._ep = ep
        self._fd = lib.mrc_eng_cq_fd(ep._e)
        self._max = 256
        self._wc = ffi.new("struct mrc_eng_wc[]", self._max)
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._fd

    def poll(self, max_n: int = 64) -> list[Completion]:
        """Up to max_n completions, without waiting."""
        _, lib = _engine()
        out: list[Completion] = []
        with self._lock:
            while len(out) < max_n and self._ep._e is not None:
                n = lib.mrc_eng_poll(self._ep._e, self._wc, min(self._max, max_n - len(out)))
                out += self._take(n)
                if n < self._max:
                    break
        return out

    def _take(self, n: int) -> list[Completion]:
        out = []
        for i in range(n):
            w = self._wc[i]
            out.append(Completion(int(w.wr_id), int(w.qpn), WcStatus(w.status), WcOpcode(w.opcode),
                                  int(w.byte_len), int(w.imm) if w.has_imm else None))
        return out

    def wait_blocking(self, timeout: float | None = None, max_n: int = 64,
                      spin_us: int = 0) -> list[Completion]:
        """Completions, waiting up to timeout seconds for the first one ([] on timeout).
        spin_us: first spin that long for one in C (the GIL released, no syscall, and the
        engine writes no eventfd meanwhile), then sleep on the eventfd: for a caller
        whose next completion is microseconds away (a round trip), one wake-up less."""
        spin_checked(spin_us, "wait_blocking: spin_us", "microseconds to spin for a completion")
        deadline = None if timeout is None else time.monotonic() + timeout
        if spin_us > 0 and self._ep._e is not None:
            _, lib = _engine()
            with self._lock:
                n = lib.mrc_eng_cq_wait(self._ep._e, self._wc, min(self._max, max_n), int(spin_us))
                if n:
                    return self._take(n)
        while True:
            got = self.poll(max_n)
            if got:
                return got
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return []
            select.select([self._fd], [], [], left)

    async def wait(self, timeout: float | None = None, max_n: int = 64) -> list[Completion]:
        """Await completions (asyncio); [] after timeout seconds without any."""
        got = self.poll(max_n)
        if got:
            return got
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            fut = loop.create_future()
            loop.add_reader(self._fd, lambda: fut.done() or fut.set_result(None))
            try:
                left = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    await asyncio.wait_for(fut, left)
                except asyncio.TimeoutError:
                    pass
            finally:
                loop.remove_reader(self._fd)
            got = self.poll(max_n)
            if got or (deadline is not None and loop.time() >= deadline):
                return got


# -------------------------------------------------------------------- endpoint

_OPT_NAMES = ("ack_every", "ack_delay_us", "rto_min_us", "rto_max_us", "rto_bulk_us", "retry_limit",
              "loss_reorder", "window", "frames", "ring", "zero_copy", "timestamps", "dscp_data", "dscp_ctrl",
              "dscp_trimmed", "cc_init_cwnd", "cc_min_cwnd", "cc_max_cwnd", "cc_target_us",
              "cc_fair_inc", "cc_prop_gain", "cc_md_gamma", "cc_max_md", "cc_pace", "spin_us", "ce_ack",
              "sg", "umem_mr", "tx_budget")
SPIN_DEFAULT_US = 0         # engine.h MRC_ENG_SPIN_DEFAULT_US (off)
SPIN_MAX_US = 10000         # engine.h MRC_ENG_SPIN_MAX_US
SPIN_OFF = 0xFFFFFFFF       # engine.h MRC_ENG_SPIN_OFF: what spin_us=0 passes


def spin_checked(v, what: str = "spin_us", means: str = "microseconds the engine spins after work "
                 "before it sleeps") -> int:
    """v if it is a spin time in microseconds, 0 (off) .. SPIN_MAX_US; else one clear error
    naming `what` (the option or flag) and what it `means`."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= SPIN_MAX_US:
        raise TransportError("%s %r: %s, 0 (off) .. %d" % (what, v, means, SPIN_MAX_US))
    return v


def check_spin_us(v) -> int:
    """spin_us as the engine takes it (0: off), or one clear error."""
    return spin_checked(v) or SPIN_OFF


class Endpoint:
    """An AF_XDP endpoint on a loaded datapath instance.

    Opens the socket on the instance's app_dev (mrc0) queue 0 inside the instance's
    network namespace (netns, default: the one it was loaded in), puts it into the
    instance's pinned XSKMAP, and starts the C progress thread.  mtu: payload bytes
    per data packet (default: the largest app_dev's MTU allows, see default_payload).
    Keyword options (engine.h struct mrc_eng_opts, 0 = default): ack_every,
    ack_delay_us, rto_min_us, rto_max_us, rto_bulk_us, retry_limit, loss_reorder, window, frames,
    ring, zero_copy, timestamps (1: TSETH on data, reflected in SACKs, which the
    datapath's time-based loss rule dates packets by; default none), dscp_*, and the
    NSCC window cc_init_cwnd, cc_min_cwnd,
    cc_max_cwnd, cc_target_us, cc_fair_inc, cc_prop_gain, cc_md_gamma, cc_max_md; spin_us:
    the most the progress thread spins after work before it sleeps (adaptive below it;
    default 0: never spins, as it only pays with a caller that spins on the CQ too,
    which write-lat does; see docs/transport.md).
    publish: every this many seconds, write the QPs' counters for other processes
    (/run/mrc-xdp/qps/<instance>/, read by `mrc-xdp stats/status/qps` and metrics;
    removed at close); None: never.
    """

    def __init__(self, instance: str, netns: str | None = None, *, mtu: int | None = None,
                 publish: float | None = 1.0, **cc_params):
        ffi, lib = _engine()
        self._e = None
        self._pub = None
        unknown = set(cc_params) - set(_OPT_NAMES)
        if unknown:
            raise TransportError("Endpoint: unknown option(s) %s (known: %s)" % (
                ", ".join(sorted(unknown)), ", ".join(_OPT_NAMES)))
        try:
            inst = maps.Instance(instance)
        except maps.NotLoaded as e:
            raise TransportError(str(e)) from None
        self.instance = instance
        try:
            self.netns = netns if netns is not None else inst.state.get("netns")
            from mrc_xdp.datapath.shared import from_bytes
            c = from_bytes("struct mrc_config", inst.map("mrc_cfg").lookup(0))
            self.local_addr = str(ipaddress.IPv6Address(bytes(c.local_addr)))
            app_mac, fab_mac, udp_port = bytes(c.app_mac), bytes(c.fab_mac), int(c.udp_port)
            dscp_data, dscp_ctrl = int(c.dscp_data), int(c.dscp_ctrl)
        finally:
            inst.close()
        from mrc_xdp.transport import conns
        conns.reap(instance)          # connections of endpoints that died without closing
        self.dev = inst.state.get("app_dev", "mrc0")
        dev_mtu = _dev_mtu(self.netns, self.dev)
        ts = cc_params.get("timestamps") == 1
        overhead = DATA_OVERHEAD + (TSETH_LEN if ts else 0)
        sg = int(cc_params.get("sg", SG_AUTO))
        if mtu is None:
            # the path's largest, at most 4096; one frame's worth with multi-buffer off.  With
            # sg auto the engine falls back to one frame's worth if the kernel refuses it
            mtu = default_payload(dev_mtu - overhead + DATA_OVERHEAD,
                                  single_frame_payload(ts) if sg == SG_OFF else IB_PAYLOAD)
        elif mtu > single_frame_payload(ts) and "sg" not in cc_params:
            cc_params["sg"] = SG_ON      # asked for: multi-buffer, or a clear error
        if mtu <= 0 or mtu % 4 or mtu + overhead > dev_mtu:
            raise TransportError("mtu %d: the payload must be a positive multiple of 4 and at most "
                                 "%d (%s MTU %d minus %d bytes of headers)" % (
                                     mtu, dev_mtu - overhead, self.dev, dev_mtu, overhead))
        self.payload = mtu
        o = ffi.new("struct mrc_eng_opts *")
        o.ifname = self.dev.encode()
        o.queue = 0
        o.local_addr = ipaddress.IPv6Address(self.local_addr).packed
        o.src_mac = app_mac
        o.dst_mac = fab_mac
        o.udp_port = udp_port
        o.payload = mtu
        o.dscp_data = dscp_data
        o.dscp_ctrl = dscp_ctrl
        for k, v in cc_params.items():
            setattr(o, k, check_spin_us(v) if k == "spin_us" else int(v))
        pin = os.path.join(maps.pin_dir(instance), XSKMAP)
        try:
            xfd = bpfsys.obj_get(pin)
        except OSError as e:
            raise TransportError("%s: %s: load the datapath (mrc-xdp load)" % (pin, e)) from None
        o.xsks_fd = xfd
        err = ffi.new("char[]", 256)
        try:
            with _netns.enter(self.netns):
                self._e = lib.mrc_eng_open(o, err, 256)
        finally:
            os.close(xfd)
        if self._e == ffi.NULL:
            self._e = None
            raise TransportError(ffi.string(err).decode(errors="replace"))
        lib.mrc_eng_get_opts(self._e, o)
        self.payload = int(o.payload)      # the single-buffer fallback may have lowered it
        self._umem = None
        if int(o.umem_mr):
            a, n = ffi.new("uint64_t *"), ffi.new("uint64_t *")
            lib.mrc_eng_umem_mr(self._e, a, n)
            self._umem = _UmemSpace(int(a[0]), int(n[0]))
        self._qps: dict[int, QP] = {}
        self._mrs: list[MR] = []
        self.cq = CQ(self)
        if publish:
            self._pub = _Publisher(self, publish)

    def reg_mr(self, buf, access: int = ACCESS_LOCAL | ACCESS_REMOTE_WRITE) -> MR:
        """Register bytes/bytearray/numpy/mmap memory; the engine reads and writes it in
        place (keep the buffer alive and unresized while registered)."""
        self._alive()
        mr = MR(self, buf, access)
        self._mrs.append(mr)
        return mr

    def alloc_mr(self, size: int, access: int = ACCESS_LOCAL | ACCESS_REMOTE_WRITE) -> "MR":
        """A memory region inside the UMEM (Endpoint(umem_mr=BYTES) sets its space aside):
        Writes from it go without the engine's copy (the packet's payload descriptors point
        at it).  mr.buf is its memory (a writable memoryview); it stays valid while the MR
        or the endpoint's space is referenced.  Its space returns at dereg."""
        ffi, _ = _engine()
        self._alive()
        if self._umem is None:
            raise TransportError("alloc_mr: no memory-region space in the UMEM: open the "
                                 "Endpoint with umem_mr=BYTES")
        off = self._umem.alloc(size)
        buf = ffi.buffer(ffi.cast("uint8_t *", self._umem.addr + off), size)
        try:
            mr = MR(self, buf, access)
        except TransportError:
            self._umem.free(off, size)
            raise
        mr._umem, mr._umem_off = self._umem, off
        self._mrs.append(mr)
        return mr

    def create_qp(self, qpn: int | None = None, start_psn: int | None = None) -> QP:
        """A new QP (qpn: a fixed local QPN, e.g. one the datapath config lists)."""
        self._alive()
        qp = QP(self, qpn, start_psn)
        self._qps[qp.qpn] = qp
        return qp

    def stats(self) -> dict:
        """Endpoint counters: rx frames, bad icrc/qpn/rkey, out-of-window, truncated,
        duplicates, tx ring full, ... (struct mrc_eng_stats)."""
        ffi, lib = _engine()
        self._alive()
        st = ffi.new("struct mrc_eng_stats *")
        lib.mrc_eng_stats(self._e, st)
        d = _struct_dict(ffi, st)
        d["payload"] = self.payload
        return d

    def _rx_inject(self, descs) -> int:
        """Tests: run (bytes, contd) descriptors through the engine's receive path as one RX
        batch (contd: XDP_PKT_CONTD, the packet goes on in the next one).  Returns the
        descriptors consumed."""
        ffi, lib = _engine()
        self._alive()
        bufs = [ffi.from_buffer(bytearray(b)) for b, _ in descs]
        ptrs = ffi.new("uint8_t *[]", [ffi.cast("uint8_t *", b) for b in bufs])
        lens = ffi.new("uint32_t[]", [len(b) for b, _ in descs])
        opts = ffi.new("uint32_t[]", [lib.MRC_ENG_PKT_CONTD if c else 0 for _, c in descs])
        return _check(lib.mrc_eng_rx_inject(self._e, ptrs, lens, opts, len(descs)), "rx_inject")

    @property
    def path(self) -> str:
        """Which receive/send path the socket took: "multi-buffer" (bound with XDP_USE_SG,
        a packet over several UMEM frames) or "single-buffer", with why."""
        st = self.stats()
        if st["sg"]:
            return "multi-buffer (XDP_USE_SG, %d frames per packet on TX, %d on RX, payload %d)" % (
                st["tx_frames_pkt"], st["rx_frames_pkt"], self.payload)
        why = " (the kernel refused XDP_USE_SG: %s)" % os.strerror(st["sg_refused"]) if st["sg_refused"] else ""
        return "single-buffer%s, payload %d" % (why, self.payload)

    def options(self) -> dict:
        """The engine options in force (defaults filled in)."""
        ffi, lib = _engine()
        self._alive()
        o = ffi.new("struct mrc_eng_opts *")
        lib.mrc_eng_get_opts(self._e, o)
        d = {k: getattr(o, k) for k in _OPT_NAMES + ("payload",)}
        d["spin_us"] = 0 if d["spin_us"] == SPIN_OFF else d["spin_us"]
        return d

    def _alive(self):
        if self._e is None:
            raise TransportError("endpoint on %s is closed" % self.instance)

    def publish(self) -> None:
        """Write this endpoint's per-QP counters now (see published_qps); the endpoint
        also does so every `publish` seconds (Endpoint(..., publish=None): never)."""
        if self._pub:
            self._pub.write()

    def qp_stats(self) -> list[dict]:
        """stats() of every QP of this endpoint."""
        out = []
        for qp in list(self._qps.values()):
            try:
                out.append(qp.stats())
            except TransportError:      # destroyed meanwhile
                pass
        return out

    def close(self) -> None:
        """Stop the progress thread and free the socket, UMEM and QPs."""
        if self._pub:
            self._pub.stop()
            self._pub = None
        if self._e is None:
            return
        qps = list(self._qps.values())
        for qp in qps:
            qp._destroyed = True
        self._qps.clear()
        for mr in self._mrs:
            mr.registered = False
        e, self._e = self._e, None
        _engine()[1].mrc_eng_close(e)
        if getattr(self, "_umem", None) is not None:
            self._umem.closed = True
        for mr in self._mrs:        # the progress thread is gone: nothing reads or writes them
            mr._release()
        self._mrs.clear()
        _drop_conns(self.instance, qps)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ------------------------------------------------------------------ per-QP counters for other processes

QP_STATS_DIR = "/run/mrc-xdp/qps"
_pub_seq = iter(range(1 << 62))


class _Publisher:
    """Write the endpoint's per-QP engine counters to
    /run/mrc-xdp/qps/<instance>/<pid>.<n>.json (atomically) every `interval` seconds, so
    `mrc-xdp stats/status/qps` and the metrics endpoint of another process see every
    Endpoint user; the file goes at close, and readers ignore (and remove) files whose
    process is gone.  One daemon thread per process serves every endpoint (it sleeps in
    between and exits with the last endpoint)."""

    _mu = threading.Lock()
    _all: set = set()
    _thread = None
    _wake = threading.Event()

    def __init__(self, ep: Endpoint, interval: float):
        self.ep, self.interval = ep, max(0.05, float(interval))
        self.dir = os.path.join(QP_STATS_DIR, ep.instance)
        self.path = os.path.join(self.dir, "%d.%d.json" % (os.getpid(), next(_pub_seq)))
        self.cmd = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
        self.due = 0.0
        self.closed = False
        self._wmu = threading.Lock()
        try:
            self.write()
        except OSError:
            pass
        cls = _Publisher
        with cls._mu:
            cls._all.add(self)
            if cls._thread is None:
                cls._wake.clear()
                cls._thread = threading.Thread(target=cls._run, daemon=True, name="mrc-qp-publish")
                cls._thread.start()

    def write(self) -> None:
        with self._wmu:
            if self.closed or self.ep._e is None:
                return
            doc = {"instance": self.ep.instance, "pid": os.getpid(), "cmd": self.cmd,
                   "time": time.time(), "qps": self.ep.qp_stats(), "path": self.ep.path}
            os.makedirs(self.dir, exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)
            self.due = time.monotonic() + self.interval

    @classmethod
    def _run(cls) -> None:
        while True:
            with cls._mu:
                pubs = list(cls._all)
                if not pubs:
                    cls._thread = None
                    return
            now = time.monotonic()
            for p in pubs:
                if now >= p.due:
                    try:
                        p.write()
                    except (OSError, RuntimeError, TransportError):
                        pass
            nxt = min((p.due for p in pubs), default=now + 1.0)
            cls._wake.wait(max(0.01, nxt - time.monotonic()))
            cls._wake.clear()

    def stop(self) -> None:
        cls = _Publisher
        with self._wmu:         # no write in progress once this returns
            self.closed = True
            for p in (self.path, self.path + ".tmp"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            _rmdir_if_empty(self.dir)
        with cls._mu:
            cls._all.discard(self)
            t = cls._thread if not cls._all else None
        if t is not None and t is not threading.current_thread():
            cls._wake.set()
            t.join(5)


def _rmdir_if_empty(d: str) -> None:
    """Remove an instance's publish directory once no endpoint file is left in it (a
    publisher that recreates it meanwhile retries its write at its next interval)."""
    try:
        os.rmdir(d)
    except OSError:
        pass


def published_qps(instance: str | None = None) -> list[dict]:
    """Per-QP counters published by the live Endpoints of every process (of one
    instance, or all): [{qpn, state_name, tx_pkts, ..., instance, pid, cmd, age_s}].
    Files of processes that are gone are removed."""
    out = []
    try:
        insts = [instance] if instance is not None else sorted(os.listdir(QP_STATS_DIR))
    except FileNotFoundError:
        return out
    for inst in insts:
        d = os.path.join(QP_STATS_DIR, inst)
        try:
            names = sorted(os.listdir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for n in names:
            if not n.endswith(".json"):
                continue
            path = os.path.join(d, n)
            try:
                pid = int(n.split(".")[0])
            except ValueError:
                continue
            if not os.path.exists("/proc/%d" % pid):
                try:
                    os.unlink(path)
                except OSError:
                    pass
                continue
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            for q in doc.get("qps", []):
                out.append(dict(q, instance=doc.get("instance", inst), pid=pid, cmd=doc.get("cmd", ""),
                                age_s=round(time.time() - doc.get("time", 0), 1),
                                engine_path=doc.get("path", "")))
        _rmdir_if_empty(d)
    return out


def icrc(ip6: bytes, fast: bool | None = None) -> int:
    """The engine's ICRC of an IPv6 RoCEv2 packet without its trailer (as wire.icrc).
    fast None: as the engine computes it; True: the PCLMULQDQ fold (when the CPU has
    it); False: zlib alone."""
    ffi, lib = _engine()
    if fast is None:
        return int(lib.mrc_eng_icrc(ffi.from_buffer(ip6), len(ip6)))
    return int(lib.mrc_eng_icrc2(ffi.from_buffer(ip6), len(ip6), int(fast)))
