"""Run a distributed job on the lab: one process per host, in the host's namespace, with
the environment torchrun gives a rank.

    launch(prefix, ["python", "train.py"], hosts=["h0", "h1", "h2", "h3"], timeout=600)

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GROUP_RANK,
MASTER_ADDR (h0's control address on plane 0: the lab's TCP control path), MASTER_PORT
MRC_INSTANCE (its host's datapath instance, which the "mrc" torch backend and the
collective library open) and MRC_CTL_ADDR (its own control address on plane 0, which is also its host name:
TCP transports such as gloo bind to it).  Every line a rank prints is shown with its rank in front.
When a rank fails the others are stopped (SIGTERM, then SIGKILL), as torchrun does; on
Ctrl-C or after `timeout` seconds every rank is stopped.  Returns the job's exit status:
0 when every rank exited 0, else the first failure's status (124 on timeout, 130 on
Ctrl-C).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from mrc_xdp.lab import fabric

GRACE_S = 5.0

# Each rank runs as its host would: in the host's network namespace and a UTS namespace
# whose host name is the host's control address, so software that binds to what its
# host name resolves to (gloo does; a lab namespace's loopback is its own) uses the
# control path across the fabric.
_AS_HOST = ("import os, socket, sys; socket.sethostname(os.environ['MRC_CTL_ADDR']); "
            "os.execvp(sys.argv[1], sys.argv[1:])")


class LaunchError(fabric.LabError):
    pass


def rank_env(prefix: str, topo, hosts: list[str], rank: int, port: int) -> dict:
    from mrc_xdp.lab import ctlpath
    return {"RANK": str(rank), "WORLD_SIZE": str(len(hosts)), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "ROLE_RANK": str(rank),
            "MASTER_ADDR": ctlpath.ctl_addr(topo, 0, hosts[0]), "MASTER_PORT": str(port),
            "MRC_INSTANCE": prefix + hosts[rank],
            "MRC_CTL_ADDR": ctlpath.ctl_addr(topo, 0, hosts[rank])}


def launch(prefix: str, cmd: list[str], hosts: list[str] | None = None, timeout: float | None = None,
           port: int = 29500, out=None) -> int:
    if not cmd:
        raise LaunchError("launch: no command (put it after --)")
    out = out or sys.stdout
    st = fabric.load_state(prefix)
    topo = fabric.topology_of(st)
    names = [h.name for h in topo.hosts]
    hosts = hosts or names
    bad = [h for h in hosts if h not in names]
    if bad:
        raise LaunchError("launch: no host %s in lab %r (hosts: %s)" % (", ".join(bad), prefix, ", ".join(names)))
    if len(set(hosts)) != len(hosts):
        raise LaunchError("launch: a host is named twice: %s" % ",".join(hosts))
    procs = []
    lock = threading.Lock()

    def pump(rank: int, stream) -> None:
        for line in stream:
            with lock:
                out.write("[rank %d] %s" % (rank, line if line.endswith("\n") else line + "\n"))
                out.flush()

    pumps = []
    try:
        for rank, h in enumerate(hosts):
            env = dict(os.environ, **rank_env(prefix, topo, hosts, rank, port))
            ns = "/run/netns/" + st["nodes"][h]
            try:
                p = subprocess.Popen(["nsenter", "--net=" + ns, "--", "unshare", "--uts", "--",
                                      sys.executable, "-c", _AS_HOST] + list(cmd), env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", start_new_session=True)
            except OSError as e:
                raise LaunchError("launch: nsenter: %s" % e.strerror) from None
            procs.append(p)
            t = threading.Thread(target=pump, args=(rank, p.stdout), daemon=True)
            t.start()
            pumps.append(t)
        return _watch(procs, timeout, out, lock)
    except KeyboardInterrupt:
        with lock:
            out.write("launch: interrupted: stopping every rank\n")
        _stop(procs)
        return 130
    finally:
        _stop(procs)
        for t in pumps:
            t.join(2)


def _watch(procs, timeout, out, lock) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    first_fail = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and first_fail is None:
            first_fail = failed[0]
            with lock:
                out.write("launch: rank %d exited with status %d: stopping the others\n" % first_fail)
            _stop(procs)
            break
        if deadline is not None and time.monotonic() > deadline:
            with lock:
                out.write("launch: timeout after %.0f s: stopping every rank\n" % timeout)
            _stop(procs)
            return 124
        time.sleep(0.1)
    codes = [p.wait() for p in procs]
    with lock:
        out.write("launch: exit status by rank: %s\n" % " ".join("%d:%d" % rc for rc in enumerate(codes)))
    if first_fail is not None:
        return first_fail[1] if first_fail[1] > 0 else 1
    bad = [c for c in codes if c != 0]
    return (bad[0] if bad[0] > 0 else 1) if bad else 0


def _stop(procs) -> None:
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
