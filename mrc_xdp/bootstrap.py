"""Out-of-band bootstrap: QP attributes exchanged over a small TCP connection, as MRC
(and perftest) do.

The server listens on the host's control address (default port 18515, perftest's),
the client connects; each side sends JSON lines.  The channel stays open for the
life of a test so the two sides can also synchronise (``barrier``) and exchange
results.  Every failure is a ``BootstrapError`` whose message is one line saying what
failed and what to do.

Attributes of one QP (``qp_attrs``)::

    {"addr": "<MRC IPv6>", "qpn": 256, "start_psn": 123, "mtu": 3328,
     "mr": {"addr": 140..., "length": 1048576, "rkey": 17}}

In the lab, TCP between hosts runs over the fabric: our XDP programs pass non-MRC
frames unchanged, and the link models treat them like any frame.  The lab's switches
only route host MRC addresses (ecmp) or uSIDs (srv6), so ``lab_control_path`` gives
every host one control address per plane NIC, ``<base>:ff0<plane>::<n+1>``, with
static routes on that plane's switches (T0s hash over the T1s).  The address of plane 0
is the host's control address.
"""
from __future__ import annotations

import ipaddress
import json
import socket
import time

from . import netns

DEFAULT_PORT = 18515
PROTO = "mrc-xdp/1"
MAX_LINE = 1 << 20


class BootstrapError(RuntimeError):
    """One line: what failed, what to do."""


def _family(host: str) -> int:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET6


