"""Where a lab node's set-up runs: a network namespace here, or a VM over SSH.

The lab code (fabric.py, hosts.py) configures a node through one of these executors,
whatever the node is:

- ``NetnsNode(ns)``: the node is network namespace ``ns`` of this machine (the netns lab);
- ``SshNode(name, argv)``: the node is a VM reached with ``argv + [command]`` (plain QEMU
  with a forwarded port, or Vagrant's ssh-config); the guest image carries this checkout
  at /opt/mrc-xdp with its own .venv (vagrant/build-image.sh runs scripts/setup.sh in it).

Both offer the same operations: ``sysctls(pairs)``, ``ip_batch(lines)`` (iproute2 batch),
``run(argv)`` and ``call(fn, **kwargs)``, which runs one of the functions of ``AGENT``
below *on the node*: in-process for a namespace, and for a VM through
``python -m mrc_xdp.lab.executor`` in the guest with the arguments as JSON on stdin and
the result as JSON on stdout.  The functions themselves are the lab's own (fabric.py,
hosts.py): nothing is reimplemented for the VMs.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys

GUEST_ROOT = "/opt/mrc-xdp"
GUEST_PY = GUEST_ROOT + "/.venv/bin/python"


class ExecError(RuntimeError):
    """A command on a node failed; str() is one line."""


def _last_line(text: str, rc: int) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "exit status %d" % rc


class NetnsNode:
    """A lab node that is a network namespace of this machine."""

    kind = "netns"

    def __init__(self, name: str, ns: str):
        self.name, self.ns = name, ns

    @property
    def netns_name(self) -> str:
        return self.ns

    def sysctls(self, pairs) -> None:
        from .. import netns
        with netns.enter(self.ns):
            for k, v in pairs:
                with open("/proc/sys/" + k.replace(".", "/"), "w") as f:
                    f.write(str(v))

    def ip_batch(self, lines, timeout: float = 60) -> None:
        if not lines:
            return
        p = subprocess.run(["ip", "-n", self.ns, "-batch", "-"], input="\n".join(lines) + "\n",
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
        if p.returncode:
            raise ExecError("%s: ip -batch failed: %s" % (self.name, _last_line(p.stderr, p.returncode)))

    def run(self, argv, input: str | None = None, timeout: float = 60, check: bool = True):
        from .. import netns
        p = netns.run_cmd(self.ns, argv, check=False, timeout=timeout, input=input)
        if check and p.returncode:
            raise ExecError("%s: %s failed: %s" % (self.name, argv[0], _last_line(p.stderr, p.returncode)))
        return p

    def call(self, fn: str, timeout: float = 600, **kwargs):
        """The agent function, run on the node: in its namespace (interface names,
        sockets), as a VM runs it."""
        from .. import netns
        if fn not in AGENT:
            raise ExecError("unknown agent function %r" % fn)
        with netns.enter(self.ns):
            return AGENT[fn](**kwargs)


class SshNode:
    """A lab node that is a VM; ``argv`` runs a shell command on it as root."""

    kind = "vm"
    netns_name = None

    def __init__(self, name: str, argv: list[str]):
        self.name, self.argv = name, list(argv)

    def _ssh(self, command: str, input: str | None, timeout: float):
        try:
            return subprocess.run(self.argv + [command], input=input, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ExecError("%s: `%s` did not finish in %d s" % (self.name, command[:60], timeout)) from None

    def sysctls(self, pairs) -> None:
        if pairs:
            self.run(["sysctl", "-q", "-w"] + ["%s=%s" % (k, v) for k, v in pairs])

    def ip_batch(self, lines, timeout: float = 120) -> None:
        if not lines:
            return
        p = self._ssh("ip -batch -", "\n".join(lines) + "\n", timeout)
        if p.returncode:
            raise ExecError("%s: ip -batch failed: %s" % (self.name, _last_line(p.stderr, p.returncode)))

    def run(self, argv, input: str | None = None, timeout: float = 120, check: bool = True):
        p = self._ssh(" ".join(shlex.quote(a) for a in argv), input, timeout)
        if check and p.returncode:
            raise ExecError("%s: %s failed: %s" % (self.name, argv[0], _last_line(p.stderr, p.returncode)))
        return p

    def call(self, fn: str, timeout: float = 900, **kwargs):
        if fn not in AGENT:
            raise ExecError("unknown agent function %r" % fn)
        p = self._ssh("cd %s && %s -m mrc_xdp.lab.executor %s" % (GUEST_ROOT, GUEST_PY, fn),
                      json.dumps(kwargs), timeout)
        out = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        res = json.loads(out[-1]) if out else None
        if p.returncode or not isinstance(res, dict) or "error" in (res or {}):
            why = (res or {}).get("error") or _last_line(p.stderr, p.returncode)
            raise ExecError("%s: %s: %s" % (self.name, fn, why))
        return res.get("result")


# ---------------------------------------------------------------- agent (runs on the node)
def _ifname_by_mac() -> dict:
    out = {}
    for d in os.listdir("/sys/class/net"):
        try:
            with open("/sys/class/net/%s/address" % d) as f:
                out[f.read().strip().lower()] = d
        except OSError:
            pass
    return out


def _ifindex(name: str) -> int:
    """The interface's index in the caller's network namespace (not /sys/class/net: a
    thread that entered a namespace still sees the sysfs mounted for another)."""
    import socket
    try:
        return socket.if_nametoindex(name)
    except OSError:
        raise FileNotFoundError("no such interface: %s" % name) from None


def wire_vm(ports: list, veth: dict | None, sysctls: list) -> dict:
    """VM wiring (what veth creation is to the netns lab): the lab NICs, found by the MAC
    the VM was given for them, get the topology's names and MTU; a host gets its
    mrc0/mrc0p veth pair.  sysctls first, so new interfaces get no link-local address."""
    import subprocess as sp
    lines = []
    for k, v in sysctls:
        with open("/proc/sys/" + k.replace(".", "/"), "w") as f:
            f.write(str(v))
    macs = _ifname_by_mac()
    for p in ports:
        cur = macs.get(p["mac"].lower())
        if cur is None:
            raise RuntimeError("no NIC with MAC %s for %s (NICs: %s)"
                               % (p["mac"], p["ifname"], ", ".join(sorted(macs.values()))))
        for key in ("addr_gen_mode", "accept_dad", "accept_ra", "router_solicitations"):
            with open("/proc/sys/net/ipv6/conf/%s/%s" % (cur, key), "w") as f:
                f.write("1" if key == "addr_gen_mode" else "0")
        lines.append("link set dev %s down" % cur)
        if cur != p["ifname"]:
            lines.append("link set dev %s name %s" % (cur, p["ifname"]))
        lines.append("link set dev %s mtu %d" % (p["ifname"], p["mtu"]))
    if veth:
        lines.append("link add %s address %s mtu %d type veth peer name %s address %s mtu %d"
                     % (veth["app"], veth["app_mac"], veth["mtu"], veth["fab"], veth["fab_mac"], veth["mtu"]))
    r = sp.run(["ip", "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError("ip: %s" % _last_line(r.stderr, r.returncode))
    return {p["ifname"]: _ifindex(p["ifname"]) for p in ports}


def vm_datapaths(topo: dict, prefix: str, node: str, pin_dir: str, hosts: bool = True,
                 linkmodel: bool = True) -> dict:
    """On a VM: the link model on the node's receiving link ends (this VM's own copy,
    pinned at pin_dir) and, on a host, its datapath chained behind it: fabric.py's and
    hosts.py's functions, with this VM's ifindexes.  linkmodel=False: the datapath's own
    ingress directly on the plane NICs (each bcc build is ~1-4 min in a TCG guest)."""
    import time
    from . import fabric, linkmodel as lmod
    from .topology import from_dict
    t = from_dict(topo)
    out = {}
    lm = None
    if linkmodel:
        t0 = time.monotonic()
        lmod.ensure_bpffs()
        lm = lmod.LinkModel.load()
        lm.pin(pin_dir)
        fabric.attach_linkmodel(lm, fabric.linkmodel_ends(t, node), ifindex_of=_ifindex)
        out["linkmodel_s"] = round(time.monotonic() - t0, 1)
    if hosts and t.nodes[node].kind == "host":
        from . import hosts as hmod
        cfg = hmod.host_configs(t, prefix)[node]
        out["host"] = hmod.load_host(t, prefix, node, cfg, lm, netns_name=None, ifindex_of=_ifindex)
    if lm is not None:
        lm.close()
    return out


def vm_unload(instances: list, pin_dir: str, ifnames: list) -> dict:
    """On a VM: unload host datapaths, detach the link model, remove its pins."""
    import shutil
    from .. import loader
    from . import linkmodel as lmod
    for inst in instances:
        try:
            loader.unload(inst, quiet_missing=True)
        except Exception:
            pass
    for n in ifnames:
        try:
            lmod.xdp_detach(_ifindex(n))
        except Exception:
            pass
    shutil.rmtree(pin_dir, ignore_errors=True)
    return {"ok": True}


def counters(instance: str) -> dict:
    """A host datapath's counters, EV table (with plane and state) and received EVs."""
    from ..maps import Instance
    with Instance(instance) as inst:
        return {"counters": inst.counters(), "evs": inst.ev_table(), "rx_evs": inst.rx_evs()}


