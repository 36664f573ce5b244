"""Prometheus metrics of every loaded instance, read live from the pins at each scrape.

`mrc-xdp metrics --listen 127.0.0.1:9417` serves GET /metrics (prometheus_client's
exposition over a custom collector, `PinsCollector`); `--once` prints one scrape and
exits.  Names:

    mrc_counter_total{mrc_instance,counter}                 every enum mrc_ctr counter
    mrc_ev_packets_total{mrc_instance,conn,ev,plane,t1,role} per-EV packets sent
    mrc_ev_feedback_total{...,kind}                          sack / nack / ecn / trim / loss / skipped
    mrc_ev_state{...,state}                                  1 for the EV's current state
    mrc_plane_in_rotation{mrc_instance,plane,dev}            0 while the plane is out of rotation
                                                             (its NIC down, health daemon), else 1
    mrc_qp_<counter>_total, mrc_qp_<gauge>{mrc_instance,qpn,pid}  transport engine per-QP
                                                             counters of every open Endpoint
    mrc_rx_ev_packets_total{mrc_instance,conn,ev}            data received, per sender EV
    mrc_rx_ev_ce_total{mrc_instance,conn,ev}                 of which CE-marked
    mrc_daemon_up{mrc_instance}                              1 while a health daemon follows the
                                                             instance (asked at its socket: $MRC_XDP_DAEMON_SOCKET
                                                             or /run/mrc-xdp/events.sock), else 0
    mrc_ev_probe_rtt_seconds{mrc_instance,conn,ev,plane,t1}  the daemon's smoothed probe RTT per EV
                                                             (EVs it has an answered probe of)

The instance's label is mrc_instance: Prometheus sets `instance` itself (the scraped
target) and would rename ours to exported_instance.  conn is the connection's name
everywhere.

The receive rows are keyed by what a sender writes in its packets, so anyone who can reach
a plane NIC could create them by the thousand: they are bounded here.  Data of no known
connection is one row per instance, conn="unknown", ev="other" (always there, 0 when
none came).  A known connection has at most RX_EV_PER_CONN per-EV rows (its EVs with the
most packets: a sender's EV set has at most MRC_EV_SLOTS) and an instance at most
RX_EV_SERIES_MAX; the rest add up in the connection's ev="other" row (so an instance has
at most RX_EV_SERIES_MAX + MRC_MAX_CONNS rows).  The rows are sums over the datapath's
LRU table (mrc_rxev): a row the table evicts leaves its sum.
"""
from __future__ import annotations

import io
import queue
import selectors
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler

from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from mrc_xdp.datapath import bpfsys, maps, names

FEEDBACK = ("sack", "nack", "ecn", "trim", "loss", "skipped")
QP_COUNTERS = ("tx_pkts", "tx_bytes", "rtx_pkts", "rtx_timeout", "rtx_sack", "rtx_nack_trim", "timeouts",
               "sacks_rx", "sacks_rx_ecn", "nacks_rx_trim", "nacks_rx_other", "wr_posted", "wr_done",
               "wr_error", "rx_pkts", "rx_bytes", "rx_dup", "rx_msgs", "rx_ce", "sacks_tx", "nacks_tx_trim",
               "nacks_tx_access", "sacks_tx_ecn", "ce_reported")
QP_GAUGES = ("state", "srtt_ns", "min_rtt_ns", "rto_ns", "cwnd", "inflight")
RX_EV_PER_CONN = maps.SLOTS     # receive rows of one known connection, the rest in ev="other"
RX_EV_SERIES_MAX = 4096         # receive rows of one instance, likewise
OTHER_EV = "other"

EV_LABELS = ["mrc_instance", "conn", "ev", "plane", "t1", "role"]
RX_LABELS = ["mrc_instance", "conn", "ev"]
QP_LABELS = ["mrc_instance", "qpn", "pid"]


def rx_rows(rows: list[dict]) -> list[tuple[str, str, int, int]]:
    """maps.Instance.rx_evs() bounded as the module says: (conn name, ev label, packets,
    CE-marked), the unknown connection's row first."""
    unknown = [0, 0]
    known: dict[int, list[dict]] = {}
    for r in rows:
        if r["conn_name"] == maps.UNKNOWN_CONN:
            unknown[0] += r["pkts"]
            unknown[1] += r["ce"]
        else:
            known.setdefault(r["conn"], []).append(r)
    out = [(maps.UNKNOWN_CONN, OTHER_EV, unknown[0], unknown[1])]
    room = RX_EV_SERIES_MAX - 1
    for cid in sorted(known):
        rs = sorted(known[cid], key=lambda r: -r["pkts"])
        keep = max(0, min(len(rs), RX_EV_PER_CONN, room - 1))   # - 1: room for its "other"
        rest = rs[keep:]
        out += [(r["conn_name"], "%#010x" % r["ev"], r["pkts"], r["ce"])
                for r in sorted(rs[:keep], key=lambda r: r["ev"])]
        if rest:
            out.append((rest[0]["conn_name"], OTHER_EV, sum(r["pkts"] for r in rest), sum(r["ce"] for r in rest)))
        room -= keep + bool(rest)
    return out


