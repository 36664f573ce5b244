"""`mrc-xdp demo --train` (`make train-demo`): a PyTorch DDP job over MRC on the lab while
a T1 switch fails under it.

The lab comes up, examples/train_ddp.py runs on all four hosts with the "mrc" backend
(one rank per host, `mrc_xdp.lab.launch`), and when a third of its steps are done T1
switch p0t1s1 fails (every link end into and out of it blackholed in the link model) for
a few seconds; training goes on over the paths that are left.  The demo prints rank 0's
progress, then every step's time around the failure, and takes the lab down.
"""
from __future__ import annotations

import io
import json
import os
import sys
import threading
import time

from mrc_xdp.lab import fabric, hosts, launch, topology
from mrc_xdp.lab import linkmodel as lmod

PREFIX = "mrctrain-"
FAIL = "p0t1s1"
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "train_ddp.py")


def _p(msg: str = "") -> None:
    print(msg, flush=True)


class _Tee(io.TextIOBase):
    """Rank output: shown as it comes, rank 0's step lines watched for the fault."""

    def __init__(self, on_step):
        self.on_step, self.lines = on_step, []

    def write(self, s: str) -> int:
        for line in s.splitlines():
            self.lines.append(line)
            if line.startswith("[rank 0]") and not line.startswith("[rank 0] {"):
                _p("      " + line)
            elif "Traceback" in line or "Error" in line or line.startswith("launch:"):
                _p("      " + line)
            if line.startswith("[rank 0] step"):
                try:
                    self.on_step(int(line.split()[3]))
                except (IndexError, ValueError):
                    pass
        return len(s)


def run(args) -> None:
    mode = getattr(args, "mode", "srv6")
    steps = max(30, getattr(args, "steps", 150))
    hold = float(getattr(args, "fail_seconds", 4.0))
    if not os.path.exists(EXAMPLE):
        raise fabric.LabError("demo --train: %s is missing (run it from the repository checkout)" % EXAMPLE)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise fabric.LabError("demo --train needs PyTorch: run `make setup` (it installs torch==2.13.0)") from None
    topo = topology.load(mode=mode)
    if fabric.running(PREFIX):
        _p("[setup] a previous training demo lab is still up: taking it down first")
        fabric.down(PREFIX, unload_hosts=hosts.unload_all)
    _p("[1/4] building the lab (%s mode), the MRC datapath on every host" % mode)
    t0 = time.monotonic()
    st = fabric.up(topo, prefix=PREFIX, progress=lambda m: _p("      " + m), hosts_hook=hosts.fabric_hook)
    topo = fabric.topology_of(st)
    from mrc_xdp.lab import ctlpath
    ctlpath.lab_control_path(PREFIX, topo)
    _p("      lab up in %.1f s" % (time.monotonic() - t0))
    fault = {}
    rc, tee = 1, _Tee(lambda step: None)
    try:
        with lmod.LinkModel.open(st["pin_dir"]) as lm:
            ends = [rx.ifindex for name, rx, tx, lk in topo.link_ends() if FAIL in (lk.a.node, lk.b.node)]
            saved = {i: lm.get(i) for i in ends}

            def heal():
                if "healed_at" not in fault:
                    for i, c in saved.items():
                        lm.update(i, blackhole=bool(c.get("blackhole")))
                    fault["healed_at"] = time.monotonic()

            def on_step(step):
                if "failed_at" not in fault and step >= steps // 3:
                    for i in ends:
                        lm.update(i, blackhole=True)
                    fault["failed_at"], fault["step"] = time.monotonic(), step
                    _p("      >>> T1 switch %s (plane 0) fails now, after step %d; healed in %.0f s"
                       % (FAIL, step, hold))
                    threading.Timer(hold, heal).start()

            tee = _Tee(on_step)
            _p("\n[2/4] examples/train_ddp.py on h0..h3 over the \"mrc\" backend (DDP, %d steps)" % steps)
            try:
                rc = launch.launch(PREFIX, [sys.executable, EXAMPLE, "--backend", "mrc", "--steps", str(steps),
                                            "--log-every", "10", "--json"], timeout=900, out=tee)
            finally:
                time.sleep(0.1)
                heal()
    except BaseException:
        fabric.down(PREFIX, unload_hosts=hosts.unload_all)
        raise
    try:
        if rc != 0:
            _p("\n      the job FAILED (exit status %d)" % rc)
            raise SystemExit(1)
        doc = json.loads([l for l in tee.lines if l.startswith("[rank 0] {")][-1][len("[rank 0] "):])
        times = doc["step_times"]
        k = fault.get("step", len(times) // 3)
        _p("\n[3/4] training went on through the failure: step times around it (rank 0)")
        lo, hi = max(0, k - 5), min(len(times), k + 15)
        base = sorted(times[:k])[len(times[:k]) // 2] if k else times[0]
        for i in range(lo, hi):
            mark = "  <- T1 fails" if i == k else ""
            _p("      step %4d  %7.1f ms  %s%s" % (i + 1, 1e3 * times[i], "#" * min(60, int(20 * times[i] / base)), mark))
        slow = max(times[k:k + 50]) if k < len(times) else 0
        _p("      median step before the failure %.1f ms; slowest step after it %.1f ms; %.1f samples/s overall; "
           "final loss %.3f" % (1e3 * base, 1e3 * slow, doc["samples_per_s"], doc["loss"]))
    finally:
        t0 = time.monotonic()
        if getattr(args, "keep", False):
            _p("\n[4/4] leaving the lab up (--keep): `mrc-xdp lab down --prefix %s`" % PREFIX)
        else:
            fabric.down(PREFIX, unload_hosts=hosts.unload_all)
            _p("\n[4/4] lab torn down in %.1f s" % (time.monotonic() - t0))
