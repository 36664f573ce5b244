"""`mrc-xdp demo` (and `demo --train`): the lab's two guided scenarios."""
from __future__ import annotations

from mrc_xdp.cli.common import CliError


def cmd_demo(args):
    if args.train:
        from mrc_xdp.lab import train_demo
        from mrc_xdp.lab.fabric import LabError
        try:
            train_demo.run(args)
        except LabError as e:
            raise CliError(str(e)) from None
        return
    from mrc_xdp.lab import demo
    demo.run(args)


def add_parsers(sub) -> None:
    sp = sub.add_parser("demo", help="bring up the lab, spray traffic, fail a T1, show MRC routing around it")
    sp.add_argument("--mode", choices=["srv6", "ecmp"], default="srv6")
    sp.add_argument("--packets", type=int, default=20000, help="packets per phase")
    sp.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    sp.add_argument("--train", action="store_true",
                    help="instead: a PyTorch DDP job (examples/train_ddp.py) over the \"mrc\" backend on all "
                    "four hosts while a T1 switch fails (make train-demo)")
    sp.add_argument("--steps", type=int, default=150, help="training steps with --train (150)")
    sp.set_defaults(fn=cmd_demo)
