"""Path health daemon (``mrc-xdp daemon``): probing, resurrection, plane link state and
the event hub, for every datapath instance on the host.

The datapath retires an EV within one feedback packet; this closes the loop from user
space, with all state in the pinned maps (a killed daemon restarted resumes):

- **Resurrection.** ASSUMED_BAD EVs are probed every ``probe.interval_ms`` (jittered,
  backing off while the EV stays bad, up to ``probe.backoff_max_ms``); after
  ``probe.ok_needed`` consecutive answered probes the EV is set GOOD with reason
  PROBE_OK (``maps.set_ev_state``).  DENIED EVs are never probed.
- **Background probes.** ``probe.background_per_s`` probes per second per instance
  visit GOOD EVs (active and backup) in turn; their RTT is recorded per EV (last and
  smoothed, served to ``mrc-xdp top``); ``probe.background_fail`` consecutive unanswered
  probes retire a GOOD EV before data is sent over it.
- **Busy instances are left to their feedback.** While an instance's spray is sending
  data or feedback for an engine (spray's data and control counters, less our probes,
  moved in the last ``BUSY_S``), it gets no background probes (a sender's SACKs test
  every EV it sprays on, and the datapath retires a dead one within a feedback packet),
  and its retired EVs are probed at most one every ``BUSY_PROBE_S`` per instance, so
  they still come back, in turn.  Why (issue 19, measured on the lab): every probe is
  a frame written into the instance's mrc0 from the daemon's thread, and 20-80 such
  frames a second during a large transfer (even frames spray passes as not MRC) made
  the engine's packets leave in bursts that the link models marked and trimmed and
  that arrived reordered past the datapath's 32-PSN loss rule: 12-24 live EVs of 24
  retired with no fault at all; with a T1 failed the set then ran empty and spray's
  last resort sent on the dead EVs (11,000-70,000 packets resent where 700-2,700
  without the daemon).  A CPU hog of the daemon's size did nothing of the kind; our
  reading (not proven) is that the frame's transmit on the veth runs mrc0p's NAPI, and
  every hop after it, on the daemon's CPU instead of inline with the engine's sends.
- **Run-time connections** (``mrc_xdp.transport.conns``, e.g. a ``send``'s QP) are followed: the
  instance's state file is re-read when it changes, so their EVs are probed and
  resurrected like those of the configured connections.
- **Plane links.** The plane NICs' link state is followed over netlink in the
  instance's namespace.  A NIC that goes down (not IFF_UP or no carrier) takes its
  plane out of rotation: the daemon sets MRC_PF_DOWN in the plane's mrc_planes entry
  (``maps.Instance.set_plane_down``), spray then passes the plane's turns to the planes
  that are up, which share the traffic equally, and publishes a link event (reason
  LINK_DOWN; LINK_UP when the NIC is up again and the flag is cleared).  EV states are
  left alone: link state is not EV health.  EVs of a plane that is down are not probed
  (neither resurrection nor background probes).  The flag is re-checked against the
  link every second, so a reload (flags 0) or a daemon restart converges.
- **Planes an operator drained** (``mrc-xdp plane out``: MRC_PF_ADMIN, which only the
  operator writes) are left alone as well: no background or resurrection probes of
  their EVs and no EV state changed on them, so a drained plane carries nothing at all
  (a plane is drained to work on it: probes failing there would retire EVs, probes
  answered would resurrect them, neither is news).  The flags are re-read every
  ``ROWS_S``; after ``plane in`` probing resumes where it was.
- **EV states** are re-read (one map lookup per configured slot) when the instance's
  ring had an event since the last read, at most every ``ROWS_S``: every change of an EV
  state, the datapath's and those made through ``mrc_evop`` (the daemon's, an operator's
  deny), writes one.  Without events they are re-read every ``ROWS_IDLE_S``, which
  catches what no event announces (connections added at run time, an instance loaded
  without ``mrc_evop``, events lost to a full ring).  Re-reading every ``ROWS_S``
  regardless was most of the daemon's CPU (1,300 lookups a second for one connection).
- **Events.** The daemon is the single consumer of every instance's ``mrc_events``
  ring; events (and the daemon's own changes, ``"source": "daemon"``) go to a bounded
  history and to any number of subscribers on a unix socket (default
  /run/mrc-xdp/events.sock, or $MRC_XDP_DAEMON_SOCKET), one JSON object per line.
  Clients are served by a thread of their own that never blocks: a subscriber that
  falls behind is disconnected, never waited for (``EventHub``).

Probes go through a *prober*: any object with ``probe(instance, conn, ev, count,
timeout) -> list[rtt_seconds | None]`` (``load_prober`` finds the datapath's in
``mrc_xdp.health.probe``).  Without one the daemon still follows links and serves events,
and says that probing is off.

Socket protocol: the client sends one JSON line, the daemon answers in JSON lines.
``{"op": "events", "instance": NAME|null, "history": N|null, "follow": bool}``: the last N
(all) stored events of NAME (every instance), then, with follow, every new one.
``{"op": "status"}``: one object: instances, plane links, per-EV probe results.
A request that is not one such line (too long, nested, not JSON) is answered with one
line ``{"error": ...}``.
"""
from __future__ import annotations