class PinsCollector:
    """Every family, read from the pinned maps of the instances (all loaded ones when
    None) at each scrape.  An instance unloaded during the scrape is left out of it.
    Scrapes at the same time share a reading: one that finds another reading the maps
    waits for it, then takes the next one's if that began after it asked (the time in
    self.asked.at, set by the server when the request came in; else now)."""

    def __init__(self, instances: list[str] | None = None):
        # a name that cannot be an instance is the caller's error (names.BadName), never a
        # path under the pin root to look at
        self.instances = None if instances is None else [names.check_instance(n) for n in instances]
        self.lock = threading.Lock()
        self.last, self.last_began = None, 0.0
        self.asked = threading.local()

    def collect(self):
        asked = getattr(self.asked, "at", None) or time.monotonic()
        with self.lock:
            if self.last is None or self.last_began < asked:
                self.last_began = time.monotonic()
                self.last = self._read()
            return self.last

    def _read(self) -> list:
        wanted = self.instances if self.instances is not None else maps.instances()
        ctr = CounterMetricFamily("mrc_counter", "MRC datapath counters (enum mrc_ctr), summed over CPUs.",
                                  labels=["mrc_instance", "counter"])
        evp = CounterMetricFamily("mrc_ev_packets", "Packets sprayed on each EV (path).", labels=EV_LABELS)
        evf = CounterMetricFamily("mrc_ev_feedback", "Feedback attributed to each EV, by kind.",
                                  labels=EV_LABELS + ["kind"])
        evs = GaugeMetricFamily("mrc_ev_state", "Current state of each EV (1 for the state it is in).",
                                labels=EV_LABELS + ["state"])
        pl = GaugeMetricFamily("mrc_plane_in_rotation", "1 while spray uses the plane, 0 while it is out of "
                               "rotation (its NIC down, or taken out by the operator).",
                               labels=["mrc_instance", "plane", "dev"])
        rxp = CounterMetricFamily("mrc_rx_ev_packets", "Data packets received, per sender EV (bounded: "
                                  "conn=\"unknown\" and ev=\"other\" rows add up the rest).", labels=RX_LABELS)
        rxc = CounterMetricFamily("mrc_rx_ev_ce", "Data packets received CE-marked, per sender EV.",
                                  labels=RX_LABELS)
        live, tables = [], {}
        for name in wanted:
            try:
                with maps.Instance(name) as inst:
                    counters, down = inst.counters(), inst.planes_down()
                    planes = inst.state["planes"]
                    evt, rx = inst.ev_table(), inst.rx_evs()
            except (maps.NotLoaded, OSError, bpfsys.BpfError, KeyError):
                continue            # unloaded or reloaded under our feet
            live.append(name)
            for k, v in counters.items():
                ctr.add_metric([name, k], v)
            for p, d in enumerate(down):
                pl.add_metric([name, str(p), planes[p].get("dev", "")], int(not d))
            for r in evt:
                base = [name, r["conn_name"], "%#010x" % r["ev"], str(r["plane"]), str(r["t1"]), r["role"]]
                evp.add_metric(base, r["tx_pkts"])
                for kind in FEEDBACK:
                    evf.add_metric(base + [kind], r[kind])
                evs.add_metric(base + [r["state"]], 1)
            for conn, ev, pk, ce in rx_rows(rx):
                rxp.add_metric([name, conn, ev], pk)
                rxc.add_metric([name, conn, ev], ce)
            tables[name] = evt
        return [ctr, evp, evf, evs, pl] + _qp_families(live) + [rxp, rxc] + _daemon_families(tables)


def _qp_families(instances) -> list:
    """mrc_qp_<counter>_total / mrc_qp_<gauge> of every QP of every open transport
    Endpoint (published by each endpoint under /run/mrc-xdp/qps/)."""
    from mrc_xdp.transport import published_qps
    rows = [q for name in instances for q in published_qps(name)]
    out = []
    for k, fam in [(k, CounterMetricFamily) for k in QP_COUNTERS] + [(k, GaugeMetricFamily) for k in QP_GAUGES]:
        what = "counter " + k if fam is CounterMetricFamily else k
        m = fam("mrc_qp_" + k, "Transport engine per-QP %s." % what, labels=QP_LABELS)
        for q in rows:
            m.add_metric([q["instance"], "%#x" % q["qpn"], str(q["pid"])], q.get(k, 0))
        out.append(m)
    return out