def link_counters(pin_dir: str, ifnames: list) -> dict:
    """The link model's counters at this node's receiving ends, by interface name."""
    from . import linkmodel as lmod
    with lmod.LinkModel.open(pin_dir) as lm:
        return {n: lm.counters(_ifindex(n)) for n in ifnames}


def link_status(pin_dir: str, ifnames: list) -> dict:
    """`lab status` at this node's receiving ends, by interface name: the guest's ifindex,
    the link model's settings, its phantom queue's backlog now (this VM's clock) and its
    counters; an end with no link model entry gives None."""
    from . import linkmodel as lmod
    from .cli import _drained
    out = {}
    with lmod.LinkModel.open(pin_dir) as lm:
        for n in ifnames:
            i = _ifindex(n)
            cfg = lm.get(i)
            out[n] = None if cfg is None else {
                "ifindex": i, "cfg": cfg, "backlog": _drained(lm.state(i) or {}, cfg.get("rate_bps", 0)),
                "counters": lm.counters(i)}
    return out


def datapath_config(instance: str, changes: dict) -> dict:
    """On a host: change run-time fields of the datapath's mrc_config (e.g. loss_thresh);
    returns their previous values (to restore them)."""
    from ..maps import Instance
    with Instance(instance) as inst:
        return inst.update_config(**changes)


