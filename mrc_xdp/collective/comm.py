"""A communicator: collectives among world_size ranks over the MRC transport engine.

One rank per datapath instance, as an MRC NIC serves one GPU.  At start every rank opens
an Endpoint on its instance, creates one QP per peer (a full mesh: a handful of QPs for
the world sizes a lab has), registers one staging buffer per peer for what that peer
sends it, and publishes the QP attributes and the staging buffer (address, length,
R_Key) in the store; then it connects to every peer's QP.  After that the store is not
used again: every byte of every collective is an RDMA Write-with-Immediate.

Streams.  Between each ordered pair of ranks there is one stream of chunks.  Chunk i of
the stream i -> j is written into slot i mod ``slots`` of j's staging buffer for i, with
an immediate that names it: bit 31 clear, bits 30-24 a signature of the collective
(kind, element type, element count, operation), bits 23-0 the chunk's id within the
collective.  The receiver takes the chunks in stream order (Write-with-Immediate
completes in message order, so slot = chunk number mod slots on both sides), checks
signature, id and length (a rank that called a different collective, another size or
another type is an error naming it, never a wrong result), uses the slot, and gives it
back with a zero-length Write-with-Immediate whose immediate has bit 31 set (a credit).  A sender never has more than ``slots`` chunks a peer has not given back.

Algorithms.  all_reduce is a ring (reduce-scatter then all-gather, 2(n-1) steps over the
ring rank -> rank+1), each step's segment cut into chunks of ``chunk_bytes`` and
pipelined: chunk k of step t+1 leaves as soon as chunk k of step t has arrived and been
reduced, so the ring's links are busy together.  all_gather and reduce_scatter are the
two halves, broadcast a pipelined chain from the root along the ring, barrier an
all_reduce of one int32, send/recv one stream.  Reductions are numpy on whole chunks.

Failures.  A QP that goes to error (its retry limit exhausted), or a peer that sends
nothing for ``timeout`` seconds, ends the collective with a CollectiveError naming the
peer rank and its QP's state and counters; the communicator is then unusable.
"""
from __future__ import annotations

import json
import math
import time
import zlib
from collections import deque

import numpy as np

from mrc_xdp import transport
from mrc_xdp.collective.reduce import ReduceOp, divide, dtype_name, reduce_into

CREDIT = 1 << 31


class CollectiveError(RuntimeError):
    """A collective failed; the message names the rank, the peer and what happened."""


CID_MASK = (1 << 24) - 1
# the engine's RTO ceiling and its default retry limit (engine.h): a QP errors after
# retry_limit RTO expiries in a row, the RTO doubling up to the ceiling
ENGINE_RTO_MAX_S = 0.5
ENGINE_RETRY_LIMIT = 12


def retry_limit_for(timeout: float, rto_max_s: float = ENGINE_RTO_MAX_S) -> int:
    """The QP retry limit whose RTO expiries in a row last at least `timeout` seconds.

    The engine's default (12 expiries, RTO 1 ms doubling to 500 ms: about 2.5 s) would
    error a QP, and with it the job, long before the collective timeout an operator sets
    (as NCCL operators set NCCL_IB_TIMEOUT and NCCL_IB_RETRY_CNT so that the IB
    transport's retries outlast a transient outage and the collective timeout decides):
    a path dead for less than the timeout never ends a collective on its own."""
    return ENGINE_RETRY_LIMIT + int(math.ceil(max(0.0, timeout) / rto_max_s))


def _signature(kind: str, dtype: str, count: int, op: str) -> int:
    return zlib.crc32(("%s/%s/%d/%s" % (kind, dtype, count, op)).encode()) & 0x7F