DAEMON_TIMEOUT_S = 1.0      # a daemon that has not answered its status by then counts as down


def _daemon_families(tables: dict) -> list:
    """mrc_daemon_up and mrc_ev_probe_rtt_seconds from the health daemon's status (one
    request per scrape on its socket); tables: {instance: its ev_table()}."""
    from mrc_xdp.health import daemon as health
    up = GaugeMetricFamily("mrc_daemon_up", "1 while a health daemon (mrc-xdp daemon) follows the instance.",
                           labels=["mrc_instance"])
    rtt = GaugeMetricFamily("mrc_ev_probe_rtt_seconds", "Smoothed RTT of the health daemon's probes of each EV.",
                            labels=["mrc_instance", "conn", "ev", "plane", "t1"])
    st = None
    if tables:
        g = health.request_lines({"op": "status"}, timeout=DAEMON_TIMEOUT_S)
        try:
            st = next(g, None) if g is not None else None
        except (OSError, ValueError):
            st = None
        finally:
            if g is not None:
                g.close()
    followed = (st or {}).get("instances") or {}
    for name, evt in tables.items():
        up.add_metric([name], int(name in followed))
        rows = {(r["conn"], r["ev"]): r for r in evt}
        for key, d in sorted(((followed.get(name) or {}).get("rtt") or {}).items()):
            try:
                cid, ev = (int(x) for x in key.split(":"))
            except ValueError:
                continue
            r = rows.get((cid, ev))
            if r is None or d.get("srtt") is None:
                continue
            rtt.add_metric([name, r["conn_name"], "%#010x" % ev, str(r["plane"]), str(r["t1"])], float(d["srtt"]))
    return [up, rtt]