def link_update(pin_dir: str, ifnames: list, changes: dict) -> dict:
    """On a VM: `lab link set` / `fail` / `heal` at this node's receiving ends: the link
    model's LinkModel.update (the netns lab's call), by interface name."""
    from . import linkmodel as lmod
    with lmod.LinkModel.open(pin_dir) as lm:
        return {n: lm.update(_ifindex(n), **changes) for n in ifnames}


def traffic_receive(local: str, peer: str, local_qpn: int, peer_qpn: int, expect: int,
                    seconds: float, ready: str = "", stop: str = "") -> dict:
    """On a host: answer data from `peer` on mrc0 with SACKs (traffic.Receiver) until
    `expect` frames came, file `stop` exists or `seconds` passed; touches `ready` once
    listening."""
    import time
    from ..traffic import Receiver
    rx = Receiver("mrc0", local, {(peer, local_qpn): peer_qpn}, max_seconds=seconds + 10).start()
    try:
        if ready:
            open(ready, "w").close()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and rx.frames < expect and not (stop and os.path.exists(stop)):
            time.sleep(0.1)
        time.sleep(1.0)             # SACKs of the last frames on their way
    finally:
        rx.stop()
        for f in (ready, stop):
            if f:
                with contextlib.suppress(OSError):
                    os.unlink(f)
    return dict(rx.stats(), sacks=rx.sacks, nacks=rx.nacks, frames=rx.frames)


def traffic_send(local: str, peer: str, dqpn: int, count: int, pps: float, payload: int = 256,
                 psn: int = 0) -> dict:
    """On a host: `count` data frames to `peer` written into mrc0 (the datapath sprays)."""
    from ..traffic import Sender
    tx = Sender("mrc0", local, peer, dqpn, payload=payload)
    try:
        tx.psn = psn
        n = tx.send(count, pps=pps, deadline_s=count / pps * 3 + 30)
    finally:
        tx.close()
    return {"sent": n, "next_psn": tx.psn}


AGENT = {"traffic_receive": traffic_receive, "traffic_send": traffic_send, "wire_vm": wire_vm, "vm_datapaths": vm_datapaths, "vm_unload": vm_unload,
         "counters": counters, "link_counters": link_counters, "link_update": link_update,
         "link_status": link_status,
         "datapath_config": datapath_config}


def main(argv=None) -> int:
    """python -m mrc_xdp.lab.executor FN  (JSON kwargs on stdin, JSON result on stdout)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in AGENT:
        print(json.dumps({"error": "usage: executor FN (one of %s)" % ", ".join(AGENT)}))
        return 2
    try:
        kwargs = json.loads(sys.stdin.read() or "{}")
        res = AGENT[argv[0]](**kwargs)
    except Exception as e:  # reported to the caller as one line
        print(json.dumps({"error": "%s: %s" % (type(e).__name__, e)}))
        return 1
    print(json.dumps({"result": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
