"""`mrc-xdp write-bw`, `write-lat`, `send`, `recv`, `qps`: the perftest-style tools of
mrc_xdp.transport.perf as commands (tables as perftest prints them, or --json)."""
from __future__ import annotations

import json
import sys

from mrc_xdp import transport
from mrc_xdp.transport import bootstrap as bs
from mrc_xdp.transport.perf import (CQ_SPIN_DEFAULT_US, DEFAULT_SIZE, LAT_SPIN_US, PerfError, published_qps,
                                    recv_file, send_file, write_bw_client, write_bw_server, write_lat_client, write_lat_server)

def _fmt_bw(r: dict) -> str:
    line = "-" * 86
    return "\n".join([
        line,
        " %-10s %-8s %-12s %-18s %-20s %-12s" % ("#bytes", "#QPs", "#iterations", "BW peak[Mb/sec]",
                                                 "BW average[Mb/sec]", "MsgRate[Mpps]"),
        " %-10d %-8d %-12d %-18.2f %-20.2f %-12.6f" % (r["bytes"], r["qps"], r["iterations"],
                                                       r["bw_peak_bps"] / 1e6, r["bw_avg_bps"] / 1e6,
                                                       r["msg_rate_mps"]),
        line,
        " payload %d B/packet; sent %d packets, retransmitted %d (timeout %d, SACK %d, NACK trim %d)" % (
            r["payload"], r["qp_stats"]["tx_pkts"], r["qp_stats"]["rtx_pkts"], r["qp_stats"]["rtx_timeout"],
            r["qp_stats"]["rtx_sack"], r["qp_stats"]["rtx_nack_trim"])]
        + ([" engine: " + r["path"]] if r.get("path") else []))


def _fmt_lat(r: dict) -> str:
    line = "-" * 86
    return "\n".join([
        line,
        " %-8s %-12s %-12s %-12s %-12s %-13s %-12s %-12s" % (
            "#bytes", "#iterations", "t_min[usec]", "t_p50[usec]", "t_p99[usec]", "t_p99.9[usec]",
            "t_max[usec]", "t_avg[usec]"),
        " %-8d %-12d %-12.2f %-12.2f %-12.2f %-13.2f %-12.2f %-12.2f" % (
            r["bytes"], r["iterations"], r["t_min_us"], r["p50_us"], r["p99_us"], r["p999_us"], r["t_max_us"],
            r["t_avg_us"]),
        line,
        " one-way latency = half the round trip (as ib_write_lat); round trip p50 %.2f us, p99 %.2f us, "
        "p99.9 %.2f us" % (r["rtt_p50_us"], r["rtt_p99_us"], r["rtt_p999_us"])])


def _emit(args, res, fmt):
    import json
    if args.json:
        print(json.dumps(res, separators=(",", ":")))
    else:
        print(fmt(res))


def _common(p, server_ok=True):
    p.add_argument("-i", "--instance", default="default", help="the loaded datapath instance")
    p.add_argument("--netns", default=None, help="network namespace (default: the instance's)")
    p.add_argument("--port", type=int, default=bs.DEFAULT_PORT, help="bootstrap TCP port (18515)")
    if server_ok:
        p.add_argument("--bind", default="::", help="server: address to listen on (default: all)")
        p.add_argument("--accept-timeout", type=float, default=None, metavar="S",
                       help="server: give up if no client has connected within S seconds "
                            "(default: wait, as perftest's servers do); clients it rejects "
                            "(a bad hello, none within %.0f s) are logged and the wait goes on"
                            % bs.HELLO_TIMEOUT)
    p.add_argument("--mtu", type=int, default=None, help="payload bytes per packet (default: the largest mrc0 allows)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds without progress (data or a message from the peer) before giving up")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")


def _ns_of(args):
    if args.netns is not None:
        return args.netns
    from mrc_xdp.datapath.maps import Instance
    with Instance(args.instance) as inst:
        return inst.state.get("netns")