def registry(collector: PinsCollector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def render(instances: list[str] | None = None) -> str:
    """One scrape in the Prometheus text format."""
    return generate_latest(registry(PinsCollector(instances))).decode()


# ---------------------------------------------------------------- the HTTP server

HEAD_S = 5.0            # a request head must arrive whole within this
HEAD_MAX = 8192         # ... and be at most this long
WRITE_S = 10.0          # an answer must be taken whole within this
MAX_PENDING = 512       # connections waiting for their request head (the oldest goes)
WORKERS = 4             # scrapes rendered at once
QUEUE_MAX = 32          # requests in hand (rendering, waiting to, or being written); more get a 503


class _Quiet(ServerHandler):
    def log_exception(self, exc_info):
        print("mrc-xdp metrics: scrape failed: %s: %s" % (exc_info[0].__name__, exc_info[1]),
              file=sys.stderr, flush=True)


class _Request(WSGIRequestHandler):
    """wsgiref's handler over a request head the server has already read, writing its
    whole answer into memory (self.wfile) for the server's thread to send."""

    def __init__(self, addr, server, head: bytes):
        self.head = head
        super().__init__(None, addr, server)

    def setup(self):
        self.rfile, self.wfile = io.BytesIO(self.head), io.BytesIO()

    def handle(self):
        self.raw_requestline = self.rfile.readline(HEAD_MAX + 1)
        if not self.parse_request():
            return
        h = _Quiet(self.rfile, self.wfile, sys.stderr, self.get_environ(), multithread=True)
        h.request_handler = self
        h.run(self.server.app)

    def finish(self):
        pass                        # the answer stays in self.wfile

    def log_message(self, fmt, *args):
        pass


class Server:
    """GET /metrics over HTTP, answered by prometheus_client's WSGI app; no client can
    stall it.  One thread does all the sockets' I/O, never blocking: an idle connection
    holds no thread, only a socket, and is closed when its request head has not arrived
    whole within HEAD_S (or grows over HEAD_MAX); at most MAX_PENDING connections wait so
    (a new one closes the oldest).  A complete request is rendered by one of WORKERS
    threads into memory, and the answer is sent by the I/O thread as the client takes
    it: a client that has not taken it all within WRITE_S is closed.  Beyond QUEUE_MAX
    requests in hand the answer is 503.  A client gone mid-answer is closed without a
    word."""

    def __init__(self, host: str, port: int, instances: list[str] | None = None):
        fam = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self.sock = socket.create_server((host, port), family=fam, backlog=128)
        self.sock.setblocking(False)
        self.server_port = self.sock.getsockname()[1]
        self.collector = PinsCollector(instances)
        app = make_wsgi_app(registry(self.collector))

        def only_metrics(environ, start_response):
            if environ.get("PATH_INFO") != "/metrics":
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"try /metrics\n"]
            return app(environ, start_response)
        self.app = only_metrics
        self.base_environ = {"SERVER_NAME": host, "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_PORT": str(self.server_port),
                             "REMOTE_HOST": "", "CONTENT_LENGTH": "", "SCRIPT_NAME": ""}
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="mrc-metrics")
        self.in_hand = 0            # the I/O thread's alone
        self.done = queue.SimpleQueue()     # (conn, answer) from the workers
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.stop = threading.Event()

    def _render(self, conn, addr, head: bytes, asked: float) -> None:
        self.collector.asked.at = asked
        try:
            r = _Request(addr, self, head)
            answer = r.wfile.getvalue()
        except Exception as e:      # noqa: BLE001 - one scrape, not the server
            print("mrc-xdp metrics: scrape failed: %s: %s" % (type(e).__name__, e), file=sys.stderr, flush=True)
            answer = b"HTTP/1.0 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
        self.done.put((conn, answer))
        try:
            self._wake_w.send(b"\0")
        except OSError:             # full: the I/O thread is awake already
            pass

    def serve_forever(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        pending: dict = {}          # conn -> [addr, head so far, deadline]; oldest first
        writing: dict = {}          # conn -> [answer left (memoryview), deadline]; oldest first

        def drop(conn, table):
            sel.unregister(conn)
            del table[conn]
            _close(conn)
            if table is writing:
                self.in_hand -= 1
        try:
            while not self.stop.is_set():
                for key, _ in sel.select(0.2):
                    if key.data == "accept":
                        try:
                            conn, addr = self.sock.accept()
                        except BlockingIOError:
                            continue
                        except OSError:         # out of file descriptors: let them go first
                            time.sleep(0.05)
                            continue
                        conn.setblocking(False)
                        if len(pending) >= MAX_PENDING:
                            drop(next(iter(pending)), pending)
                        pending[conn] = [addr, b"", time.monotonic() + HEAD_S]
                        sel.register(conn, selectors.EVENT_READ, "read")
                    elif key.data == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    elif key.data == "read":
                        conn = key.fileobj
                        st = pending[conn]
                        try:
                            data = conn.recv(4096)
                        except BlockingIOError:
                            continue
                        except OSError:
                            data = b""
                        st[1] += data
                        if not data or len(st[1]) > HEAD_MAX:  # gone, or not a scraper
                            drop(conn, pending)
                            continue
                        if b"\r\n\r\n" not in st[1] and b"\n\n" not in st[1]:
                            continue
                        sel.unregister(conn)
                        del pending[conn]
                        if self.in_hand >= QUEUE_MAX:
                            self._send_now(conn, b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
                            continue
                        self.in_hand += 1
                        self.pool.submit(self._render, conn, st[0], st[1], time.monotonic())
                    else:                           # "write"
                        conn = key.fileobj
                        st = writing[conn]
                        try:
                            n = conn.send(st[0])
                        except BlockingIOError:
                            continue
                        except OSError:             # the client went away
                            n = len(st[0])
                        st[0] = st[0][n:]
                        if not st[0]:
                            drop(conn, writing)
                while True:
                    try:
                        conn, answer = self.done.get_nowait()
                    except queue.Empty:
                        break
                    writing[conn] = [memoryview(answer), time.monotonic() + WRITE_S]
                    sel.register(conn, selectors.EVENT_WRITE, "write")
                now = time.monotonic()
                for table in (pending, writing):
                    while table:
                        conn, st = next(iter(table.items()))
                        if st[-1] > now:
                            break
                        drop(conn, table)
        finally:
            for conn in list(pending) + list(writing):
                _close(conn)
            sel.close()
            self.sock.close()
            self.pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _send_now(conn, data: bytes) -> None:
        try:
            conn.send(data)
        except OSError:
            pass
        _close(conn)

    def shutdown(self) -> None:
        self.stop.set()


def _close(conn) -> None:
    try:
        conn.close()
    except OSError:
        pass


def serve(host: str, port: int, max_seconds: float | None = None, instances: list[str] | None = None) -> None:
    srv = Server(host, port, instances)
    if max_seconds:
        t = threading.Timer(max_seconds, srv.shutdown)
        t.daemon = True
        t.start()
    srv.serve_forever()