import collections
import fnmatch
import json
import os
import random
import select
import selectors
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mrc_xdp.datapath import bpfsys, maps, netns
from mrc_xdp.transport import conns
from mrc_xdp.datapath.shared import Ctr, EvReason, EvState, const, ffi

DEFAULT_SOCKET = "/run/mrc-xdp/events.sock"
SOCKET_ENV = "MRC_XDP_DAEMON_SOCKET"
DEFAULT_CONFIG = "/etc/mrc-xdp/daemon.toml"

LINK_DOWN, LINK_UP = EvReason.LINK_DOWN, EvReason.LINK_UP       # plane link events
PROBE_FAIL = EvReason.PROBE_FAIL                                    # background probes lost
TICK = 0.02                 # main loop: ring polls, due probes
ROWS_S = 0.05               # EV states re-read at most this often per instance (after an event) ...
ROWS_IDLE_S = 1.0           # ... and at least this often (module docstring)
RESCAN_S = 1.0              # new/removed instances, link resync
BUSY_S = 0.2                # an instance whose spray sent data this recently is busy ...
BUSY_PROBE_S = 0.2          # ... and gets at most one probe per this long (module docstring)

IFF_UP, IFF_RUNNING = 0x1, 0x40
PF_ADMIN = const("MRC_PF_ADMIN")     # mrc_plane.flags: drained by the operator (`plane out`)


class HealthError(RuntimeError):
    """One line for the user."""


def socket_path(path: str | None = None) -> str:
    return path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


# ---------------------------------------------------------------- configuration

@dataclass
class HealthConfig:
    socket: str = ""
    instances: list = field(default_factory=lambda: ["*"])
    history: int = 4096
    interval_ms: int = 100          # ASSUMED_BAD EVs: probe period
    ok_needed: int = 3              # consecutive answers to resurrect
    timeout_ms: int = 50            # one probe's answer
    backoff_max_ms: int = 1000      # period cap while an EV stays bad
    jitter_pct: int = 20            # +- on every period
    background_per_s: int = 20      # per instance, over GOOD EVs
    background_fail: int = 3        # consecutive unanswered: retire a GOOD EV
    follow_links: bool = True
    workers: int = 4                # probes in flight at once

    KEYS = {"socket", "instances", "history", "probe", "links"}
    PROBE_KEYS = {"interval_ms", "ok_needed", "timeout_ms", "backoff_max_ms", "jitter_pct",
                  "background_per_s", "background_fail", "workers"}

    @classmethod
    def from_dict(cls, d: dict, source: str = "daemon config") -> "HealthConfig":
        from mrc_xdp.datapath import validate as V
        E = HealthError
        V.no_unknown_keys(d, cls.KEYS, source, E)
        c = cls()
        if "socket" in d:
            c.socket = V.string(d["socket"], "socket", E, maxlen=100)
            if not c.socket.startswith("/"):
                raise E("socket: %s must be an absolute path" % V.show(c.socket))
        if "instances" in d:
            v = d["instances"]
            if not isinstance(v, list) or not v:
                raise E("instances: expected a non-empty list of names or globs, got %s" % V.show(v))
            c.instances = [V.string(x, "instances[%d]" % i, E) for i, x in enumerate(v)]
        if "history" in d:
            c.history = V.int_in(d["history"], "history", 1, 1_000_000, E)
        pr = V.table(d.get("probe", {}), "probe", E)
        V.no_unknown_keys(pr, cls.PROBE_KEYS, "[probe]", E)
        lim = {"interval_ms": (1, 600_000), "ok_needed": (1, 1000), "timeout_ms": (1, 10_000),
               "backoff_max_ms": (1, 3_600_000), "jitter_pct": (0, 90),
               "background_per_s": (0, 100_000), "background_fail": (1, 1000), "workers": (1, 64)}
        for k, (lo, hi) in lim.items():
            if k in pr:
                setattr(c, k, V.int_in(pr[k], "probe." + k, lo, hi, E))
        ln = V.table(d.get("links", {}), "links", E)
        V.no_unknown_keys(ln, {"follow"}, "[links]", E)
        if "follow" in ln:
            c.follow_links = V.boolean(ln["follow"], "links.follow", E)
        return c

    @classmethod
    def from_toml(cls, path: str) -> "HealthConfig":
        from mrc_xdp.datapath import validate as V
        return cls.from_dict(V.read_toml(path, "daemon config", HealthError), path)

    def wants(self, instance: str) -> bool:
        return any(fnmatch.fnmatchcase(instance, g) for g in self.instances)


# ---------------------------------------------------------------- events

def event_dict(instance: str, raw: bytes) -> dict:
    e = ffi.cast("struct mrc_event *", ffi.from_buffer(raw))
    return {"instance": instance, "ts_ns": e.ts_ns, "conn": e.conn, "ev": e.ev, "slot": e.slot,
            "plane": e.plane, "old": _name(EvState, e.old_state), "new": _name(EvState, e.new_state),
            "reason": _name(EvReason, e.reason), "other_ev": e.other_ev, "source": "datapath"}


def _name(enum, v) -> str:
    try:
        return enum(v).name
    except ValueError:
        return str(v)