def cmd_write_bw(args):
    ns = _ns_of(args)
    if args.iters is not None and args.duration is not None:
        raise PerfError("give --iters or --duration, not both")
    if args.peer:
        res = write_bw_client(args.peer, args.instance, ns, size=args.size, iters=args.iters,
                              duration=args.duration, qps=args.qps, port=args.port, tx_depth=args.tx_depth,
                              mtu=args.mtu, progress=not args.json or sys.stderr.isatty(), timeout=args.timeout,
                              spin_us=args.spin_us, ce_ack=CE_ACK[args.ce_ack])
    else:
        res = write_bw_server(args.instance, ns, port=args.port, bind=args.bind, mtu=args.mtu,
                              accept_timeout=args.accept_timeout, timeout=args.timeout, spin_us=args.spin_us,
                              ce_ack=CE_ACK[args.ce_ack])
    _emit(args, res, _fmt_bw)


def cmd_write_lat(args):
    ns = _ns_of(args)
    if args.peer:
        res = write_lat_client(args.peer, args.instance, ns, size=args.size, iters=args.iters,
                               port=args.port, mtu=args.mtu, timeout=args.timeout, spin_us=args.spin_us,
                               cq_spin_us=args.cq_spin_us)
    else:
        res = write_lat_server(args.instance, ns, port=args.port, bind=args.bind, mtu=args.mtu,
                               accept_timeout=args.accept_timeout, timeout=args.timeout, spin_us=args.spin_us,
                               cq_spin_us=args.cq_spin_us)
    _emit(args, res, _fmt_lat)


def cmd_send(args):
    res = send_file(args.file, args.peer, args.instance, _ns_of(args), port=args.port, mtu=args.mtu,
                    progress=not args.json, timeout=args.timeout)
    _emit(args, res, lambda r: "sent %s: %d bytes in %.3f s (%.1f Mbit/s), sha256 %s, receiver's copy "
          "intact (%s); retransmitted %d packets" % (r["file"], r["bytes"], r["seconds"], r["goodput_bps"] / 1e6,
                                                     r["sha256"], r["saved_as"], r["qp_stats"]["rtx_pkts"]))


def cmd_recv(args):
    res = recv_file(args.dir, args.instance, _ns_of(args), port=args.port, bind=args.bind, mtu=args.mtu,
                    accept_timeout=args.accept_timeout, timeout=args.timeout, overwrite=args.overwrite)
    _emit(args, res, lambda r: "received %s: %d bytes, sha256 %s, matches the sender's" % (
        r["file"], r["bytes"], r["sha256"]))


def cmd_qps(args):
    rows = published_qps(args.instance)
    if args.json:
        print(json.dumps(rows))
        return
    if not rows:
        print("no QPs: no perf session (write-bw, write-lat, send, recv) is running%s" % (
            " on instance %s" % args.instance if args.instance else ""))
        return
    print("%-12s %-7s %-16s %-8s %-5s %10s %12s %8s %8s %8s %8s %9s %10s" % (
        "instance", "pid", "cmd", "qpn", "state", "tx_pkts", "tx_bytes", "rtx", "rtx_sack", "rtx_rto",
        "rtx_trim", "ecn_sacks", "cwnd"))
    for r in rows:
        print("%-12s %-7d %-16s %#-8x %-5s %10d %12d %8d %8d %8d %8d %9d %10d" % (
            r["instance"], r["pid"], r["cmd"], r["qpn"], r.get("state_name", "?"), r["tx_pkts"], r["tx_bytes"],
            r["rtx_pkts"], r["rtx_sack"], r["rtx_timeout"], r["rtx_nack_trim"], r["sacks_rx_ecn"], r["cwnd"]))


CE_ACK = {"coalesced": 1, "each": 2}     # --ce-ack: the engine's ce_ack option


