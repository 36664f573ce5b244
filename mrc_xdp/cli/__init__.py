"""mrc-xdp: load the MRC datapath onto a host, inspect live per-EV state, run the lab.

The CLI is the only package that knows argparse; it is a thin layer over the library
packages, one module per command group:

- ``datapath``: load, unload, status, ev, plane, stats, events, version
- ``observe``: metrics, top
- ``transport``: write-bw, write-lat, send, recv, qps
- ``collective``: allreduce-perf, allgather-perf, reducescatter-perf, bcast-perf
- ``health``: daemon, fabric check
- ``lab``: lab up / down / status / exec / launch / link / fail / heal / vm / inventory ...; ``demo``
- ``fleet``: fleet inventory, fleet prometheus-config

Every command has --json where a script may want it.  Errors are one line on stderr,
exit status 1 (2 for usage).  Library errors are turned into that line here (``main``).
"""
from __future__ import annotations

import argparse
import sys

from mrc_xdp.cli.common import CliError  # noqa: F401 - where callers have always found it

EPILOG = """\
examples:
  mrc-xdp load --config host.toml            load the datapath described in host.toml
  mrc-xdp stats --watch                      live counters and per-EV rates, every second
  mrc-xdp ev list --state ASSUMED_BAD        EVs the datapath has retired
  mrc-xdp ev deny 0x3d3ec531                 take one path out of service
  mrc-xdp unload                             detach everything, remove pins
  mrc-xdp demo                               the whole story on a lab fabric, in a minute
"""


# the command group (cli module) of each top-level command: `mrc-xdp status` imports the
# datapath group only, not the transport, collective and lab libraries (numpy among them).
# Under QEMU TCG that is most of a CLI start: `version --json` took 12 s in a lab guest with
# every group imported.  tests/test_layout.py checks this table against the full parser.
GROUPS = {
    "datapath": ("load", "unload", "status", "ev", "plane", "stats", "events", "version"),
    "observe": ("metrics", "top"),
    "demo": ("demo",),
    "transport": ("write-bw", "write-lat", "send", "qps", "recv"),
    "collective": ("allreduce-perf", "allgather-perf", "reducescatter-perf", "bcast-perf"),
    "health": ("daemon", "fabric"),
    "lab": ("lab",),
    "fleet": ("fleet",),
}


def _group_of(argv) -> str | None:
    """The group of the command argv names (its first word), None for anything else
    (no command, an option first, an unknown word: the full parser says what is wrong)."""
    if not argv or argv[0].startswith("-"):
        return None
    return next((g for g, cmds in GROUPS.items() if argv[0] in cmds), None)


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The CLI's parser: every command group, or only the group of the command argv
    names (the same parser for that command, with fewer imports)."""
    p = argparse.ArgumentParser(
        prog="mrc-xdp", description="MRC (Multipath Reliable Connection) on Linux hosts with XDP: "
        "load the multipath datapath, watch per-path (per-EV) health, run the lab fabric.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    import importlib
    only = _group_of(argv)
    for g in GROUPS:
        if only in (None, g):
            m = importlib.import_module("mrc_xdp.cli." + g)
            (m.add_parsers if hasattr(m, "add_parsers") else m.add_parser)(sub)
    return p


def main(argv=None) -> int:
    p = build_parser(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if not getattr(args, "fn", None):
        p.print_help()
        return 2
    from mrc_xdp.datapath.config import ConfigError
    from mrc_xdp.datapath.loader import LoadError
    from mrc_xdp.datapath.maps import NotLoaded
    from mrc_xdp.datapath.bpfsys import BpfError
    from mrc_xdp.datapath.netns import NetnsError
    try:
        args.fn(args)
    except (CliError, ConfigError, LoadError, NotLoaded) as e:
        print("mrc-xdp: %s" % e, file=sys.stderr)
        return 1
    except NetnsError as e:
        print("mrc-xdp: %s" % (e.strerror or e), file=sys.stderr)
        return 1
    except BpfError as e:
        hint = " (needs root)" if e.errno in (1, 13) else ""
        print("mrc-xdp: %s%s" % (e.strerror if e.strerror else e, hint), file=sys.stderr)
        return 1
    except PermissionError as e:
        print("mrc-xdp: %s: permission denied (needs root)" % (e.filename or e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