def format_event(d: dict) -> str:
    """One line, as `mrc-xdp events` prints a ring event."""
    if "error" in d:                # the daemon refused the request (EventHub)
        return "daemon: %s" % d["error"]
    if d.get("kind") == "link":
        return "%.6f %s plane %d (%s) link %s: %s, %d EV(s) %s [daemon]" % (
            d["ts_ns"] / 1e9, d["instance"], d["plane"], d["dev"], "up" if d["up"] else "down",
            d.get("reason", "LINK_UP" if d["up"] else "LINK_DOWN"), d["evs"],
            "back in rotation" if d["up"] else "out of rotation")
    extra = " (replaced %#010x)" % d["other_ev"] if d.get("reason") == "REPLACED" else ""
    src = " [daemon]" if d.get("source") == "daemon" else ""
    return "%.6f conn %d plane %d EV %#010x %s -> %s: %s%s%s" % (
        d["ts_ns"] / 1e9, d["conn"], d["plane"], d["ev"], d["old"], d["new"], d["reason"], extra, src)


REQ_MAX = 4096          # a request: one JSON line of at most this many bytes,
REQ_DEPTH = 4           # ... nested at most this deep (a request is one flat object),
REQ_S = 2.0             # ... arriving whole within this
CLIENT_QUEUE = 4096     # live events waiting for one subscriber; one more disconnects it
STALL_S = 10.0          # a client that takes no byte for this long while output waits: disconnected
MAX_CLIENTS = 256       # connections at once; one more gets an error line
SEND_CHUNK = 65536


def json_depth(b: bytes) -> int:
    """How deep arrays and objects nest in JSON text b (strings skipped), without parsing:
    json.loads recurses once per level."""
    depth = top = 0
    in_str = esc = False
    for c in b:
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:         # backslash
                esc = True
            elif c == 0x22:         # quote
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):     # [ {
            depth += 1
            top = max(top, depth)
        elif c in (0x5D, 0x7D):
            depth -= 1
    return top


class _Client:
    """One connection to the daemon's socket: its request as it arrives, then its answer
    (history first, taken from a snapshot as the socket drains), then live events."""
    __slots__ = ("sock", "pid", "inbuf", "deadline", "hist", "hist_at", "live", "buf", "follow", "inst",
                 "done", "slow", "progress", "full")

    def __init__(self, sock):
        self.sock, self.inbuf, self.deadline = sock, b"", time.monotonic() + REQ_S
        try:                        # the client's process, for the log
            self.pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        except OSError:
            self.pid = 0
        self.hist, self.hist_at, self.live, self.buf = [], 0, collections.deque(), b""
        self.follow, self.inst = False, None
        self.done = False           # request answered: a follower stays, the others go once it is sent
        self.slow = ""              # why the hub disconnects it
        self.progress = time.monotonic()    # output last sent, or last found nothing to send
        self.full = False           # came when the hub was full: its request is refused

    def pending(self) -> bool:
        return bool(self.buf or self.hist_at < len(self.hist) or self.live)


