"""`mrc-xdp allreduce-perf`, `allgather-perf`, `reducescatter-perf`, `bcast-perf`: the
nccl-tests tables of mrc_xdp.collective.perf as commands."""
from __future__ import annotations

import argparse
import sys

from mrc_xdp.collective import perf as cperf
from mrc_xdp.collective.perf import COLLECTIVES, DTYPES, OPS, PerfError, run


def parse_size(v: str) -> int:
    try:
        return cperf.parse_size(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parsers(sub) -> None:
    for tool, cls in COLLECTIVES.items():
        p = sub.add_parser(tool, help="%s bandwidth table, as nccl-tests' %s_perf" % (cls.name, cls.name),
                           description=cperf.__doc__.split("\n\n")[1].replace("\n", " "))
        p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("32M"), help="smallest size (32M)")
        p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"), help="largest size (32M)")
        p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between rows (2)")
        p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (20)")
        p.add_argument("-w", "--warmup-iters", type=int, default=5, help="warm-up iterations (5)")
        p.add_argument("-d", "--dtype", choices=DTYPES, default="float32")
        p.add_argument("-o", "--op", choices=OPS, default="sum")
        p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="check the results (1)")
        p.add_argument("--backend", choices=("mrc", "gloo"), default="mrc")
        p.add_argument("--rank", type=int)
        p.add_argument("--world-size", type=int)
        p.add_argument("--master-addr")
        p.add_argument("--master-port", type=int)
        p.add_argument("-i", "--instance", help="datapath instance of this rank (default $MRC_INSTANCE)")
        p.add_argument("--timeout", type=float, default=300, help="collective timeout, seconds (300)")
        p.add_argument("--json", action="store_true")
        p.set_defaults(fn=_cmd, tool=tool)


def _cmd(args) -> None:
    from mrc_xdp.collective.comm import CollectiveError
    try:
        rc = run(args)
    except (PerfError, CollectiveError) as e:
        print("%s: %s" % (args.tool, str(e).splitlines()[0]), file=sys.stderr)
        raise SystemExit(1) from None
    except RuntimeError as e:          # torch.distributed: a store or backend error
        print("%s: %s" % (args.tool, str(e).splitlines()[0]), file=sys.stderr)
        raise SystemExit(1) from None
    if rc:
        raise SystemExit(rc)