def _guard(fn):
    def run(args):
        from mrc_xdp.datapath.maps import NotLoaded
        from mrc_xdp.transport.conns import ConnError
        t = transport
        try:
            return fn(args)
        except (PerfError, bs.BootstrapError, t.TransportError, ConnError, NotLoaded) as e:
            print("mrc-xdp %s: %s" % (args.cmd, e), file=sys.stderr)
            raise SystemExit(1)
    return run


def add_parsers(sub) -> None:
    """Register write-bw, write-lat, send and recv on the CLI's subparsers."""
    p = sub.add_parser("write-bw", help="RDMA Write bandwidth (ib_write_bw style): server without PEER, client with it")
    p.add_argument("peer", nargs="?", metavar="PEER", help="the server's control address (client)")
    p.add_argument("-s", "--size", type=int, default=DEFAULT_SIZE, help="bytes per write (65536)")
    p.add_argument("-n", "--iters", type=int, default=None, help="writes to post (default 5000, 1000 above 64 KiB)")
    p.add_argument("-D", "--duration", type=float, default=None, help="run for S seconds instead of --iters")
    p.add_argument("-q", "--qps", type=int, default=1, help="QPs (writes spread round robin)")
    p.add_argument("-t", "--tx-depth", type=int, default=None, help="outstanding writes per QP")
    p.add_argument("--spin-us", type=int, default=None, metavar="US",
                   help="this side's engine: spin up to US microseconds after work before sleeping "
                        "(adaptive below it; default: the engine's, %d; 0: off)" % transport.endpoint.SPIN_DEFAULT_US)
    p.add_argument("--ce-ack", choices=sorted(CE_ACK), default="coalesced",
                   help="how this side SACKs data that arrives CE-marked: coalesced with the rest, the SACK "
                        "echoing the newest marked packet's EV (default), or each: a SACK of its own per "
                        "marked packet (the policy before 0.3, for comparison)")
    _common(p)
    p.set_defaults(fn=_guard(cmd_write_bw))

    p = sub.add_parser("write-lat", help="RDMA Write latency (ib_write_lat style): t_min, p50, p99, p99.9, t_max")
    p.add_argument("peer", nargs="?", metavar="PEER", help="the server's control address (client)")
    p.add_argument("-s", "--size", type=int, default=8, help="bytes per write (8)")
    p.add_argument("-n", "--iters", type=int, default=1000, help="round trips (1000)")
    p.add_argument("--spin-us", type=int, default=LAT_SPIN_US, metavar="US",
                   help="this side's engine: spin up to US microseconds after work before sleeping "
                        "(adaptive below it; default %d, where the engine's own is off; 0: off)" % LAT_SPIN_US)
    p.add_argument("--cq-spin-us", type=int, default=CQ_SPIN_DEFAULT_US, metavar="US",
                   help="this side's caller: spin up to US microseconds for each completion before "
                        "sleeping on the CQ's eventfd (default %d; 0: off)" % CQ_SPIN_DEFAULT_US)
    _common(p)
    p.set_defaults(fn=_guard(cmd_write_lat))

    p = sub.add_parser("send", help="RDMA-Write a file to a `recv` peer; both sides check its sha256")
    p.add_argument("file", metavar="FILE")
    p.add_argument("peer", metavar="PEER", help="the receiver's control address")
    _common(p, server_ok=False)
    p.set_defaults(fn=_guard(cmd_send))

    p = sub.add_parser("qps", help="per-QP engine counters of the running perf sessions (any process)")
    p.add_argument("-i", "--instance", default=None, help="only this instance")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_guard(cmd_qps))

    p = sub.add_parser("recv", help="receive one file from `send` into DIR, verified by sha256")
    p.add_argument("dir", metavar="DIR", help="where the file goes: under a temporary name (.mrc-recv.*), "
                   "its space reserved first, renamed to the sender's name once its sha256 matches")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a file of the sender's name in DIR (a symlink itself, never its target; "
                        "default: refuse the sender)")
    _common(p)
    p.set_defaults(fn=_guard(cmd_recv))
