"""What every command group of the CLI shares: its error, output and argument helpers."""
from __future__ import annotations

import json
import math


class CliError(Exception):
    pass


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("mrc-xdp")
    except Exception:  # noqa: BLE001 - not installed (run from a checkout)
        return "0.1.0+checkout"


def _out(args, obj, text_fn):
    if getattr(args, "json", False):
        print(json.dumps(obj, indent=1, default=str))
    else:
        text_fn(obj)


def table(rows: list[dict], cols: list[str], headers: list[str] | None = None, fmt=None) -> str:
    fmt = fmt or {}
    headers = headers or cols
    cells = [[fmt.get(c, str)(r.get(c, "")) for c in cols] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for row in cells:
        lines.append("  ".join(v.rjust(w) if v[:1].isdigit() else v.ljust(w)
                               for v, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _hex(v):
    return "%#010x" % v


MAX_SECONDS = 86400.0


def _seconds(opt: str, v, what: str):
    """A command-line duration: finite, > 0 and at most a day (inf, nan, <= 0: one line)."""
    if v is not None and not (math.isfinite(v) and 0 < v <= MAX_SECONDS):
        raise CliError("%s %g: %s must be a number of seconds > 0 and at most %d"
                       % (opt, v, what, MAX_SECONDS))
    return v




def add_instance(sp) -> None:
    sp.add_argument("--instance", "-i", default="default",
                    help="datapath instance name (pins under /sys/fs/bpf/mrc/NAME; default: default)")


def add_json(sp) -> None:
    sp.add_argument("--json", action="store_true", help="machine-readable output")
