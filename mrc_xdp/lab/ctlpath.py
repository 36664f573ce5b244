"""The lab's control path: TCP between lab hosts (the bootstrap of QP attributes, torch's
store, gloo, MPTCP) routed over the fabric, one control address per host and plane.

In the lab, TCP between hosts runs over the fabric: our XDP programs pass non-MRC frames
unchanged, and the link models treat them like any frame.  The lab's switches only route
host MRC addresses (ecmp) or uSIDs (srv6), so ``lab_control_path`` gives every host
addresses of its own, routed by every switch (`mrc-xdp lab up` calls it).
"""
from __future__ import annotations

import ipaddress
import subprocess

from mrc_xdp.datapath import netns
from mrc_xdp.lab import fabric

CTL_SUBNET = 0xff00     # <base>:ff0<plane>::<host number + 1>


def ctl_addr(topo, plane: int, host: str) -> str:
    base = int(topo.base.network_address)
    return str(ipaddress.IPv6Address(base | (CTL_SUBNET + plane) << 80 | (topo.host(host).index + 1)))


def lab_control_path(prefix: str, topo=None, execs=None) -> dict:
    """Give every lab host one control address per plane NIC, C(p, h), routed over the
    fabric (idempotent).  Every plane's switches route every control address (T0s hash
    over their T1s by L4 ports), so the plane a packet takes is chosen by its sender:
    a host sends to C(p, g) over plane p, and whatever it sends from its own C(p, h) over
    plane p too (policy rule ``from C(p, h) lookup 100+p``), which lets MPTCP put one
    subflow on each plane.  execs: {node: executor} of a VM lab (mrc_xdp.lab.vm, the same
    lines over SSH); None: the netns lab `prefix`.  Returns {host: [C(0, h), C(1, h), ...]}."""
    if topo is None:
        topo = fabric.topology_of(fabric.load_state(prefix))
    P = range(topo.planes)
    cmds: dict[str, list[str]] = {}
    for h in topo.hosts:
        c = cmds.setdefault(h.name, [])
        for p in P:
            gw = topo.port(h.name, "p%d" % p).peer.addr
            me = ctl_addr(topo, p, h.name)
            c.append("address replace %s/128 dev p%d nodad" % (me, p))
            c.append("rule del from %s/128 lookup %d" % (me, 100 + p))
            c.append("rule add from %s/128 lookup %d pref %d" % (me, 100 + p, 1000 + p))
            for g in topo.hosts:
                if g.name == h.name:
                    continue
                c.append("route replace %s/128 via %s dev p%d src %s"
                         % (ctl_addr(topo, p, g.name), gw, p, me))
                for q in P:
                    c.append("route replace %s/128 via %s dev p%d table %d"
                             % (ctl_addr(topo, q, g.name), gw, p, 100 + p))
    for name, n in topo.nodes.items():
        if n.kind == "host":
            continue
        c = cmds.setdefault(name, [])
        by_peer = {pt.peer.node: pt for pt in n.ports}
        for h in topo.hosts:
            for q in P:
                a = ctl_addr(topo, q, h.name)
                if n.kind == "t0" and h.t0 == n.index:
                    pt = by_peer[h.name]
                    c.append("route replace %s/128 via %s dev %s" % (a, pt.peer.addr, pt.ifname))
                elif n.kind == "t0":
                    hops = " ".join("nexthop via %s dev %s" % (by_peer[topo.t1_name(n.plane, j)].peer.addr,
                                                               by_peer[topo.t1_name(n.plane, j)].ifname)
                                    for j in range(topo.t1_per_plane))
                    c.append("route replace %s/128 %s" % (a, hops))
                else:
                    pt = by_peer[topo.t0_name(n.plane, h.t0)]
                    c.append("route replace %s/128 via %s dev %s" % (a, pt.peer.addr, pt.ifname))
    for node, lines in cmds.items():
        if execs is not None:
            r = execs[node].run(["ip", "-6", "-force", "-batch", "-"], input="\n".join(lines) + "\n", check=False)
        else:
            r = subprocess.run(["nsenter", "--net=/run/netns/" + prefix + node, "ip", "-6", "-force",
                                "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True)
        errs = [l for l in r.stderr.splitlines() if l.strip() and "No such file" not in l
                and "Command failed" not in l]
        if errs:
            raise fabric.LabError("lab control path: %s: %s" % (node, errs[-1]))
    # the T0s hash TCP flows over the T1s by L4 ports, as they hash MRC EVs
    for n in topo.nodes.values():
        if n.kind == "t0" and execs is not None:
            execs[n.name].sysctls([("net.ipv6.fib_multipath_hash_policy", "1")])
        elif n.kind == "t0":
            netns.run(prefix + n.name, _sysctl, "net.ipv6.fib_multipath_hash_policy", "1")
    return {h.name: [ctl_addr(topo, p, h.name) for p in P] for h in topo.hosts}


def _sysctl(key: str, value: str) -> None:
    with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
        f.write(value)
