"""`mrc-xdp daemon` and `mrc-xdp fabric check`: path health (mrc_xdp.health) as commands;
`events_from_daemon` serves `mrc-xdp events` through a running daemon."""
from __future__ import annotations

import json
import os
import socket
import sys
import time

from mrc_xdp.cli.common import CliError
from mrc_xdp.health.daemon import (DEFAULT_SOCKET, SOCKET_ENV, Daemon, HealthConfig, HealthError, connect,
                                   format_event, status)
from mrc_xdp.health.fabriccheck import FabricCheckError, check, format_text
from mrc_xdp.lab.ops import lab_model_for


def events_from_daemon(args) -> bool:
    """`mrc-xdp events` through a running daemon that follows args.instance: its history
    (every stored event of the instance), then with --follow the live events.  False when
    no daemon serves that instance (the caller then reads the ring itself)."""
    st = status()
    if st is None or args.instance not in st.get("instances", {}):
        return False
    s = connect()
    if s is None:
        return False
    end = time.monotonic() + args.seconds if args.follow and args.seconds else None
    try:
        s.sendall((json.dumps({"op": "events", "instance": args.instance,
                               "follow": bool(args.follow)}) + "\n").encode())
        s.settimeout(0.25)
        buf = b""
        while True:
            if end and time.monotonic() > end:
                break
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                break               # no --follow: history sent; or the daemon stopped
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                d = json.loads(line)
                print(json.dumps(d) if args.json else format_event(d), flush=True)
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError):
        pass
    finally:
        s.close()
    return True


def cmd_daemon(args) -> None:
    try:
        cfg = HealthConfig.from_toml(args.config) if args.config else HealthConfig()
        if args.socket:
            cfg.socket = args.socket
        if args.instance:
            cfg.instances = args.instance
        if os.geteuid() != 0:
            raise HealthError("the daemon reads and writes pinned BPF maps: run it as root")
        d = Daemon(cfg, prober=None if args.no_probe else "auto")
        import faulthandler
        import signal
        # a crash in native code (libbpf, cffi, the kernel's answers) leaves every
        # thread's Python stack in the daemon's log (its stderr), not only a dmesg line
        faulthandler.enable(all_threads=True)
        signal.signal(signal.SIGTERM, lambda *a: d.stop.set())
        d.run(args.seconds)
    except HealthError as e:
        raise CliError(str(e)) from None


def add_parsers(sub) -> None:
    sp = sub.add_parser("daemon", help="path health daemon: probe and resurrect EVs, follow plane links, serve events",
                        description="Run in the foreground for every datapath instance on the host: probe "
                        "ASSUMED_BAD EVs and return them to GOOD after N answered probes, background-probe GOOD "
                        "EVs (RTT per EV), take a plane's EVs out of rotation while its NIC is down, and be the "
                        "single consumer of the event rings, republishing to `mrc-xdp events`/`top` over a unix "
                        "socket. Config: TOML, see contrib/daemon.toml.")
    sp.add_argument("--config", "-c", help="TOML config (default: built-in defaults)")
    sp.add_argument("--socket", help="unix socket to serve events on (default %s or $%s)" % (DEFAULT_SOCKET, SOCKET_ENV))
    sp.add_argument("--instance", "-i", action="append",
                    help="follow only this instance (a glob; repeatable; default every one)")
    sp.add_argument("--no-probe", action="store_true", help="do not probe (links and events only)")
    sp.add_argument("--seconds", type=float, help="stop after this long (default: until Ctrl-C / SIGTERM)")
    sp.set_defaults(fn=cmd_daemon)

    add_fabric_parser(sub)


def cmd_check(args) -> None:
    if not 1 <= args.count <= 1000:
        raise CliError("--count %d: must be 1..1000" % args.count)
    if not 0.001 <= args.timeout <= 10:
        raise CliError("--timeout %g: must be 0.001..10 seconds" % args.timeout)
    say = (lambda m: print("fabric check: " + m, file=sys.stderr)) if not args.json else (lambda m: None)
    try:
        r = check(args.instance or None, count=args.count, timeout=args.timeout, progress=say,
                  model_for=lab_model_for)
    except FabricCheckError as e:
        raise CliError(str(e)) from None
    print(json.dumps(r, indent=1) if args.json else format_text(r))


def add_fabric_parser(sub) -> None:
    sp = sub.add_parser("fabric", help="fabric diagnostics: `fabric check` localises bad links and switches")
    fs = sp.add_subparsers(dest="fabric_cmd", metavar="ACTION", required=True)
    c = fs.add_parser("check", help="probe every path to each peer and name suspect links/switches",
                      description="Probe every EV (plane, T1 path) of every connection of the instances on this "
                      "machine (default: all) and name the links and switches that explain the lost probes, "
                      "with a confidence.")
    c.add_argument("--instance", "-i", action="append", help="probe from this instance (repeatable; default all)")
    c.add_argument("--count", type=int, default=8, help="probes per EV (default 8)")
    c.add_argument("--timeout", type=float, default=0.05, help="seconds to wait for a probe's answer (default 0.05)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(fn=cmd_check)
