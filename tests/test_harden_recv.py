"""`mrc-xdp send` / `recv`, `write-bw` and `write-lat` attacked as an attacker and a
careless user would (issue 15, items 4, 6, 7, 8 and 11).

The servers and clients are the real CLI on a live pair of datapaths (tests/perf_pair.py);
hostile peers are raw TCP sockets speaking (or not speaking) the bootstrap's JSON lines.
A server that rejects a client logs one line and keeps waiting for a real one; a client
that gets nonsense ends with one line and exit 1; nothing is left behind in DIR, in the
datapath (connections) or in /run/mrc-xdp/qps.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from mrc_xdp.transport import bootstrap as bs
from mrc_xdp.transport import conns, perf
from mrc_xdp.datapath import netns
from mrc_xdp import transport
from perf_pair import A_ADDR, B_ADDR, B_CTL, make_pair

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, AF_XDP, netns)")

CLI = [sys.executable, "-m", "mrc_xdp.cli"]
SHA = "0" * 64
_ports = iter(range(20000 + os.getpid() % 500 * 20, 1 << 16))


@pytest.fixture(scope="module")
def pair():
    yield from make_pair("hr")


# ------------------------------------------------------------------ harness

class Server:
    """A CLI server in B's namespace; stderr read line by line as it comes."""

    def __init__(self, pair, args, accept_timeout=60.0, extra=()):
        self.port = next(_ports)
        self.p = subprocess.Popen(CLI + list(args) + ["-i", pair["b"], "--bind", B_CTL, "--port", str(self.port),
                                                      "--accept-timeout", str(accept_timeout)] + list(extra),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.out = ""
        self.done = False

    def wait_line(self, text: str, timeout: float = 20.0, since: int = 0) -> str:
        """The first stderr line containing text, from line `since` on (AssertionError
        with all stderr if none comes)."""
        end = time.monotonic() + timeout
        while True:
            for ln in self.err[since:]:
                if text in ln:
                    return ln
            left = end - time.monotonic()
            if left <= 0 or self.p.stderr is None:
                break
            r, _, _ = select.select([self.p.stderr], [], [], left)
            if not r:
                break
            ln = self.p.stderr.readline()
            if not ln:             # exited
                break
            self.err.append(ln.rstrip("\n"))
        raise AssertionError("no line with %r from the server (rc %s): %s" % (text, self.p.poll(), self.err))

    def finish(self, timeout: float = 30.0) -> int:
        """Wait for the exit; the rest of stderr into self.err."""
        if self.done:
            return self.p.returncode
        try:
            out, rest = self.p.communicate(timeout=timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.communicate()
        self.out, self.done = out, True
        self.err += rest.splitlines()
        return self.p.returncode

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
        try:
            self.finish(10)
        except subprocess.TimeoutExpired:
            pass


def _connect(ns: str, port: int, timeout: float = 20.0) -> socket.socket:
    """A raw TCP connection from ns to [B_CTL]:port, retried while the server starts."""
    end = time.monotonic() + timeout
    while True:
        s = netns.run(ns, socket.socket, socket.AF_INET6, socket.SOCK_STREAM)
        try:
            s.connect((B_CTL, port))
            return s
        except OSError:
            s.close()
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def _reply(s: socket.socket, timeout: float = 15.0) -> bytes:
    """One line from the server (b"" if it closed without one)."""
    s.settimeout(timeout)
    buf = b""
    try:
        while b"\n" not in buf:
            c = s.recv(65536)
            if not c:
                break
            buf += c
    except socket.timeout:
        pass
    return buf.split(b"\n")[0]


def _line(obj) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj).encode() + b"\n"


def hello(cmd, **kw):
    return dict({"type": "hello", "proto": bs.PROTO, "cmd": cmd}, **kw)


def qp(**kw):
    mr = kw.pop("mr", {})
    d = {"addr": A_ADDR, "qpn": 0x1000, "start_psn": 1, "mtu": 3328,
         "mr": dict({"addr": 0x7f0000000000, "length": 1 << 20, "rkey": 1}, **mr)}
    d.update(kw)
    return d


def qps(*entries):
    return {"type": "qps", "qps": list(entries) or [qp()]}


def one_line(text: str) -> None:
    assert text and "\n" not in text.strip() and "Traceback" not in text, text


def _published(inst: str) -> list:
    d = os.path.join(transport.QP_STATS_DIR, inst)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _nothing_behind(pair):
    for n in (pair["a"], pair["b"]):
        assert conns.list_(n) == [] and _published(n) == [], n


def send_hello(size=100, name="x.bin", **kw):
    return hello("send", name=name, size=size, sha256=SHA, **kw)


# ------------------------------------------------------------------ item 8: bootstrap input on the servers

DEEP = b'{"type":"hello","proto":"mrc-xdp/1","cmd":"send","x":' + b"[" * 100000 + b"\n"
SERVER_CASES = [
    # (id, server command, lines the client sends, text the rejection names)
    ("recv size abc", "recv", [send_hello(size="abc")], "size"),
    ("recv size NaN", "recv", [b'{"type":"hello","proto":"mrc-xdp/1","cmd":"send","name":"x.bin","size":NaN,'
                               b'"sha256":"%s"}\n' % SHA.encode()], "NaN"),
    ("recv size inf", "recv", [b'{"type":"hello","proto":"mrc-xdp/1","cmd":"send","name":"x.bin",'
                               b'"size":1e999,"sha256":"%s"}\n' % SHA.encode()], "size"),
    ("recv size 2^62", "recv", [send_hello(size=1 << 62)], "size"),
    ("recv size 2^63", "recv", [send_hello(size=1 << 63)], "size"),
    ("recv size -1", "recv", [send_hello(size=-1)], "size"),
    ("recv no sha256", "recv", [hello("send", name="x.bin", size=5)], "sha256"),
    ("recv name NUL", "recv", [send_hello(name="a\0b")], "name"),
    ("recv name 300", "recv", [send_hello(name="n" * 300)], "name"),
    ("recv name slash", "recv", [send_hello(name="../x.bin")], "name"),
    ("recv name dir", "recv", [send_hello(name="sub")], "sub"),
    ("recv deep JSON", "recv", [DEEP], "nested"),
    ("recv garbage", "recv", [b"GET / HTTP/1.0\r\n\r\n"], "not JSON"),
    ("recv not object", "recv", [b"[1, 2]\n"], "object"),
    ("recv wrong cmd", "recv", [hello("write-bw", size=10, qps=1)], "write-bw"),
    ("recv no qps key", "recv", [send_hello(), {"type": "qps"}], "qps"),
    ("recv two qps", "recv", [send_hello(), qps(qp(), qp())], "qps"),
    ("recv addr ::", "recv", [send_hello(), qps(qp(addr="::"))], "addr"),
    ("recv multicast", "recv", [send_hello(), qps(qp(addr="ff02::1"))], "addr"),
    ("recv own addr", "recv", [send_hello(), qps(qp(addr=B_ADDR))], "addr"),
    ("recv scoped", "recv", [send_hello(), qps(qp(addr="fe80::1%p0"))], "addr"),
    ("recv mtu 4", "recv", [send_hello(), qps(qp(mtu=4))], "mtu"),
    ("recv mr 2^63", "recv", [send_hello(), qps(qp(mr={"length": 1 << 63}))], "mr.length"),
    ("bw size abc", "write-bw", [hello("write-bw", size="abc", qps=1)], "size"),
    ("bw size NaN", "write-bw", [b'{"type":"hello","proto":"mrc-xdp/1","cmd":"write-bw","size":NaN}\n'], "NaN"),
    ("bw size inf", "write-bw", [b'{"type":"hello","proto":"mrc-xdp/1","cmd":"write-bw","size":Infinity}\n'],
     "Infinity"),
    ("bw size 2^63", "write-bw", [hello("write-bw", size=1 << 63, qps=1)], "size"),
    ("bw qps 0", "write-bw", [hello("write-bw", size=64, qps=0)], "qps"),
    ("bw no qps key", "write-bw", [hello("write-bw", size=64, qps=1), {"type": "qps"}], "qps"),
    ("bw qps not list", "write-bw", [hello("write-bw", size=64, qps=1), {"type": "qps", "qps": 5}], "qps"),
    ("bw deep JSON", "write-bw", [DEEP.replace(b'"send"', b'"write-bw"')], "nested"),
    ("bw mtu 4", "write-bw", [hello("write-bw", size=64, qps=1), qps(qp(mtu=4))], "mtu"),
    ("lat iters abc", "write-lat", [hello("write-lat", size=8, iters="abc")], "iters"),
    ("lat iters NaN", "write-lat", [b'{"type":"hello","proto":"mrc-xdp/1","cmd":"write-lat","iters":NaN}\n'],
     "NaN"),
    ("lat size 2^62", "write-lat", [hello("write-lat", size=1 << 62, iters=5)], "size"),
    ("lat no qps key", "write-lat", [hello("write-lat", size=8, iters=5), {"type": "qps"}], "qps"),
    ("lat own addr", "write-lat", [hello("write-lat", size=8, iters=5), qps(qp(addr=B_ADDR))], "addr"),
]


@pytest.fixture(scope="module")
def servers(pair, tmp_path_factory):
    """One waiting server per command, for every hostile client of the table (each is
    rejected and the server waits on); recv's DIR holds one directory, "sub"."""
    d = tmp_path_factory.mktemp("recv") / "in"
    (d / "sub").mkdir(parents=True)
    out = {cmd: Server(pair, [cmd] + ([str(d)] if cmd == "recv" else []), accept_timeout=600)
           for cmd in ("recv", "write-bw", "write-lat")}
    out["dir"] = d
    try:
        yield out
    finally:
        for cmd in ("recv", "write-bw", "write-lat"):
            out[cmd].stop()


@pytest.mark.parametrize("cmd,lines,why", [c[1:] for c in SERVER_CASES], ids=[c[0] for c in SERVER_CASES])
def test_server_rejects_bad_bootstrap_input(pair, servers, cmd, lines, why):
    """The server logs one line naming what was wrong, tells the client (one line) and
    keeps waiting; DIR gets nothing."""
    srv = servers[cmd]
    since = len(srv.err)
    assert srv.p.poll() is None, ("the server is gone", srv.err)
    s = _connect(pair["a"], srv.port)
    with s:
        for ln in lines:
            s.sendall(_line(ln))
        rep = _reply(s)
    ln = srv.wait_line("rejected", since=since)
    assert why in ln, (ln, srv.err)
    assert srv.p.poll() is None, ("the server stopped waiting", srv.err)
    err = json.loads(rep)["error"]           # the client is told, in one line
    one_line(err)
    assert why in err, err
    time.sleep(0.05)                         # nothing more comes
    r, _, _ = select.select([srv.p.stderr], [], [], 0)
    assert not r and srv.err[since:] == [ln], srv.err[since:]
    assert sorted(os.listdir(servers["dir"])) == ["sub"]
    _nothing_behind(pair)


# ------------------------------------------------------------------ item 8: what a client is answered

def _fake_server(pair, port, answers, got):
    """Accept one client in B's namespace, read its hello and qps, answer `answers`, then
    hold the connection until the client closes it."""
    lst = netns.run(pair["b"], socket.socket, socket.AF_INET6, socket.SOCK_STREAM)
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind((B_CTL, port))
    lst.listen(1)
    lst.settimeout(30)

    def run():
        try:
            c, _ = lst.accept()
        except OSError:
            return
        with c, lst:
            c.settimeout(30)
            buf = b""
            while buf.count(b"\n") < 2:
                chunk = c.recv(65536)
                if not chunk:
                    return
                buf += chunk
            got.extend(json.loads(x) for x in buf.split(b"\n")[:2])
            for a in answers:
                c.sendall(_line(a))
            while c.recv(65536):
                pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def sqp(**kw):
    """A server's QP attributes (the client runs on A)."""
    return qp(**dict({"addr": B_ADDR}, **kw))


CLIENT_CASES = [
    ("no qps key", ["write-bw"], [{"type": "qps"}], "qps is missing"),
    ("qps not a list", ["write-bw"], [{"type": "qps", "qps": {"a": 1}}], "is not a list"),
    ("no mr", ["write-bw"], [{"type": "qps", "qps": [{k: v for k, v in sqp().items() if k != "mr"}]}],
     "qps[0].mr is missing"),
    ("mr too short", ["write-bw"], [qps(sqp(mr={"length": 100}))], "qps[0].mr.length=100 is less than"),
    ("addr ::", ["write-lat"], [qps(sqp(addr="::"))], "qps[0].addr='::' is not a peer's address"),
    ("own addr", ["write-lat"], [qps(sqp(addr=A_ADDR))], "this host's own address"),
    ("deep JSON", ["write-bw"], [b'{"type":"qps","qps":' + b"[" * 100000 + b"\n"], "nested"),
    ("NaN", ["write-bw"], [b'{"type":"qps","qps":[{"addr":"fd00:7a::b","qpn":NaN}]}\n'], "NaN"),
    ("error over lines", ["write-bw"], [{"error": "bad\nworse\n" * 400}], "bad worse bad"),
    # an empty file needs no RDMA Write: the sender reaches the receiver's verdict at once
    ("verdict no sha256", ["send", "EMPTY"], [qps(sqp()), {"type": "barrier", "name": "go"}, {"type": "verdict"}],
     "sha256 is missing"),
]


@pytest.mark.parametrize("cmd,answers,why", [c[1:] for c in CLIENT_CASES], ids=[c[0] for c in CLIENT_CASES])
def test_client_rejects_bad_server_answers(pair, tmp_path, cmd, answers, why):
    port = next(_ports)
    got = []
    (tmp_path / "empty").write_bytes(b"")
    argv = [str(tmp_path / "empty") if a == "EMPTY" else a for a in cmd] + [B_CTL]
    if cmd[0] != "send":
        argv += ["--size", "4096"]
    t = _fake_server(pair, port, answers, got)
    r = subprocess.run(CLI + argv + ["-i", pair["a"], "--port", str(port), "--timeout", "15"],
                       capture_output=True, text=True, timeout=60)
    t.join(30)
    assert r.returncode == 1, (r.returncode, r.stderr)
    one_line(r.stderr)
    assert r.stderr.startswith("mrc-xdp %s: " % cmd[0]) and why in r.stderr, r.stderr
    assert len(r.stderr) < 1000, r.stderr
    assert got and got[0]["type"] == "hello"
    _nothing_behind(pair)


# ------------------------------------------------------------------ item 4: recv and the files in DIR

def _files(tmp_path):
    d, out = tmp_path / "in", tmp_path / "outside"
    d.mkdir()
    out.mkdir()
    (out / "target").write_bytes(b"precious")
    return d, out


FILE_CASES = [
    # (id, prepare DIR (d, outside), what must hold afterwards)
    ("symlink to a file outside", lambda d, o: os.symlink(o / "target", d / "x.bin"),
     lambda d, o: (o / "target").read_bytes() == b"precious" and os.readlink(d / "x.bin") == str(o / "target")),
    ("dangling symlink", lambda d, o: os.symlink(o / "new", d / "x.bin"),
     lambda d, o: not os.path.lexists(o / "new") and os.path.islink(d / "x.bin")),
    ("existing file", lambda d, o: (d / "x.bin").write_bytes(b"keep me"),
     lambda d, o: (d / "x.bin").read_bytes() == b"keep me"),
]


@pytest.mark.parametrize("prepare,holds", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_recv_never_touches_an_existing_name(pair, tmp_path, prepare, holds):
    """Without --overwrite an existing name (file, symlink, dangling symlink) is refused at
    the sender's hello: nothing is opened through it, nothing is created."""
    d, o = _files(tmp_path)
    prepare(d, o)
    before = sorted(os.listdir(d))
    srv = Server(pair, ["recv", str(d)])
    try:
        with _connect(pair["a"], srv.port) as s:
            s.sendall(_line(send_hello(size=100)) + _line(qps()))
            rep = _reply(s)
        assert "exists" in srv.wait_line("rejected") and "--overwrite" in json.loads(rep)["error"]
    finally:
        srv.stop()
    assert holds(d, o)
    assert sorted(os.listdir(d)) == before and sorted(os.listdir(o)) == ["target"]


def test_recv_creates_nothing_before_the_transfer_is_agreed(pair, tmp_path):
    """A sender that says hello and leaves: no file appears in DIR (the QP exchange is
    what agrees the transfer)."""
    d, _ = _files(tmp_path)
    srv = Server(pair, ["recv", str(d)], accept_timeout=3)
    try:
        with _connect(pair["a"], srv.port) as s:
            s.sendall(_line(send_hello(size=1 << 20)))
            time.sleep(0.5)
            assert os.listdir(d) == []
        assert srv.finish(30) == 1
    finally:
        srv.stop()
    assert os.listdir(d) == []
    assert "Traceback" not in "\n".join(srv.err), srv.err


def test_recv_overwrite_replaces_the_name_not_a_symlink_target(pair, tmp_path):
    """--overwrite replaces the file of that name, and a symlink of that name itself (its
    target outside DIR keeps its content); a transfer leaves no temporary file behind."""
    d, o = _files(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    os.symlink(o / "target", d / "x.bin")
    (d / "y.bin").write_bytes(b"old content")
    for name in ("x.bin", "y.bin"):
        data = os.urandom(300000)
        (src / name).write_bytes(data)
        srv = Server(pair, ["recv", str(d), "--overwrite", "--json"])
        try:
            r = subprocess.run(CLI + ["send", str(src / name), B_CTL, "-i", pair["a"], "--port", str(srv.port),
                                      "--json"], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            assert srv.finish(30) == 0, srv.err
        finally:
            srv.stop()
        assert not os.path.islink(d / name) and (d / name).read_bytes() == data
    assert (o / "target").read_bytes() == b"precious"
    assert sorted(os.listdir(d)) == ["x.bin", "y.bin"]
    _nothing_behind(pair)
    assert "--overwrite" in subprocess.run(CLI + ["recv", "--help"], capture_output=True, text=True).stdout


# ------------------------------------------------------------------ item 6: a full file system

@pytest.fixture
def small_fs(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.parametrize("size", [64 << 20, 1 << 40], ids=["64MiB", "1TiB"])
def test_recv_refuses_a_file_that_does_not_fit(pair, tmp_path, small_fs, size):
    """recv reserves the declared size before anything else; what does not fit is refused
    in one line on both sides (the sender does not see RETRY_EXC_ERR), and nothing is left
    behind: no file, no connection, no published QP file."""
    if size <= 64 << 20:
        src = tmp_path / "big.bin"
        with open(src, "wb") as f:
            f.write(os.urandom(1 << 20) * (size >> 20))
        argv = ["send", str(src), B_CTL]
    else:       # a sender that declares a 1 TiB file: the bootstrap alone
        argv = None
    srv = Server(pair, ["recv", str(small_fs)])
    try:
        if argv:
            r = subprocess.run(CLI + argv + ["-i", pair["a"], "--port", str(srv.port), "--timeout", "10"],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 1, r.stderr
            one_line(r.stderr)
            assert "free" in r.stderr and "RETRY_EXC_ERR" not in r.stderr, r.stderr
        else:
            with _connect(pair["a"], srv.port) as s:
                s.sendall(_line(send_hello(size=size, name="huge.bin")) + _line(qps()))
                assert "free" in json.loads(_reply(s))["error"]
        ln = srv.wait_line("rejected")
        assert "free" in ln and srv.p.poll() is None, srv.err
    finally:
        srv.stop()
    assert srv.p.returncode != -signal.SIGBUS, srv.err
    assert "Traceback" not in "\n".join(srv.err), srv.err
    assert os.listdir(small_fs) == []
    assert os.statvfs(small_fs).f_bfree == os.statvfs(small_fs).f_blocks
    _nothing_behind(pair)


# ------------------------------------------------------------------ item 7: silent and stray peers

@pytest.mark.parametrize("cmd", ["recv", "write-bw", "write-lat"])
def test_silent_connection_does_not_outlast_accept_timeout(pair, tmp_path, cmd):
    """A connection that sends nothing holds a server no longer than --accept-timeout."""
    srv = Server(pair, [cmd] + ([str(tmp_path)] if cmd == "recv" else []), accept_timeout=2)
    t0 = time.monotonic()
    try:
        with _connect(pair["a"], srv.port):
            rc = srv.finish(timeout=12)
    finally:
        srv.stop()
    assert rc == 1 and time.monotonic() - t0 < 12
    assert "no client connected" in srv.err[-1] and "Traceback" not in "\n".join(srv.err), srv.err


def test_stray_connections_do_not_end_a_waiting_server(pair, tmp_path):
    """A silent connection and a garbage one come first; the real sender that follows is
    served (the garbage is rejected with a log line)."""
    d = tmp_path / "in"
    d.mkdir()
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(100000))
    srv = Server(pair, ["recv", str(d), "--json"])
    try:
        silent = _connect(pair["a"], srv.port)
        with _connect(pair["a"], srv.port) as g:
            g.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
            _reply(g)
        r = subprocess.run(CLI + ["send", str(src), B_CTL, "-i", pair["a"], "--port", str(srv.port), "--json"],
                           capture_output=True, text=True, timeout=120)
        silent.close()
        assert r.returncode == 0, r.stderr
        assert srv.finish(30) == 0, srv.err
    finally:
        srv.stop()
    assert (d / "f.bin").read_bytes() == src.read_bytes()
    assert len([e for e in srv.err if "rejected" in e and "not JSON" in e]) == 1, "\n".join(srv.err)
    _nothing_behind(pair)


def test_many_silent_connections_do_not_hide_a_client():
    """More silent connections than the listener keeps waiting at once, then a client:
    the oldest silent ones are dropped (logged), the client is served before any hello
    is due (the bootstrap alone, over loopback)."""
    port = next(_ports)
    log, got = [], {}
    with bs.Listener(port, bind="::1") as lst:
        def serve():
            try:
                got["ch"] = lst.accept(timeout=bs.HELLO_TIMEOUT - 2, log=log.append)
            except bs.BootstrapError as e:
                got["error"] = e
        t = threading.Thread(target=serve)
        t.start()
        silent = []
        try:
            for _ in range(bs.MAX_PENDING + 4):
                silent.append(socket.create_connection(("::1", port), timeout=15))
            with bs.connect("::1", port, timeout=5, hello={"cmd": "write-bw"}):
                t.join(bs.HELLO_TIMEOUT)
        finally:
            for s in silent:
                s.close()
    assert "ch" in got and got["ch"].hello["cmd"] == "write-bw", got
    got["ch"].close()
    assert len(log) >= 4 and all("too many connections" in ln for ln in log), log


class SilentClient:
    """A real client (an endpoint on A, a QP connected to the server's) that goes silent
    after the server said go, without closing its TCP connection."""

    def __init__(self, pair, port, hello_fields):
        self.ep = transport.Endpoint(pair["a"], pair["a"], publish=None)
        self.mr = self.ep.reg_mr(bytearray(1 << 16))
        self.qp = self.ep.create_qp()
        self.ch = bs.connect(B_CTL, port, timeout=20, ns=pair["a"], hello=hello_fields)
        self.ch.send({"type": "qps", "qps": [bs.qp_attrs(self.qp, self.mr)]})
        self.qp.connect(self.ch.expect("qps", 20)["qps"][0])
        self.ch.barrier("go", 20)

    def close(self):
        self.ch.close()
        self.qp.destroy()
        self.ep.close()


@pytest.mark.parametrize("cmd", ["recv", "write-bw"])
def test_silent_peer_after_go_is_given_up(pair, tmp_path, cmd):
    """A sender that vanished once the QPs are up: the server gives up after --timeout
    without progress (not days later), in one line, and leaves no partial file."""
    d = tmp_path / "in"
    d.mkdir()
    srv = Server(pair, [cmd] + ([str(d)] if cmd == "recv" else []), extra=["--timeout", "2"])
    c = None
    try:
        h = {"cmd": "send", "name": "x.bin", "size": 8 << 20, "sha256": SHA} if cmd == "recv" else \
            {"cmd": "write-bw", "size": 65536, "qps": 1}
        c = SilentClient(pair, srv.port, h)
        t0 = time.monotonic()
        rc = srv.finish(timeout=30)
        assert rc == 1 and time.monotonic() - t0 < 30, srv.err
    finally:
        srv.stop()
        if c:
            c.close()
    one_line(srv.err[-1])
    assert "no data" in srv.err[-1] and "Traceback" not in "\n".join(srv.err), srv.err
    assert os.listdir(d) == []
    _nothing_behind(pair)


def test_stopped_sender_is_given_up(pair, tmp_path):
    """A real `send` stopped (SIGSTOP) once the receiver has its file: the receiver gives
    up after --timeout without progress, in one line, and keeps nothing; the sender,
    continued, fails in one line and leaves no connection behind.  (Small packets keep the
    transfer long enough to be caught midway; wherever it is caught, the waits are
    bounded.)"""
    d = tmp_path / "in"
    d.mkdir()
    src = tmp_path / "big.bin"
    with open(src, "wb") as f:
        f.write(os.urandom(1 << 20) * 64)
    srv = Server(pair, ["recv", str(d)], extra=["--timeout", "2"])
    snd = subprocess.Popen(CLI + ["send", str(src), B_CTL, "-i", pair["a"], "--port", str(srv.port),
                                  "--timeout", "5", "--mtu", "256"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while not os.listdir(d) and time.monotonic() < end and snd.poll() is None:
            time.sleep(0.02)
        snd.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        rc = srv.finish(timeout=30)
        assert rc == 1 and time.monotonic() - t0 < 30, srv.err
    finally:
        srv.stop()
        snd.send_signal(signal.SIGCONT)
        _, serr = snd.communicate(timeout=60)
    one_line(srv.err[-1])
    assert "Traceback" not in "\n".join(srv.err), srv.err
    assert snd.returncode == 1 and "Traceback" not in serr, serr
    one_line(serr)
    assert os.listdir(d) == []
    _nothing_behind(pair)


# ------------------------------------------------------------------ item 11: the sender's mapping

def test_failed_send_unmaps_its_file(pair, tmp_path):
    """A send that fails (nobody listens) has unmapped the file when it returns, without
    waiting for the garbage collector."""
    src = tmp_path / "mapped.bin"
    src.write_bytes(os.urandom(1 << 20))
    gc.disable()
    try:
        with pytest.raises(bs.BootstrapError):
            perf.send_file(str(src), B_CTL, pair["a"], ns=pair["a"], port=next(_ports), timeout=0.5)
        with open("/proc/self/maps") as f:
            maps = f.read()
    finally:
        gc.enable()
    assert str(src) not in maps
    _nothing_behind(pair)


def test_corrupt_transfer_leaves_no_file(pair, tmp_path):
    """A sender whose data does not match the sha256 it announced: recv says so in one
    line and keeps nothing under the file's name (nor a temporary file)."""
    d = tmp_path / "in"
    d.mkdir()
    srv = Server(pair, ["recv", str(d)], extra=["--timeout", "5"])
    c = None
    try:
        c = SilentClient(pair, srv.port, {"cmd": "send", "name": "x.bin", "size": 1000,
                                          "sha256": hashlib.sha256(b"other").hexdigest()})
        c.ch.send({"type": "done", "sha256": hashlib.sha256(b"other").hexdigest(), "seconds": 0.1})
        v = c.ch.expect("verdict", 20)
        assert v["sha256"] == hashlib.sha256(bytes(1000)).hexdigest()
        c.ch.barrier("done", 20)
        assert srv.finish(30) == 1
    finally:
        srv.stop()
        if c:
            c.close()
    one_line(srv.err[-1])
    assert "corrupted" in srv.err[-1], srv.err
    assert os.listdir(d) == []
    _nothing_behind(pair)
