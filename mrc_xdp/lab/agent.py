"""Functions a lab node runs for the lab's set-up and tests, whatever the node is.

``call(node, fn, **kwargs)`` runs one of ``AGENT`` *on the node* (an executor of
mrc_xdp.lab.executor): in-process inside the namespace for a netns node, and for a VM
through ``python -m mrc_xdp.lab.agent FN`` in the guest, with the arguments as JSON on
stdin and the result as JSON on stdout.  The functions are the lab's own (fabric.py,
hosts.py, linkmodel.py): nothing is reimplemented for the VMs.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

from mrc_xdp.lab.executor import ExecError, _last_line


def call(node, fn: str, /, timeout: float = 900, **kwargs):
    """Run agent function ``fn`` on ``node`` (NetnsNode or SshNode); its result.  node
    and fn are positional only: agent functions take arguments of those names (e.g.
    vm_datapaths(node=...))."""
    if fn not in AGENT:
        raise ExecError("unknown agent function %r" % fn)
    if node.kind == "vm":
        return node.run_module("mrc_xdp.lab.agent", fn, kwargs, timeout)
    from mrc_xdp.datapath import netns
    with netns.enter(node.netns_name):
        return AGENT[fn](**kwargs)


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
    from mrc_xdp.lab import fabric, linkmodel as lmod
    from mrc_xdp.lab.topology import from_dict
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
        from mrc_xdp.lab import hosts as hmod
        cfg = hmod.host_configs(t, prefix)[node]
        out["host"] = hmod.load_host(t, prefix, node, cfg, lm, netns_name=None, ifindex_of=_ifindex)
    if lm is not None:
        lm.close()
    return out


def vm_unload(instances: list, pin_dir: str, ifnames: list) -> dict:
    """On a VM: unload host datapaths, detach the link model, remove its pins."""
    import shutil
    from mrc_xdp.datapath import loader
    from mrc_xdp.lab import linkmodel as lmod
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
    from mrc_xdp.datapath.maps import Instance
    with Instance(instance) as inst:
        return {"counters": inst.counters(), "evs": inst.ev_table(), "rx_evs": inst.rx_evs()}


def link_counters(pin_dir: str, ifnames: list) -> dict:
    """The link model's counters at this node's receiving ends, by interface name."""
    from mrc_xdp.lab import linkmodel as lmod
    with lmod.LinkModel.open(pin_dir) as lm:
        return {n: lm.counters(_ifindex(n)) for n in ifnames}


def link_status(pin_dir: str, ifnames: list) -> dict:
    """`lab status` at this node's receiving ends, by interface name: the guest's ifindex,
    the link model's settings, its phantom queue's backlog now (this VM's clock) and its
    counters; an end with no link model entry gives None."""
    from mrc_xdp.lab import linkmodel as lmod
    from mrc_xdp.lab.links import _drained
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
    from mrc_xdp.datapath.maps import Instance
    with Instance(instance) as inst:
        return inst.update_config(**changes)


def link_update(pin_dir: str, ifnames: list, changes: dict) -> dict:
    """On a VM: `lab link set` / `fail` / `heal` at this node's receiving ends: the link
    model's LinkModel.update (the netns lab's call), by interface name."""
    from mrc_xdp.lab import linkmodel as lmod
    with lmod.LinkModel.open(pin_dir) as lm:
        return {n: lm.update(_ifindex(n), **changes) for n in ifnames}


def traffic_receive(local: str, peer: str, local_qpn: int, peer_qpn: int, expect: int,
                    seconds: float, ready: str = "", stop: str = "") -> dict:
    """On a host: answer data from `peer` on mrc0 with SACKs (traffic.Receiver) until
    `expect` frames came, file `stop` exists or `seconds` passed; touches `ready` once
    listening."""
    import time
    from mrc_xdp.lab.traffic import Receiver
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
    from mrc_xdp.lab.traffic import Sender
    tx = Sender("mrc0", local, peer, dqpn, payload=payload)
    try:
        tx.psn = psn
        n = tx.send(count, pps=pps, deadline_s=count / pps * 3 + 30)
    finally:
        tx.close()
    return {"sent": n, "next_psn": tx.psn}


def bpf_cache_get() -> dict:
    """On a node: its BPF build cache's entries ({file name: text}, bpfcache.entries)."""
    from mrc_xdp.datapath import bpfcache
    return bpfcache.entries()


def bpf_cache_put(entries: dict) -> list:
    """On a node: these build cache entries added to its cache (those that check out)."""
    from mrc_xdp.datapath import bpfcache
    return bpfcache.import_entries(entries)


AGENT = {"bpf_cache_get": bpf_cache_get, "bpf_cache_put": bpf_cache_put,
         "traffic_receive": traffic_receive, "traffic_send": traffic_send, "wire_vm": wire_vm, "vm_datapaths": vm_datapaths, "vm_unload": vm_unload,
         "counters": counters, "link_counters": link_counters, "link_update": link_update,
         "link_status": link_status,
         "datapath_config": datapath_config}


def main(argv=None) -> int:
    """python -m mrc_xdp.lab.agent FN  (JSON kwargs on stdin, JSON result on stdout)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in AGENT:
        print(json.dumps({"error": "usage: agent FN (one of %s)" % ", ".join(AGENT)}))
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
