"""Prometheus text exposition of every loaded instance, read live from the pins.

`mrc-xdp metrics --listen 127.0.0.1:9417` serves GET /metrics; `--once` prints one
scrape and exits.  Names:

    mrc_counter_total{instance,counter}                 every enum mrc_ctr counter
    mrc_ev_packets_total{instance,conn,ev,plane,t1,role} per-EV packets sent
    mrc_ev_feedback_total{...,kind}                      sack / nack / ecn / trim / loss / skipped
    mrc_ev_state{...,state}                              1 for the EV's current state
    mrc_plane_in_rotation{instance,plane,dev}            0 while the plane is out of rotation
                                                         (its NIC down, health daemon), else 1
    mrc_qp_<counter>_total, mrc_qp_<gauge>{instance,qpn,pid}  transport engine per-QP
                                                         counters of every open Endpoint
    mrc_rx_ev_packets_total{instance,conn,ev}            data received, per sender EV
    mrc_rx_ev_ce_total{instance,conn,ev}                 of which CE-marked

conn is the connection's name everywhere ("unknown": data of no known connection).
Each metric's samples follow its own HELP and TYPE lines, as the exposition format asks.
"""
from __future__ import annotations

import http.server
import socketserver

from . import maps

FEEDBACK = ("sack", "nack", "ecn", "trim", "loss", "skipped")


def _labels(**kv) -> str:
    return "{" + ",".join('%s="%s"' % (k, str(v).replace('"', '\\"')) for k, v in kv.items()) + "}"


QP_COUNTERS = ("tx_pkts", "tx_bytes", "rtx_pkts", "rtx_timeout", "rtx_sack", "rtx_nack_trim", "timeouts",
               "sacks_rx", "sacks_rx_ecn", "nacks_rx_trim", "nacks_rx_other", "wr_posted", "wr_done",
               "wr_error", "rx_pkts", "rx_bytes", "rx_dup", "rx_msgs", "rx_ce", "sacks_tx", "nacks_tx_trim",
               "nacks_tx_access")
QP_GAUGES = ("state", "srtt_ns", "min_rtt_ns", "rto_ns", "cwnd", "inflight")


def _qp_lines(instances) -> list[str]:
    """mrc_qp_<counter>_total / mrc_qp_<gauge> of every QP of every open transport
    Endpoint (published by each endpoint under /run/mrc-xdp/qps/), labels instance, qpn, pid."""
    from .transport import published_qps
    rows = [q for name in instances for q in published_qps(name)]
    out = []
    for k in QP_COUNTERS:
        out += ["# HELP mrc_qp_%s_total Transport engine per-QP counter %s." % (k, k),
                "# TYPE mrc_qp_%s_total counter" % k]
        out += ["mrc_qp_%s_total%s %d" % (k, _labels(instance=q["instance"], qpn="%#x" % q["qpn"], pid=q["pid"]),
                                         q.get(k, 0)) for q in rows]
    for k in QP_GAUGES:
        out += ["# HELP mrc_qp_%s Transport engine per-QP %s." % (k, k), "# TYPE mrc_qp_%s gauge" % k]
        out += ["mrc_qp_%s%s %d" % (k, _labels(instance=q["instance"], qpn="%#x" % q["qpn"], pid=q["pid"]),
                                   q.get(k, 0)) for q in rows]
    return out


def render(instances: list[str] | None = None) -> str:
    out = [
        "# HELP mrc_counter_total MRC datapath counters (enum mrc_ctr), summed over CPUs.",
        "# TYPE mrc_counter_total counter",
    ]
    ev_lines, fb_lines, st_lines, rx_lines, ce_lines, pl_lines = [], [], [], [], [], []
    for name in instances if instances is not None else maps.instances():
        with maps.Instance(name) as inst:
            for k, v in inst.counters().items():
                out.append("mrc_counter_total%s %d" % (_labels(instance=name, counter=k), v))
            for p, down in enumerate(inst.planes_down()):
                dev = inst.state["planes"][p].get("dev", "")
                pl_lines.append("mrc_plane_in_rotation%s %d" % (_labels(instance=name, plane=p, dev=dev), not down))
            for r in inst.ev_table():
                base = dict(instance=name, conn=r["conn_name"], ev="%#010x" % r["ev"],
                            plane=r["plane"], t1=r["t1"], role=r["role"])
                ev_lines.append("mrc_ev_packets_total%s %d" % (_labels(**base), r["tx_pkts"]))
                for kind in FEEDBACK:
                    fb_lines.append("mrc_ev_feedback_total%s %d" % (_labels(**base, kind=kind), r[kind]))
                st_lines.append("mrc_ev_state%s 1" % _labels(**base, state=r["state"]))
            for r in inst.rx_evs():
                lab = dict(instance=name, conn=r["conn_name"], ev="%#010x" % r["ev"])
                rx_lines.append("mrc_rx_ev_packets_total%s %d" % (_labels(**lab), r["pkts"]))
                ce_lines.append("mrc_rx_ev_ce_total%s %d" % (_labels(**lab), r["ce"]))
    out += ["# HELP mrc_ev_packets_total Packets sprayed on each EV (path).",
            "# TYPE mrc_ev_packets_total counter"] + ev_lines
    out += ["# HELP mrc_ev_feedback_total Feedback attributed to each EV, by kind.",
            "# TYPE mrc_ev_feedback_total counter"] + fb_lines
    out += ["# HELP mrc_ev_state Current state of each EV (1 for the state it is in).",
            "# TYPE mrc_ev_state gauge"] + st_lines
    out += ["# HELP mrc_plane_in_rotation 1 while spray uses the plane, 0 while it is out of rotation "
            "(its NIC down, or taken out by the operator).", "# TYPE mrc_plane_in_rotation gauge"] + pl_lines
    out += _qp_lines(instances if instances is not None else maps.instances())
    out += ["# HELP mrc_rx_ev_packets_total Data packets received, per sender EV.",
            "# TYPE mrc_rx_ev_packets_total counter"] + rx_lines
    out += ["# HELP mrc_rx_ev_ce_total Data packets received CE-marked, per sender EV.",
            "# TYPE mrc_rx_ev_ce_total counter"] + ce_lines
    return "\n".join(out) + "\n"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404, "try /metrics")
            return
        try:
            body = render().encode()
            code = 200
        except Exception as e:  # noqa: BLE001 - a scrape must answer, not kill the server
            body = ("# scrape failed: %s\n" % e).encode()
            code = 500
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(host: str, port: int, max_seconds: float | None = None) -> None:
    with Server((host, port), _Handler) as srv:
        if max_seconds:
            import threading
            threading.Timer(max_seconds, srv.shutdown).start()
        srv.serve_forever(poll_interval=0.2)
