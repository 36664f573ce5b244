"""Out-of-band bootstrap: QP attributes exchanged over a small TCP connection, as MRC
(and perftest) do.

The server listens on the host's control address (default port 18515, perftest's),
the client connects; each side sends JSON lines.  The channel stays open for the
life of a test so the two sides can also synchronise (``barrier``) and exchange
results.  Every failure is a ``BootstrapError`` whose message is one line saying what
failed and what to do.

The peer is not trusted: each line is bounded in size and nesting before it is parsed,
and every message is checked against its type's schema (``check_msg``, the one place
that says what a hello, a qps list, a result... may hold) before anyone uses it.  A
listener serves the first client whose hello passes; the others are told why, logged
and dropped, and the wait goes on.

Attributes of one QP (``qp_attrs``)::

    {"addr": "<MRC IPv6>", "qpn": 256, "start_psn": 123, "mtu": 3328,
     "mr": {"addr": 140..., "length": 1048576, "rkey": 17}}

In the lab the TCP connection runs over the lab's control path (mrc_xdp.lab.ctlpath).
"""
from __future__ import annotations

import ipaddress
import json
import math
import re
import select
import socket
import time

from mrc_xdp.datapath import netns

DEFAULT_PORT = 18515
PROTO = "mrc-xdp/1"
MAX_LINE = 1 << 18          # bytes of one message; the largest (a write-bw result) is a few KiB
MAX_DEPTH = 16              # nesting of one message; ours go 4 deep
HELLO_TIMEOUT = 10.0        # a connection has this long (at most) to say hello
MAX_PENDING = 16            # connections waiting for their hello at once

# What a peer may ask for (perftest-style commands, mrc_xdp.transport.perf)
MAX_QPS = 1000              # connections per datapath instance are MRC_MAX_CONNS (1024), a few are taken
MAX_MSG = 1 << 30           # write-bw/write-lat: bytes per write
MAX_ITERS = 10 ** 8
MAX_FILE = 1 << 48          # send/recv: bytes of one file (the space free is checked too)
MIN_PAYLOAD = 256           # QP attribute mtu: payload bytes per packet
MAX_MR = 1 << 47            # bytes of an MR (x86-64 user space)


class BootstrapError(RuntimeError):
    """One line: what failed, what to do."""


class BootstrapTimeout(BootstrapError):
    """No message within the time asked for (the channel stays usable)."""


def _family(host: str) -> int:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET6


def _show(v, n: int = 40) -> str:
    """v for a one-line message: repr, cut to about n characters."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _printable(text, n: int = 300) -> str:
    """A peer's free text on one line: control characters as spaces, at most n characters."""
    t = "".join(c if c.isprintable() else " " for c in str(text)[:n])
    return t + ("..." if len(str(text)) > n else "")


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _too_deep(line: bytes, limit: int = MAX_DEPTH) -> bool:
    """Brackets nest deeper than limit outside strings (checked before json.loads, whose
    recursion a deeply nested line would exhaust)."""
    depth = 0
    for m in _TOKENS.finditer(line):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


def _not_a_number(name):
    raise ValueError("%s, which JSON has no number for" % name)


def parse(line: bytes, peer: str) -> dict:
    """One message (a JSON object) from peer, size and depth bounded before parsing; a
    message with an "error" field raises it."""
    if len(line) > MAX_LINE:
        raise BootstrapError("bootstrap: %s sent a line over %d bytes: not an mrc-xdp peer" % (peer, MAX_LINE))
    if _too_deep(line):
        raise BootstrapError("bootstrap: %s sent JSON nested more than %d deep: not an mrc-xdp peer"
                             % (peer, MAX_DEPTH))
    try:
        obj = json.loads(line, parse_constant=_not_a_number)
    except ValueError as e:
        why = str(e) if "JSON has no number" in str(e) else "something that is not JSON (%s...)" % _show(line[:40])
        raise BootstrapError("bootstrap: %s sent %s: not an mrc-xdp peer on this port?" % (peer, why)) from None
    if not isinstance(obj, dict):
        raise BootstrapError("bootstrap: %s sent %s, expected a JSON object" % (peer, _show(obj)))
    if obj.get("error"):
        raise BootstrapError("peer %s: %s" % (peer, _printable(obj["error"])))
    return obj


