"""`mrc-xdp metrics` and `mrc-xdp top`: the observation commands (mrc_xdp.observe)."""
from __future__ import annotations

import sys

from mrc_xdp.cli.common import CliError, _seconds
from mrc_xdp.observe.top import run as run_top


def cmd_metrics(args):
    try:
        from mrc_xdp.observe import metrics
    except ImportError as e:
        raise CliError("metrics needs the prometheus_client module (%s): run `make setup` "
                       "(Debian package python3-prometheus-client)" % e) from None
    from mrc_xdp.datapath import maps
    _seconds("--seconds", args.seconds, "the time to serve")
    names = None if args.instance is None else [args.instance]
    if names is not None:
        maps.Instance(args.instance).close()        # NotLoaded: one line
    if args.once:
        if names is None and not maps.instances():
            raise CliError("nothing loaded (run `mrc-xdp load --config FILE`)")
        sys.stdout.write(metrics.render(names))
        return
    host, _, port = args.listen.rpartition(":")
    try:
        port_n = int(port)
    except ValueError:
        raise CliError("--listen %r: expected HOST:PORT, e.g. 127.0.0.1:9417" % args.listen) from None
    if not 0 < port_n <= 65535:
        raise CliError("--listen %r: the port must be 1-65535" % args.listen)
    host = host.strip("[]") or "127.0.0.1"
    print("serving Prometheus metrics on http://%s:%d/metrics (Ctrl-C to stop)" % (host, port_n),
          file=sys.stderr, flush=True)
    try:
        metrics.serve(host, port_n, args.seconds, names)
    except OSError as e:
        raise CliError("--listen %s: %s" % (args.listen, e.strerror or e)) from None


def add_parsers(sub) -> None:
    sp = sub.add_parser("metrics", help="Prometheus metrics of every loaded instance (HTTP or --once)",
                        description="Serve GET /metrics in Prometheus text format, read live from the pinned "
                        "maps of every loaded instance: counters by name, per-EV packets, feedback and state.")
    sp.add_argument("--listen", default="127.0.0.1:9417", help="HOST:PORT to serve on (default 127.0.0.1:9417)")
    sp.add_argument("--once", action="store_true", help="print one scrape to stdout and exit")
    sp.add_argument("--instance", "-i", help="only this instance (default every loaded one)")
    sp.add_argument("--seconds", type=float, help="stop serving after this long")
    sp.set_defaults(fn=cmd_metrics)
    add_top_parser(sub)


def cmd_top(args) -> None:
    if not (0.05 <= args.interval <= 3600):
        raise CliError("--interval %g: must be between 0.05 and 3600 seconds" % args.interval)
    try:
        import rich  # noqa: F401
    except ImportError:
        raise CliError("top needs the rich module: run `make setup` (Debian package python3-rich)") from None
    run_top(args.instance, args.interval, args.once)


def add_top_parser(sub) -> None:
    sp = sub.add_parser("top", help="live view: per-EV state, rate and probe RTT, plane balance, events",
                        description="A live terminal view of one instance. Keys: s sort, c filter by connection, "
                        "j/k (arrows) move, d deny / a allow the EV under the cursor, q quit.")
    sp.add_argument("--instance", "-i", default="default")
    sp.add_argument("--interval", type=float, default=1.0, help="refresh period in seconds (default 1)")
    sp.add_argument("--once", action="store_true", help="print one frame and exit (also when stdin is not a tty)")
    sp.set_defaults(fn=cmd_top)