class EventHub:
    """Bounded history plus the clients of the daemon's socket.  The clients are served by
    the hub's own thread (serve()), never by the health loop: publish() only appends an
    event to the history and to each subscriber's queue, in memory, and never waits on a
    socket.  The hub's thread reads requests and writes answers with non-blocking calls.

    A slow subscriber is disconnected (not fed a stream with gaps: it can reconnect and
    ask for the history, whose seq numbers say what it missed), and the daemon logs it:
    when more than CLIENT_QUEUE live events wait for it, or when it has taken no byte for
    STALL_S while output waits.  A request is one JSON object on one line of at most
    REQ_MAX bytes, nested at most REQ_DEPTH deep, arriving within REQ_S; anything else
    gets one error line (``{"error": ...}``) and the connection is closed.  At most
    MAX_CLIENTS connections are served at once: the request of one more is answered with
    an error line."""

    def __init__(self, history: int):
        self.history: collections.deque = collections.deque(maxlen=history)    # (instance, JSON line)
        self.clients: list[_Client] = []
        self.lock = threading.Lock()
        self.seq = 0
        self.stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.thread = None

    def publish(self, ev: dict) -> None:
        with self.lock:
            self.seq += 1
            ev["seq"] = self.seq
            line = (json.dumps(ev) + "\n").encode()
            self.history.append((ev.get("instance"), line))
            for c in self.clients:
                if not c.follow or c.slow or (c.inst is not None and ev.get("instance") != c.inst):
                    continue
                if len(c.live) >= CLIENT_QUEUE:
                    c.slow = "more than %d events waiting for it" % CLIENT_QUEUE
                else:
                    c.live.append(line)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:             # full: the hub's thread is awake already
            pass

    # -- the hub's thread
    def start(self, srv: socket.socket, status_fn, log) -> None:
        """Serve srv (a listening socket) from a thread of the hub's own."""
        srv.setblocking(False)
        self.thread = threading.Thread(target=self.serve, args=(srv, status_fn, log), name="mrc-daemon-hub",
                                       daemon=True)
        self.thread.start()

    def serve(self, srv: socket.socket, status_fn, log) -> None:
        sel = selectors.DefaultSelector()
        sel.register(srv, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self.stop.is_set():
                with self.lock:
                    clients = list(self.clients)
                for c in clients:
                    want = selectors.EVENT_READ if not c.done else 0
                    if c.pending():
                        want |= selectors.EVENT_WRITE
                    try:
                        sel.modify(c.sock, want or selectors.EVENT_READ, c)
                    except KeyError:
                        sel.register(c.sock, want or selectors.EVENT_READ, c)
                for key, mask in sel.select(0.25):
                    if key.data == "accept":
                        for _ in range(64):     # the backlog's worth, then the others' turn
                            if not self._accept(srv, sel):
                                break
                    elif key.data == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        c = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(c, status_fn)
                        if mask & selectors.EVENT_WRITE and not c.slow:
                            self._write(c)
                now = time.monotonic()
                for c in clients:
                    if not c.done and now > c.deadline:
                        self._error(c, "no whole request line within %.0f s" % REQ_S)
                    elif not c.pending():
                        c.progress = now
                    elif now - c.progress > STALL_S:
                        c.slow = c.slow or "took nothing for %.0f s" % STALL_S
                    if c.slow:
                        log("event subscriber (pid %d) disconnected: %s" % (c.pid, c.slow))
                        self._close(c, sel)
                    elif c.done and not c.follow and not c.pending():
                        self._close(c, sel)
        finally:
            sel.close()

    def _accept(self, srv, sel) -> bool:
        """One connection accepted (or refused, the hub being full); False: none waits."""
        try:
            s, _ = srv.accept()
        except BlockingIOError:
            return False
        except OSError:             # out of file descriptors: give the clients time to go
            time.sleep(0.05)
            return False
        s.setblocking(False)
        c = _Client(s)
        with self.lock:
            n = len(self.clients)
            if n < MAX_CLIENTS + 64:    # the refused ones too, while they wait for their answer
                self.clients.append(c)
        if n >= MAX_CLIENTS + 64:
            s.close()
            return True
        c.full = n >= MAX_CLIENTS
        sel.register(s, selectors.EVENT_READ, c)
        return True

    def _read(self, c: _Client, status_fn) -> None:
        try:
            chunk = c.sock.recv(REQ_MAX + 1)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if c.done:                  # bytes after the request are ignored; EOF ends a follower
            if not chunk and c.follow:
                with self.lock:
                    c.hist, c.live, c.follow = [], collections.deque(), False
                c.buf = b""
            return
        c.inbuf += chunk
        if b"\n" not in c.inbuf and chunk and len(c.inbuf) <= REQ_MAX:
            return
        line = c.inbuf.split(b"\n")[0]
        if c.full:
            return self._error(c, "the daemon serves %d clients already" % MAX_CLIENTS)
        if len(line) > REQ_MAX:
            return self._error(c, "request longer than %d bytes" % REQ_MAX)
        if json_depth(line) > REQ_DEPTH:
            return self._error(c, "request nested deeper than %d" % REQ_DEPTH)
        try:
            req = json.loads(line or b"{}")
        except (ValueError, RecursionError) as e:
            return self._error(c, "request is not JSON: %s" % e)
        if not isinstance(req, dict):
            return self._error(c, "request is not a JSON object")
        op = req.get("op")
        if op == "status":
            try:
                st = json.dumps(status_fn()) + "\n"
            except Exception as e:      # noqa: BLE001 - one client's answer, not the daemon
                return self._error(c, "status failed: %s" % e)
            c.buf, c.done = st.encode(), True
            return
        if op != "events":
            return self._error(c, "unknown op %r" % op)
        inst, n = req.get("instance"), req.get("history")
        with self.lock:
            hist = [ln for i, ln in self.history if inst is None or i == inst]
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                hist = hist[len(hist) - n:] if n else []
            c.hist, c.inst, c.follow, c.done = hist, inst, bool(req.get("follow")), True

    def _error(self, c: _Client, msg: str) -> None:
        with self.lock:
            c.hist, c.live, c.follow, c.done = [], collections.deque(), False, True
        c.buf = (json.dumps({"error": msg}) + "\n").encode()

    def _write(self, c: _Client) -> None:
        if not c.buf:
            with self.lock:
                if c.hist_at < len(c.hist):
                    part = c.hist[c.hist_at:c.hist_at + 256]
                    c.hist_at += len(part)
                else:
                    part = [c.live.popleft() for _ in range(min(len(c.live), 256))]
            c.buf = b"".join(part)
        try:
            n = c.sock.send(c.buf[:SEND_CHUNK])
        except BlockingIOError:
            return
        except OSError:             # gone
            with self.lock:
                c.hist, c.live, c.follow, c.done = [], collections.deque(), False, True
            c.buf = b""
            return
        c.buf = c.buf[n:]
        c.progress = time.monotonic()

    def _close(self, c: _Client, sel) -> None:
        with self.lock:
            if c in self.clients:
                self.clients.remove(c)
        try:
            sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        try:                        # unread bytes would reset the connection, error line and all
            for _ in range(16):
                if not c.sock.recv(REQ_MAX):
                    break
        except OSError:
            pass
        try:
            c.sock.close()
        except OSError:
            pass

    def close(self, flush_s: float = 1.0) -> None:
        """Stop serving, after at most flush_s for what is queued to reach the clients."""
        end = time.monotonic() + flush_s
        while self.thread is not None and self.thread.is_alive() and time.monotonic() < end:
            with self.lock:
                if not any(c.pending() and not c.slow for c in self.clients):
                    break
            self._wake()
            time.sleep(0.01)
        self.stop.set()
        self._wake()
        if self.thread is not None:
            self.thread.join(5)
        with self.lock:
            for c in self.clients:
                try:
                    c.sock.close()
                except OSError:
                    pass
            self.clients = []
        self._wake_r.close()
        self._wake_w.close()


# ---------------------------------------------------------------- client side

def connect(path: str | None = None, timeout: float = 2.0) -> socket.socket | None:
    """A connection to a running daemon, None when none answers at the socket."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(socket_path(path))
    except OSError:
        s.close()
        return None
    return s


def request_lines(req: dict, path: str | None = None, timeout: float | None = 2.0):
    """Send one request; yield the answer's JSON objects.  None: no daemon."""
    s = connect(path)
    if s is None:
        return None

    def gen():
        try:
            s.sendall((json.dumps(req) + "\n").encode())
            s.settimeout(timeout)
            f = s.makefile("rb")
            for line in f:
                yield json.loads(line)
        finally:
            s.close()
    return gen()


def status(path: str | None = None) -> dict | None:
    g = request_lines({"op": "status"}, path)
    if g is None:
        return None
    try:
        for obj in g:
            return obj
    except (OSError, ValueError):
        return None
    return None


# ---------------------------------------------------------------- probers

class ProberUnavailable(HealthError):
    pass


def load_prober():
    """The datapath's prober (mrc_xdp.health.probe), adapted to probe(instance, conn, ev, count,
    timeout) -> [rtt | None]; None when the module is not there."""
    try:
        from mrc_xdp.health import probe as mod      # issue 8 item 1: probes answered in the datapath
    except ImportError:
        return None
    if hasattr(mod, "Prober"):
        return mod.Prober()
    if hasattr(mod, "probe"):
        class _F:
            def probe(self, instance, conn, ev, count=1, timeout=0.05):
                return mod.probe(instance, conn, ev, count, timeout)
        return _F()
    return None


# ---------------------------------------------------------------- per instance

def ev_states(inst: maps.Instance) -> list[dict]:
    """Every configured EV of every connection: conn, slot, ev, plane, t1, state, reason
    (names), changed_ns; mrc_evs only (no counters), cheap enough for every tick."""
    out = []
    evs = inst.map("mrc_evs")
    nplanes = len(inst.state.get("planes", [])) or 1
    for c in inst.connections():
        n, b = c["ev_per_plane"], c["backup_per_plane"]
        slots = [p * n + k for p in range(nplanes) for k in range(n)] + \
                [maps.ACTIVE_MAX + p * b + k for p in range(nplanes) for k in range(b)]
        for slot in slots:
            raw = evs.lookup(c["id"] * maps.SLOTS + slot)
            if raw is None:
                continue
            e = ffi.cast("struct mrc_ev *", ffi.from_buffer(raw))
            if e.state == EvState.UNUSED:
                continue
            out.append({"conn": c["id"], "conn_name": c["name"], "slot": slot, "ev": e.ev,
                        "plane": e.plane, "t1": e.t1, "state": _name(EvState, e.state),
                        "reason": _name(EvReason, e.reason), "changed_ns": e.changed_ns,
                        "role": "active" if slot < maps.ACTIVE_MAX else "backup"})
    return out


class _Probe:
    __slots__ = ("next", "ok", "fails", "busy")

    def __init__(self, nxt):
        self.next, self.ok, self.fails, self.busy = nxt, 0, 0, False


class InstanceHealth:
    """Everything the daemon does for one instance."""

    def __init__(self, name: str, cfg: HealthConfig, hub: EventHub, prober, pool, log):
        self.name, self.cfg, self.hub, self.prober, self.pool, self.log = name, cfg, hub, prober, pool, log
        self.inst = maps.Instance(name)
        self.map_id = bpfsys.map_info(self.inst.map("mrc_events").fd).id
        self.netns = self.inst.state.get("netns")
        self.planes = [(i, p["dev"]) for i, p in enumerate(self.inst.state.get("planes", []))]
        self.rb = bpfsys.RingReader(self.inst.map("mrc_events").fd, self._on_event)
        self.link_up: dict[int, bool] = {}
        self.admin_out: set[int] = set()        # planes drained by the operator (MRC_PF_ADMIN)
        self._rows, self._rows_at = [], 0.0     # ev_states(), re-read at most every ROWS_S
        self._admin_at = 0.0
        self._events = True                     # ring events since the last ev_states()
        self.ipr = None
        self.bad: dict[tuple[int, int], _Probe] = {}
        self.bg_fail: dict[tuple[int, int], int] = {}
        self.rtt: dict[tuple[int, int], dict] = {}
        self.bg_order: list[tuple[int, int]] = []
        self.bg_credit = 0.0
        self.last_tick = time.monotonic()
        self.lock = threading.Lock()
        self.rng = random.Random()
        self.resurrected = 0
        self.busy = False
        self._tx_data, self._busy_until, self._busy_next = None, 0.0, 0.0
        if cfg.follow_links and self.planes:
            self._open_netlink()
            self.sync_links()

    # -- events
    def _on_event(self, raw: bytes) -> None:
        self._events = True
        self.hub.publish(event_dict(self.name, raw))

    def _daemon_event(self, row: dict, old: str, new: str, reason) -> None:
        """A change the daemon made: the datapath's mrc_evop (maps.set_ev_state) writes its
        event into the ring like any other; an instance loaded without mrc_evop gets one
        published here instead."""
        if self.inst.evop_fd() is not None:
            return
        self.hub.publish({"instance": self.name, "ts_ns": time.monotonic_ns(), "conn": row["conn"],
                          "ev": row["ev"], "slot": row["slot"], "plane": row["plane"], "old": old,
                          "new": new, "reason": reason.name, "other_ev": 0, "source": "daemon"})

    def poll_ring(self) -> None:
        self.rb.poll(0)

    def still_loaded(self) -> bool:
        return maps.pinned_map_id(self.name, "mrc_events") == self.map_id

    # -- links
    def _open_netlink(self) -> None:
        from pyroute2 import IPRoute

        def mk():
            ipr = IPRoute()
            ipr.bind()
            return ipr
        try:
            self.ipr = netns.run(self.netns, mk) if self.netns else mk()
        except (OSError, netns.NetnsError) as e:
            self.log("%s: cannot follow plane links (%s)" % (self.name, e))
            self.ipr = None

    def fileno(self):
        return self.ipr.fileno() if self.ipr else None

    def on_netlink(self) -> None:
        try:
            msgs = self.ipr.get()
        except OSError:
            return
        devs = {dev: p for p, dev in self.planes}
        for m in msgs:
            if m.get("event") not in ("RTM_NEWLINK", "RTM_DELLINK"):
                continue
            dev = m.get_attr("IFLA_IFNAME")
            if dev in devs:
                up = m.get("event") == "RTM_NEWLINK" and bool(m["flags"] & IFF_UP) and bool(m["flags"] & IFF_RUNNING)
                self.set_link(devs[dev], dev, up)

    def sync_links(self) -> None:
        if not self.ipr:
            return
        try:
            links = {l.get_attr("IFLA_IFNAME"): l["flags"] for l in self.ipr.get_links()}
        except OSError:
            return
        for p, dev in self.planes:
            fl = links.get(dev)
            self.set_link(p, dev, fl is not None and bool(fl & IFF_UP) and bool(fl & IFF_RUNNING), force=True)

    def set_link(self, plane: int, dev: str, up: bool, force: bool = False) -> None:
        """Record a plane NIC's link state and make the plane's rotation flag follow it
        (MRC_PF_DOWN while down).  An event when the link changed or the flag had to be
        changed (a daemon started or restarted against a flag left by an earlier one, a
        reload that cleared it); force: re-check the flag even if the link did not change."""
        if not force and self.link_up.get(plane) == up:
            return
        first = plane not in self.link_up
        changed = self.link_up.get(plane) != up
        self.link_up[plane] = up
        try:
            flipped = self.inst.set_plane_down(plane, not up)
        except (maps.NotLoaded, KeyError, OSError) as e:
            if changed:
                self.log("%s: plane %d (%s) link %s, not followed: %s" % (
                    self.name, plane, dev, "up" if up else "down", e))
            return
        if not flipped and (first or not changed):
            return
        reason = LINK_UP if up else LINK_DOWN
        n = sum(1 for r in ev_states(self.inst) if r["plane"] == plane and r["role"] == "active")
        self.log("%s: plane %d (%s) link %s: %d active EV(s) %s" % (
            self.name, plane, dev, "up" if up else "down", n, "back in rotation" if up else "out of rotation"))
        self.hub.publish({"instance": self.name, "ts_ns": time.monotonic_ns(), "kind": "link",
                          "plane": plane, "dev": dev, "up": up, "reason": reason.name, "evs": n,
                          "source": "daemon"})

    # -- probing
    def _left_alone(self, plane: int) -> bool:
        """Is the plane out of the daemon's hands: its link down (our flag) or drained by
        the operator (MRC_PF_ADMIN)?  Its EVs are neither probed nor changed."""
        return self.link_up.get(plane) is False or plane in self.admin_out

    def _read_admin(self) -> None:
        try:
            flags = self.inst.plane_flags()
        except (maps.NotLoaded, OSError, TypeError):
            return
        out = {p for p, f in enumerate(flags) if f & PF_ADMIN}
        if out != self.admin_out:
            for p in sorted(out - self.admin_out):
                self.log("%s: plane %d drained by the operator: its EVs are left alone (no probes)" % (self.name, p))
            for p in sorted(self.admin_out - out):
                self.log("%s: plane %d returned by the operator: probing its EVs again" % (self.name, p))
        self.admin_out = out

    def _period(self, fails: int) -> float:
        base = min(self.cfg.interval_ms * (2 ** min(fails, 20)), max(self.cfg.backoff_max_ms, self.cfg.interval_ms))
        j = self.cfg.jitter_pct / 100.0
        return base / 1000.0 * (1 + self.rng.uniform(-j, j))

    def _ev_now(self, cid: int, ev: int) -> dict | None:
        """The current state of one EV (two map lookups), None when it left the set."""
        slot = maps.ev_slot(self.inst.map("mrc_evidx"), cid, ev)
        if slot is None:
            return None
        raw = self.inst.map("mrc_evs").lookup(cid * maps.SLOTS + slot)
        if raw is None:
            return None
        e = ffi.cast("struct mrc_ev *", ffi.from_buffer(raw))
        return {"conn": cid, "ev": ev, "slot": slot, "plane": e.plane, "t1": e.t1,
                "state": _name(EvState, e.state), "reason": _name(EvReason, e.reason)}

    def _change_if(self, r: dict, was: str, state: EvState, reason: EvReason) -> bool:
        """EV r (conn, ev, plane) to state, with an event, if it is still in state `was`
        (re-read now) and its plane's link is not down.  True when it changed."""
        cur = self._ev_now(r["conn"], r["ev"])
        if cur is None or cur["state"] != was:
            return False
        self._read_admin()          # a drain since the probe was sent wins
        if self._left_alone(cur["plane"]):
            return False
        maps.set_ev_state(self.inst.map("mrc_evs"), self.inst.map("mrc_evidx"), r["conn"], r["ev"],
                          state, reason)
        self._events = True         # re-read the states next tick (an instance without mrc_evop writes no event)
        self._daemon_event(cur, was, state.name, reason)
        return True

    def _busy(self, now: float) -> bool:
        """Is the instance's spray sending data (see the module docstring)?"""
        stats = self.inst.map("mrc_stats")

        def ctr(c):
            raw = stats.lookup(int(c))
            return sum(bpfsys.sum_u64_percpu(raw)) if raw is not None else 0
        # data and feedback (SACK/NACK) the engine sent; not our own probes
        n = ctr(Ctr.SPRAY_DATA) + ctr(Ctr.SPRAY_CTRL) - ctr(Ctr.SPRAY_PROBE)
        if self._tx_data is not None and n != self._tx_data:
            self._busy_until = now + BUSY_S
        self._tx_data = n
        return now < self._busy_until

    def tick(self) -> None:
        if self.prober is None:
            return
        now = time.monotonic()
        self.busy = self._busy(now)     # every tick: the first probes must not race a start
        if now - self._rows_at >= (ROWS_S if self._events else ROWS_IDLE_S):
            self._events = False
            self.inst.reload_state()
            self._rows, self._rows_at = ev_states(self.inst), now
        if now - self._admin_at >= ROWS_S:
            self._admin_at = now
            self._read_admin()
        rows = self._rows
        seen = set()
        for r in rows:
            k = (r["conn"], r["ev"])
            if r["state"] != "ASSUMED_BAD" or self._left_alone(r["plane"]):
                continue
            seen.add(k)
            with self.lock:
                st = self.bad.get(k)
                if st is None:
                    st = self.bad[k] = _Probe(now + self._period(0))
                if st.busy or now < st.next:
                    continue
                if self.busy:           # one probe per BUSY_PROBE_S: see the module docstring
                    if now < self._busy_next:
                        continue
                    self._busy_next = now + BUSY_PROBE_S
                st.busy = True
            self.pool.submit(self._probe_bad, r, st)
        with self.lock:
            for k in [k for k, st in self.bad.items() if k not in seen and not st.busy]:
                del self.bad[k]
        # background: idle instances only (a busy one's feedback tests its EVs)
        dt, self.last_tick = now - self.last_tick, now
        self.bg_credit = min(self.bg_credit + dt * self.cfg.background_per_s, 8.0)
        if self.busy:
            self.bg_credit = 0.0
        good = [r for r in rows if r["state"] == "GOOD" and not self._left_alone(r["plane"])]
        while self.bg_credit >= 1.0 and good:
            self.bg_credit -= 1.0
            if not self.bg_order:
                self.bg_order = [(r["conn"], r["ev"]) for r in good]
                self.rng.shuffle(self.bg_order)
            k = self.bg_order.pop()
            r = next((x for x in good if (x["conn"], x["ev"]) == k), None)
            if r is not None:
                self.pool.submit(self._probe_good, r)

    def _probe(self, r: dict):
        try:
            res = self.prober.probe(self.name, r["conn"], r["ev"], 1, self.cfg.timeout_ms / 1000.0)
        except Exception as e:      # a prober failure is one missed probe, said once per EV
            self.log("%s: probe conn %d EV %#010x failed: %s" % (self.name, r["conn"], r["ev"], e))
            res = [None]
        rtt = res[0] if res else None
        k = (r["conn"], r["ev"])
        with self.lock:
            d = self.rtt.setdefault(k, {"last": None, "srtt": None, "sent": 0, "answered": 0, "at": 0.0})
            d["sent"] += 1
            d["at"] = time.time()
            if rtt is not None:
                d["answered"] += 1
                d["last"] = rtt
                d["srtt"] = rtt if d["srtt"] is None else 0.875 * d["srtt"] + 0.125 * rtt
        return rtt

    def _probe_bad(self, r: dict, st: _Probe) -> None:
        try:
            rtt = self._probe(r)
            if rtt is None:
                st.ok, st.fails = 0, st.fails + 1
            else:
                st.ok += 1
                st.fails = 0
                if st.ok >= self.cfg.ok_needed:
                    if self._change_if(r, "ASSUMED_BAD", EvState.GOOD, EvReason.PROBE_OK):
                        self.resurrected += 1
                    st.ok = 0
            st.next = time.monotonic() + self._period(st.fails)
        except Exception as e:
            self.log("%s: resurrecting conn %d EV %#010x: %s" % (self.name, r["conn"], r["ev"], e))
            st.next = time.monotonic() + self._period(st.fails)
        finally:
            st.busy = False

    def _probe_good(self, r: dict) -> None:
        k = (r["conn"], r["ev"])
        try:
            rtt = self._probe(r)
            if rtt is not None:
                self.bg_fail.pop(k, None)
                return
            n = self.bg_fail[k] = self.bg_fail.get(k, 0) + 1
            if n >= self.cfg.background_fail:
                self.bg_fail.pop(k, None)
                self._change_if(r, "GOOD", EvState.ASSUMED_BAD, PROBE_FAIL)
        except Exception as e:
            self.log("%s: background probe conn %d EV %#010x: %s" % (self.name, r["conn"], r["ev"], e))

    def status(self) -> dict:
        with self.lock:
            rtt = {"%d:%d" % k: dict(v) for k, v in self.rtt.items()}
            bad = {"%d:%d" % k: {"ok": v.ok, "fails": v.fails, "next_in_s": round(v.next - time.monotonic(), 3)}
                   for k, v in self.bad.items()}
        return {"netns": self.netns, "links": {str(p): {"dev": dev, "up": self.link_up.get(p),
                                                        "in_rotation": self.link_up.get(p) is not False,
                                                        "operator_out": p in self.admin_out}
                                               for p, dev in self.planes},
                "rtt": rtt, "probing": bad, "resurrected": self.resurrected}

    def close(self) -> None:
        self.rb.close()
        if self.ipr:
            self.ipr.close()
        self.inst.close()


# ---------------------------------------------------------------- the daemon

class Daemon:
    def __init__(self, cfg: HealthConfig, prober="auto", log=None):
        self.cfg = cfg
        self.sock_path = socket_path(cfg.socket or None)
        self.hub = EventHub(cfg.history)
        self.prober = load_prober() if prober == "auto" else prober
        self.pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="mrc-probe")
        self.watch: dict[str, InstanceHealth] = {}
        self.stop = threading.Event()
        self.log = log or (lambda m: print("mrc-xdp daemon: " + m, file=sys.stderr, flush=True))
        self.srv = None
        self.started = time.time()

    # -- socket
    def _listen(self) -> None:
        d = os.path.dirname(self.sock_path)
        os.makedirs(d, exist_ok=True)
        if os.path.exists(self.sock_path):
            if connect(self.sock_path, 0.5) is not None:
                raise HealthError("a daemon already serves %s: stop it first (or set socket in the config)"
                                  % self.sock_path)
            os.unlink(self.sock_path)
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.sock_path)
        os.chmod(self.sock_path, 0o660)
        self.srv.listen(64)
        self.hub.start(self.srv, self.status, self.log)

    def status(self) -> dict:
        return {"pid": os.getpid(), "started": self.started, "socket": self.sock_path,
                "prober": self.prober is not None, "events": self.hub.seq,
                "config": {k: getattr(self.cfg, k) for k in ("interval_ms", "ok_needed", "timeout_ms",
                                                              "backoff_max_ms", "jitter_pct",
                                                              "background_per_s", "background_fail")},
                "instances": {n: w.status() for n, w in list(self.watch.items())}}

    # -- instances
    def rescan(self) -> None:
        names = [n for n in maps.instances() if self.cfg.wants(n)]
        for n in list(self.watch):
            if n not in names or not self.watch[n].still_loaded():
                self.log("%s: unloaded or reloaded: %s" % (n, "following the new one" if n in names else "dropped"))
                self.watch.pop(n).close()
        for n in names:
            if n in self.watch:
                continue
            try:
                if not maps.load_complete(n):
                    continue
                self.watch[n] = InstanceHealth(n, self.cfg, self.hub, self.prober, self.pool, self.log)
                self.log("%s: following (%d plane(s)%s)" % (n, len(self.watch[n].planes),
                                                           ", netns " + self.watch[n].netns if self.watch[n].netns else ""))
            except (maps.NotLoaded, OSError, bpfsys.BpfError) as e:
                self.log("%s: cannot follow: %s" % (n, e))
        conns.reap_each(self.watch, self.log)     # connections of processes gone
        for w in self.watch.values():
            w.sync_links()

    def run(self, seconds: float | None = None) -> None:
        self._listen()
        if self.prober is None:
            self.log("probing is off: no prober (mrc_xdp.health.probe) available; following links and events only")
        self.log("serving events on %s" % self.sock_path)
        end = time.monotonic() + seconds if seconds else None
        next_scan = 0.0
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if end and now >= end:
                    break
                if now >= next_scan:
                    self.rescan()
                    if not next_scan and not self.watch:        # after the first scan: say why it idles
                        loaded = maps.instances()
                        self.log("no loaded instance matches %s (loaded: %s): waiting for one to load"
                                 % (" or ".join(self.cfg.instances), ", ".join(loaded) or "none"))
                    next_scan = now + RESCAN_S
                fds = {w.fileno(): w for w in self.watch.values() if w.fileno() is not None}
                try:
                    r, _, _ = select.select(list(fds), [], [], TICK)
                except (OSError, ValueError):
                    r = []
                for fd in r:
                    fds[fd].on_netlink()
                for w in list(self.watch.values()):
                    try:
                        w.poll_ring()
                        w.tick()
                    except (OSError, bpfsys.BpfError) as e:
                        self.log("%s: %s" % (w.name, e))
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=True, cancel_futures=True)
        for w in self.watch.values():
            w.poll_ring()
            w.close()
        self.watch.clear()
        self.hub.close()
        if self.srv:
            self.srv.close()
            try:
                os.unlink(self.sock_path)
            except OSError:
                pass