class Channel:
    """A connected JSON-lines channel."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self._buf = b""

    def send(self, obj: dict) -> None:
        try:
            self.sock.settimeout(HELLO_TIMEOUT * 3)     # a peer that reads nothing cannot hold us
            self.sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        except OSError as e:
            raise BootstrapError("bootstrap: sending to %s failed (%s): is the peer still running?"
                                 % (self.peer, e.strerror or e)) from None

    def _take(self) -> dict | None:
        """The next complete message in the buffer, or None."""
        if b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                raise BootstrapError("bootstrap: %s sent a line over %d bytes: not an mrc-xdp peer"
                                     % (self.peer, MAX_LINE))
            return None
        line, self._buf = self._buf.split(b"\n", 1)
        return parse(line, self.peer)

    def _read(self, timeout: float) -> None:
        """What the peer sent within timeout seconds (0: what is there) into the buffer."""
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(65536)
        except (socket.timeout, BlockingIOError):
            return
        except OSError as e:
            raise BootstrapError("bootstrap: reading from %s failed (%s)" % (self.peer, e.strerror or e)) from None
        if not chunk:
            raise BootstrapError("bootstrap: %s closed the connection (the peer stopped or "
                                 "failed: see its output)" % self.peer)
        self._buf += chunk

    def recv(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            obj = self._take()
            if obj is not None:
                return obj
            left = deadline - time.monotonic()
            if left <= 0:
                raise BootstrapTimeout("bootstrap: no answer from %s within %.0f s: is the peer "
                                       "running (and its control address reachable)?" % (self.peer, timeout))
            self._read(left)

    def expect(self, kind: str, timeout: float = 30.0, **ctx) -> dict:
        """The next message, of type kind, checked against its schema (check)."""
        obj = self.recv(timeout)
        if obj.get("type") != kind:
            raise BootstrapError("bootstrap: expected %r from %s, got %s" % (kind, self.peer, _show(obj.get("type"))))
        return check_msg(kind, obj, self.peer, **ctx)

    def barrier(self, name: str, timeout: float = 60.0) -> None:
        """Both sides reach the same named point."""
        self.send({"type": "barrier", "name": name})
        got = self.expect("barrier", timeout)
        if got.get("name") != name:
            raise BootstrapError("bootstrap: out of step with %s (at %r, peer at %s)" % (self.peer, name,
                                                                                     _show(got.get("name"))))

    def reject(self, why: str) -> None:
        """Tell the peer why (one line, if it still listens) and close."""
        try:
            self.send({"error": why})
        except BootstrapError:
            pass
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


class Listener:
    """A listening socket on (bind, port), created in netns ns."""

    def __init__(self, port: int = DEFAULT_PORT, bind: str = "::", ns: str | None = None):
        self.port = port

        def mk():
            s = socket.socket(_family(bind), socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if s.family == socket.AF_INET6 and bind == "::":
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind((bind, port))
            s.listen(4 * MAX_PENDING)     # room for the connections accept() weeds out
            return s
        try:
            self.sock = netns.run(ns, mk)
        except OSError as e:
            raise BootstrapError("bootstrap: cannot listen on [%s]:%d%s (%s): pick another --port"
                                 % (bind, port, " in netns %s" % ns if ns else "", e.strerror or e)) from None

    def accept(self, timeout: float | None = None, check=None, log=None) -> Channel:
        """The first client within timeout seconds (None: wait) that says an mrc-xdp hello
        and passes check(channel) (which raises BootstrapError to refuse it; it may read
        more).  A connection that sends garbage, no hello within HELLO_TIMEOUT, or is
        refused, is told why, closed and logged (log(line)); the wait goes on.  Several
        connections may be waiting for their hello at once: a silent one holds nobody."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending: dict = {}          # socket -> (Channel, the time its hello is due by)

        def refuse(ch, why):
            pending.pop(ch.sock, None)
            for head in ("bootstrap: ", ch.peer + ": ", ch.peer + " "):    # the line names the peer once
                why = why[len(head):] if why.startswith(head) else why
            ch.reject(why)
            if log:
                log("rejected %s: %s" % (ch.peer, why))
        try:
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise BootstrapError("bootstrap: no client connected to port %d within %g s" % (self.port, timeout))
                for ch, due in list(pending.values()):
                    if now >= due:
                        refuse(ch, "sent no hello within %.0f s" % HELLO_TIMEOUT)
                ends = [due for _, due in pending.values()] + ([deadline] if deadline is not None else [])
                r, _, _ = select.select([self.sock] + list(pending), [], [],
                                        max(0.0, min(ends) - now) if ends else None)
                for s in r:
                    if s is self.sock:
                        try:
                            c, addr = self.sock.accept()
                        except OSError:
                            continue
                        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        ch = Channel(c, "[%s]:%d" % addr[:2])
                        if len(pending) >= MAX_PENDING:
                            refuse(min(pending.values(), key=lambda p: p[1])[0], "too many connections at once")
                        pending[c] = (ch, now + HELLO_TIMEOUT)
                        continue
                    if s not in pending:        # refused above, to make room
                        continue
                    ch = pending[s][0]
                    try:
                        ch._read(0)
                        hello = ch._take()
                        if hello is None:
                            continue
                        del pending[s]
                        ch.hello = check_msg("hello", hello, ch.peer)
                        if check is not None:
                            check(ch)
                    except BootstrapError as e:
                        refuse(ch, str(e))
                        continue
                    ch.sock.settimeout(None)
                    return ch
        finally:
            for ch, _ in pending.values():
                ch.close()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def connect(host: str, port: int = DEFAULT_PORT, timeout: float = 30.0, ns: str | None = None,
            hello: dict | None = None) -> Channel:
    """Connect to a server, retrying while it is not up yet (refused, unreachable) until
    timeout; sends the hello (with `hello`'s fields) and returns the channel."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        def mk():
            return socket.socket(_family(host), socket.SOCK_STREAM)
        s = netns.run(ns, mk)
        s.settimeout(max(0.2, min(5.0, deadline - time.monotonic())))
        try:
            s.connect((host, port))
            break
        except (ConnectionRefusedError, socket.timeout, OSError) as e:
            s.close()
            last = e
            if isinstance(e, socket.gaierror):
                raise BootstrapError("bootstrap: cannot resolve %r: give the peer's control address" % host) from None
            if time.monotonic() >= deadline:
                raise BootstrapError("bootstrap: cannot connect to [%s]:%d within %.0f s (%s): start the "
                                     "server side first, and check the address and --port"
                                     % (host, port, timeout, getattr(last, "strerror", None) or last)) from None
            time.sleep(0.1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(None)
    ch = Channel(s, "[%s]:%d" % (host, port))
    ch.send(dict(hello or {}, type="hello", proto=PROTO))
    return ch


# ------------------------------------------------------------------ the messages' schemas
#
# Every message a peer sends is checked here, against one schema per message type, before
# anyone uses it: a field is ("key", checker, required), a checker returns the value or
# raises _Bad.  Context a schema cannot know (the QPs this side has, our own address, the
# MR length needed) comes as check()'s keywords.

class _Bad(ValueError):
    pass


def _int(lo, hi, mult=1):
    def c(v):
        if not isinstance(v, int) or isinstance(v, bool):
            raise _Bad("is not an integer")
        if not lo <= v <= hi:
            raise _Bad("is out of range (%d..%d)" % (lo, hi))
        if v % mult:
            raise _Bad("is not a multiple of %d" % mult)
        return v
    return c


def _num(lo, hi):
    def c(v):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise _Bad("is not a finite number")
        if not lo <= v <= hi:
            raise _Bad("is out of range (%g..%g)" % (lo, hi))
        return v
    return c


def _str(n):
    def c(v):
        if not isinstance(v, str) or not 0 < len(v) <= n or not v.isprintable():
            raise _Bad("is not a string of 1..%d printable characters" % n)
        return v
    return c


def _hex(n):
    def c(v):
        if not isinstance(v, str) or not re.fullmatch("[0-9a-f]{%d}" % n, v):
            raise _Bad("is not %d lowercase hex digits" % n)
        return v
    return c


def _file_name(v):
    """A plain file name: no directory part, no NUL, printable, at most 255 bytes."""
    if not isinstance(v, str) or v in ("", ".", "..") or "/" in v or not v.isprintable():
        raise _Bad("is not a file name (no '/', no control characters)")
    try:
        n = len(v.encode())
    except UnicodeError:
        raise _Bad("is not a file name (not UTF-8)") from None
    if n > 255:
        raise _Bad("is not a file name (%d bytes, at most 255)" % n)
    return v


def _peer_addr(v):
    """An address a peer can have: a global or unique local IPv6 unicast address."""
    try:
        a = ipaddress.IPv6Address(v)
    except (ValueError, TypeError):
        raise _Bad("is not an IPv6 address") from None
    if a.scope_id is not None:
        raise _Bad("has a scope: give an MRC address, not a link-local one")
    for bad, what in ((a.is_unspecified, "unspecified"), (a.is_multicast, "multicast"),
                      (a.is_loopback, "loopback"), (a.is_link_local, "link-local"),
                      (a.ipv4_mapped is not None, "IPv4-mapped")):
        if bad:
            raise _Bad("is not a peer's address (%s)" % what)
    return str(a)


def _const(value):
    def c(v):
        if v != value:
            raise _Bad("is not %r" % value)
        return v
    return c


def _obj(*fields):
    def c(v, where=""):
        if not isinstance(v, dict):
            raise _Bad("is not an object")
        for key, chk, required in fields:
            if key not in v:
                if required:
                    raise _Bad("%s%s is missing" % (where, key), True)
                continue
            try:
                v[key] = chk(v[key], where + key + ".") if getattr(chk, "nested", False) else chk(v[key])
            except _Bad as e:
                if len(e.args) > 1:         # already names its field
                    raise
                raise _Bad("%s%s=%s %s" % (where, key, _show(v[key]), e), True) from None
        return v
    c.nested = True
    return c


def _list(item, lo, hi):
    def c(v, where=""):
        if not isinstance(v, list):
            raise _Bad("is not a list")
        if not lo <= len(v) <= hi:
            raise _Bad("has %d entries (%d..%d)" % (len(v), lo, hi))
        return [item(x, "%s[%d]." % (where.rstrip("."), i)) for i, x in enumerate(v)]
    c.nested = True
    return c


_MR = _obj(("addr", _int(0, (1 << 64) - 1), True), ("length", _int(0, MAX_MR), True),
           ("rkey", _int(0, 0xFFFFFFFF), True))
_QP = _obj(("addr", _peer_addr, True), ("qpn", _int(1, 0xFFFFFF), True),
           ("start_psn", _int(0, 0xFFFFFF), True), ("mtu", _int(MIN_PAYLOAD, 1 << 16, 4), True),
           ("mr", _MR, False))
_QP_STATS = _obj(*[(k, _int(0, 1 << 64), True) for k in ("tx_pkts", "rtx_pkts", "rtx_timeout", "rtx_sack",
                                                          "rtx_nack_trim")])
_N = _num(0, 1e18)
SCHEMAS = {
    "hello": _obj(("proto", _const(PROTO), True), ("cmd", _str(32), False)),
    "qps": _obj(("qps", _list(_QP, 1, MAX_QPS), True)),
    "barrier": _obj(("name", _str(64), True)),
    "done": _obj(("sha256", _hex(64), True), ("seconds", _N, True)),
    "verdict": _obj(("sha256", _hex(64), True), ("path", _str(4096), False)),
}
HELLOS = {      # the fields of a hello, per command
    "write-bw": _obj(("size", _int(1, MAX_MSG), True), ("qps", _int(1, MAX_QPS), True)),
    "write-lat": _obj(("size", _int(1, MAX_MSG), True), ("iters", _int(1, MAX_ITERS), True)),
    "send": _obj(("name", _file_name, True), ("size", _int(0, MAX_FILE), True), ("sha256", _hex(64), True)),
}
RESULTS = {     # a client's result, which the server prints
    "write-bw": _obj(*[(k, _int(0, 1 << 64), True) for k in ("bytes", "qps", "iterations", "payload")],
                     *[(k, _N, True) for k in ("seconds", "bw_avg_bps", "bw_peak_bps", "msg_rate_mps")],
                     ("qp_stats", _QP_STATS, True)),
    "write-lat": _obj(*[(k, _int(0, 1 << 64), True) for k in ("bytes", "iterations", "payload")],
                      *[(k, _N, True) for k in ("t_min_us", "p50_us", "p99_us", "t_max_us", "t_avg_us",
                                                "rtt_p50_us", "rtt_p99_us")]),
}


def check_msg(kind: str, obj: dict, who: str = "peer", cmd: str | None = None, n: int | None = None,
              local: str | None = None, need_mr: int | None = None) -> dict:
    """obj, a message of type kind from `who`, checked against its schema; BootstrapError
    (one line naming the field) if it does not fit.  cmd: the command a hello must ask
    for, or whose result this is; n: the QPs a qps message must have; local: our own
    address (a peer cannot have it); need_mr: the MR bytes the peer's QPs must offer
    (None: no MR needed)."""
    try:
        if kind == "hello" and cmd is not None and obj.get("cmd") != cmd:
            raise _Bad("asked for %s, this server runs %s" % (_show(obj.get("cmd")), cmd))
        schema = SCHEMAS.get(kind)
        if kind == "result" and cmd in RESULTS:
            schema = _obj(("result", RESULTS[cmd], True))
        if schema is not None:
            schema(obj)
        if kind == "hello" and cmd is not None:
            HELLOS[cmd](obj)
        if kind == "qps":
            if n is not None and len(obj["qps"]) != n:
                raise _Bad("qps has %d entries, this side has %d QPs" % (len(obj["qps"]), n))
            for i, q in enumerate(obj["qps"]):
                _qp_context(q, "qps[%d]." % i, local, need_mr)
    except _Bad as e:
        raise BootstrapError("%s: %s" % (who, e.args[0])) from None
    return obj


def _qp_context(q: dict, where: str, local, need_mr) -> None:
    if local is not None and ipaddress.IPv6Address(q["addr"]) == ipaddress.IPv6Address(local):
        raise _Bad("%saddr=%s is this host's own address" % (where, q["addr"]))
    if need_mr is None:
        return
    mr = q.get("mr")
    if mr is None:
        raise _Bad("%smr is missing" % where)
    if mr["length"] < need_mr:
        raise _Bad("%smr.length=%d is less than the %d bytes to write" % (where, mr["length"], need_mr))
    if mr["addr"] + mr["length"] > 1 << 64:
        raise _Bad("%smr.addr=%#x + mr.length runs past the end of memory" % (where, mr["addr"]))



# ------------------------------------------------------------------ QP attributes

def qp_attrs(qp, mr=None) -> dict:
    """A transport QP's attributes (and its MR's, if given) for the peer."""
    d = dict(qp.local_attrs())
    if mr is not None:
        d["mr"] = mr.attrs()
    return d


def check_qp_attrs(d, who: str = "peer", local: str | None = None, need_mr: int | None = None) -> dict:
    """Validate one QP's attributes received from a peer (the schema of a qps entry);
    BootstrapError naming the bad field."""
    try:
        if not isinstance(d, dict):
            raise _Bad("QP attributes must be an object, got %s" % _show(d))
        _QP(d)
        _qp_context(d, "", local, need_mr)
    except _Bad as e:
        raise BootstrapError("%s: %s" % (who, e.args[0])) from None
    return d