class Communicator:
    """rank, world_size: this rank and the number of ranks.  store: set/get/add (a
    ``StoreClient``, or torch's store through ``TorchStore``).  instance: the datapath
    instance this rank's Endpoint opens (netns: its namespace, default the instance's).
    timeout: seconds without progress before a collective fails.  chunk_bytes, slots:
    pipelining unit and chunks in flight per peer.  key: a prefix making this
    communicator's keys unique in the store (several communicators may share it).
    endpoint_opts: engine options of the Endpoint (transport.Endpoint); its QPs' retry
    limit defaults to retry_limit_for(timeout), so that the timeout, not the engine's
    retry limit, decides when a silent peer ends a collective."""

    def __init__(self, rank: int, world_size: int, store, instance: str, *, netns: str | None = None,
                 timeout: float = 300.0, chunk_bytes: int = 1 << 20, slots: int = 4, key: str = "mrc",
                 endpoint_opts: dict | None = None):
        if not 0 <= rank < world_size:
            raise CollectiveError("rank %d is outside world size %d" % (rank, world_size))
        if chunk_bytes <= 0 or chunk_bytes % 8 or slots < 1:
            raise CollectiveError("chunk_bytes must be a positive multiple of 8 and slots >= 1")
        self.rank, self.size, self.timeout = rank, world_size, float(timeout)
        self.chunk, self.slots = chunk_bytes, slots
        self._dead: str | None = None
        self._wr = 0
        self._pending: dict[int, int] = {}    # wr_id -> peer, of data writes not completed
        self._credit_wrs: set[int] = set()    # wr_ids of credits not completed
        self._store, self._key = store, key
        self.peers = [j for j in range(world_size) if j != rank]
        self.ep = None
        opts = dict(endpoint_opts or {})
        opts.setdefault("retry_limit", retry_limit_for(self.timeout))
        try:
            self.ep = transport.Endpoint(instance, netns, **opts)
            self._setup(store, key)
        except transport.TransportError as e:
            self.close()
            raise CollectiveError("rank %d: %s" % (rank, e)) from None
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up
    def _setup(self, store, key: str) -> None:
        ep, r = self.ep, self.rank
        self._stage = {j: np.zeros(self.chunk * self.slots, dtype=np.uint8) for j in self.peers}
        self._stage_mr = {j: ep.reg_mr(self._stage[j]) for j in self.peers}
        self._qp = {j: ep.create_qp() for j in self.peers}
        self._peer_of = {qp.qpn: j for j, qp in self._qp.items()}
        for j in self.peers:
            store.set("%s/qp/%d/%d" % (key, r, j), json.dumps(
                {"qp": self._qp[j].local_attrs(), "stage": self._stage_mr[j].attrs()}).encode())
        self._rstage = {}
        for j in self.peers:
            remote = json.loads(store.get("%s/qp/%d/%d" % (key, j, r)))
            self._qp[j].connect(remote["qp"])
            self._rstage[j] = remote["stage"]
        # everyone connected before anyone writes
        store.set("%s/ready/%d" % (key, r), b"1")
        for j in self.peers:
            store.get("%s/ready/%d" % (key, j))
        self._tx_seq = {j: 0 for j in self.peers}
        self._credits = {j: self.slots for j in self.peers}
        self._rx_seq = {j: 0 for j in self.peers}
        self._rx = {j: deque() for j in self.peers}

    def close(self) -> None:
        """Free the QPs, buffers and the Endpoint (its run-time datapath connections too).

        A rank that leaves takes its engine with it, and the engine is what acknowledges
        the peers' last writes: so a healthy communicator first says goodbye through the
        store and waits (at most `timeout`, 60 s) until every peer has too, i.e. until
        every peer's writes to this rank were acknowledged."""
        ep, self.ep = self.ep, None
        if ep is None:
            return
        try:
            if self._dead is None and getattr(self, "_qp", None):
                self.ep = ep
                self._drain()
                self.ep = None
                self._store.set("%s/bye/%d" % (self._key, self.rank), b"1")
                for j in self.peers:
                    self._store.get("%s/bye/%d" % (self._key, j), timeout=min(self.timeout, 60.0))
        except Exception:           # a peer gone or the store gone: leave anyway
            pass
        finally:
            self.ep = None
            ep.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    # ------------------------------------------------------------------ progress
    def _fail(self, msg: str):
        self._dead = msg
        raise CollectiveError(msg)

    def _qp_state(self, j: int) -> str:
        try:
            s = self._qp[j].stats()
        except transport.TransportError as e:
            return str(e)
        try:
            e = self.ep.stats()
        except transport.TransportError:
            e = {}
        # both directions of the QP, and what this endpoint's engine and socket dropped: a
        # stalled transfer is either lost before us (XSK drops, out of window), refused
        # (duplicates re-SACKed without progress) or acknowledged into the void
        return ("QP %#x %s (sent %d packets, %d retransmitted, %d RTO expiries in a row at most, %d unacknowledged "
                "from PSN %#x; received %d data packets (%d duplicates, every PSN below %#x), %d SACKs, "
                "%d trimmed NACKs; sent %d SACKs, %d NACKs; oldest send slot %s, %d queued for resend, "
                "in flight %d B of cwnd %d B, pacer %d us ahead; endpoint: %d out of window, %d trimmed, "
                "%d bad ICRC, XSK %d dropped, %d ring full, %d fill empty)" % (
                    s["qpn"], s["state_name"], s.get("tx_pkts", 0), s.get("rtx_pkts", 0), s.get("retries_max", 0),
                    (s.get("next_psn", 0) - s.get("una_psn", 0)) & 0xFFFFFF, s.get("una_psn", 0),
                    s.get("rx_pkts", 0), s.get("rx_dup", 0), s.get("rcv_cack", 0), s.get("sacks_rx", 0),
                    s.get("nacks_rx_trim", 0), s.get("sacks_tx", 0), s.get("nacks_tx_trim", 0),
                    transport.send_slot_name(s.get("una_state", 0)),
                    s.get("rtx_queued", 0), s.get("inflight", 0), s.get("cwnd", 0), s.get("pace_wait_ns", 0) // 1000,
                    e.get("out_of_window", 0), e.get("trimmed", 0), e.get("bad_icrc", 0), e.get("xsk_rx_dropped", 0),
                    e.get("xsk_rx_ring_full", 0), e.get("xsk_fill_empty", 0)))

    def _progress(self, wait: float) -> bool:
        """Take completions; wait up to `wait` seconds for the first.  True if any came."""
        got = self.ep.cq.poll(256)
        if not got and wait > 0:
            got = self.ep.cq.wait_blocking(wait, 256)
        for c in got:
            j = self._peer_of.get(c.qpn)
            if c.wr_id in self._credit_wrs:
                self._credit_wrs.discard(c.wr_id)
                if not c.ok:            # the peer will fail its own writes to us: say it there
                    continue
            elif not c.ok:
                self._fail("rank %d: the write %s rank %s failed (%s): %s" % (
                    self.rank, "from" if c.opcode == transport.WcOpcode.RECV_RDMA_IMM else "to",
                    j, c.status.name, self._qp_state(j) if j is not None else "unknown QP"))
            if c.opcode == transport.WcOpcode.RECV_RDMA_IMM:
                if c.imm & CREDIT:
                    self._credits[j] += 1
                else:
                    self._rx[j].append((c.imm, c.byte_len))
            else:
                self._pending.pop(c.wr_id, None)
        return bool(got)

    def _wait(self, ready, what: str, peer: int) -> None:
        """Make progress until ready() holds; fail after `timeout` s without any."""
        last = time.monotonic()
        while not ready():
            if self._progress(0.05):
                last = time.monotonic()
            elif time.monotonic() - last > self.timeout:
                self._fail("rank %d: nothing from rank %d for %.0f s while %s: %s" % (
                    self.rank, peer, self.timeout, what, self._qp_state(peer)))

    def _post(self, j: int, mr, off: int, length: int, raddr: int, rkey: int, imm: int) -> int:
        self._wr += 1
        try:
            self._qp[j].post_write(self._wr, mr, off, length, raddr, rkey, imm=imm)
        except transport.TransportError as e:
            self._fail("rank %d: to rank %d: %s: %s" % (self.rank, j, e, self._qp_state(j)))
        # a collective waits for its data writes; a credit is the peer's business (if the
        # peer has left, its credit can never be acknowledged: that is no error of ours)
        if imm & CREDIT:
            self._credit_wrs.add(self._wr)
        else:
            self._pending[self._wr] = j
        return self._wr

    # ------------------------------------------------------------------ streams
    def _can_send(self, j: int) -> bool:
        self._progress(0)
        return self._credits[j] > 0

    def _send_chunk(self, j: int, mr, off: int, length: int, sig: int, cid: int) -> int:
        """mr[off:off+length] to j's next slot as chunk `cid` (the caller checked a credit)."""
        seq = self._tx_seq[j]
        self._tx_seq[j] = seq + 1
        self._credits[j] -= 1
        rs = self._rstage[j]
        slot = seq % self.slots
        return self._post(j, mr, off, length, rs["addr"] + slot * self.chunk, rs["rkey"],
                          (sig << 24) | (cid & CID_MASK))

    def _has_chunk(self, j: int) -> bool:
        self._progress(0)
        return bool(self._rx[j])

    def _take_chunk(self, j: int, sig: int, length_of) -> tuple[int, np.ndarray]:
        """The next chunk from j: (its id, a uint8 view of its slot), checked against
        length_of(id) (None: no such chunk in this collective); give the slot back with
        _release(j) once used."""
        imm, got = self._rx[j].popleft()
        seq = self._rx_seq[j]
        self._rx_seq[j] = seq + 1
        cid, their = imm & CID_MASK, (imm >> 24) & 0x7F
        want = length_of(cid) if their == sig else None
        if want is None or got != want:
            self._fail("rank %d: rank %d called a different collective (its chunk %d: %d bytes, signature "
                       "%#x; this rank's signature %#x, %s bytes): sizes, types or operations differ "
                       "across ranks" % (self.rank, j, cid, got, their, sig, want))
        slot = seq % self.slots
        return cid, self._stage[j][slot * self.chunk: slot * self.chunk + got]

    def _release(self, j: int) -> None:
        rs = self._rstage[j]
        self._post(j, self._stage_mr[j], 0, 0, rs["addr"], rs["rkey"], CREDIT)

    def _drain(self) -> None:
        """Wait until every write this rank posted has completed."""
        if self._pending:           # named by the peer of the oldest write still pending
            self._wait(lambda: not self._pending, "finishing its writes to it", self._pending[min(self._pending)])

    # ------------------------------------------------------------------ arrays
    def _check(self, arr, name: str) -> np.ndarray:
        if self._dead:
            raise CollectiveError("communicator unusable after an earlier failure: %s" % self._dead)
        if self.ep is None:
            raise CollectiveError("communicator is closed")
        if not isinstance(arr, np.ndarray):
            raise CollectiveError("%s: expected a numpy array, got %s" % (name, type(arr).__name__))
        if not arr.flags.c_contiguous:
            raise CollectiveError("%s: the array is not contiguous (pass np.ascontiguousarray(a) and copy "
                                  "the result back)" % name)
        if not arr.flags.writeable:
            raise CollectiveError("%s: the array is read-only" % name)
        return arr.reshape(-1)

    @staticmethod
    def _op(op) -> ReduceOp:
        try:
            return ReduceOp.of(op)
        except ValueError as e:
            raise CollectiveError(str(e)) from None

    def _dtype(self, flat: np.ndarray, dtype: str | None) -> str:
        try:
            return dtype_name(flat, dtype)
        except ValueError as e:
            raise CollectiveError(str(e)) from None

    # ------------------------------------------------------------------ the ring
    def _ring(self, flat: np.ndarray, dtype: str, op: ReduceOp | None, sig: int,
              seg_of, nsteps: int, shift: int) -> None:
        """Ring steps t = 0..nsteps-1 over `flat` (1-D): at step t this rank sends segment
        (rank - t + shift) mod n to rank+1 and takes segment (rank - t - 1 + shift) mod n
        from rank-1, reducing it into flat while t < n-1 and op is given, else copying it.
        seg_of(i) = (start, count) in elements.  Each segment is cut into columns of
        chunk_bytes; chunk (t, k) leaves once chunk (t-1, k) has been taken, so every
        column moves through the ring on its own and the steps overlap."""
        n, r = self.size, self.rank
        right, left = (r + 1) % n, (r - 1) % n
        isz = flat.itemsize
        per = max(1, self.chunk // isz)             # elements per chunk
        segs = [seg_of(i) for i in range(n)]
        K = max(1, max((c + per - 1) // per for _, c in segs))
        if nsteps * K > CID_MASK:
            raise CollectiveError("%d elements are too many chunks for one collective: raise chunk_bytes"
                                  % flat.size)

        def piece(t: int, k: int, sending: bool):
            s0, cnt = segs[(r - t + shift - (0 if sending else 1)) % n]
            a = min(cnt, k * per)
            return s0 + a, min(cnt, a + per) - a

        def in_len(cid: int):
            t, k = divmod(cid, K)
            if t >= nsteps or t != taken[k]:
                return None
            return piece(t, k, False)[1] * isz

        sent = [0] * K              # per column: steps sent (or skipped: empty piece)
        taken = [0] * K             # per column: steps taken
        reading = {}                # (t, k) -> wr_id of the send reading that piece
        raw = flat.view(np.uint8)
        mr = self.ep.reg_mr(raw, transport.ACCESS_LOCAL)

        def skip_empty(k: int) -> None:          # an empty piece is never sent: nothing to take
            while taken[k] < nsteps and piece(taken[k], k, False)[1] == 0:
                taken[k] += 1

        try:
            for k in range(K):
                skip_empty(k)
            last = time.monotonic()
            while min(taken) < nsteps or min(sent) < nsteps:
                moved = False
                for k in range(K):                   # sends whose input is there
                    while sent[k] < nsteps and taken[k] >= sent[k]:
                        t = sent[k]
                        start, cnt = piece(t, k, True)
                        if cnt:
                            if self._credits[right] <= 0:
                                break
                            reading[(t, k)] = self._send_chunk(right, mr, start * isz, cnt * isz,
                                                               sig, t * K + k)
                        sent[k] += 1
                        moved = True
                        skip_empty(k)
                self._progress(0)
                # chunks that arrived, in stream order; what follows the last one this
                # collective expects belongs to the next collective
                while self._rx[left] and min(taken) < nsteps:
                    cid, chunk = self._take_chunk(left, sig, in_len)
                    t, k = divmod(cid, K)
                    start, cnt = piece(t, k, False)
                    # the piece we overwrite was sent by us at step t+1-n: let that send finish
                    w = reading.pop((t + 1 - n, k), None)
                    if w is not None and w in self._pending:
                        self._wait(lambda: w not in self._pending, "sending", right)
                    dst = flat[start:start + cnt]
                    if op is not None and t < n - 1:
                        reduce_into(dst, chunk.view(flat.dtype), op, dtype)
                    else:
                        np.copyto(dst, chunk.view(flat.dtype))
                    self._release(left)
                    taken[k] += 1
                    skip_empty(k)
                    moved = True
                if moved:
                    last = time.monotonic()
                elif self._progress(0.05):
                    last = time.monotonic()
                elif time.monotonic() - last > self.timeout:
                    self._fail("rank %d: nothing from rank %d for %.0f s in a ring step: %s"
                               % (r, left, self.timeout, self._qp_state(left)))
            self._drain()
        finally:
            mr.dereg()

    @staticmethod
    def _split(count: int, n: int):
        """Segment i of n over count elements: (start, count), the first count % n one longer."""
        q, rem = divmod(count, n)
        return lambda i: (i * q + min(i, rem), q + (1 if i < rem else 0))

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, arr: np.ndarray, op="sum", dtype: str | None = None) -> np.ndarray:
        """arr = op over every rank's arr, in place (and returned)."""
        flat = self._check(arr, "all_reduce")
        dt, rop = self._dtype(flat, dtype), self._op(op)
        n = self.size
        if n > 1 and flat.size:
            sig = _signature("all_reduce", dt, flat.size, rop.value)
            self._ring(flat, dt, rop, sig, self._split(flat.size, n), 2 * (n - 1), 0)
        if rop is ReduceOp.AVG and n > 1:
            divide(flat, n, dt)
        return arr

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op="sum", dtype: str | None = None) -> np.ndarray:
        """out = segment `rank` of op over every rank's inp; inp has world_size * out.size
        elements (not modified)."""
        o, i = self._check(out, "reduce_scatter out"), self._check(inp, "reduce_scatter in")
        dt, rop = self._dtype(i, dtype), self._op(op)
        if self._dtype(o, dtype) != dt or i.size != o.size * self.size:
            raise CollectiveError("reduce_scatter: in must be world_size (%d) x out's elements of the same "
                                  "type (in %d %s, out %d %s)" % (self.size, i.size, i.dtype, o.size, o.dtype))
        work = i.copy()
        n = self.size
        if n > 1 and o.size:
            sig = _signature("reduce_scatter", dt, i.size, rop.value)
            # shift -1: after n-1 steps this rank holds segment `rank` (not rank+1)
            self._ring(work, dt, rop, sig, lambda s: (s * o.size, o.size), n - 1, -1)
        np.copyto(o, work[self.rank * o.size:(self.rank + 1) * o.size])
        if rop is ReduceOp.AVG and n > 1:
            divide(o, n, dt)
        return out

    def all_gather(self, out: np.ndarray, inp: np.ndarray, dtype: str | None = None) -> np.ndarray:
        """out = every rank's inp, concatenated by rank; out has world_size * inp.size elements."""
        o, i = self._check(out, "all_gather out"), self._check(inp, "all_gather in")
        dt = self._dtype(i, dtype)
        if self._dtype(o, dtype) != dt or o.size != i.size * self.size:
            raise CollectiveError("all_gather: out must be world_size (%d) x in's elements of the same "
                                  "type (in %d %s, out %d %s)" % (self.size, i.size, i.dtype, o.size, o.dtype))
        m, n = i.size, self.size
        np.copyto(o[self.rank * m:(self.rank + 1) * m], i)
        if n > 1 and m:
            sig = _signature("all_gather", dt, o.size, "-")
            # the all-reduce ring's second half: step 0 sends this rank's own segment
            self._ring(o, dt, None, sig, lambda s: (s * m, m), n - 1, 0)
        return out

    def broadcast(self, arr: np.ndarray, root: int = 0, dtype: str | None = None) -> np.ndarray:
        """arr = root's arr on every rank: a pipelined chain root -> root+1 -> ..."""
        flat = self._check(arr, "broadcast")
        if not 0 <= root < self.size:
            raise CollectiveError("broadcast: root %d is outside world size %d" % (root, self.size))
        dt = self._dtype(flat, dtype)
        n, r = self.size, self.rank
        if n == 1 or not flat.size:
            return arr
        sig = _signature("broadcast", dt, flat.size, str(root))
        right, left = (r + 1) % n, (r - 1) % n
        last_in_chain = right == root
        raw = flat.view(np.uint8)
        mr = self.ep.reg_mr(raw, transport.ACCESS_LOCAL)
        try:
            for c, off in enumerate(range(0, raw.size, self.chunk)):
                ln = min(self.chunk, raw.size - off)
                if r != root:
                    self._wait(lambda: self._has_chunk(left), "receiving a broadcast", left)
                    _, got = self._take_chunk(left, sig, lambda cid: ln if cid == c & CID_MASK else None)
                    np.copyto(raw[off:off + ln], got)
                    self._release(left)
                if not last_in_chain:
                    self._wait(lambda: self._can_send(right), "broadcasting", right)
                    self._send_chunk(right, mr, off, ln, sig, c)
            self._drain()
        finally:
            mr.dereg()
        return arr

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        self.all_reduce(np.zeros(1, dtype=np.int32))

    def send(self, arr: np.ndarray, dst: int, dtype: str | None = None) -> None:
        """arr to rank dst, which calls recv() with an array of the same size and type."""
        self._p2p(arr, dst, dtype, sending=True)

    def recv(self, arr: np.ndarray, src: int, dtype: str | None = None) -> np.ndarray:
        """arr = what rank src send()s."""
        self._p2p(arr, src, dtype, sending=False)
        return arr

    def _p2p(self, arr, peer: int, dtype, sending: bool) -> None:
        flat = self._check(arr, "send" if sending else "recv")
        if peer == self.rank or not 0 <= peer < self.size:
            raise CollectiveError("%s: peer %d is not another rank of %d" % (
                "send" if sending else "recv", peer, self.size))
        dt = self._dtype(flat, dtype)
        sig = _signature("p2p", dt, flat.size, "-")
        raw = flat.view(np.uint8)
        mr = self.ep.reg_mr(raw, transport.ACCESS_LOCAL) if sending else None
        try:
            for c, off in enumerate(range(0, raw.size, self.chunk)):
                ln = min(self.chunk, raw.size - off)
                if sending:
                    self._wait(lambda: self._can_send(peer), "sending", peer)
                    self._send_chunk(peer, mr, off, ln, sig, c)
                else:
                    self._wait(lambda: self._has_chunk(peer), "receiving", peer)
                    _, got = self._take_chunk(peer, sig, lambda cid: ln if cid == c & CID_MASK else None)
                    np.copyto(raw[off:off + ln], got)
                    self._release(peer)
            self._drain()
        finally:
            if mr is not None:
                mr.dereg()