class Channel:
    """A connected JSON-lines channel."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self._buf = b""

    def send(self, obj: dict) -> None:
        try:
            self.sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        except OSError as e:
            raise BootstrapError("bootstrap: sending to %s failed (%s): is the peer still running?"
                                 % (self.peer, e.strerror or e)) from None

    def recv(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BootstrapError("bootstrap: no answer from %s within %.0f s: is the peer "
                                     "running (and its control address reachable)?" % (self.peer, timeout))
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError as e:
                raise BootstrapError("bootstrap: reading from %s failed (%s)" % (self.peer, e.strerror or e)) from None
            if not chunk:
                raise BootstrapError("bootstrap: %s closed the connection (the peer stopped or "
                                     "failed: see its output)" % self.peer)
            self._buf += chunk
            if len(self._buf) > MAX_LINE:
                raise BootstrapError("bootstrap: %s sent a line over %d bytes: not an mrc-xdp peer" % (self.peer, MAX_LINE))
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            obj = json.loads(line)
        except ValueError:
            raise BootstrapError("bootstrap: %s sent something that is not JSON (%r...): not an "
                                 "mrc-xdp peer on this port?" % (self.peer, line[:40])) from None
        if not isinstance(obj, dict):
            raise BootstrapError("bootstrap: %s sent %r, expected a JSON object" % (self.peer, obj))
        if obj.get("error"):
            raise BootstrapError("peer %s: %s" % (self.peer, obj["error"]))
        return obj

    def expect(self, kind: str, timeout: float = 30.0) -> dict:
        obj = self.recv(timeout)
        if obj.get("type") != kind:
            raise BootstrapError("bootstrap: expected %r from %s, got %r" % (kind, self.peer, obj.get("type")))
        return obj

    def barrier(self, name: str, timeout: float = 60.0) -> None:
        """Both sides reach the same named point."""
        self.send({"type": "barrier", "name": name})
        got = self.expect("barrier", timeout)
        if got.get("name") != name:
            raise BootstrapError("bootstrap: out of step with %s (at %r, peer at %r)" % (self.peer, name, got.get("name")))

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
            s.listen(8)
            return s
        try:
            self.sock = netns.run(ns, mk)
        except OSError as e:
            raise BootstrapError("bootstrap: cannot listen on [%s]:%d%s (%s): pick another --port"
                                 % (bind, port, " in netns %s" % ns if ns else "", e.strerror or e)) from None

    def accept(self, timeout: float | None = None) -> Channel:
        self.sock.settimeout(timeout)
        try:
            s, addr = self.sock.accept()
        except socket.timeout:
            raise BootstrapError("bootstrap: no client connected to port %d within %g s" % (self.port, timeout)) from None
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(None)
        ch = Channel(s, "[%s]:%d" % addr[:2])
        hello = ch.recv(30)
        if hello.get("type") != "hello" or hello.get("proto") != PROTO:
            ch.send({"error": "expected an %s hello" % PROTO})
            ch.close()
            raise BootstrapError("bootstrap: %s is not an %s client (%r)" % (ch.peer, PROTO, hello))
        ch.hello = hello
        return ch

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


# ------------------------------------------------------------------ QP attributes

def qp_attrs(qp, mr=None) -> dict:
    """A transport QP's attributes (and its MR's, if given) for the peer."""
    d = dict(qp.local_attrs())
    if mr is not None:
        d["mr"] = mr.attrs()
    return d


def check_qp_attrs(d, who: str = "peer") -> dict:
    """Validate attributes received from a peer; BootstrapError naming the bad field."""
    if not isinstance(d, dict):
        raise BootstrapError("%s: QP attributes must be an object, got %r" % (who, d))

    def need(obj, key, lo, hi, where):
        v = obj.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise BootstrapError("%s: %s%s=%r is missing or out of range (%d..%d)" % (who, where, key, v, lo, hi))
    try:
        ipaddress.IPv6Address(d.get("addr"))
    except (ValueError, TypeError):
        raise BootstrapError("%s: addr=%r is not an IPv6 address" % (who, d.get("addr"))) from None
    need(d, "qpn", 1, 0xFFFFFF, "")
    need(d, "start_psn", 0, 0xFFFFFF, "")
    need(d, "mtu", 4, 1 << 16, "")
    if "mr" in d:
        mr = d["mr"]
        if not isinstance(mr, dict):
            raise BootstrapError("%s: mr must be an object {addr, length, rkey}" % who)
        need(mr, "addr", 0, (1 << 64) - 1, "mr.")
        need(mr, "length", 0, (1 << 64) - 1, "mr.")
        need(mr, "rkey", 0, 0xFFFFFFFF, "mr.")
    return d


# ------------------------------------------------------------------ lab control path

CTL_SUBNET = 0xff00     # <base>:ff0<plane>::<host number + 1>


def ctl_addr(topo, plane: int, host: str) -> str:
    base = int(topo.base.network_address)
    return str(ipaddress.IPv6Address(base | (CTL_SUBNET + plane) << 80 | (topo.host(host).index + 1)))


def lab_control_path(prefix: str, topo=None, execs=None) -> dict:
    """Give every lab host one control address per plane NIC, C(p, h), routed over the
    fabric (idempotent).  Every plane's switches route every control address (T0s hash
    over their T1s by L4 ports), so the plane a packet takes is chosen by its sender:
    a host sends to C(p, g) over plane p, and whatever it sends from its own C(p, h) over
    plane p too (policy rule ``from C(p, h) lookup 100+p``), which lets MPTCP put one
    subflow on each plane.  execs: {node: executor} of a VM lab (mrc_xdp.lab.vm, the same
    lines over SSH); None: the netns lab `prefix`.  Returns {host: [C(0, h), C(1, h), ...]}."""
    import subprocess
    from .lab import fabric
    if topo is None:
        topo = fabric.topology_of(fabric.load_state(prefix))
    P = range(topo.planes)
    cmds: dict[str, list[str]] = {}
    for h in topo.hosts:
        c = cmds.setdefault(h.name, [])
        for p in P:
            gw = topo.port(h.name, "p%d" % p).peer.addr
            me = ctl_addr(topo, p, h.name)
            c.append("address replace %s/128 dev p%d nodad" % (me, p))
            c.append("rule del from %s/128 lookup %d" % (me, 100 + p))
            c.append("rule add from %s/128 lookup %d pref %d" % (me, 100 + p, 1000 + p))
            for g in topo.hosts:
                if g.name == h.name:
                    continue
                c.append("route replace %s/128 via %s dev p%d src %s"
                         % (ctl_addr(topo, p, g.name), gw, p, me))
                for q in P:
                    c.append("route replace %s/128 via %s dev p%d table %d"
                             % (ctl_addr(topo, q, g.name), gw, p, 100 + p))
    for name, n in topo.nodes.items():
        if n.kind == "host":
            continue
        c = cmds.setdefault(name, [])
        by_peer = {pt.peer.node: pt for pt in n.ports}
        for h in topo.hosts:
            for q in P:
                a = ctl_addr(topo, q, h.name)
                if n.kind == "t0" and h.t0 == n.index:
                    pt = by_peer[h.name]
                    c.append("route replace %s/128 via %s dev %s" % (a, pt.peer.addr, pt.ifname))
                elif n.kind == "t0":
                    hops = " ".join("nexthop via %s dev %s" % (by_peer[topo.t1_name(n.plane, j)].peer.addr,
                                                               by_peer[topo.t1_name(n.plane, j)].ifname)
                                    for j in range(topo.t1_per_plane))
                    c.append("route replace %s/128 %s" % (a, hops))
                else:
                    pt = by_peer[topo.t0_name(n.plane, h.t0)]
                    c.append("route replace %s/128 via %s dev %s" % (a, pt.peer.addr, pt.ifname))
    for node, lines in cmds.items():
        if execs is not None:
            r = execs[node].run(["ip", "-6", "-force", "-batch", "-"], input="\n".join(lines) + "\n", check=False)
        else:
            r = subprocess.run(["nsenter", "--net=/run/netns/" + prefix + node, "ip", "-6", "-force",
                                "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True)
        errs = [l for l in r.stderr.splitlines() if l.strip() and "No such file" not in l
                and "Command failed" not in l]
        if errs:
            raise BootstrapError("lab control path: %s: %s" % (node, errs[-1]))
    # the T0s hash TCP flows over the T1s by L4 ports, as they hash MRC EVs
    for n in topo.nodes.values():
        if n.kind == "t0" and execs is not None:
            execs[n.name].sysctls([("net.ipv6.fib_multipath_hash_policy", "1")])
        elif n.kind == "t0":
            netns.run(prefix + n.name, _sysctl, "net.ipv6.fib_multipath_hash_policy", "1")
    return {h.name: [ctl_addr(topo, p, h.name) for p in P] for h in topo.hosts}


def _sysctl(key: str, value: str) -> None:
    with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
        f.write(value)


def main(argv=None) -> int:
    """`python -m mrc_xdp.bootstrap lab-control-path [PREFIX]`: give a running lab's
    hosts their control addresses (prints them)."""
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="python -m mrc_xdp.bootstrap")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("lab-control-path", help="control addresses and routes for a running lab")
    p.add_argument("prefix", nargs="?", default=None, help="lab prefix (default: mrc- or $MRC_LAB_PREFIX)")
    args = ap.parse_args(argv)
    import os
    prefix = args.prefix or os.environ.get("MRC_LAB_PREFIX", "mrc-")
    try:
        addrs = lab_control_path(prefix)
    except Exception as e:      # one line, as every mrc-xdp error
        print("lab-control-path: %s" % e, file=sys.stderr)
        return 1
    for h, a in addrs.items():
        print("%s %s" % (h, " ".join(a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
