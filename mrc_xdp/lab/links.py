"""Link ends by name and the rows of `lab status`: what the netns lab, the VM lab (vm.py)
and the agent functions run on a node share.

Link names: ``<lower>-<upper>`` names both directions of a link (``h0-p0t0s0``,
``p0t0s0-p0t1s1``); ``<from>><to>`` one direction, modelled at the receiving end
(``h0>p0t0s0`` is at p0t0s0's port h0).
"""
from __future__ import annotations

from mrc_xdp.lab import fabric
from mrc_xdp.lab import topology as topomod


class UsageError(fabric.LabError):
    pass


def resolve_ends(topo: topomod.Topology, target: str | None, node_ok: bool = True):
    """Link ends named by a node, a link ("a-b", both directions) or one direction ("a>b").
    None: every end.  Returns [(end name, receiving Port, Link)]."""
    ends = [(name, rx, lk) for name, rx, tx, lk in topo.link_ends()]
    if target is None:
        return ends
    if ">" in target:
        sel = [e for e in ends if e[0] == target]
    elif node_ok and target in topo.nodes:
        sel = [e for e in ends if target in (e[2].a.node, e[2].b.node)]
    else:
        sel = [e for e in ends if e[2].name == target]
        if not sel and "-" in target:       # accept the upper-lower spelling too
            a, _, b = target.partition("-")
            sel = [e for e in ends if e[2].name == "%s-%s" % (b, a)]
    if not sel:
        what = "node or link" if node_ok else "link"
        raise UsageError("no %s %r (nodes: %s; links look like %s or %s; see `mrc-xdp lab status`)"
                         % (what, target, ", ".join(list(topo.nodes)[:6]) + ", ...",
                            topo.links[0].name, topo.links[-1].name))
    return sel


def link_row(name, rx, lk, ifindex, cfg: dict | None, backlog: int | None, counters: dict | None) -> dict:
    """One link end of `lab status`; cfg None: the end is not modelled (a VM without the
    link model, or one that did not answer): settings and counters are None."""
    c = cfg or {}
    row = {"name": name, "link": lk.name, "tier": lk.tier, "plane": lk.plane,
           "from": rx.peer.node, "to": rx.node, "dev": "%s:%s" % (rx.node, rx.ifname),
           "ifindex": ifindex, "modelled": cfg is not None}
    for k, d in (("rate_bps", 0), ("ecn", False), ("trim", False), ("blackhole", False), ("loss_ppm", 0),
                 ("flap_period_ms", 0), ("ecn_bytes", 0), ("trim_bytes", 0), ("drop_bytes", 0)):
        row[k] = c.get(k, d) if cfg is not None else None
    row["backlog"], row["counters"] = backlog, counters
    return row


def node_row(topo: topomod.Topology, name: str, **where) -> dict:
    """One node of `lab status`: what the topology says, plus where it runs (netns or vm,
    exists, ...)."""
    n = topo.nodes[name]
    d = {"name": name, "kind": n.kind}
    d.update(where)
    if n.kind == "host":
        h = topo.host(name)
        d.update(addr=h.addr, t0=h.t0,
                 locators=[topo.host_locator(name, p) for p in range(topo.planes)]
                 if topo.mode == "srv6" else [])
    else:
        d.update(plane=n.plane, index=n.index,
                 usid="%04x" % n.usid() if topo.mode == "srv6" else None)
    return d


def _drained(q: dict, rate_bps: int) -> int:
    """The phantom queue's backlog now (the program drains it lazily, on arrivals)."""
    import time
    if not q:
        return 0
    if not rate_bps:
        return 0
    dt = time.clock_gettime_ns(time.CLOCK_MONOTONIC) - q["last_ns"]
    if dt <= 0:
        return q["backlog"]
    return max(0, q["backlog"] - rate_bps * dt // 8_000_000_000)
